"""Mamba (arch 'mamba'): the scan against its recurrence, the generation state against the full
forward, padding, config validation, accounting, and logit parity with transformers' MambaForCausalLM
(its pure-torch path) in both directions."""

from __future__ import annotations

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from models import ModelConfig, build_model
from models.accounting import flops_per_token, kv_cache_bytes_per_token, param_counts
from models.export import load_hf, load_safetensors, save_hf, save_safetensors
from models.families.mamba.model import MambaLM, _SelectiveScan, selective_scan
from models.generate import generate


def mamba_cfg(**kw) -> ModelConfig:
    base = dict(arch="mamba", pos_encoding="none", vocab_size=64, d_model=32, n_layers=2, max_seq_len=64,
                ssm_state_size=8)
    base.update(kw)
    return ModelConfig(**base)


def random_mamba(seed: int = 0, **kw) -> MambaLM:
    """An initialised model whose A_log, D, biases and norms are moved off their initial values, so that
    parity tests see every tensor at work."""
    model = build_model(mamba_cfg(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "bias", "norm.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def reference_scan(x, delta, A, B, C, h):
    """The recurrence itself, one token at a time."""
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("chunk", [1, 3, 32, 128])
def test_scan_equals_recurrence(chunk):
    g = torch.Generator().manual_seed(0)
    B, T, E, N = 2, 45, 6, 4
    x, Bm, C = (torch.randn(B, T, s, generator=g) for s in (E, N, N))
    delta = torch.rand(B, T, E, generator=g) * 2
    A = -torch.rand(E, N, generator=g) * 5
    h0 = torch.randn(B, E, N, generator=g)
    y, h = selective_scan(x, delta, A, Bm, C, h0, chunk=chunk)
    y_ref, h_ref = reference_scan(x, delta, A, Bm, C, h0)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


def test_stepwise_state_equals_full_forward():
    model = random_mamba()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        state = model.new_kv_cache(2)
        parts = [model(ids[:, :9], kv_cache=state).logits]  # a prompt through the scan, then token by token
        for t in range(9, 40):
            parts.append(model(ids[:, t:t + 1], kv_cache=state).logits)
    assert state.length == 40
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    # The state's size is fixed: the same tensors after 40 tokens as after none.
    assert state.conv_LBEK.shape == (2, 2, 64, 3) and state.ssm_LBEN.shape == (2, 2, 64, 8)


def test_left_padding_leaves_real_tokens_unchanged():
    model = random_mamba()
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    with torch.no_grad():
        plain = model(ids).logits
        left = model(padded, attention_mask_BT=mask).logits[:, 5:]
    torch.testing.assert_close(left, plain, atol=1e-6, rtol=1e-6)


def test_greedy_generation_equals_full_recompute():
    model = random_mamba()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    out = generate(model, prompt, max_new_tokens=8, temperature=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def test_training_step_lowers_the_loss_and_reaches_every_parameter():
    torch.manual_seed(0)
    model = build_model(mamba_cfg())
    ids = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_bf16_autocast_and_bf16_weights_train_and_generate():
    """The scan stays fp32 under autocast (its backward once met bf16 einsums there) and with bf16 weights."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 17))
    model = build_model(mamba_cfg())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    bf16 = build_model(mamba_cfg()).to(torch.bfloat16).eval()
    assert generate(bf16, ids[:, :4], 5, temperature=0).shape == (2, 9)


def test_param_counts_equal_the_built_model():
    for kw in (dict(), dict(bias=True, tie_embeddings=True, ssm_dt_rank=5, ssm_expand=3, ssm_conv_kernel=2)):
        cfg = mamba_cfg(**kw)
        model = build_model(cfg, device="meta")
        unique = {id(p): p.numel() for p in model.parameters()}
        assert param_counts(cfg)["total"] == sum(unique.values())
    # d 32, E 64, N 8, R 2, K 4, V 64, 2 layers: 6 * (non-embedding + V D) + 3 * 9 * L E N.
    cfg = mamba_cfg()
    n = param_counts(cfg)["non_embedding"] + 64 * 32
    assert param_counts(cfg)["non_embedding"] == 2 * (32 + 32 * 128 + 64 * 4 + 64 + 64 * 18 + 2 * 64 + 64 + 64 * 8 + 64 + 64 * 32) + 32
    assert flops_per_token(cfg, 64) == {"total": 6 * n + 27 * 2 * 64 * 8, "forward": 2 * n + 9 * 2 * 64 * 8}
    assert flops_per_token(cfg, 64) == flops_per_token(cfg, 4096)  # no term grows with the length
    assert kv_cache_bytes_per_token(cfg) == 0  # the generation state does not grow per token


@pytest.mark.parametrize("kw, field", [
    (dict(pos_encoding="rope"), "pos_encoding"),
    (dict(attention="mla"), "attention"),
    (dict(norm="layernorm"), "norm"),
    (dict(norm_position="post"), "norm_position"),
    (dict(num_experts=4), "num_experts"),
    (dict(ssm_state_size=0), "ssm_state_size"),
    (dict(ssm_dt_rank=0), "ssm_dt_rank"),
    (dict(arch="rnn"), "arch"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        mamba_cfg(**kw)


def test_return_attention_is_refused():
    with pytest.raises(ValueError, match="no attention"):
        random_mamba()(torch.zeros(1, 3, dtype=torch.long), return_attention=True)


def test_own_format_round_trip(tmp_path):
    model = random_mamba(tie_embeddings=True)
    save_safetensors(model, model.cfg, tmp_path / "m.safetensors")
    back = load_safetensors(tmp_path / "m.safetensors").eval()
    assert isinstance(back, MambaLM) and back.cfg == model.cfg
    x = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(back(x).logits, model(x).logits, atol=0, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(bias=True, tie_embeddings=True, ssm_dt_rank=3, norm_eps=1e-6)],
                         ids=["untied", "bias_tied"])
def test_hf_export_logits_equal_ours(tmp_path, kw):
    model = random_mamba(**kw)
    save_hf(model, model.cfg, tmp_path)
    hf = MambaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x, use_cache=False).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    back = load_hf(tmp_path).eval()
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(x).logits, ours, atol=0, rtol=0)


def test_hf_import_logits_equal_theirs(tmp_path):
    torch.manual_seed(5)
    hf_cfg = MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                         conv_kernel=4, max_position_embeddings=64, tie_word_embeddings=False)
    hf = MambaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", ".D", "bias", "norm.weight", "norm_f.weight")):
                p.add_(0.3 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.arch == "mamba" and ours.cfg.max_seq_len == 64 and not ours.cfg.tie_embeddings
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x, use_cache=False).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_scan_gradients_equal_autograd_through_the_recurrence(chunk):
    """The hand-written backward against autograd of `reference_scan`, in float64, every input
    (h0 and the final state's gradient included)."""
    g = torch.Generator().manual_seed(1)
    B, T, E, N = 2, 19, 3, 4
    x, Bm, C = (torch.randn(B, T, s, generator=g, dtype=torch.float64) for s in (E, N, N))
    delta = torch.rand(B, T, E, generator=g, dtype=torch.float64) * 2
    A = -torch.rand(E, N, generator=g, dtype=torch.float64) * 3
    h0 = torch.randn(B, E, N, generator=g, dtype=torch.float64)
    dy, dh = torch.randn(B, T, E, generator=g, dtype=torch.float64), torch.randn(B, E, N, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda *a: _SelectiveScan.apply(*a, chunk), reference_scan):
        inputs = [t.clone().requires_grad_() for t in (x, delta, A, Bm, C, h0)]
        y, h = fn(*inputs)
        torch.autograd.backward([y, h], [dy, dh])
        grads.append([t.grad for t in inputs])
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)

"""Hybrid attention + Mamba-2 models: cached generation against the full forward (the KV cache and the SSM
state together, through padding and row moves), transformers' GraniteMoeHybridForCausalLM both ways, the
patterns it cannot express refused at export yet trained and served from safetensors, the pattern's
checks, and the accounting (parameters, FLOPs, KV-cache and state bytes) by hand, Mamba-2's too."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from models import build_model
from models.accounting import flops_per_token, kv_cache_bytes_per_token, param_counts, state_bytes_per_sequence
from models.export import load_hf, load_safetensors, save_hf, save_safetensors
from models.families.hybrid.model import HybridState
from models.generate import generate


def _random(**kw):
    torch.manual_seed(0)
    model = build_model("debug_hybrid", vocab_size=64, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("kw", [dict(), dict(hybrid_layers="AMMA", attention="mla", num_experts=4, moe_every=2)],
                         ids=["dense", "mla_moe"])
def test_cached_generation_equals_the_full_forward(kw):
    model = _random(ssm_n_groups=2, **kw)
    x = torch.randint(0, 64, (2, 23))
    with torch.no_grad():
        full = model(x).logits
        state = model.new_kv_cache(2)
        assert isinstance(state, HybridState) and len(state.k_BGSK) == 2 and state.ssm.ssm_LBEN.shape[0] == 2
        first = model(x[:, :9], kv_cache=state).logits  # a prompt, then one token at a time
        steps = [model(x[:, t:t + 1], kv_cache=state).logits for t in range(9, 23)]
    torch.testing.assert_close(torch.cat([first, *steps], 1), full, atol=1e-5, rtol=1e-5)
    other = build_model(model.cfg.replace(ssm_chunk_size=5))  # the chunk size is a speed setting
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.eval()(x).logits, full, atol=1e-5, rtol=1e-5)


def test_a_left_padded_row_and_moved_rows_continue_as_alone():
    model = _random()
    a, b = torch.randint(0, 64, (1, 11)), torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        alone = [model(torch.cat([r, torch.tensor([[5, 7]])], 1)).logits[:, -2:] for r in (a, b)]
        ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        state = model.new_kv_cache(2)
        model(ids, attention_mask_BT=mask, kv_cache=state)
        # the rows swap places and gain a free row (what the serving engine's rebuild does), then decode
        moved = HybridState.gather_rows([(state, torch.tensor([1, 0]))], max_len=40, free_rows=1)
        outs = [model(torch.tensor([[t], [t], [0]]), attention_mask_BT=torch.tensor([[1], [1], [0]]),
                      kv_cache=moved).logits for t in (5, 7)]
    for row, ref in ((1, alone[0]), (0, alone[1])):
        got = torch.cat([outs[0][row, -1:], outs[1][row, -1:]])
        torch.testing.assert_close(got, ref[0, :], atol=1e-5, rtol=1e-5)
    # put_row places a row's keys and its SSM state in another batch's free row
    target = model.new_kv_cache(2, max_len=40)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 12)), kv_cache=target)
        target.put_row(1, state, 0)
        got = model(torch.tensor([[3], [5]]), kv_cache=target).logits[1, -1]
    torch.testing.assert_close(got, alone[0][0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(num_kv_heads=2, ssm_n_groups=2),
                                dict(pos_encoding="none", tie_embeddings=True, hybrid_layers="AMMM"),
                                dict(rope_scaling=2.0, rope_scaling_type="yarn", rope_original_max_seq_len=64)],
                         ids=["gqa_groups", "nope_tied", "yarn"])
def test_export_and_import_equal_granite_moe_hybrid(tmp_path, kw):
    model = _random(**kw)
    save_hf(model, model.cfg, tmp_path)
    hf = GraniteMoeHybridForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["full_attention" if k == "A" else "linear_attention"
                                     for k in model.cfg.hybrid_layers]
    x = torch.randint(1, 64, (2, 37))  # 37: not a multiple of the chunk (16); no 0 (generate's pad id below)
    with torch.no_grad():
        ours = model(x).logits
        torch.testing.assert_close(hf(x).logits, ours, atol=1e-5, rtol=1e-5)
        assert torch.equal(hf.generate(x[:, :6], max_new_tokens=8, do_sample=False, pad_token_id=0),
                           generate(model, x[:, :6], 8, temperature=0.0))
    back = load_hf(tmp_path).eval()
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(x).logits, ours, atol=0, rtol=0)


def test_a_folder_as_transformers_writes_it_imports(tmp_path):
    torch.manual_seed(0)
    cfg = GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        shared_intermediate_size=48, num_local_experts=0, position_embedding_type="rope",
        attention_multiplier=1 / math.sqrt(8), layer_types=["mamba", "attention", "mamba"],  # the older names
        mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8, max_position_embeddings=128)
    hf = GraniteMoeHybridForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.hybrid_layers == "MAM" and ours.cfg.d_ff == 48 and ours.cfg.ssm_heads == 8
    x = torch.randint(0, 64, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(embedding_multiplier=12.0), "embedding_multiplier=12.0 is not supported"),
    (dict(attention_multiplier=0.0078125), "attention_multiplier=0.0078125 is not supported"),
    (dict(num_local_experts=4), "num_local_experts=4"),
])
def test_granite_options_conduit_does_not_compute_are_named(tmp_path, change, message):
    cfg = GraniteMoeHybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 shared_intermediate_size=48, position_embedding_type="rope",
                                 **{"attention_multiplier": 1 / math.sqrt(8), "num_local_experts": 0, **change},
                                 layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8)
    GraniteMoeHybridForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


def test_a_pattern_no_hf_class_expresses_is_refused_but_trains_and_serves(tmp_path):
    model = _random(attention="mla", num_experts=4, moe_every=2, hybrid_layers="AMMA")
    with pytest.raises(ValueError, match=r"attention='mla' \(GraniteMoeHybrid's attention is multi-head.*"
                                         r"num_experts=4 \(GraniteMoeHybrid's MoE"):
        save_hf(model, model.cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    # it trains: a few steps lower the loss
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 33))
    losses = []
    for _ in range(5):
        out = model(x[:, :-1], targets_BT=x[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    # and it round-trips through Conduit's safetensors, generating as before
    model.eval()
    save_safetensors(model, model.cfg, tmp_path / "model.safetensors")
    back = load_safetensors(tmp_path / "model.safetensors").eval()
    assert back.cfg == model.cfg
    assert torch.equal(generate(back, x[:2, :5], 6, temperature=0.0), generate(model, x[:2, :5], 6, temperature=0.0))


@pytest.mark.parametrize("kw, message", [
    (dict(hybrid_layers="MAM"), r"hybrid_layers must name each of the n_layers \(4\) layers"),
    (dict(hybrid_layers="MAXA"), r"'A' \(attention\) or 'M' \(Mamba-2\).*got 'MAXA'"),
    (dict(hybrid_layers="MMMM"), r"needs at least one 'A' and one 'M'"),
    (dict(norm_position="post"), r"norm_position must be 'pre' when arch is 'hybrid'"),
    (dict(ssm_head_dim=48), r"ssm_head_dim \(48\) must divide the inner width"),
])
def test_bad_hybrid_fields_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        build_model("debug_hybrid", device="meta", **kw)


def test_hybrid_layers_is_refused_for_other_families():
    with pytest.raises(ValueError, match="hybrid_layers is an option of arch 'hybrid'"):
        build_model("debug_mamba2", hybrid_layers="MA")


def test_mamba2_accounting_by_hand():
    cfg = build_model("debug_mamba2", device="meta").cfg  # D 64, L 2, V 512, E 128, P 16 (H 8), G 1, N 16, K 4, Q 16
    conv = 128 + 2 * 16  # x, B and C through the conv
    layer = 64 + 64 * (128 + conv + 8) + conv * 4 + conv + 3 * 8 + 128 + 128 * 64  # norm .. out_proj
    assert layer == 28152
    assert param_counts(cfg)["total"] == 2 * layer + 64 + 2 * 512 * 64
    n = 2 * layer + 64 + 512 * 64  # non-embedding + the head's V D
    scan = 2 * 16 * 8 * (16 + 16) + 4 * 8 * 16 * 16  # 2 Q H (N + P) + 4 H P N per token and layer, forward
    assert flops_per_token(cfg, 128) == flops_per_token(cfg, 16) == {"total": 6 * n + 3 * 2 * scan,
                                                                     "forward": 2 * n + 2 * scan}
    assert kv_cache_bytes_per_token(cfg) == 0
    assert state_bytes_per_sequence(cfg) == 2 * (conv * 3 * 2 + 8 * 16 * 16 * 4) == 18304  # bf16 conv, fp32 state


def test_hybrid_accounting_by_hand():
    cfg = build_model("debug_hybrid", device="meta").cfg  # "MAMA", D 64, 4 heads of 16, d_ff 192 (SwiGLU)
    norms_ffn = 2 * 64 + 3 * 64 * 192
    attention = 4 * 64 * 64
    mamba = 28152 - 64  # debug_mamba2's layer without its norm (same ssm sizes)
    non_embedding = 2 * (norms_ffn + attention) + 2 * (norms_ffn + mamba) + 64
    assert param_counts(cfg) == {"total": non_embedding + 2 * 512 * 64, "active": non_embedding + 2 * 512 * 64,
                                 "embedding": 2 * 512 * 64, "non_embedding": non_embedding,
                                 "active_non_embedding": non_embedding}
    n, T = non_embedding + 512 * 64, 100
    attn = 2 * 4 * (16 + 16) * T  # two attention layers: Q K^T and A V over T keys per head
    scan = 2 * (2 * 16 * 8 * 32 + 4 * 8 * 16 * 16)  # two Mamba-2 layers
    assert flops_per_token(cfg, T) == {"total": 6 * n + 6 * attn + 3 * scan, "forward": 2 * n + 2 * attn + scan}
    assert kv_cache_bytes_per_token(cfg) == 2 * 2 * 4 * 16 * 2  # attention layers only: a key and a value per head
    assert state_bytes_per_sequence(cfg) == 18304  # two Mamba-2 layers, as debug_mamba2's two
    # and what the generation state allocates (fp32 model: 4 bytes per element)
    model = build_model("debug_hybrid")
    state = model.new_kv_cache(1, max_len=7)
    kv = sum(t.numel() * t.element_size() for t in (*state.k_BGSK, *state.v_BGSK))
    ssm = sum(t.numel() * t.element_size() for t in (state.ssm.conv_LBEK, state.ssm.ssm_LBEN))
    assert kv == 7 * kv_cache_bytes_per_token(cfg, bytes_per_element=4)
    assert ssm == state_bytes_per_sequence(cfg, bytes_per_element=4)

"""Mamba-2: the chunked state-space-duality scan against the recurrence token by token (values and
gradients, any chunk size, any length), cached generation against the full forward, and transformers'
Mamba2ForCausalLM both ways (and Mamba / Mamba-2 folders as transformers writes them)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

from models import build_model
from models.export import load_hf, save_hf
from models.families.mamba.hf_mamba import SSM_CONTEXT
from models.families.mamba2.model import ssd_scan
from models.generate import generate


def recurrence(x, dt, A, B, C, h0=None):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t: one token at a time (the definition)."""
    Bsz, T, H, P = x.shape
    rep = H // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    h = torch.zeros(Bsz, H, P, B.shape[-1]) if h0 is None else h0
    ys = []
    for t in range(T):
        h = h * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def _inputs(T, H=4, P=3, G=2, N=5, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, H, P, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(2, T, H, generator=g))
    A = -torch.rand(H, generator=g) * 2
    B, C = torch.randn(2, T, G, N, generator=g), torch.randn(2, T, G, N, generator=g)
    h0 = torch.randn(2, H, P, N, generator=g)
    ts = [x, dt, A, B, C, h0]
    return [t.requires_grad_() for t in ts] if grad else ts


@pytest.mark.parametrize("T, chunk", [(13, 4), (16, 4), (7, 16), (1, 8), (29, 1)])
def test_chunked_scan_equals_the_recurrence(T, chunk):
    x, dt, A, B, C, h0 = _inputs(T)
    y, h = ssd_scan(x, dt, A, B, C, chunk, h0)
    y_ref, h_ref = recurrence(x, dt, A, B, C, h0)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


def test_chunked_scan_gradients_equal_the_recurrences():
    ins = _inputs(11, grad=True)
    y, h = ssd_scan(*ins[:5], 4, ins[5])
    (y.square().sum() + h.sum()).backward()
    ours = [t.grad.clone() for t in ins]
    ref_ins = _inputs(11, grad=True)
    y_ref, h_ref = recurrence(*ref_ins)
    (y_ref.square().sum() + h_ref.sum()).backward()
    for a, b in zip(ours, ref_ins):
        torch.testing.assert_close(a, b.grad, atol=1e-4, rtol=1e-4)


def _random(**kw):
    torch.manual_seed(0)
    model = build_model("debug_mamba2", vocab_size=64, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def test_cached_generation_equals_the_full_forward():
    model = _random(ssm_n_groups=2)
    x = torch.randint(0, 64, (2, 23))
    with torch.no_grad():
        full = model(x).logits
        state = model.new_kv_cache(2)
        first = model(x[:, :9], kv_cache=state).logits  # a prompt (its own chunks), then a token at a time
        steps = [model(x[:, t:t + 1], kv_cache=state).logits for t in range(9, 23)]
    torch.testing.assert_close(torch.cat([first, *steps], 1), full, atol=1e-5, rtol=1e-5)
    # and the chunk size is a speed setting: another gives the same logits
    other = build_model(model.cfg.replace(ssm_chunk_size=5))
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.eval()(x).logits, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(ssm_n_groups=2, tie_embeddings=True, bias=True)],
                         ids=["untied", "groups_tied_bias"])
def test_export_and_import_equal_mamba2_for_causal_lm(tmp_path, kw):
    model = _random(**kw)
    save_hf(model, model.cfg, tmp_path)
    hf = Mamba2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(1, 64, (2, 37))  # 37: not a multiple of the chunk (16); no 0 (generate's pad id below)
    with torch.no_grad():
        ours = model(x).logits
        torch.testing.assert_close(hf(x).logits, ours, atol=1e-5, rtol=1e-5)
        assert torch.equal(hf.generate(x[:, :6], max_new_tokens=8, do_sample=False, pad_token_id=0),
                           generate(model, x[:, :6], 8, temperature=0.0))
    back = load_hf(tmp_path).eval()
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(x).logits, ours, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_a_folder_as_transformers_writes_it_imports_without_a_context_length(tmp_path, arch):
    torch.manual_seed(0)
    if arch == "mamba":
        hf = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    else:
        hf = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8,
                                            num_heads=8, head_dim=8, n_groups=2, chunk_size=8)).eval()
    hf.save_pretrained(tmp_path)
    assert "max_position_embeddings" not in json.loads((tmp_path / "config.json").read_text())
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.arch == arch and ours.cfg.max_seq_len == SSM_CONTEXT
    x = torch.randint(0, 64, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw, message", [
    (dict(ssm_head_dim=48), r"ssm_head_dim \(48\) must divide the inner width"),
    (dict(ssm_n_groups=3), r"ssm_n_groups \(3\) must divide the heads"),
    (dict(ssm_chunk_size=0), r"ssm_chunk_size must be an int >= 1"),
    (dict(num_experts=4), r"num_experts"),
])
def test_bad_mamba2_fields_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        build_model("debug_mamba2", **kw)


def test_mamba2_fields_are_refused_for_other_families():
    with pytest.raises(ValueError, match="ssm_head_dim is an option of arch 'mamba2'"):
        build_model("debug_dense", ssm_head_dim=32)

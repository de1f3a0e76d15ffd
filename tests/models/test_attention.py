"""Attention: the formula (MHA/GQA/MQA), fast path == explicit path, masks, dropout, equivariance."""

from __future__ import annotations

import math

import pytest
import torch

from models.families.decoder.model import Transformer
from models.layers.attention import Attention


def reference_attention(attn: Attention, x_BTD: torch.Tensor, allowed_TS: torch.Tensor) -> tuple:
    """softmax(Q K^T / sqrt(d_k)) V head by head; query head h uses kv head h // (H / G)."""
    B, T, _ = x_BTD.shape
    H, G, K = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = x_BTD @ attn.q_proj.weight.T
    k = x_BTD @ attn.k_proj.weight.T
    v = x_BTD @ attn.v_proj.weight.T
    heads, weights = [], torch.zeros(B, H, T, T)
    for h in range(H):
        g = h // (H // G)
        qh, kh, vh = q[..., h * K:(h + 1) * K], k[..., g * K:(g + 1) * K], v[..., g * K:(g + 1) * K]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(K)
        scores = scores.masked_fill(~allowed_TS, float("-inf"))
        w = torch.softmax(scores, dim=-1)
        weights[:, h] = w
        heads.append(w @ vh)
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T, weights


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_attention_formula_both_paths(make_cfg, kv_heads):
    cfg = make_cfg(num_kv_heads=kv_heads, pos_encoding="none")
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 7, cfg.d_model)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    ref_out, ref_w = reference_attention(attn, x, causal)
    fast, none = attn(x)
    explicit, w = attn(x, return_attention=True)
    assert none is None
    torch.testing.assert_close(fast, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(explicit, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    assert w.shape == (2, 4, 7, 7)


@pytest.mark.parametrize("pos", ["rope", "alibi", "sinusoidal", "learned", "none"])
def test_causality_future_tokens_never_change_past_logits(make_model, pos):
    model = make_model(pos_encoding=pos, num_kv_heads=2)
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, 12))
    y = x.clone()
    y[:, 8:] = torch.randint(0, 64, (2, 4))
    for return_attention in (False, True):
        a = model(x, return_attention=return_attention).logits
        b = model(y, return_attention=return_attention).logits
        torch.testing.assert_close(a[:, :8], b[:, :8])
        assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_attention_weights_are_causal_distributions(make_model):
    model = make_model(pos_encoding="alibi")
    out = model(torch.randint(0, 64, (2, 6)), return_attention=True)
    assert len(out.attentions) == 2
    for w in out.attentions:
        assert w.shape == (2, 4, 6, 6)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
        assert (w.triu(diagonal=1) == 0).all()


@pytest.mark.parametrize("pos", ["rope", "alibi", "sinusoidal", "learned", "none"])
def test_fast_and_explicit_paths_agree_with_padding(make_model, pos):
    model = make_model(pos_encoding=pos)
    x = torch.randint(0, 64, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, 6:] = 0  # right padding
    fast = model(x, attention_mask_BT=mask).logits
    explicit = model(x, attention_mask_BT=mask, return_attention=True).logits
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(fast).all()


@pytest.mark.parametrize("pos", ["rope", "alibi", "sinusoidal", "learned", "none"])
def test_left_padding_gives_the_unpadded_logits(make_model, pos):
    model = make_model(pos_encoding=pos, num_kv_heads=1)
    torch.manual_seed(2)
    real = torch.randint(0, 64, (1, 6))
    padded = torch.cat([torch.randint(0, 64, (1, 3)), real], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    expected = model(real).logits
    got = model(padded, attention_mask_BT=mask).logits[:, 3:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # The pad contents do not matter either.
    other = padded.clone()
    other[:, :3] = (other[:, :3] + 1) % 64
    torch.testing.assert_close(model(other, attention_mask_BT=mask).logits[:, 3:], got)


def test_padded_keys_get_zero_attention(make_model):
    model = make_model()
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    out = model(torch.randint(0, 64, (1, 5)), attention_mask_BT=mask, return_attention=True)
    for w in out.attentions:
        assert (w[0, :, 3:, 2] == 0).all()  # real queries never look at the pad key


def test_attention_without_mask_is_permutation_equivariant(make_cfg):
    """No positions and no mask: permuting the tokens permutes the outputs the same way."""
    cfg = make_cfg(pos_encoding="none", num_kv_heads=2)
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 7, cfg.d_model)
    perm = torch.randperm(7)
    full = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    y, _ = attn(x, attn_mask=full)
    y_perm, _ = attn(x[:, perm], attn_mask=full)
    torch.testing.assert_close(y_perm, y[:, perm], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pos", ["rope", "alibi", "sinusoidal", "learned", "none"])
def test_only_position_encodings_see_order(make_model, pos):
    """One causal layer: the last token attends to the set of all tokens. Without position information
    its output ignores the order of the earlier tokens; with any encoding it does not."""
    # A large init_std makes attention far from uniform, so position effects are well above rounding.
    model = make_model(pos_encoding=pos, n_layers=1, init_std=0.3)
    torch.manual_seed(3)
    x = torch.randint(0, 64, (1, 10))
    shuffled = torch.cat([x[:, :9][:, torch.randperm(9)], x[:, 9:]], dim=1)
    assert not torch.equal(shuffled, x)
    a, b = model(x).logits[:, -1], model(shuffled).logits[:, -1]
    if pos == "none":
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    else:
        assert (a - b).abs().max() > 1e-2


def test_attention_dropout_only_in_training(make_cfg):
    cfg = make_cfg(attn_dropout=0.5)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    x = torch.randint(0, 64, (2, 8))
    model.eval()
    a = model(x, return_attention=True)
    torch.testing.assert_close(a.logits, model(x).logits, atol=1e-5, rtol=1e-4)
    model.train()
    torch.manual_seed(1)
    b = model(x, return_attention=True)
    torch.manual_seed(1)
    c = model(x)
    assert not torch.allclose(b.logits, a.logits)
    assert not torch.allclose(c.logits, a.logits)
    # Returned weights are the distribution before dropout.
    torch.testing.assert_close(b.attentions[0], a.attentions[0])


def test_too_long_input_raises(make_model):
    model = make_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))

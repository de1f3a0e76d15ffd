"""Norms, feed-forward networks and block wiring (pre/post norm) against hand formulas."""

from __future__ import annotations

import math

import pytest
import torch

from models.layers.attention import Attention
from models.layers.block import TransformerBlock
from models.layers.ffn import FeedForward
from models.layers.norms import LayerNorm, RMSNorm


def test_rmsnorm_formula():
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-5)
    norm.weight.data = torch.randn(6)
    x = torch.randn(2, 3, 6)
    expected = torch.empty_like(x)
    for b in range(2):
        for t in range(3):
            v = x[b, t]
            rms = math.sqrt(sum(e.item() ** 2 for e in v) / 6 + 1e-5)
            expected[b, t] = v / rms * norm.weight.data
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-5)


def test_rmsnorm_keeps_dtype():
    norm = RMSNorm(4, eps=1e-5)
    norm.reset_parameters()
    assert norm(torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [False, True])
def test_layernorm_formula(bias):
    torch.manual_seed(0)
    norm = LayerNorm(5, eps=1e-5, bias=bias)
    norm.weight.data = torch.randn(5)
    if bias:
        norm.bias.data = torch.randn(5)
    x = torch.randn(3, 5)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance, as in the paper
    expected = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight.data + (norm.bias.data if bias else 0)
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-5)


def _random_ffn(kind: str, bias: bool) -> FeedForward:
    torch.manual_seed(1)
    ffn = FeedForward(8, 12, kind, bias)
    for p in ffn.parameters():
        p.data = torch.randn_like(p) * 0.3
    return ffn


@pytest.mark.parametrize("bias", [False, True])
def test_ffn_formulas(bias):
    x = torch.randn(4, 8)

    def lin(layer, v):
        return v @ layer.weight.T + (layer.bias if bias else 0)

    relu = _random_ffn("relu", bias)
    torch.testing.assert_close(relu(x), lin(relu.w2, torch.clamp(lin(relu.w1, x), min=0)))

    gelu = _random_ffn("gelu", bias)
    h = lin(gelu.w1, x)
    exact_gelu = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    torch.testing.assert_close(gelu(x), lin(gelu.w2, exact_gelu))

    swiglu = _random_ffn("swiglu", bias)
    gate = lin(swiglu.w1, x)
    silu = gate / (1 + torch.exp(-gate))
    torch.testing.assert_close(swiglu(x), lin(swiglu.w2, silu * lin(swiglu.w3, x)))
    assert relu.w3 is None and gelu.w3 is None


def test_unknown_ffn_kind():
    with pytest.raises(ValueError, match="swiglu"):
        FeedForward(4, 4, "geglu", False)


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_block_wiring(make_cfg, position, norm):
    cfg = make_cfg(norm=norm, norm_position=position, pos_encoding="none", bias=True)
    torch.manual_seed(0)
    block = TransformerBlock(cfg, 0, Attention(cfg))
    for p in block.parameters():
        p.data = torch.randn_like(p) * 0.2
    x = torch.randn(2, 5, cfg.d_model)

    def attn(v):
        return block.attn(v)[0]

    if position == "pre":
        h = x + attn(block.attn_norm(x))
        expected = h + block.ffn(block.ffn_norm(h))
    else:
        h = block.attn_norm(x + attn(x))
        expected = block.ffn_norm(h + block.ffn(h))
    out, weights, aux, stats = block(x, None, None, None, False)
    torch.testing.assert_close(out, expected)
    assert weights is None and aux is None and stats is None

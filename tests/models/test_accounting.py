"""Analytic parameter counts equal the built model; the FLOP formula by hand."""

from __future__ import annotations

import pytest
import torch

from models import PRESETS, Transformer
from models.accounting import flops_per_token, param_counts
from models.moe import MoEFeedForward
from models.presets import model_class

VARIANTS = [
    dict(),
    dict(num_kv_heads=1, tie_embeddings=True),
    dict(pos_encoding="learned", norm="layernorm", bias=True, ffn="gelu"),
    dict(norm_position="post", ffn="relu", d_ff=40),
    dict(num_experts=4, moe_top_k=2),
    dict(num_experts=3, moe_top_k=1, moe_every=2, n_layers=4, moe_shared_experts=2, moe_d_ff=24, bias=True),
]


def built_counts(model: Transformer) -> dict[str, int]:
    """Counts read off the module tree."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    if model.pos_embeddings is not None:
        embedding += model.pos_embeddings.weight.numel()
    if model.lm_head.weight is not model.tok_embeddings.weight:
        embedding += model.lm_head.weight.numel()
    inactive = 0
    for block in model.layers:
        if isinstance(block.ffn, MoEFeedForward):
            per_expert = sum(p.numel() for p in block.ffn.experts[0].parameters())
            inactive += (block.ffn.num_experts - block.ffn.top_k) * per_expert
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "active": total - inactive}


@pytest.mark.parametrize("kw", VARIANTS)
def test_param_counts_equal_the_built_model(make_cfg, kw):
    cfg = make_cfg(**kw)
    with torch.device("meta"):
        model = Transformer(cfg)
    counts = param_counts(cfg)
    for key, value in built_counts(model).items():
        assert counts[key] == value, key
    assert counts["active_non_embedding"] == counts["active"] - counts["embedding"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_counts_of_presets(name):
    with torch.device("meta"):
        model = model_class(PRESETS[name])(PRESETS[name])
    assert param_counts(PRESETS[name])["total"] == sum(p.numel() for p in model.parameters())


def test_dense_by_hand():
    # d 64, 2 layers, 4 heads, swiglu hidden 192, vocab 512, untied, rmsnorm.
    cfg = PRESETS["debug_dense"]
    attn = 4 * 64 * 64
    ffn = 3 * 64 * 192
    per_layer = attn + ffn + 2 * 64
    expected = 2 * per_layer + 64 + 2 * 512 * 64
    assert param_counts(cfg)["total"] == expected


def test_flops_formula():
    cfg = PRESETS["debug_moe"]
    T = 128
    counts = param_counts(cfg)
    n = counts["active_non_embedding"] + cfg.vocab_size * cfg.d_model
    attn = cfg.n_layers * cfg.n_heads * cfg.head_dim * T
    flops = flops_per_token(cfg, T)
    assert flops == {"total": 6 * n + 12 * attn, "forward": 2 * n + 4 * attn}
    # More (inactive) experts add no FLOPs; only the router grows by D per expert and layer.
    more_experts = cfg.replace(num_experts=16)
    extra_router = cfg.n_layers * (16 - 4) * cfg.d_model
    assert flops_per_token(more_experts, T)["total"] == flops["total"] + 6 * extra_router
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)

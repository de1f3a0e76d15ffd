"""Analytic parameter counts equal the built model; the FLOP formula by hand."""

from __future__ import annotations

import pytest
import torch

from models import PRESETS, ModelConfig, Transformer
from models.accounting import flops_per_token, kv_cache_bytes_per_token, param_counts
from models.layers.moe import MoEFeedForward
from models.presets import model_class

VARIANTS = [
    dict(),
    dict(num_kv_heads=1, tie_embeddings=True),
    dict(pos_encoding="learned", norm="layernorm", bias=True, ffn="gelu"),
    dict(norm_position="post", ffn="relu", d_ff=40),
    dict(num_experts=4, moe_top_k=2),
    dict(num_experts=3, moe_top_k=1, moe_every=2, n_layers=4, moe_shared_experts=2, moe_d_ff=24, bias=True),
    dict(attention="mla"),
    dict(attention="mla", kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
         bias=True, tie_embeddings=True),
    dict(attention="mla", kv_lora_rank=16, num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_d_ff=16,
         moe_first_dense_layers=1, n_layers=3),
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
            per_expert = sum(p[0].numel() for p in block.ffn.experts.parameters())  # expert 0's slices
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


def test_mla_by_hand():
    # d 32, 2 layers, 4 heads; latent R 16, query latent 8, nope N 6, rope P 4, value V 5; swiglu hidden
    # 96 (8/3 * 32 = 85 rounded up to 16s); vocab 64, untied, rmsnorm.
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_multiple_of=16, attention="mla",
                      kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
    query = 32 * 8 + 8 + 8 * 4 * (6 + 4)  # q_a_proj, q_a_norm, q_b_proj
    latent = 32 * (16 + 4) + 16  # kv_a_proj (latent and shared rope key), kv_a_norm
    expand = 16 * 4 * (6 + 5)  # kv_b_proj: per head a nope key and a value
    out = 4 * 5 * 32
    per_layer = query + latent + expand + out + 3 * 32 * 96 + 2 * 32
    assert param_counts(cfg)["total"] == 2 * per_layer + 32 + 2 * 64 * 32
    T = 10
    n = 2 * per_layer + 32 + 64 * 32
    attn = 2 * 4 * (6 + 4 + 5) * T  # Q K^T over N + P features, A V over V features, per layer and head
    assert flops_per_token(cfg, T) == {"total": 6 * n + 6 * attn, "forward": 2 * n + 2 * attn}


def test_kv_cache_bytes_per_token_by_hand():
    # llama_1b: 16 layers, 32 query heads of 64, 8 kv heads (GQA); bf16 = 2 bytes.
    gqa = PRESETS["llama_1b"]
    assert kv_cache_bytes_per_token(gqa) == 16 * 2 * 8 * 64 * 2 == 32768
    assert kv_cache_bytes_per_token(gqa.replace(num_kv_heads=None)) == 16 * 2 * 32 * 64 * 2 == 131072  # MHA
    assert kv_cache_bytes_per_token(gqa.replace(num_kv_heads=1)) == 16 * 2 * 1 * 64 * 2 == 4096  # MQA
    assert kv_cache_bytes_per_token(gqa, bytes_per_element=4) == 65536  # an fp32 cache
    # mla_moe_32x_top4: 20 layers, latent 512 + one rope key of 64 per token and layer.
    mla = PRESETS["mla_moe_32x_top4"]
    assert kv_cache_bytes_per_token(mla) == 20 * (512 + 64) * 2 == 23040
    with pytest.raises(ValueError, match="bytes_per_element"):
        kv_cache_bytes_per_token(mla, bytes_per_element=0)


@pytest.mark.parametrize("kw", [dict(num_kv_heads=2), dict(attention="mla", kv_lora_rank=12, qk_rope_head_dim=6)])
def test_kv_cache_bytes_equal_what_the_cache_allocates(make_model, kw):
    model = make_model(**kw)
    cache = model.new_kv_cache(batch_size=1, max_len=5)
    allocated = sum(t.numel() * t.element_size() for t in (*cache.k_BGSK, *cache.v_BGSK))
    assert allocated == 5 * kv_cache_bytes_per_token(model.cfg, bytes_per_element=4)

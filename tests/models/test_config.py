"""ModelConfig validation, derived sizes, (de)serialisation; presets and build_model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models import PRESETS, ModelConfig, Transformer, build_model


def test_defaults_match_the_documented_values():
    cfg = ModelConfig()
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.max_seq_len) == (512, 128, 2, 4, 256)
    assert (cfg.pos_encoding, cfg.ffn, cfg.norm, cfg.norm_position) == ("rope", "swiglu", "rmsnorm", "pre")
    assert cfg.num_kv_heads is None and cfg.resolved_num_kv_heads == 4
    assert cfg.head_dim == 32
    assert cfg.num_experts == 0 and not cfg.is_moe
    assert cfg.moe_capacity_factor is None and cfg.moe_renormalize is True


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().d_model = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "d, ffn, multiple, expected",
    [
        (128, "swiglu", 64, 384),  # int(341.33) = 341 -> 384
        (64, "swiglu", 64, 192),  # 170 -> 192
        (768, "swiglu", 64, 2048),  # exactly 2048
        (96, "swiglu", 1, 256),  # int(256.0) = 256, no rounding
        (128, "gelu", 64, 512),
        (128, "relu", 64, 512),
    ],
)
def test_ffn_hidden_size_rule(d, ffn, multiple, expected):
    cfg = ModelConfig(d_model=d, n_heads=4, ffn=ffn, ffn_multiple_of=multiple)
    assert cfg.resolved_d_ff == expected
    assert cfg.resolved_moe_d_ff == expected


def test_explicit_d_ff_and_moe_d_ff_win():
    cfg = ModelConfig(d_ff=100, moe_d_ff=50, num_experts=2, moe_top_k=1)
    assert cfg.resolved_d_ff == 100 and cfg.resolved_moe_d_ff == 50


def test_moe_layer_placement():
    cfg = ModelConfig(n_layers=4, num_experts=4, moe_every=2)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert cfg.is_moe and cfg.num_moe_layers == 2
    assert not ModelConfig(n_layers=2, num_experts=4, moe_every=3).is_moe


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("pos_encoding", "absolute", ["pos_encoding", "rope", "alibi", "sinusoidal", "learned", "none"]),
        ("ffn", "geglu", ["ffn", "swiglu", "gelu", "relu"]),
        ("norm", "batchnorm", ["norm", "rmsnorm", "layernorm"]),
        ("norm_position", "sandwich", ["norm_position", "pre", "post"]),
        ("n_heads", 3, ["d_model", "n_heads"]),
        ("num_kv_heads", 3, ["num_kv_heads", "n_heads"]),
        ("d_model", 0, ["d_model", ">= 1"]),
        ("vocab_size", 2.5, ["vocab_size", "int"]),
        ("n_layers", True, ["n_layers", "int"]),
        ("dropout", 1.0, ["dropout", "[0, 1)"]),
        ("attn_dropout", -0.1, ["attn_dropout"]),
        ("rope_base", 0.0, ["rope_base", "> 0"]),
        ("rope_scaling", -1.0, ["rope_scaling"]),
        ("bias", 1, ["bias", "bool"]),
        ("moe_capacity_factor", 0.0, ["moe_capacity_factor", "None"]),
        ("moe_every", 0, ["moe_every"]),
        ("num_experts", -1, ["num_experts"]),
    ],
)
def test_bad_values_name_the_field_and_allowed_values(field, value, words):
    with pytest.raises(ValueError) as e:
        ModelConfig(**{field: value})
    for w in words:
        assert w in str(e.value)


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match="moe_top_k.*1..num_experts"):
        ModelConfig(num_experts=2, moe_top_k=3)


def test_rope_needs_even_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(d_model=12, n_heads=4)
    ModelConfig(d_model=12, n_heads=4, pos_encoding="alibi")  # fine without rope


def test_round_trip_and_replace():
    cfg = ModelConfig(num_experts=4, moe_capacity_factor=1.25, num_kv_heads=2)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    other = cfg.replace(d_model=64)
    assert other.d_model == 64 and other.num_experts == 4 and cfg.d_model == 128
    with pytest.raises(ValueError, match="n_heads"):
        cfg.replace(n_heads=5)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown ModelConfig key 'n_layer'.*'n_layers'"):
        ModelConfig.from_dict({"n_layer": 3})
    with pytest.raises(ValueError, match=r"'num_expert'.*did you mean 'num_experts'"):
        ModelConfig().replace(num_expert=3)


PRESET_SHAPES = {
    "debug_dense": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=128, num_experts=0),
    "debug_moe": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=128, num_experts=4, moe_top_k=2),
    "cpu_small": dict(d_model=128, n_layers=4, n_heads=4, max_seq_len=256, num_experts=0),
    "cpu_medium": dict(d_model=256, n_layers=6, n_heads=8, max_seq_len=256, num_experts=0),
    "cpu_moe": dict(d_model=128, n_layers=4, n_heads=4, max_seq_len=256, num_experts=8, moe_top_k=2),
    "gpt_125m": dict(d_model=768, n_layers=12, n_heads=12, max_seq_len=2048, vocab_size=32000),
    "llama_1b": dict(d_model=2048, n_layers=16, n_heads=32, num_kv_heads=8, max_seq_len=2048, vocab_size=32000),
    "moe_8x_top2": dict(d_model=1024, n_layers=16, n_heads=16, num_experts=8, moe_top_k=2, vocab_size=32000),
    "cpu_mla_moe": dict(d_model=128, n_layers=4, n_heads=4, attention="mla", kv_lora_rank=64, qk_rope_head_dim=16,
                        num_experts=8, moe_top_k=2, moe_shared_experts=1, moe_renormalize=False),
    "mla_moe_32x_top4": dict(d_model=1536, n_layers=20, n_heads=12, attention="mla", kv_lora_rank=512,
                             q_lora_rank=768, qk_rope_head_dim=64, num_experts=32, moe_top_k=4,
                             moe_shared_experts=2, vocab_size=32000),
    "debug_mamba": dict(arch="mamba", vocab_size=512, d_model=64, n_layers=2, max_seq_len=128, ssm_state_size=16),
    "mamba": dict(arch="mamba", vocab_size=512, d_model=128, n_layers=8, max_seq_len=256, ssm_state_size=16),
    "debug_mamba2": dict(arch="mamba2", vocab_size=512, d_model=64, n_layers=2, max_seq_len=128, ssm_head_dim=16,
                         ssm_chunk_size=16),
    "mamba2": dict(arch="mamba2", vocab_size=512, d_model=128, n_layers=8, max_seq_len=256, ssm_head_dim=32,
                   ssm_chunk_size=64),
    "debug_hybrid": dict(arch="hybrid", vocab_size=512, d_model=64, n_layers=4, n_heads=4, hybrid_layers="MAMA",
                         ssm_head_dim=16, ssm_chunk_size=16),
    "hybrid": dict(arch="hybrid", vocab_size=512, d_model=128, n_layers=4, n_heads=4, hybrid_layers="MMAM",
                   ssm_head_dim=32),
    "debug_encdec": dict(arch="encoder_decoder", d_model=64, n_layers=2, n_encoder_layers=2, norm_position="post",
                         pos_encoding="sinusoidal", ffn="relu", norm="layernorm", tie_embeddings=True),
    "encdec": dict(arch="encoder_decoder", d_model=128, n_layers=4, n_encoder_layers=4, norm_position="post",
                   pos_encoding="sinusoidal", ffn="relu", norm="layernorm", tie_embeddings=True),
}


def test_presets_have_the_documented_shapes():
    assert set(PRESETS) == set(PRESET_SHAPES)
    for name, shape in PRESET_SHAPES.items():
        for field, value in shape.items():
            assert getattr(PRESETS[name], field) == value, (name, field)


def test_build_model_by_name_with_overrides():
    torch.manual_seed(0)
    model = build_model("debug_moe", vocab_size=100, n_layers=1)
    assert isinstance(model, Transformer)
    assert model.cfg == PRESETS["debug_moe"].replace(vocab_size=100, n_layers=1)
    assert model.tok_embeddings.weight.shape == (100, 64)
    out = model(torch.randint(0, 100, (1, 8)))
    assert torch.isfinite(out.logits).all()


def test_build_model_errors():
    with pytest.raises(ValueError, match=r"unknown model preset 'debug_dens'.*'debug_dense'"):
        build_model("debug_dens")
    with pytest.raises(ValueError, match="d_modle"):
        build_model("debug_dense", d_modle=3)


def test_build_model_on_meta_allocates_nothing():
    model = build_model("llama_1b", device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert math.isclose(sum(p.numel() for p in model.parameters()) / 1e9, 0.84, abs_tol=0.01)

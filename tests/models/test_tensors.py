"""Each family's module listing (`models.tensors`, read from the config without torch) is the built model's:
every module that holds parameters, by path, with the size of each parameter in the order it registers
them, which of them are routed experts and which head is tied, for every preset and the options each family
reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import PRESETS, ModelConfig
from models.families import family
from models.layers.grouped_experts import StackedExperts
from models.presets import model_class

from tests.models.conftest import tiny_config

DECODER_VARIANTS = [
    dict(),
    dict(num_kv_heads=1, tie_embeddings=True),
    dict(pos_encoding="learned", norm="layernorm", bias=True, ffn="gelu"),
    dict(norm_position="post", ffn="relu", d_ff=40),
    dict(num_experts=3, moe_top_k=1, moe_every=2, n_layers=4, moe_shared_experts=2, moe_d_ff=24, bias=True,
         ffn="gelu", norm="layernorm"),
    dict(attention="mla", kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
         bias=True, tie_embeddings=True),
    dict(attention="mla", kv_lora_rank=16, num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_d_ff=16,
         moe_first_dense_layers=1, n_layers=3, moe_router="sigmoid"),
]

# Other families: a preset with the options its family reads changed.
FAMILY_VARIANTS = [
    ("mamba", dict(bias=True, tie_embeddings=True, ssm_dt_rank=5, ssm_state_size=8, ssm_conv_kernel=3)),
    ("mamba2", dict(bias=True, ssm_n_groups=2, ssm_head_dim=32, ssm_state_size=8)),
    ("hybrid", dict(hybrid_layers="AMMA", num_experts=4, moe_top_k=2, moe_every=2, bias=True, norm="layernorm",
                    pos_encoding="learned")),
    ("hybrid", dict(attention="mla", kv_lora_rank=16, tie_embeddings=True)),
    ("encdec", dict(n_encoder_layers=3, embedding_norm=True, norm_position="pre", bias=False, tie_embeddings=True,
                    pos_encoding="learned", ffn="swiglu")),
    ("debug_encdec", dict(num_kv_heads=2, norm="rmsnorm")),
]


def built(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str], bool]:
    """The meta-device model's modules that hold parameters: path -> sizes, the expert stacks, whether tied."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    held = {name: tuple(p.numel() for p in m.parameters(recurse=False)) for name, m in model.named_modules()}
    experts = {name for name, m in model.named_modules() if isinstance(m, StackedExperts)}
    return {k: v for k, v in held.items() if v}, experts, model.lm_head.weight is model.tok_embeddings.weight


def check_listing(cfg: ModelConfig) -> None:
    modules = family(cfg).modules(cfg)
    held, experts, tied = built(cfg)
    assert {m.path: m.sizes for m in modules} == held
    assert len(modules) == len(held)  # no path listed twice
    assert {m.path for m in modules if m.experts} == experts
    assert [m.path for m in modules if m.tied] == (["lm_head"] if tied else [])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_lists_the_modules_it_builds(name):
    check_listing(PRESETS[name])


@pytest.mark.parametrize("kw", DECODER_VARIANTS)
def test_decoder_options_list_the_modules_they_build(kw):
    check_listing(tiny_config(**kw))


@pytest.mark.parametrize("name,kw", FAMILY_VARIANTS)
def test_family_options_list_the_modules_they_build(name, kw):
    check_listing(dataclasses.replace(PRESETS[name], **kw))


def test_a_changed_constructor_would_be_seen():
    """The comparison fails on a listing that differs from the build by one bias (the check can fail)."""
    cfg = tiny_config(bias=True)
    modules = family(cfg).modules(cfg)
    held, _, _ = built(cfg)
    wrong = {m.path: (m.sizes[:1] if m.path.endswith("q_proj") else m.sizes) for m in modules}
    assert wrong != held

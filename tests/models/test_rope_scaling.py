"""RoPE context extension: linear, NTK-aware, dynamic NTK, YaRN (DeepSeek's mscale too) and Llama 3's
scaling, each equal to transformers' own frequencies, and each model exported to Llama / Mixtral /
DeepseekV2 giving transformers' logits at a length beyond the original context, then read back."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.models.conftest import random_model
from models.export import load_hf, save_hf
from models.families.decoder.hf_llama import rope_parameters
from models.layers.positions import RopeScaling, rope_cos_sin, rope_inv_freq

ORIGINAL = 8  # the context "trained at"; inputs run to 24, three times past it
LONG = 24

METHODS = {
    "linear": dict(rope_scaling=4.0),
    "ntk": dict(rope_scaling=4.0, rope_scaling_type="ntk"),
    "dynamic": dict(rope_scaling=4.0, rope_scaling_type="dynamic", rope_original_max_seq_len=ORIGINAL),
    "yarn": dict(rope_scaling=4.0, rope_scaling_type="yarn", rope_original_max_seq_len=ORIGINAL),
    "yarn_betas": dict(rope_scaling=3.0, rope_scaling_type="yarn", rope_original_max_seq_len=ORIGINAL,
                       rope_yarn_beta_fast=8.0, rope_yarn_beta_slow=0.5),
    "llama3": dict(rope_scaling=4.0, rope_scaling_type="llama3", rope_original_max_seq_len=ORIGINAL,
                   rope_llama3_low_freq_factor=1.0, rope_llama3_high_freq_factor=4.0),
}


_random_model = random_model


@pytest.mark.parametrize("name", sorted(METHODS))
def test_frequencies_equal_transformers(make_cfg, name):
    """Our inverse frequencies and attention factor against transformers' ROPE_INIT_FUNCTIONS, from the
    config.json we export (so the mapping is checked too), with a head width where the bands differ."""
    cfg = make_cfg(d_model=128, n_heads=2, rope_base=10000.0, **METHODS[name])  # 64 rotated features
    rope, max_positions = rope_parameters(cfg)
    hf_cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=max_positions,
                         rope_parameters=rope)
    rs = cfg.rope
    for seq_len in (None, ORIGINAL, LONG, 4 * LONG):
        theirs, their_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu", seq_len=seq_len) \
            if rope["rope_type"] != "default" else (1.0 / (rope["rope_theta"] ** (
                torch.arange(0, 64, 2, dtype=torch.int64).float() / 64)), 1.0)
        if name == "linear":
            ours, factor = rope_inv_freq(64, cfg.rope_base, RopeScaling()), 1.0
            ours = ours[0] / rs.factor  # linear divides the positions instead: the same angles
        else:
            ours, factor = rope_inv_freq(64, cfg.rope_base, rs, seq_len)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
        assert factor == pytest.approx(their_factor, rel=1e-12)
    if name.startswith("yarn"):
        assert factor == pytest.approx(0.1 * math.log(rs.factor) + 1)
        # the highest frequencies are kept, the lowest divided by the factor
        base = rope_inv_freq(64, cfg.rope_base, RopeScaling())[0]
        assert ours[0] == base[0] and torch.allclose(ours[-1], base[-1] / rs.factor)


def test_dynamic_ntk_changes_nothing_up_to_the_original_context(make_cfg):
    pos = torch.arange(ORIGINAL).unsqueeze(0)
    cfg = make_cfg(**METHODS["dynamic"])
    plain = rope_cos_sin(pos, 8, 10000.0, 1.0)
    dyn = rope_cos_sin(pos, 8, 10000.0, cfg.rope)
    assert all(torch.equal(a, b) for a, b in zip(plain, dyn))
    longer = rope_cos_sin(torch.arange(LONG).unsqueeze(0), 8, 10000.0, cfg.rope)
    assert not torch.allclose(longer[0][..., :ORIGINAL, :], plain[0])  # past it, every position moves


LLAMA_CASES = [(name, dict(kw)) for name, kw in sorted(METHODS.items())] + [
    ("mixtral_yarn", dict(**METHODS["yarn"], num_experts=4, moe_top_k=2, moe_d_ff=48)),
    ("mixtral_llama3_gqa", dict(**METHODS["llama3"], num_experts=3, moe_top_k=1, num_kv_heads=2)),
]


@pytest.mark.parametrize("name, kw", LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def test_export_past_the_original_context_equals_transformers(make_cfg, tmp_path, name, kw):
    if name == "dynamic":
        kw["max_seq_len"] = 4 * ORIGINAL  # what an import gives back: factor x original
    model = _random_model(make_cfg, **kw)
    save_hf(model, model.cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, LONG))
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x).logits
        unscaled = _random_model(make_cfg, **{**kw, **dict(rope_scaling=1.0, rope_scaling_type="linear",
                                                            rope_original_max_seq_len=None)})(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert (ours - unscaled).abs().max() > 1e-3  # the scaling changed the logits at these lengths
    back = load_hf(tmp_path).eval()
    if name != "ntk":  # NTK-aware comes back as its raised base, unscaled: the same frequencies
        assert back.cfg == model.cfg
    else:
        assert back.cfg.rope_scaling == 1.0 and back.cfg.rope_base > model.cfg.rope_base
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours, atol=1e-6, rtol=1e-6)


MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
DEEPSEEK_CASES = [
    ("yarn_mscale", dict(**MLA, **METHODS["yarn"], rope_yarn_mscale=0.707, rope_yarn_mscale_all_dim=0.707)),
    ("yarn_mscale_unequal_moe", dict(**MLA, **METHODS["yarn"], rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=0.5,
                                     num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_renormalize=False)),
    ("llama3", dict(**MLA, **METHODS["llama3"])),
    ("ntk", dict(**MLA, **METHODS["ntk"])),
]


@pytest.mark.parametrize("name, kw", DEEPSEEK_CASES, ids=[c[0] for c in DEEPSEEK_CASES])
def test_mla_export_past_the_original_context_equals_deepseek_v2(make_cfg, tmp_path, name, kw):
    """MLA's decoupled RoPE features scale as DeepseekV2's, with DeepSeek's mscale in the softmax scale."""
    model = _random_model(make_cfg, **kw)
    save_hf(model, model.cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV2ForCausalLM"
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, LONG))
    with torch.no_grad():
        ours = model(x).logits
        torch.testing.assert_close(hf(x).logits, ours, atol=1e-5, rtol=1e-5)
        back = load_hf(tmp_path).eval()
        torch.testing.assert_close(back(x).logits, ours, atol=1e-6, rtol=1e-6)
    if name.startswith("yarn"):
        assert back.cfg == model.cfg and model.layers[0].attn.softmax_scale is not None


def test_a_llama31_config_as_transformers_writes_it_imports(tmp_path):
    """rope_type llama3 with original_max_position_embeddings, max_position_embeddings the extended
    length: a LlamaForCausalLM made and saved by transformers loads with equal logits past the original."""
    hf_cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": ORIGINAL})
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert (ours.cfg.rope_scaling_type, ours.cfg.rope_scaling, ours.cfg.rope_original_max_seq_len,
            ours.cfg.max_seq_len) == ("llama3", 4.0, ORIGINAL, 32)
    x = torch.randint(0, 64, (2, LONG))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "factor": 4.0}, "rope_type must be one of default, linear, dynamic, yarn, llama3; "
                                               "got 'longrope'"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2, "original_max_position_embeddings": 8},
     "attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": False, "original_max_position_embeddings": 8}, "truncate=false"),
])
def test_rope_types_conduit_does_not_compute_are_refused_by_name(tmp_path, rope, message):
    from models.families.decoder.hf_llama import rope_fields

    with pytest.raises(ValueError, match=message):
        rope_fields({"max_position_embeddings": 32, "rope_parameters": {"rope_theta": 10000.0, **rope}})


@pytest.mark.parametrize("kw, message", [
    (dict(rope_scaling_type="ntk2", rope_scaling=2.0), "rope_scaling_type"),
    (dict(rope_scaling_type="yarn", rope_scaling=4.0), "needs rope_original_max_seq_len"),
    (dict(rope_scaling_type="llama3", rope_scaling=4.0, rope_original_max_seq_len=64),
     r"rope_original_max_seq_len must be an int in 1..max_seq_len \(32\)"),
    (dict(rope_scaling_type="yarn", rope_scaling=0.5, rope_original_max_seq_len=8), "rope_scaling=0.5 must be >= 1"),
    (dict(rope_scaling_type="ntk", rope_scaling=2.0, pos_encoding="alibi"), "scales RoPE; pos_encoding is 'alibi'"),
    (dict(rope_yarn_beta_fast=1.0, rope_yarn_beta_slow=2.0), r"rope_yarn_beta_fast \(1.0\) must be > rope_yarn_beta_slow"),
    (dict(rope_llama3_low_freq_factor=0.0), "rope_llama3_low_freq_factor must be > 0"),
    (dict(rope_scaling_type="yarn", rope_scaling=4.0, rope_original_max_seq_len=8, rope_yarn_mscale=1.0),
     "rope_yarn_mscale and rope_yarn_mscale_all_dim go together"),
])
def test_bad_or_missing_parameters_are_config_errors_naming_them(make_cfg, kw, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(**kw)


def test_dynamic_ntk_scales_each_row_by_its_own_length():
    """A batch's rows get the frequencies they get alone: the factor grows with each row's own longest
    position (it grew with the batch's, so a short row beside a long one was scaled as the long one)."""
    rs = RopeScaling("dynamic", 4.0, 16)
    positions = torch.stack([torch.arange(30, 40), torch.arange(0, 10), torch.arange(12, 22)])
    cos, sin = rope_cos_sin(positions, 16, 10000.0, rs)
    for b in range(len(positions)):
        alone_cos, alone_sin = rope_cos_sin(positions[b:b + 1], 16, 10000.0, rs)
        assert torch.equal(cos[b:b + 1], alone_cos) and torch.equal(sin[b:b + 1], alone_sin), b
    unscaled, _ = rope_cos_sin(positions[1:2], 16, 10000.0, 1.0)  # within the trained 16: nothing changes
    assert torch.equal(cos[1:2], unscaled)

"""Multi-head latent attention: against the formula, cached == uncached, DeepseekV2 parity both ways."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM)

from models import Transformer
from tests.models.conftest import random_model
from models.export import load_hf, save_hf
from models.generate import generate
from models.layers.positions import apply_rope, rope_cos_sin

MLA = dict(attention="mla", kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


_random_model = random_model


def test_mla_layer_is_the_paper_formula_written_out(make_cfg):
    """One layer's output against DeepSeek-V2's equations (section 2.1) with plain tensor ops."""
    model = _random_model(make_cfg, q_lora_rank=10, **MLA)
    attn = model.layers[0].attn
    B, T, H, N, P, V, R = 2, 7, 4, 6, 4, 5, 12
    x = torch.randn(B, T, 32)
    cos, sin = rope_cos_sin(torch.arange(T).expand(B, T), P, model.cfg.rope_base, 1.0)

    def rms(z, w):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    c_q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_norm.weight)
    q = (c_q @ attn.q_b_proj.weight.T).view(B, T, H, N + P).transpose(1, 2)
    q_c, q_r = q[..., :N], apply_rope(q[..., N:], cos, sin)
    kv_a = x @ attn.kv_a_proj.weight.T
    c_kv, k_r = rms(kv_a[..., :R], attn.kv_a_norm.weight), apply_rope(kv_a[..., R:].unsqueeze(1), cos, sin)
    kv = (c_kv @ attn.kv_b_proj.weight.T).view(B, T, H, N + V).transpose(1, 2)
    k_c, v = kv[..., :N], kv[..., N:]
    scores = (q_c @ k_c.transpose(-1, -2) + q_r @ k_r.transpose(-1, -2)) / math.sqrt(N + P)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * V) @ attn.o_proj.weight.T
    rope = rope_cos_sin(torch.arange(T).expand(B, T), P, model.cfg.rope_base, 1.0)
    fast, _ = attn(x, rope)
    explicit, weights = attn(x, rope, return_attention=True)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=1e-5)
    assert weights.shape == (B, H, T, T)


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=10, num_experts=4, moe_top_k=2, moe_shared_experts=1)])
def test_the_cache_holds_the_latent_and_the_rope_key_and_chunks_equal_one_pass(make_model, kw):
    model = make_model(**MLA, **kw)
    x = torch.randint(0, 64, (2, 11))
    full = model(x).logits
    cache = model.new_kv_cache(2, max_len=11)
    # What MLA is for: per layer and token, the 12-wide latent and the 4-wide rope key, no per-head keys.
    assert [tuple(t.shape) for t in (cache.k_BGSK[0], cache.v_BGSK[0])] == [(2, 1, 11, 12), (2, 1, 11, 4)]
    parts = [model(x[:, a:b], kv_cache=cache).logits for a, b in ((0, 4), (4, 5), (5, 11))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def _generate_without_cache(model, ids_BT, n, attention_mask_BT=None):
    """Greedy decoding with a full forward over the whole sequence at every step (no cache)."""
    mask = attention_mask_BT
    for _ in range(n):
        logits = model(ids_BT, attention_mask_BT=mask).logits[:, -1]
        ids_BT = torch.cat([ids_BT, logits.argmax(-1, keepdim=True)], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids_BT


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=10, num_experts=4, moe_top_k=2, moe_shared_experts=1,
                                             moe_renormalize=False)])
def test_generation_with_the_cache_equals_generation_without_it(make_model, kw):
    model = make_model(seed=3, **MLA, **kw)
    torch.manual_seed(0)
    prompt = torch.randint(0, 64, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # the first row left-padded
    with torch.no_grad():
        for m in (None, mask):
            cached = generate(model, prompt, 8, temperature=0.0, attention_mask_BT=m)
            uncached = _generate_without_cache(model, prompt, 8, m)
            assert torch.equal(cached, uncached)


@pytest.mark.parametrize("kw, message", [
    (dict(attention="flash"), r"attention must be one of \['mha', 'mla'\], got 'flash'"),
    (dict(kv_lora_rank=16), r"kv_lora_rank is an option of attention 'mla'"),
    (dict(v_head_dim=8), r"v_head_dim is an option of attention 'mla'"),
    (dict(attention="mla", pos_encoding="alibi"), r"pos_encoding must be 'rope', got 'alibi'"),
    (dict(attention="mla", num_kv_heads=2), r"num_kv_heads must be None with attention 'mla'"),
    (dict(attention="mla", qk_rope_head_dim=3), r"qk_rope_head_dim must be even"),
    (dict(attention="mla", kv_lora_rank=0), r"kv_lora_rank must be an int >= 1, got 0"),
    (dict(attention="mla", q_lora_rank=True), r"q_lora_rank must be an int >= 1, got True"),
    (dict(moe_first_dense_layers=-1), r"moe_first_dense_layers must be an int >= 0, got -1"),
])
def test_config_errors_name_the_field(make_cfg, kw, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(**kw)


def test_mla_defaults_follow_deepseek_v2_proportions(make_cfg):
    cfg = make_cfg(attention="mla")  # head_dim 8
    assert (cfg.resolved_kv_lora_rank, cfg.q_lora_rank, cfg.resolved_qk_nope_head_dim, cfg.resolved_qk_rope_head_dim,
            cfg.resolved_v_head_dim, cfg.rope_head_dim) == (32, None, 8, 4, 8, 4)


# --------------------------------------------------------------------------- Hugging Face DeepseekV2

HF_CASES = [
    ("dense", dict(**MLA)),
    ("dense_q_lora_tied_rope_scaled", dict(**MLA, q_lora_rank=10, tie_embeddings=True, rope_scaling=2.0,
                                           rope_base=500.0, norm_eps=1e-6)),
    ("moe_shared2_top2_first_dense", dict(**MLA, num_experts=4, moe_top_k=2, moe_shared_experts=2, moe_d_ff=16,
                                          moe_renormalize=False, moe_first_dense_layers=1, n_layers=3)),
    ("moe_no_shared_top1_q_lora", dict(**MLA, q_lora_rank=10, num_experts=3, moe_top_k=1, moe_renormalize=False)),
    ("moe_routed_scaled", dict(**MLA, num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_renormalize=False,
                               moe_routed_scaling_factor=1.5)),
]


@pytest.mark.parametrize("name, kw", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_export_logits_equal_deepseek_v2(make_cfg, tmp_path, name, kw):
    model = _random_model(make_cfg, **kw)
    save_hf(model, model.cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf) is DeepseekV2ForCausalLM
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        ours = model(x).logits
    _check_both_ways(model, hf, tmp_path, x, ours)


def _check_both_ways(model, hf, folder, x, ours) -> None:
    """HF's logits and cached greedy decoding equal ours; the folder loads back to our config and logits;
    HF's own save of it loads back too."""
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours, atol=1e-5, rtol=1e-5)
        # The cached decoding of both models agrees too (HF caches the latent as well).
        assert torch.equal(hf.generate(x[:, :6], max_new_tokens=8, do_sample=False, pad_token_id=0),
                           generate(model, x[:, :6], 8, temperature=0.0))
    back = load_hf(folder).eval()
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(x).logits, ours, atol=0, rtol=0)
    resaved = folder / "resaved"
    hf.save_pretrained(resaved)
    torch.testing.assert_close(load_hf(resaved).eval()(x).logits, ours, atol=1e-6, rtol=1e-6)


IMPORT_CASES = [
    ("dense", dict(q_lora_rank=None, n_routed_experts=0, first_k_dense_replace=2)),
    ("moe", dict(q_lora_rank=10, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                 first_k_dense_replace=0)),
    ("moe_first_layer_dense", dict(n_routed_experts=4, num_experts_per_tok=3, n_shared_experts=1,
                                   first_k_dense_replace=1, n_group=1, topk_group=1)),
]


@pytest.mark.parametrize("name, kw", IMPORT_CASES, ids=[c[0] for c in IMPORT_CASES])
def test_import_of_a_deepseek_v2_checkpoint_equals_it(tmp_path, name, kw):
    """A DeepseekV2 model made by transformers (no Conduit metadata) loads with equal logits."""
    hf_cfg = DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=5, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False, **kw,
    )
    torch.manual_seed(0)
    hf = DeepseekV2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.attention == "mla" and ours.cfg.num_experts == kw["n_routed_experts"]
    assert [b.is_moe for b in ours.layers] == [kw["n_routed_experts"] > 0 and i >= kw["first_k_dense_replace"]
                                               for i in range(2)]
    x = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw, option", [
    (dict(num_experts=2, moe_top_k=1), "moe_renormalize=True"),
    (dict(num_experts=2, moe_top_k=1, moe_renormalize=False, moe_every=2), "moe_every=2"),
    (dict(num_experts=2, moe_top_k=1, moe_renormalize=False, moe_capacity_factor=1.0), "moe_capacity_factor=1.0"),
    (dict(bias=True), "bias=True"),
    (dict(ffn="gelu"), "ffn='gelu'"),
])
def test_unsupported_mla_options_raise(make_cfg, tmp_path, kw, option):
    with torch.device("meta"):
        model = Transformer(make_cfg(**MLA, **kw))
    with pytest.raises(ValueError, match=option):
        save_hf(model, model.cfg, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_load_refuses_deepseek_options_it_cannot_express(tmp_path):
    from safetensors.torch import save_file

    base = dict(model_type="deepseek_v2", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=32, rms_norm_eps=1e-6, kv_lora_rank=12, qk_nope_head_dim=6,
                qk_rope_head_dim=4, v_head_dim=5, intermediate_size=40, moe_intermediate_size=16,
                n_routed_experts=4, num_experts_per_tok=2)
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    for extra, message in ((dict(topk_method="group_limited_greedy"), "topk_method"),
                           (dict(model_type="deepseek_v3", rope_interleave=False), "rope_interleave")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(ValueError, match=message):
            load_hf(tmp_path)


# --------------------------------------------------------------------------- Hugging Face DeepseekV3

V3 = dict(**MLA, moe_router="sigmoid")
V3_CASES = [
    ("groups_bias_shared_first_dense", dict(**V3, num_experts=8, moe_top_k=2, moe_n_group=4, moe_topk_group=2,
                                            moe_shared_experts=1, moe_d_ff=16, moe_first_dense_layers=1, n_layers=3,
                                            moe_routed_scaling_factor=2.5)),
    ("one_group_top1_unnormalised_q_lora", dict(**V3, q_lora_rank=10, num_experts=4, moe_top_k=1,
                                                moe_renormalize=False)),
    ("two_shared_one_of_two_groups_tied", dict(**V3, num_experts=6, moe_top_k=3, moe_n_group=2, moe_topk_group=1,
                                               moe_shared_experts=2, moe_d_ff=16, tie_embeddings=True,
                                               moe_bias_update_rate=0.01)),
]


def _random_v3(make_cfg, **kw) -> Transformer:
    """Random weights and a random selection bias of both signs in every MoE layer, large enough to change
    which experts and groups win (checked by the caller)."""
    model = _random_model(make_cfg, **kw)
    torch.manual_seed(2)
    for block in model.layers:
        if block.is_moe:
            block.ffn.score_bias.copy_(torch.randn(model.cfg.num_experts) * 0.3)
    return model


@pytest.mark.parametrize("name, kw", V3_CASES, ids=[c[0] for c in V3_CASES])
def test_export_logits_equal_deepseek_v3(make_cfg, tmp_path, name, kw):
    model = _random_v3(make_cfg, **kw)
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, 24))
    # The bias matters: without it the routing, and so the logits, differ.
    unbiased = _random_model(make_cfg, **kw)
    with torch.no_grad():
        ours = model(x).logits
        assert not torch.allclose(unbiased(x).logits, ours, atol=1e-3)
    save_hf(model, model.cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["n_group"] == model.cfg.moe_n_group
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf) is DeepseekV3ForCausalLM
    moe = next(i for i, b in enumerate(model.layers) if b.is_moe)
    torch.testing.assert_close(hf.model.layers[moe].mlp.gate.e_score_correction_bias,
                               model.layers[moe].ffn.score_bias, atol=0, rtol=0)
    _check_both_ways(model, hf, tmp_path, x, ours)


@pytest.mark.parametrize("kw", [
    dict(n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
         routed_scaling_factor=2.5, q_lora_rank=None),
    dict(n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False,
         routed_scaling_factor=1.0, q_lora_rank=10),
], ids=["groups_first_dense", "one_group_q_lora"])
def test_import_of_a_deepseek_v3_checkpoint_equals_it(tmp_path, kw):
    """A DeepseekV3 model made by transformers, selection bias included, loads with equal logits."""
    hf_cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=5, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False, n_routed_experts=8,
        num_experts_per_tok=2, **kw,
    )
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for layer in hf.model.layers[kw["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    c = ours.cfg
    assert (c.moe_router, c.moe_n_group, c.moe_topk_group, c.moe_renormalize, c.moe_routed_scaling_factor) == (
        "sigmoid", kw["n_group"], kw["topk_group"], kw["norm_topk_prob"], kw["routed_scaling_factor"])
    assert [b.is_moe for b in ours.layers] == [i >= kw["first_k_dense_replace"] for i in range(2)]
    torch.testing.assert_close(ours.layers[1].ffn.score_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias,
                               atol=0, rtol=0)
    x = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw, option", [
    (dict(**MLA, num_experts=4, moe_top_k=2, moe_renormalize=False, moe_n_group=2), "moe_n_group=2"),
    (dict(**V3, num_experts=4, moe_top_k=2, moe_capacity_factor=1.0), "moe_capacity_factor=1.0"),
    (dict(**V3, num_experts=4, moe_top_k=2, moe_every=2), "moe_every=2"),
    (dict(**V3, num_experts=1, moe_top_k=1), "num_experts=1"),
    (dict(num_experts=4, moe_top_k=2, moe_router="sigmoid"), "moe_router='sigmoid'.*DeepseekV3"),
    (dict(num_experts=4, moe_top_k=2, moe_routed_scaling_factor=2.0), "moe_routed_scaling_factor=2.0"),
])
def test_router_options_a_class_cannot_express_are_refused_by_name(make_cfg, tmp_path, kw, option):
    with torch.device("meta"):
        model = Transformer(make_cfg(**kw))
    with pytest.raises(ValueError, match=option):
        save_hf(model, model.cfg, tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("name", ["cpu_mla_moe", "mla_moe_32x_top4"])
def test_mla_presets_export_to_deepseek_v2(name):
    from models import PRESETS
    from models.export import hf_unsupported_options

    cfg = PRESETS[name]
    assert cfg.attention == "mla" and cfg.num_experts > 0 and cfg.moe_shared_experts > 0
    assert hf_unsupported_options(cfg) == []
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]  # DeepSeek's first layer is dense

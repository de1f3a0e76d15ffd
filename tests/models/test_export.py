"""Export: our safetensors format round-trips; HF Llama/Mixtral logits equal ours; unsupported options raise."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM, MixtralForCausalLM

from models import Transformer
from tests.models.conftest import random_model
from models.export import load_hf, load_safetensors, read_config, save_hf, save_safetensors


_random_model = random_model


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(tie_embeddings=True, num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_every=2, n_layers=3)],
)
def test_own_format_round_trip(make_cfg, tmp_path, kw):
    model = _random_model(make_cfg, **kw)
    path = tmp_path / "model.safetensors"
    save_safetensors(model, model.cfg, path)
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["conduit_model_config"]) == model.cfg.to_dict()
        if model.cfg.tie_embeddings:
            assert "lm_head.weight" not in f.keys()
    assert read_config(path) == model.cfg
    loaded = load_safetensors(path)
    assert loaded.cfg == model.cfg
    if model.cfg.tie_embeddings:
        assert loaded.lm_head.weight is loaded.tok_embeddings.weight
    x = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(loaded.eval()(x).logits, model(x).logits, atol=0, rtol=0)


def test_own_format_errors(make_cfg, tmp_path):
    model = _random_model(make_cfg)
    with pytest.raises(ValueError, match="cfg differs"):
        save_safetensors(model, model.cfg.replace(dropout=0.1), tmp_path / "x.safetensors")
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ValueError, match="conduit_model_config"):
        load_safetensors(tmp_path / "foreign.safetensors")


HF_CASES = [
    ("llama_mha", dict(), LlamaForCausalLM),
    ("llama_gqa_tied", dict(num_kv_heads=2, tie_embeddings=True, rope_base=500.0), LlamaForCausalLM),
    ("llama_mqa_rope_scaled", dict(num_kv_heads=1, rope_scaling=4.0, norm_eps=1e-6), LlamaForCausalLM),
    ("mixtral_top2_gqa", dict(num_experts=4, moe_top_k=2, num_kv_heads=2, moe_d_ff=48), MixtralForCausalLM),
    ("mixtral_top1_tied", dict(num_experts=3, moe_top_k=1, tie_embeddings=True), MixtralForCausalLM),
]


@pytest.mark.parametrize("name, kw, hf_class", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_hf_logits_equal_ours(make_cfg, tmp_path, name, kw, hf_class):
    model = _random_model(make_cfg, **kw)
    save_hf(model, model.cfg, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf) is hf_class
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        ours, theirs = model(x).logits, hf(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)

    # load_hf reads it back exactly, also after transformers re-saved it in its own way.
    back = load_hf(tmp_path).eval()
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(x).logits, ours, atol=0, rtol=0)
    resaved = tmp_path / "resaved"
    hf.save_pretrained(resaved)
    torch.testing.assert_close(load_hf(resaved).eval()(x).logits, ours, atol=1e-6, rtol=1e-6)


def test_hf_export_with_dtype_and_extra_config(make_cfg, tmp_path):
    model = _random_model(make_cfg)
    save_hf(model.state_dict(), model.cfg, tmp_path, dtype=torch.bfloat16, extra_config={"eos_token_id": 2})
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["eos_token_id"] == 2 and cfg_json["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="hidden_size"):
        save_hf(model, model.cfg, tmp_path / "x", extra_config={"hidden_size": 3})


@pytest.mark.parametrize(
    "kw, option",
    [
        (dict(pos_encoding="alibi"), "pos_encoding='alibi'"),
        (dict(pos_encoding="sinusoidal"), "pos_encoding='sinusoidal'"),
        (dict(pos_encoding="learned"), "pos_encoding='learned'"),
        (dict(norm_position="post"), "norm_position='post'"),
        (dict(ffn="gelu"), "ffn='gelu'"),
        (dict(ffn="relu"), "ffn='relu'"),
        (dict(norm="layernorm"), "norm='layernorm'"),
        (dict(bias=True), "bias=True"),
        (dict(num_experts=2, moe_top_k=1, moe_shared_experts=1), "moe_shared_experts=1"),
        (dict(num_experts=2, moe_top_k=1, moe_every=2), "moe_every=2"),
        (dict(num_experts=2, moe_top_k=1, moe_first_dense_layers=1), "moe_first_dense_layers=1"),
        (dict(num_experts=2, moe_top_k=1, moe_capacity_factor=1.5), "moe_capacity_factor=1.5"),
        (dict(num_experts=2, moe_top_k=1, moe_renormalize=False), "moe_renormalize=False"),
    ],
)
def test_unsupported_options_raise(make_cfg, tmp_path, kw, option):
    with torch.device("meta"):
        model = Transformer(make_cfg(**kw))
    with pytest.raises(ValueError, match=option.replace("(", r"\(")):
        save_hf(model, model.cfg, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_load_hf_rejects_foreign_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model_type"):
        load_hf(tmp_path)

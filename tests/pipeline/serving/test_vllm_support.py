"""deploy.engine's choice: the table of what vLLM serves, read from real exports' config.json, and the
engine chosen (or refused) before anything starts. The served vLLM deployment is tests/jobs/test_deploy_vllm.py."""

from __future__ import annotations

import json

import pytest

from models import PRESETS, build_model
from models.export import save_hf
from pipeline.config import ConfigError, DeploySection, load_config
from pipeline.serving import deploy, vllm_support


def _exported(tmp_path, name: str, **changes) -> dict:
    """config.json of a real export of preset ``name`` (with ``changes``)."""
    cfg = PRESETS[name].replace(**changes)
    save_hf(build_model(cfg), cfg, tmp_path / name)
    return json.loads((tmp_path / name / "config.json").read_text())


def test_the_table_answers_from_the_exports_config(tmp_path):
    dense32 = _exported(tmp_path, "debug_dense", n_heads=2, num_kv_heads=1)
    assert dense32["architectures"] == ["LlamaForCausalLM"] and vllm_support.head_size(dense32) == 32
    assert vllm_support.check(dense32, "cpu").ok and vllm_support.check(dense32, "gpu").ok
    dense16 = _exported(tmp_path, "debug_dense")  # 4 heads of 16
    verdict = vllm_support.check(dense16, "cpu")
    assert not verdict.ok and "head size 16" in verdict.reason and "LlamaForCausalLM on CPU" in verdict.reason
    assert vllm_support.check(dense16, "gpu").ok
    mamba = _exported(tmp_path, "debug_mamba")
    assert "Mamba-1" in vllm_support.check(mamba, "cpu").reason and vllm_support.check(mamba, "gpu").ok
    mamba2 = _exported(tmp_path, "debug_mamba2")
    assert vllm_support.check(mamba2, "cpu").ok  # no attention: no head size to check
    mla = _exported(tmp_path, "cpu_mla_moe", moe_router="sigmoid", moe_renormalize=True)
    assert mla["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "MLA" in vllm_support.check(mla, "cpu").reason and vllm_support.check(mla, "gpu").ok
    assert "no Hugging Face export" in vllm_support.check(None, "cpu", "not exported: pos_encoding='alibi'").reason
    assert "alibi" in vllm_support.check(None, "cpu", "not exported: pos_encoding='alibi'").reason
    assert "not in Conduit's table" in vllm_support.check({"architectures": ["GPT2LMHeadModel"]}, "gpu").reason
    with pytest.raises(ValueError, match="hardware"):
        vllm_support.check(dense32, "tpu")


def test_deepseek_v3_export_says_how_it_routes_as_deepseek_writes_it(tmp_path):
    """vLLM creates the router's e_score_correction_bias only for topk_method noaux_tc."""
    mla = _exported(tmp_path, "cpu_mla_moe", moe_router="sigmoid", moe_renormalize=True)
    assert (mla["topk_method"], mla["scoring_func"]) == ("noaux_tc", "sigmoid")
    v2 = _exported(tmp_path, "cpu_mla_moe")
    assert v2["architectures"] == ["DeepseekV2ForCausalLM"] and v2["topk_method"] == "greedy"


def test_engine_setting_is_checked_and_the_choice_says_why(tmp_path):
    with pytest.raises(ConfigError, match="deploy.engine='tgi' must be 'auto', 'vllm' or 'conduit'"):
        load_config(None, ["deploy.engine=tgi"])
    with pytest.raises(ConfigError, match="deploy.vllm_kv_cache_gib=0.0 must be > 0"):
        load_config(None, ["deploy.vllm_kv_cache_gib=0"])
    assert load_config(None, []).deploy.engine == "auto"
    # No registry is asked before the interpreter is found: these need no MLflow server.
    choice = deploy.choose_engine(DeploySection(engine="conduit"), "sqlite:///unused.db", "m", 1)
    assert (choice.engine, choice.reason) == ("conduit", "deploy.engine is conduit")
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    choice = deploy.choose_engine(DeploySection(vllm_python=missing), "sqlite:///unused.db", "m", 1)
    assert choice.engine == "conduit" and f"no vLLM interpreter at {missing}" in choice.reason
    with pytest.raises(deploy.DeployError, match="deploy.engine is vllm, but vLLM cannot serve m v1 here: no vLLM"):
        deploy.choose_engine(DeploySection(engine="vllm", vllm_python=missing), "sqlite:///unused.db", "m", 1)
    import sys  # an interpreter without vLLM: this one
    choice = deploy.choose_engine(DeploySection(vllm_python=sys.executable), "sqlite:///unused.db", "m", 1)
    assert choice.engine == "conduit" and "cannot import vllm" in choice.reason
    assert deploy.vllm_python(DeploySection(vllm_python="")) is None
    assert deploy.vllm_python(DeploySection()).endswith("/.venv-vllm/bin/python")

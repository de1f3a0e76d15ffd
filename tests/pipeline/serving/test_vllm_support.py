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
    # GPU replicas: no registry is asked before the interpreter is found (these need no MLflow server)
    choice = deploy.choose_engine(DeploySection(engine="conduit"), "sqlite:///unused.db", "m", 1)
    assert (choice.engine, choice.reason) == ("conduit", "deploy.engine is conduit")
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    gpu = {"num_gpus_per_replica": 1.0}
    choice = deploy.choose_engine(DeploySection(vllm_python=missing, **gpu), "sqlite:///unused.db", "m", 1)
    assert choice.engine == "conduit"
    assert choice.reason == (f"auto: vLLM cannot serve it: no vLLM interpreter at {missing} (deploy.vllm_python): "
                             "build it with `make install-vllm`")
    with pytest.raises(deploy.DeployError, match="deploy.engine is vllm, but vLLM cannot serve m v1 here: no vLLM "
                                                 "interpreter at .* build it with `make install-vllm`"):
        deploy.choose_engine(DeploySection(engine="vllm", vllm_python=missing), "sqlite:///unused.db", "m", 1)
    import sys  # an interpreter without vLLM: this one
    choice = deploy.choose_engine(DeploySection(vllm_python=sys.executable, **gpu), "sqlite:///unused.db", "m", 1)
    assert choice.engine == "conduit" and choice.reason.endswith(
        f"{sys.executable} cannot import vllm (deploy.vllm_python): build .venv-vllm with `make install-vllm`")
    assert deploy.vllm_python(DeploySection(vllm_python="")) is None
    assert deploy.vllm_python(DeploySection()).endswith("/.venv-vllm/bin/python")


def test_on_cpu_vllm_counts_as_faster_only_where_the_benchmark_measured_it_faster(tmp_path):
    """benchmarks/RESULTS.md, serve_vllm: vLLM through Serve 0.75x Conduit's engine's tokens/s at cpu_small
    (hidden size 128), 1.79x at gpt_125m (hidden size 768); nothing else measured."""
    cpu_small = _exported(tmp_path, "cpu_small")
    assert vllm_support.faster_on_cpu(cpu_small) == (False, (
        "on CPU replicas Conduit's engine answers faster than vLLM below hidden size 768 (LlamaForCausalLM of "
        "hidden size 128 here): benchmarks/RESULTS.md, serve_vllm"))
    gpt_125m = {**cpu_small, "hidden_size": PRESETS["gpt_125m"].d_model}  # its config.json's width
    assert vllm_support.faster_on_cpu(gpt_125m) == (True, (
        "on CPU replicas vLLM answers faster than Conduit's engine from hidden size 768 (LlamaForCausalLM of "
        "hidden size 768 here): benchmarks/RESULTS.md, serve_vllm"))
    mixtral = _exported(tmp_path, "cpu_moe")
    assert mixtral["architectures"] == ["MixtralForCausalLM"]
    assert vllm_support.faster_on_cpu({**mixtral, "hidden_size": 4096}) == (False, (
        "on CPU replicas vLLM answered faster than Conduit's engine only for LlamaForCausalLM from hidden size "
        "768, not MixtralForCausalLM: benchmarks/RESULTS.md, serve_vllm"))
    assert vllm_support.faster_on_cpu(None)[0] is False
    assert "not a version without a Hugging Face export" in vllm_support.faster_on_cpu(None)[1]

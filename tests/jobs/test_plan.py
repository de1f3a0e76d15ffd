"""python -m jobs.plan: every shipped config plans, its JSON carries the terms and the peak, bad input gets one
error naming the field; jobs.run --dry-run shows the same plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import plan as plan_cli
from jobs import run as run_cli

CONFIGS = sorted(p.name for p in Path("configs").glob("*.yaml"))
CPU_FLOPS = ["--cpu-flops", "1e11"]  # the cpu row at a stated peak: no timing in tests


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cluster_of(config: str) -> str:
    """Each config on a cluster its layout divides: the GPU configs' 8 workers on one H100 node."""
    return "1x8xH100" if config.startswith("gpu_") else "1x2xcpu"


@pytest.mark.parametrize("config", CONFIGS)
def test_every_shipped_config_plans(capsys, config):
    """The CLI's plumbing: the config, --cluster and --tokens reach the plan, and the JSON carries every
    term and the peak they make. The numbers themselves are checked against independent figures in
    tests/pipeline/plan/: model states against DeepSpeed's estimators (test_deepspeed_estimators.py) and a
    real step's bytes (test_measured_step.py), FLOPs against counted matmuls (test_measured_step.py) and
    Llama 3 405B's published budget (test_published.py), activations against a measured step
    (test_activations.py), communication against a gloo run's collectives (test_communication.py)."""
    code, out, _ = run_plan(capsys, f"configs/{config}", "--cluster", cluster_of(config), *CPU_FLOPS, "--json",
                            "--tokens", "1e9")
    assert code == 0
    plan = json.loads(out)
    assert plan["fits"] and plan["peak"] == sum(plan["memory"].values())
    assert plan["setup"]["world"] == int(cluster_of(config).split("x")[1]) and plan["tokens"] == 10**9
    assert plan["step"]["step_s"] > 0 and plan["budget_device_hours"] > 0


def test_text_plan_names_every_term_and_the_verdict(capsys):
    code, out, _ = run_plan(capsys, "configs/gpu_1b.yaml", "--cluster", "2x8xH100", "train.global_batch_size=256")
    assert code == 0
    for term in ("weights", "gradients", "optimizer", "deepspeed_buffers", "activations", "loss_output",
                 "backward_and_logits_transient", "peak", "fits", "KV cache", "tokens/s", "device-hours"):
        assert term in out, term


def test_a_config_that_does_not_fit_exits_1_with_the_cheapest_change(capsys):
    code, out, _ = run_plan(capsys, "configs/gpu_mla_moe.yaml", "--cluster", "1x8xL4", "train.zero_stage=0")
    assert code == 1
    assert "DOES NOT FIT" in out and "the cheapest change that fits: train.zero_stage=1" in out


@pytest.mark.parametrize("argv,message", [
    (["configs/gpu_1b.yaml", "--cluster", "1x8xB300"], "--cluster: unknown device type 'B300'; known: H100, H200"),
    (["configs/gpu_1b.yaml", "--cluster", "8 H100"], "--cluster '8 H100': write NODESxGPUSxTYPE"),
    (["configs/gpu_1b.yaml", "--cluster", "1x12xH100"],
     "train.global_batch_size=128 must be a multiple of the world (12 devices on --cluster 1x12xH100) x "
     "train.micro_batch_size_per_rank=4 = 48"),
    (["configs/gpu_1b.yaml", "--cluster", "1x6xH100", "parallel.sequence_parallel_size=4", "parallel.num_workers=4",
      "train.global_batch_size=4"],
     "parallel.sequence_parallel_size=4 must divide the world (6 devices on --cluster 1x6xH100)"),
    (["configs/gpu_moe.yaml", "--cluster", "1x4xH100"],
     "parallel.ep_size=8 must divide the world (4 devices on --cluster 1x4xH100)"),
    (["configs/gpu_1b.yaml", "--cluster", "1x8xH100", "train.micro_batch_size_per_rank=3"],
     # config validation refuses it first, on the config's own workers
     "train.global_batch_size=128 must be a multiple of parallel.num_workers=8 x train.micro_batch_size_per_rank=3"),
    (["configs/gpu_1b.yaml", "--cluster", "1x8xH100", "--mfu", "1.5"], "--mfu 1.5"),
])
def test_bad_input_is_one_error_naming_the_field(capsys, argv, message):
    code, out, err = run_plan(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_run_dry_run_shows_the_plan(capsys, tmp_path):
    code = run_cli.main(["configs/smoke.yaml", "--dry-run", f"run.workdir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "plan of the train stage on the config's own cluster (1x2xcpu" in out
    assert "peak" in out and "tokens/s" in out


def test_submit_dry_run_shows_the_plan_before_it_submits(capsys, monkeypatch, tmp_path):
    from jobs import submit

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CONDUIT_INFRA_ENV", str(tmp_path / "absent.env"))  # no cluster to submit to
    code = submit.main(["configs/smoke.yaml", "--dry-run", f"run.workdir={tmp_path}"])
    err = capsys.readouterr().err
    assert "plan of the train stage on the config's own cluster (1x2xcpu" in err and "peak" in err
    assert code == 2 and "error:" in err  # then it finds no cluster, as without --dry-run

"""A training worker killed mid-run: Ray Train restarts the group from the latest checkpoint and
the run ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipeline import tracking
from pipeline.config import load_config
from pipeline.runner import make_plan, resolve
from pipeline.stages import execute_stage

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def train_worker_pids() -> list[int]:
    """Pids of this session's Ray Train workers: children of our own raylet, whatever other Ray
    clusters share the machine (the state API needs a dashboard, which the test cluster lacks)."""
    import psutil
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "RayTrainWorker" not in cmd:
            continue
        parent = proc.parent()
        if parent is not None and session in " ".join(parent.cmdline()):
            pids.append(proc.info["pid"])
    return pids


def kill_a_worker_after_checkpoints(ray_dir: Path, killed: list[int]) -> None:
    deadline = time.time() + 120
    # Two checkpoints on disk: the controller has surely registered the first by then.
    while len(list(ray_dir.glob("checkpoint_*"))) < 2 or len(train_worker_pids()) < 2:
        if time.time() > deadline:
            return  # the test then fails on `killed` being empty
        time.sleep(0.02)
    pid = max(train_worker_pids())
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)


def train_once(tmp: Path, name: str, overrides: list[str], kill: bool):
    work = tmp / name
    cfg = resolve(load_config(ROOT / "configs" / "smoke.yaml", [
        f"run.workdir={work}", "train.steps=200", "train.checkpoint_every=20", "train.log_every=10",
        "train.progress_bar=false", *overrides,
    ]))
    uri = cfg.tracking_uri()
    work.mkdir(parents=True)
    exp = tracking.ensure_experiment(uri, "fault", artifact_location=str(work / "mlartifacts"))
    plan = {p.stage: p for p in make_plan(cfg)}
    arts = {}
    for stage in ("shard", "tokenizer", "tokenize", "train"):
        tracker = tracking.StageTracker(uri, tracking.start_run(uri, exp, stage))
        killed: list[int] = []
        killer = None
        if stage == "train" and kill:
            killer = threading.Thread(target=kill_a_worker_after_checkpoints,
                                      args=(plan["train"].path / "ray" / "train", killed))
            killer.start()
        arts[stage] = execute_stage(stage, cfg, plan[stage].hash, plan[stage].path, arts, tracker)
        if killer:
            killer.join()
    history = json.loads((arts["train"].path / "train_metrics.json").read_text())
    return load_file(arts["train"].path / "model.safetensors"), history, killed


def test_killed_worker_resumes_from_checkpoint_exactly(tmp_path, ray_cluster):
    straight, straight_history, _ = train_once(tmp_path, "straight", [], kill=False)
    resumed, resumed_history, killed = train_once(tmp_path, "killed", ["train.max_failures=1"], kill=True)
    assert len(killed) == 1
    # Rank 0's history restarts with the restored run: its first logged step is past a checkpoint.
    assert resumed_history[0]["step"] > 20
    assert resumed_history[-1]["step"] == straight_history[-1]["step"] == 200
    assert resumed_history[-1]["loss"] == straight_history[-1]["loss"]
    assert straight.keys() == resumed.keys()
    assert all((straight[k] == resumed[k]).all() for k in straight)

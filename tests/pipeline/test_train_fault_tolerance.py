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
from pipeline.stages import STAGES

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


def registered_checkpoints(ray_dir: Path) -> int:
    """Checkpoints the Ray Train controller has registered (a folder on disk may not be yet)."""
    snapshot = ray_dir / "checkpoint_manager_snapshot.json"
    try:
        return len(json.loads(snapshot.read_text())["checkpoint_results"])
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being rewritten
        return 0


def kill_a_worker_after_checkpoints(ray_dir: Path, killed: list[int], done: threading.Event) -> None:
    while registered_checkpoints(ray_dir) < 1 or len(train_worker_pids()) < 2:
        if done.is_set():
            return  # training ended first; the test then fails on `killed` being empty
        time.sleep(0.02)
    pid = max(train_worker_pids())
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)


def train_once(tmp: Path, name: str, overrides: list[str], kill: bool):
    work = tmp / name
    cfg = resolve(load_config(ROOT / "configs" / "smoke.yaml", [
        f"run.workdir={work}", "train.steps=200", "train.checkpoint_every=20", "train.log_every=10",
        # adam_eps 1e-4: the resume on another world size is compared to 1e-5, and a tiny eps turns
        # rounding differences of near-zero gradients into lr-sized steps (see dist_checks.py).
        "train.progress_bar=false", "train.adam_eps=0.0001", *overrides,
    ]))
    uri = cfg.tracking_uri()
    work.mkdir(parents=True)
    exp = tracking.ensure_experiment(uri, "fault", artifact_location=str(work / "mlartifacts"))
    plan = {p.stage: p for p in make_plan(cfg)}
    arts = {}
    for stage in ("shard", "tokenizer", "tokenize", "train"):
        tracker = tracking.StageTracker(uri, tracking.start_run(uri, exp, stage))
        killed: list[int] = []
        killer, done = None, threading.Event()
        if stage == "train" and kill:
            killer = threading.Thread(target=kill_a_worker_after_checkpoints,
                                      args=(plan["train"].path / "ray" / "train", killed, done))
            killer.start()
        try:
            arts[stage] = STAGES[stage].execute(cfg, plan[stage].hash, plan[stage].path, arts, tracker)
        finally:
            done.set()
            if killer:
                killer.join()
    history = json.loads((arts["train"].path / "train_metrics.json").read_text())
    return load_file(arts["train"].path / "model.safetensors"), history, killed, arts["train"].path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, ray_cluster):
    return train_once(tmp_path_factory.mktemp("straight"), "straight", [], kill=False)


def test_killed_worker_resumes_from_checkpoint_exactly(tmp_path, straight):
    straight, straight_history, _, _ = straight
    resumed, resumed_history, killed, _ = train_once(tmp_path, "killed", ["train.max_failures=1"], kill=True)
    assert len(killed) == 1
    # Rank 0's history restarts with the restored run: its first logged step is past a checkpoint.
    assert resumed_history[0]["step"] > 20
    assert resumed_history[-1]["step"] == straight_history[-1]["step"] == 200
    assert resumed_history[-1]["loss"] == straight_history[-1]["loss"]
    assert straight.keys() == resumed.keys()
    assert all((straight[k] == resumed[k]).all() for k in straight)


def test_resume_on_one_worker_from_a_checkpoint_on_s3(tmp_path, straight, moto_s3):
    """2 workers trained to step 180; that checkpoint, copied to S3 (a moto server), is continued by
    1 worker (``train.resume_from=s3://...``, through the layout-independent canonical.pt since the
    world size differs) to step 200: same weights as the 2-worker run, and its own checkpoint is
    reported to ``train.checkpoint_storage=s3://...``."""
    import pyarrow.fs as pafs

    weights, _, _, train_dir = straight
    first_kept = sorted((train_dir / "ray" / "train").glob("checkpoint_*"))[0]  # keep_checkpoints=2: 180, 200
    assert json.loads((first_kept / "layout.json").read_text()) == {"world_size": 2, "ep_size": 1, "zero_stage": 1}
    query = f"endpoint_override={moto_s3}&scheme=http"
    fs = pafs.S3FileSystem(endpoint_override=moto_s3, scheme="http", allow_bucket_creation=True)
    fs.create_dir("conduit-ckpt")
    pafs.copy_files(str(first_kept), f"conduit-ckpt/from/{first_kept.name}",
                    source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    resumed, history, _, _ = train_once(tmp_path, "s3", [
        "parallel.num_workers=1", f"train.resume_from=s3://conduit-ckpt/from/{first_kept.name}?{query}",
        f"train.checkpoint_storage=s3://conduit-ckpt/runs?{query}"], kill=False)
    assert history[0]["step"] == 190
    assert max((weights[k] - resumed[k]).abs().max().item() for k in weights) < 1e-5
    written = [i.path for i in fs.get_file_info(pafs.FileSelector("conduit-ckpt/runs", recursive=True))]
    final = [p for p in written if p.endswith("/layout.json")]
    assert len(final) == 1 and f"{final[0].rsplit('/', 1)[0]}/canonical.pt" in written

"""Two pipelines training on one Ray cluster share its CPUs honestly: each training worker runs as many
threads as the CPUs Ray reserved for it (``device.worker_cpus``, ``engine.local_threads``).

Each run is ``python -m jobs.run configs/smoke.yaml --only train`` as a user starts it, on the session's
Ray cluster (4 logical CPUs on the machine's 2 cores), with the session smoke run's data stages found
cached, one training worker and an MLflow database of its own. What each worker reserved and ran is read
from its train run's tags, and when it trained from the timestamps of its logged losses.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _start(work: Path, artifact_root: str, gcs: str, lr: str, steps: int, *extra: str) -> subprocess.Popen:
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={work}",
           f"run.artifact_root={artifact_root}", f"checkpoint.storage={work / 'checkpoints'}",
           "parallel.num_workers=1", f"train.steps={steps}", f"optimizer.lr={lr}", "validation.every=0",
           # what is tested is the CPUs each run holds: no timing of precision and compile before training
           "train.precision=fp32", "train.compile=false",
           "tracking.system_metrics_every_s=0", *extra, "--only", "train"]
    with open(work / "driver.log", "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": gcs}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _train_run(work: Path):
    """The run's train stage in its MLflow database (None until it exists), with its loss history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("conduit") if (work / "mlflow.db").exists() else None
    if experiment is None:
        return None, []
    runs = client.search_runs([experiment.experiment_id], "tags.`conduit.stage` = 'train'")
    if not runs:
        return None, []
    return runs[0], client.get_metric_history(runs[0].info.run_id, "loss")


def _finish(proc: subprocess.Popen, work: Path, timeout_s: float = 600):
    assert proc.wait(timeout=timeout_s) == 0, (work / "driver.log").read_text()[-3000:]
    run, losses = _train_run(work)
    assert run is not None and losses, (work / "driver.log").read_text()[-3000:]
    return run.data.tags, min(m.timestamp for m in losses), max(m.timestamp for m in losses)


def _has_logged_a_loss(work: Path) -> bool:
    """Whether the run has logged a loss, read from its database without MLflow: an MLflow client opened
    while the run is still creating the database runs the schema migrations beside the run's own, and one
    of the two fails (a CI run lost its first run to ``AttributeError: dimension_attributes``)."""
    if not (work / "mlflow.db").exists():
        return False
    try:
        with closing(sqlite3.connect(f"file:{work / 'mlflow.db'}?mode=ro", uri=True, timeout=1)) as db:
            return db.execute("SELECT 1 FROM metrics WHERE key = 'loss' LIMIT 1").fetchone() is not None
    except sqlite3.OperationalError:  # no metrics table yet, or the run holds a write lock
        return False


def _wait_for_training(work: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (work / "driver.log").read_text()[-3000:]
        if _has_logged_a_loss(work):
            return
        time.sleep(0.5)
    raise AssertionError(f"no loss logged in {timeout_s} s: {(work / 'driver.log').read_text()[-3000:]}")


def test_a_second_run_waits_for_cpus_rather_than_running_threads_on_the_first_runs_cores(
        tmp_path, ray_cluster, smoke_artifact_root):
    """Neither run sets threads_per_worker. The first takes every free CPU (all 4 logical ones) and runs
    2 threads (the machine's 2 cores, its one worker's share); the second, started while the first
    trains, finds none free, reserves one and trains only after the first has finished: never 4 threads
    on 2 cores."""
    gcs = ray_cluster.get_runtime_context().gcs_address
    assert ray_cluster.available_resources().get("CPU") == 4.0, "another test left CPUs reserved"
    first = _start(tmp_path / "first", smoke_artifact_root, gcs, "0.00311", 400)
    _wait_for_training(tmp_path / "first", first)
    second = _start(tmp_path / "second", smoke_artifact_root, gcs, "0.00312", 30)
    tags1, start1, end1 = _finish(first, tmp_path / "first")
    tags2, start2, end2 = _finish(second, tmp_path / "second")
    cores = os.cpu_count()
    assert (tags1["cpus_per_worker"], tags1["threads_per_worker"]) == ("4", str(min(4, cores)))
    assert (tags2["cpus_per_worker"], tags2["threads_per_worker"]) == ("1", "1")
    assert start2 > end1, "the second run trained while the first still held the CPUs"


def test_two_runs_given_a_share_each_train_side_by_side_on_their_shares(tmp_path, ray_cluster,
                                                                        smoke_artifact_root):
    """Both set ``parallel.threads_per_worker=1``: each reserves one CPU and runs one thread, and they
    train at the same time."""
    gcs = ray_cluster.get_runtime_context().gcs_address
    runs = {name: _start(tmp_path / name, smoke_artifact_root, gcs, lr, 150, "parallel.threads_per_worker=1")
            for name, lr in (("a", "0.00313"), ("b", "0.00314"))}
    (tags_a, start_a, end_a), (tags_b, start_b, end_b) = (_finish(p, tmp_path / n) for n, p in runs.items())
    for tags in (tags_a, tags_b):
        assert (tags["cpus_per_worker"], tags["threads_per_worker"]) == ("1", "1")
    assert start_a < end_b and start_b < end_a, "the two runs did not train at the same time"

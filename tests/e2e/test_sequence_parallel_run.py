"""Sequence parallelism through the pipeline: ``configs/smoke.yaml`` trained by two workers that split every
sequence between them (``parallel.sequence_parallel_size=2``: data parallelism of 1, two micro-steps of
accumulation) ends at the weights of the session's smoke run, whose two workers split the batch instead:
the same global batches, the same loss, another layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.store.contracts import WEIGHTS_FILE, read_train_precision

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_two_workers_splitting_each_sequence_train_the_smoke_runs_weights(tmp_path, ray_cluster, smoke,
                                                                          smoke_artifact_root):
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    cfg, result, _, _ = smoke
    assert read_train_precision(result.artifacts["train"].path)["precision"] == "fp32"  # what SP runs in (auto)
    cmd = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={tmp_path}",
           f"run.artifact_root={smoke_artifact_root}", f"checkpoint.storage={tmp_path / 'checkpoints'}",
           "parallel.sequence_parallel_size=2", "tracking.system_metrics_every_s=0", "--only", "train"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("conduit").experiment_id],
                                "tags.`conduit.stage` = 'train'")
    tags = run.data.tags
    assert tags["precision"] == "fp32" and tags["precision.auto"].startswith("not measured: sequence parallelism")
    split = load_file(Path(smoke_artifact_root) / "train" / tags["conduit.hash"] / WEIGHTS_FILE)
    whole = load_file(result.artifacts["train"].path / WEIGHTS_FILE)
    assert split.keys() == whole.keys()
    assert max((split[k] - whole[k]).abs().max().item() for k in whole) < 1e-5
    # validation (at steps 50, 100 and 150) splits its sequences too, and sums to the same loss
    smoke_client = MlflowClient(result.tracking_uri)
    (smoke_train,) = smoke_client.search_runs(
        [smoke_client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
        f"tags.`conduit.hash` = '{result.artifacts['train'].hash}' and tags.`conduit.stage` = 'train'")
    ours, theirs = ({m.step: m.value for m in c.get_metric_history(r.info.run_id, "val_loss")}
                    for c, r in ((client, run), (smoke_client, smoke_train)))
    assert sorted(ours) == sorted(theirs) == [50, 100, 150]
    assert all(abs(ours[s] - theirs[s]) < 1e-5 for s in ours), (ours, theirs)


def test_what_cannot_be_split_is_refused_by_name_before_any_stage(tmp_path, ray_cluster, smoke_artifact_root):
    """As a user types it: sp that does not divide the workers stops at load (exit 2, before Ray); a model whose
    layers read the whole sequence (Mamba-2) is refused by the run's preflight (exit 2, naming the field),
    before any stage: no stage run, no worker, no checkpoint."""
    from mlflow.tracking import MlflowClient

    base = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={tmp_path}",
            f"run.artifact_root={smoke_artifact_root}", f"checkpoint.storage={tmp_path / 'checkpoints'}",
            "tracking.system_metrics_every_s=0", "--only", "train"]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    bad = subprocess.run([*base, "parallel.sequence_parallel_size=3"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "parallel.sequence_parallel_size=3 must be >= 1 and divide parallel.num_workers=2" in bad.stderr
    assert not (tmp_path / "mlflow.db").exists()  # before MLflow, Ray or a stage
    mamba = subprocess.run([*base, "model.preset=debug_mamba2", "parallel.sequence_parallel_size=2"], cwd=ROOT,
                           capture_output=True, text=True, timeout=900, env=env)
    out = mamba.stdout + mamba.stderr
    assert mamba.returncode == 2, out[-4000:]
    # one paragraph for the user, not a traceback
    assert "Traceback" not in mamba.stderr, mamba.stderr[-4000:]
    errors = [line for line in mamba.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: parallel.sequence_parallel_size=2: the mamba2 family's layers read the whole sequence "
                      "in order (a scan, or an encoder), so a shard cannot be computed on its own; use 1"], errors
    assert not list((tmp_path / "checkpoints").rglob("checkpoint_*"))  # no worker started, nothing checkpointed
    if (tmp_path / "mlflow.db").exists():
        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("conduit")
        assert experiment is None or not client.search_runs([experiment.experiment_id])  # no run, no stage run

    # What only the stage finds out (a parent model that does not exist) fails the stage: one paragraph naming
    # the stage and the reason (the traceback is in the run's log and on the stage run), its run FAILED.
    missing = subprocess.run([*base, "train.init_from=train:00000000deadbeef"], cwd=ROOT, capture_output=True,
                             text=True, timeout=900, env=env)
    assert missing.returncode == 1, (missing.stdout + missing.stderr)[-4000:]
    assert "Traceback" not in missing.stderr, missing.stderr[-4000:]
    errors = [line for line in missing.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: stage train failed: LookupError("), missing.stderr[-4000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("conduit").experiment_id],
                                "tags.`conduit.stage` = 'train'")
    assert run.info.status == "FAILED" and "no finished train artifact 00000000deadbeef" in run.data.tags["conduit.error"]

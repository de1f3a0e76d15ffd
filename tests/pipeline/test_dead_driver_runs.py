"""The runs a killed driver left RUNNING (docs/reliability.md, "the driver is SIGKILLed"): before its
parent run starts, the runner (``fail_runs_of_dead_drivers``) marks FAILED the RUNNING runs of this
config whose driver, on this host, is gone; a live driver's runs and another host's are left alone,
the latter named. Against a real sqlite MLflow store, with runs tagged as the runner tags them; no Ray.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

from pipeline import tracking
from pipeline.config import load_config
from pipeline.runner import DRIVER_TAG, driver_identity, fail_runs_of_dead_drivers, resolve


def dead_identity() -> dict:
    """The identity of a process of this host that was running and has been SIGKILLed."""
    proc = subprocess.Popen(["sleep", "600"])
    identity = driver_identity(proc.pid)
    proc.kill()
    proc.wait()
    return identity


def start_attempt(uri: str, exp_id: str, cfg, identity: dict, stages: dict[str, str]) -> tuple[str, dict[str, str]]:
    """A pipeline run as the runner starts one (its tags), with stage runs left in the given states."""
    parent = tracking.start_run(uri, exp_id, cfg.run.name, tags={
        "conduit.ray_job_id": "local", "conduit.config_name": cfg.run.name,
        "conduit.workdir": str(cfg.workdir()), DRIVER_TAG: json.dumps(identity),
    })
    children = {}
    for stage, status in stages.items():
        children[stage] = tracking.start_run(uri, exp_id, stage, parent_id=parent, tags={"conduit.stage": stage})
        if status != "RUNNING":
            tracking.end_run(uri, children[stage], status)
    return parent, children


def test_only_the_runs_of_a_dead_driver_on_this_host_are_failed_and_another_hosts_are_named(tmp_path):
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = resolve(load_config(None, [f"run.workdir={tmp_path}", f"tracking.uri={mlflow_uri}"]))
    exp_id = tracking.ensure_experiment(mlflow_uri, "drivers")
    killed = dead_identity()
    dead = start_attempt(mlflow_uri, exp_id, cfg, killed, {"shard": "FINISHED", "tokenize": "RUNNING", "train": "RUNNING"})
    live = start_attempt(mlflow_uri, exp_id, cfg, driver_identity(), {"shard": "RUNNING"})  # this process
    # The same pid and start time on another host: whether it runs cannot be told from here.
    elsewhere = {**killed, "host": f"not-{socket.gethostname()}"}
    remote = start_attempt(mlflow_uri, exp_id, cfg, elsewhere, {"shard": "RUNNING"})
    # A pid of this host that now belongs to another process (its start time differs): that driver is gone.
    reused = start_attempt(mlflow_uri, exp_id, cfg, {**driver_identity(), "started": 1.0}, {"train": "RUNNING"})
    other_cfg = resolve(load_config(None, [f"run.workdir={tmp_path / 'other'}", f"tracking.uri={mlflow_uri}"]))
    other_config = start_attempt(mlflow_uri, exp_id, other_cfg, dead_identity(), {"train": "RUNNING"})

    lines = fail_runs_of_dead_drivers(mlflow_uri, exp_id, cfg)

    c = tracking.client(mlflow_uri)

    def states(attempt) -> tuple[str, dict[str, str]]:
        parent, children = attempt
        return c.get_run(parent).info.status, {s: c.get_run(r).info.status for s, r in children.items()}

    assert states(dead) == ("FAILED", {"shard": "FINISHED", "tokenize": "FAILED", "train": "FAILED"})
    assert c.get_run(dead[0]).data.tags["conduit.error"] == "the driver died (no longer running)"
    assert c.get_run(dead[1]["train"]).data.tags["conduit.error"] == "the driver died during this stage"
    assert states(reused) == ("FAILED", {"train": "FAILED"})
    assert states(live) == ("RUNNING", {"shard": "RUNNING"})
    assert states(remote) == ("RUNNING", {"shard": "RUNNING"})
    assert states(other_config) == ("RUNNING", {"train": "RUNNING"})  # another workdir's runs are not this config's
    assert sorted(lines) == sorted([
        f"marked MLflow run {dead[0]} (and 2 stage runs) FAILED: its driver, pid {killed['pid']} on "
        f"{socket.gethostname()}, is gone",
        f"marked MLflow run {reused[0]} (and 1 stage runs) FAILED: its driver, pid {os.getpid()} on "
        f"{socket.gethostname()}, is gone",
        f"note: MLflow run {remote[0]} of this config is RUNNING under a driver on {elsewhere['host']}; left as it is",
    ])


def test_a_quote_in_the_workdir_is_matched_exactly(tmp_path):
    """MLflow's filter strings cannot escape a quote (``run.name`` refuses them at load; a folder may hold
    both kinds): the runs of a config under ``it's "x"`` are found all the same, and those of a folder
    whose name differs only after the quote are not."""
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    quoted, unquoted = tmp_path / "it's \"x\"", tmp_path / "it's"
    cfg = resolve(load_config(None, [f"run.workdir={quoted}", f"tracking.uri={mlflow_uri}"]))
    near = resolve(load_config(None, [f"run.workdir={unquoted}", f"tracking.uri={mlflow_uri}"]))
    assert "'" in str(cfg.workdir()) and '"' in str(cfg.workdir())
    exp_id = tracking.ensure_experiment(mlflow_uri, "quotes")
    dead = start_attempt(mlflow_uri, exp_id, cfg, dead_identity(), {"train": "RUNNING"})
    other = start_attempt(mlflow_uri, exp_id, near, dead_identity(), {"train": "RUNNING"})
    lines = fail_runs_of_dead_drivers(mlflow_uri, exp_id, cfg)
    c = tracking.client(mlflow_uri)
    assert c.get_run(dead[0]).info.status == "FAILED" and c.get_run(dead[1]["train"]).info.status == "FAILED"
    assert c.get_run(other[0]).info.status == "RUNNING"
    assert len(lines) == 1 and dead[0] in lines[0]

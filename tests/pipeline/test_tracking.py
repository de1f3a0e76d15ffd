"""pipeline.tracking against a real sqlite store: no process-wide MLflow state leaks out of it."""

from __future__ import annotations

import os

import pytest

from pipeline import tracking
from pipeline.stage_tracker import StageTracker


def test_fluent_calls_leave_the_environment_as_they_found_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/a.db"
    with tracking._fluent_uri(uri):
        assert os.environ["MLFLOW_TRACKING_URI"] == uri
    assert "MLFLOW_TRACKING_URI" not in os.environ and "MLFLOW_REGISTRY_URI" not in os.environ

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    with tracking._fluent_uri(uri):
        pass
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:1"


def test_stage_tracker_logs_to_its_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/t.db"
    exp = tracking.ensure_experiment(uri, "t", artifact_location=str(tmp_path / "art"))
    parent = tracking.start_run(uri, exp, "parent")
    child = tracking.start_run(uri, exp, "child", parent_id=parent, tags={"k": "v"})
    t = StageTracker(uri, child)
    t.log_params({f"p{i}": i for i in range(150)})  # more than one batch of 100
    t.log_metrics({"loss": 2.5}, step=3)
    t.log_metrics({"loss": 2.0}, step=4)
    run = tracking.client(uri).get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["k"] == "v"
    assert len(run.data.params) == 150
    hist = tracking.client(uri).get_metric_history(child, "loss")
    assert [(m.step, m.value) for m in hist] == [(3, 2.5), (4, 2.0)]


def test_train_stage_records_its_tokens_as_an_mlflow_dataset(tmp_path):
    import json
    from pathlib import Path

    from pipeline.store.artifacts import Artifact
    from pipeline.config import config_from_dict
    from pipeline.stages.train import training_dataset

    uri = f"sqlite:///{tmp_path}/d.db"
    run_id = tracking.start_run(uri, tracking.ensure_experiment(uri, "d", str(tmp_path / "art")), "train")
    cfg = config_from_dict({"run": {"workdir": str(tmp_path)}, "data": {"train_paths": ["a/*.txt", "b.jsonl"]}})
    split = {"blocks": 2, "tokens": 258, "dropped_tail_tokens": 0, "bytes": 900, "tokens_in_documents": 250}
    tokens = Artifact(stage="tokenize", hash="0123456789abcdef", path=Path("/node/cache/tokenize"), manifest={
        "inputs": {"shard": "shardhash", "tokenizer": "tokhash"},
        "counts": {"splits": {"train": {**split, "documents": 7}, "validation": {**split, "documents": 1}}}})
    StageTracker(uri, run_id).log_input_dataset(**training_dataset(cfg, tokens))

    (inp,) = tracking.client(uri).get_run(run_id).inputs.dataset_inputs
    assert inp.dataset.digest == "0123456789abcdef" and inp.dataset.name == "a/*.txt, b.jsonl"
    assert json.loads(inp.dataset.source)["uri"] == f"{cfg.artifact_root()}/tokenize/0123456789abcdef"
    assert [(t.key, t.value) for t in inp.tags] == [("mlflow.data.context", "training")]
    profile = json.loads(inp.dataset.profile)
    assert profile["source_paths"] == ["a/*.txt", "b.jsonl"] and profile["shard_hash"] == "shardhash"
    assert profile["documents"] == {"train": 7, "validation": 1} and profile["tokens"]["train"] == 250


def test_the_experiment_opens_as_a_model_training_experiment(tmp_path):
    uri = f"sqlite:///{tmp_path}/k.db"
    c = tracking.client(uri)
    exp = tracking.ensure_experiment(uri, "new", artifact_location=str(tmp_path / "art"))
    assert c.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"
    older = c.create_experiment("older", artifact_location=str(tmp_path / "art2"))  # as an earlier Conduit made it
    assert "mlflow.experimentKind" not in c.get_experiment(older).tags
    assert tracking.ensure_experiment(uri, "older") == older
    assert c.get_experiment(older).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow
def test_run_tags_go_as_strings_to_a_server(mlflow_server):
    """A number among a new run's tags: MLflow's REST API takes only strings (a sqlite store does not
    mind, which hid this until a sweep ran against a server)."""
    exp = tracking.ensure_experiment(mlflow_server.uri, "tags")
    run_id = tracking.start_run(mlflow_server.uri, exp, "r", tags={"conduit.sweep_trials": 8, "conduit.ok": True})
    tags = tracking.client(mlflow_server.uri).get_run(run_id).data.tags
    assert tags["conduit.sweep_trials"] == "8" and tags["conduit.ok"] == "True"


def test_an_unparsable_outage_setting_is_named_before_anything_runs(tmp_path, monkeypatch):
    """It used to become 600 s silently; now check_reachable (the driver's first call) refuses it."""
    from pipeline.base import ConfigError

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for bad in ("ten", "-5", "nan", "inf"):
        monkeypatch.setenv(tracking.OUTAGE_ENV, bad)
        with pytest.raises(ConfigError, match=rf"\$CONDUIT_MLFLOW_OUTAGE_S='{bad}' must be a number of seconds >= 0"):
            tracking.check_reachable(uri)
    monkeypatch.setenv(tracking.OUTAGE_ENV, "30")
    tracking.check_reachable(uri)
    assert tracking.outage_s() == 30.0
    monkeypatch.delenv(tracking.OUTAGE_ENV)
    assert tracking.outage_s() == tracking.DEFAULT_OUTAGE_S


OPEN_AT = """
import sys, time
from pipeline import tracking

start = float(sys.argv[2])
while time.time() < start:  # every process opens the store at the same moment
    time.sleep(0.001)
c = tracking.client(sys.argv[1])
c.get_experiment_by_name("conduit")
"""


@pytest.mark.slow
def test_processes_opening_a_new_sqlite_store_at_once_all_succeed(tmp_path):
    """MLflow creates a new sqlite store's tables and migrates its schema when a client first opens it; three
    processes doing that at the same moment failed ("duplicate column name", in 14 of 15 tries here) until
    tracking.client took a lock beside the database while it opens the store."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for attempt in range(2):
        uri = f"sqlite:///{tmp_path / f'fresh-{attempt}' / 'mlflow.db'}"
        (tmp_path / f"fresh-{attempt}").mkdir()
        start = time.time() + 4  # after every interpreter has imported MLflow
        procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT, uri, str(start)], cwd=root,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(3)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-1500:] for o in outs)
        assert tracking.client(uri).get_experiment_by_name("Default") is not None  # a whole, usable store


LOG_INPUT_AT = """
import sys, time
from pipeline import tracking

uri, run_id, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
c = tracking.client(uri)
c.get_run(run_id)  # the store opened and the run read before the moment
while time.time() < start:
    time.sleep(0.001)
for digest in sys.argv[4:]:
    tracking.log_input(c, run_id, "tokens", "/data/tokens/" + digest, digest, "training", {"tokens": 7})
"""


@pytest.mark.slow
def test_runs_logging_one_dataset_at_once_all_record_it(tmp_path):
    """A sweep's trials log the same token blocks as their train runs' input dataset, often at the same moment
    (a benchmark's sweep lost a trial attempt to "UNIQUE constraint failed: datasets..."): MLflow looks a
    dataset up and inserts it if missing, so two inserts race. Three processes, each with its run, log the same ten datasets at one
    instant: every run holds all ten, and the store holds each dataset once."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "race")
    runs = [tracking.start_run(uri, exp, f"trial_{i}") for i in range(3)]
    digests = [f"d{i:02d}" for i in range(10)]
    start = time.time() + 6  # after every interpreter has imported MLflow and opened the store
    procs = [subprocess.Popen([sys.executable, "-c", LOG_INPUT_AT, uri, run, str(start), *digests], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for run in runs]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-1500:] for o in outs)
    c = tracking.client(uri)
    for run in runs:
        assert sorted(d.dataset.digest for d in c.get_run(run).inputs.dataset_inputs) == digests
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(str(tmp_path / "mlflow.db"))) as db:
        assert db.execute("SELECT COUNT(*), COUNT(DISTINCT digest) FROM datasets").fetchone() == (10, 10)

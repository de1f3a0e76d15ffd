"""What a run shows a person (pipeline.console): the log file that takes every process's output, the
console lines and status line, the status read from MLflow, and the closing summary."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from pipeline import tracking
from pipeline.stage_tracker import StageTracker
from pipeline.config import load_config
from pipeline.console import Console, describe, summary_lines
from pipeline.training.ray_train import failure_phase

ROOT = Path(__file__).resolve().parents[2]

RUN_LOG_SCRIPT = """
import subprocess, sys
from pathlib import Path
from pipeline.console import Console, RunLog
with RunLog(Path(sys.argv[1])) as log:
    console = Console(log.terminal, log)
    log.on_warning = lambda line: console.line(line, log=False)
    console.line("for the person")
    print("from python", flush=True)
    print("python to stderr", file=sys.stderr, flush=True)
    subprocess.run(["sh", "-c", "echo from a child; echo child to stderr >&2"], check=True)
    log.errors().write("error: for the person too\\n")
    print("\\x1b[36m(conduit.shard pid=12)\\x1b[0m warning: a setting fell back", flush=True)
    print("FutureWarning: a library's own", flush=True)
print("after the run")
"""


def test_the_run_log_takes_every_process_output_and_the_terminal_only_the_console_lines(tmp_path):
    log = tmp_path / "logs" / "run.log"
    out = subprocess.run([sys.executable, "-c", RUN_LOG_SCRIPT, str(log)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Conduit's own warning, forwarded from a worker, reaches the person; a library's stays in the log.
    assert out.stdout == "for the person\nwarning: a setting fell back\nafter the run\n"
    assert out.stderr == "error: for the person too\n"
    logged = log.read_text().splitlines()
    assert sorted(logged) == sorted(["for the person", "from python", "python to stderr", "from a child",
                                     "child to stderr", "error: for the person too",
                                     "\x1b[36m(conduit.shard pid=12)\x1b[0m warning: a setting fell back",
                                     "FutureWarning: a library's own"])


def test_a_status_line_is_redrawn_in_place_on_a_terminal_and_a_plain_line_elsewhere():
    tty = io.StringIO()
    console = Console(tty, tty=True)
    console.status("train: 1s")
    console.status("train: 3s, step 2/10")
    console.line("train: done")
    assert tty.getvalue() == "\r\x1b[Ktrain: 1s\r\x1b[Ktrain: 3s, step 2/10\r\x1b[Ktrain: done\n"
    pipe = io.StringIO()
    console = Console(pipe, tty=False)
    console.status("train: 20s")
    console.line("train: done")
    assert pipe.getvalue() == "train: 20s\ntrain: done\n"


def test_the_status_says_the_training_step_loss_speed_and_eta_tokenize_documents_and_evaluate_sets():
    cfg = load_config(ROOT / "configs" / "smoke.yaml", ["train.steps=150"])
    line = describe("train", 75, {"step": 30, "loss": 4.25, "tokens_per_s": 8123.4}, cfg,
                    first_seen=(time.monotonic() - 10, 10))
    # 20 steps in 10 s: the 120 left take about a minute.
    assert line.startswith("train: 1m15s, step 30/150, loss 4.250, 8,123 tokens/s, ETA ")
    assert line.endswith(("ETA 59s", "ETA 1m00s"))
    assert describe("train", 5, None, cfg) == "train: 5s"
    assert describe("tokenize", 12, {"documents_tokenized": 1234}, cfg) == "tokenize: 12s, 1,234 documents tokenized"
    assert describe("evaluate", 4, {"sets_scored": 2, "val_loss": 3.1}, cfg) == "evaluate: 4s, 2 sets scored"


def test_while_no_step_goes_by_the_status_says_why():
    cfg = load_config(ROOT / "configs" / "smoke.yaml", ["train.steps=150", "tracking.uri=http://mlflow.internal:5000"])
    assert describe("train", 20, {"phase": "starting 2 training workers"}, cfg) == \
        "train: 20s, starting 2 training workers"
    assert describe("train", 30, {"phase": "building the model and DeepSpeed's engine"}, cfg) == \
        "train: 30s, building the model and DeepSpeed's engine"
    # After a failure: where training had got to, then what it is doing about it.
    failed = failure_phase(1, 2, {1: RuntimeError("worker died\nmore of the traceback")})
    assert failed == {"conduit.phase": "restarting after a failure (attempt 2 of 3): rank 1: RuntimeError: worker died",
                      "conduit.restarts": "1", "conduit.last_failure": "rank 1: RuntimeError: worker died"}
    assert describe("train", 95, {"step": 40, "loss": 3.5, **{"phase": failed["conduit.phase"]}}, cfg) == \
        "train: 1m35s, step 40/150, loss 3.500, restarting after a failure (attempt 2 of 3): rank 1: RuntimeError: worker died"
    assert describe("train", 99, {"step": 40, "phase": "loading the checkpoint checkpoint_000004"}, cfg) == \
        "train: 1m39s, step 40/150, loading the checkpoint checkpoint_000004"
    assert describe("train", 99, {"step": 41, "phase": "training"}, cfg) == "train: 1m39s, step 41/150"
    last = failure_phase(3, 2, {0: OSError("disk full"), 1: RuntimeError("peer gone")})
    assert last["conduit.phase"] == ("failed 3 times, more than checkpoint.max_failures=2 allows: rank 0: OSError: "
                                     "disk full; rank 1: RuntimeError: peer gone") and last["conduit.restarts"] == "2"
    assert describe("evaluate", 70, None, cfg, mlflow_unanswered_s=25) == (
        "evaluate: 1m10s, waiting for MLflow at http://mlflow.internal:5000 (no answer for 25s; the stage goes on "
        "and its metrics follow when it is back)")


def test_stage_progress_reads_the_running_stage_run_by_its_hash(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "conduit")
    assert tracking.stage_progress(uri, "conduit", "abc123") is None
    run = tracking.start_run(uri, exp, "train", tags={"conduit.hash": "abc123"})
    tracker = StageTracker(uri, run)
    tracker.log_metrics({"loss": 5.0, "tokens_per_s": 100.0}, step=5)
    tracker.log_metrics({"loss": 4.0, "tokens_per_s": 120.0}, step=10)
    assert tracking.stage_progress(uri, "conduit", "abc123") == {"loss": 4.0, "tokens_per_s": 120.0, "step": 10.0}
    tracker.set_tags({"conduit.phase": "loading the checkpoint checkpoint_000002"})
    assert tracking.stage_progress(uri, "conduit", "abc123")["phase"] == "loading the checkpoint checkpoint_000002"
    tracking.end_run(uri, run)
    assert tracking.stage_progress(uri, "conduit", "abc123") is None  # a finished stage has no live status


def _artifact(seconds: float, counts: dict):
    return SimpleNamespace(manifest={"seconds": seconds, "counts": counts})


def test_the_summary_has_a_row_per_stage_with_its_number_then_the_run_and_the_model():
    result = SimpleNamespace(
        run_id="r1", tracking_uri="sqlite:////w/mlflow.db",
        artifacts={
            "shard": _artifact(8.4, {"documents_read": 7222}),
            "tokenizer": _artifact(1.2, {"vocab_size": 512}),
            "tokenize": _artifact(0.9, {"splits": {"train": {"tokens": 600000}, "validation": {"tokens": 15615}}}),
            "train": _artifact(87.8, {"final_loss": 4.8104}),
            "evaluate": _artifact(7.0, {"val_bits_per_byte": 3.8241, "unigram_bits_per_byte": 4.0831}),
            "register": _artifact(3.1, {"model_name": "m", "version": 2, "alias": "challenger",
                                        "model_uri": "models:/m@challenger", "hf_export": True}),
        },
        transfers={"evaluate": None, "register": None},  # the stages that ran
    )
    assert summary_lines(result) == [
        "",
        "stage      status   seconds  result",
        "shard      cached       8.4  7,222 documents",
        "tokenizer  cached       1.2  vocabulary 512",
        "tokenize   cached       0.9  615,615 tokens",
        "train      cached      87.8  final loss 4.810",
        "evaluate   ran          7.0  validation 3.824 bits/byte (unigram 4.083)",
        "register   ran          3.1  version 2",
        "",
        "MLflow run: r1  (tracking URI sqlite:////w/mlflow.db)",
        "Registered model: models:/m@challenger (version 2)",
        "Open the MLflow UI:  mlflow ui --backend-store-uri sqlite:////w/mlflow.db --host 127.0.0.1 --port 5000",
    ]


@pytest.mark.slow
def test_the_status_reads_a_server_without_retries_and_says_at_once_when_it_is_down(mlflow_server):
    """Through a real MLflow server: the bounded REST read gives what MLflow's client gives; with the server
    stopped it fails within its timeout (MLflow's client would retry for minutes, and the status line
    would freeze on old figures instead of saying that MLflow does not answer)."""
    uri = mlflow_server.uri
    exp = tracking.ensure_experiment(uri, "status")
    run = tracking.start_run(uri, exp, "train", tags={"conduit.hash": "feed01"})
    tracker = StageTracker(uri, run)
    tracker.log_metrics({"loss": 5.0, "tokens_per_s": 100.0}, step=5)
    tracker.log_metrics({"loss": 4.0, "tokens_per_s": 120.0}, step=10)
    tracker.set_tags({"conduit.phase": "loading the checkpoint checkpoint_000001"})
    expected = {"loss": 4.0, "tokens_per_s": 120.0, "step": 10.0, "phase": "loading the checkpoint checkpoint_000001"}
    assert tracking.stage_progress(uri, "status", "feed01") == expected
    assert tracking.stage_progress(uri, "status", "feed01", timeout_s=5) == expected
    assert tracking.stage_progress(uri, "status", "other", timeout_s=5) is None
    assert tracking.stage_progress(uri, "no such experiment", "feed01", timeout_s=5) is None
    mlflow_server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(requests.RequestException):
            tracking.stage_progress(uri, "status", "feed01", timeout_s=2)
        assert time.monotonic() - t0 < 10
    finally:
        mlflow_server.start()
    tracking.end_run(uri, run)

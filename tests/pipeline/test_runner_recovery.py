"""How a run ends when its surroundings fail: a tracking server that does not answer stops the run
before anything computes; SIGTERM (``ray job stop``, ``kill``) ends the MLflow runs KILLED."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.config import load_config
from pipeline.runner import run_pipeline

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_tracking_server_stops_the_run_before_any_compute(tmp_path):
    uri = f"http://127.0.0.1:{closed_port()}"
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [f"run.workdir={tmp_path / 'work'}", f"tracking.uri={uri}"])
    t0 = time.monotonic()
    with pytest.raises(tracking.TrackingUnavailable, match=f"the MLflow tracking server at {uri} does not answer"):
        run_pipeline(cfg, echo=print)
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "work").exists()  # nothing was written, nothing started
    done = subprocess.run([sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={tmp_path / 'w'}",
                           f"tracking.uri={uri}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"error: the MLflow tracking server at {uri} does not answer" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_marks_the_runs_killed(tmp_path, sig):
    """``kill`` / ``ray job stop`` (SIGTERM) and Ctrl-C (SIGINT) while the train stage runs: exit 130, one line
    naming the signal and no traceback after it, the stage's and the parent's MLflow runs KILLED, the finished
    stages FINISHED. jobs.run starts with SIGINT ignored here (as a command started with ``&`` by a script
    does, which Python then leaves ignored): it must stop on it all the same."""
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={work}", "train.steps=100000",
           "train.progress_bar=false", "train.compile=false"]  # a run this long would compile first (compile auto)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # inherited: ignored
    seen = []
    for line in proc.stdout:  # the stages print "<stage>: running (<hash>)" as they start
        seen.append(line)
        if line.startswith("train: running"):
            time.sleep(5)  # inside the Ray task now
            proc.send_signal(sig)
            break
    try:
        rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{sig.name} did not end jobs.run within 120 s: {''.join(seen)[-3000:]}") from None
    out = "".join(seen) + rest
    assert proc.returncode == 130, out[-3000:]
    said = f"interrupted ({sig.name})"
    assert said in out and "Traceback" not in out.split(said)[-1], out[-3000:]
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [f"run.workdir={work}"])
    uri = cfg.tracking_uri()
    exp = tracking.ensure_experiment(uri, cfg.tracking.experiment)
    runs = {r.data.tags["mlflow.runName"]: r.info.status for r in tracking.client(uri).search_runs([exp])}
    assert runs["train"] == "KILLED" and runs["smoke"] == "KILLED", runs
    assert runs["tokenize"] == "FINISHED", runs

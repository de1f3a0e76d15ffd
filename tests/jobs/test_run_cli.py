"""jobs.run as a user calls it: errors before any work, and the dry-run plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "jobs.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_unknown_key_fails_with_its_name_and_a_suggestion(tmp_path):
    out = run_cli("configs/smoke.yaml", f"run.workdir={tmp_path}", "train.stpes=3")
    assert out.returncode == 2
    assert "unknown key train.'stpes'; did you mean 'steps'?" in out.stderr
    assert not (tmp_path / "mlflow.db").exists()  # nothing was started or written


def test_dry_run_on_a_fresh_workdir_plans_every_stage(tmp_path):
    out = run_cli("configs/smoke.yaml", "--dry-run", f"run.workdir={tmp_path}")  # overrides may follow flags
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.split("\n\n")[0].splitlines()[1:]]  # the table; then the train plan
    assert [r[0] for r in rows] == ["shard", "tokenizer", "tokenize", "train", "evaluate", "register"]
    assert all(r[2] == "run" and len(r[1]) == 16 for r in rows)
    assert all(r[3].startswith(str(tmp_path / "artifacts" / r[0])) for r in rows)
    assert not (tmp_path / "mlflow.db").exists()


def test_dry_run_until_plans_the_stages_up_to_it(tmp_path):
    out = run_cli("configs/smoke.yaml", "--dry-run", "--until", "tokenize", f"run.workdir={tmp_path}")
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.split("\n\n")[0].splitlines()[1:]]  # the table; then the train plan
    assert [(r[0], r[2]) for r in rows] == [("shard", "run"), ("tokenizer", "run"), ("tokenize", "run"),
                                            ("train", "skip"), ("evaluate", "skip"), ("register", "skip")]


def test_only_with_unfinished_inputs_is_refused(tmp_path):
    out = run_cli("configs/smoke.yaml", f"run.workdir={tmp_path}", "--only", "train")
    assert out.returncode == 2
    assert "--only train: its inputs ['tokenize'] are not finished" in out.stderr


UNEXPECTED_ERROR_SCRIPT = """
import sys
import jobs.run

def fails(*args, **kwargs):
    print("a worker's line", flush=True)
    raise RuntimeError("something nobody expected")

jobs.run.run_pipeline = fails
sys.exit(jobs.run.main(sys.argv[1:]))
"""


def test_an_unexpected_error_ends_the_terminal_output_and_its_whole_traceback_is_in_the_log(tmp_path):
    out = subprocess.run([sys.executable, "-c", UNEXPECTED_ERROR_SCRIPT, "configs/smoke.yaml",
                          f"run.workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    (log,) = (tmp_path / "logs").glob("run-*.log")
    lines = out.stdout.splitlines()
    assert lines == [f"Conduit smoke: the full log is in {log}", f"The full log: {log}"]
    assert out.stderr.splitlines()[0] == "error: unexpected; the traceback ends:"
    assert out.stderr.splitlines()[-1] == "RuntimeError: something nobody expected"
    logged = log.read_text()
    assert "a worker's line" in logged and "Traceback (most recent call last):" in logged
    assert 'in fails' in logged and "Traceback" not in out.stdout + out.stderr


def test_verbose_streams_everything_to_the_terminal_and_writes_no_log(tmp_path):
    out = subprocess.run([sys.executable, "-c", UNEXPECTED_ERROR_SCRIPT, "configs/smoke.yaml", "--verbose",
                          f"run.workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stdout == "a worker's line\n"
    assert "Traceback (most recent call last):" in out.stderr  # as before: Python's own report
    assert out.stderr.rstrip().endswith("RuntimeError: something nobody expected")
    assert not (tmp_path / "logs").exists()

"""Helpers for tests that stand up real local services with infra/local/up and talk to them through
the jobs CLIs as subprocesses (the pytest process never calls ray.init or imports the Ray client:
other tests in the session own the in-process Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UP, DOWN = ROOT / "infra" / "local" / "up", ROOT / "infra" / "local" / "down"
RAY = Path(sys.executable).parent / "ray"  # the venv's CLI, whatever PATH says


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without cluster pointers or tokens, with one thread each.
    ``RAY_AUTH_MODE`` is left out too: the CLIs must get it (and the token) from the env file."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "CONDUIT_INFRA_ENV", "RAY_AUTH_MODE",
                        "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra}


def run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repo root; fail with its output if it outlives ``timeout``."""
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env))


def jobs_cli(module: str, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``python -m jobs.<module> ARGS``."""
    return run([sys.executable, "-m", f"jobs.{module}", *args], timeout=timeout, **env)


def read_env(state_dir: Path) -> dict[str, str]:
    lines = (state_dir / "env").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


def up(state_dir: Path, *args: str, timeout: float = 400, **env: str) -> dict[str, str]:
    """``infra/local/up --state-dir STATE ARGS`` (``env`` added to its environment); returns the env
    file it wrote."""
    done = run([UP, "--state-dir", state_dir, "--timeout", str(timeout - 20), *args], timeout=timeout, **env)
    assert done.returncode == 0, f"infra/local/up failed:\n{done.stdout}\n{done.stderr}"
    return read_env(state_dir)


def down(state_dir: Path) -> subprocess.CompletedProcess:
    return run([DOWN, "--state-dir", state_dir], timeout=120)


def wait_for(predicate, timeout: float, what: str, every: float = 2.0):
    """Poll ``predicate()`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")

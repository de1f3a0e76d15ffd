"""Real server processes for tests: start one, wait until it answers, stop its whole process tree.

``MlflowServer`` is the session's MLflow tracking and registry server (sqlite, proxied artifacts,
127.0.0.1, a free port; the ``mlflow_server`` fixture of tests/conftest.py). It starts once per
session (about 20 s), and a test of an outage may stop it and start it again on the same store and
port. Tests that share it keep apart by experiment and registered-model names.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_addresses(port: int) -> set[str]:
    """The local addresses of every socket on this machine listening on ``port`` (TCP, IPv4 and IPv6):
    what a server really bound, whatever it was told."""
    return {c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def stop_tree(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL whatever is left after ``timeout``."""
    if proc.poll() is not None:
        return
    parent = psutil.Process(proc.pid)
    family = [*parent.children(recursive=True), parent]
    for p in family:
        if p.is_running():
            p.terminate()
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=timeout)
    proc.wait(timeout=timeout)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200; fail with the process's log if it dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited with {proc.returncode} before {url} answered:\n{log.read_text()[-4000:]}")
        try:
            up = requests.get(url, timeout=5).status_code == 200
        except (requests.ConnectionError, requests.Timeout):
            up = False  # not listening yet, or still starting up on a busy machine
        if up:
            return
        time.sleep(0.2)
    pytest.fail(f"{url} did not answer within {timeout}s:\n{log.read_text()[-4000:]}")


def start_process(cmd: list[str], log: Path) -> subprocess.Popen:
    from pipeline import tracking

    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **tracking.env_for_workers()})


class MlflowServer:
    """``mlflow server`` on a sqlite store in ``work``, artifacts proxied to ``work/artifacts``."""

    def __init__(self, work: Path):
        self.work, self.port = work, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 300) -> None:
        """Start it (again: the same store, the same address) and wait until ``/health`` answers."""
        assert self.proc is None or self.proc.poll() is not None, "the server is already running"
        self.starts += 1
        log = self.work / f"server-{self.starts}.log"
        self.proc = start_process([
            sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.work / 'mlflow.db'}",
            "--artifacts-destination", str(self.work / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", "1"], log)
        wait_http(f"{self.uri}/health", self.proc, log, timeout=timeout)  # ~20 s idle; minutes on a loaded box

    def stop(self) -> None:
        """Stop the server and its helper processes; the store stays."""
        if self.proc is not None:
            stop_tree(self.proc)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

"""The one helper that runs distributed test code: N plain processes in a gloo world on 127.0.0.1.

Worker modules are run as ``python -m MODULE ARGS...`` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set (the env:// rendezvous torch and DeepSpeed both read). One launch
costs several seconds of imports, so each worker module runs many checks per launch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(module: str, *args: str, world_size: int = 2, timeout: float = 600) -> None:
    """Run ``module`` in ``world_size`` processes and wait; raise with every rank's output on failure."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
        }
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in procs):
        report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{out[-6000:]}"
                           for r, (p, out) in enumerate(zip(procs, outputs)))
        raise RuntimeError(f"{module} failed:\n{report}")

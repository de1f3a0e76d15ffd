"""The session's one run of configs/smoke.yaml, shared by every test that can read it.

``python -m jobs.run configs/smoke.yaml`` runs once per session, as a person runs it: on a terminal
(a pseudo-terminal), on the session's Ray cluster, into a workdir of its own. tests/e2e/test_smoke.py
checks what it printed and left; every other test that needs the smoke config's data stages (shard,
tokenizer, tokenize: the same hashes) points ``run.artifact_root`` at this run's artifact root
(``smoke_artifact_root``), so those stages are built once per session and found cached, as the
content-addressed cache is made to do. Such a test must not run a stage of this run's own hashes
again (``--force``) or write into its workdir, with one exception: the MoE pipeline of
tests/e2e/test_smoke.py, which shares the workdir on purpose.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_on_terminal(cmd: list[str], env: dict, timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` with stdin, stdout and stderr on a new pseudo-terminal; its exit status and what
    the terminal received."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    received, deadline = bytearray(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([leader], [], [], 1.0)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not chunk:
                break
            received += chunk
    else:
        proc.kill()
    os.close(leader)
    return proc.wait(timeout=60), received.decode("utf-8", errors="replace")


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: a carriage return starts its line over."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        shown = line.split("\r")[-1]
        lines.append(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", shown))
    return lines[:-1] if lines and not lines[-1] else lines


@pytest.fixture(scope="session")
def smoke(tmp_path_factory, ray_cluster):
    """``(config, PipelineResult, screen lines, raw terminal bytes)`` of the session's smoke run."""
    from pipeline.config import load_config
    from pipeline.runner import PipelineResult, make_plan, resolve
    from pipeline.store.backends import store_for

    work = tmp_path_factory.mktemp("smoke")
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [f"run.workdir={work}"])
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    code, raw = run_on_terminal([sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={work}"],
                                env, timeout_s=900)
    lines = screen_lines(raw)
    assert code == 0, raw[-3000:]
    # What the run left, as a later run finds it: every stage's sealed artifact, and its MLflow run id.
    (run_id,) = re.findall(r"^MLflow run: (\w+) ", raw, flags=re.M)
    store = store_for(cfg.artifact_root())
    plan = make_plan(resolve(cfg))
    result = PipelineResult(run_id=run_id, tracking_uri=resolve(cfg).tracking_uri(), plan=plan,
                            artifacts={p.stage: store.load(p.stage, p.hash) for p in plan})
    return cfg, result, lines, raw


@pytest.fixture(scope="session")
def smoke_artifact_root(smoke) -> str:
    """The artifact root of the session's smoke run: its data stages, sealed, for other configs to find
    cached (``run.artifact_root=...``)."""
    cfg = smoke[0]
    return cfg.artifact_root()

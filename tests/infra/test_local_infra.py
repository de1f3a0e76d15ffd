"""infra/local/up and down against real processes: both services answer, the env file names them,
and down stops exactly those processes (by pid and by the cluster's own temp dir) and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import requests

from tests.infra.local_infra import UP, down, jobs_cli, run, up

pytestmark = pytest.mark.slow


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def state_dir(tmp_path) -> Path:
    state = tmp_path / "infra"
    yield state
    down(state)  # a no-op once the test has brought everything down itself


def test_up_answers_writes_env_and_down_stops_exactly_that(state_dir):
    env = up(state_dir, "--num-cpus", "2")
    assert env["RAY_ADDRESS"].startswith("http://127.0.0.1:") and env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert env["RAY_AUTH_MODE"] == "token"
    assert requests.get(f"{env['MLFLOW_TRACKING_URI']}/health", timeout=10).status_code == 200
    # The jobs CLIs find the cluster through the env file alone (no --address, no RAY_ADDRESS).
    listed = jobs_cli("status", CONDUIT_INFRA_ENV=str(state_dir / "env"))
    assert listed.returncode == 0 and listed.stdout == "", listed.stderr
    ray_pids = [int(p) for p in env["CONDUIT_RAY_PIDS"].split(",")]
    mlflow_pid = int(env["CONDUIT_MLFLOW_PID"])
    assert len(ray_pids) >= 4 and _alive([*ray_pids, mlflow_pid]) == [*ray_pids, mlflow_pid]
    mlflow_family = [c.pid for c in psutil.Process(mlflow_pid).children(recursive=True)]
    # A process that looks like Ray by name but is not this cluster's (as another person's would be).
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "raylet", "gcs_server"])

    again = run([UP, "--state-dir", state_dir], timeout=60)
    assert again.returncode == 1 and "run infra/local/down" in again.stderr, again.stderr

    done = down(state_dir)
    assert done.returncode == 0, done.stderr
    assert "ray: stopped" in done.stdout and f"server pid {mlflow_pid}" in done.stdout, done.stdout
    assert _alive([*ray_pids, mlflow_pid, *mlflow_family]) == []
    assert not (state_dir / "env").exists() and not Path(env["CONDUIT_RAY_TEMP_DIR"]).exists()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{env['MLFLOW_TRACKING_URI']}/health", timeout=5)
    assert bystander.poll() is None, "down stopped a process that was not this cluster's"
    bystander.kill()
    bystander.wait()
    assert "nothing to stop" in down(state_dir).stdout


def test_env_file_is_read_by_the_jobs_clis_and_missing_cluster_is_named(tmp_path):
    (tmp_path / "env").write_text("# nothing here\n")
    out = jobs_cli("status", CONDUIT_INFRA_ENV=str(tmp_path / "env"))
    assert out.returncode != 0 and "no Ray cluster address" in out.stderr and "infra/local/up" in out.stderr

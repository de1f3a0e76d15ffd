"""infra/local/up and down against real processes: both services answer, the env file names them,
and down stops exactly those processes (by pid and by the cluster's own temp dir) and nothing else.
``up`` runs with an empty HOME, as on a new machine: the cluster's token is Conduit's own."""

from __future__ import annotations

import stat
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


def test_up_answers_writes_env_and_down_stops_exactly_that(state_dir, tmp_path):
    empty_home = tmp_path / "home"
    empty_home.mkdir()
    env = up(state_dir, "--num-cpus", "2", HOME=str(empty_home))
    assert env["RAY_ADDRESS"].startswith("http://127.0.0.1:") and env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert env["RAY_AUTH_MODE"] == "token"
    assert requests.get(f"{env['MLFLOW_TRACKING_URI']}/health", timeout=10).status_code == 200
    # The token is the cluster's own: in the state dir, readable by this user only, never in HOME,
    # and the env file says where it is, not what it is.
    token_path = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert token_path.parent == state_dir and stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text()
    assert len(token) == 64 and token not in (state_dir / "env").read_text()
    assert not (empty_home / ".ray").exists(), list(empty_home.rglob("*"))
    # The jobs CLIs find the cluster and its token through the env file alone (no --address, no
    # RAY_ADDRESS, no RAY_AUTH_MODE, another empty HOME).
    client_home = tmp_path / "client-home"
    client_home.mkdir()
    listed = jobs_cli("status", CONDUIT_INFRA_ENV=str(state_dir / "env"), HOME=str(client_home))
    assert listed.returncode == 0 and listed.stdout == "", listed.stderr
    # Without the token, or with a wrong one: exit 2 and a sentence that says where tokens come from.
    no_env_file = str(tmp_path / "no-env")
    missing = jobs_cli("status", "--address", env["RAY_ADDRESS"], CONDUIT_INFRA_ENV=no_env_file,
                       HOME=str(client_home), RAY_AUTH_MODE="token")
    (tmp_path / "wrong").write_text("0" * 64)
    wrong = jobs_cli("status", CONDUIT_INFRA_ENV=str(state_dir / "env"), HOME=str(client_home),
                     RAY_AUTH_TOKEN_PATH=str(tmp_path / "wrong"))
    for out in (missing, wrong):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"the Ray cluster at {env['RAY_ADDRESS']} refused this client's token" in out.stderr, out.stderr
        assert "RAY_AUTH_TOKEN_PATH" in out.stderr and token not in out.stderr + out.stdout
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
    assert not token_path.exists()
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

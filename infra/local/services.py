"""Stand up (and tear down) a local Ray head and MLflow server for Conduit jobs: ``up`` and ``down``.

Run through the ``infra/local/up`` and ``infra/local/down`` wrappers, which pick the repo's venv.

up   creates the cluster's auth token (``<state-dir>/ray_auth_token``, mode 0600, never printed),
     starts ``ray start --head`` (dashboard and every port on 127.0.0.1 free ports, token auth with
     that token, a temp dir of its own) and ``mlflow server`` on 127.0.0.1 (sqlite backend, proxied
     artifacts in ``<state-dir>/mlartifacts`` or the object store ``--artifacts-destination`` names),
     optionally extra Ray worker nodes on this machine, waits until the Jobs API and ``/health`` answer,
     and writes ``<state-dir>/env``: the addresses, where the token is, the Ray temp dir and the pids.
     With ``--mlflow-auth`` the MLflow server is MLflow's basic-auth
     app (``--app-name basic-auth``): every request but ``/health`` needs a user and password; the
     admin's password is made here (``<state-dir>/mlflow_admin_password``, mode 0600, never printed)
     and given to the Ray processes as ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``,
     so jobs on this cluster log to it. Ray's GCS listens on every interface whatever
     ``--node-ip-address`` says (STACK.md); the token guards it.
down reads that file and stops exactly what ``up`` started: every process of this Ray cluster (found
     by its own temp dir in the command line, plus their descendants such as job drivers) and the
     MLflow server's process tree and process group. Then it removes the env file and the token.

Why not ``ray stop``: it stops every Ray process on the machine, other people's clusters included.
Why a temp dir of our own: ``ray start`` records its address in ``<temp-dir>/ray_current_cluster``,
and a plain ``ray.init()`` elsewhere on this machine (``/tmp/ray``) would otherwise attach to it.
Why a token of our own: ``ray start`` with ``RAY_AUTH_MODE=token`` never creates one (on a new
machine it fails with "no authentication token was found"), and ``~/.ray/auth_token`` is shared by
every Ray on the machine. ``RAY_AUTH_TOKEN_PATH`` names ours to every process and client.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: `ray`, `mlflow` and the jobs' `python`
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
             "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
             # MLflow's GenAI job runner: 7 helper processes that each import MLflow at start and poll a
             # queue (a seventh of a core, idle); Conduit runs no MLflow jobs
             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class InfraError(RuntimeError):
    """A service did not start or answer, or the state dir is already in use."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TOKEN_FILE = "ray_auth_token"
MLFLOW_PASSWORD_FILE = "mlflow_admin_password"
MLFLOW_ADMIN = "admin"


def service_env(token_path: Path, mlflow_password: Path | None = None) -> dict[str, str]:
    """Environment of every service process: this venv first on PATH (a Ray job's ``python`` is
    then the venv's), token auth on with the cluster's own token file, telemetry and hub look-ups off,
    and with an authenticated MLflow server its user and password (what MLflow's client sends).
    A ``RAY_AUTH_TOKEN`` of the caller's is dropped: Ray would prefer it over the file."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    if mlflow_password is not None:
        env.update(MLFLOW_TRACKING_USERNAME=MLFLOW_ADMIN, MLFLOW_TRACKING_PASSWORD=mlflow_password.read_text())
    return {**env, **QUIET_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def create_token(path: Path) -> None:
    """A new random token (256 bits, hex, as ``ray get-auth-token --generate`` makes) in a file that
    only this user can read, created with that mode so it is never readable by others."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secrets.token_hex(32))
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to a file that already existed


def mlflow_auth_env(state_dir: Path) -> dict[str, str]:
    """What ``mlflow server --app-name basic-auth`` needs, made in ``state_dir``: its config (users in
    ``mlflow_auth.db``; new users may read, not write), the admin's password (created with the token's
    care) and the key that signs its CSRF tokens."""
    password = state_dir / MLFLOW_PASSWORD_FILE
    if not password.exists():
        create_token(password)
    ini = state_dir / "mlflow_auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{state_dir / 'mlflow_auth.db'}\n"
                   f"admin_username = {MLFLOW_ADMIN}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": password.read_text(),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)}


def ray_temp_dir(state_dir: Path) -> Path:
    """A short per-state-dir folder (Unix socket paths under it must stay below 108 bytes)."""
    return Path("/tmp") / f"conduit-ray-{hashlib.sha1(str(state_dir).encode()).hexdigest()[:10]}"


# ---- env file ------------------------------------------------------------------------------------
def write_env(path: Path, values: dict[str, str]) -> None:
    """``KEY=value`` lines, readable by bash ``source``, ``pipeline.cluster.read_env_file`` and make."""
    body = "# written by infra/local/up; infra/local/down stops these and removes this file\n"
    body += "".join(f"{k}={v}\n" for k, v in values.items())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(body, encoding="utf-8")
    tmp.rename(path)


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


# ---- process trees -------------------------------------------------------------------------------
def ray_processes(temp_dir: Path) -> list[psutil.Process]:
    """Every process of the cluster that lives under ``temp_dir``, and all their descendants (never
    this process or its ancestors, whose command lines may mention the folder too)."""
    me = psutil.Process()
    spared = {me.pid, *(a.pid for a in me.parents())}
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        if p.pid not in spared and any(str(temp_dir) in arg for arg in (p.info["cmdline"] or [])):
            found[p.pid] = p
    for p in list(found.values()):
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue  # ended while we looked: nothing left to stop
    return [p for p in found.values() if p.pid not in spared]


def process_group(leader_pid: int, marker: str) -> list[psutil.Process]:
    """The process ``leader_pid`` (only if its command line still contains ``marker``, so that a
    reused pid is never touched), its descendants and every process left in its process group."""
    try:
        leader = psutil.Process(leader_pid)
        if marker not in " ".join(leader.cmdline()):
            return []
        found = {leader.pid: leader, **{c.pid: c for c in leader.children(recursive=True)}}
    except psutil.NoSuchProcess:
        found = {}
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == leader_pid:
                found[p.pid] = p
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue  # gone already
    return list(found.values())


def terminate(procs: list[psutil.Process], grace_s: float = 15.0) -> int:
    """SIGTERM ``procs``, SIGKILL whatever is alive after ``grace_s``. Returns how many were signalled."""
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue  # exited between the check and the signal
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=grace_s)
    return len(alive)


# ---- up ------------------------------------------------------------------------------------------
def start_ray_node(temp_dir: Path, token_path: Path, log: Path, num_cpus: int, head_port: int | None = None,
                   resources: dict | None = None, dashboard_port: int | None = None,
                   mlflow_password: Path | None = None) -> None:
    """``ray start`` a head (``dashboard_port`` given) or a worker node joining ``head_port``.

    Raises:
        InfraError: ``ray start`` failed; the message carries its output.
    """
    cmd = [str(BIN / "ray"), "start", "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
           "--temp-dir", str(temp_dir), "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats"]
    if dashboard_port:
        cmd += ["--head", "--port", str(head_port), "--dashboard-host", "127.0.0.1",
                "--dashboard-port", str(dashboard_port), "--ray-client-server-port", str(free_port())]
    else:
        cmd += ["--address", f"127.0.0.1:{head_port}"]
    if resources:
        cmd += ["--resources", json.dumps(resources)]
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=service_env(token_path, mlflow_password),
                              cwd=REPO_ROOT,
                              start_new_session=True, timeout=180)
    if done.returncode != 0:
        raise InfraError(f"{' '.join(cmd)} exited with {done.returncode}:\n{log.read_text()[-3000:]}")


def start_mlflow(state_dir: Path, port: int, token_path: Path, artifacts_destination: str | None = None,
                 auth: bool = False) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1:``port`` in its own process group (its helpers go with it).

    Artifacts are proxied (clients upload and download through the server, with no store credentials
    of their own) to ``artifacts_destination``: an object-store URI (``s3://bucket/mlflow``; the server
    reads the credentials and ``MLFLOW_S3_ENDPOINT_URL`` from its environment), or None for
    ``<state_dir>/mlartifacts``. With ``auth``, MLflow's basic-auth app (``mlflow_auth_env``).
    """
    destination = artifacts_destination or str(state_dir / "mlartifacts")
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{state_dir / 'mlflow.db'}",
           "--artifacts-destination", destination, "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1", *(["--app-name", "basic-auth"] if auth else [])]
    env = {**service_env(token_path), **(mlflow_auth_env(state_dir) if auth else {})}
    with (state_dir / "mlflow.log").open("w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=state_dir,
                                start_new_session=True)


def wait_mlflow(uri: str, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InfraError(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{uri}/health", timeout=2).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):
            pass  # not listening yet, or too busy starting to answer
        time.sleep(0.5)
    raise InfraError(f"mlflow server at {uri} did not answer /health in time:\n{log.read_text()[-3000:]}")


def wait_jobs_api(address: str, token_path: Path, deadline: float) -> None:
    """Until the Ray Jobs API lists jobs (this also proves the token auth works)."""
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    from ray.job_submission import JobSubmissionClient

    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            JobSubmissionClient(address).list_jobs()
            return
        except (ConnectionError, RuntimeError) as e:  # Ray raises these while the dashboard starts
            last = e
        time.sleep(0.5)
    raise InfraError(f"the Ray Jobs API at {address} did not answer in time: {last}")


def up(state_dir: Path, num_cpus: int, worker_nodes: int, worker_cpus: int, timeout_s: float,
       artifacts_destination: str | None = None, mlflow_auth: bool = False) -> dict[str, str]:
    """Start the services, wait for them, write ``<state_dir>/env``. Stops what it started on failure.

    Returns:
        The env file's variables.

    Raises:
        InfraError: the state dir is in use, or a service did not start in ``timeout_s``.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    env_path = state_dir / "env"
    if env_path.exists():
        raise InfraError(f"{env_path} exists: services from an earlier `up` may be running; "
                         f"run infra/local/down --state-dir {state_dir} first")
    temp_dir = ray_temp_dir(state_dir)
    token_path = state_dir / TOKEN_FILE
    gcs, dash, ml = free_port(), free_port(), free_port()
    values = {
        "RAY_ADDRESS": f"http://127.0.0.1:{dash}",
        "CONDUIT_RAY_GCS_ADDRESS": f"127.0.0.1:{gcs}",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{ml}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_path),
        "CONDUIT_RAY_TEMP_DIR": str(temp_dir),
        "CONDUIT_STATE_DIR": str(state_dir),
    }
    # Written before anything starts, so that `down` can clean up after a failed `up` too.
    write_env(env_path, values)
    create_token(token_path)
    deadline = time.monotonic() + timeout_s
    # ~18 s to answer: overlaps with ray start (~9 s)
    mlflow = start_mlflow(state_dir, ml, token_path, artifacts_destination, mlflow_auth)
    values["CONDUIT_MLFLOW_PID"] = str(mlflow.pid)
    password = state_dir / MLFLOW_PASSWORD_FILE if mlflow_auth else None
    if password is not None:
        values.update(MLFLOW_TRACKING_USERNAME=MLFLOW_ADMIN, CONDUIT_MLFLOW_PASSWORD_FILE=str(password))
    write_env(env_path, values)
    try:
        ray_log = state_dir / "ray-start.log"
        start_ray_node(temp_dir, token_path, ray_log, num_cpus, head_port=gcs, dashboard_port=dash,
                       mlflow_password=password)
        for i in range(worker_nodes):
            start_ray_node(temp_dir, token_path, ray_log, worker_cpus, head_port=gcs,
                           resources={f"conduit_worker_node_{i + 1}": 1}, mlflow_password=password)
        values["CONDUIT_RAY_PIDS"] = ",".join(str(p.pid) for p in ray_processes(temp_dir))
        write_env(env_path, values)
        wait_jobs_api(values["RAY_ADDRESS"], token_path, deadline)
        wait_mlflow(values["MLFLOW_TRACKING_URI"], mlflow, state_dir / "mlflow.log", deadline)
    except BaseException:
        down(state_dir)
        raise
    return values


# ---- down ----------------------------------------------------------------------------------------
def down(state_dir: Path) -> list[str]:
    """Stop what ``up`` started for ``state_dir`` and remove its env file, token and Ray temp dir.

    Returns:
        One line per service saying what was stopped (empty when there was no env file).
    """
    env_path = state_dir / "env"
    if not env_path.exists():
        return []
    values = read_env(env_path)
    report = []
    temp_dir = Path(values["CONDUIT_RAY_TEMP_DIR"])
    n = terminate(ray_processes(temp_dir))
    report.append(f"ray: stopped {n} processes under {temp_dir}")
    if values.get("CONDUIT_MLFLOW_PID"):
        pid = int(values["CONDUIT_MLFLOW_PID"])
        n = terminate(process_group(pid, str(state_dir / "mlflow.db")))
        report.append(f"mlflow: stopped {n} processes (server pid {pid})")
    if temp_dir.exists():  # session logs and the now stale ray_current_cluster
        shutil.rmtree(temp_dir, onerror=_unless_gone)  # an exiting process may still remove its own files
    for secret in (state_dir / TOKEN_FILE, state_dir / MLFLOW_PASSWORD_FILE):
        if secret.exists():
            secret.unlink()  # it opened services that no longer exist
    env_path.unlink()
    return report


def _unless_gone(func, path, exc_info) -> None:
    """``shutil.rmtree``'s error handler: a file that vanished meanwhile is fine, anything else raises."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infra/local/{up,down}", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["up", "down"])
    p.add_argument("--state-dir", default=str(REPO_ROOT / "outputs" / "infra"),
                   help="env file, mlflow.db, artifacts and logs (default: outputs/infra)")
    p.add_argument("--num-cpus", type=int, default=max(4, os.cpu_count() or 1),
                   help="logical CPUs of the head (default: max(4, cores): the smoke pipeline needs 4)")
    p.add_argument("--worker-nodes", type=int, default=0, help="extra Ray nodes on this machine")
    p.add_argument("--worker-cpus", type=int, default=2, help="logical CPUs of each extra node")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for both services")
    p.add_argument("--artifacts-destination", metavar="URI",
                   help="where MLflow keeps artifacts and registered models, proxied by the server: an object "
                        "store such as s3://bucket/mlflow (credentials and MLFLOW_S3_ENDPOINT_URL from this "
                        "environment); default <state-dir>/mlartifacts")
    p.add_argument("--mlflow-auth", action="store_true",
                   help="MLflow's basic-auth app: every request needs a user (admin, password in the state dir)")
    args = p.parse_args(argv)
    state_dir = Path(args.state_dir).expanduser().resolve()
    if args.command == "down":
        lines = down(state_dir)
        print("\n".join(lines) if lines else f"nothing to stop: no {state_dir / 'env'}")
        return 0
    try:
        dest = args.artifacts_destination
        if dest and "://" in dest and ":" in dest.split("://", 1)[1].split("/", 1)[0].rpartition("@")[0]:
            print("error: --artifacts-destination has credentials in its URI (user:secret@), which the env file "
                  "and process list would show; set them in the environment (AWS_ACCESS_KEY_ID, ...)", file=sys.stderr)
            return 2
        values = up(state_dir, args.num_cpus, args.worker_nodes, args.worker_cpus, args.timeout, dest,
                    args.mlflow_auth)
    except InfraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Ray Jobs API  {values['RAY_ADDRESS']}  (dashboard; GCS {values['CONDUIT_RAY_GCS_ADDRESS']})")
    print(f"MLflow        {values['MLFLOW_TRACKING_URI']}   (artifacts proxied to {dest or state_dir / 'mlartifacts'})")
    if args.mlflow_auth:
        print(f"MLflow auth   export MLFLOW_TRACKING_USERNAME={MLFLOW_ADMIN} "
              f"MLFLOW_TRACKING_PASSWORD=\"$(cat {values['CONDUIT_MLFLOW_PASSWORD_FILE']})\"   (mode 0600)")
    print(f"Ray token     {values['RAY_AUTH_TOKEN_PATH']}   (mode 0600; clients read it through RAY_AUTH_TOKEN_PATH)")
    print(f"env file      {state_dir / 'env'}   (source it, or let `make run` / jobs.submit read it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

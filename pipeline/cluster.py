"""Talking to a running Ray cluster through the Ray Jobs API: addresses, the job's runtime_env, follow.

``jobs.submit`` / ``jobs.status`` / ``jobs.logs`` / ``jobs.stop`` are thin doors onto this module.

Where the cluster is: ``--address``, else ``$RAY_ADDRESS``, else the env file that ``infra/local/up``
writes (``$CONDUIT_INFRA_ENV``, default ``outputs/infra/env``). The same file supplies
``MLFLOW_TRACKING_URI`` when the environment does not, and ``RAY_AUTH_MODE`` and
``RAY_AUTH_TOKEN_PATH`` (the cluster's token) for its own cluster's address.

A submitted job runs in a copy of this repository (the ``working_dir``) under the cluster's temp
folder, so every relative location in the config would land in, or be looked up in, that throwaway
copy. ``pin_locations`` turns them into this machine's absolute paths, which is right when the
cluster's nodes see this machine's disk (a local cluster, or a shared mount at the same path).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import credentials
from pipeline.base import REPO_ROOT, is_uri

if TYPE_CHECKING:  # a hint only: the jobs.status / logs / stop CLIs need no config, no models, no torch
    from pipeline.config import RunConfig

DEFAULT_ENV_FILE = REPO_ROOT / "outputs" / "infra" / "env"
ENV_FILE_VAR = "CONDUIT_INFRA_ENV"
# What never travels in working_dir (gitignore syntax, relative to the repo root). Ray also honours
# .gitignore; these are listed so that a checkout without one does not upload a 2 GB venv.
# A leading "/" anchors a pattern at the repo root (pipeline/data/ is code and must travel).
WORKING_DIR_EXCLUDES = [
    "/.git", "/.venv", "/venv", "/outputs", "/mlruns", "/data", "/build",
    "__pycache__", "*.pyc", ".pytest_cache", "*.egg-info",
]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class ClusterError(RuntimeError):
    """No cluster address, an unreadable env file, or a job id the cluster does not know."""


# ---- the env file written by infra/local/up --------------------------------------------------------
def env_file_path() -> Path:
    """``$CONDUIT_INFRA_ENV``, else ``outputs/infra/env`` in this repository."""
    return Path(os.environ.get(ENV_FILE_VAR) or DEFAULT_ENV_FILE)


def read_env_file(path: Path) -> dict[str, str]:
    """Parse ``KEY=value`` lines (``#`` comments and blank lines allowed; no quoting, no expansion).

    Args:
        path: the file; a missing file reads as empty.

    Returns:
        The variables, in file order.

    Raises:
        ClusterError: a line that is not ``KEY=value``.
    """
    if not path.is_file():
        return {}
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ClusterError(f"{path}:{n}: expected KEY=value, got {line!r}")
        out[key.strip()] = value.strip()
    return out


def resolve_address(address: str | None) -> str:
    """The Jobs API address: the argument, else ``$RAY_ADDRESS``, else the env file's ``RAY_ADDRESS``.

    Raises:
        ClusterError: none of the three is set.
    """
    found = address or os.environ.get("RAY_ADDRESS") or read_env_file(env_file_path()).get("RAY_ADDRESS")
    if not found:
        raise ClusterError(
            f"no Ray cluster address: pass --address http://HOST:8265, set RAY_ADDRESS, or start one "
            f"with infra/local/up (which writes {env_file_path()})"
        )
    return found


def resolve_tracking_uri(uri: str | None, cfg: RunConfig) -> str | None:
    """MLflow URI for the job: the argument, the config's ``tracking.uri``, ``$MLFLOW_TRACKING_URI``,
    then the env file's. None leaves the job on its default (sqlite under ``run.workdir``)."""
    return (uri or cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
            or read_env_file(env_file_path()).get("MLFLOW_TRACKING_URI"))


def mlflow_login(uri: str | None) -> dict[str, str]:
    """The MLflow login this submitter has for ``uri``: ``MLFLOW_TRACKING_USERNAME`` /
    ``MLFLOW_TRACKING_PASSWORD`` / ``MLFLOW_TRACKING_TOKEN`` from the environment and, when ``uri`` is
    the env file's MLflow server (``infra/local/up --mlflow-auth``), the user and the password file
    (``CONDUIT_MLFLOW_PASSWORD_FILE``) it names for what the environment leaves out.

    Raises:
        ClusterError: the env file names a password file that cannot be read.
    """
    login = {k: os.environ[k] for k in credentials.MLFLOW_LOGIN_VARS if os.environ.get(k)}
    values = read_env_file(env_file_path())
    if uri and uri == values.get("MLFLOW_TRACKING_URI"):
        if "MLFLOW_TRACKING_USERNAME" in values:
            login.setdefault("MLFLOW_TRACKING_USERNAME", values["MLFLOW_TRACKING_USERNAME"])
        password_file = values.get("CONDUIT_MLFLOW_PASSWORD_FILE")
        if password_file and "MLFLOW_TRACKING_PASSWORD" not in login:
            try:
                login["MLFLOW_TRACKING_PASSWORD"] = Path(password_file).read_text().strip()
            except OSError as e:
                raise ClusterError(f"{env_file_path()}: CONDUIT_MLFLOW_PASSWORD_FILE={password_file} cannot be "
                                   f"read ({e.strerror})") from e
    return login


AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


def apply_auth(address: str) -> None:
    """Token auth for ``address``: when it is the env file's cluster (its Jobs API or, for
    ``pipeline.serving.deploy``, its GCS address), take ``RAY_AUTH_MODE`` and
    ``RAY_AUTH_TOKEN_PATH`` from that file unless the environment sets them (or ``RAY_AUTH_TOKEN``)
    itself. Another address never gets the env file's token. Ray reads these variables once, on its
    first use, so this must run before that."""
    values = read_env_file(env_file_path())
    if address not in (values.get("RAY_ADDRESS"), values.get("CONDUIT_RAY_GCS_ADDRESS")):
        return
    own_token = "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ
    for key in AUTH_VARS:
        if key in values and key not in os.environ and not (key == "RAY_AUTH_TOKEN_PATH" and own_token):
            os.environ[key] = values[key]


def where_tokens_are() -> str:
    """Where a client looks for the cluster's token, in Ray's order, as one sentence for errors."""
    env_file = env_file_path()
    return (f"Ray clusters started by `ray start` (infra/local/up included) need a token: Conduit's clients "
            f"send it when RAY_AUTH_MODE=token and take it from $RAY_AUTH_TOKEN, else the file named by "
            f"$RAY_AUTH_TOKEN_PATH (infra/local/up writes that line into {env_file}), else ~/.ray/auth_token")


def connection_error(address: str, exc: BaseException) -> ClusterError:
    """A ``ClusterError`` for a failed connection to ``address``, saying what the token has to do
    with it (Ray's own message for a wrong GCS token is only 'Failed to connect')."""
    from ray.exceptions import AuthenticationError

    mode = os.environ.get("RAY_AUTH_MODE", "unset")
    if isinstance(exc, AuthenticationError):
        first = str(exc).strip().splitlines()[0]
        return ClusterError(f"the Ray cluster at {address} refused this client's token ({first}; "
                            f"RAY_AUTH_MODE={mode}). {where_tokens_are()}")
    return ClusterError(f"could not connect to the Ray cluster at {address}: {exc}. If it answers, a missing "
                        f"or wrong token is the usual cause (RAY_AUTH_MODE={mode}). {where_tokens_are()}")


def client(address: str | None):
    """A ``JobSubmissionClient`` for the resolved address (it checks the connection on creation).

    Raises:
        ClusterError: no address could be resolved, nothing answers there, or the cluster refuses
            the token (or its absence); the message says where the token is looked for.
    """
    resolved = resolve_address(address)
    apply_auth(resolved)  # before ray is imported: Ray reads RAY_AUTH_MODE once
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(resolved)
    except (AuthenticationError, ConnectionError) as e:
        raise connection_error(resolved, e) from e


# ---- what a job is sent with ----------------------------------------------------------------------
def pin_locations(cfg: RunConfig) -> tuple[list[str], dict[str, str]]:
    """Overrides and env vars that make the job read and write where this machine would.

    Returns:
        ``(overrides, env_vars)``: ``run.workdir`` always absolute; ``run.artifact_root`` and
        ``data.data_root`` absolute when set to local paths; ``CONDUIT_DATA_ROOT`` always.
    """
    overrides = [f"run.workdir={cfg.workdir()}"]
    if cfg.run.artifact_root and not is_uri(cfg.run.artifact_root):
        overrides.append(f"run.artifact_root={cfg.artifact_root()}")
    if cfg.data.data_root:
        overrides.append(f"data.data_root={cfg.data_root()}")
    return overrides, {"CONDUIT_DATA_ROOT": str(cfg.data_root())}


def repo_relative(config_path: str | Path) -> str:
    """The config's path inside the repository, as the job (whose cwd is the working_dir copy) sees it.

    Raises:
        ClusterError: the file is outside the repository or in a folder that does not travel.
    """
    path = Path(config_path).expanduser().resolve()
    try:
        rel = path.relative_to(REPO_ROOT)
    except ValueError as e:
        raise ClusterError(
            f"config {config_path} is outside the repository {REPO_ROOT}; only files inside it travel "
            "with the job (put it under configs/)"
        ) from e
    if f"/{rel.parts[0]}" in WORKING_DIR_EXCLUDES:
        raise ClusterError(f"config {config_path} is under {rel.parts[0]}/, which is not sent with the job")
    return rel.as_posix()


@dataclass
class JobSpec:
    """Everything ``JobSubmissionClient.submit_job`` is called with."""

    submission_id: str
    entrypoint: str
    runtime_env: dict


def new_submission_id() -> str:
    """``raysubmit_`` + 16 letters and digits, the form Ray gives the ids it makes itself."""
    alphabet = string.ascii_letters + string.digits
    return "raysubmit_" + "".join(secrets.choice(alphabet) for _ in range(16))


def job_spec(config_rel: str, overrides: list[str], env_vars: dict[str, str],
             run_args: list[str] | None = None, module: str = "jobs.run", login_package: Path | None = None) -> JobSpec:
    """The entrypoint ``python -m jobs.run CONFIG OVERRIDES ARGS`` (``module``: ``jobs.sweep`` for a sweep
    file) and its runtime_env.

    The submission id is chosen here and also passed as ``RAY_JOB_SUBMISSION_ID``: Ray does not put
    it in the driver's environment, and the runner names the MLflow parent run after that variable.

    The env vars of ``pipeline.runner.worker_env()`` are deliberately absent: the job's driver passes
    them to ``ray.init(runtime_env=...)`` itself, and Ray refuses to merge a job runtime_env and a
    driver runtime_env that set the same variable.

    Args:
        config_rel: the config's repository-relative path (``repo_relative``).
        overrides: ``a.b=c`` strings, applied in order.
        env_vars: extra environment of the driver and every task (MLFLOW_TRACKING_URI, ...).
        run_args: extra ``jobs.run`` flags (``--only train``, ``--force evaluate``, ``--dry-run``).
        login_package: ``credentials.job_login_package``'s folder, sent as ``py_modules`` (the MLflow
            login: never in ``env_vars``, which ``ray job list`` shows); it must exist until the job
            is submitted (Ray uploads it then).

    Raises:
        ClusterError: an env var's value carries a credential in a URI (``$MLFLOW_TRACKING_URI``).
    """
    for name, value in env_vars.items():  # a runtime env is shown by the dashboard and `ray job list`
        try:
            credentials.check_uri(f"the job's environment variable {name}", value)
        except credentials.CredentialsInUri as e:
            raise ClusterError(str(e)) from e
        if name in credentials.MLFLOW_LOGIN_VARS:
            raise ClusterError(f"{name} would be shown by `ray job list` and the dashboard as part of the job's "
                               "runtime env; pass the MLflow login as login_package")
    argv = ["python", "-m", module, config_rel, *overrides, *(run_args or [])]
    submission_id = new_submission_id()
    runtime_env = {"working_dir": str(REPO_ROOT), "excludes": list(WORKING_DIR_EXCLUDES),
                   "env_vars": {**env_vars, "RAY_JOB_SUBMISSION_ID": submission_id}}
    if login_package is not None:
        runtime_env["py_modules"] = [str(login_package)]
    return JobSpec(submission_id=submission_id, entrypoint=shlex.join(argv), runtime_env=runtime_env)


# ---- following a job ------------------------------------------------------------------------------
def follow(job_client, job_id: str, out=sys.stdout, timeout_s: float = 60.0) -> str:
    """Stream the job's logs to ``out`` until it ends, and return its final status.

    Args:
        timeout_s: how long to wait for a terminal status once the log stream has closed.

    Raises:
        ClusterError: the log stream ended but the job did not reach a terminal status in time.
    """
    async def _tail() -> None:
        async for chunk in job_client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    asyncio.run(_tail())
    return wait_terminal(job_client, job_id, timeout_s)


def wait_terminal(job_client, job_id: str, timeout_s: float) -> str:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED; return that status.

    Raises:
        ClusterError: still running after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(job_client.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            raise ClusterError(f"job {job_id} is still {status} after {timeout_s:.0f}s")
        time.sleep(1.0)


def exit_code(status: str) -> int:
    """0 for SUCCEEDED, 1 for FAILED or STOPPED (so scripts can chain on ``--follow``)."""
    return 0 if status == "SUCCEEDED" else 1

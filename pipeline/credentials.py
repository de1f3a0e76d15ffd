"""Credentials never travel inside a URI: found, refused at config load, and redacted where printed.

The whole resolved config is logged to MLflow as params, saved in every artifact's manifest, and
shipped to Ray tasks; a secret inside one of its URIs (``postgresql://user:pass@db/mlflow``,
``s3://KEY:SECRET@bucket``, ``s3://b/x?secret_key=...``) would be copied to all of them. So
``pipeline.config.validate`` refuses every config string that carries one (``config_problem``), and
URIs that do not come from the config (``$MLFLOW_TRACKING_URI``, ``--tracking-uri``) are checked by the
same rule where they enter or ``redact``-ed where they are printed.

Each store has a place for its secret outside the URI: S3 reads ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, an MLflow server ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``
(or ``MLFLOW_TRACKING_TOKEN``), PostgreSQL and MySQL their password files or ``PGPASSWORD``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from pipeline.base import SECRET_PARAMS, URI_PATTERN as _URI
from pipeline.base import redact as redact  # noqa: F401  (offered here too: callers redact what they print)
WHERE_INSTEAD = ("set credentials in the environment instead (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for S3, "
                 "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for an MLflow server, PGPASSWORD or a "
                 "password file for a database)")


def found_in(value: str) -> str | None:
    """What credential ``value`` carries in a URI, without its value, or None.

    A password in the user part (``user:secret@host``) or a query parameter of ``SECRET_PARAMS``; a user
    name alone (``hdfs://alice@namenode``) is not a secret.
    """
    for m in _URI.finditer(value):
        userinfo = m.group("authority").rpartition("@")[0]
        if ":" in userinfo:
            return f"a password in its user part ({userinfo.split(':', 1)[0]}:***@)"
        secret = sorted({k for k, _ in parse_qsl(m.group("query") or "", keep_blank_values=True)
                         if k.lower() in SECRET_PARAMS})
        if secret:
            return f"the secret query parameter(s) {secret}"
    return None


def strings_of(value: Any, name: str):
    """Yield ``(dotted field name, string)`` for every string in a config dict (lists indexed: ``a.b[0]``)."""
    if isinstance(value, str):
        yield name, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_of(v, f"{name}.{k}" if name else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from strings_of(v, f"{name}[{i}]")


def config_problem(config: dict) -> str | None:
    """The first field of a config dict (``RunConfig.to_dict()``) whose value carries a credential, as
    an error message that names the field and what was found but not the secret; None when clean."""
    for name, value in strings_of(config, ""):
        what = found_in(value)
        if what is not None:
            return (f"{name} has credentials in its URI ({what}), which would be saved with the config in "
                    f"MLflow params and manifests; {WHERE_INSTEAD}")
    return None


class CredentialsInUri(ValueError):
    """A URI from outside the config (an environment variable, a flag) that carries a credential."""


def check_uri(name: str, value: str | None) -> None:
    """Refuse a URI that does not come from the config (an environment variable, a flag) the same way.

    Raises:
        CredentialsInUri: naming ``name`` and what was found, not the secret.
    """
    what = None if value is None else found_in(value)
    if what is not None:
        raise CredentialsInUri(f"{name} has credentials in its URI ({what}), which would reach MLflow params, logs or "
                         f"a Ray runtime env; {WHERE_INSTEAD}")


# ---- an MLflow server's login, carried to a submitted job ------------------------------------------
# The variables MLflow's client reads for a server that asks who is calling (basic auth or a bearer token).
MLFLOW_LOGIN_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
# The Python package that carries them into a job (``job_login_package``); ``apply_job_login`` reads it.
JOB_LOGIN_PACKAGE = "conduit_job_login"


def job_login_package(folder: str | Path, login: dict[str, str]) -> Path:
    """Write ``login`` as the package ``<folder>/conduit_job_login`` (a data file, mode 0600) for a job's
    ``runtime_env`` ``py_modules``.

    A job's ``env_vars`` are shown by ``ray job list``, ``ray list jobs --detail`` and the dashboard; a
    ``py_modules`` package is shown only as its content-addressed ``gcs://_ray_pkg_<hash>.zip`` URI. Ray
    puts it on the import path of the job's driver and of every task and actor the job starts (stage
    tasks, Ray Train workers, Tune trials), where ``apply_job_login`` turns it back into MLflow's
    variables before a client connects.
    """
    package = Path(folder) / JOB_LOGIN_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""The MLflow login of a job submitted by Conduit\'s jobs.submit."""\n')
    data = package / "login.json"
    fd = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({k: v for k, v in login.items() if k in MLFLOW_LOGIN_VARS}, f)
    return package


def apply_job_login() -> list[str]:
    """In a job's process: MLflow's login variables from ``conduit_job_login``, when the job was sent
    with one. The submitter's login is the job's: it replaces whatever login the node's environment
    has (a cluster may log its own processes in as a service user). Cheap after the first call.

    Returns:
        The names of the variables set by this call.
    """
    global _login_applied
    if _login_applied:
        return []
    _login_applied = True
    spec = importlib.util.find_spec(JOB_LOGIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return []
    data = Path(next(iter(spec.submodule_search_locations))) / "login.json"
    login = {k: v for k, v in json.loads(data.read_text()).items() if k in MLFLOW_LOGIN_VARS and v} \
        if data.is_file() else {}
    if not login:
        return []
    for key in MLFLOW_LOGIN_VARS:
        os.environ.pop(key, None)
    os.environ.update(login)
    return sorted(login)


_login_applied = False

"""Serve a registered model version over HTTP with MLflow's scoring server.

    python -m jobs.serve NAME@champion --port 5001 [--host 127.0.0.1] [--tracking-uri URI]

Runs ``mlflow models serve -m models:/NAME@ALIAS --env-manager local`` (this venv, no new
environment), bound to 127.0.0.1 unless ``--host`` says otherwise, after checking that the alias is
set. POST /invocations answers prompts with generated text; GET /ping answers when the model is loaded.
The server replaces this process, so stopping it (Ctrl-C, SIGTERM) stops the server.
"""

from __future__ import annotations

import argparse
import os
import sys

from pipeline import tracking
from pipeline.config import ConfigError, load_config
from pipeline.serving.listen import warn_if_exposed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.serve", description=__doc__.splitlines()[0])
    p.add_argument("model", help="NAME@ALIAS (e.g. conduit-demo@champion) or NAME/VERSION")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--config", help="YAML config whose tracking section names the registry")
    p.add_argument("--tracking-uri", help="MLflow tracking/registry URI (default: the config's)")
    return p.parse_args(argv)


def resolve(uri: str, model: str) -> str:
    """``NAME@ALIAS`` or ``NAME/VERSION`` -> the ``models:/`` URI, checked against the registry.

    Raises:
        LookupError: an unknown model, alias or version; ValueError: a malformed reference.
    """
    if "@" in model:
        name, alias = model.rsplit("@", 1)
        if not name or not alias:
            raise ValueError(f"model reference {model!r} must look like NAME@ALIAS")
        if tracking.version_by_alias(uri, name, alias) is None:
            raise LookupError(f"model {name!r} has no alias {alias!r} (at {uri})")
        return f"models:/{name}@{alias}"
    name, _, version = model.rpartition("/")
    if not name or not version.isdigit():
        raise ValueError(f"model reference {model!r} must look like NAME@ALIAS or NAME/VERSION")
    tracking.get_version(uri, name, int(version))
    return f"models:/{name}/{version}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        uri = args.tracking_uri or load_config(args.config).tracking_uri()
        model_uri = resolve(uri, args.model)
    except (ConfigError, LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
           "-p", str(args.port), "--host", args.host]
    print(f"serving {model_uri} from {uri} on http://{args.host}:{args.port} (POST /invocations, GET /ping)",
          flush=True)
    warn_if_exposed("the MLflow scoring server", args.host, "--host")
    # MLflow starts the server as `uvicorn ...` through a shell: this interpreter's bin folder must lead
    # PATH even when the venv is not activated (`.venv/bin/python -m jobs.serve`).
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, **tracking.env_for_workers(), "PATH": path, "MLFLOW_TRACKING_URI": uri,
           "MLFLOW_REGISTRY_URI": uri}
    os.execve(sys.executable, cmd, env)
    return 0  # not reached: execve replaces this process


if __name__ == "__main__":
    sys.exit(main())

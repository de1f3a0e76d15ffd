"""Serve a registered model version on Ray Serve, behind an OpenAI-compatible API.

    python -m jobs.deploy NAME[@ALIAS] [--address HOST:PORT] [--replicas N] [--cpus C] [--gpus G]
                          [--port P] [--host H] [--config configs/x.yaml] [--tracking-uri URI]
    python -m jobs.deploy NAME --down [--address HOST:PORT]   (default: the cluster its tags name)

ALIAS defaults to ``champion``. Settings come from the config's ``deploy`` section; the flags override
it. The deployment follows the alias: ``jobs.promote`` rolls it over to a new champion. Prints the
status, the endpoint (the OpenAI base URL) and the version, which are also tagged on the version
(``deploy.*``). Without a cluster address Ray starts in this process, and the deployment serves until
Ctrl-C (or SIGTERM); meanwhile one status line says what it does (the version answering, completions
per second, their p50 latency, errors, the largest batch), redrawn in place on a terminal and printed
every ``STATUS_EVERY_S`` seconds otherwise, and the replicas' access log goes to the folder the first
line names. Exit status: 0 deployed (or taken down), 2 usage, bad reference or no cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
import urllib.request

from pipeline.serving import deploy
from pipeline.cluster import ClusterError
from pipeline.config import ConfigError, load_config


STATUS_EVERY_S = 2.0  # how often the status line is redrawn (a terminal)
STATUS_LINE_EVERY_S = 30.0  # how often it is printed where output is not a terminal (a log)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.deploy", description=__doc__.splitlines()[0])
    p.add_argument("model", help="NAME or NAME@ALIAS (default alias: champion)")
    p.add_argument("--down", action="store_true", help="remove the model's deployment from the cluster")
    p.add_argument("--address", help="Ray GCS address HOST:PORT (default: $RAY_ADDRESS, the infra env file, "
                                     "else Ray starts here)")
    p.add_argument("--replicas", type=int, help="deploy.num_replicas")
    p.add_argument("--cpus", type=float, help="deploy.num_cpus_per_replica")
    p.add_argument("--gpus", type=float, help="deploy.num_gpus_per_replica")
    p.add_argument("--port", type=int, help="deploy.port (Serve's HTTP port, one per cluster)")
    p.add_argument("--host", help="deploy.host (default 127.0.0.1: this machine only)")
    p.add_argument("--config", help="YAML config with deploy and tracking sections")
    p.add_argument("--tracking-uri", help="MLflow tracking/registry URI (default: the config's)")
    p.add_argument("--status-every", type=float, default=None, metavar="S",
                   help=f"serving here: print the status line every S seconds (default: redrawn every "
                        f"{STATUS_EVERY_S:.0f} s on a terminal, else printed every {STATUS_LINE_EVERY_S:.0f} s)")
    return p.parse_args(argv)


FLAGS = {"replicas": "num_replicas", "cpus": "num_cpus_per_replica", "gpus": "num_gpus_per_replica",
         "port": "port", "host": "host"}


def status_line(now: dict, before: dict | None, seconds: float) -> str:
    """One line of what the deployment did since ``before``, from two /healthz answers ``seconds`` apart."""
    c, b = now["completions"], now["batches"]
    rate = (c["ok"] - before["completions"]["ok"]) / seconds if before is not None and seconds > 0 else 0.0
    p50 = "-" if c["p50_latency_s"] is None else f"{c['p50_latency_s']:.2f} s"
    # vLLM's batches are its own: its ingress counts the most requests in flight at once instead
    most = f"most in flight {b['largest']}" if now.get("engine") == "vllm" else f"largest batch {b['largest']}"
    return (f"v{now['version']}: {rate:.1f} completions/s, p50 {p50}, {c['ok']} answered, {c['errors']} errors, "
            f"{most}")


def _healthz(endpoint: str) -> dict | None:
    try:
        with urllib.request.urlopen(endpoint.removesuffix("/v1") + "/healthz", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None  # rolling over, or busy: the next poll tells


def _serve_until_stopped(uri: str, d: deploy.Deployment, every_s: float | None) -> None:
    """Keep the embedded Ray (and so the deployment) alive until Ctrl-C or SIGTERM, with a status line
    (printed every ``every_s`` seconds when given, else redrawn in place on a terminal or printed every
    ``STATUS_LINE_EVERY_S`` seconds)."""
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    tty = sys.stdout.isatty() and every_s is None
    poll_s, print_s = (every_s, every_s) if every_s is not None else (STATUS_EVERY_S, STATUS_LINE_EVERY_S)
    print(f"access log: {deploy.serve_log_dir()} (Serve's replica logs)\nserving until Ctrl-C (Ray runs in this "
          "process)", flush=True)
    before, t_before, last_print = None, time.monotonic(), 0.0
    try:
        while True:
            time.sleep(poll_s)
            now, t_now = _healthz(d.endpoint), time.monotonic()
            if now is None:
                continue
            line = status_line(now, before, t_now - t_before)
            if tty:
                print(f"\r\x1b[K{line}", end="", flush=True)
            elif t_now - last_print >= print_s:
                print(line, flush=True)
                last_print = t_now
            before, t_before = now, t_now
    except KeyboardInterrupt:
        if tty:
            print()
        served = deploy.served_version(uri, d.model_name)  # a promotion may have rolled it meanwhile
        if served is not None:
            deploy.mark_stopped(uri, d.model_name, served)
        print(f"stopped; {d.model_name} v{served} tagged deploy.status=stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name, _, alias = args.model.partition("@")
    try:
        if not name or (args.model.count("@") == 1 and not alias) or args.model.count("@") > 1:
            raise ValueError(f"model reference {args.model!r} must look like NAME or NAME@ALIAS")
        cfg = load_config(args.config)
        uri = args.tracking_uri or cfg.tracking_uri()
        section = dataclasses.replace(cfg.deploy, **{field: getattr(args, flag) for flag, field in FLAGS.items()
                                                     if getattr(args, flag) is not None})
        if args.down:  # on the given cluster, else on the one the registry says serves the model
            address = args.address or deploy.resolve_address(None) or deploy.recorded_address(uri, name)
            if address is None:
                raise LookupError(f"no cluster to take {name!r} down from: no --address, RAY_ADDRESS or infra env "
                                  f"file, and no version of it is tagged deploy.status=running at {uri}")
            deploy.connect(address)
            served = deploy.served_version(uri, name)
            removed = deploy.down(uri, name)
            print(f"{deploy.app_name(name)}: " + ("removed" if removed else "not deployed on this cluster")
                  + ("" if served is None or not removed else f"; v{served} tagged deploy.status=down"))
            return 0
        gcs, started_here = deploy.connect(args.address)
        d = deploy.deploy(section, uri, name, alias or "champion", gcs)
    except (ConfigError, LookupError, ValueError, ClusterError, deploy.DeployError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{d.app}: {d.status}, serving {d.model_name} v{d.version} (@{d.alias}) on Ray at {d.ray_address}\n"
          f"engine: {d.engine} ({d.engine_reason})\n"
          f"endpoint: {d.endpoint}  (POST /completions, GET /models; OpenAI clients: base_url={d.endpoint})",
          flush=True)
    if started_here:
        _serve_until_stopped(uri, d, args.status_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())

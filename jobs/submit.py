"""Submit a Conduit pipeline, or a sweep, to a Ray cluster as a Ray job (the config is validated here first).

    python -m jobs.submit configs/smoke.yaml [section.field=value ...] [--address http://HOST:8265]
        [--tracking-uri URI] [--follow] [--only STAGE | --until STAGE] [--force STAGE] [--dry-run] [--keep-paths]
    python -m jobs.submit configs/sweeps/smoke_lr.yaml [section.field=value ...] [--follow] ...

A sweep file (one top-level key, ``sweep``) runs as ``jobs.sweep`` in the job, its trials drawn and
checked here first; the overrides apply to every trial.

Prints the job id on stdout. With --follow, streams the job's logs and exits 0 if it SUCCEEDED,
1 if it FAILED or was STOPPED. A bad config exits 2 before anything is sent.

Checking a config imports neither torch nor the stages (Ray, MLflow): the stage names come from
``pipeline.base.STAGE_ORDER``, so ``--help`` and a bad config answer at once.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from pipeline import cluster
from pipeline.base import STAGE_ORDER
from pipeline.config import ConfigError, load_config
from pipeline.sweep.spec import is_sweep_file, load_sweep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.submit", description=__doc__.splitlines()[0])
    p.add_argument("config", help="YAML config file inside this repository (it travels with the job)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.steps=50")
    p.add_argument("--address", help="Ray Jobs API, http://HOST:8265 (default: $RAY_ADDRESS, then infra env file)")
    p.add_argument("--tracking-uri", help="MLflow server for the job (default: config, $MLFLOW_TRACKING_URI, env file)")
    p.add_argument("--follow", action="store_true", help="stream the logs and exit with the job's status")
    p.add_argument("--only", choices=STAGE_ORDER, help="passed to jobs.run")
    p.add_argument("--until", choices=STAGE_ORDER, help="passed to jobs.run")
    p.add_argument("--force", action="append", default=[], choices=STAGE_ORDER, help="passed to jobs.run (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="passed to jobs.run: the job prints the plan")
    p.add_argument("--keep-paths", action="store_true",
                   help="send run.workdir / data root as written (the cluster does not share this disk)")
    return p.parse_intermixed_args(argv)  # overrides may follow the flags


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sweep = is_sweep_file(args.config)
    try:
        if sweep:
            if args.only or args.until or args.force:
                raise ConfigError("--only, --until and --force are for a pipeline; a sweep's trials run up to "
                                  "evaluate and its best is registered")
            cfg = load_sweep(args.config, args.overrides).trials[0].cfg
        else:
            cfg = load_config(args.config, args.overrides)
        config_rel = cluster.repo_relative(args.config)
    except (ConfigError, cluster.ClusterError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:  # what jobs.run --dry-run will print in the job, shown here before submitting
        from pipeline.plan.report import summary

        print(summary(cfg), file=sys.stderr)
    pinned, env_vars = ([], {}) if args.keep_paths else cluster.pin_locations(cfg)
    uri = cluster.resolve_tracking_uri(args.tracking_uri, cfg)
    if uri:
        env_vars["MLFLOW_TRACKING_URI"] = uri
    run_args = [*(["--only", args.only] if args.only else []), *(["--until", args.until] if args.until else []),
                *[a for s in args.force for a in ("--force", s)],
                *(["--dry-run"] if args.dry_run else [])]
    with tempfile.TemporaryDirectory(prefix="conduit_submit_") as tmp:
        try:
            package = _login_package(uri, tmp)
            spec = cluster.job_spec(config_rel, [*args.overrides, *pinned], env_vars, run_args,
                                    module="jobs.sweep" if sweep else "jobs.run", login_package=package)
            jc = cluster.client(args.address)
        except cluster.ClusterError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        job_id = jc.submit_job(entrypoint=spec.entrypoint, runtime_env=spec.runtime_env,
                               submission_id=spec.submission_id)  # uploads the login package
    print(job_id, flush=True)
    print(f"submitted {spec.entrypoint!r} to {jc.get_address()}", file=sys.stderr)
    if not args.follow:
        return 0
    status = cluster.follow(jc, job_id)
    print(f"job {job_id}: {status}", file=sys.stderr)
    return cluster.exit_code(status)


def _login_package(uri: str | None, folder: str):
    """The job's MLflow login (``cluster.mlflow_login``) as a package under ``folder``, checked against
    the server first; None when this shell has none.

    Raises:
        cluster.ClusterError: the server turns the login away (or its absence), naming what to set.
    """
    login = cluster.mlflow_login(uri)
    if uri and uri.startswith(("http://", "https://")):
        from pipeline import tracking

        try:
            tracking.check_login(uri, login)
        except tracking.TrackingUnavailable as e:
            raise cluster.ClusterError(str(e)) from e
    if not login:
        return None
    from pipeline.credentials import job_login_package

    return job_login_package(folder, login)


if __name__ == "__main__":
    sys.exit(main())

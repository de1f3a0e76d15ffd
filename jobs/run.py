"""Run a Conduit pipeline here (embedded Ray and MLflow by default) or inside a Ray job.

    python -m jobs.run configs/smoke.yaml [section.field=value ...] [--dry-run] [--only STAGE] [--force STAGE]
"""

from __future__ import annotations

import argparse
import signal
import sys

from pipeline.cluster import ClusterError
from pipeline.config import ConfigError, load_config
from pipeline.runner import ORDER, StageFailed, main_exit_code, run_pipeline
from pipeline.stage_io import RegisteredModel
from pipeline.storage import StorageError
from pipeline.tracking import TrackingUnavailable, ui_command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.run", description=__doc__.splitlines()[0])
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.steps=50")
    p.add_argument("--dry-run", action="store_true", help="print the plan with hashes and what is cached")
    p.add_argument("--only", choices=ORDER, help="run just this stage (its inputs must be cached)")
    p.add_argument("--force", action="append", default=[], choices=ORDER,
                   help="rerun this stage and everything after it (repeatable)")
    return p.parse_intermixed_args(argv)  # overrides may follow the flags


_SIGNALS: list[str] = []  # the signals that ended the run (Ray may re-raise KeyboardInterrupt without its text)


def _interrupt(signum, frame):
    _SIGNALS.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(_SIGNALS[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `ray job stop`, `kill`: end as Ctrl-C does (runs KILLED)
    try:
        cfg = load_config(args.config, args.overrides)
        result = run_pipeline(cfg, only=args.only, force=tuple(args.force), dry_run=args.dry_run)
    except (ConfigError, ClusterError, StageFailed, TrackingUnavailable, StorageError) as e:
        return main_exit_code(e)
    except KeyboardInterrupt:
        print(f"interrupted ({_SIGNALS[-1] if _SIGNALS else 'SIGINT'}): the MLflow runs are KILLED; finished "
              "stages stay cached, and a rerun of this command continues training from its latest checkpoint",
              file=sys.stderr)
        return 130
    if not args.dry_run:
        print(f"\nMLflow run: {result.run_id}  (tracking URI {result.tracking_uri})")
        if "register" in result.artifacts:
            reg = RegisteredModel.of(result.artifacts["register"])
            print(f"Registered model: {reg.model_uri} (version {reg.version})")
        print(f"Open the MLflow UI:  {ui_command(result.tracking_uri)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

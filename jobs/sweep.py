"""Run a sweep: many pipelines of one base config with Ray Tune, here (embedded Ray and MLflow) or in a Ray job.

    python -m jobs.sweep configs/sweeps/smoke_lr.yaml [section.field=value ...] [--dry-run] [--verbose]

The sweep file (``pipeline.sweep.spec``) names the base config, the fields to search and how, the metric
and the scheduler. The terminal shows the trials as they start, are stopped and finish, and a summary;
everything else goes to ``<workdir>/logs/run-<UTC time>.log``. Run the same command again after an
interruption: finished and stopped trials stay, unfinished ones resume from their checkpoints.
``--dry-run`` lists the trials and their sampled values and runs nothing.
"""

from __future__ import annotations

import argparse
import signal
import sys

from pipeline.console import Console, RunLog, log_path
from pipeline.runner import EXPECTED_ERRORS, main_exit_code
from pipeline.sweep.spec import load_sweep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.sweep", description=__doc__.splitlines()[0])
    p.add_argument("sweep", help="sweep YAML file (see configs/sweeps/smoke_lr.yaml)")
    p.add_argument("overrides", nargs="*", help="section.field=value for every trial, e.g. train.steps=50")
    p.add_argument("--dry-run", action="store_true", help="list the trials and their values; run nothing")
    p.add_argument("--verbose", action="store_true", help="stream every process's output to the terminal")
    return p.parse_intermixed_args(argv)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also where it started ignored (as jobs.run does)
    quiet = not (args.verbose or args.dry_run)
    overrides = ["train.progress_bar=false", *args.overrides] if quiet else args.overrides
    try:
        spec = load_sweep(args.sweep, overrides)
    except EXPECTED_ERRORS as e:
        return main_exit_code(e)
    if args.dry_run:
        print(f"sweep {spec.name}: {len(spec.trials)} trials of {spec.base}, metric {spec.metric} ({spec.mode}), "
              f"scheduler {spec.scheduler}"
              + (f" (trials compared at steps {', '.join(map(str, spec.rungs))})" if spec.scheduler == "sha" else "")
              + f", {spec.max_concurrent} at a time")
        for t in spec.trials:
            print(f"  {t.name}: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in t.values.items()))
        for why in spec.dropped:
            print(f"  dropped (invalid): {why}")
        return 0
    workdir = spec.trials[0].cfg.workdir()
    if not quiet:
        return _run(spec, print, sys.stderr)
    path = log_path(workdir)
    with RunLog(path) as log:
        console = Console(log.terminal, log)
        console.line(f"Conduit sweep {spec.name}: the full log is in {path}")
        code = _run(spec, console.line, log.errors())
        console.line(f"The full log: {path}")
    return code


def _run(spec, echo, errors) -> int:
    from pipeline.sweep.run import run_sweep

    try:
        result = run_sweep(spec, echo=echo)
    except EXPECTED_ERRORS as e:
        print(f"error: {e}", file=errors)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume the sweep (finished trials are kept)", file=errors)
        return 130
    if result.best is None:  # the summary above named each trial and why none is best
        echo("no best trial: nothing was registered")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run a Conduit pipeline here (embedded Ray and MLflow by default) or inside a Ray job.

    python -m jobs.run configs/smoke.yaml [section.field=value ...] [--dry-run] [--only STAGE | --until STAGE] [--force STAGE]
                                          [--verbose]

The terminal shows the stages, one live status line and a closing summary; everything else (every
Ray worker's output, DeepSpeed's, Ray's and MLflow's logs) goes to ``<workdir>/logs/run-<UTC time>.log``,
named in the first and last lines. ``--verbose`` streams everything to the terminal instead, with no file.

The runner and the console (Ray, MLflow, torch) are imported once the arguments parse, so ``--help`` and a
bad flag answer at once; the stage names come from ``pipeline.base.STAGE_ORDER``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import traceback
from typing import TYPE_CHECKING, TextIO

from pipeline.base import STAGE_ORDER
from pipeline.config import RunConfig, load_config

if TYPE_CHECKING:
    from pipeline.console import Console, RunLog

TRACEBACK_TAIL_LINES = 4  # of an unexpected error's traceback, shown on the terminal (all of it is in the log)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.run", description=__doc__.splitlines()[0])
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. train.steps=50")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan with hashes and what is cached, and the train stage's memory and time plan")
    p.add_argument("--only", choices=STAGE_ORDER, help="run just this stage (its inputs must be cached)")
    p.add_argument("--until", choices=STAGE_ORDER,
                   help="run the stages up to and including this one (e.g. train: evaluate and register later)")
    p.add_argument("--force", action="append", default=[], choices=STAGE_ORDER,
                   help="rerun this stage and everything after it (repeatable)")
    p.add_argument("--verbose", action="store_true",
                   help="stream every process's output to the terminal (workers' progress bars too), no log file")
    return p.parse_intermixed_args(argv)  # overrides may follow the flags


_SIGNALS: list[str] = []  # the signals that ended the run (Ray may re-raise KeyboardInterrupt without its text)


def _interrupt(signum, frame):
    _SIGNALS.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(_SIGNALS[-1])


def run_pipeline(cfg: RunConfig, **kwargs):
    """`pipeline.runner.run_pipeline`, imported when a run starts (tests replace this one with a stand-in)."""
    from pipeline.runner import run_pipeline as run

    return run(cfg, **kwargs)


def fetch_missing_data(cfg: RunConfig) -> int | None:
    """The run's set-up: the shipped corpora's files the config reads and the data root lacks, downloaded
    from their public sources and checked (``pipeline.data.fetch.fetch_for_run``; a progress bar per file on
    a terminal). Returns None to go on, or the exit status after printing the one error that says what
    is missing, from where, and the command that fetches it."""
    from pipeline.data.fetch import fetch_for_run

    # The stage tasks read where this process looked and fetched, whichever checkout their own code lies in.
    cfg.data.data_root = str(cfg.data_root())
    error = fetch_for_run(cfg.data_patterns(), cfg.data_root(), say=print, progress=sys.stderr.isatty())
    if error is None:
        return None
    print(f"error: {error}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipeline.console import Console, RunLog, log_path
    from pipeline.errors import EXPECTED_ERRORS, main_exit_code

    signal.signal(signal.SIGTERM, _interrupt)  # `ray job stop`, `kill`: end as Ctrl-C does (runs KILLED)
    # Ctrl-C, set here too: Python leaves SIGINT ignored when the process started with it ignored (anything
    # started in the background by a non-interactive shell, `cmd &`), and the run would not stop on it
    signal.signal(signal.SIGINT, _interrupt)
    quiet = not (args.verbose or args.dry_run)
    # Quiet, the workers' own progress bars would only fill the log file: the driver shows progress.
    overrides = ["train.progress_bar=false", *args.overrides] if quiet else args.overrides
    try:
        cfg = load_config(args.config, overrides)
    except EXPECTED_ERRORS as e:
        return main_exit_code(e)
    if not args.dry_run and (code := fetch_missing_data(cfg)) is not None:
        return code
    if not quiet:
        return _run(cfg, args, Console(sys.stdout, tty=False), sys.stderr, None)
    path = log_path(cfg.workdir())
    with RunLog(path) as log:
        console = Console(log.terminal, log)
        log.on_warning = lambda line: console.line(line, log=False)  # it is in the log already
        console.line(f"Conduit {cfg.run.name}: the full log is in {path}")
        code = _run(cfg, args, console, log.errors(), log)
        console.line(f"The full log: {path}")
    return code


def _run(cfg: RunConfig, args: argparse.Namespace, console: Console, errors: TextIO, log: RunLog | None) -> int:
    """Run the pipeline; the stage lines and the summary go to ``console``, errors to ``errors``.

    Args:
        log: the run's log file; with it, an unexpected error's traceback goes there and its last
            lines to ``errors``. Without it (--verbose) the error propagates as it is.
    """
    from pipeline.console import StageStatus, summary_lines
    from pipeline.errors import EXPECTED_ERRORS, main_exit_code

    try:
        if args.dry_run:  # the stage table and the train plan, from the config alone (no MLflow, Ray or torch)
            from pipeline.plan.report import summary
            from pipeline.stage_plan import format_plan, make_plan, resolve

            console.line(format_plan(make_plan(resolve(cfg), only=args.only, force=tuple(args.force), until=args.until)))

            console.line("")  # the stage table ends at the first blank line
            for line in summary(cfg).splitlines():
                console.line(line)
            return 0
        with StageStatus(console, cfg, live=log is not None) as status:
            result = run_pipeline(cfg, only=args.only, until=args.until, force=tuple(args.force),
                                      echo=status.echo)
    except EXPECTED_ERRORS as e:
        with contextlib.redirect_stderr(errors):
            return main_exit_code(e)
    except KeyboardInterrupt:
        print(f"interrupted ({_SIGNALS[-1] if _SIGNALS else 'SIGINT'}): the MLflow runs are KILLED; finished "
              "stages stay cached, and a rerun of this command continues training from its latest checkpoint",
              file=errors)
        return 130
    except Exception:
        if log is None:
            raise
        text = traceback.format_exc()
        log.write(text)
        tail = text.rstrip().splitlines()[-TRACEBACK_TAIL_LINES:]
        errors.write("\n".join(["error: unexpected; the traceback ends:", *tail]) + "\n")
        return 1
    for line in summary_lines(result):
        console.line(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a pipeline run shows a person, and where the rest of its output goes.

A run's processes print a great deal: every Ray worker's output is forwarded to the driver, and
DeepSpeed, Ray and MLflow log there too. ``RunLog`` sends all of it (file descriptors 1 and 2 of the
driver, which Ray's log forwarding and every library write to) into one log file in the run's
workdir, and keeps the terminal for a ``Console``: the runner's stage lines, one live status line per
running stage (``StageStatus``, read from the stage's own MLflow run) and the closing summary
(``summary_lines``). Each of those lines is also written to the log file, which so holds the whole run.

Conduit's own warnings (lines that start ``warning: ``, from the driver or, behind Ray's
``(name pid=N)`` prefix, from a worker) are for the person too: ``RunLog`` hands them to the console.
Libraries' warnings (``FutureWarning``, ``UserWarning: ...``) stay in the log.

On a terminal the status line is redrawn in place (``\\r``); elsewhere (a pipe, ``ray job submit``'s
log) it is printed as a plain line every ``PLAIN_STATUS_EVERY_S`` seconds.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from pipeline.base import redact
from pipeline.config import RunConfig

TTY_STATUS_EVERY_S = 2.0  # how often the status line is redrawn on a terminal
STATUS_READ_TIMEOUT_S = 5.0  # each MLflow request of the status line, never retried: a server down shows at once
PLAIN_STATUS_EVERY_S = 20.0  # how often a status line is printed when the output is not a terminal
_CLEAR_LINE = "\r\x1b[K"
# The runner's line for a stage that starts (pipeline.runner._run_one): "<stage>: running (<hash>)".
_RUNNING = re.compile(r"^(\w+): running \(([0-9a-f]+)\)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Conduit's warning line, as printed by the driver or forwarded by Ray from a worker ("(name pid=N) ").
_OWN_WARNING = re.compile(r"^(?:\(\S+ pid=\d+(?:, ip=\S+)?\) )?(warning: .*)$")


def log_path(workdir: Path) -> Path:
    """A new log file's path: ``<workdir>/logs/run-<UTC time>.log``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(workdir) / "logs" / f"run-{stamp}.log"


class RunLog:
    """Everything written to this process's stdout and stderr (and by its child processes, which
    inherit them) goes to ``path``; ``terminal`` and ``terminal_err`` reach the original ones.

    Use as a context manager; on exit the original descriptors are put back.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.on_warning = None  # called with each of Conduit's own warning lines (see the module doc)

    def __enter__(self) -> RunLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = os.dup(1), os.dup(2)
        self.terminal = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace", buffering=1)
        self.terminal_err = os.fdopen(os.dup(2), "w", encoding="utf-8", errors="replace", buffering=1)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._pump = threading.Thread(target=self._copy, args=(read_fd,), name="conduit-run-log", daemon=True)
        self._pump.start()
        return self

    def _copy(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                text = raw.decode("utf-8", errors="replace")
                self.write(text)
                own = _OWN_WARNING.match(_ANSI.sub("", text).rstrip("\n"))
                if own and self.on_warning is not None:
                    self.on_warning(own.group(1))

    def write(self, text: str) -> None:
        """Append ``text`` to the log file (from any thread)."""
        with self._lock:
            self._file.write(text)

    def errors(self) -> TextIO:
        """A stream for messages that must reach the person (errors): the original stderr and the log."""
        return _Both(self.terminal_err, self)

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)  # closes this process's last write ends of the pipe
            os.close(saved)
        # A child process that outlived the run (none should) may still hold the pipe open.
        self._pump.join(timeout=5.0)
        with self._lock:
            self._file.close()


class _Both:
    """Writes to a terminal stream and to the run's log file."""

    def __init__(self, out: TextIO, log: RunLog):
        self.out, self.log = out, log

    def write(self, text: str) -> int:
        self.out.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.out.flush()


class Console:
    """Lines for the person who started the run, on ``out`` and (with ``log``) in the log file,
    with at most one status line that each new line replaces."""

    def __init__(self, out: TextIO, log: RunLog | None = None, tty: bool | None = None):
        self.out = out
        self.log = log
        self.tty = out.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._status_shown = False

    def line(self, text: str, log: bool = True) -> None:
        """Print ``text`` (and, unless ``log`` is False, write it to the log file)."""
        with self._lock:
            if self._status_shown:
                self.out.write(_CLEAR_LINE)
                self._status_shown = False
            self.out.write(text + "\n")
            self.out.flush()
            if log and self.log is not None:
                self.log.write(text + "\n")

    def clear(self) -> None:
        """Take the status line off the terminal (before something else writes there)."""
        with self._lock:
            if self._status_shown:
                self.out.write(_CLEAR_LINE)
                self.out.flush()
                self._status_shown = False

    def status(self, text: str) -> None:
        """Show ``text`` as the status line: redrawn in place on a terminal, else a plain line."""
        if not self.tty:
            self.line(text)
            return
        width = _columns(self.out) - 1
        with self._lock:
            self.out.write(_CLEAR_LINE + text[:width])
            self.out.flush()
            self._status_shown = True


class StageStatus:
    """The live status of the stage that runs now, from its MLflow run's latest metrics.

    ``echo`` (given to ``run_pipeline``) passes the runner's lines to the console and, when a line
    says a stage started, follows that stage until the next line.
    """

    def __init__(self, console: Console, cfg: RunConfig, live: bool = True):
        """``live=False``: pass the lines on and show no status (when workers print their own progress)."""
        self.console = console
        self.cfg = cfg
        self.live = live
        self._stage: tuple[str, str, float] | None = None  # name, hash, start time
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._follow, name="conduit-status", daemon=True)

    def __enter__(self) -> StageStatus:
        if self.live:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._wake.set()
        if self.live:
            self._thread.join(timeout=10.0)
        self.console.clear()

    def echo(self, text: str) -> None:
        m = _RUNNING.match(text)
        self._stage = (m.group(1), m.group(2), time.monotonic()) if m else None
        self.console.line(text)
        self._wake.set()

    def _follow(self) -> None:
        every = TTY_STATUS_EVERY_S if self.console.tty else PLAIN_STATUS_EVERY_S
        first_seen: tuple[float, int] | None = None  # (time, step) when training was first seen going
        unanswered_since: float | None = None  # when MLflow first failed to answer, while it does not
        while not self._stop:
            self._wake.wait(every)
            if self._wake.is_set():  # a new line: the stage changed (or the run ends)
                self._wake.clear()
                first_seen = None
                if not self.console.tty:
                    continue  # plain lines: the first status comes a full interval after the stage starts
            stage = self._stage
            if stage is None or self._stop:
                continue
            name, hash_, started = stage
            waiting = None
            try:
                from pipeline import tracking  # mlflow: where the status line asks it, not at import

                progress = tracking.stage_progress(self.cfg.tracking_uri(), self.cfg.tracking.experiment, hash_,
                                                   timeout_s=STATUS_READ_TIMEOUT_S)
                unanswered_since = None
            except Exception as e:  # noqa: BLE001 - the display must never end the run; the log keeps why
                print(f"status: could not read the {name} run's metrics: {e!r}", file=sys.stderr)
                progress = None
                unanswered_since = unanswered_since or time.monotonic()
                waiting = time.monotonic() - unanswered_since
            if progress is not None and name == "train" and "step" in progress:
                first_seen = first_seen or (time.monotonic(), int(progress["step"]))
            if self._stage is stage and not self._stop:
                self.console.status(describe(name, time.monotonic() - started, progress, self.cfg, first_seen,
                                             mlflow_unanswered_s=waiting))


def describe(stage: str, elapsed_s: float, progress: dict | None, cfg: RunConfig,
             first_seen: tuple[float, int] | None = None, mlflow_unanswered_s: float | None = None) -> str:
    """One status line: the stage, its time so far and what its MLflow run says of its progress; while
    it makes none, why (its ``phase``: starting workers, loading a checkpoint, restarting after a
    failure), or that MLflow, where the progress is read, does not answer.

    Args:
        progress: the stage run's latest metrics and phase (``tracking.stage_progress``), or None.
        first_seen: for train, when and at which step the driver first saw it log (for the ETA).
        mlflow_unanswered_s: how long MLflow has not answered the status's reads, or None when it does.
    """
    parts = [f"{stage}: {_duration(elapsed_s)}"]
    if mlflow_unanswered_s is not None:
        parts.append(f"waiting for MLflow at {redact(cfg.tracking_uri())} (no answer for "
                     f"{_duration(mlflow_unanswered_s)}; the stage goes on and its metrics follow when it is back)")
        return ", ".join(parts)
    p = progress or {}
    if stage == "train" and "step" in p:
        step = int(p["step"])
        parts.append(f"step {step}/{cfg.train.steps}")
        if "loss" in p:
            parts.append(f"loss {p['loss']:.3f}")
        if "tokens_per_s" in p:
            parts.append(f"{p['tokens_per_s']:,.0f} tokens/s")
        if first_seen is not None and step > first_seen[1]:
            rate = (step - first_seen[1]) / max(time.monotonic() - first_seen[0], 1e-6)
            parts.append(f"ETA {_duration((cfg.train.steps - step) / rate)}")
    elif stage == "tokenize" and "documents_tokenized" in p:
        parts.append(f"{int(p['documents_tokenized']):,} documents tokenized")
    elif stage == "evaluate" and "sets_scored" in p:
        parts.append(f"{int(p['sets_scored'])} sets scored")
    if p.get("phase") and p["phase"] != "training":
        parts.append(str(p["phase"]))
    return ", ".join(parts)


def _columns(out: TextIO) -> int:
    """The terminal's width; a pseudo-terminal that was never given a size says 0 (then 100)."""
    try:
        return os.get_terminal_size(out.fileno()).columns or 100
    except OSError:  # not a terminal after all (a test's StringIO stands in for one)
        return 100


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _headline(stage: str, counts: dict) -> str:
    """The one number that matters in a stage's manifest counts."""
    if stage == "shard":
        return f"{counts['documents_read']:,} documents"
    if stage == "tokenizer":
        return f"vocabulary {counts['vocab_size']:,}"
    if stage == "tokenize":
        return f"{sum(s['tokens'] for s in counts['splits'].values()):,} tokens"
    if stage == "train":
        smoothed = counts.get("loss_label_smoothing") or 0  # absent in manifests written before it existed
        return f"final {'smoothed (eps=' + str(smoothed) + ') ' if smoothed else ''}loss {counts['final_loss']:.3f}"
    if stage == "evaluate":
        return (f"validation {counts['val_bits_per_byte']:.3f} bits/byte "
                f"(unigram {counts['unigram_bits_per_byte']:.3f})")
    if stage == "register":
        return f"version {counts['version']}"
    return ""


def summary_lines(result) -> list[str]:
    """The closing table (stage, ran or cached, seconds, its headline number), then the run id, the
    registered model and the command that opens the MLflow UI.

    Args:
        result: the ``pipeline.runner.PipelineResult`` of a run that was not a dry run.
    """
    from pipeline.store.contracts import RegisteredModel

    lines = ["", f"{'stage':<10} {'status':<7} {'seconds':>8}  result"]
    for name, art in result.artifacts.items():
        ran = name in result.transfers  # the runner records a transfer for each stage it ran
        lines.append(f"{name:<10} {'ran' if ran else 'cached':<7} {art.manifest['seconds']:>8.1f}  "
                     f"{_headline(name, art.manifest['counts'])}")
    lines.append("")
    lines.append(f"MLflow run: {result.run_id}  (tracking URI {result.tracking_uri})")
    if "register" in result.artifacts:
        reg = RegisteredModel.of(result.artifacts["register"])
        lines.append(f"Registered model: {reg.model_uri} (version {reg.version})")
    from pipeline import tracking

    lines.append(f"Open the MLflow UI:  {tracking.ui_command(result.tracking_uri)}")
    return lines

"""The ground floor: what every layer may import. It imports nothing of Conduit.

- ``REPO_ROOT`` and ``DEFAULT_DATA_ROOT``: where the checkout is, and where the shipped corpora are read from
  when nothing else is set: ``../shared/data`` beside the checkout where that folder exists (the developers'
  and CI's layout), else ``data/`` inside it (a clone anywhere; ``make data`` and ``make run`` fill it).
- ``ConfigError``: bad input (a config file, field or value; a data source), with a message that names
  which and what is allowed. The config, the data readers and the stages all raise it, so it lives
  below all of them.
- ``is_uri``: whether a location is a ``scheme://`` URI (an object store, a URI-addressed filesystem)
  rather than a local path.
- ``redact``: every URI password and secret query value in a text replaced by ``***``; a
  ``ConfigError``'s message passes through it (``pipeline.credentials`` finds and refuses
  credentials, with the same patterns).
- ``beside_lock``: an exclusive ``flock`` on ``<file>.lock`` beside a file that several processes update (the
  machine caches, a new sqlite MLflow store).
- ``interruptible``: Ray's non-force cancel made to reach a task's process that SIGINT was ignored in.
- ``STAGE_ORDER``: the six stages' names in the order the runner walks them, for the command lines'
  ``--only``/``--until``/``--force`` choices: ``jobs.submit`` and ``jobs.run --help`` offer them without
  importing the stages (Ray, MLflow, torch); `pipeline.stages` refuses a table that differs.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA_ROOT = REPO_ROOT.parent / "shared" / "data"
DEFAULT_DATA_ROOT = SHARED_DATA_ROOT if SHARED_DATA_ROOT.is_dir() else REPO_ROOT / "data"

STAGE_ORDER = ("shard", "tokenizer", "tokenize", "train", "evaluate", "register")


def interruptible() -> None:
    """Let Ray's non-force cancel reach this process's main thread (``runner.cancel_stage_tasks``, a rank's
    cancel). Ray interrupts it as SIGINT would (``_thread.interrupt_main``), which does nothing where SIGINT is
    ignored: in every process of a Ray started in the background (a shell's ``&`` starts its command with
    SIGINT ignored, and Python keeps that). There it gets Python's own handler back, as in a Ray started in
    the foreground."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Query parameters that carry a secret: pyarrow's S3 options, signed URLs, generic names.
SECRET_PARAMS = {"access_key", "secret_key", "session_token", "password", "passwd", "secret", "token",
                 "api_key", "apikey", "sig", "signature", "x-amz-signature", "x-amz-credential",
                 "x-amz-security-token"}
URI_PATTERN = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://(?P<authority>[^/?#\s]*)(?P<path>[^?#\s]*)(?:\?(?P<query>[^#\s]*))?")


@contextlib.contextmanager
def beside_lock(path: Path, make_folder: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` (made if missing) while the block runs; yields whether
    it is held. ``make_folder``: make ``path``'s folder first (an OSError if it cannot be); else, where the
    folder is missing or the lock file cannot be made (a read-only folder), run the block unlocked."""
    import fcntl

    lock_path = path.with_name(path.name + ".lock")
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(lock_path, "a") if make_folder or lock_path.parent.is_dir() else None
    except OSError:
        if make_folder:
            raise
        lock = None
    if lock is None:
        yield False
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield True  # closing the file releases the lock


def is_uri(location: str | Path) -> bool:
    """True for a ``scheme://`` location (an object store or a URI-addressed filesystem)."""
    return "://" in str(location)


def redact(value: str) -> str:
    """``value`` with every URI password and secret query value replaced by ``***``."""
    def one(m: re.Match) -> str:
        authority = m.group("authority")
        userinfo, at, host = authority.rpartition("@")
        if ":" in userinfo:
            authority = f"{userinfo.split(':', 1)[0]}:***{at}{host}"
        query = m.group("query")
        if query is not None:
            query = "&".join(f"{k}=***" if k.lower() in SECRET_PARAMS else part
                             for part in query.split("&") for k in [part.split("=", 1)[0]])
        scheme = m.group(0).split("://", 1)[0]
        return f"{scheme}://{authority}{m.group('path')}" + ("" if query is None else f"?{query}")
    return URI_PATTERN.sub(one, value)


class ConfigError(ValueError):
    """A config file, field or value is wrong; the message names which and what is allowed.

    A message that quotes a value never quotes a URI's password or secret (``redact``).
    """

    def __init__(self, message: str):
        super().__init__(redact(message))


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server does not answer."""


class StageFailed(RuntimeError):
    """A stage raised; the message names the stage and carries the original error."""

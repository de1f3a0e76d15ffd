"""Per-stage locks: two drivers of one config never clear or write the same stage at once.

The runner takes ``<artifact_root>/<stage>/.<hash>.lock`` before it clears a stage's unsealed folder
(and, for train, touches its checkpoints) and holds it until the stage is sealed or has failed. The
lock file names its holder (host, pid, process start time, MLflow run) so the driver that finds it
taken can say who has it.

On a local or shared filesystem the lock is an advisory ``flock`` on that file. The kernel (or the
NFS server, which emulates ``flock`` with POSIX locks) drops it when the holding process dies,
however it dies, so a lock left by a SIGKILLed driver is taken over without guessing; the new holder
finds the dead holder's record still in the file and says it took over from it.

On an object store (``s3://``, ``gs://``) there is no such primitive: the lock is an object holding
the record. It is taken when absent, or when it names a driver on this host that is gone, then read
back to check that this driver's record is the one that landed. Two drivers that start within the
same moment on different hosts can still both pass; that window is what object stores allow
(documented in docs/reliability.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pipeline.base import is_uri

POLL_S = 0.5  # how often a waiting driver looks again


class StageLocked(RuntimeError):
    """Another live driver holds the stage's lock (after waiting ``run.lock_wait_s``)."""


def process_identity(pid: int | None = None) -> dict:
    """This host, the pid and its start time: a pid with another start time is another process."""
    import psutil

    proc = psutil.Process(pid or os.getpid())
    return {"host": socket.gethostname(), "pid": proc.pid, "started": proc.create_time()}


def is_gone(identity: dict) -> bool | None:
    """True when the process ``identity`` names no longer runs; None when that cannot be told from
    here (it ran on another host)."""
    import psutil

    if identity.get("host") != socket.gethostname():
        return None
    try:
        return psutil.Process(identity["pid"]).create_time() != identity.get("started")
    except (psutil.NoSuchProcess, KeyError):
        return True


def holder_record(run_id: str | None = None) -> dict:
    """This driver, as a lock names it."""
    return {**process_identity(), "run_id": run_id}


def describe(holder: dict) -> str:
    started = datetime.fromtimestamp(holder.get("started", 0), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    run = f", MLflow run {holder['run_id']}" if holder.get("run_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')} (started {started}{run})"


@dataclass
class Acquired:
    """A held lock: ``took_over`` is the record of a dead holder whose lock this one replaced."""

    release: Callable[[], None]
    took_over: dict | None = None


def lock_path(artifact_root: str, stage: str, hash_: str) -> str:
    """``<artifact_root>/<stage>/.<hash>.lock``; a URI's pyarrow options (``?endpoint_override=...``) stay last."""
    base, sep, options = str(artifact_root).partition("?")
    return f"{base.rstrip('/')}/{stage}/.{hash_}.lock{sep}{options}"


def acquire(artifact_root: str, stage: str, hash_: str, *, wait_s: float = 0.0, run_id: str | None = None,
            on_wait: Callable[[str], None] | None = None) -> Acquired:
    """Take the lock of stage ``stage``'s artifact ``hash_``.

    Args:
        artifact_root: the resolved ``run.artifact_root`` (a path or a pyarrow.fs URI).
        wait_s: how long to wait for a live holder to let go; 0 fails at once.
        run_id: this driver's MLflow parent run, named in the record.
        on_wait: called once with a line saying whom this driver waits for.

    Returns:
        The held lock; call its ``release`` when the stage is sealed or has failed.

    Raises:
        StageLocked: a live holder kept it past ``wait_s``; the message names the holder and the file.
        OSError: the lock file cannot be created (its folder is not writable); the message names it.
    """
    path = lock_path(artifact_root, stage, hash_)
    me = holder_record(run_id)
    if is_uri(path):
        return _acquire_object(path, me, wait_s, on_wait)
    return _acquire_flock(Path(path), me, wait_s, on_wait)


def _acquire_flock(path: Path, me: dict, wait_s: float, on_wait) -> Acquired:
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            holder = _read_fd(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise StageLocked(_busy_message(path, holder, wait_s)) from None
            if on_wait and not told:
                on_wait(f"waiting for the lock {path}, held by {describe(holder)}")
                told = True
            time.sleep(POLL_S)
            continue
        # The file may have been unlinked by its last holder between our open and our flock: then we
        # hold a lock on a name nobody else sees. Only the inode the path names now counts.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        previous = _read_fd(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode("utf-8"), 0)
        os.fsync(fd)

        def release(fd: int = fd) -> None:
            try:
                os.unlink(path)  # while still locked: whoever opened the old inode retries on the new one
            except FileNotFoundError:
                pass
            os.close(fd)

        # A record left in the file means its holder never released: it died (the kernel freed its flock).
        return Acquired(release=release, took_over=previous or None)


def _read_fd(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {}


def _busy_message(path, holder: dict, wait_s: float) -> str:
    waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
    return (f"another driver is running this stage: {describe(holder)} holds {path}{waited}. Wait for it to "
            "finish (its finished stages are then cached here), or set run.lock_wait_s to wait for it")


def _acquire_object(uri: str, me: dict, wait_s: float, on_wait) -> Acquired:
    from pipeline.data.fs import filesystem_for

    fs, path = filesystem_for(uri)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        holder = _read_object(fs, path)
        taken_over = None
        if holder and holder != me and not is_gone(holder):
            if time.monotonic() >= deadline:
                raise StageLocked(_busy_message(uri, holder, wait_s))
            if on_wait and not told:
                on_wait(f"waiting for the lock {uri}, held by {describe(holder)}")
                told = True
            time.sleep(POLL_S)
            continue
        if holder:
            taken_over = holder
        with fs.open_output_stream(path) as f:
            f.write(json.dumps(me).encode("utf-8"))
        time.sleep(POLL_S)  # let a competing write land, then see whose record stayed
        if _read_object(fs, path) != me:
            continue

        def release() -> None:
            if _read_object(fs, path) == me:
                fs.delete_file(path)

        return Acquired(release=release, took_over=taken_over)


def _read_object(fs, path: str) -> dict:
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return {}
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read().decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}

"""The storage seam: where sealed artifacts live, and how a node writes and reads them.

``run.artifact_root`` is a local path (or a shared-filesystem mount) or any ``pyarrow.fs`` URI
(``s3://``, ``gs://``, ``hdfs://``, ``file://``), with pyarrow's options in the query
(``s3://bucket/conduit?endpoint_override=minio:9000&scheme=http``) and the credentials in each node's
environment (``AWS_ACCESS_KEY_ID``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...), never in the URI.

Stage bodies never see a URI. They write into a node-local folder and read their inputs from
node-local folders; this module is the one that moves bytes:

- ``LocalStore`` (a path): the folder a stage fills *is* ``<root>/<stage>/<hash>``; nothing is copied.
- ``ObjectStore`` (a URI): a stage fills ``<scratch>/build/<stage>/<hash>`` on its node and seals it
  there (``pipeline.store.artifacts.write_manifest``); ``publish`` uploads every file, then the manifest
  last, so a manifest in the store still means a finished artifact. ``fetch`` brings an input into
  ``<scratch>/cache/<stage>/<hash>`` once per node (a file lock makes the other processes of the node
  wait for it rather than fetch again), checking every byte against the manifest's sha256 on the way.

The scratch folder is node-local: ``$CONDUIT_SCRATCH_DIR`` of the node's processes, else
``$XDG_CACHE_HOME/conduit/scratch`` (``~/.cache/conduit/scratch``). It is a cache: deleting it costs
a download, never a result. Its fetched and published copies are kept under ``$CONDUIT_SCRATCH_CACHE_GB``
(default 20; 0: no bound) per node: whenever one is added, the copies used longest ago go first, but
never one that a process of the node holds. ``fetch`` and ``publish`` hold what they return (a shared
lock) until the process calls ``release_held`` (a stage task, when its stage is done) or exits (a
training worker); a copy being fetched is never removed either.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow.fs as pafs

from pipeline.base import is_uri

from pipeline.store.artifacts import MANIFEST, Artifact, artifact_dir, is_complete, remove_unsealed, verify, write_json_atomic

SCRATCH_ENV = "CONDUIT_SCRATCH_DIR"
CACHE_LIMIT_ENV = "CONDUIT_SCRATCH_CACHE_GB"
DEFAULT_CACHE_GB = 20.0
CHUNK_BYTES = 8 << 20  # per read/write call when streaming to or from the store
TRANSFER_THREADS = 8  # files of one artifact moved at once (object stores serve parallel requests well)


class StorageError(RuntimeError):
    """The artifact store cannot be reached, or an artifact in it does not match its manifest."""


def join(root: str, *parts: str) -> str:
    """``root`` with ``parts`` appended to its path; a URI keeps its query (pyarrow's options) at the end.

    ``join("s3://b/x?scheme=http", "train", "ab12")`` is ``"s3://b/x/train/ab12?scheme=http"``.
    """
    base, sep, query = str(root).partition("?")
    return f"{base.rstrip('/')}/{'/'.join(parts)}{sep}{query}"


def scratch_root() -> Path:
    """This node's scratch folder (see the module docstring); read where the process runs, so every
    node may have its own."""
    if os.environ.get(SCRATCH_ENV):
        return Path(os.environ[SCRATCH_ENV]).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "conduit" / "scratch"


def cache_limit_bytes() -> int | None:
    """This node's bound on its scratch cache (``$CONDUIT_SCRATCH_CACHE_GB``, default 20), None for none.

    Raises:
        StorageError: the variable is not a number >= 0.
    """
    raw = os.environ.get(CACHE_LIMIT_ENV, "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_CACHE_GB
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise StorageError(f"${CACHE_LIMIT_ENV}={raw!r} must be a number of GB >= 0 (0: no bound)")
    return None if gb == 0 else int(gb * 1e9)


@dataclass
class Transfer:
    """Bytes and seconds one process moved to or from the store (for MLflow tags and benchmarks)."""

    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    uploaded_bytes: int = 0
    upload_seconds: float = 0.0

    def as_tags(self) -> dict[str, str]:
        return {"conduit.fetched_bytes": str(self.fetched_bytes),
                "conduit.fetch_seconds": f"{self.fetch_seconds:.3f}",
                "conduit.uploaded_bytes": str(self.uploaded_bytes),
                "conduit.upload_seconds": f"{self.upload_seconds:.3f}"}


class LocalStore:
    """Artifacts in a local folder (or a shared-filesystem mount): stages write in place."""

    def __init__(self, root: str | Path):
        self.root = str(root)
        self.transfer = Transfer()

    def location(self, stage: str, hash_: str) -> Path:
        return artifact_dir(self.root, stage, hash_)

    def is_complete(self, stage: str, hash_: str) -> bool:
        return is_complete(self.location(stage, hash_))

    def load(self, stage: str, hash_: str) -> Artifact:
        return Artifact.load(self.location(stage, hash_))

    def check(self, artifact: Artifact) -> str | None:
        """What is wrong with a sealed artifact's files (None: nothing), as ``artifacts.verify``."""
        return verify(artifact)

    def clear(self, stage: str, hash_: str) -> None:
        """Remove what an unsealed (or forced, or damaged) attempt left at the location."""
        path = self.location(stage, hash_)
        if path.exists() or path.is_symlink():
            remove_unsealed(path, self.root)  # never follows a symlink out of the artifact root

    def prepare_build(self, stage: str, hash_: str) -> Path:
        """The folder the stage body fills: the artifact's own (``Stage.execute`` clears leftovers)."""
        return self.location(stage, hash_)

    def publish(self, artifact: Artifact) -> Artifact:
        return artifact  # sealed in place

    def fetch(self, artifact: Artifact) -> Artifact:
        return artifact  # every process reads it in place


@dataclass
class _Remote:
    fs: pafs.FileSystem
    base: str  # the root's path inside ``fs``, no trailing slash


class ObjectStore:
    """Artifacts under a ``pyarrow.fs`` URI; stages write to node-local scratch, this class moves the bytes.

    Args:
        root: the URI (``s3://bucket/prefix?endpoint_override=...``).
        scratch: this node's scratch folder; None: ``scratch_root()``.

    Raises:
        StorageError: pyarrow cannot parse the URI or has no filesystem for its scheme.
    """

    def __init__(self, root: str, scratch: Path | None = None, cache_limit: int | None | str = "env"):
        self.root = root
        self.scratch = scratch or scratch_root()
        self.cache_limit = cache_limit  # bytes, None: unbounded; "env": $CONDUIT_SCRATCH_CACHE_GB where it runs
        self.transfer = Transfer()
        self._remote: _Remote | None = None

    @property
    def remote(self) -> _Remote:
        if self._remote is None:  # opened lazily: a store is pickled into tasks, a filesystem need not be
            try:
                fs, path = pafs.FileSystem.from_uri(self.root)
            except (ValueError, OSError) as e:
                raise StorageError(f"run.artifact_root={self.root!r}: pyarrow.fs cannot open it: {e}") from e
            self._remote = _Remote(fs, path.rstrip("/"))
        return self._remote

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_remote": None}

    def _path(self, stage: str, hash_: str, rel: str = "") -> str:
        return "/".join(p for p in (self.remote.base, stage, hash_, rel) if p)

    def location(self, stage: str, hash_: str) -> str:
        return join(self.root, stage, hash_)

    def is_complete(self, stage: str, hash_: str) -> bool:
        """Whether the stage's manifest is in the store (the runner's first request: it names the root
        when the store does not answer).

        Raises:
            StorageError: the store cannot be reached or refuses the request.
        """
        try:
            info = self.remote.fs.get_file_info(self._path(stage, hash_, MANIFEST))
        except OSError as e:
            raise StorageError(f"run.artifact_root={self.root!r}: the store did not answer: {e}") from e
        return info.type == pafs.FileType.File

    def _read_manifest(self, stage: str, hash_: str) -> dict:
        with self.remote.fs.open_input_stream(self._path(stage, hash_, MANIFEST)) as f:
            return json.loads(f.read().decode("utf-8"))

    def load(self, stage: str, hash_: str) -> Artifact:
        """The sealed artifact's manifest; ``path`` is where this node's cache keeps (or will keep) its files."""
        manifest = self._read_manifest(stage, hash_)
        return Artifact(stage=manifest["stage"], hash=manifest["hash"], path=self._cache_dir(stage, hash_),
                        manifest=manifest, uri=self.location(stage, hash_))

    def check(self, artifact: Artifact) -> str | None:
        """Every file the manifest lists is in the store with its size (one listing, no download);
        the sha256 of each byte is checked when a node fetches it.

        Returns:
            None when all are there; else what is wrong, naming the first bad file.
        """
        listed = artifact.manifest.get("files")
        if listed is None:
            return None
        prefix = self._path(artifact.stage, artifact.hash) + "/"
        infos = self.remote.fs.get_file_info(pafs.FileSelector(prefix.rstrip("/"), recursive=True))
        sizes = {i.path[len(prefix):]: i.size for i in infos if i.type == pafs.FileType.File}
        for rel, want in listed.items():
            where = join(self.root, artifact.stage, artifact.hash, rel)
            if rel not in sizes:
                return f"{where} is missing"
            if sizes[rel] != want["bytes"]:
                return f"{where} has {sizes[rel]} bytes, the manifest says {want['bytes']}"
        return None

    def clear(self, stage: str, hash_: str) -> None:
        """Remove what an unsealed (or forced, or damaged) attempt left in the store."""
        self.remote.fs.delete_dir_contents(self._path(stage, hash_), missing_dir_ok=True)

    def prepare_build(self, stage: str, hash_: str) -> Path:
        """The node-local folder the stage body fills (emptied of what an earlier attempt on this node
        left, sealed or not); ``publish`` uploads it once it is sealed."""
        build = self.scratch / "build" / stage / hash_
        if build.exists():
            shutil.rmtree(build)
        return build

    def _cache_dir(self, stage: str, hash_: str) -> Path:
        return self.scratch / "cache" / stage / hash_

    def publish(self, artifact: Artifact) -> Artifact:
        """Upload a sealed build folder: first whatever an earlier attempt left there is removed, then
        every file the manifest lists, then the manifest, last. The folder then becomes this node's
        cached copy, so a later stage on this node reads it without a download.

        Returns:
            The artifact, at its place in this node's cache, with its ``uri``.
        """
        started = time.monotonic()
        stage, hash_ = artifact.stage, artifact.hash
        fs = self.remote.fs
        fs.delete_dir_contents(self._path(stage, hash_), missing_dir_ok=True)
        files = list(artifact.manifest["files"])
        with ThreadPoolExecutor(max_workers=max(1, min(TRANSFER_THREADS, len(files)))) as pool:
            self.transfer.uploaded_bytes += sum(pool.map(
                lambda rel: _copy_out(artifact.path / rel, fs, self._path(stage, hash_, rel)), files))
        self.transfer.uploaded_bytes += _copy_out(artifact.path / MANIFEST, fs, self._path(stage, hash_, MANIFEST))
        self.transfer.upload_seconds += time.monotonic() - started
        cached = self._cache_dir(stage, hash_)
        with _node_lock(cached):
            if cached.exists():
                shutil.rmtree(cached)
            cached.parent.mkdir(parents=True, exist_ok=True)
            os.replace(artifact.path, cached)
            _hold(cached)
        self.evict()
        return Artifact(stage=stage, hash=hash_, path=cached, manifest=artifact.manifest,
                        uri=self.location(stage, hash_))

    def fetch(self, artifact: Artifact) -> Artifact:
        """The artifact on this node: its cached copy when that was sealed with the same manifest,
        else downloaded once (the node's other processes wait on a lock and reuse it), each file
        checked against the manifest's size and sha256.

        Raises:
            StorageError: a file in the store does not match the manifest (the message names it).
        """
        cached = self._cache_dir(artifact.stage, artifact.hash)
        with _node_lock(cached):
            if _same_manifest(cached, artifact.manifest):
                _hold(cached)
                return Artifact(stage=artifact.stage, hash=artifact.hash, path=cached, manifest=artifact.manifest,
                                uri=self.location(artifact.stage, artifact.hash))
            started = time.monotonic()
            tmp = cached.with_name(f".{cached.name}.fetch-{os.getpid()}")
            for stale in (tmp, cached):
                if stale.exists():
                    shutil.rmtree(stale)
            listed = artifact.manifest["files"]
            try:
                with ThreadPoolExecutor(max_workers=max(1, min(TRANSFER_THREADS, len(listed)))) as pool:
                    self.transfer.fetched_bytes += sum(pool.map(
                        lambda item: self._fetch_file(artifact, item[0], item[1], tmp), listed.items()))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-fetched stays in the cache
                raise
            write_json_atomic(tmp / MANIFEST, artifact.manifest)  # last: a manifest means a whole copy
            os.replace(tmp, cached)
            _hold(cached)
            self.transfer.fetch_seconds += time.monotonic() - started
        self.evict()
        return Artifact(stage=artifact.stage, hash=artifact.hash, path=cached, manifest=artifact.manifest,
                        uri=self.location(artifact.stage, artifact.hash))

    def evict(self) -> list[Path]:
        """Bring this node's cache under ``cache_limit``: the copies used longest ago first, skipping
        those a process holds or is fetching. Returns the folders removed."""
        limit = cache_limit_bytes() if self.cache_limit == "env" else self.cache_limit
        return [] if limit is None else evict_cache(self.scratch / "cache", limit)

    def _fetch_file(self, artifact: Artifact, rel: str, want: dict, tmp: Path) -> int:
        """Download one file of ``artifact`` into ``tmp``, checked against its manifest record; returns its size."""
        where = join(self.root, artifact.stage, artifact.hash, rel)
        try:
            size, digest = _copy_in(self.remote.fs, self._path(artifact.stage, artifact.hash, rel), tmp / rel)
        except OSError as e:  # pyarrow: a missing object, a refused request
            raise StorageError(f"cannot fetch {where}: {e}; rerun with --force {artifact.stage} if it is gone") from e
        if (size, digest) != (want["bytes"], want["sha256"]):
            raise StorageError(
                f"{where} does not match its manifest ({size} bytes, sha256 {digest[:12]}..., the manifest says "
                f"{want['bytes']} bytes, {want['sha256'][:12]}...); rerun with --force {artifact.stage} to rebuild it"
            )
        return size


Store = LocalStore | ObjectStore


def store_for(root: str | Path) -> Store:
    """The store of ``run.artifact_root`` (as ``RunConfig.artifact_root()`` resolves it)."""
    return ObjectStore(str(root)) if is_uri(root) else LocalStore(root)


def _store_of(artifact: Artifact) -> ObjectStore:
    """The object store an artifact with a ``uri`` lives in (``<root>/<stage>/<hash>?q`` -> ``<root>?q``)."""
    base, sep, query = artifact.uri.partition("?")
    return ObjectStore(base.rsplit("/", 2)[0] + sep + query)


def on_this_node(artifact: Artifact) -> Path:
    """The folder of ``artifact`` on this node: its path when it is a local-root artifact, else its copy
    in this node's cache, fetched once per node. For code that runs on other nodes than the stage's
    task (Ray Train workers, tokenize tasks), which gets the ``Artifact`` rather than a path."""
    if artifact.uri is None:
        return artifact.path
    return _store_of(artifact).fetch(artifact).path


def cluster_readable(artifact: Artifact, files: list[Path]) -> tuple[list[str], pafs.FileSystem | None]:
    """Where any node can read ``files`` (under ``artifact.path``, this node's copy), for readers that
    run all over the cluster (the tokenize tasks).

    Returns:
        For a local-root artifact the paths themselves and None (the local filesystem); for one in an
        object store, the files' paths in the store and its ``pyarrow`` filesystem.
    """
    if artifact.uri is None:
        return [str(f) for f in files], None
    store = _store_of(artifact)
    paths = [store._path(artifact.stage, artifact.hash, Path(f).relative_to(artifact.path).as_posix()) for f in files]
    return paths, store.remote.fs


def remote_folder(artifact: Artifact) -> tuple[pafs.FileSystem, str]:
    """The object store's ``pyarrow`` filesystem and the folder of ``artifact`` in it, for readers that
    read parts of its files in place (``pipeline.data.token_blocks``) rather than fetch them.

    Raises:
        ValueError: a local-root artifact (no ``uri``): read ``artifact.path``.
    """
    if artifact.uri is None:
        raise ValueError(f"{artifact.path} is a local artifact: read it in place")
    store = _store_of(artifact)
    return store.remote.fs, store._path(artifact.stage, artifact.hash)


def _same_manifest(folder: Path, manifest: dict) -> bool:
    """True when ``folder`` is a whole copy of the artifact ``manifest`` describes (its files' sizes checked)."""
    if not is_complete(folder):
        return False
    have = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    if have.get("files") != manifest.get("files"):
        return False  # another build of this hash (a --force): fetch the store's
    return all((folder / rel).is_file() and (folder / rel).stat().st_size == want["bytes"]
               for rel, want in manifest["files"].items())


def _use_file(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.use")


_HELD: dict[Path, object] = {}  # this process's shared locks on cached copies, by folder


def _hold(folder: Path) -> None:
    """Hold ``folder`` (a cached copy) for this process: a shared lock on its ``.use`` file, whose time
    is also its last use. Called with the folder's node lock held, so no eviction slips in between."""
    use = _use_file(folder)
    handle = open(use, "a")
    fcntl.flock(handle, fcntl.LOCK_SH)
    os.utime(use)
    old = _HELD.pop(folder, None)
    _HELD[folder] = handle
    if old is not None:
        old.close()  # after the new lock is taken: the folder is never unheld in between


def release_held(folder: Path | None = None) -> None:
    """Let go of the cached copy at ``folder``, or of every one this process holds (a stage task, once
    its stage is done)."""
    for key in [folder] if folder is not None else list(_HELD):
        handle = _HELD.pop(key, None)
        if handle is not None:
            handle.close()


def evict_cache(cache: Path, limit: int) -> list[Path]:
    """Remove whole cached copies under ``cache`` (``<stage>/<hash>`` folders), least recently used first,
    until their bytes are at most ``limit``; a copy that a process holds (``_hold``) or is fetching
    (its node lock) is skipped. Returns the folders removed."""
    entries = []
    for folder in (p for stage in (cache.iterdir() if cache.is_dir() else ()) if stage.is_dir()
                   for p in stage.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            size = sum(int(f["bytes"]) for f in manifest.get("files", {}).values())
        except (OSError, ValueError, KeyError, TypeError):
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        use = _use_file(folder)
        last = use.stat().st_mtime if use.exists() else folder.stat().st_mtime
        entries.append((last, size, folder))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, folder in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if _remove_unheld(folder):
            total -= size
            removed.append(folder)
            print(f"scratch cache: removed {folder} ({size / 1e6:.1f} MB, least recently used) to stay under "
                  f"{limit / 1e9:g} GB (${CACHE_LIMIT_ENV})", flush=True)
    return removed


def _remove_unheld(folder: Path) -> bool:
    """Remove ``folder`` if no process of this node is fetching or holding it (both locks, not waiting)."""
    with open(folder.with_name(f".{folder.name}.lock"), "a") as fetching, open(_use_file(folder), "a") as use:
        for handle in (fetching, use):
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        shutil.rmtree(folder, ignore_errors=True)
        return True


@contextmanager
def _node_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` among the processes of this node (``<folder>.lock`` beside it)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _copy_out(src: Path, fs: pafs.FileSystem, dst: str) -> int:
    with open(src, "rb") as f, fs.open_output_stream(dst) as out:
        n = 0
        while chunk := f.read(CHUNK_BYTES):
            out.write(chunk)
            n += len(chunk)
    return n


def _copy_in(fs: pafs.FileSystem, src: str, dst: Path) -> tuple[int, str]:
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    n = 0
    with fs.open_input_stream(src) as f, open(dst, "wb") as out:
        while chunk := f.read(CHUNK_BYTES):
            out.write(chunk)
            digest.update(chunk)
            n += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return n, digest.hexdigest()


@dataclass(frozen=True)
class NodeFolder:
    """A folder on one node of the Ray cluster that a process on any node can fill.

    A stage's output folder is on its task's node, while the Ray Train worker that writes the
    weights (rank 0) may be on another node: ``put`` moves its files there, through a Ray task pinned
    to that node when the caller is elsewhere. Without Ray (unit tests) the folder is local.
    """

    path: str
    node_id: str | None  # None: made without Ray; the folder is on the caller's machine

    @classmethod
    def here(cls, path: str | Path) -> NodeFolder:
        """``path`` on the node of the calling process."""
        import ray

        return cls(str(path), ray.get_runtime_context().get_node_id() if ray.is_initialized() else None)

    def put(self, src: str | Path) -> None:
        """Move every file under the folder ``src`` (on this node) into this folder, keeping relative paths."""
        import ray

        src = Path(src)
        if self.node_id is None or not ray.is_initialized() or ray.get_runtime_context().get_node_id() == self.node_id:
            _move_tree(src, Path(self.path))
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        files = {f.relative_to(src).as_posix(): f.read_bytes() for f in sorted(src.rglob("*")) if f.is_file()}
        pinned = ray.remote(_write_files).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False))
        ray.get(pinned.remote(self.path, files))


def _move_tree(src: Path, dst: Path) -> None:
    for f in sorted(src.rglob("*")):
        if f.is_file():
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(f, target)


def _write_files(folder: str, files: dict[str, bytes]) -> None:
    """Write ``files`` (relative path -> bytes) into ``folder`` on the node this task is pinned to."""
    for rel, data in files.items():
        target = Path(folder) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, target)

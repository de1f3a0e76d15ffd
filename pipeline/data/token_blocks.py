"""Read a split of the tokenize artifact as one ``(n_blocks, seq_len + 1)`` array, touching only the
blocks asked for.

A split is several token shards (``pipeline.data.packing``); ``TokenBlocks`` addresses their blocks by
global index. Each shard is opened the first time one of its blocks is wanted:

- a local artifact (or this node's fetched copy): the ``.npy`` is memory-mapped, so a worker's reads
  touch the pages of its own blocks only;
- an artifact in an object store (``run.artifact_root`` a URI): each wanted run of consecutive rows is one
  ranged read (``read_at``) of the object, several in parallel, after one read of the file's ``.npy``
  header. Nothing else of the object is downloaded, so a training worker reads about its ``1/W`` share.
  The store's own integrity checks cover these reads; the manifest's sha256 of a whole file cannot be
  checked on a part of it (``pipeline.store.backends.ObjectStore.fetch`` checks it when a node fetches the artifact).

``bytes_read`` counts the bytes of token rows (and, for ranged reads, headers) read so far: the
benchmark and the tests compare it with the split's size.
"""

from __future__ import annotations

import ast
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.store.artifacts import Artifact
from pipeline.store.contracts import TokenIndex, docs_file, tokens_file

RANGE_READ_THREADS = 8  # ranged reads in flight: object stores answer parallel requests well


class _LocalShard:
    def __init__(self, path: Path):
        self.path = path
        self.array = np.load(path, mmap_mode="r")

    def rows(self, idx: np.ndarray) -> np.ndarray:
        return np.asarray(self.array[idx])


class _RemoteShard:
    """A ``.npy`` object read in row ranges; its header is read once."""

    def __init__(self, fs, path: str, pool: ThreadPoolExecutor):
        self.fs, self.path, self.pool = fs, path, pool
        self.file = fs.open_input_file(path)
        head = self.file.read_at(10, 0)
        if head[:6] != b"\x93NUMPY":
            raise ValueError(f"{path}: not a .npy file")
        major = head[6]
        if major == 1:
            (hlen,), start = struct.unpack("<H", head[8:10]), 10
        else:
            (hlen,), start = struct.unpack("<I", self.file.read_at(4, 8)), 12
        header = ast.literal_eval(self.file.read_at(hlen, start).decode("latin1"))
        if header["fortran_order"]:
            raise ValueError(f"{path}: a Fortran-ordered array")
        self.dtype = np.dtype(header["descr"])
        self.shape = tuple(header["shape"])
        self.offset = start + hlen
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:]))
        self.header_bytes = self.offset

    def rows(self, idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx), *self.shape[1:]), dtype=self.dtype)
        if not len(idx):
            return out
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        # runs of consecutive rows: one request each
        breaks = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [len(sorted_idx)]])

        def read(run: tuple[int, int]) -> bytes:
            a, b = run
            first, count = int(sorted_idx[a]), int(sorted_idx[b - 1] - sorted_idx[a] + 1)
            return self.file.read_at(count * self.row_bytes, self.offset + first * self.row_bytes)

        runs = list(zip(starts.tolist(), ends.tolist()))
        for (a, b), data in zip(runs, self.pool.map(read, runs)):
            block = np.frombuffer(data, dtype=self.dtype).reshape(b - a, *self.shape[1:])
            out[order[a:b]] = block[sorted_idx[a:b] - sorted_idx[a]]
        return out


@dataclass(frozen=True)
class _Source:
    """Where a split's shard files are: a local folder, or an object store's filesystem and folder path."""

    folder: Path | str
    fs: object | None = None


class TokenBlocks:
    """One split's blocks (or their document indices) over its token shards.

    Args:
        source: where the shard files are.
        names: each shard's file name (``None`` for a shard without blocks).
        counts: blocks per shard.
        width: ``seq_len + 1``.
    """

    def __init__(self, source: _Source, names: list[str | None], counts: list[int], width: int):
        self.source, self.names, self.counts, self.width = source, names, list(counts), width
        self.ends = np.cumsum(self.counts).tolist()
        self._open: dict[int, _LocalShard | _RemoteShard] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.bytes_read = 0

    # -- constructors --------------------------------------------------------------------------------
    @classmethod
    def from_npy(cls, path: str | Path) -> TokenBlocks:
        """One ``(n, width)`` ``.npy`` file as a single shard (tests and benchmarks)."""
        path = Path(path)
        shape = np.load(path, mmap_mode="r").shape
        if len(shape) != 2:
            raise ValueError(f"{path}: blocks of shape {shape}, expected (n_blocks, seq_len+1)")
        return cls(_Source(path.parent), [path.name], [shape[0]], shape[1])

    @classmethod
    def of(cls, tokens_dir: str | Path, split: str, *, kind: str = "tokens") -> TokenBlocks:
        """A split of the tokenize artifact in the local folder ``tokens_dir``; ``kind``: tokens or docs."""
        index = TokenIndex.read(Path(tokens_dir))
        return cls._from_index(_Source(Path(tokens_dir)), index, split, kind)

    @classmethod
    def of_artifact(cls, artifact: Artifact, split: str, *, kind: str = "tokens") -> TokenBlocks:
        """A split of a tokenize ``Artifact`` read where it lives: in place for a local-root artifact,
        ranged reads for one in an object store (nothing fetched to this node)."""
        if artifact.uri is None:
            return cls.of(artifact.path, split, kind=kind)
        from pipeline.store.backends import remote_folder

        fs, folder = remote_folder(artifact)
        return cls._from_index(_Source(folder, fs), _index_of(artifact), split, kind)

    @classmethod
    def _from_index(cls, source: _Source, index: TokenIndex, split: str, kind: str) -> TokenBlocks:
        if split not in index.splits:
            raise KeyError(f"the tokenize artifact has no {split} split (it has {sorted(index.splits)})")
        name = {"tokens": tokens_file, "docs": docs_file}[kind]
        counts = index.splits[split].shards
        return cls(source, [name(split, k) if n else None for k, n in enumerate(counts)], counts, index.seq_len + 1)

    # -- reading -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.width

    def _shard(self, k: int) -> _LocalShard | _RemoteShard:
        if k not in self._open:
            name = self.names[k]
            if self.source.fs is None:
                shard = _LocalShard(Path(self.source.folder) / name)
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(RANGE_READ_THREADS)
                shard = _RemoteShard(self.source.fs, f"{self.source.folder}/{name}", self._pool)
                self.bytes_read += shard.header_bytes
            self._open[k] = shard
        return self._open[k]

    def take(self, indices) -> np.ndarray:
        """The blocks at global ``indices`` (any order, repeats allowed), as a new ``(len, width)`` array.

        Raises:
            IndexError: an index outside ``[0, len)``.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"block index out of range [0, {n}): {idx[(idx < 0) | (idx >= n)][0]}")
        shard_of = np.searchsorted(np.asarray(self.ends), idx, side="right")
        out = None
        for k in np.unique(shard_of).tolist():
            where = np.flatnonzero(shard_of == k)
            rows = self._shard(k).rows(idx[where] - (self.ends[k - 1] if k else 0))
            if out is None:
                out = np.empty((len(idx), self.width), dtype=rows.dtype)
            out[where] = rows
            self.bytes_read += rows.nbytes
        if out is None:  # nothing asked
            return np.empty((0, self.width), dtype=np.uint32)
        return out

    def head(self, n: int) -> np.ndarray:
        """The first ``min(n, len)`` blocks."""
        return self.take(np.arange(min(n, len(self))))

    def shard_arrays(self) -> Iterator[np.ndarray]:
        """Every shard's blocks in order (memory-mapped when local): for passes over the whole split."""
        for k, name in enumerate(self.names):
            if name is not None:
                shard = self._shard(k)
                yield shard.array if isinstance(shard, _LocalShard) else shard.rows(np.arange(self.counts[k]))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._open.clear()


def _index_of(artifact: Artifact) -> TokenIndex:
    """The ``TokenIndex`` of a tokenize artifact, from its manifest counts (which hold the index)."""
    counts = dict(artifact.manifest["counts"])
    fields = {f: counts[f] for f in ("seq_len", "dtype", "vocab_size", "add_bos")}
    from pipeline.store.contracts import SplitTokens

    return TokenIndex(**fields, splits={s: SplitTokens(**v) for s, v in counts["splits"].items()})


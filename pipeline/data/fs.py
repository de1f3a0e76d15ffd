"""Input files on any ``pyarrow.fs`` filesystem: what one input is and how to open it.

Kept free of the config module (and so of torch), because Ray read tasks import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.fs as pafs

from pipeline.base import is_uri
from pipeline.data import DataError


@dataclass(frozen=True)
class InputFile:
    """One input: ``uri`` is an absolute local path or a URI with a scheme; ``kind`` is its format."""

    uri: str
    kind: str  # txt | jsonl | parquet | datasets
    size: int  # bytes (a datasets folder: all its files)
    mtime_ns: int


def filesystem_for(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and in-filesystem path of ``uri`` (a local path needs no scheme).

    Raises:
        DataError: a URI that pyarrow cannot parse or has no filesystem for.
    """
    if not is_uri(uri):
        return pafs.LocalFileSystem(), uri
    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:
        raise DataError(f"data.train_paths: cannot open {uri!r} with pyarrow.fs: {e}") from e

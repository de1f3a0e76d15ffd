"""Resolve ``data.train_paths`` to input files through ``pyarrow.fs``.

A pattern is a path relative to the data root, an absolute path, or a filesystem URI
(``file:///x``, ``s3://bucket/x``, ...). It may name a file, a folder (all supported files under it,
recursively) or a glob (``*`` and ``?`` within one path segment, ``[...]`` classes, ``**`` for any
number of folders). A folder written by ``datasets.save_to_disk`` is one input of kind ``datasets``,
also when it lies inside a folder that is expanded. Results are sorted within each pattern and
de-duplicated across patterns, so the order of inputs (and with it the first occurrence of a duplicate
document) is the same on every machine.

A URI other than ``file://`` may end in pyarrow's filesystem options as a query string, e.g.
``s3://bucket/corpus/*.txt?endpoint_override=127.0.0.1:9000&scheme=http`` for an S3-compatible
server; the glob applies to the path before it, and every input keeps the query, so a Ray read task
on any node opens the same filesystem. Credentials never go into a URI: pyarrow reads them from the
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``; ``AWS_ENDPOINT_URL`` also sets the
endpoint) or the usual credential files.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.base import ConfigError, is_uri
from pipeline.data.corpora import data_root_hint
from pipeline.data.fs import InputFile, filesystem_for

# .csv and .json are always read through ``datasets.load_dataset``; the others by Conduit's readers
# unless data.reader=datasets (pipeline.data.readers).
SUFFIX_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".csv": "csv", ".json": "json"}
DATASETS_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes at a folder's top
GLOB_CHARS = set("*?[")
QUERY = re.compile(r"\?\w+=[^?&]*(?:&\w+=[^?&]*)*$")  # ?key=value&key=value at the end of a URI


def split_query(uri: str) -> tuple[str, str]:
    """``s3://b/x/*.txt?scheme=http`` -> (``s3://b/x/*.txt``, ``?scheme=http``); local paths and
    ``file://`` URIs have no query (there a ``?`` is a glob character)."""
    if not is_uri(uri) or uri.startswith("file://"):
        return uri, ""
    m = QUERY.search(uri)
    return (uri[: m.start()], m.group(0)) if m else (uri, "")


def _join(prefix: str, path: str, query: str = "") -> str:
    """Rebuild a URI from the scheme part of ``prefix``, a filesystem path and the query."""
    if not is_uri(prefix):
        return path
    return f"{prefix.split('://', 1)[0]}://{path}{query}"


def _match_segments(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_match_segments(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _match_segments(pattern[1:], path[1:])


def _is_datasets_dir(fs: pafs.FileSystem, path: str) -> bool:
    infos = fs.get_file_info([f"{path}/{m}" for m in DATASETS_MARKERS])
    return any(i.type == pafs.FileType.File for i in infos)


def _folder_stats(files: list[pafs.FileInfo]) -> tuple[int, int]:
    return sum(i.size for i in files), max((i.mtime_ns or 0 for i in files), default=0)


def _expand(fs: pafs.FileSystem, info: pafs.FileInfo, prefix: str, query: str, pattern: str) -> list[InputFile]:
    """A matched file or folder -> input files."""
    if info.type == pafs.FileType.File:
        kind = SUFFIX_KINDS.get(Path(info.path).suffix)
        if kind is None:
            raise ConfigError(
                f"data.train_paths: {info.path} (from {pattern!r}) has suffix {Path(info.path).suffix!r}; "
                f"supported: {sorted(SUFFIX_KINDS)} or a folder saved by datasets.save_to_disk"
            )
        return [InputFile(_join(prefix, info.path, query), kind, info.size, info.mtime_ns or 0)]
    listing = sorted(fs.get_file_info(pafs.FileSelector(info.path, recursive=True)), key=lambda i: i.path)
    files = [i for i in listing if i.type == pafs.FileType.File]
    if _is_datasets_dir(fs, info.path):
        return [InputFile(_join(prefix, info.path, query), "datasets", *_folder_stats(files))]
    # Saved datasets inside the folder are one input each (the top-most folder: a DatasetDict's splits
    # have markers too); their own .json/.arrow files are not inputs.
    marked = {posixpath.dirname(i.path) for i in files if posixpath.basename(i.path) in DATASETS_MARKERS}
    saved = {m for m in marked if not any(m.startswith(o + "/") for o in marked)}
    found = []
    for sub in listing:
        owner = next((s for s in saved if sub.path.startswith(s + "/")), None)
        if sub.path in saved:
            inside = [i for i in files if i.path.startswith(sub.path + "/")]
            found.append(InputFile(_join(prefix, sub.path, query), "datasets", *_folder_stats(inside)))
        elif owner is None and sub.type == pafs.FileType.File and Path(sub.path).suffix in SUFFIX_KINDS:
            found.append(InputFile(_join(prefix, sub.path, query), SUFFIX_KINDS[Path(sub.path).suffix],
                                   sub.size, sub.mtime_ns or 0))
    return found


def resolve_pattern(pattern: str, data_root: Path) -> list[InputFile]:
    """Expand one ``data.train_paths`` entry.

    Args:
        pattern: a path, glob or URI (see the module docstring).
        data_root: what relative paths are relative to.

    Returns:
        The inputs it names, sorted by path.

    Raises:
        ConfigError: nothing matches (for a relative pattern the message also says where the data root
            is, how to set it and how to fetch the shipped corpora), or a matched file has an
            unsupported suffix.
    """
    full = pattern if (is_uri(pattern) or Path(pattern).is_absolute()) else str(data_root / pattern)
    full, query = split_query(full)
    scheme_prefix, _, rest = full.rpartition("://")
    body = rest if scheme_prefix else full
    segments = body.split("/")
    first_glob = next((i for i, s in enumerate(segments) if GLOB_CHARS & set(s)), None)
    if first_glob is None:
        fs, path = filesystem_for(full + query)
        info = fs.get_file_info(path)
        matched = [info] if info.type != pafs.FileType.NotFound else []
    else:
        base = "/".join(segments[:first_glob]) or "/"
        fs, base_path = filesystem_for(f"{scheme_prefix}://{base}{query}" if scheme_prefix else base)
        tail = segments[first_glob:]
        recursive = len(tail) > 1 or "**" in tail
        selector = pafs.FileSelector(base_path, recursive=recursive, allow_not_found=True)
        base_parts = base_path.rstrip("/").split("/")
        matched = sorted(
            (i for i in fs.get_file_info(selector)
             if _match_segments(tail, i.path.rstrip("/").split("/")[len(base_parts):])),
            key=lambda i: i.path,
        )
    out: list[InputFile] = []
    for info in matched:
        out += _expand(fs, info, full, query, pattern)
    if not out:
        raise ConfigError(
            f"data.train_paths: {pattern!r} matches no {'/'.join(SUFFIX_KINDS)} file or saved dataset "
            f"(looked at {full}){data_root_hint(pattern, data_root)}"
        )
    return out


def resolve_inputs(patterns: list[str], data_root: Path) -> list[InputFile]:
    """All inputs of ``patterns`` in order, each once (the first pattern that names it wins)."""
    files: dict[str, InputFile] = {}
    for pattern in patterns:
        for f in resolve_pattern(pattern, data_root):
            files.setdefault(f.uri, f)
    return list(files.values())

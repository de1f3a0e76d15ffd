"""Resolve ``data.train_paths`` to input files through ``pyarrow.fs``.

A pattern is a path relative to the data root, an absolute path, or a filesystem URI
(``file:///x``, ``s3://bucket/x``, ...). It may name a file, a folder (all supported files under it,
recursively) or a glob (``*`` and ``?`` within one path segment, ``[...]`` classes, ``**`` for any
number of folders). A folder written by ``datasets.save_to_disk`` is one input of kind ``datasets``.
Results are sorted within each pattern and de-duplicated across patterns, so the order of inputs
(and with it the first occurrence of a duplicate document) is the same on every machine.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.config import ConfigError
from pipeline.data.fs import InputFile, filesystem_for

SUFFIX_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
DATASETS_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes at a folder's top
GLOB_CHARS = set("*?[")


def _join(prefix: str, path: str) -> str:
    """Rebuild a URI from the scheme part of ``prefix`` and a filesystem path."""
    if "://" not in prefix:
        return path
    scheme = prefix.split("://", 1)[0]
    return f"{scheme}://{path}" if scheme != "file" else f"file://{path}"


def _match_segments(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_match_segments(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _match_segments(pattern[1:], path[1:])


def _is_datasets_dir(fs: pafs.FileSystem, path: str) -> bool:
    infos = fs.get_file_info([f"{path}/{m}" for m in DATASETS_MARKERS])
    return any(i.type == pafs.FileType.File for i in infos)


def _folder_stats(fs: pafs.FileSystem, path: str) -> tuple[int, int]:
    files = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if i.type == pafs.FileType.File]
    return sum(i.size for i in files), max((i.mtime_ns or 0 for i in files), default=0)


def _expand(fs: pafs.FileSystem, info: pafs.FileInfo, prefix: str, pattern: str) -> list[InputFile]:
    """A matched file or folder -> input files."""
    if info.type == pafs.FileType.File:
        kind = SUFFIX_KINDS.get(Path(info.path).suffix)
        if kind is None:
            raise ConfigError(
                f"data.train_paths: {info.path} (from {pattern!r}) has suffix {Path(info.path).suffix!r}; "
                f"supported: {sorted(SUFFIX_KINDS)} or a folder saved by datasets.save_to_disk"
            )
        return [InputFile(_join(prefix, info.path), kind, info.size, info.mtime_ns or 0)]
    if _is_datasets_dir(fs, info.path):
        size, mtime = _folder_stats(fs, info.path)
        return [InputFile(_join(prefix, info.path), "datasets", size, mtime)]
    found = []
    for sub in sorted(fs.get_file_info(pafs.FileSelector(info.path, recursive=True)), key=lambda i: i.path):
        if sub.type == pafs.FileType.File and Path(sub.path).suffix in SUFFIX_KINDS:
            found.append(InputFile(_join(prefix, sub.path), SUFFIX_KINDS[Path(sub.path).suffix],
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
        ConfigError: nothing matches, or a matched file has an unsupported suffix.
    """
    full = pattern if ("://" in pattern or Path(pattern).is_absolute()) else str(data_root / pattern)
    scheme_prefix, _, rest = full.rpartition("://")
    body = rest if scheme_prefix else full
    segments = body.split("/")
    first_glob = next((i for i, s in enumerate(segments) if GLOB_CHARS & set(s)), None)
    if first_glob is None:
        fs, path = filesystem_for(full)
        info = fs.get_file_info(path)
        matched = [info] if info.type != pafs.FileType.NotFound else []
    else:
        base = "/".join(segments[:first_glob]) or "/"
        fs, base_path = filesystem_for(f"{scheme_prefix}://{base}" if scheme_prefix else base)
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
        out += _expand(fs, info, full, pattern)
    if not out:
        raise ConfigError(
            f"data.train_paths: {pattern!r} matches no .txt/.jsonl/.parquet file or saved dataset "
            f"(looked at {full})"
        )
    return out


def resolve_inputs(patterns: list[str], data_root: Path) -> list[InputFile]:
    """All inputs of ``patterns`` in order, each once (the first pattern that names it wins)."""
    files: dict[str, InputFile] = {}
    for pattern in patterns:
        for f in resolve_pattern(pattern, data_root):
            files.setdefault(f.uri, f)
    return list(files.values())

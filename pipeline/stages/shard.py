"""shard: raw text files -> parquet shards of documents, split train/validation by content hash.

Reads .txt (whole file, or split on ``data.separator``), .jsonl (``data.text_field``) and .parquet
(column ``data.text_field``). A document goes to validation when the first 8 bytes of its sha256,
read as a fraction of 2^64, fall below ``data.validation_fraction``: the split depends on the text
alone, never on file order, shard count or machine. Exact duplicates are kept once. Every document
read is counted, and every one left out is counted under the rule that removed it.

Output: ``train-NNNNN.parquet`` (``data.num_shards`` files) and ``validation-00000.parquet``, columns
``text`` (string), ``doc_id`` (sha256 hex of the text) and ``source`` (input file).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError, RunConfig, hash_view

NAME = "shard"
VERSION = 1
INPUTS: tuple[str, ...] = ()
SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = ("train", "validation")


class DataError(ValueError):
    """Input data that cannot be read as configured; names the file and the place."""


def resolve_inputs(cfg: RunConfig) -> list[Path]:
    """Expand ``data.train_paths`` (files, folders, globs; relative to the data root) to files.

    Raises:
        ConfigError: a pattern that matches no readable input file.
    """
    root = cfg.data_root()
    files: list[Path] = []
    for pattern in cfg.data.train_paths:
        full = pattern if os.path.isabs(pattern) else str(root / pattern)
        matches = sorted(glob.glob(full, recursive=True))
        found: list[Path] = []
        for m in matches:
            p = Path(m)
            if p.is_dir():
                found += sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in SUFFIXES)
            elif p.is_file():
                found.append(p)
        if not found:
            raise ConfigError(f"data.train_paths: {pattern!r} matches no .txt/.jsonl/.parquet file under {root}")
        for p in found:
            if p.suffix not in SUFFIXES:
                raise ConfigError(f"data.train_paths: {p} has suffix {p.suffix!r}; supported: {list(SUFFIXES)}")
        files += found
    return list(dict.fromkeys(files))  # keep order, drop repeats


def input_fingerprint(files: list[Path]) -> list[list]:
    """Cheap identity of the inputs for the stage hash: path, size and mtime (content is hashed in run)."""
    return [[str(p), p.stat().st_size, int(p.stat().st_mtime)] for p in files]


def hash_config(cfg: RunConfig) -> dict:
    return {"data": hash_view(cfg.data), "files": input_fingerprint(resolve_inputs(cfg))}


def _decode(raw: bytes, path: Path, policy: str) -> tuple[str, int]:
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if policy == "error":
            raise DataError(
                f"{path}: invalid UTF-8 at byte offset {e.start} (set data.encoding_errors=replace to "
                "replace bad bytes with U+FFFD and count them)"
            ) from e
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.count("\ufffd".encode("utf-8"))


def read_documents(path: Path, cfg: RunConfig) -> tuple[list[str], dict]:
    """Read one input file into documents, with its counts.

    Raises:
        DataError: invalid UTF-8 (policy error), NUL bytes, malformed JSON or a missing field,
            naming the file and the byte offset or line number.
    """
    raw = path.read_bytes()
    stats = {"path": str(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(), "replaced_chars": 0}
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        if cfg.data.text_field not in table.column_names:
            raise DataError(f"{path}: no column {cfg.data.text_field!r} (columns: {table.column_names})")
        docs = [d for d in table.column(cfg.data.text_field).to_pylist() if d is not None]
        stats["documents"] = len(docs)
        return docs, stats
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{path}: contains NUL bytes (first at byte offset {nul}); is it a binary file?")
    text, stats["replaced_chars"] = _decode(raw, path, cfg.data.encoding_errors)
    if path.suffix == ".jsonl":
        docs = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON: {e.msg}") from e
            if not isinstance(obj, dict) or cfg.data.text_field not in obj:
                raise DataError(f"{path}:{lineno}: no field {cfg.data.text_field!r} in this JSON line")
            if not isinstance(obj[cfg.data.text_field], str):
                raise DataError(f"{path}:{lineno}: field {cfg.data.text_field!r} is not a string")
            docs.append(obj[cfg.data.text_field])
    elif cfg.data.separator is None:
        docs = [text]
    else:
        docs = text.split(cfg.data.separator)
    stats["documents"] = len(docs)
    return docs, stats


def split_of(doc_id: str, validation_fraction: float) -> str:
    return "validation" if int(doc_id[:16], 16) / 2**64 < validation_fraction else "train"


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    files = resolve_inputs(cfg)
    seen: set[str] = set()
    rows: dict[str, list[tuple[str, str, str]]] = {s: [] for s in SPLITS}
    removed = {"empty_or_short": 0, "duplicate": 0, "over_max_documents": 0}
    per_input = []
    for path in files:
        docs, stats = read_documents(path, cfg)
        per_input.append(stats)
        for doc in docs:
            if len(doc.strip()) < max(cfg.data.min_doc_chars, 1):
                removed["empty_or_short"] += 1
                continue
            doc_id = hashlib.sha256(doc.encode("utf-8")).hexdigest()
            if doc_id in seen:
                removed["duplicate"] += 1
                continue
            seen.add(doc_id)
            rows[split_of(doc_id, cfg.data.validation_fraction)].append((doc, doc_id, str(path)))
    if cfg.data.max_documents is not None:
        for split in SPLITS:  # a cap keeps the validation share: each split keeps its fraction
            keep = max(1, round(cfg.data.max_documents * len(rows[split]) / max(1, len(seen))))
            removed["over_max_documents"] += max(0, len(rows[split]) - keep)
            rows[split] = rows[split][:keep]
    for split in SPLITS:
        if not rows[split]:
            raise DataError(
                f"no {split} documents are left after filtering {len(files)} input file(s) "
                f"(removed: {removed}); add data or change data.validation_fraction"
            )

    counts = {"inputs": per_input, "removed": removed, "documents": {}, "bytes": {}, "shards": {}}
    for split in SPLITS:
        n_shards = cfg.data.num_shards if split == "train" else 1
        docs = rows[split]
        counts["documents"][split] = len(docs)
        counts["bytes"][split] = sum(len(d[0].encode("utf-8")) for d in docs)
        counts["shards"][split] = []
        for k in range(n_shards):
            part = docs[k::n_shards]  # round-robin keeps shards within one document of each other
            name = f"{split}-{k:05d}.parquet"
            table = pa.table({
                "text": [d[0] for d in part], "doc_id": [d[1] for d in part], "source": [d[2] for d in part],
            })
            pq.write_table(table, out_dir / name)
            counts["shards"][split].append({"file": name, "documents": len(part)})
    total = sum(s["documents"] for s in per_input)
    kept = sum(counts["documents"].values())
    assert total == kept + sum(removed.values()), "every document is kept or counted as removed"
    tracker.log_metrics({
        "documents_read": total, "documents_train": counts["documents"]["train"],
        "documents_validation": counts["documents"]["validation"], "bytes_train": counts["bytes"]["train"],
        **{f"removed_{k}": v for k, v in removed.items()},
    })
    return counts


def shard_files(artifact_path: Path, split: str) -> list[Path]:
    return sorted(Path(artifact_path).glob(f"{split}-*.parquet"))


def read_texts(artifact_path: Path, split: str) -> list[str]:
    return [t for f in shard_files(artifact_path, split) for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]

"""shard: raw text inputs -> parquet shards of documents, split train/validation/test by content hash.

Inputs are resolved by ``pipeline.data.sources`` (paths, globs, pyarrow filesystem URIs, folders
saved by ``datasets``) and read by ``pipeline.data.readers``: .txt (whole file, or split on
``data.separator``), .jsonl and .json (field ``data.text_field``), .csv, .parquet and datasets (column
``data.text_field``); .csv and .json through ``datasets.load_dataset``, and all data files with
``data.reader=datasets``. Each input is read, normalised (``data.normalize``,
``data.strip_control_chars``) and length-filtered in its own Ray task when Ray is running (the
pipeline), or in this process (unit tests). Then, in input order: exact duplicates (same sha256
after cleaning) are kept once; a document goes to validation when the first 8 bytes of its sha256,
read as a fraction u of 2^64, fall below ``data.validation_fraction``, to test when u is below
``validation_fraction + test_fraction``, else to train. The split depends on the text alone, never
on file order, shard count or machine; adding a test split leaves validation unchanged.

Sharding: the train split is cut into ``data.num_shards`` contiguous shards of about equal bytes
(validation and test: one shard each), or, when ``data.target_shard_bytes`` is set, every split into
``ceil(bytes / target)`` shards. A split never gets more shards than documents; shards keep input
order. Every document read is counted, and every one left out is counted under the rule that
removed it (``counts.removed``); an input file's bytes and sha256 are in ``counts.inputs``. Under
``data.on_bad_document=skip``, malformed .jsonl lines and undecodable files are left out and counted
by reason in ``counts.skipped`` (and each input's ``skipped``); they are not documents, so they are
not in ``documents_read``. Native .txt and .jsonl inputs are read in bounded memory
(``pipeline.data.stream``); version 3 added ``skipped``.

Output: ``train-NNNNN.parquet``, ``validation-00000.parquet`` (``test-00000.parquet`` when
``data.test_fraction > 0``), columns ``text`` (string), ``doc_id`` (sha256 hex of the text) and
``source`` (input URI).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from pipeline.config import RunConfig, hash_view
from pipeline.data import DataError, ray_running
from pipeline.data.clean import DOCUMENT_SCHEMA, REMOVAL_RULES, CleanOptions
from pipeline.data.fs import InputFile
from pipeline.data.readers import read_and_clean
from pipeline.data.stream import SKIP_REASONS
from pipeline.data.sources import resolve_inputs as _resolve
from pipeline.stage_io import SPLITS, SplitSizes, shard_file_name, shard_files
from pipeline.stages.stage import Resources, Stage


def resolve_inputs(cfg: RunConfig) -> list[InputFile]:
    """The input files of ``data.train_paths`` (relative to the data root), in a stable order.

    Raises:
        ConfigError: a pattern that matches nothing readable, or an unsupported file.
    """
    return _resolve(cfg.data.train_paths, cfg.data_root())


def input_fingerprint(files: list[InputFile]) -> list[list]:
    """Cheap identity of the inputs for the stage hash: URI, size and mtime (content is hashed in run)."""
    return [[f.uri, f.kind, f.size, f.mtime_ns] for f in files]


def hash_config(cfg: RunConfig) -> dict:
    return {"data": hash_view(cfg.data), "files": input_fingerprint(resolve_inputs(cfg))}


def split_of(doc_id: str, validation_fraction: float, test_fraction: float = 0.0) -> str:
    """The split of a document, from its id alone."""
    u = int(doc_id[:16], 16) / 2**64
    if u < validation_fraction:
        return "validation"
    return "test" if u < validation_fraction + test_fraction else "train"


def _read_all(files: list[InputFile], cfg: RunConfig) -> Iterator[tuple[pa.Table, dict]]:
    """Read and clean every input, in input order: in parallel Ray tasks when Ray is running."""
    d = cfg.data
    opts = CleanOptions(d.normalize, d.strip_control_chars, d.min_doc_chars, d.max_doc_chars)
    args = (d.text_field, d.separator, d.encoding_errors, opts, d.reader, d.on_bad_document)
    if not ray_running():
        for src in tqdm(files, desc="shard: read", unit="file", disable=None):
            yield read_and_clean(src, *args)
        return
    import ray

    task = ray.remote(num_cpus=1)(read_and_clean)
    refs = [task.options(name=f"conduit.shard.read[{i}]").remote(src, *args) for i, src in enumerate(files)]
    for ref in tqdm(refs, desc="shard: read", unit="file", disable=None):
        try:
            yield ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            raise e.cause  # the DataError itself, naming the file, not Ray's wrapper


def shard_bounds(sizes: np.ndarray, n_shards: int) -> list[tuple[int, int]]:
    """Cut rows with byte ``sizes`` into ``min(n_shards, len(sizes))`` contiguous, non-empty ranges of
    about equal bytes (a range boundary falls at the first row starting at or after k/n of the bytes).
    """
    n = min(n_shards, len(sizes))
    starts = np.cumsum(sizes) - sizes
    total = float(sizes.sum())
    bounds = [0]
    for k in range(1, n):
        b = int(np.searchsorted(starts, k * total / n, side="left"))
        bounds.append(min(max(b, bounds[-1] + 1), len(sizes) - (n - k)))
    bounds.append(len(sizes))
    return list(zip(bounds[:-1], bounds[1:]))


def _dedup_and_split(parts, cfg: RunConfig, removed: dict, per_input: list) -> dict[str, list[pa.Table]]:
    seen: set[str] = set()
    by_split: dict[str, list[pa.Table]] = {s: [] for s in SPLITS}
    for table, stats in parts:
        per_input.append(stats)
        for rule, n in stats["removed"].items():
            removed[rule] += n
        picks: dict[str, list[int]] = {s: [] for s in SPLITS}
        for i, did in enumerate(table.column("doc_id").to_pylist()):
            if did in seen:
                removed["duplicate"] += 1
                continue
            seen.add(did)
            picks[split_of(did, cfg.data.validation_fraction, cfg.data.test_fraction)].append(i)
        for s in SPLITS:
            if picks[s]:
                by_split[s].append(table.take(picks[s]))
    return by_split


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    d = cfg.data
    files = resolve_inputs(cfg)
    removed = {**dict.fromkeys(REMOVAL_RULES, 0), "duplicate": 0, "over_max_documents": 0}
    per_input: list[dict] = []
    by_split = _dedup_and_split(_read_all(files, cfg), cfg, removed, per_input)
    tables = {s: pa.concat_tables(by_split[s]) if by_split[s] else DOCUMENT_SCHEMA.empty_table() for s in SPLITS}
    splits = [s for s in SPLITS if s != "test" or d.test_fraction > 0]
    unique = sum(len(t) for t in tables.values())
    if d.max_documents is not None:
        for s in splits:  # a cap keeps the split shares: each split keeps its fraction
            keep = max(1, round(d.max_documents * len(tables[s]) / max(1, unique)))
            removed["over_max_documents"] += max(0, len(tables[s]) - keep)
            tables[s] = tables[s].slice(0, keep)
    for s in splits:
        if len(tables[s]) == 0:
            raise DataError(
                f"no {s} documents are left after reading and filtering {len(files)} input(s) "
                f"(removed: {removed}); add data or change data.validation_fraction / data.test_fraction"
            )

    sizes_by_split = SplitSizes(documents={}, bytes={})  # filled below, then added to the counts
    counts = {
        "inputs": per_input, "removed": removed, "shards": {},
        "empty_inputs": sum(s["empty_file"] for s in per_input),
        "replaced_chars": sum(s["replaced_chars"] for s in per_input),
        "normalized_changed": sum(s["normalized_changed"] for s in per_input),
        "control_chars_removed": sum(s["control_chars_removed"] for s in per_input),
        "skipped": {r: sum(s["skipped"][r] for s in per_input) for r in SKIP_REASONS},
    }
    for s in splits:
        table = tables[s]
        sizes = pc.binary_length(table.column("text")).to_numpy()
        split_bytes = int(sizes.sum())
        if d.target_shard_bytes is not None:
            n_shards = math.ceil(split_bytes / d.target_shard_bytes)
        else:
            n_shards = d.num_shards if s == "train" else 1
        sizes_by_split.documents[s], sizes_by_split.bytes[s], counts["shards"][s] = len(table), split_bytes, []
        for k, (a, b) in enumerate(shard_bounds(sizes, n_shards)):
            name = shard_file_name(s, k)
            pq.write_table(table.slice(a, b - a), out_dir / name)
            counts["shards"][s].append({"file": name, "documents": b - a, "bytes": int(sizes[a:b].sum())})
    counts.update(sizes_by_split.counts())
    read = sum(s["documents"] for s in per_input)
    kept = sum(sizes_by_split.documents.values())
    if read != kept + sum(removed.values()):
        raise AssertionError(f"shard: {read} documents read but {kept} kept + {removed} removed")  # a bug here
    counts["documents_read"] = read
    tracker.log_metrics({
        "documents_read": read, "bytes_read": sum(s["bytes"] for s in per_input),
        **{f"documents_{s}": n for s, n in sizes_by_split.documents.items()},
        **{f"bytes_{s}": n for s, n in sizes_by_split.bytes.items()},
        **{f"removed_{k}": v for k, v in removed.items()},
        **{f"skipped_{k}": v for k, v in counts["skipped"].items()},
    })
    return counts


def read_texts(artifact_path: Path, split: str) -> list[str]:
    """Every document of ``split`` in shard order."""
    return [t for f in shard_files(artifact_path, split) for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]


# Holds no CPU itself: each input is read in a Ray task of its own (1 CPU each).
def disk_need(cfg: RunConfig, inputs: dict, hash_: str) -> list[tuple[str | None, int, str]]:
    """The shards hold the corpus's text as compressed parquet: at most about its size, twice for slack."""
    corpus = sum(f.size for f in resolve_inputs(cfg))
    return [(None, 2 * corpus, f"parquet shards of {corpus / 2**20:.1f} MiB of input")]


STAGE = Stage(name="shard", version=3, inputs=(), hash_config=hash_config, run=run, resources=Resources(cpus=0),
              disk_need=disk_need)

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

Memory: with Ray, each input's read task keeps its documents in Ray's object store and hands the
stage's own process only their ids and byte sizes, from which it decides duplicates, splits and shard
bounds; each shard is then encoded to parquet by a task of its own from the inputs that hold its rows,
and the stage process writes one shard's bytes at a time (a few shards in flight). No process holds
the corpus, only the largest input (its read task) or the largest shard (its writer).

Quality and near-duplicates (both off unless enabled): ``data.quality``'s filters run in each read task
after cleaning (``pipeline.data.quality``), each removed document counted under its filter in
``counts.removed`` and the rule inside it in ``counts.quality``. ``data.near_dedup`` removes documents
whose MinHash signatures mark them as near-copies of an earlier one anywhere in the corpus
(``pipeline.data.near_dedup``): the signatures and band keys are made in the read tasks, the keys are
joined in one task per partition, and the stage's process resolves the clusters from the verified
pairs (``counts.removed.near_duplicate``, ``counts.near_dedup``: pairs, clusters, the largest and the
histogram of sizes; ``near_duplicates.jsonl``: a sample of removed documents beside the one kept;
MLflow: the counts and ``plots/near_duplicate_clusters.png``). Exact duplicates are removed first.

Output: ``train-NNNNN.parquet``, ``validation-00000.parquet`` (``test-00000.parquet`` when
``data.test_fraction > 0``), columns ``text`` (string), ``doc_id`` (sha256 hex of the text) and
``source`` (input URI).
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from pipeline.config import RunConfig, hash_view
from pipeline.data import DataError, ray_running
from pipeline.data import near_dedup
from pipeline.data.clean import DOCUMENT_SCHEMA, REMOVAL_RULES, CleanOptions, doc_id
from pipeline.config.data_filters import NearDedupSection, QualitySection
from pipeline.data.quality import Filters
from pipeline.data.fs import InputFile
from pipeline.data.readers import read_and_clean
from pipeline.data.stream import SKIP_REASONS
from pipeline.data.sources import resolve_inputs as _resolve
from pipeline.store.contracts import SPLITS, SplitSizes, shard_file_name, shard_files
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


def read_for_shards(src: InputFile, *args, quality_cfg: QualitySection | None = None,
                    near: NearDedupSection | None = None, index: int = 0, partitions: int = 1) -> tuple:
    """Read, clean and filter one input (a Ray task in the pipeline).

    Returns:
        (its documents' ``doc_id`` list and UTF-8 ``bytes`` array, the input's stats, the documents):
        the stage's own process takes only the first two; the table goes from this task's object
        straight to the tasks that write the shards holding its documents. With ``near`` enabled, then
        the ``partitions`` parts of its documents' MinHash band keys (``near_dedup``).
    """
    table, stats = read_and_clean(src, *args)
    if quality_cfg is not None and quality_cfg.enabled():
        table = _filter_quality(table, stats, quality_cfg)
    keys = {"doc_id": table.column("doc_id").to_pylist(),
            "bytes": pc.binary_length(table.column("text")).to_numpy(zero_copy_only=False)}
    if near is None or not near.enabled:
        return keys, stats, table
    sigs = near_dedup.signatures(table.column("text").to_pylist(), near)
    parts = near_dedup.partition(near_dedup.band_keys(sigs, near), index, np.arange(len(sigs)), partitions)
    return (keys, stats, table, *parts)


def _filter_quality(table: pa.Table, stats: dict, q: QualitySection) -> pa.Table:
    """The documents the enabled quality filters keep (a filter that rewrites a document, C4's lines,
    gives it a new id); each removed document counted under its filter in ``stats``."""
    filters = Filters(q)
    for name in filters.names:
        stats["removed"][name] = 0
    texts, ids, sources = [], [], []
    for text, did, source in zip(*(table.column(c).to_pylist() for c in ("text", "doc_id", "source"))):
        kept, by = filters.apply(text)
        if kept is None:
            stats["removed"][by] += 1
            continue
        texts.append(kept)
        ids.append(did if kept == text else doc_id(kept))
        sources.append(source)
    stats["quality"] = filters.counts()
    return pa.table({"text": texts, "doc_id": ids, "source": sources}, schema=DOCUMENT_SCHEMA)


def encode_shard(pieces: list[np.ndarray], *tables: pa.Table) -> pa.Buffer:
    """One shard's parquet file, of rows ``pieces[i]`` of ``tables[i]`` in order (a Ray task in the pipeline)."""
    parts = [t.take(pa.array(rows)) for t, rows in zip(tables, pieces)]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.concat_tables(parts) if parts else DOCUMENT_SCHEMA.empty_table(), sink)
    return sink.getvalue()


def _read_all(files: list[InputFile], cfg: RunConfig, near_out: list | None = None,
              partitions: int = 1) -> Iterator[tuple[dict, dict, object]]:
    """Read and clean every input, in input order: in parallel Ray tasks when Ray is running, each
    input's table then staying in Ray's object store (the third item is its ``ObjectRef``). With
    near-duplicate removal on, each input's band-key parts go to ``near_out`` (refs with Ray)."""
    d = cfg.data
    opts = CleanOptions(d.normalize, d.strip_control_chars, d.min_doc_chars, d.max_doc_chars)
    args = (d.text_field, d.separator, d.encoding_errors, opts, d.reader, d.on_bad_document)
    near = d.near_dedup if d.near_dedup.enabled else None
    kw = {"quality_cfg": d.quality, "near": near, "partitions": partitions}
    if not ray_running():
        for i, src in enumerate(tqdm(files, desc="shard: read", unit="file", disable=None)):
            keys, stats, table, *extra = read_for_shards(src, *args, index=i, **kw)
            if near is not None:
                near_out.append(extra)
            yield keys, stats, table
        return
    import ray

    returns = 3 if near is None else 3 + partitions
    task = ray.remote(num_cpus=1, num_returns=returns)(read_for_shards)
    refs = [task.options(name=f"conduit.shard.read[{i}]").remote(src, *args, index=i, **kw)
            for i, src in enumerate(files)]
    for keys_ref, stats_ref, table_ref, *extra in tqdm(refs, desc="shard: read", unit="file", disable=None):
        try:
            keys, stats = ray.get([keys_ref, stats_ref])
        except ray.exceptions.RayTaskError as e:
            raise e.cause  # the DataError itself, naming the file, not Ray's wrapper
        if near is not None:
            near_out.append(extra)
        yield keys, stats, table_ref


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


@dataclass
class SplitRows:
    """Which rows of which input make up one split, in input order: ``rows[k]`` of input ``inputs[k]``."""

    inputs: list[int] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    sizes: list[np.ndarray] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(r) for r in self.rows)

    def head(self, n: int) -> SplitRows:
        """The first ``n`` rows."""
        out, left = SplitRows(), n
        for i, rows, sizes in zip(self.inputs, self.rows, self.sizes):
            if left <= 0:
                break
            out.inputs.append(i)
            out.rows.append(rows[:left])
            out.sizes.append(sizes[:left])
            left -= len(out.rows[-1])
        return out

    def slice(self, a: int, b: int) -> tuple[list[int], list[np.ndarray]]:
        """Rows ``a:b`` of the split, as (inputs, their row indices)."""
        inputs, pieces, offset = [], [], 0
        for i, rows in zip(self.inputs, self.rows):
            lo, hi = max(a - offset, 0), min(b - offset, len(rows))
            if lo < hi:
                inputs.append(i)
                pieces.append(rows[lo:hi])
            offset += len(rows)
        return inputs, pieces


def _dedup_and_split(parts, cfg: RunConfig, removed: dict, per_input: list, tables: list,
                     near: NearResult | None = None) -> dict[str, SplitRows]:
    seen: set[str] = set()
    by_split = {s: SplitRows() for s in SPLITS}
    all_keys, exact = [], set()
    for index, (keys, stats, table) in enumerate(parts):
        per_input.append(stats)
        tables.append(table)
        for rule, n in stats["removed"].items():
            removed[rule] = removed.get(rule, 0) + n
        for i, did in enumerate(keys["doc_id"]):
            if did in seen:
                exact.add((index << near_dedup.ROW_BITS) | i)
            seen.add(did)
        all_keys.append(keys)
    near_removed = near.run(exact) if near is not None else set()
    for index, keys in enumerate(all_keys):
        picks: dict[str, list[int]] = {s: [] for s in SPLITS}
        for i, did in enumerate(keys["doc_id"]):
            g = (index << near_dedup.ROW_BITS) | i
            if g in exact:
                removed["duplicate"] += 1
                continue
            if g in near_removed:
                removed["near_duplicate"] += 1
                continue
            picks[split_of(did, cfg.data.validation_fraction, cfg.data.test_fraction)].append(i)
        for s in SPLITS:
            if picks[s]:
                rows = np.asarray(picks[s], dtype=np.int64)
                by_split[s].inputs.append(index)
                by_split[s].rows.append(rows)
                by_split[s].sizes.append(np.asarray(keys["bytes"], dtype=np.int64)[rows])
    return by_split


def _join(parts: list[tuple]) -> np.ndarray:
    """Candidate pairs from every input's band-key parts: one join per partition (a Ray task each with Ray)."""
    if not parts:
        return np.empty((0, 2), dtype=np.int64)
    partitions = len(parts[0])
    if not ray_running():
        found = [near_dedup.candidates(*[p[k] for p in parts]) for k in range(partitions)]
    else:
        import ray

        task = ray.remote(num_cpus=1)(near_dedup.candidates)
        refs = [task.options(name=f"conduit.shard.near_join[{k}]").remote(*[p[k] for p in parts])
                for k in range(partitions)]
        found = [ray.get(r) for r in tqdm(refs, desc="shard: near-duplicate join", unit="part", disable=None)]
    found = [f for f in found if len(f)]
    return np.unique(np.concatenate(found), axis=0) if found else np.empty((0, 2), dtype=np.int64)


def _take_texts(table: pa.Table, rows: list[int]) -> list[str]:
    return table.take(pa.array(rows, type=pa.int64())).column("text").to_pylist()


def _pair_similarities(table_a: pa.Table, rows_a: np.ndarray, table_b: pa.Table, rows_b: np.ndarray,
                       n: int) -> np.ndarray:
    """Exact shingle Jaccard of documents rows_a[k] of one input and rows_b[k] of another (a Ray task)."""
    return near_dedup.similarities(_take_texts(table_a, rows_a.tolist()), _take_texts(table_b, rows_b.tolist()), n)


class NearResult:
    """Near-duplicate removal over every input read (``pipeline.data.near_dedup``): run once the exact
    duplicates are known; keeps its counts and a sample of removed documents beside the one kept."""

    def __init__(self, nd: NearDedupSection, tables: list):
        self.nd, self.tables = nd, tables
        self.parts: list[list] = []  # per input: its band-key parts (refs with Ray)
        self.counts: dict = {}
        self.sample: list[dict] = []
        self.sizes: list[int] = []

    def _texts(self, i: int, rows: list[int]) -> list[str]:
        table = self.tables[i]
        if ray_running() and not isinstance(table, pa.Table):
            import ray

            return ray.get(ray.remote(num_cpus=0)(_take_texts).remote(table, rows))
        return _take_texts(table, rows)

    def _similarities(self, a: int, rows_a: np.ndarray, b: int, rows_b: np.ndarray) -> np.ndarray:
        ta, tb = self.tables[a], self.tables[b]
        if ray_running() and not isinstance(ta, pa.Table):
            import ray

            task = ray.remote(num_cpus=1)(_pair_similarities)
            return ray.get(task.options(name=f"conduit.shard.near_verify[{a},{b}]").remote(
                ta, rows_a, tb, rows_b, self.nd.ngram))
        return _pair_similarities(ta, rows_a, tb, rows_b, self.nd.ngram)

    def run(self, exact: set[int]) -> set[int]:
        pairs = _join(self.parts)
        joined, sim = near_dedup.verify(pairs, self._similarities, self.nd.threshold)
        remove, clusters = near_dedup.resolve(joined, exact)
        self.sizes = [len(c) for c in clusters]
        self.counts = {
            "candidate_pairs": int(len(pairs)), "joined_pairs": int(len(joined)),
            "clusters": len(clusters), "largest_cluster": max(self.sizes, default=0),
            "cluster_sizes": {str(k): v for k, v in sorted(collections.Counter(self.sizes).items())},
        }
        for c in clusters[: self.nd.sample_pairs]:
            keep, gone = c[0], c[1]
            (ki, kr), (gi, gr) = near_dedup.split_gidx(keep), near_dedup.split_gidx(gone)
            kept_text, removed_text = self._texts(ki, [kr])[0], self._texts(gi, [gr])[0]
            self.sample.append({
                "kept": kept_text, "removed": removed_text, "cluster_size": len(c),
                "kept_at": [ki, kr], "removed_at": [gi, gr],
                "jaccard": round(near_dedup.jaccard(kept_text, removed_text, self.nd.ngram), 4)})
        return remove

    def write(self, out_dir: Path, tracker) -> None:
        with open(out_dir / "near_duplicates.jsonl", "w", encoding="utf-8") as f:
            for row in self.sample:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        tracker.log_metrics({"near_dedup_clusters": self.counts["clusters"],
                             "near_dedup_largest_cluster": self.counts["largest_cluster"],
                             "near_dedup_candidate_pairs": self.counts["candidate_pairs"]})
        if self.sizes:
            tracker.log_figure(cluster_figure(self.sizes), "plots/near_duplicate_clusters.png")


def cluster_figure(sizes: list[int]):
    """How many near-duplicate clusters there are of each size (documents per cluster)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    counts = collections.Counter(sizes)
    ax.bar(list(counts), list(counts.values()), width=0.8)
    ax.set_xlabel("documents in the cluster (one kept)")
    ax.set_ylabel("clusters")
    ax.set_yscale("log")
    ax.set_title(f"near-duplicate clusters: {len(sizes)}, {sum(sizes) - len(sizes)} documents removed")
    fig.tight_layout()
    return fig


def _write_shards(jobs: list[tuple[str, list[int], list[np.ndarray]]], tables: list, out_dir: Path) -> None:
    """Write each (file name, inputs, rows) shard. With Ray, ``tables`` are object refs and each shard is
    encoded in a task of its own from the inputs it needs; this process holds one shard's bytes at a time."""
    if not ray_running():
        for name, inputs, pieces in jobs:
            (out_dir / name).write_bytes(encode_shard(pieces, *[tables[i] for i in inputs]).to_pybytes())
        return
    import ray

    task = ray.remote(num_cpus=1)(encode_shard)
    window = max(2, int(ray.cluster_resources().get("CPU", 2)))  # shards in flight: bounds the object store too
    pending: list[tuple[str, object]] = []
    for name, inputs, pieces in tqdm(jobs, desc="shard: write", unit="shard", disable=None):
        pending.append((name, task.options(name=f"conduit.shard.write[{name}]").remote(
            pieces, *[tables[i] for i in inputs])))
        while len(pending) >= window:
            done, ref = pending.pop(0)
            (out_dir / done).write_bytes(memoryview(ray.get(ref)))
    for done, ref in pending:
        (out_dir / done).write_bytes(memoryview(ray.get(ref)))


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    d = cfg.data
    files = resolve_inputs(cfg)
    removed = {**dict.fromkeys(REMOVAL_RULES, 0), **dict.fromkeys(d.quality.enabled(), 0), "duplicate": 0,
               **({"near_duplicate": 0} if d.near_dedup.enabled else {}), "over_max_documents": 0}
    per_input: list[dict] = []
    tables: list = []  # per input: its documents (or, with Ray, the ref of the task's table)
    near = NearResult(d.near_dedup, tables) if d.near_dedup.enabled else None
    reads = _read_all(files, cfg, near.parts if near else None, near_partitions(files))
    by_split = _dedup_and_split(reads, cfg, removed, per_input, tables, near)
    splits = [s for s in SPLITS if s != "test" or d.test_fraction > 0]
    unique = sum(len(by_split[s]) for s in SPLITS)
    if d.max_documents is not None:
        for s in splits:  # a cap keeps the split shares: each split keeps its fraction
            keep = max(1, round(d.max_documents * len(by_split[s]) / max(1, unique)))
            removed["over_max_documents"] += max(0, len(by_split[s]) - keep)
            by_split[s] = by_split[s].head(keep)
    for s in splits:
        if len(by_split[s]) == 0:
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
    jobs = []
    for s in splits:
        rows = by_split[s]
        sizes = np.concatenate(rows.sizes)
        split_bytes = int(sizes.sum())
        if d.target_shard_bytes is not None:
            n_shards = math.ceil(split_bytes / d.target_shard_bytes)
        else:
            n_shards = d.num_shards if s == "train" else 1
        sizes_by_split.documents[s], sizes_by_split.bytes[s], counts["shards"][s] = len(rows), split_bytes, []
        for k, (a, b) in enumerate(shard_bounds(sizes, n_shards)):
            name = shard_file_name(s, k)
            jobs.append((name, *rows.slice(a, b)))
            counts["shards"][s].append({"file": name, "documents": b - a, "bytes": int(sizes[a:b].sum())})
    _write_shards(jobs, tables, out_dir)
    counts.update(sizes_by_split.counts())
    read = sum(s["documents"] for s in per_input)
    kept = sum(sizes_by_split.documents.values())
    if read != kept + sum(removed.values()):
        raise AssertionError(f"shard: {read} documents read but {kept} kept + {removed} removed")  # a bug here
    counts["documents_read"] = read
    if d.quality.enabled():
        counts["quality"] = {name: dict(sum((collections.Counter(s.get("quality", {}).get(name, {}))
                                            for s in per_input), collections.Counter()))
                             for name in d.quality.enabled()}
        if d.quality.c4_lines.enabled:
            counts["quality"]["c4_lines_dropped_lines"] = sum(s.get("quality", {}).get("c4_lines_dropped_lines", 0)
                                                              for s in per_input)
    if near is not None:
        counts["near_dedup"] = near.counts
        near.write(out_dir, tracker)
    tracker.log_metrics({
        "documents_read": read, "bytes_read": sum(s["bytes"] for s in per_input),
        **{f"documents_{s}": n for s, n in sizes_by_split.documents.items()},
        **{f"bytes_{s}": n for s, n in sizes_by_split.bytes.items()},
        **{f"removed_{k}": v for k, v in removed.items()},
        **{f"skipped_{k}": v for k, v in counts["skipped"].items()},
    })
    return counts


def near_partitions(files: list[InputFile]) -> int:
    """Parts the band keys are split into: the cluster's CPUs, and one more per 256 MiB of input, so a
    join task's share stays bounded as the corpus grows."""
    corpus = sum(f.size for f in files)
    cpus = 1
    if ray_running():
        import ray

        cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(cpus, math.ceil(corpus / 2**28), 1)


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

"""tokenize: document shards + tokenizer -> packed token blocks, one token shard per document shard.

Each document shard is read, encoded and packed (``pipeline.data.packing``) in one place: a Ray task
per shard (``ray`` engine; ``tokenize.num_actors`` of them at a time, 1 logical CPU and
``tokenize.threads_per_actor`` sentencepiece threads each, reading the shard and the model wherever
every node can: in place, or the object store), or this stage's own process with
``num_actors x threads_per_actor`` threads (``local``). ``auto`` takes Ray from
``tokenize.ray_data_min_bytes`` of text on: below it a task's start-up costs more than the encoding it
spreads. Without Ray (unit tests) the stage is always local. Both engines run the same function on the
same shards, so they write the same files. The stage's process only writes each packed shard as it
arrives (the tasks return it through Ray's object store) and holds one at a time, plus the tails.

Documents are joined with EOS after every document (BOS before each when ``tokenize.add_bos``) and
cut into blocks of ``seq_len + 1`` tokens (inputs and shifted targets), per document shard; the
shards' leftover tails are joined, in shard order, into one last shard; only its remainder is dropped
and counted. The global block order (shard 0's blocks, shard 1's, ..., the tail shard's) depends only
on the data; training permutes it with the run's seed.

Output per split the shard artifact has (train, validation, and test when present), for each token
shard ``k`` with blocks: ``<split>.tokens.<k>.npy`` (n_blocks_k, seq_len+1), uint16 when the vocabulary
fits else uint32, and ``<split>.docs.<k>.npy`` (same shape, uint32): the index (in shard order) of the
document each token came from. ``index.json`` lists per split ``blocks``, ``tokens``, ``bytes`` (feeds
bits-per-byte), ``documents``, ``tokens_in_documents`` (ids without BOS/EOS), ``dropped_tail_tokens``
and ``shards`` (blocks per token shard). Read splits with ``pipeline.data.token_blocks.TokenBlocks``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from pipeline.store.artifacts import Artifact
from pipeline.config import RunConfig, hash_view
from pipeline.data import ray_running
from pipeline.data.encode import SentencePieceEncoder, token_dtype
from pipeline.data.packing import PackedShard, SplitWriter, pack
from pipeline.store.contracts import SPLITS, TOKENIZER_FILE, SplitSizes, SplitTokens, TokenIndex, shard_files
from pipeline.stages.stage import Resources, Stage
from pipeline.store.backends import cluster_readable, on_this_node, release_held
from pipeline.tokenization.spm import load_sentencepiece


PROGRESS_EVERY_S = 5.0  # how often the stage logs documents_tokenized to its MLflow run


def hash_config(cfg: RunConfig) -> dict:
    return {"tokenize": hash_view(cfg.tokenize)}


def text_bytes(shard_artifact) -> int:
    """UTF-8 bytes of text in the shard artifact (its manifest counts them per split)."""
    return int(sum(SplitSizes.of(shard_artifact).bytes.values()))


def choose_engine(cfg: RunConfig, n_bytes: int) -> str:
    """``ray`` or ``local`` for a corpus of ``n_bytes`` (see ``tokenize.engine`` in the config;
    ``ray_data``, its older name, means ``ray``)."""
    if not ray_running():
        return "local"
    if cfg.tokenize.engine != "auto":
        return "ray" if cfg.tokenize.engine in ("ray", "ray_data") else cfg.tokenize.engine
    return "ray" if n_bytes >= cfg.tokenize.ray_data_min_bytes else "local"


def encode_threads(cfg: RunConfig) -> int:
    """sentencepiece threads of the local engine."""
    return cfg.tokenize.num_actors * cfg.tokenize.threads_per_actor


def task_resources(cfg: RunConfig, inputs: dict) -> Resources:
    """What the runner reserves for this stage's task: the encode threads when it encodes in-process
    (capped by the cluster's CPUs), no CPU with the Ray engine (its tasks hold their own)."""
    if choose_engine(cfg, text_bytes(inputs["shard"])) == "ray":
        return Resources(cpus=0)
    import ray

    return Resources(cpus=min(encode_threads(cfg), ray.cluster_resources().get("CPU", 1)))


def pack_document_shard(source: str, filesystem, model: str | Artifact, add_bos: bool, threads: int,
                        seq_len: int, first_doc: int, batch_size: int) -> PackedShard:
    """Read, encode and pack one document shard (a Ray task with the ``ray`` engine).

    Args:
        source: the parquet file's path (in ``filesystem`` when given, else local).
        filesystem: the object store's ``pyarrow`` filesystem, or None.
        model: the sentencepiece model's path, or the tokenizer ``Artifact`` (read from this node's copy).
        add_bos, threads, seq_len, batch_size: the tokenize section's.
        first_doc: the split-wide index of the shard's first document.
    """
    folder = None if isinstance(model, str) else on_this_node(model)
    encoder = SentencePieceEncoder(model if folder is None else str(folder / TOKENIZER_FILE), add_bos, threads)
    if folder is not None:
        release_held(folder)  # the model is in memory now; this task's worker goes on to other tasks
    stream, lengths, n_bytes = [], [], 0
    handle = filesystem.open_input_file(source) if filesystem is not None else source
    for rb in pq.ParquetFile(handle).iter_batches(batch_size=batch_size, columns=["text"]):
        table = encoder(pa.Table.from_batches([rb]))
        tokens = table.column("tokens").combine_chunks()
        stream.append(tokens.flatten().to_numpy())  # flatten honours slices
        lengths.append(pc.list_value_length(tokens).to_numpy())
        n_bytes += int(pc.sum(table.column("n_bytes")).as_py() or 0)
    dtype = encoder.dtype
    packed = pack(np.concatenate(stream) if stream else np.empty(0, dtype),
                  np.concatenate(lengths) if lengths else np.empty(0, np.int64), seq_len + 1, first_doc, dtype)
    packed.n_bytes = n_bytes
    return packed


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    t = cfg.tokenize
    model_path = str(inputs["tokenizer"].path / TOKENIZER_FILE)
    sp = load_sentencepiece(model_path)
    dtype = token_dtype(sp.get_piece_size())
    per_doc_extra = 1 + int(t.add_bos)
    engine = choose_engine(cfg, text_bytes(inputs["shard"]))
    # (split, shard number, file, first document): every document shard of every split, in order.
    jobs = []
    for split in SPLITS:
        first = 0
        for k, f in enumerate(shard_files(inputs["shard"].path, split)):
            jobs.append((split, k, f, first))
            first += pq.ParquetFile(f).metadata.num_rows
    writers = {s: SplitWriter(out_dir, s, t.seq_len + 1, dtype) for s in dict.fromkeys(j[0] for j in jobs)}
    bar = tqdm(total=sum(SplitSizes.of(inputs["shard"]).documents.values()), desc="tokenize", unit="doc",
               mininterval=1.0, disable=None)
    done, last_report = 0, time.monotonic()
    for (split, k, _, _), packed in _packed_shards(jobs, inputs, cfg, engine, model_path):
        writers[split].add(k, packed)
        bar.update(packed.documents)
        done += packed.documents
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:  # the driver's status line reads it
            tracker.log_metrics({"documents_tokenized": done}, step=done)
            last_report = time.monotonic()
    splits = {}
    for split, writer in writers.items():
        shards, dropped = writer.finish()
        blocks = sum(shards)
        splits[split] = SplitTokens(
            blocks=blocks, tokens=blocks * (t.seq_len + 1), dropped_tail_tokens=dropped,
            documents=writer.documents, bytes=writer.n_bytes,
            tokens_in_documents=writer.total - per_doc_extra * writer.documents, shards=shards,
        )
    index = TokenIndex(seq_len=t.seq_len, dtype=dtype.name, vocab_size=sp.get_piece_size(),
                       add_bos=t.add_bos, splits=splits)
    index.write(out_dir)
    bar.close()
    tracker.log_metrics({f"tokens_{s}": v.tokens for s, v in splits.items()})
    tracker.log_metrics({"documents_tokenized": done}, step=done)
    return {**index.to_dict(), "engine": engine}


def _packed_shards(jobs: list, inputs: dict, cfg: RunConfig, engine: str, model_path: str):
    """``(job, PackedShard)`` of every job, in order: here, or in Ray tasks, ``tokenize.num_actors`` at a time."""
    t = cfg.tokenize
    if engine == "local":
        for job in jobs:
            yield job, pack_document_shard(str(job[2]), None, model_path, t.add_bos, encode_threads(cfg),
                                           t.seq_len, job[3], t.batch_size)
        return
    import ray

    paths, filesystem = cluster_readable(inputs["shard"], [j[2] for j in jobs])
    task = ray.remote(num_cpus=1)(pack_document_shard)
    window = max(1, t.num_actors)
    pending: list = []
    for job, path in zip(jobs, paths):
        pending.append((job, task.options(name=f"conduit.tokenize[{Path(job[2]).name}]").remote(
            path, filesystem, inputs["tokenizer"], t.add_bos, t.threads_per_actor, t.seq_len, job[3], t.batch_size)))
        while len(pending) > window:
            head, ref = pending.pop(0)
            yield head, ray.get(ref)
    for head, ref in pending:
        yield head, ray.get(ref)


def disk_need(cfg: RunConfig, inputs: dict, hash_: str) -> list[tuple[str | None, int, str]]:
    """At most one token per UTF-8 byte of text, each 4 bytes (uint32, the wider token dtype)."""
    n = text_bytes(inputs["shard"])
    return [(None, 4 * n, f"token files of {n / 2**20:.1f} MiB of text")]


STAGE = Stage(name="tokenize", version=3, inputs=("shard", "tokenizer"),
              hash_config=hash_config, run=run, resources_for=task_resources, disk_need=disk_need)

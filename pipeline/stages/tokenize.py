"""tokenize: document shards + tokenizer -> packed token blocks.

Each split's shards are read with Ray Data (``read_parquet``) and encoded by
``tokenize.num_actors`` sentencepiece actors (``map_batches`` with ``ActorPoolStrategy``; each actor
loads the model once) when Ray is running, which it is inside the pipeline's stage task. Without Ray
(unit tests) the same encoder runs in this process over the same batches. Ray Data is told to
preserve order, so both paths give identical files.

Documents are joined with EOS after every document (BOS before each when ``tokenize.add_bos``) and
cut into blocks of ``seq_len + 1`` tokens (inputs and shifted targets). The tail that does not fill
a block is dropped and counted. The stream goes through temporary files, so memory stays bounded.

Output per split the shard artifact has (train, validation, and test when present):
``<split>.tokens.npy`` (n_blocks, seq_len+1), uint16 when the vocabulary fits else uint32, and
``<split>.docs.npy`` (same shape, uint32): the index (in shard order) of the document each token came
from. ``index.json`` lists per split ``blocks``, ``tokens``, ``bytes`` (feeds bits-per-byte),
``documents``, ``tokens_in_documents`` (ids without BOS/EOS) and ``dropped_tail_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.artifacts import write_json_atomic
from pipeline.config import RunConfig, hash_view
from pipeline.data import ray_running
from pipeline.data.encode import SentencePieceEncoder, token_dtype
from pipeline.data.packing import BlockWriter, segment
from pipeline.stages import shard
from pipeline.stages.tokenizer import MODEL_FILE
from pipeline.text import load_sentencepiece


NAME = "tokenize"
VERSION = 2
INPUTS = ("shard", "tokenizer")


def hash_config(cfg: RunConfig) -> dict:
    return {"tokenize": hash_view(cfg.tokenize)}


def pack(docs_ids: list[list[int]], seq_len: int, add_bos: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Concatenate documents (EOS after each, BOS before each if asked) into (n, seq_len+1) blocks,
    in memory (the stage itself streams through ``BlockWriter``; this is the same rule, for small inputs).

    Returns:
        (tokens, doc_index, dropped_tail_tokens).
    """
    stream, lengths = segment(docs_ids, add_bos, np.dtype(np.int64))
    doc_of = np.repeat(np.arange(len(docs_ids), dtype=np.uint32), lengths)
    block = seq_len + 1
    n = len(stream) // block
    return stream[: n * block].reshape(n, block), doc_of[: n * block].reshape(n, block), len(stream) - n * block


def encoded_batches(files: list[Path], model_path: str, cfg: RunConfig) -> Iterator[tuple[str, pa.Table]]:
    """Encoded documents of ``files`` in the given order: ``(shard file, SentencePieceEncoder table)``.

    With Ray running: one Ray Data pipeline over all files (``read_parquet`` -> ``map_batches`` over an
    actor pool of ``tokenize.num_actors``, 1 logical CPU each), order preserved, so the actors start
    once for every split. Without Ray: the same encoder here, file by file.

    Raises:
        ValueError: the Ray cluster has fewer logical CPUs than the actors plus one reader need.
    """
    t = cfg.tokenize
    if not ray_running():
        encoder = SentencePieceEncoder(model_path, t.add_bos, t.threads_per_actor)
        for f in files:
            for rb in pq.ParquetFile(f).iter_batches(batch_size=t.batch_size, columns=["text"]):
                yield str(f), encoder(pa.Table.from_batches([rb]))
        return
    import ray

    cpus = ray.cluster_resources().get("CPU", 0)
    if t.num_actors + 1 > cpus:  # each actor holds 1 CPU for its life; parquet reads need one more
        raise ValueError(
            f"tokenize.num_actors={t.num_actors} needs {t.num_actors + 1} logical CPUs in the Ray cluster "
            f"(one per actor plus one for reading) but it has {cpus:g}; lower tokenize.num_actors or raise "
            "cluster.num_cpus"
        )
    ds = ray.data.read_parquet([str(f) for f in files], include_paths=True).select_columns(["text", "path"])
    ds = ds.map_batches(
        SentencePieceEncoder,
        fn_constructor_args=(model_path, t.add_bos, t.threads_per_actor),
        batch_size=t.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=t.num_actors),
        num_cpus=1,
    )
    ds.context.execution_options.preserve_order = True  # the Dataset's own copy of the context
    for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        paths = table.column("path").to_pylist()
        start = 0
        for i in range(1, len(paths) + 1):  # a batch may span files: cut it where the path changes
            if i == len(paths) or paths[i] != paths[start]:
                yield paths[start], table.slice(start, i - start)
                start = i


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    model_path = str(inputs["tokenizer"].path / MODEL_FILE)
    sp = load_sentencepiece(model_path)
    dtype = token_dtype(sp.get_piece_size())
    per_doc_extra = 1 + int(cfg.tokenize.add_bos)
    index = {"seq_len": cfg.tokenize.seq_len, "dtype": dtype.name, "vocab_size": sp.get_piece_size(),
             "add_bos": cfg.tokenize.add_bos, "splits": {}}
    # Splits the shard artifact has (test is optional), their files in order, all in one pass.
    split_files = {s: shard.shard_files(inputs["shard"].path, s) for s in shard.SPLITS}
    split_of = {str(f): s for s, fs in split_files.items() for f in fs}
    writers = {s: BlockWriter(out_dir, s, cfg.tokenize.seq_len, dtype) for s, fs in split_files.items() if fs}
    n_bytes = dict.fromkeys(writers, 0)
    for path, table in encoded_batches([f for fs in split_files.values() for f in fs], model_path, cfg):
        split = split_of[path]
        tokens = table.column("tokens").combine_chunks()
        lengths = pc.list_value_length(tokens).to_numpy()
        writers[split].append(tokens.flatten().to_numpy(), lengths)  # flatten honours slices
        n_bytes[split] += int(pc.sum(table.column("n_bytes")).as_py() or 0)
    for split, writer in writers.items():
        blocks, dropped = writer.finish()
        index["splits"][split] = {
            "blocks": blocks, "tokens": blocks * (cfg.tokenize.seq_len + 1), "dropped_tail_tokens": dropped,
            "documents": writer.documents, "bytes": n_bytes[split],
            "tokens_in_documents": writer.total - per_doc_extra * writer.documents,
        }
    write_json_atomic(out_dir / "index.json", index)
    tracker.log_metrics({f"tokens_{s}": v["tokens"] for s, v in index["splits"].items()})
    return index

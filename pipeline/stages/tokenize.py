"""tokenize: document shards + tokenizer -> packed token blocks.

Two engines encode the same batches into identical files (``tokenize.engine``):
``ray_data`` reads the shards with Ray Data (``read_parquet``) and encodes them in
``tokenize.num_actors`` sentencepiece actors (``map_batches`` with ``ActorPoolStrategy``; each actor
loads the model once; order preserved); ``local`` encodes in the stage's own process with
``num_actors x threads_per_actor`` sentencepiece threads. ``auto`` takes Ray Data from
``tokenize.ray_data_min_bytes`` of text on: below it, Ray Data's start-up (worker processes, actors,
planning: about 5-8 s on 2 cores) costs more than the encoding it spreads (benchmarks/tokenize_throughput.py).
Without Ray (unit tests) the stage is always local.

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

import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from pipeline.artifacts import Artifact
from pipeline.config import RunConfig, hash_view
from pipeline.data import ray_running
from pipeline.data.encode import SentencePieceEncoder, token_dtype
from pipeline.data.packing import BlockWriter
from pipeline.stage_io import SPLITS, TOKENIZER_FILE, SplitSizes, SplitTokens, TokenIndex, shard_files
from pipeline.stages.stage import Resources, Stage
from pipeline.storage import cluster_readable, on_this_node
from pipeline.text import load_sentencepiece


PROGRESS_EVERY_S = 5.0  # how often the stage logs documents_tokenized to its MLflow run


def hash_config(cfg: RunConfig) -> dict:
    return {"tokenize": hash_view(cfg.tokenize)}


def text_bytes(shard_artifact) -> int:
    """UTF-8 bytes of text in the shard artifact (its manifest counts them per split)."""
    return int(sum(SplitSizes.of(shard_artifact).bytes.values()))


def choose_engine(cfg: RunConfig, n_bytes: int) -> str:
    """``ray_data`` or ``local`` for a corpus of ``n_bytes`` (see ``tokenize.engine`` in the config)."""
    if not ray_running():
        return "local"
    if cfg.tokenize.engine != "auto":
        return cfg.tokenize.engine
    return "ray_data" if n_bytes >= cfg.tokenize.ray_data_min_bytes else "local"


def encode_threads(cfg: RunConfig) -> int:
    """sentencepiece threads of the local engine."""
    return cfg.tokenize.num_actors * cfg.tokenize.threads_per_actor


def task_resources(cfg: RunConfig, inputs: dict) -> Resources:
    """What the runner reserves for this stage's task: the encode threads when it encodes in-process
    (capped by the cluster's CPUs), no CPU with Ray Data (its actors hold their own)."""
    if choose_engine(cfg, text_bytes(inputs["shard"])) == "ray_data":
        return Resources(cpus=0)
    import ray

    return Resources(cpus=min(encode_threads(cfg), ray.cluster_resources().get("CPU", 1)))


class NodeEncoder(SentencePieceEncoder):
    """A ``SentencePieceEncoder`` of the tokenizer artifact's model, read from the copy on the node the
    Ray Data actor runs on (``pipeline.storage.on_this_node``: fetched once per node from an object store)."""

    def __init__(self, tokenizer: Artifact, add_bos: bool, num_threads: int):
        super().__init__(str(on_this_node(tokenizer) / TOKENIZER_FILE), add_bos, num_threads)


def encoded_batches(files: list[Path], inputs: Mapping[str, Artifact], cfg: RunConfig,
                    engine: str) -> Iterator[tuple[str, pa.Table]]:
    """Encoded documents of ``files`` (of the shard artifact) in the given order: ``(shard file,
    SentencePieceEncoder table)``, with the model of the tokenizer artifact.

    ``local``: one encoder here with ``num_actors x threads_per_actor`` threads, file by file.
    ``ray_data``: one Ray Data pipeline over all files (``read_parquet`` -> ``map_batches`` over an
    actor pool of ``tokenize.num_actors``, 1 logical CPU each), order preserved, so the actors start
    once for every split. Its readers and actors may run on other nodes: they read the shard files
    and the model wherever every node can (``pipeline.storage``: in place, or the object store).

    Raises:
        ValueError: the Ray cluster has fewer logical CPUs than the actors plus one reader need.
    """
    t = cfg.tokenize
    if engine == "local":
        encoder = SentencePieceEncoder(str(inputs["tokenizer"].path / TOKENIZER_FILE), t.add_bos, encode_threads(cfg))
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
    ctx = ray.data.DataContext.get_current()
    v2 = ctx.use_datasource_v2
    # Ray 2.60's file-listing operator (datasource v2) spends seconds listing a handful of known
    # files; the v1 reader takes the paths as given. Enough blocks that every actor gets work.
    ctx.use_datasource_v2 = False
    try:
        paths, filesystem = cluster_readable(inputs["shard"], files)
        ds = ray.data.read_parquet(paths, filesystem=filesystem, include_paths=True, columns=["text"],
                                   override_num_blocks=max(len(files), 4 * t.num_actors))
    finally:
        ctx.use_datasource_v2 = v2
    ds = ds.map_batches(
        NodeEncoder,
        fn_constructor_args=(inputs["tokenizer"], t.add_bos, t.threads_per_actor),
        batch_size=t.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=t.num_actors),
        num_cpus=1,
    )
    ds.context.execution_options.preserve_order = True  # the Dataset's own copy of the context
    local_file = dict(zip(paths, map(str, files)))
    for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        read = table.column("path").to_pylist()
        start = 0
        for i in range(1, len(read) + 1):  # a batch may span files: cut it where the path changes
            if i == len(read) or read[i] != read[start]:
                yield local_file[read[start]], table.slice(start, i - start)
                start = i


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    model_path = str(inputs["tokenizer"].path / TOKENIZER_FILE)
    sp = load_sentencepiece(model_path)
    dtype = token_dtype(sp.get_piece_size())
    per_doc_extra = 1 + int(cfg.tokenize.add_bos)
    # Splits the shard artifact has (test is optional), their files in order, all in one pass.
    split_files = {s: shard_files(inputs["shard"].path, s) for s in SPLITS}
    split_of = {str(f): s for s, fs in split_files.items() for f in fs}
    writers = {s: BlockWriter(out_dir, s, cfg.tokenize.seq_len, dtype) for s, fs in split_files.items() if fs}
    n_bytes = dict.fromkeys(writers, 0)
    engine = choose_engine(cfg, text_bytes(inputs["shard"]))
    # Ray Data draws its own progress bars; the local path gets one over documents.
    bar = tqdm(total=sum(SplitSizes.of(inputs["shard"]).documents.values()), desc="tokenize", unit="doc",
               disable=engine != "local", mininterval=1.0)
    done, last_report = 0, time.monotonic()
    for path, table in encoded_batches([f for fs in split_files.values() for f in fs], inputs, cfg, engine):
        bar.update(table.num_rows)
        done += table.num_rows
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:  # the driver's status line reads it
            tracker.log_metrics({"documents_tokenized": done}, step=done)
            last_report = time.monotonic()
        split = split_of[path]
        tokens = table.column("tokens").combine_chunks()
        lengths = pc.list_value_length(tokens).to_numpy()
        writers[split].append(tokens.flatten().to_numpy(), lengths)  # flatten honours slices
        n_bytes[split] += int(pc.sum(table.column("n_bytes")).as_py() or 0)
    splits = {}
    for split, writer in writers.items():
        blocks, dropped = writer.finish()
        splits[split] = SplitTokens(
            blocks=blocks, tokens=blocks * (cfg.tokenize.seq_len + 1), dropped_tail_tokens=dropped,
            documents=writer.documents, bytes=n_bytes[split],
            tokens_in_documents=writer.total - per_doc_extra * writer.documents,
        )
    index = TokenIndex(seq_len=cfg.tokenize.seq_len, dtype=dtype.name, vocab_size=sp.get_piece_size(),
                       add_bos=cfg.tokenize.add_bos, splits=splits)
    index.write(out_dir)
    bar.close()
    tracker.log_metrics({f"tokens_{s}": v.tokens for s, v in splits.items()})
    tracker.log_metrics({"documents_tokenized": done}, step=done)
    return {**index.to_dict(), "engine": engine}


def disk_need(cfg: RunConfig, inputs: dict, hash_: str) -> list[tuple[str | None, int, str]]:
    """At most one token per UTF-8 byte of text, each 4 bytes (uint32, the wider token dtype)."""
    n = text_bytes(inputs["shard"])
    return [(None, 4 * n, f"token files of {n / 2**20:.1f} MiB of text")]


STAGE = Stage(name="tokenize", version=2, inputs=("shard", "tokenizer"),
              hash_config=hash_config, run=run, resources_for=task_resources, disk_need=disk_need)

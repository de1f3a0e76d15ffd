"""tokenizer: the training shards -> a sentencepiece model (``tokenizer.model``).

Trained from an iterator over the training documents in shard order, capped at
``tokenizer.max_training_bytes``, so memory stays bounded on a large corpus and the sample is the
same on every run. Special ids are fixed (see ``pipeline.text``).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from pipeline.config import RunConfig, hash_view
from pipeline.stages import shard
from pipeline.text import load_sentencepiece, train_sentencepiece, training_lines

NAME = "tokenizer"
VERSION = 1
INPUTS = ("shard",)
MODEL_FILE = "tokenizer.model"


def hash_config(cfg: RunConfig) -> dict:
    return {"tokenizer": hash_view(cfg.tokenizer)}


def _train_docs(shard_dir: Path):
    for f in shard.shard_files(shard_dir, "train"):
        yield from pq.read_table(f, columns=["text"]).column(0).to_pylist()


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    t = cfg.tokenizer
    model = train_sentencepiece(
        training_lines(_train_docs(inputs["shard"].path), t.max_training_bytes),
        vocab_size=t.vocab_size, model_type=t.model_type, character_coverage=t.character_coverage,
        byte_fallback=t.byte_fallback, normalization=t.normalization, num_threads=t.num_threads,
    )
    (out_dir / MODEL_FILE).write_bytes(model)
    sp = load_sentencepiece(str(out_dir / MODEL_FILE))
    # A sample of pieces, for a person to eyeball in the manifest.
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    counts = {"vocab_size": sp.get_piece_size(), "sample_pieces": pieces[-20:]}
    tracker.log_metrics({"vocab_size": sp.get_piece_size()})
    return counts

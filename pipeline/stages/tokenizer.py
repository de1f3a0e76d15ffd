"""tokenizer: the training shards -> a sentencepiece model (``tokenizer.model``).

Trained from an iterator, so memory stays bounded on a large corpus, over a deterministic sample:
a training document is in the sample when bytes 8-16 of its id (sha256), read as a fraction of
2^64, fall below ``max_training_bytes / train_bytes`` (bits the train/validation split does not
use), and the lines of the sampled documents are taken in shard order until
``tokenizer.max_training_bytes``. The sample depends on the documents alone and spreads over the
whole corpus instead of its first files. Special ids are fixed (see ``pipeline.tokenization.spm``).

Sentencepiece skips a training sentence longer than its ``max_sentence_length`` without a word, so
a corpus of long lines would train on almost nothing: lines longer than ``MAX_SENTENCE_BYTES`` are
split instead, and the manifest's counts and the stage's metrics say how many (``long_lines_split``,
``sentences_from_splits``, ``training_sentences``). Version 3: that split (version 2 skipped them).

An encoder-decoder run (model.arch encoder_decoder) also reserves the span-corruption sentinels
``<extra_id_0>``, ... (``pipeline.data.span_corruption``) as user-defined symbols after the configured
ones, one per span of a block; they enter the hash only then, so a decoder run's tokenizer is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.config import RunConfig, hash_view
from pipeline.data.span_corruption import num_sentinels, sentinel_symbols
from pipeline.store.contracts import TOKENIZER_FILE, SplitSizes, shard_files
from pipeline.stages.stage import Stage
from pipeline.tokenization.spm import MAX_SENTENCE_BYTES, load_sentencepiece, train_sentencepiece, training_lines

READ_BATCH_ROWS = 4096


def hash_config(cfg: RunConfig) -> dict:
    sentinels = num_sentinels(cfg)
    return {"tokenizer": hash_view(cfg.tokenizer), **({"sentinels": sentinels} if sentinels else {})}


def reserved_symbols(cfg: RunConfig) -> list[str]:
    """The user-defined symbols the tokenizer reserves: the configured ones, then any sentinels."""
    return [*cfg.tokenizer.user_defined_symbols, *sentinel_symbols(num_sentinels(cfg))]


def in_sample(doc_id: str, rate: float) -> bool:
    """Whether a document is in the tokenizer's training sample (independent of the split bits)."""
    return int(doc_id[16:32], 16) / 2**64 < rate


def sample_docs(shard_dir: Path, rate: float, tally: dict) -> Iterator[str]:
    """Training documents in shard order that are in the sample, read a batch at a time.

    Args:
        shard_dir: the shard artifact.
        rate: the sampling rate in (0, 1].
        tally: gets ``documents`` and ``bytes`` of the sampled documents added as they are yielded.
    """
    for f in shard_files(shard_dir, "train"):
        for batch in pq.ParquetFile(f).iter_batches(batch_size=READ_BATCH_ROWS, columns=["text", "doc_id"]):
            for text, did in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                if in_sample(did, rate):
                    tally["documents"] += 1
                    tally["bytes"] += len(text.encode("utf-8"))
                    yield text


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    t = cfg.tokenizer
    train_bytes = SplitSizes.of(inputs["shard"]).bytes["train"]
    rate = min(1.0, t.max_training_bytes / max(1, train_bytes))
    tally = {"documents": 0, "bytes": 0}
    lines: dict = {}  # sentences, long_lines_split, sentences_from_splits (see training_lines)
    model = train_sentencepiece(
        training_lines(sample_docs(inputs["shard"].path, rate, tally), t.max_training_bytes, lines),
        vocab_size=t.vocab_size, model_type=t.model_type, character_coverage=t.character_coverage,
        byte_fallback=t.byte_fallback, normalization=t.normalization, num_threads=t.num_threads,
        user_defined_symbols=reserved_symbols(cfg),
    )
    (out_dir / TOKENIZER_FILE).write_bytes(model)
    sp = load_sentencepiece(str(out_dir / TOKENIZER_FILE))
    # A sample of pieces, for a person to eyeball in the manifest.
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    counts = {
        "vocab_size": sp.get_piece_size(), "sample_pieces": pieces[-20:],
        "sample_rate": rate, "sample_documents_seen": tally["documents"], "sample_bytes_seen": tally["bytes"],
        "user_defined_symbols": {s: sp.piece_to_id(s) for s in reserved_symbols(cfg)},
        "training_sentences": lines["sentences"], "max_sentence_bytes": MAX_SENTENCE_BYTES,
        "long_lines_split": lines["long_lines_split"], "sentences_from_splits": lines["sentences_from_splits"],
    }
    tracker.log_metrics({"vocab_size": sp.get_piece_size(), "sample_bytes_seen": tally["bytes"],
                         "training_sentences": lines["sentences"], "long_lines_split": lines["long_lines_split"],
                         "sentences_from_splits": lines["sentences_from_splits"]})
    return counts


STAGE = Stage(name="tokenizer", version=3, inputs=("shard",), hash_config=hash_config, run=run)

"""tokenize: document shards + tokenizer -> packed token blocks.

Each split's documents are encoded, joined with EOS after every document (BOS before each when
``tokenize.add_bos``) and cut into blocks of ``seq_len + 1`` tokens (inputs and shifted targets).
The tail that does not fill a block is dropped and counted.

Output per split: ``<split>.tokens.npy`` (n_blocks, seq_len+1), uint16 when the vocabulary fits
else uint32, and ``<split>.docs.npy`` (same shape, uint32): the index of the document each token
came from, so later work can mask attention across documents. ``index.json`` lists them with
token and byte counts (bytes feed bits-per-byte).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.artifacts import write_json_atomic
from pipeline.config import RunConfig, hash_view
from pipeline.stages import shard
from pipeline.stages.tokenizer import MODEL_FILE
from pipeline.text import BOS_ID, EOS_ID, load_sentencepiece

NAME = "tokenize"
VERSION = 1
INPUTS = ("shard", "tokenizer")


def hash_config(cfg: RunConfig) -> dict:
    return {"tokenize": hash_view(cfg.tokenize)}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def pack(docs_ids: list[list[int]], seq_len: int, add_bos: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Concatenate documents (EOS after each, BOS before each if asked) into (n, seq_len+1) blocks.

    Returns:
        (tokens, doc_index, dropped_tail_tokens).
    """
    lengths = [len(d) + 1 + int(add_bos) for d in docs_ids]
    total = sum(lengths)
    stream = np.empty(total, dtype=np.int64)
    doc_of = np.empty(total, dtype=np.uint32)
    pos = 0
    for i, ids in enumerate(docs_ids):
        if add_bos:
            stream[pos] = BOS_ID
            pos += 1
        stream[pos : pos + len(ids)] = ids
        pos += len(ids)
        stream[pos] = EOS_ID
        pos += 1
        doc_of[pos - lengths[i] : pos] = i
    block = seq_len + 1
    n = total // block
    return stream[: n * block].reshape(n, block), doc_of[: n * block].reshape(n, block), total - n * block


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    sp = load_sentencepiece(str(inputs["tokenizer"].path / MODEL_FILE))
    dtype = token_dtype(sp.get_piece_size())
    index = {"seq_len": cfg.tokenize.seq_len, "dtype": dtype.name, "vocab_size": sp.get_piece_size(), "splits": {}}
    for split in shard.SPLITS:
        texts = shard.read_texts(inputs["shard"].path, split)
        ids = sp.encode(texts, num_threads=cfg.tokenizer.num_threads)
        tokens, docs, dropped = pack(ids, cfg.tokenize.seq_len, cfg.tokenize.add_bos)
        if len(tokens) == 0:
            raise ValueError(
                f"tokenize: the {split} split has {sum(map(len, ids))} tokens, fewer than one block of "
                f"tokenize.seq_len+1={cfg.tokenize.seq_len + 1}; add data or lower tokenize.seq_len"
            )
        np.save(out_dir / f"{split}.tokens.npy", tokens.astype(dtype))
        np.save(out_dir / f"{split}.docs.npy", docs)
        index["splits"][split] = {
            "blocks": int(tokens.shape[0]), "tokens": int(tokens.size), "dropped_tail_tokens": int(dropped),
            "documents": len(texts), "bytes": sum(len(t.encode("utf-8")) for t in texts),
            "tokens_in_documents": int(sum(map(len, ids))),
        }
    write_json_atomic(out_dir / "index.json", index)
    tracker.log_metrics({f"tokens_{s}": v["tokens"] for s, v in index["splits"].items()})
    return index

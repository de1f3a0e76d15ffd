"""Join encoded documents into token streams and cut them into fixed-size blocks, one token shard per
document shard, so that every shard can be packed where it is encoded.

The stream of a document is ``[BOS]`` (when asked) + its ids + ``EOS``. Document shard ``k``'s stream
(its documents in order) is cut into blocks of ``seq_len + 1`` tokens (inputs and shifted targets):
token shard ``k``. What is left at its end, shorter than a block, is its *tail*. The tails of all
shards, joined in shard order, form one more stream, cut the same way into the last token shard
(number ``K``, the count of document shards); only that stream's own remainder, shorter than one
block per split, is dropped and counted, as it was when a split was one stream.

Why this order: shard ``k``'s blocks depend on document shard ``k`` alone, and the tail shard on the
tails in shard order, so any number of processes can pack shards independently and the result is
the same files. The global block order is then fixed by the data: the blocks of shard 0, then shard
1, ..., then the tail shard; global block ``g`` is found from the per-shard counts in the index.
Training draws a permutation of ``range(n_blocks)`` seeded by ``(run.seed, epoch)``
(``pipeline.training.loader``): a pure function of the data and the seed, whatever the number of
encoders or of training workers.

Beside every token the shard keeps the index of the document it came from (uint32, counted over the
split in shard order), so later work can mask attention across documents.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.store.contracts import docs_file, tokens_file
from pipeline.tokenization.spm import BOS_ID, EOS_ID


def segment(ids: list[list[int]], add_bos: bool, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The stream of a batch of documents.

    Args:
        ids: each document's token ids.
        add_bos: put BOS before each document.
        dtype: the token dtype of the result.

    Returns:
        (tokens, lengths): the flat stream and each document's length in it (ids + EOS [+ BOS]).
    """
    n_ids = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    extra = 1 + int(add_bos)
    lengths = n_ids + extra
    ends = np.cumsum(lengths)
    starts = ends - lengths
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(n_ids.sum()))
    out = np.full(int(ends[-1]) if len(ids) else 0, EOS_ID, dtype=dtype)
    # id j of document i lands at starts[i] + bos + j: shift each document's ids by its offset.
    first_id = np.cumsum(n_ids) - n_ids
    out[np.arange(len(flat)) + np.repeat(starts + int(add_bos) - first_id, n_ids)] = flat
    if add_bos:
        out[starts] = BOS_ID
    return out, lengths


@dataclass
class PackedShard:
    """One document shard, packed: its whole blocks, its tail and its counts."""

    tokens: np.ndarray  # (n, block) token ids
    docs: np.ndarray  # (n, block) uint32: each token's document index in the split
    tail_tokens: np.ndarray  # the stream's end that does not fill a block (fewer than ``block`` tokens)
    tail_docs: np.ndarray
    documents: int
    stream_tokens: int  # tokens of the shard's whole stream (ids, EOS and BOS)
    n_bytes: int = 0  # UTF-8 bytes of the shard's text


def pack(tokens: np.ndarray, lengths: np.ndarray, block: int, first_doc: int, dtype: np.dtype) -> PackedShard:
    """Cut the stream of consecutive documents into blocks.

    Args:
        tokens: the flat stream (``segment``'s first result, or several joined in order).
        lengths: each document's length in the stream.
        block: tokens per block (``seq_len + 1``).
        first_doc: the split-wide index of the first document.
        dtype: the token dtype of the shard file.
    """
    doc_index = np.repeat(np.arange(first_doc, first_doc + len(lengths), dtype=np.uint32), lengths)
    return _cut(np.ascontiguousarray(tokens, dtype=dtype), doc_index, block, len(lengths))


def _cut(tokens: np.ndarray, doc_index: np.ndarray, block: int, documents: int) -> PackedShard:
    n = len(tokens) // block
    whole = n * block
    return PackedShard(tokens=tokens[:whole].reshape(n, block), docs=doc_index[:whole].reshape(n, block),
                       tail_tokens=tokens[whole:].copy(), tail_docs=doc_index[whole:].copy(),
                       documents=documents, stream_tokens=len(tokens))


@dataclass
class SplitWriter:
    """Writes one split's token shards as they are packed (in any order), then the tail shard.

    Args:
        out_dir: the artifact folder.
        split: the split name, for file names and messages.
        block: tokens per block (``seq_len + 1``).
        dtype: the token dtype (uint16 or uint32).
    """

    out_dir: Path
    split: str
    block: int
    dtype: np.dtype
    shards: dict[int, int] = field(default_factory=dict)  # shard -> blocks written
    tails: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    documents: int = 0
    total: int = 0  # stream tokens of the whole split
    n_bytes: int = 0

    def add(self, k: int, shard: PackedShard) -> None:
        """Write document shard ``k``'s blocks as token shard ``k``; keep its tail for ``finish``."""
        if k in self.shards:
            raise ValueError(f"{self.split} shard {k} added twice")
        self._write(k, shard.tokens, shard.docs)
        self.shards[k] = len(shard.tokens)
        self.tails[k] = (shard.tail_tokens, shard.tail_docs)
        self.documents += shard.documents
        self.total += shard.stream_tokens
        self.n_bytes += shard.n_bytes

    def _write(self, k: int, tokens: np.ndarray, docs: np.ndarray) -> None:
        if len(tokens):  # an empty shard has no file (a zero-row .npy cannot be memory-mapped)
            np.save(Path(self.out_dir) / tokens_file(self.split, k), np.ascontiguousarray(tokens, dtype=self.dtype))
            np.save(Path(self.out_dir) / docs_file(self.split, k), np.ascontiguousarray(docs, dtype=np.uint32))

    def finish(self) -> tuple[list[int], int]:
        """Join the tails in shard order into the last shard.

        Returns:
            (blocks per token shard, in order; the dropped remainder's tokens).

        Raises:
            ValueError: a document shard is missing, or the split has fewer tokens than one block.
        """
        k_tail = len(self.shards)
        if sorted(self.shards) != list(range(k_tail)):
            raise ValueError(f"{self.split}: token shards {sorted(self.shards)} are not 0..{k_tail - 1}")
        order = range(k_tail)
        tail = _cut(np.concatenate([self.tails[k][0] for k in order] or [np.empty(0, self.dtype)]).astype(self.dtype),
                    np.concatenate([self.tails[k][1] for k in order] or [np.empty(0, np.uint32)]),
                    self.block, 0)
        counts = [self.shards[k] for k in order] + [len(tail.tokens)]
        if sum(counts) == 0:
            raise ValueError(
                f"tokenize: the {self.split} split has {self.total} tokens (EOS included), fewer than one "
                f"block of tokenize.seq_len+1={self.block}; add data or lower tokenize.seq_len"
            )
        self._write(k_tail, tail.tokens, tail.docs)
        return counts, len(tail.tail_tokens)

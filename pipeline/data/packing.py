"""Join encoded documents into one token stream and cut it into fixed-size blocks, in bounded memory.

The stream is, per document: ``[BOS]`` (when asked) + its ids + ``EOS``. Blocks are ``seq_len + 1``
tokens (inputs and shifted targets); the tail that does not fill a block is dropped and counted.
Beside every token the writer keeps the index of the document it came from (uint32), so later work
can mask attention across documents.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from pipeline.stage_io import docs_file, tokens_file
from pipeline.text import BOS_ID, EOS_ID

COPY_CHUNK_TOKENS = 1 << 24  # tokens per copy from the temporary stream into the final .npy


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


class BlockWriter:
    """Appends stream pieces to temporary files and turns them into ``<split>.tokens.npy`` and
    ``<split>.docs.npy`` of shape (n_blocks, seq_len + 1) on ``finish``.

    Args:
        out_dir: the artifact folder.
        split: the split name, for file names and messages.
        seq_len: tokens per block minus one.
        dtype: the token dtype (uint16 or uint32).
    """

    def __init__(self, out_dir: Path, split: str, seq_len: int, dtype: np.dtype):
        self.out_dir, self.split, self.block, self.dtype = Path(out_dir), split, seq_len + 1, np.dtype(dtype)
        self._tok_tmp = self.out_dir / f".{split}.tokens.tmp"
        self._doc_tmp = self.out_dir / f".{split}.docs.tmp"
        self._tok_f = open(self._tok_tmp, "wb")
        self._doc_f = open(self._doc_tmp, "wb")
        self.total = 0
        self.documents = 0

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Add the stream of the next ``len(lengths)`` documents (from ``segment``)."""
        doc_index = np.repeat(np.arange(self.documents, self.documents + len(lengths), dtype=np.uint32), lengths)
        self._tok_f.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._doc_f.write(doc_index.tobytes())
        self.total += len(tokens)
        self.documents += len(lengths)

    def finish(self) -> tuple[int, int]:
        """Write the .npy files and remove the temporary ones.

        Returns:
            (n_blocks, dropped_tail_tokens).

        Raises:
            ValueError: fewer tokens than one block.
        """
        self._tok_f.close()
        self._doc_f.close()
        n = self.total // self.block
        if n == 0:
            self._tok_tmp.unlink()
            self._doc_tmp.unlink()
            raise ValueError(
                f"tokenize: the {self.split} split has {self.total} tokens (EOS included), fewer than one "
                f"block of tokenize.seq_len+1={self.block}; add data or lower tokenize.seq_len"
            )
        for tmp, name, dtype in ((self._tok_tmp, tokens_file(self.split), self.dtype),
                                 (self._doc_tmp, docs_file(self.split), np.dtype(np.uint32))):
            src = np.memmap(tmp, dtype=dtype, mode="r", shape=(self.total,))
            dst = np.lib.format.open_memmap(self.out_dir / name, mode="w+", dtype=dtype, shape=(n, self.block))
            flat = dst.reshape(-1)
            for a in range(0, n * self.block, COPY_CHUNK_TOKENS):
                b = min(a + COPY_CHUNK_TOKENS, n * self.block)
                flat[a:b] = src[a:b]
            dst.flush()
            del src, dst, flat
            tmp.unlink()
        return n, self.total - n * self.block

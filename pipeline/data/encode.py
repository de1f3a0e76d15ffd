"""The sentencepiece batch encoder the tokenize stage maps over document shards.

One instance loads the model once and encodes a document shard batch by batch, in the tokenize
stage's Ray task for that shard or in the stage's own process. Either way a batch of documents
becomes the same table, so both engines write the same tokens.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.packing import segment
from pipeline.tokenization.spm import load_sentencepiece


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class SentencePieceEncoder:
    """``pyarrow`` batch with a ``text`` column -> table with one row per document: ``tokens``
    (its stream piece: [BOS] ids EOS, as list<uint16|uint32>) and ``n_bytes`` (UTF-8 bytes of the text),
    plus ``path`` passed through when the batch has it.

    Args:
        model_path: the tokenizer artifact's ``tokenizer.model`` (every worker must see it).
        add_bos: put BOS before each document.
        num_threads: sentencepiece encode threads.
    """

    def __init__(self, model_path: str, add_bos: bool, num_threads: int):
        self.sp = load_sentencepiece(model_path)
        self.add_bos, self.num_threads = add_bos, num_threads
        self.dtype = token_dtype(self.sp.get_piece_size())

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column("text")
        ids = self.sp.encode(texts.to_pylist(), num_threads=self.num_threads)
        flat, lengths = segment(ids, self.add_bos, self.dtype)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))
        out = {"tokens": tokens, "n_bytes": pc.binary_length(texts).cast(pa.int64())}
        if "path" in batch.column_names:  # passed through: which file a row is from, when the reader says
            out["path"] = batch.column("path")
        return pa.table(out)

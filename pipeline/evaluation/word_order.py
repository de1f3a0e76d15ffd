"""Word-order sensitivity: held-out loss on text as written against the same tokens shuffled.

Each sequence's tokens are permuted (inputs and targets together, so the bag of tokens is unchanged)
and the loss is recomputed. A model that uses word order does much worse on the shuffled text; a
model that only learned token frequencies does about as well on both.
"""

from __future__ import annotations

import numpy as np

from pipeline.evaluation.text_metrics import summed_nll


def shuffle_within_rows(blocks: np.ndarray, seed: int) -> np.ndarray:
    """A copy of ``blocks`` (n, L) with each row's tokens in a random order (seeded)."""
    rng = np.random.default_rng(seed)
    return np.stack([row[rng.permutation(len(row))] for row in np.asarray(blocks)])


def word_order_metrics(model, blocks: np.ndarray, batch_size: int, seed: int) -> dict[str, float]:
    """Mean next-token loss on ``blocks`` (n, seq_len+1) as written and shuffled within each row.

    Returns:
        ``word_order_loss`` (as written), ``shuffled_loss`` and their difference ``word_order_gap``.
    """
    blocks = np.asarray(blocks).astype(np.int64)
    if len(blocks) == 0:
        raise ValueError("word-order sensitivity needs at least one block of held-out tokens")
    shuffled = shuffle_within_rows(blocks, seed)
    nll, n = summed_nll(model, blocks[:, :-1], blocks[:, 1:], batch_size)
    nll_s, n_s = summed_nll(model, shuffled[:, :-1], shuffled[:, 1:], batch_size)
    written, scrambled = nll / n, nll_s / n_s
    return {"word_order_loss": written, "shuffled_loss": scrambled, "word_order_gap": scrambled - written}

"""Held-out metrics of an encoder-decoder: the denoising loss and bits per target byte.

Each validation block is span-corrupted with evaluation's fixed noise (``span_corruption.EVAL_SALT``),
so every evaluation of every model of a run scores the same spans. The loss is the mean cross-entropy
over all decoder targets (span tokens, sentinels and the final EOS), the quantity training minimises.

Bits per target byte = total target nats / ln 2 / UTF-8 bytes of the text the spans restore. The bytes
are counted per token from the tokenizer's pieces (``piece_bytes``: a byte piece is one byte, a
control piece none, any other piece its text with sentencepiece's space mark as one space), which is
exact for Conduit's lossless tokenizer but for the one space of each document's dummy prefix. Sentinels and EOS cost bits but restore no byte: the number is
what the model pays per byte of masked-out text, comparable across tokenizers and noise settings only
loosely (a denser noise leaves less context), and not with a decoder's next-token bits per byte.

Shape legend: B blocks, S encoder length, T decoder length, V vocab.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from models.layers.loss import DEFAULT_CHUNK_TOKENS
from pipeline.data.span_corruption import EVAL_SALT, SpanCorruption
from pipeline.evaluation.device import on_model
from pipeline.evaluation import perplexity


def piece_bytes(sp) -> np.ndarray:
    """(V,) UTF-8 bytes each token id stands for in decoded text."""
    out = np.zeros(sp.get_piece_size(), dtype=np.int64)
    for i in range(len(out)):
        if sp.is_byte(i):
            out[i] = 1
        elif not (sp.is_control(i) or sp.is_unknown(i)):
            out[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return out


@torch.no_grad()
def denoising_metrics(model: torch.nn.Module, blocks: np.ndarray, corruption: SpanCorruption, batch_size: int,
                      sp) -> dict[str, float]:
    """Denoising loss, perplexity and bits per target byte of ``model`` on ``blocks`` (n, seq_len + 1).

    Raises:
        ValueError: on an empty set of blocks.
    """
    blocks = np.asarray(blocks).astype(np.int64)
    if len(blocks) == 0:
        raise ValueError("the denoising metrics need at least one block of held-out tokens")
    nbytes = piece_bytes(sp)
    model.eval()
    total, count, target_bytes = 0.0, 0, 0
    for b in range(0, len(blocks), batch_size):
        chunk = torch.from_numpy(blocks[b : b + batch_size])
        enc_BS, dec_in_BT, tgt_BT = corruption.batch(chunk, EVAL_SALT)
        out = model(on_model(model, enc_BS), on_model(model, dec_in_BT), targets_BT=on_model(model, tgt_BT),
                    reduction="sum", chunk_tokens=DEFAULT_CHUNK_TOKENS)
        total += out.loss.item()
        count += tgt_BT.numel()
        for row in chunk.numpy():  # the restored text: the block's noise tokens
            target_bytes += int(nbytes[row[corruption.noise_mask(row, EVAL_SALT)]].sum())
    loss = total / count
    return {
        "val_loss": loss,
        "val_perplexity": perplexity(loss),
        "val_bits_per_target_byte": total / math.log(2) / max(target_bytes, 1),
        "val_targets_evaluated": count,
        "val_target_bytes": target_bytes,
    }

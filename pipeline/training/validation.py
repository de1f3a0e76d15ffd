"""Validation during training (``validation.every``, ``validation.batches``, ``validation.early_stop_patience``).

The subset is fixed: the first ``eval_batches x global_batch_size`` blocks of the validation split,
whatever the number of ranks. Rank ``r`` of ``W`` scores the contiguous ``1/W`` of it at ``r``, in
micro-batches of ``micro_batch_size_per_rank`` (so under ZeRO-3 or expert parallelism every rank runs
the same number of forward passes, which their collectives need); the summed negative
log-likelihood (float64) and the token count are all-reduced, so every rank gets the mean over the
whole subset: the unsmoothed cross-entropy, comparable with the evaluate stage's ``val_loss``.

The pass runs in eval mode without gradients: no parameter, optimizer state or RNG changes, so a
run with validation trains exactly as one without it.

Early stopping: after ``early_stop_patience`` validations in a row without a new best loss, training
stops (a final checkpoint, then the weights as they are). The state is recomputed from the metric
history, which checkpoints carry, so a resumed run stops where an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pipeline.data.span_corruption import EVAL_SALT, SpanCorruption
from pipeline.data.token_blocks import TokenBlocks
from pipeline.training.layout import ParallelDims, check_split  # noqa: F401 - offered here too


def subset_size(eval_batches: int, dims: ParallelDims) -> int:
    """Blocks in the validation subset: ``eval_batches`` global batches."""
    return eval_batches * dims.global_batch_size


def rank_slice(n: int, world: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` blocks (``n`` divides by ``world``)."""
    per = n // world
    return slice(rank * per, (rank + 1) * per)


@torch.no_grad()
def partial_nll(engine, blocks: np.ndarray, micro: int, device: torch.device,
                corruption: SpanCorruption | None = None, loss_chunk_tokens: int = 0,
                positions: slice = slice(None)) -> tuple[float, int]:
    """Summed NLL (nats, accumulated in float64) and target count over ``blocks`` (n, T+1): next-token
    targets, or with ``corruption`` (an encoder-decoder) the decoder targets of each span-corrupted block,
    with evaluation's fixed noise. The model sums each micro-batch's loss itself (its head, chunked by
    ``loss_chunk_tokens`` as in training). ``positions``: a sequence-parallel rank's shard of the inputs
    (and their targets); every position by default."""
    total, count = 0.0, 0
    for b in range(0, len(blocks), micro):
        block = torch.from_numpy(np.asarray(blocks[b : b + micro]).astype(np.int64))
        if corruption is None:
            inputs_BT, targets_BT = block[:, :-1], block[:, 1:]
            inputs, y = (inputs_BT[:, positions].contiguous(),), targets_BT[:, positions].contiguous()
        else:
            enc, dec_in, y = corruption.batch(block, EVAL_SALT)
            inputs = (enc, dec_in)
        out = engine(*(x.to(device) for x in inputs), targets_BT=y.to(device), reduction="sum",
                     chunk_tokens=loss_chunk_tokens)
        total += out.loss.double().item()
        count += y.numel()
    return total, count


def validation_loss(engine, blocks: TokenBlocks | np.ndarray, dims: ParallelDims, rank: int, eval_batches: int,
                    device: torch.device, all_reduce: Callable[[torch.Tensor], None] | None,
                    corruption: SpanCorruption | None = None, loss_chunk_tokens: int = 0) -> float:
    """The mean validation loss over the subset, the same on every rank.

    Args:
        blocks: the validation split's blocks; each rank reads only its slice of the subset.
        all_reduce: sums a float64 tensor over the ranks in place (``torch.distributed.all_reduce``);
            None in a single process.
        corruption: the span corruption of an encoder-decoder run, else None.
        loss_chunk_tokens: train.loss_chunk_tokens (the same loss to float rounding, whatever its value).
    """
    n = subset_size(eval_batches, dims)
    rows = np.arange(n)[rank_slice(n, dims.dp_size, dims.dp_rank(rank))]
    mine = blocks.take(rows) if isinstance(blocks, TokenBlocks) else blocks[rows]
    width = dims.seq_len // dims.sp_size  # a sequence-parallel rank's positions of each block
    positions = slice(dims.sp_rank(rank) * width, (dims.sp_rank(rank) + 1) * width)
    was_training = engine.training
    engine.eval()
    try:
        total, count = partial_nll(engine, mine, dims.micro_batch_size_per_rank, device, corruption,
                                   loss_chunk_tokens, positions)
    finally:
        engine.train(was_training)
    sums = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
    if all_reduce is not None:
        all_reduce(sums)
    return (sums[0] / sums[1]).item()


def stop_early(val_losses: list[float], patience: int) -> bool:
    """True when the last ``patience`` losses all failed to beat the best one before them."""
    if patience <= 0 or len(val_losses) <= patience:
        return False
    best_before = min(val_losses[:-patience])
    return all(v >= best_before for v in val_losses[-patience:])

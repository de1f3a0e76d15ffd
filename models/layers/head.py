"""The LM head: hidden states to logits, or straight to the loss.

Shape legend: B batch, T time, D d_model, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.loss import linear_cross_entropy


class LMHead(nn.Linear):
    """``nn.Linear(d_model, vocab, bias=False)`` (the same ``lm_head.weight``, tied or not) whose forward
    also takes the targets and then returns the loss instead of the logits.

    The loss is computed here, inside the head's own forward, so that whatever wraps module forwards
    sees the head's weight used: ZeRO-3 gathers a partitioned weight in its forward hooks, and a
    compiled model traces the head and the loss into the same graph as the blocks.
    """

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__(d_model, vocab_size, bias=False)

    def forward(self, x_BTD: torch.Tensor, targets_BT: torch.Tensor | None = None, *,
                label_smoothing: float = 0.0, chunk_tokens: int = 0, reduction: str = "mean",
                ignore_index: int = -100) -> torch.Tensor:
        """Logits (B, T, V) when ``targets_BT`` is None; else the scalar loss of
        ``models.layers.loss.linear_cross_entropy`` (``chunk_tokens`` > 0: never holding the whole logits)."""
        if targets_BT is None:
            return F.linear(x_BTD, self.weight)
        return linear_cross_entropy(x_BTD, self.weight, targets_BT, label_smoothing, ignore_index, chunk_tokens,
                                    reduction)


def head_output(lm_head: LMHead, x_BTD: torch.Tensor, targets_BT: torch.Tensor | None,
                loss_options: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, None) without targets, (None, loss) with them: what every family's forward returns."""
    if targets_BT is None:
        if loss_options:
            raise ValueError(f"loss options {sorted(loss_options)} given without targets_BT")
        return lm_head(x_BTD), None
    return None, lm_head(x_BTD, targets_BT, **loss_options)

"""Language-model loss.

Shape legend: B batch, T time, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean token cross-entropy with optional label smoothing (Szegedy et al. 2016).

    For each counted token the target distribution is y * (1 - eps) + eps / V (y one-hot), so the
    per-token loss is (1 - eps) * (-log p_target) + eps * mean_v(-log p_v). The loss is averaged over
    the tokens whose target is not `ignore_index`. Computed in fp32 whatever the logits' dtype.
    Targets are not shifted here: targets_BT[b, t] is the token that should follow position t.

    Args:
        logits_BTV: model logits.
        targets_BT: target ids, `ignore_index` where no loss is wanted (e.g. padding).
        label_smoothing: eps in [0, 1).
        ignore_index: target value to skip.

    Returns:
        Scalar loss (NaN if every target is ignored, as in torch's cross_entropy).

    Raises:
        ValueError: on mismatched shapes or a label_smoothing outside [0, 1).
    """
    if logits_BTV.shape[:-1] != targets_BT.shape:
        raise ValueError(f"logits {tuple(logits_BTV.shape)} and targets {tuple(targets_BT.shape)} do not match")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    V = logits_BTV.shape[-1]
    return F.cross_entropy(
        logits_BTV.reshape(-1, V).float(),
        targets_BT.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction="mean",
    )

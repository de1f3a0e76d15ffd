"""Language-model loss: from logits (``lm_loss``), or from the hidden states and the head's weight a
chunk of tokens at a time (``linear_cross_entropy``), never holding the whole logits.

Shape legend: B batch, T time, V vocab, D model width, N tokens (B*T), C tokens of one chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The default chunk (train.loss_chunk_tokens's and evaluation's), offered with the loss its callers pass it to;
# it lives in models.config, which the run config reads without torch.
from models.config import DEFAULT_CHUNK_TOKENS

__all__ = ["DEFAULT_CHUNK_TOKENS", "linear_cross_entropy", "lm_loss"]


def lm_loss(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean (or, with reduction "sum", summed) token cross-entropy with optional label smoothing (Szegedy et al. 2016).

    For each counted token the target distribution is y * (1 - eps) + eps / V (y one-hot), so the
    per-token loss is (1 - eps) * (-log p_target) + eps * mean_v(-log p_v). The loss is averaged over
    the tokens whose target is not `ignore_index`. Computed in fp32 whatever the logits' dtype.
    Targets are not shifted here: targets_BT[b, t] is the token that should follow position t.

    Args:
        logits_BTV: model logits.
        targets_BT: target ids, `ignore_index` where no loss is wanted (e.g. padding).
        label_smoothing: eps in [0, 1).
        ignore_index: target value to skip.
        reduction: "mean" over the counted tokens, or "sum".

    Returns:
        Scalar loss (with "mean", NaN if every target is ignored, as in torch's cross_entropy).

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
        reduction=reduction,
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of ``hidden @ weight.T`` computed ``chunk`` rows at a time; see ``linear_cross_entropy``.

    With grad wanted, the forward also computes both gradients chunk by chunk (as Liger Kernel's fused
    linear cross-entropy does): a chunk's logits become, in their own memory, exp(z - max), then the
    softmax minus the smoothed one-hot target, scaled by the reduction; that (C, V) gradient gives the
    chunk's rows of d hidden and adds its share of d weight. So one chunk's logits are the only (C, V)
    buffer there is, the matmuls are the plain path's three (forward, and the two of its backward),
    and backward only scales the stored gradients by the incoming one.
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, eps, ignore_index, chunk, reduction):
        N, V = hidden_ND.shape[0], weight_VD.shape[0]
        valid_N = targets_N != ignore_index
        safe_N = torch.where(valid_N, targets_N, torch.zeros_like(targets_N))
        scale = valid_N.sum().float() if reduction == "mean" else torch.ones((), device=hidden_ND.device)
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        grad_h_ND = torch.empty_like(hidden_ND) if want_grad else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device) if want_grad else None
        plain_matmuls = not torch.is_autocast_enabled(hidden_ND.device.type) and hidden_ND.dtype == torch.float32
        for start in range(0, N, chunk):
            h_CD = hidden_ND[start : start + chunk]
            t_C, valid_C = safe_N[start : start + chunk], valid_N[start : start + chunk]
            z_CV = (h_CD @ weight_VD.T).float()
            z_target_C = z_CV.gather(1, t_C[:, None]).squeeze(1)
            z_mean_C = z_CV.mean(dim=-1) if eps else None
            max_C1 = z_CV.amax(dim=-1, keepdim=True)
            e_CV = z_CV.sub_(max_C1).exp_()  # in place: the logits are not needed again
            sum_C = e_CV.sum(dim=-1)
            lse_C = sum_C.log() + max_C1.squeeze(1)
            per_C = lse_C - z_target_C
            if eps:
                per_C = (1 - eps) * per_C + eps * (lse_C - z_mean_C)
            total = total + torch.where(valid_C, per_C, torch.zeros_like(per_C)).sum()
            if not want_grad:
                continue
            row_C = valid_C.float() / scale  # each counted token's share of the reduced loss; 0 if ignored
            g_CV = e_CV.mul_((row_C / sum_C)[:, None])  # softmax x row share
            g_CV.scatter_add_(1, t_C[:, None], (-(1 - eps) * row_C)[:, None])
            if eps:
                g_CV.sub_((eps / V) * row_C[:, None])
            g_CV = g_CV.to(weight_VD.dtype)  # under autocast the matmuls below cast as the plain backward's do
            grad_h_ND[start : start + chunk] = (g_CV @ weight_VD).to(hidden_ND.dtype)
            if plain_matmuls:
                grad_w_VD.addmm_(g_CV.T, h_CD)
            else:
                grad_w_VD += (g_CV.T @ h_CD).float()
        if want_grad:
            ctx.save_for_backward(grad_h_ND, grad_w_VD.to(weight_VD.dtype))
        return total / scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        return grad_h_ND * grad_out, grad_w_VD * grad_out, None, None, None, None, None


def linear_cross_entropy(
    hidden_BTD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_BT: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    chunk_tokens: int = 0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``lm_loss(hidden_BTD @ weight_VD.T, targets_BT)`` without ever holding the whole logits.

    The tokens are taken ``chunk_tokens`` at a time: each chunk's logits (chunk x V floats) are made,
    reduced to its loss (and, when grad is wanted, to its rows of the hidden states' gradient and its
    share of the weight's), and dropped. The plain path holds B*T*V logits in the compute dtype, their
    fp32 copy and their gradient; this holds one chunk's. The same math as ``lm_loss``, to float
    rounding (sums are taken in another order).

    Args:
        hidden_BTD: the final hidden states (after the final norm).
        weight_VD: the LM head's weight (tied or not; gradients reach it either way).
        targets_BT: target ids, ``ignore_index`` where no loss is wanted.
        label_smoothing: eps in [0, 1), as ``lm_loss``.
        ignore_index: target value to skip.
        chunk_tokens: tokens per chunk; 0 = all at once (the plain path: logits, then ``lm_loss``).
        reduction: "mean" over the counted tokens, or "sum".

    Returns:
        Scalar loss (fp32).

    Raises:
        ValueError: on mismatched shapes, a label_smoothing outside [0, 1), a negative chunk_tokens or
            an unknown reduction.
    """
    if hidden_BTD.shape[:-1] != targets_BT.shape or hidden_BTD.shape[-1] != weight_VD.shape[1]:
        raise ValueError(f"hidden {tuple(hidden_BTD.shape)}, weight {tuple(weight_VD.shape)} and targets "
                         f"{tuple(targets_BT.shape)} do not match")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (0 = no chunking), got {chunk_tokens}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_tokens == 0:
        return lm_loss(hidden_BTD @ weight_VD.T, targets_BT, label_smoothing, ignore_index, reduction)
    D = hidden_BTD.shape[-1]
    return _LinearCrossEntropy.apply(hidden_BTD.reshape(-1, D), weight_VD, targets_BT.reshape(-1),
                                     float(label_smoothing), ignore_index, chunk_tokens, reduction)

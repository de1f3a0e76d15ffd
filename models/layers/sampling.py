"""Picking the next token from last-position logits: greedy, temperature, top-k and top-p (nucleus).

Shared by every family's generation (`models.generate`, the encoder-decoder's own loop) and by the
inference engine. Shape legend: B batch, V vocab.
"""

from __future__ import annotations

import torch


def _filter_logits(logits_BV: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus (Holtzman et al. 2020)."""
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass strictly before
        # it already reaches top_p. The most likely token is always kept.
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from last-position logits.

    Args:
        logits_BV: logits of the next token.
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling.
        top_k: keep only the k most likely tokens.
        top_p: keep only the smallest set of most likely tokens with total probability >= top_p.
        generator: RNG for sampling.

    Returns:
        (B,) long token ids.
    """
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = _filter_logits(logits_BV.float() / temperature, top_k, top_p)
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)

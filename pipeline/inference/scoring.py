"""Each token's log-probability under a causal model, and the most likely tokens at its position: what
the completions API's ``logprobs`` and ``echo`` answer (``pipeline.serving.app``).

One forward pass over the whole sequence (prompt and completion), log-softmax in float32: position t's
distribution is the model's over token t given tokens before it, so token t's log-probability is
exactly what the model assigns it there, and the top-k come from the same row (a greedy token's value
equals the first top entry, as harnesses compare them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from models.families import family


@dataclass(frozen=True)
class TokenScores:
    """For tokens 1..L-1 of a sequence: ``logprobs[t-1]`` = log p(ids[t] | ids[:t]), and ``top[t-1]`` the
    ``k`` most likely (id, log-probability) pairs at that position, most likely first."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def can_score(model: torch.nn.Module) -> bool:
    """Whether ``model`` scores one causal stream (not an encoder-decoder, whose target needs a source)."""
    return not family(model.cfg).seq2seq


@torch.no_grad()
def score_tokens(model: torch.nn.Module, ids: Sequence[int], k: int) -> TokenScores:
    """Log-probabilities of ``ids[1:]`` and the top ``k`` at each of their positions (see the module docstring).

    Raises:
        ValueError: fewer than two ids, or a model that cannot score a causal stream.
    """
    if not can_score(model):
        raise ValueError(f"{family(model.cfg).title} models cannot score token log-probabilities")
    if len(ids) < 2:
        raise ValueError("scoring needs at least two tokens (the first has no context)")
    device = next(model.parameters()).device
    x_1T = torch.tensor([list(ids)], dtype=torch.long, device=device)
    logp_TV = torch.log_softmax(model(x_1T[:, :-1]).logits[0].float(), dim=-1)
    chosen = logp_TV.gather(1, x_1T[0, 1:, None])[:, 0].tolist()
    if k == 0:
        return TokenScores(chosen, [[] for _ in chosen])
    values, indices = logp_TV.topk(k, dim=-1)
    top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return TokenScores(chosen, top)

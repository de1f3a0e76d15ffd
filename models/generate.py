"""Autoregressive sampling with the KV cache.

Length limit: every position encoding is limited to `max_seq_len` tokens in total (prompt plus new),
and a request that could exceed it raises ValueError up front, rather than sliding a window. Learned
and sinusoidal tables end there; RoPE and ALiBi could extrapolate but were never trained beyond it.

Shape legend: B batch, T prompt time, V vocab.
"""

from __future__ import annotations

import torch

from models.families.decoder.model import Transformer
from models.layers.attention import KVCache
from models.layers.sampling import sample_next

__all__ = ["KVCache", "generate", "sample_next"]


@torch.no_grad()
def generate(
    model: Transformer,
    input_ids_BT: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Extend each prompt by up to `max_new_tokens` tokens.

    The prompt is run once to fill a KV cache, then one token per step. Once a row has produced
    `eos_id`, it keeps emitting `eos_id` (as padding) while other rows continue; generation stops
    when every row has finished or the budget is spent. The model runs in eval mode (dropout off)
    and its previous mode is restored afterwards.

    Args:
        model: the Transformer.
        input_ids_BT: prompts, (B, T) with T >= 1. Left-pad prompts of different lengths and pass
            `attention_mask_BT`.
        max_new_tokens: budget of new tokens per row (>= 0).
        temperature: 0 = greedy, else sampling temperature (> 0).
        top_k: restrict sampling to the k most likely tokens (>= 1).
        top_p: nucleus sampling threshold in (0, 1].
        eos_id: token that ends a row.
        generator: RNG for sampling (reproducible generation).
        attention_mask_BT: 1 = real prompt token, 0 = pad; None = all real.

    Returns:
        (B, T + n) long tensor, prompt followed by n <= max_new_tokens generated tokens.

    Raises:
        ValueError: on bad sampling arguments or when T + max_new_tokens > max_seq_len.
    """
    if input_ids_BT.dim() != 2 or input_ids_BT.shape[1] < 1:
        raise ValueError(f"input_ids_BT must be (B, T) with T >= 1, got {tuple(input_ids_BT.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be None or >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p}")
    B, T = input_ids_BT.shape
    max_len = model.cfg.max_seq_len
    if T + max_new_tokens > max_len:
        raise ValueError(
            f"prompt length {T} + max_new_tokens {max_new_tokens} exceeds max_seq_len {max_len}"
        )
    if max_new_tokens == 0:
        return input_ids_BT.clone()

    was_training = model.training
    model.eval()
    try:
        cache = model.new_kv_cache(B, max_len=T + max_new_tokens)
        out = model(input_ids_BT, attention_mask_BT=attention_mask_BT, kv_cache=cache)
        tokens = [input_ids_BT]
        finished_B = torch.zeros(B, dtype=torch.bool, device=input_ids_BT.device)
        for step in range(max_new_tokens):
            next_B = sample_next(out.logits[:, -1, :], temperature, top_k, top_p, generator)
            if eos_id is not None:
                next_B = torch.where(finished_B, torch.full_like(next_B, eos_id), next_B)
                finished_B = finished_B | (next_B == eos_id)
            tokens.append(next_B.unsqueeze(1))
            if (eos_id is not None and bool(finished_B.all())) or step == max_new_tokens - 1:
                break
            out = model(next_B.unsqueeze(1), kv_cache=cache)
    finally:
        # Restoring the caller's mode is cleanup, not error handling: exceptions still propagate.
        model.train(was_training)
    return torch.cat(tokens, dim=1)

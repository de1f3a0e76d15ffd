"""A generation request and what every batching path does with one: the ground floor of inference.

``GenRequest`` is one row (prompt ids, budget, sampling, seed); ``check_fits`` refuses a row that does
not fit the model's context; ``pad_left`` makes rows one left-padded batch; ``fill_spans`` answers an
encoder-decoder's row alone. The engine (``pipeline.inference.engine``) and ``generate_batch``
(``pipeline.inference.batched``) build on this module, which imports neither.

Shape legend: B batch rows, T padded prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GenRequest:
    """One row of a batch: prompt token ids (non-empty) and how to extend them.

    Attributes:
        prompt_ids: the prompt, already tokenized (with its leading EOS/BOS, as the caller wants).
        max_new_tokens: the row's budget (>= 1).
        temperature: 0 = greedy.
        top_p: nucleus threshold in (0, 1]; 1 = off.
        seed: seeds the row's own generator (same seed, same sample).
        logprobs: None, or k: the engine (``pipeline.inference.engine``) records each new token's
            log-probability and the k most likely tokens at its position, from the logits it samples
            from (the model's own, before temperature and top-p).
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    logprobs: int | None = None


def check_fits(request: GenRequest, max_seq_len: int) -> None:
    """Raise ValueError unless the prompt plus its budget fit the model's context.

    Raises:
        ValueError: an empty prompt, a budget below 1, or prompt + budget > ``max_seq_len``.
    """
    if not request.prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if request.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {request.max_new_tokens}")
    if len(request.prompt_ids) + request.max_new_tokens > max_seq_len:
        raise ValueError(f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens {request.max_new_tokens} "
                         f"exceeds the model's context of {max_seq_len} tokens")


def fill_spans(model: torch.nn.Module, r: GenRequest, eos_id: int) -> list[int]:
    """An encoder-decoder's answer to one request: the decoder's tokens up to EOS or the budget."""
    from models.families.encdec.model import generate_encdec
    from pipeline.data.span_corruption import DECODER_START_ID

    device = model.tok_embeddings.weight.device
    new_BT = generate_encdec(
        model, torch.tensor([r.prompt_ids], dtype=torch.long, device=device), decoder_start_id=DECODER_START_ID,
        max_new_tokens=r.max_new_tokens, eos_id=eos_id, temperature=r.temperature,
        top_p=None if r.top_p >= 1.0 else r.top_p,
        generator=torch.Generator(device=device).manual_seed(r.seed))
    out = new_BT[0].tolist()
    return out[: out.index(eos_id)] if eos_id in out else out


def pad_left(requests: list[GenRequest], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' prompts as one left-padded batch: (ids, attention mask), each (B, T) on `device`."""
    T = max(len(r.prompt_ids) for r in requests)
    ids_BT = torch.zeros(len(requests), T, dtype=torch.long)
    mask_BT = torch.zeros(len(requests), T, dtype=torch.long)
    for i, r in enumerate(requests):
        ids_BT[i, T - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask_BT[i, T - len(r.prompt_ids):] = 1
    return ids_BT.to(device), mask_BT.to(device)


__all__ = ["GenRequest", "check_fits", "fill_spans", "pad_left"]

"""Generate for many requests at once: one left-padded batch through the KV-cached model.

Each request keeps its own budget, temperature, top-p and seed, and its output equals the output it
would get alone (greedy exactly; sampled too, up to floating-point noise, since every row samples from
its own seeded generator). Two things make that true:

- prompts are left-padded and the pads masked (``attention_mask_BT``); the model counts positions from
  each row's first real token, so a padded prompt decodes like the unpadded one;
- a row that has finished (end of text, or its own budget spent) leaves the batch, and the cache keeps
  only the rows that go on (``pipeline.inference.engine``, which also lets rows join a running batch).

A Mamba model has no positions: it zeroes masked inputs, so pads before a prompt leave its state as
without them.

An encoder-decoder's requests (text with sentinels; the answer is the spans that fill them) run one
row at a time through ``models.families.encdec.model.generate_encdec`` (the encoder once, a KV-cached decoder), each
from its own seeded generator: the same output as alone, without the batching speed-up.

The KV cache's slots may outnumber ``max_seq_len`` (a long prompt in one row, a long budget in
another); every row's own positions stay below it (``check_fits``).

Shape legend: B batch rows, T padded prompt length, V vocab.
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


def _fill_spans(model: torch.nn.Module, r: GenRequest, eos_id: int) -> list[int]:
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


def _pad_left(requests: list[GenRequest], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r.prompt_ids) for r in requests)
    ids_BT = torch.zeros(len(requests), T, dtype=torch.long)
    mask_BT = torch.zeros(len(requests), T, dtype=torch.long)
    for i, r in enumerate(requests):
        ids_BT[i, T - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask_BT[i, T - len(r.prompt_ids):] = 1
    return ids_BT.to(device), mask_BT.to(device)


def generate_batch(model: torch.nn.Module, requests: list[GenRequest], eos_id: int) -> list[list[int]]:
    """Extend every request's prompt in one batch (``pipeline.inference.engine.Engine``, all rows
    admitted at its first step; a row leaves the batch when it ends).

    Args:
        model: a ``models.Transformer`` (or another family's model) in eval mode.
        requests: the rows; each must pass ``check_fits`` for the model's ``max_seq_len``.
        eos_id: the token that ends a row (it is not included in the output).

    Returns:
        Per request, the new token ids (at most its ``max_new_tokens``, without the EOS).

    Raises:
        ValueError: a request that does not fit (``check_fits``) or an empty batch.
        Exception: what the model raised (the first failing row's error).
    """
    from pipeline.inference.engine import FINISH_ERROR, Engine  # the engine builds on this module

    if not requests:
        raise ValueError("generate_batch needs at least one request")
    for r in requests:
        check_fits(r, model.cfg.max_seq_len)
    engine = Engine(model, eos_id, max_rows=len(requests))
    tickets = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    for t in tickets:
        if t.finish == FINISH_ERROR:
            raise t.error
    return [t.tokens for t in tickets]

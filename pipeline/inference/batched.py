"""Generate for many requests at once: one left-padded batch through the KV-cached model.

Each request keeps its own budget, temperature, top-p and seed, and its output equals the output it
would get alone (greedy exactly; sampled too, up to floating-point noise, since every row samples from
its own seeded generator). Two things make that true:

- prompts are left-padded and the pads masked (``attention_mask_BT``); the model counts positions from
  each row's first real token, so a padded prompt decodes like the unpadded one;
- a row that has finished (end of text, or its own budget spent) is fed as a pad from then on, so
  its position counter stops and the other rows carry on unaffected.

A Mamba model has no positions: it zeroes masked inputs, so pads before a prompt leave its state as
without them, and a finished row's state no longer matters.

An encoder-decoder's requests (text with sentinels; the answer is the spans that fill them) run one
row at a time through ``models.encdec.generate_encdec`` (the encoder once, a KV-cached decoder), each
from its own seeded generator: the same output as alone, without the batching speed-up.

The KV cache is sized for the batch (longest prompt + largest budget), which may exceed
``max_seq_len`` in slots; every row's own positions stay below it (``check_fits``).

Shape legend: B batch rows, T padded prompt length, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.generate import sample_next
from models.families import family


@dataclass(frozen=True)
class GenRequest:
    """One row of a batch: prompt token ids (non-empty) and how to extend them.

    Attributes:
        prompt_ids: the prompt, already tokenized (with its leading EOS/BOS, as the caller wants).
        max_new_tokens: the row's budget (>= 1).
        temperature: 0 = greedy.
        top_p: nucleus threshold in (0, 1]; 1 = off.
        seed: seeds the row's own generator (same seed, same sample).
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


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
    from models.encdec import generate_encdec
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


@torch.no_grad()
def generate_batch(model: torch.nn.Module, requests: list[GenRequest], eos_id: int) -> list[list[int]]:
    """Extend every request's prompt in one batch.

    Args:
        model: a ``models.Transformer`` in eval mode.
        requests: the rows; each must pass ``check_fits`` for the model's ``max_seq_len``.
        eos_id: the token that ends a row (it is not included in the output).

    Returns:
        Per request, the new token ids (at most its ``max_new_tokens``, without the EOS).

    Raises:
        ValueError: a request that does not fit (``check_fits``) or an empty batch.
    """
    if not requests:
        raise ValueError("generate_batch needs at least one request")
    cfg = model.cfg
    for r in requests:
        check_fits(r, cfg.max_seq_len)
    if family(cfg).seq2seq:
        return [_fill_spans(model, r, eos_id) for r in requests]
    p = model.tok_embeddings.weight
    ids_BT, mask_BT = _pad_left(requests, p.device)
    B, T = ids_BT.shape
    budgets = [r.max_new_tokens for r in requests]
    cache = model.new_kv_cache(B, max_len=T + max(budgets))  # a KVCache, or a Mamba model's state
    gens = [torch.Generator(device="cpu").manual_seed(r.seed) for r in requests]
    out: list[list[int]] = [[] for _ in requests]
    active = [True] * B
    logits_BV = model(ids_BT, attention_mask_BT=mask_BT, kv_cache=cache).logits[:, -1, :]
    while True:
        next_B = torch.zeros(B, dtype=torch.long)  # finished rows feed token 0, masked as a pad
        logits_BV = logits_BV.float().cpu()
        greedy_B = logits_BV.argmax(dim=-1).tolist()  # one op for every greedy row
        for i, r in enumerate(requests):
            if not active[i]:
                continue
            # Sampled rows draw one at a time, each from its own generator (batch-independent output).
            tok = greedy_B[i] if r.temperature == 0 else int(sample_next(
                logits_BV[i:i + 1], r.temperature, top_p=None if r.top_p >= 1.0 else r.top_p, generator=gens[i])[0])
            if tok == eos_id:
                active[i] = False
                continue
            out[i].append(tok)
            next_B[i] = tok
            if len(out[i]) >= budgets[i]:
                active[i] = False
        if not any(active):
            return out
        # Finished rows are fed as pads: masked as keys, and their positions stop advancing.
        step_mask_B1 = torch.tensor(active, dtype=torch.long).unsqueeze(1).to(p.device)
        logits_BV = model(next_B.unsqueeze(1).to(p.device), attention_mask_BT=step_mask_B1,
                          kv_cache=cache).logits[:, -1, :]

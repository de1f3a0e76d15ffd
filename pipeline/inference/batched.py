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

The request record and the helpers every path shares live in ``pipeline.inference.requests``, which
the engine builds on; this module builds on the engine.

Shape legend: B batch rows, T padded prompt length, V vocab.
"""

from __future__ import annotations

import torch

from pipeline.inference.engine import FINISH_ERROR, Engine
from pipeline.inference.requests import GenRequest, check_fits



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

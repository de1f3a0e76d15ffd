"""Activation checkpointing recomputes; it must not change a single gradient."""

from __future__ import annotations

import torch

from models import build_model
from models.layers.loss import lm_loss
from pipeline.training.parallelize import apply_activation_checkpointing


def grads(model_name: str, checkpointed: bool) -> tuple[float, dict]:
    torch.manual_seed(0)
    pattern = {"hybrid_layers": "MAM"} if "hybrid" in model_name else {}
    model = build_model(model_name, n_layers=3, max_seq_len=32, **pattern)
    if checkpointed:
        apply_activation_checkpointing(model)
    x = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    out = model(x[:, :-1])
    loss = lm_loss(out.logits, x[:, 1:]) + out.aux_loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_gives_identical_gradients_dense_moe_and_mamba():
    for name in ("debug_dense", "debug_moe", "debug_mamba", "debug_mamba2", "debug_hybrid"):
        loss_a, a = grads(name, False)
        loss_b, b = grads(name, True)
        assert loss_a == loss_b
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_checkpointed_blocks_really_recompute():
    torch.manual_seed(0)
    model = build_model("debug_dense", n_layers=2)
    apply_activation_checkpointing(model)
    calls = []
    attn = model.layers[0].attn
    attn.register_forward_hook(lambda *a: calls.append(1))
    x = torch.randint(0, 512, (1, 9))
    lm_loss(model(x[:, :-1]).logits, x[:, 1:]).backward()
    assert len(calls) == 2  # once forward, once again during backward
    with torch.no_grad():
        model(x)
    assert len(calls) == 3  # no recomputation machinery without grad


def test_both_stacks_of_an_encoder_decoder_are_checkpointed_and_give_identical_gradients():
    """The encoder's blocks recompute too (they were once left out: every encoder activation was kept), and the
    gradients are the unwrapped model's exactly."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build_model("encdec", n_layers=2, n_encoder_layers=2, max_seq_len=32)
        if checkpointed:
            apply_activation_checkpointing(model)
        calls = []
        for block in (model.encoder_layers[0], model.encoder_layers[1], model.layers[1]):
            block.attn.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        src = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        tgt = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
        out = model(src, tgt[:, :-1], targets_BT=tgt[:, 1:])
        out.loss.backward()
        assert len(calls) == (6 if checkpointed else 3)  # each block's attention again during backward
        results.append((out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, a), (loss_b, b) = results
    assert loss_a == loss_b and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

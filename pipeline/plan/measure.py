"""Measure, on this machine's CPU, the live tensor bytes of one training micro-step (forward, loss,
backward) of a model: what the planner's activation and peak terms are checked against.

A ``TorchDispatchMode`` sees every tensor an operator returns, forward and backward (autograd's
backward runs below the dispatcher too). Each new storage is counted when it first appears and
uncounted when Python's weak reference to it fires (the storage was freed). What existed before the
step (the weights, the input ids) is not counted, so the window's numbers are what the step adds:
the saved activations at the end of forward, and the peak of activations, gradients and
temporaries over the whole step. Workspace an operator allocates and frees inside itself is not seen.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models import build_model
from models.config import ModelConfig
from models.families import family


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside it and still alive (``current``), and their
    high-water mark (``peak``)."""

    def __init__(self, existing: list[torch.Tensor] = ()) -> None:
        super().__init__()
        # Storages that exist already (the weights): a view of one (a weight's transpose) is not new memory.
        self._sizes: dict[int, int] = {t.untyped_storage().data_ptr(): 0 for t in existing}
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self._sizes:
                continue  # a view or an in-place result: storage already counted
            self._sizes[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)
        return out


@dataclass(frozen=True)
class StepBytes:
    """One measured micro-step.

    Attributes:
        params: bytes of the model's parameters (there before the step).
        after_forward: live bytes the step holds when the loss is computed (the saved activations).
        peak: the most live bytes at any moment of forward and backward (activations, gradients,
            temporaries), weights not included.
    """

    params: int
    after_forward: int
    peak: int


def measure_step(cfg: ModelConfig, batch: int, seq_len: int, *, checkpointing: bool, chunk_tokens: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> StepBytes:
    """Build ``cfg`` on the CPU and measure one forward + loss + backward at ``batch`` x ``seq_len``.

    Args:
        checkpointing: recompute each block in backward (``pipeline.training.parallelize``'s wrapping).
        chunk_tokens: the loss's chunk (0: the whole logits at once).
        dtype: the weights' and so the activations' dtype (bfloat16: DeepSpeed's bf16 runs the model in it).
    """
    from pipeline.training.parallelize import apply_activation_checkpointing

    torch.manual_seed(seed)
    model = build_model(cfg).to(dtype)
    if checkpointing:
        apply_activation_checkpointing(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    # An encoder-decoder reads a source as long as the target (what its activation count assumes).
    args = (inputs, inputs) if family(cfg).seq2seq else (inputs,)
    with LiveBytes(list(model.parameters()) + list(model.buffers())) as live:
        out = model(*args, targets_BT=targets, chunk_tokens=chunk_tokens)
        loss = out.loss + out.aux_loss
        after_forward = live.current
        loss.backward()
        peak = live.peak
    return StepBytes(params=params, after_forward=after_forward, peak=peak)

"""Activation memory of one training micro-step on one rank: what the forward keeps, the loss's buffers
and the peak over the backward, from the families' own counts (`models.accounting.activations`).

The backward is walked layer by layer, from the last: while layer i's backward runs, a rank holds the
stem and what layers below i keep, layer i's whole activations (recomputed first under activation
checkpointing), the gradient flowing down (N x D) and the widest tensor its backward makes, and, when
gradients are allocated as they arrive (a plain torch step; DeepSpeed's are in the model states
already), the gradients of the layers done. The loss starts the backward holding everything the
forward kept plus the hidden states' gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.accounting import activations as family_activations
from pipeline.plan.memory import ModelShape, Setup


@dataclass(frozen=True)
class ActivationPlan:
    """Bytes of one rank's micro-step beyond the model states.

    Attributes:
        layers: what the stem and the layers keep at the end of the forward.
        output: what the output end keeps (the final norm, the loss's saved tensors).
        loss_buffer: the logits the loss holds while it runs (two chunks', or all of them).
        peak: the most live bytes over forward and backward.
    """

    layers: int
    output: int
    loss_buffer: int
    peak: int

    @property
    def kept(self) -> int:
        """All the forward keeps for backward."""
        return self.layers + self.output


def _output_end(setup: Setup) -> tuple[int, int, int]:
    """(kept, loss buffer, head gradient) bytes of the final norm, the head and the loss."""
    cfg, N, b, w = setup.model, setup.tokens, setup.activation_bytes, setup.weight_bytes
    D, V = cfg.d_model, cfg.vocab_size
    # The final norm's input (in fp32: the last residual, or its fp32 copy) and rsqrt, and x * rsqrt; the
    # product with its weight goes to the loss, which keeps gradients instead of it.
    norm = N * (4 * (D + 1) + b * D) if cfg.norm == "rmsnorm" else N * (b * 2 * D + 8)
    if setup.chunk_tokens:
        chunk = min(setup.chunk_tokens, N)
        kept = norm + N * D * b + V * D * w  # the chunked loss computes both gradients in its forward
        # A chunk's fp32 logits (turned into its gradient in place) live until the next chunk's are made:
        # two chunks at once, each with a 16-bit copy for the matmuls in 16-bit, which also sums the head's
        # gradient in fp32 before casting it.
        live = 2 if N > chunk else 1
        buffer = live * chunk * V * 4 + (live * chunk * V * w + V * D * 4 if w == 2 else 0)
    else:
        kept = norm + N * D * b + N * V * 4  # the head's input and the fp32 log-softmax
        buffer = N * V * b + (N * V * 4 if b == 2 else 0)  # the logits (and their fp32 copy)
    return kept, buffer, V * D * w


def plan_activations(setup: Setup, shape: ModelShape, grads_as_they_come: bool = False) -> ActivationPlan:
    """The activation terms and the micro-step's peak (module docstring).

    Args:
        grads_as_they_come: count the gradients in the peak as the backward makes them (a plain torch
            step); False when the model states hold them (DeepSpeed's flat buffers).
    """
    N, b, D = setup.tokens, setup.activation_bytes, setup.model.d_model
    acts = family_activations(setup.model, setup.seq_len, b)
    kept = acts.inputs if setup.checkpointing else acts.layers
    checkpointed_stem = acts.stem if acts.stem_checkpointed is None else acts.stem_checkpointed
    stem = N * (checkpointed_stem if setup.checkpointing else acts.stem)
    layers = round(stem + N * sum(kept))
    output, buffer, head_grad = _output_end(setup)
    grad_bytes = setup.weight_bytes if grads_as_they_come else 0
    forward_peak = layers + output + buffer
    done = head_grad * (grad_bytes > 0)
    peak = max(forward_peak, layers + output + N * D * b + done)
    below = stem + N * sum(kept)
    for i in reversed(range(len(kept))):
        below -= N * kept[i]
        # the gradient flowing down, and its fp32 form through the norms' backward
        live = below + N * (acts.layers[i] + 2 * D * 4 + acts.widest[i]) + done + shape.blocks[i] * grad_bytes
        peak = max(peak, round(live))
        done += shape.blocks[i] * grad_bytes
    return ActivationPlan(layers=layers, output=output, loss_buffer=buffer, peak=peak)

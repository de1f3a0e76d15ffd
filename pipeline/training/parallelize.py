"""Parallelism and its companions applied to a built model from outside, in one place and one order.

As torchtitan's ``parallelize_*``: the model is built plainly (the same initial weights on every
rank), then ``parallelize`` applies, in this order,

1. expert parallelism (``expert_parallel``): each rank keeps its share of the experts and reaches the
   others by all-to-all; it changes which parameters exist, so it comes before anything that wraps
   the blocks and before the optimizer is built;
2. activation checkpointing: each block's forward recomputes its activations during backward;
3. compile, by regions: each block (with its checkpointing, and its all-to-all dispatch where there
   is one) becomes one compiled unit, and so does the model's output end (the final norm, the LM
   head and the loss: ``output``). Compiling last puts the checkpointed forward inside the compiled
   region, as torchtitan does, rather than a checkpoint around a compiled block.

The limits these rely on are checked at config validation (``pipeline.config.limits``) and required here
again for callers without a config.
"""

from __future__ import annotations

import torch

from pipeline.config import limits, TrainSection
from pipeline.training.expert_parallel import apply_expert_parallel
from pipeline.training.layout import ParallelDims


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each Transformer block's activations during backward instead of storing them.

    Wraps every block's forward, the encoder's too in an encoder-decoder (the stacks ``compile_regions``
    compiles), in non-reentrant ``torch.utils.checkpoint`` (it takes the blocks' non-tensor arguments and
    returns their MoE statistics); without grad it runs plainly.
    """
    from torch.utils.checkpoint import checkpoint

    for block in [*getattr(model, "encoder_layers", ()), *model.layers]:
        plain = block.forward

        def forward(*args, _plain=plain, **kwargs):
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def compile_regions(model: torch.nn.Module) -> None:
    """``torch.compile`` (inductor) the model by regions: each Transformer block (of the encoder too, in
    an encoder-decoder), the unit torchtitan compiles, and the output end (``model.output``: the final
    norm, the LM head and the loss, chunked or not).

    Blocks of a stack share one graph, so compile time does not grow with depth, as it does when the
    whole model is one graph; whatever cannot be traced (MoE routing's data-dependent sizes) falls back
    to eager at a graph break instead of failing. What stays eager between the regions is the token
    embedding (one gather) and the position tables and masks, made once per forward. Each region
    compiles once for training and once more for evaluation (no grad, dropout off).
    """
    for stack in ("encoder_layers", "layers"):
        for block in getattr(model, stack, ()):
            block.compile()
    model.output = torch.compile(model.output)


def parallelize(model: torch.nn.Module, train: TrainSection, dims: ParallelDims, rank: int) -> None:
    """Apply expert parallelism, sequence parallelism, activation checkpointing and compile to ``model``, in
    that order.

    Call after the model is built and its weights set, and before the optimizer is made and
    ``deepspeed.initialize`` runs.

    Args:
        model: a ``models.Transformer`` or ``models.families.mamba.model.MambaLM`` (both keep their blocks in
            ``layers``).
        train: ``activation_checkpointing``, ``compile`` and ``zero_stage`` are read.
        dims: ``ep_size`` > 1 splits the experts; ``sp_size`` > 1 splits each sequence (every rank must call
            this: the groups are made on all ranks).
        rank: this process's global rank (its expert-parallel rank is ``rank % ep_size``).

    Raises:
        ValueError: the combination breaks a limit of ``pipeline.config.limits`` (expert parallelism with
            ZeRO-3, compile with ZeRO-3, or a model expert parallelism cannot split).
    """
    limits.require(limits.ep_zero_stage(dims.ep_size, train.zero_stage))
    limits.require(limits.compile_zero_stage(train.compile, train.zero_stage))
    if dims.ep_size > 1:
        apply_expert_parallel(model, dims.ep_size, rank)
    if dims.sp_size > 1:  # attention over all positions of the group's shards (DeepSpeed-Ulysses)
        from pipeline.training import sequence_parallel

        sequence_parallel.install(model, model.cfg, sequence_parallel.groups(dims.world_size, dims.sp_size),
                                  seq_len=dims.seq_len)
    if train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if train.compile is True:  # "auto" is decided before (pipeline.training.autotune); unresolved, eager
        compile_regions(model)

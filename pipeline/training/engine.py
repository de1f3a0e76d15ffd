"""The DeepSpeed engine of one rank: built from the typed config and stepped.

These functions are the whole training step; ``loop.main`` adds Ray Train, logging, the loader and the
checkpoints (``pipeline.training.checkpoint``) around them, and the distributed tests call them
directly in plain 2-process gloo worlds.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from models import ModelConfig, build_model
from models.families.mamba.model import MambaMixer
from models.layers.grouped_experts import StackedExperts
from models.schedules import lr_multiplier
from pipeline.config import OptimizerSection, TrainSection
from pipeline.training.ds_config import build_ds_config, engine_zero_stage
from pipeline.training.expert_parallel import (canonical_state_dict, check_groups, expert_shards, moe_layers,
                                               moe_param_groups)
from pipeline.training.layout import ParallelDims
from pipeline.training.parallelize import parallelize



def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decoupled weight decay on matrices only (not norms, biases, the stacked experts'
    biases, embeddings or a Mamba mixer's A_log and D, which set its dynamics rather than map features)."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, (MambaMixer, StackedExperts)):
            no_decay.update(id(getattr(module, name)) for name in module.NO_WEIGHT_DECAY
                            if getattr(module, name, None) is not None)
    decay, other = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (other if p.ndim < 2 or id(p) in no_decay else decay).append(p)
    return [{"name": "decay", "params": decay, "weight_decay": weight_decay},
            {"name": "no_decay", "params": other, "weight_decay": 0.0}]


def schedule_kwargs(optim: OptimizerSection, steps: int, d_model: int) -> dict:
    if optim.schedule in ("inverse_sqrt", "noam"):
        return {"d_model": d_model, "warmup": max(1, optim.warmup_steps)}
    if optim.schedule == "constant":
        return {}
    return {"warmup": optim.warmup_steps, "total": steps, "min_ratio": optim.min_lr_ratio}


def fused_adamw(model: torch.nn.Module) -> bool | None:
    """Whether AdamW runs fused: True when every parameter is on the CPU, else None (torch's choice).

    On the CPU torch's default AdamW is a Python loop over parameters (a dozen small ops each), which
    costs most in models of many small tensors: an 8-expert MoE has 8x the feed-forward tensors of its
    dense twin (issue 18). The fused CPU kernel updates each parameter in one vectorised pass (the same
    update up to float rounding). On a GPU the default is already the multi-tensor implementation.
    """
    return True if all(p.device.type == "cpu" for p in model.parameters()) else None


def make_optimizer(model: torch.nn.Module, optim: OptimizerSection, steps: int, d_model: int,
                   expert_parallel: bool = False):
    """Torch AdamW (no JIT-compiled op needed) and the LR schedule as a LambdaLR.

    Schedules in ``models.schedules`` count steps from 1; LambdaLR counts from 0. With expert
    parallelism the expert parameters get groups of their own (see ``expert_parallel``). On the CPU
    AdamW is torch's fused kernel (``fused_adamw``); elsewhere torch's default (multi-tensor on GPUs).
    """
    groups = param_groups(model, optim.weight_decay)
    if expert_parallel:
        groups = moe_param_groups(groups)
    optimizer = torch.optim.AdamW(groups, lr=optim.resolved_lr, betas=(optim.beta1, optim.beta2),
                                  eps=optim.adam_eps, fused=fused_adamw(model))
    kw = schedule_kwargs(optim, steps, d_model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(optim.schedule, s + 1, **kw))
    return optimizer, scheduler


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _keep_clip_norm(engine) -> None:
    """Stage 0 (fp32): DeepSpeed clips the gradients but drops their norm, so ``get_global_grad_norm()``
    is None and the logged ``grad_norm`` would read 0. Clip with the same function and keep the norm.
    Without clipping (``optimizer.grad_clip`` 0) DeepSpeed would not compute the norm at all: it is
    computed at an infinite threshold, which scales every gradient by exactly 1."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients() -> None:
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                   max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_fp32_gradients
    if engine.gradient_clipping() == 0:  # read again only by the step, which clips when it is > 0
        engine.gradient_clipping = lambda: math.inf


def skip_inference_shm_op() -> None:
    """Keep DeepSpeed from compiling and loading its shared-memory all-reduce op in this process.

    DeepSpeed's CPU backend builds that op (``ShareMemCommBuilder``: 40-70 s of compiling on a
    machine's first run, then a compiler probe of every op and a load in each process) when its
    communication backend starts, for ``inference_all_reduce`` alone, which training never calls.
    The backend builds it only when DeepSpeed's table of compatible ops lists it; setting that table
    before its first use (which is what would probe every op) leaves it out. Where the accelerator
    has no such op (CUDA), the table is not consulted for it.
    """
    import deepspeed.ops

    if "__compatible_ops__" in vars(deepspeed.ops):  # already probed (something asked for an op)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def build_engine(model_cfg: ModelConfig, train: TrainSection, optim: OptimizerSection, dims: ParallelDims, *,
                 precision: str, device: torch.device, seed: int, init_state: dict | None = None):
    """Build the model (the same initial weights on every rank: ``init_state``, a parent model's state
    dict (train.init_from), or a seeded initialisation), parallelize it, then the optimizer, schedule
    and engine (at ``engine_zero_stage``: stage 0 where ZeRO would partition over one rank).

    Returns:
        (engine, scheduler).

    Raises:
        ValueError: the layout breaks a limit of ``pipeline.config.limits`` (see ``parallelize``).
    """
    import deepspeed

    if device.type == "cpu":
        skip_inference_shm_op()
    seed_everything(seed)
    model = build_model(model_cfg, device=device)
    if init_state is not None:
        model.load_state_dict(init_state)  # strict: the stage checked the architectures match
    parallelize(model, train, dims, dist.get_rank())  # expert parallelism, checkpointing, compile
    ep = dims.ep_size > 1
    optimizer, scheduler = make_optimizer(model, optim, train.steps, model_cfg.d_model, expert_parallel=ep)
    stage = engine_zero_stage(train, dims, precision)
    config = build_ds_config(dims=dims, zero_stage=stage, precision=precision, grad_clip=optim.grad_clip,
                             offload_optimizer=train.offload_optimizer, offload_params=train.offload_params)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if stage == 0 and precision in ("fp32", "amp_bf16"):
        _keep_clip_norm(engine)
        if dims.world_size == 1:
            # An all-reduce over one rank changes nothing, but DeepSpeed's copies every gradient into
            # flat buckets and back.
            engine.enable_backward_allreduce = False
    if ep:
        check_groups(engine.module, dist.get_rank())
    return engine, scheduler


def loss_definition(label_smoothing: float) -> str:
    """What the logged training ``loss`` is, for the run's tags (evaluation's losses are always plain)."""
    if label_smoothing == 0:
        return "cross-entropy (nats per token)"
    return (f"label-smoothed cross-entropy, eps={label_smoothing} (nats per token; not comparable to the "
            "unsmoothed evaluation loss)")


def train_step(engine, micro_batches: list[tuple[torch.Tensor, ...]], device: torch.device,
               moe_stats=None, label_smoothing: float = 0.0, loss_chunk_tokens: int = 0) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns this rank's mean LM loss (detached).

    The model computes its own loss from the targets (``models.layers.head.LMHead``: inside its forward, so a
    compiled model compiles the head and the loss with the blocks). DeepSpeed divides each micro-batch
    loss by the accumulation steps in ``backward`` and applies the update (with clipping) at the last
    micro-batch's ``step``. The MoE auxiliary loss is trained on but not part of the returned loss, so
    dense and MoE losses compare.

    Args:
        micro_batches: each the model's inputs then the targets: ``(inputs_BT, targets_BT)`` for a decoder,
            ``(encoder_ids_BS, decoder_inputs_BT, targets_BT)`` for an encoder-decoder
            (``pipeline.data.span_corruption.corrupt_micro_batches``).
        moe_stats: a ``metrics.MoEStats`` that collects routing statistics, or None.
        label_smoothing: train.label_smoothing; the returned loss is the one trained on, so it is the
            smoothed cross-entropy when this is > 0.
        loss_chunk_tokens: train.loss_chunk_tokens: the head and the loss a chunk of tokens at a time
            (``models.layers.loss.linear_cross_entropy``); 0 = the whole logits at once.
    """
    losses, routed = [], []
    model_cfg = getattr(engine.module, "cfg", None)
    balancing = model_cfg is not None and model_cfg.moe_bias_update_rate > 0
    for *model_inputs, targets_BT in micro_batches:
        out = engine(*(x.to(device) for x in model_inputs), targets_BT=targets_BT.to(device),
                     label_smoothing=label_smoothing, chunk_tokens=loss_chunk_tokens)
        engine.backward(out.loss + out.aux_loss)
        engine.step()
        losses.append(out.loss.detach())
        if moe_stats is not None:
            moe_stats.add(out.moe_stats)
        if balancing and out.moe_stats:
            routed.append(torch.stack([s["routed_per_expert"] for s in out.moe_stats]))
    if routed:
        update_score_biases(engine.module, torch.stack(routed).sum(dim=0))
    return torch.stack(losses).mean()


def update_score_biases(module: torch.nn.Module, routed_LE: torch.Tensor) -> None:
    """The auxiliary-loss-free bias step of every MoE layer after an optimizer step (DeepSeek-V3):
    ``routed_LE`` (one row per MoE layer, in order) is this rank's routed slots over its micro-batches,
    summed here over every rank (data- and expert-parallel alike: each routes its own tokens with the
    same router), so every rank moves every bias by the same amount."""
    counts = routed_LE.to(torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    layers = [layer for _, layer in moe_layers(module)]
    for layer, routed_E in zip(layers, counts, strict=True):
        layer.update_score_bias(routed_E)


def full_state_dict(engine, zero_stage: int) -> dict[str, torch.Tensor] | None:
    """The consolidated fp32 weights on rank 0 (None elsewhere); every rank must call it.

    Under ZeRO-3 the parameters are partitioned and under expert parallelism the experts are, so
    all ranks join the gather. The result has the single-process layout of ``models``.
    """
    import deepspeed

    def rank0_copy(state: dict) -> dict | None:
        return {k: v.detach().float().clone() for k, v in state.items()} if dist.get_rank() == 0 else None

    module = engine.module
    if expert_shards(module):
        state = rank0_copy(canonical_state_dict(module))  # experts gathered over their EP groups
    elif zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = rank0_copy(module.state_dict())
    else:
        state = rank0_copy(module.state_dict())
    dist.barrier()
    return state


def local_threads(local_world_size: int, configured: int | None, reserved: float | None = None) -> int:
    """Intra-op threads per worker: the configured number (``parallel.threads_per_worker``, which is also
    what the worker reserved), else the CPUs Ray reserved for it (``device.worker_cpus``), at most this node's
    cores split evenly over the run's workers on it (a cluster may declare more logical CPUs than it has
    cores); that split alone outside Ray."""
    if configured:
        return configured
    share = max(1, (os.cpu_count() or 1) // local_world_size)
    return share if reserved is None else max(1, min(share, int(reserved)))

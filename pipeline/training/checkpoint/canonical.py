"""A checkpoint that does not depend on the layout: full fp32 weights and Adam state per parameter.

DeepSpeed's own checkpoints store each rank's flat partition (and each rank's experts), so they
load only into the same data-parallel and expert-parallel layout; DeepSpeed cannot convert MoE
checkpoints at all. Beside them, every checkpoint also holds ``canonical.pt`` (written by rank 0):
for each parameter, under its name in the single-process model (each layer's experts as its whole
stacked tensors ``...ffn.experts.w13`` etc., whatever ranks held their rows), the fp32 weight and AdamW's
``exp_avg`` / ``exp_avg_sq``; every persistent buffer (the training state that is not a parameter:
DeepSeek-V3's router ``score_bias``, moved by the routed counts after each step, the same on every
rank); plus the optimizer step, the LR scheduler's state and the loader
position (world-size independent already). A run resumed with another number of workers, ZeRO
stage (0-3) or ``parallel.ep_size`` loads it instead of DeepSpeed's.

How the full tensors are reached, by ZeRO stage: 0 reads the client AdamW's state; 1 and 2 read
each parameter's fragments of the flat fp32 partitions (``safe_get_full_*``, gathered over the
parameter's data-parallel group: the expert-data-parallel group for experts); 3 the same through
the stage-3 optimizer. Experts are then gathered over their expert-parallel group. Loading runs
the other way: every rank writes the slices it owns. A ``canonical.pt`` written before the experts
were stacked (``...ffn.experts.<global id>.w1.weight`` per expert) is stacked on load.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from models.layers.grouped_experts import stack_expert_state
from pipeline.training.expert_parallel import (
    canonical_names, expert_name, expert_rows, expert_shards, gather_experts, local_expert_param,
)

CANONICAL_FILE = "canonical.pt"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = ("weight", *ADAM_KEYS)


def _zero_optimizer(engine):
    """DeepSpeed's ZeRO 1-3 optimizer, or None when the engine steps the client optimizer itself."""
    opt = engine.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups") or hasattr(opt, "fp32_partitioned_groups_flat"):
        return opt
    return None


def _flat_partitions(zopt) -> list[torch.Tensor]:
    """The fp32 flat partitions AdamW steps (its state is keyed by them)."""
    if hasattr(zopt, "single_partition_of_fp32_groups"):
        return list(zopt.single_partition_of_fp32_groups)
    return list(zopt.fp32_partitioned_groups_flat)


def _relink_optimizer_fragments(zopt) -> None:
    """ZeRO 1/2: point every parameter's fragment view at AdamW's current state tensors.

    DeepSpeed links them once and marks them linked; a link made before AdamW had created its
    state is empty and stays so, hence the forced relink. (ZeRO-3 looks state up on each call.)
    """
    if hasattr(zopt, "_lazy_init_hp_params_optimizer_state"):
        zopt._hp_optimizer_states_linked = False
        zopt._lazy_init_hp_params_optimizer_state()


def _full_entry(engine, zopt, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """Weight and Adam state of one parameter, full over its data-parallel group (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if zopt is not None:
        entry = {"weight": safe_get_full_fp32_param(p)}
        for key in ADAM_KEYS:
            entry[key] = safe_get_full_optimizer_state(p, key)
    else:
        state = engine.optimizer.state.get(p, {})
        entry = {"weight": p.detach(), **{k: state.get(k) for k in ADAM_KEYS}}
    missing = [k for k, v in entry.items() if v is None]
    if missing:
        raise RuntimeError(f"no {missing} for a parameter: save the canonical checkpoint after an optimizer step")
    return {k: v.detach().float().cpu().clone().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
            for k, v in entry.items()}


def _adam_step(engine) -> int:
    zopt = _zero_optimizer(engine)
    inner = zopt.optimizer if zopt is not None else engine.optimizer
    steps = [int(s["step"]) for s in inner.state.values() if "step" in s]
    step = torch.tensor(max(steps) if steps else 0)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a rank whose partitions are empty has no state
    return int(step)


def save_canonical(engine, ckpt_dir: str | Path, *, step: int, scheduler, loader_state: dict) -> None:
    """Write ``canonical.pt`` into ``ckpt_dir`` (rank 0 writes; every rank must call: it gathers)."""
    zopt = _zero_optimizer(engine)
    if zopt is not None:
        _relink_optimizer_fragments(zopt)
    module = engine.module
    names, shards = canonical_names(module), expert_shards(module)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in module.named_parameters():  # the same order on every rank: collectives line up
        entry = _full_entry(engine, zopt, p)
        parsed = local_expert_param(name)
        if parsed is None:
            params[names[name]] = entry
            continue
        # Every expert-parallel rank's block of this tensor, in global expert order.
        params[expert_name(*parsed)] = {key: gather_experts(shards[parsed[0]], value) for key, value in entry.items()}
    adam_step = _adam_step(engine)
    if dist.get_rank() == 0:
        torch.save({"params": params, "buffers": persistent_buffers(module), "adam_step": adam_step, "step": step,
                    "scheduler": scheduler.state_dict(), "loader": loader_state, "world_size": dist.get_world_size()},
                   Path(ckpt_dir) / CANONICAL_FILE)
    dist.barrier()


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that its state dict holds (non-persistent ones, such as RoPE's tables, are
    derived from the config and left out), by name, as CPU copies."""
    kept = set(module.state_dict(keep_vars=True))
    return {name: b.detach().cpu().clone() for name, b in module.named_buffers() if name in kept}


def _stacked(params: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """``params`` with per-expert entries (a checkpoint from before the experts were stacked) stacked, each of
    the weight and the two Adam moments as the weights are (Adam is elementwise, so the stacked moments
    are the per-expert ones)."""
    by_key = {key: stack_expert_state({name: entry[key] for name, entry in params.items()}) for key in STATE_KEYS}
    return {name: {key: by_key[key][name] for key in STATE_KEYS} for name in by_key["weight"]}


def _write_param(engine, zopt, p: torch.nn.Parameter, entry: dict[str, torch.Tensor], adam_step: torch.Tensor) -> None:
    """One parameter's weight and Adam state, full, into whatever this rank holds of it."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if zopt is not None and hasattr(zopt, "fp32_partitioned_groups_flat"):
        # ZeRO-3's partitioned compute copy: gathered, written on rank 0, re-partitioned.
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                p.copy_(entry["weight"].to(p.device, p.dtype))
    else:
        with torch.no_grad():
            p.copy_(entry["weight"].to(p.device, p.dtype))  # the full copy every ZeRO 0-2 rank computes with
    if zopt is not None:
        safe_set_full_fp32_param(p, entry["weight"].to(p.device))
        for key in ADAM_KEYS:
            safe_set_full_optimizer_state(p, entry[key].to(p.device), key)
    else:
        engine.optimizer.state[p] = {"step": adam_step.clone(), **{k: entry[k].to(p.device).clone() for k in ADAM_KEYS}}


def load_canonical(engine, ckpt_dir: str | Path, *, scheduler) -> tuple[int, dict]:
    """Restore weights, Adam state, schedule and step from ``canonical.pt`` into any layout.

    Returns:
        (step, loader_state).

    Raises:
        ValueError: no canonical.pt, or it holds another model's parameters.
        pickle.UnpicklingError: canonical.pt holds anything but tensors and plain values.
    """
    path = Path(ckpt_dir) / CANONICAL_FILE
    if not path.is_file():
        raise ValueError(
            f"{ckpt_dir} has no {CANONICAL_FILE} (an older checkpoint): it resumes only with the same number "
            "of workers, parallel.ep_size and train.zero_stage"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: nothing runs
    params = _stacked(saved["params"])
    module = engine.module
    expected = set(canonical_names(module).values())
    if expected != set(params):
        extra, missing = sorted(set(params) - expected)[:5], sorted(expected - set(params))[:5]
        raise ValueError(f"{path} holds another model's parameters (unexpected {extra}, missing {missing}): "
                         "resume needs the same model config")
    adam_step = torch.tensor(float(saved["adam_step"]))
    zopt = _zero_optimizer(engine)
    if zopt is not None:
        # AdamW creates its state lazily at the first step; create it for every flat partition so
        # that the per-parameter fragments can be written into it.
        for flat in _flat_partitions(zopt):
            zopt.optimizer.state[flat] = {"step": adam_step.clone(), **{k: torch.zeros_like(flat) for k in ADAM_KEYS}}
        _relink_optimizer_fragments(zopt)
    names, rows = canonical_names(module), expert_rows(module)
    for name, p in module.named_parameters():
        entry = params[names[name]]
        if name in rows:  # this rank's block of the layer's experts
            entry = {k: v[rows[name]] for k, v in entry.items()}
        _write_param(engine, zopt, p, entry, adam_step)
    _load_buffers(module, saved.get("buffers"), path)
    # The schedule's position only: base LRs and group count belong to this layout (expert
    # parallelism gives experts optimizer groups of their own).
    scheduler.load_state_dict({k: v for k, v in saved["scheduler"].items() if k not in ("base_lrs", "_last_lr")})
    scheduler._last_lr = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(engine.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    return saved["step"], saved["loader"]


def _load_buffers(module: torch.nn.Module, saved: dict[str, torch.Tensor] | None, path: Path) -> None:
    """Copy the checkpoint's persistent buffers into ``module``.

    Raises:
        ValueError: ``path`` was written before buffers were saved, for a model that has some (its
            buffers, V3's router biases, are lost: resuming would restart them at zero), or it holds
            other buffers than this model's.
    """
    own = persistent_buffers(module)
    if saved is None:
        if own:
            raise ValueError(f"{path} holds no buffers (written before they were saved) but the model has "
                             f"{sorted(own)[:3]}: resume it on the layout it was saved on (DeepSpeed's own "
                             "checkpoint keeps them), or start anew")
        return
    if set(saved) != set(own):
        raise ValueError(f"{path} holds other buffers than this model's (saved {sorted(saved)[:5]}, model "
                         f"{sorted(own)[:5]}): resume needs the same model config")
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in saved:
                b.copy_(saved[name].to(b.device, b.dtype))

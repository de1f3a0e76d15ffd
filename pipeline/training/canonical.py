"""A checkpoint that does not depend on the world size: full fp32 weights, per-parameter Adam state.

DeepSpeed's own ZeRO checkpoints store each rank's flat partition, so they load only into the same
data-parallel layout. Beside them, every checkpoint also holds ``canonical.pt`` (written by rank 0):
for each parameter, by its name in the model, the fp32 weight and AdamW's ``exp_avg`` /
``exp_avg_sq``, plus the optimizer step, the LR scheduler's state and the loader position (which is
world-size independent already). A run resumed on a different number of workers loads it instead.

Supported: ZeRO 0, 1 and 2 without expert parallelism. ZeRO-3 and expert-parallel runs resume only
onto the same layout (their DeepSpeed checkpoint); asking for more is refused with a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

CANONICAL_FILE = "canonical.pt"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _zero_optimizer(engine):
    """DeepSpeed's ZeRO 1/2 optimizer, or None when the engine steps the client optimizer itself."""
    opt = engine.optimizer
    return opt if hasattr(opt, "single_partition_of_fp32_groups") else None


def _relink_optimizer_fragments(zopt) -> None:
    """Point every parameter's fragment view at AdamW's current state tensors.

    DeepSpeed links them once and marks them linked; a link made before AdamW had created its
    state is empty and stays so, hence the forced relink.
    """
    zopt._hp_optimizer_states_linked = False
    zopt._lazy_init_hp_params_optimizer_state()


def _check_supported(engine, zero_stage: int) -> None:
    if zero_stage == 3:
        raise ValueError("a world-size-independent checkpoint is not supported with train.zero_stage=3 yet")
    if getattr(engine, "has_moe_layers", False):
        raise ValueError("a world-size-independent checkpoint is not supported with expert parallelism yet")


def _adam_step(engine) -> int:
    zopt = _zero_optimizer(engine)
    inner = zopt.optimizer if zopt is not None else engine.optimizer
    steps = [int(s["step"]) for s in inner.state.values() if "step" in s]
    return max(steps) if steps else 0


def save_canonical(engine, ckpt_dir: str | Path, *, zero_stage: int, step: int, scheduler, loader_state: dict) -> None:
    """Write ``canonical.pt`` into ``ckpt_dir`` (rank 0 writes; every rank must call: ZeRO gathers)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _check_supported(engine, zero_stage)
    zopt = _zero_optimizer(engine)
    if zopt is not None:
        _relink_optimizer_fragments(zopt)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in engine.module.named_parameters():
        if zopt is not None:
            entry = {"weight": safe_get_full_fp32_param(p)}
            for key in ADAM_KEYS:
                entry[key] = safe_get_full_optimizer_state(p, key)
        else:
            state = engine.optimizer.state.get(p, {})
            entry = {"weight": p.detach().float(), **{k: state.get(k) for k in ADAM_KEYS}}
        params[name] = {k: (v.detach().float().cpu().clone() if v is not None else None) for k, v in entry.items()}
    if dist.get_rank() == 0:
        torch.save({"params": params, "adam_step": _adam_step(engine), "step": step,
                    "scheduler": scheduler.state_dict(), "loader": loader_state, "world_size": dist.get_world_size()},
                   Path(ckpt_dir) / CANONICAL_FILE)
    dist.barrier()


def load_canonical(engine, ckpt_dir: str | Path, *, zero_stage: int, scheduler) -> tuple[int, dict]:
    """Restore weights, Adam state, schedule and step from ``canonical.pt`` into any layout.

    Returns:
        (step, loader_state).
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    _check_supported(engine, zero_stage)
    path = Path(ckpt_dir) / CANONICAL_FILE
    if not path.is_file():
        raise ValueError(
            f"{ckpt_dir} has no {CANONICAL_FILE}: it was written by a ZeRO-3 or expert-parallel run, which "
            "resumes only with the same number of workers, parallel.ep_size and train.zero_stage"
        )
    saved = torch.load(path, map_location="cpu", weights_only=False)
    params = saved["params"]
    names = [n for n, _ in engine.module.named_parameters()]
    if sorted(names) != sorted(params):
        raise ValueError(f"{ckpt_dir}/{CANONICAL_FILE} holds other parameters than this model")
    adam_step = torch.tensor(float(saved["adam_step"]))
    zopt = _zero_optimizer(engine)
    if zopt is not None:
        # ZeRO creates AdamW's state lazily at the first step; create it for every flat partition so
        # that the per-parameter fragments can be written into it, then link the fragments.
        for flat in zopt.single_partition_of_fp32_groups:
            zopt.optimizer.state[flat] = {"step": adam_step.clone(), **{k: torch.zeros_like(flat) for k in ADAM_KEYS}}
        _relink_optimizer_fragments(zopt)
    for name, p in engine.module.named_parameters():
        entry = params[name]
        with torch.no_grad():
            p.copy_(entry["weight"].to(p.device, p.dtype))  # the full copy every ZeRO 0-2 rank computes with
        if zopt is not None:
            safe_set_full_fp32_param(p, entry["weight"].to(p.device))
            for key in ADAM_KEYS:
                if entry[key] is not None:
                    safe_set_full_optimizer_state(p, entry[key].to(p.device), key)
        elif entry["exp_avg"] is not None:
            engine.optimizer.state[p] = {"step": adam_step.clone(),
                                         **{k: entry[k].to(p.device).clone() for k in ADAM_KEYS}}
    scheduler.load_state_dict(saved["scheduler"])
    for group, lr in zip(engine.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    return saved["step"], saved["loader"]

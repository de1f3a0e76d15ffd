"""The DeepSpeed config, generated from the typed config (never hand-written), and the ZeRO stage the engine
runs (`engine_zero_stage`). Arithmetic on the config only, without torch: the planner (`pipeline.plan.report`,
``jobs.submit --dry-run``) resolves a run's setup with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config import limits
from pipeline.training.layout import ParallelDims

if TYPE_CHECKING:
    from pipeline.config import TrainSection


def engine_zero_stage(train: TrainSection, dims: ParallelDims, precision: str) -> int:
    """The ZeRO stage the engine runs: ``train.zero_stage``, except where ZeRO has nothing to do.

    ZeRO 1 and 2 partition optimizer states and gradients over the data-parallel ranks; over one rank
    they partition nothing, yet still copy every gradient into a bucket, "reduce" it, copy it into a
    flat fp32 partition, step that copy and copy it back into the weights (issue 18: about 5% of a
    cpu_medium step on one worker, ``benchmarks/full_path_profile.py``). So with one rank, fp32 weights (precision fp32 or amp_bf16) and no offload,
    the engine runs stage 0: DeepSpeed steps the client AdamW on the model's own gradients. The update
    is the same math. With bf16 or fp16 weights ZeRO keeps the fp32 master copy they need, and
    offloading is a choice of where memory lives, so both keep the configured stage; so does ZeRO-3.
    """
    single = dims.world_size == 1 and precision in ("fp32", "amp_bf16")
    if single and train.zero_stage in (1, 2) and not train.offload_optimizer:
        return 0
    return train.zero_stage


def build_ds_config(*, dims: ParallelDims, zero_stage: int, precision: str, grad_clip: float,
                    offload_optimizer: bool = False, offload_params: bool = False) -> dict:
    """DeepSpeed's config dict for one run.

    The optimizer and LR schedule are client objects passed to ``deepspeed.initialize`` (torch's
    AdamW needs no JIT-compiled op), so they do not appear here.

    Args:
        dims: batch arithmetic; DeepSpeed checks train = micro x accum x world itself.
        zero_stage: 0-3.
        precision: "fp32", "bf16", "fp16" or "amp_bf16" (already resolved from "auto"); amp_bf16
            keeps fp32 weights and runs the forward under ``torch.autocast(bfloat16)`` (DeepSpeed's
            ``torch_autocast`` section).
        grad_clip: max global grad norm; 0 disables clipping.
        offload_optimizer: keep optimizer states on the CPU (ZeRO 1-3).
        offload_params: keep parameters on the CPU between uses (ZeRO-3).

    Returns:
        The config dict for ``deepspeed.initialize``.

    Raises:
        ValueError: an unknown precision or ZeRO stage, or offloading that ``pipeline.config.limits.offload`` refuses.
    """
    if precision not in ("fp32", "bf16", "fp16", "amp_bf16"):
        raise ValueError(f"precision={precision!r}: choose fp32, bf16, fp16 or amp_bf16")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}: choose 0, 1, 2 or 3")
    limits.require(limits.offload(zero_stage, offload_optimizer, offload_params))
    zero: dict = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_batch_size": dims.ds_train_batch_size,
        "train_micro_batch_size_per_gpu": dims.micro_batch_size_per_rank,
        "gradient_accumulation_steps": dims.grad_accum_steps,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 12},
        "steps_per_print": 2**31 - 1,  # Conduit logs its own metrics
        "wall_clock_breakdown": False,
    }
    if precision == "amp_bf16":
        # Gradients stay fp32 end to end (as in plain torch AMP): no module is listed as safe for
        # bf16 gradient communication, which DeepSpeed would otherwise apply to every Linear.
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    if offload_optimizer:
        # Our optimizer is torch's AdamW (no JIT build); DeepSpeed would otherwise insist on its own.
        config["zero_force_ds_cpu_optimizer"] = False
    return config

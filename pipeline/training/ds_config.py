"""The DeepSpeed config, generated from the typed config (never hand-written)."""

from __future__ import annotations

from pipeline.config import limits
from pipeline.training.layout import ParallelDims


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

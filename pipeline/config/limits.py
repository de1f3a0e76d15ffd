"""The limits of a run's parallel layout and training options, each written once with its one message.

A limit is a combination of config values that Conduit refuses. Each function here takes the values
it judges and returns None when they are allowed, else the message that names the config fields,
their values and what is allowed. ``pipeline.config.validate`` checks every limit when a config is
loaded (as a ``ConfigError``), so a bad combination fails before any process starts.

Code that relies on a limit (``ParallelDims``, the DeepSpeed config, expert parallelism, the engine)
may be called without a config (tests, benchmarks); it calls ``require`` with the same rule, so it
fails with the same message, never a second wording of it.
"""

from __future__ import annotations


def require(problem: str | None) -> None:
    """Refuse what a limit refuses, for code that relies on it (config validation checks it first).

    Args:
        problem: what a rule of this module returned.

    Raises:
        ValueError: the rule's message, when ``problem`` is not None.
    """
    if problem is not None:
        raise ValueError(f"{problem} (a limit of pipeline.config.limits, checked when the config is validated)")


def layout_sizes(num_workers: int, ep_size: int, micro_batch_size_per_rank: int) -> str | None:
    """Workers, expert-parallel degree and micro-batch are counts: all at least 1."""
    if num_workers >= 1 and ep_size >= 1 and micro_batch_size_per_rank >= 1:
        return None
    return (f"parallel.num_workers={num_workers}, parallel.ep_size={ep_size} and "
            f"train.micro_batch_size_per_rank={micro_batch_size_per_rank} must all be >= 1")


def global_batch(global_batch_size: int, num_workers: int, micro_batch_size_per_rank: int,
                 sp_size: int = 1) -> str | None:
    """One optimizer step is a whole number of micro-steps over every data-parallel rank (gradient
    accumulation); the ranks of a sequence-parallel group share their sequences."""
    per_micro_step = num_workers // sp_size * micro_batch_size_per_rank
    if global_batch_size % per_micro_step == 0:
        return None
    workers = (f"parallel.num_workers={num_workers}" if sp_size == 1 else
               f"(parallel.num_workers={num_workers} / parallel.sequence_parallel_size={sp_size})")
    return (f"train.global_batch_size={global_batch_size} must be a multiple of {workers} "
            f"x train.micro_batch_size_per_rank={micro_batch_size_per_rank} = {per_micro_step}")


def ep_divides_workers(ep_size: int, num_workers: int) -> str | None:
    """Expert-parallel groups are blocks of ``ep_size`` consecutive ranks, so they tile the world."""
    if num_workers % ep_size == 0:
        return None
    return f"parallel.ep_size={ep_size} must divide parallel.num_workers={num_workers}"


def sequence_parallel(sp_size: int, num_workers: int, ep_size: int, seq_len: int) -> str | None:
    """Sequence-parallel groups are blocks of ``sp_size`` consecutive ranks, each holding ``seq_len / sp_size``
    positions of every sequence; expert parallelism does not compose with them yet."""
    field = f"parallel.sequence_parallel_size={sp_size}"
    if sp_size < 1 or num_workers % sp_size:
        return f"{field} must be >= 1 and divide parallel.num_workers={num_workers}"
    if seq_len % sp_size:
        return f"{field} must divide tokenize.seq_len={seq_len} (each rank holds seq_len / sp positions)"
    if sp_size > 1 and ep_size > 1:
        return f"{field} with parallel.ep_size={ep_size}: expert parallelism and sequence parallelism do not compose yet"
    return None


def ep_needs_moe(ep_size: int, num_experts: int) -> str | None:
    """Expert parallelism splits experts: a dense model has none."""
    if ep_size == 1 or num_experts > 0:
        return None
    return f"parallel.ep_size={ep_size} needs an MoE model (model.num_experts > 0)"


def ep_divides_experts(ep_size: int, num_experts: int) -> str | None:
    """Every expert-parallel rank holds the same number of experts."""
    if ep_size == 1 or num_experts % ep_size == 0:
        return None
    return f"parallel.ep_size={ep_size} must divide model.num_experts={num_experts}"


def ep_zero_stage(ep_size: int, zero_stage: int) -> str | None:
    """DeepSpeed's ZeRO-3 refuses MoE layers outside its AutoEP, so expert parallelism stops at ZeRO-2."""
    if ep_size == 1 or zero_stage != 3:
        return None
    return (f"train.zero_stage=3 with parallel.ep_size > 1 is not supported (this run: train.zero_stage={zero_stage} "
            f"with parallel.ep_size={ep_size}): DeepSpeed's ZeRO-3 refuses MoE layers outside AutoEP; use "
            "train.zero_stage 0, 1 or 2 for expert parallelism")


def ep_shared_experts(ep_size: int, moe_shared_experts: int) -> str | None:
    """DeepSpeed's checkpoint code takes every parameter named "expert" for a routed expert."""
    if ep_size == 1 or moe_shared_experts == 0:
        return None
    return (f"model.moe_shared_experts={moe_shared_experts} with parallel.ep_size={ep_size}: shared experts are "
            "not supported with expert parallelism yet")


def offload(zero_stage: int, offload_optimizer: bool, offload_params: bool) -> str | None:
    """Optimizer states live where ZeRO partitions them (stages 1-3); parameters only under ZeRO-3."""
    if offload_optimizer and zero_stage == 0:
        return "offload_optimizer needs zero_stage >= 1: train.offload_optimizer=true with train.zero_stage=0"
    if offload_params and zero_stage != 3:
        return f"offload_params needs zero_stage=3: train.offload_params=true with train.zero_stage={zero_stage}"
    return None


def compile_zero_stage(compile_blocks: bool | str, zero_stage: int) -> str | None:
    """ZeRO-3 gathers parameters in module hooks that a compiled block would trace."""
    if not (compile_blocks is True and zero_stage == 3):  # compile auto is off under ZeRO-3
        return None
    return ("train.compile=true with train.zero_stage=3 is not supported (ZeRO-3 gathers parameters in module "
            "hooks that a compiled block would trace); use zero_stage 0-2 or compile=false")

"""Device, distributed backend and precision: from config, or detected. Never hard-coded.

torch is imported only to ask this process for its GPUs (`resolve_device` without a cluster's count): the
planner (``jobs.submit --dry-run``) resolves precision without it.
"""

from __future__ import annotations


def resolve_device(requested: str, gpus_in_cluster: float | None = None) -> str:
    """"auto" -> "cuda" when GPUs exist, else "cpu"; an explicit "cuda" without any is an error.

    Args:
        requested: "auto", "cpu" or "cuda" (``parallel.device``).
        gpus_in_cluster: GPUs the Ray cluster reports; None asks this process's torch instead.
    """
    if gpus_in_cluster is None:
        import torch

        have = torch.cuda.is_available()
    else:
        have = gpus_in_cluster > 0
    if requested == "auto":
        return "cuda" if have else "cpu"
    if requested == "cuda" and not have:
        raise RuntimeError("parallel.device=cuda but no CUDA device is visible")
    return requested


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def resolve_precision(requested: str, device: str) -> str:
    """"auto" -> bf16 on a GPU; on a CPU "auto" stays: the training workers time this run's micro-steps in
    fp32 and in bf16 autocast and choose (``pipeline.training.precision_choice``). Any other value is
    honoured as given."""
    if requested == "auto":
        return "bf16" if device == "cuda" else "auto"
    if requested == "fp16" and device == "cpu":
        raise ValueError("train.precision=fp16 needs a GPU; use fp32 or bf16 on CPU")
    return requested


def worker_cpus(threads_per_worker: int | None, num_workers: int, free_by_node: list[float],
                strategy: str = "PACK") -> int:
    """The CPUs each training worker on a CPU reserves from Ray, which are also its threads (``local_threads``).

    ``parallel.threads_per_worker`` when set; else the most CPUs per worker that the nodes' free CPUs can
    place for all ``num_workers`` under the placement strategy (``parallel.placement_strategy``: STRICT_PACK
    on one node, STRICT_SPREAD one per node, PACK and SPREAD anywhere), at least 1. A lone run on a node so
    reserves the whole node, as many threads as it uses; a second run started on it meanwhile waits for CPUs
    instead of running that many threads again on the same cores, and two runs given a share each
    (``threads_per_worker``) train side by side on their shares.
    """
    if threads_per_worker:
        return threads_per_worker

    def fits(c: int) -> bool:
        if strategy == "STRICT_PACK":
            return any(free >= c * num_workers for free in free_by_node)
        if strategy == "STRICT_SPREAD":
            return sum(free >= c for free in free_by_node) >= num_workers
        return sum(int(free // c) for free in free_by_node) >= num_workers

    best = 1
    while best + 1 <= max(free_by_node, default=0) and fits(best + 1):
        best += 1
    return best


def assigned_cpus() -> float | None:
    """The CPUs Ray reserved for this process's task or actor; None outside a Ray worker (a driver calling
    the stage directly, as tests do)."""
    import ray

    context = ray.get_runtime_context()
    if not ray.is_initialized() or context.worker.mode != ray.WORKER_MODE:
        return None
    return context.get_assigned_resources().get("CPU")


def trains_in_process(launcher: str, num_workers: int, device: str, stages_confined: bool = False) -> bool:
    """Whether the train stage trains in its own task (Ray Train's local mode, ``pipeline.training.launch``):
    ``parallel.launcher`` in_task, or auto with one worker on a CPU. Auto keeps Ray Train's workers on a GPU
    (a worker gets the GPU Ray assigns it) and where ``cluster.stage_resources`` confines the stage tasks to
    some nodes (``stages_confined``): training workers are placed by ``parallel.placement_strategy``, not there."""
    if launcher == "in_task":
        return True
    return launcher == "auto" and num_workers == 1 and device == "cpu" and not stages_confined

"""Device, distributed backend and precision: from config, or detected. Never hard-coded."""

from __future__ import annotations

import torch


def resolve_device(requested: str, gpus_in_cluster: float | None = None) -> str:
    """"auto" -> "cuda" when GPUs exist, else "cpu"; an explicit "cuda" without any is an error.

    Args:
        requested: "auto", "cpu" or "cuda" (``parallel.device``).
        gpus_in_cluster: GPUs the Ray cluster reports; None asks this process's torch instead.
    """
    have = torch.cuda.is_available() if gpus_in_cluster is None else gpus_in_cluster > 0
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


def worker_cpus(threads_per_worker: int | None, num_workers: int, free_cpus: float, largest_node_cpus: float) -> int:
    """The CPUs each training worker on a CPU reserves from Ray, which are also its threads (``local_threads``).

    ``parallel.threads_per_worker`` when set; else the cluster's CPUs that are free as the stage starts, split
    over the run's workers (at least 1, at most what its largest node has). A lone run on a node so
    reserves the whole node, as many threads as it uses; a second run started on it meanwhile waits for CPUs
    instead of running that many threads again on the same cores, and two runs given a share each
    (``threads_per_worker``) train side by side on their shares.
    """
    if threads_per_worker:
        return threads_per_worker
    return int(max(1, min(largest_node_cpus, free_cpus // max(1, num_workers))))

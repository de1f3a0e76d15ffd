"""Where evaluation runs: the device and precision of the evaluate stage (``eval.device``,
``eval.precision``), and the inputs moved to the model's device.

The scoring passes (validation and word order, held-out texts, LAMBADA, routing) run on the model's
device, under bf16 autocast when the precision says so (logits are scored in fp32 either way);
pictures and sample generation run on CPU afterwards (small, and sampling draws from a CPU generator).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from pipeline.training.device import resolve_device

if TYPE_CHECKING:
    import torch

# torch is imported where a function needs it, not here: the driver asks ``eval_device`` where the evaluate
# task goes (its resources) while its own threads run, and importing torch there crashed the driver (a
# segfault in a Ray job's driver, where its status and log threads run beside the import).

# A GPU batch is grown from eval.batch_size by doubling while a forward pass of it fits, up to this.
MAX_GPU_BATCH = 512


def on_model(model: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``t`` on the device of ``model``'s parameters (a no-op on CPU)."""
    return t.to(next(model.parameters()).device)


def eval_device(requested: str, gpus_in_cluster: float | None = None) -> str:
    """``eval.device`` resolved: auto takes a GPU when one is visible (to the cluster, or to this process).

    Raises:
        ValueError: ``eval.device=cuda`` where no GPU is visible.
    """
    try:
        return resolve_device(requested, gpus_in_cluster)
    except RuntimeError as e:
        where = "in the Ray cluster" if gpus_in_cluster is not None else "to the evaluate task"
        raise ValueError(f"eval.device=cuda but no GPU is visible {where}") from e


def eval_precision(requested: str, device: str) -> str:
    """``eval.precision``: auto is bf16 on a GPU, fp32 on CPU (where bf16 is slower without AMX)."""
    if requested == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return requested


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``precision=bf16``, else nothing."""
    if precision != "bf16":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def fit_batch_size(model: torch.nn.Module, seq_len: int, start: int, limit: int) -> int:
    """The largest batch from ``start`` doubling up to ``limit`` (and ``MAX_GPU_BATCH``) whose forward pass
    and fp32 logits fit in the GPU's memory; ``start`` itself is taken as it is."""
    import torch

    best, b = start, start * 2
    device = next(model.parameters()).device
    with torch.no_grad():
        while b <= min(limit, MAX_GPU_BATCH):
            try:
                model(torch.zeros(b, seq_len, dtype=torch.long, device=device)).logits.float()
            except torch.cuda.OutOfMemoryError:
                break
            finally:
                torch.cuda.empty_cache()
            best, b = b, b * 2
    return best

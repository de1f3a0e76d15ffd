"""Training metrics beyond the loss: the device's peak for MFU, and MoE routing statistics.

MFU = achieved model FLOPs/s / peak FLOPs/s, with model FLOPs per token from
``models.accounting.flops_per_token`` (6N + 12·L·H·Q·T, PaLM appendix B) and the peak being the
sum over workers of each worker's peak. On CPU the peak is measured by a short matmul probe with
the worker's own threads (datasheets say little about what a CPU sustains); on known GPUs it is
the datasheet's dense bf16 figure.
"""

from __future__ import annotations

import time

import torch

from pipeline.training.expert_parallel import moe_layers

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA datasheets, FLOP/s.
GPU_BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower (756e12) and matched first below
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}


def gpu_peak_flops(device_name: str) -> float | None:
    """The datasheet bf16 peak for a GPU name as torch reports it, or None if unknown."""
    if "H100" in device_name and "PCIe" in device_name:
        return 756e12
    for key, peak in GPU_BF16_PEAK.items():
        if key in device_name:
            return peak
    return None


def measure_matmul_flops(dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                         seconds: float = 0.3) -> float:
    """Attainable matmul FLOP/s for (dim x dim) @ (dim x dim) on this process's threads."""
    a = torch.randn(dim, dim, dtype=dtype, device=device)
    b = torch.randn(dim, dim, dtype=dtype, device=device)
    for _ in range(3):  # warm up caches and kernels
        a @ b
    n, t0 = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return 2 * dim**3 * n / elapsed


def peak_memory_gib(device: torch.device) -> float:
    """This worker's peak memory so far: CUDA's peak allocation on GPU; on CPU the process's peak
    resident set (Python, libraries and buffers included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_flops_per_worker(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one worker, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return peak, f"datasheet bf16 dense, {name}"
        return measure_matmul_flops(4096, torch.bfloat16, str(device)), f"measured bf16 matmul, {name}"
    dtype = torch.bfloat16 if precision in ("bf16", "amp_bf16") else torch.float32
    return measure_matmul_flops(512, dtype), f"measured {dtype} 512^3 matmul, {torch.get_num_threads()} threads"


class MoEStats:
    """Accumulates the per-layer routing statistics of one optimizer step's micro-batches."""

    def __init__(self) -> None:
        self.layers: list[dict[str, torch.Tensor]] = []
        self.micro_batches = 0

    def add(self, moe_stats: list[dict[str, torch.Tensor]]) -> None:
        if not moe_stats:
            return
        if not self.layers:
            self.layers = [{k: torch.zeros_like(v, dtype=torch.float64) for k, v in s.items()} for s in moe_stats]
        for acc, s in zip(self.layers, moe_stats):
            for k, v in s.items():
                acc[k] += v.detach().to(torch.float64)
        self.micro_batches += 1

    def all_reduce(self) -> None:
        """Sum every rank's statistics, so the logged load is the whole global batch's.
        Every rank must call it (at the same steps)."""
        import torch.distributed as dist

        if not self.layers or not dist.is_initialized():
            return
        keys = sorted(self.layers[0])
        flat = torch.cat([s[k].reshape(-1) for s in self.layers for k in keys])
        dist.all_reduce(flat)
        pos = 0
        for s in self.layers:
            for k in keys:
                n = s[k].numel()
                s[k] = flat[pos : pos + n].view_as(s[k])
                pos += n
        self.micro_batches *= dist.get_world_size()

    def metrics(self) -> dict[str, float]:
        """Step means: aux/z loss, dropped share, router entropy, and per-layer expert load.

        ``expert_tokens/l{i}/e{j}`` is the number of token slots layer i's router kept for expert j
        (summed over micro-batches, and over ranks after ``all_reduce``); ``expert_load/l{i}/e{j}``
        is that count's share of the layer's kept slots; ``load_imbalance/l{i}`` is max/mean of
        those shares (1.0 is perfectly balanced). ``max_violation/l{i}`` is the measure of the
        auxiliary-loss-free balancing paper (Wang et al. 2024): max_i load_i / mean load - 1 over the
        slots routed before any capacity drop (0.0 is perfectly balanced); ``moe_max_violation`` the
        largest over the layers.
        """
        if not self.layers:
            return {}
        n = self.micro_batches
        out = {
            "moe_load_balance_loss": sum(s["load_balance_loss"].item() for s in self.layers) / (n * len(self.layers)),
            "moe_z_loss": sum(s["z_loss"].item() for s in self.layers) / (n * len(self.layers)),
            "moe_dropped_fraction": sum(s["dropped_fraction"].item() for s in self.layers) / (n * len(self.layers)),
            "moe_router_entropy": sum(s["router_entropy"].item() for s in self.layers) / (n * len(self.layers)),
        }
        imbalance, violation = [], []
        for i, s in enumerate(self.layers):
            counts = s["tokens_per_expert"]
            share = counts / counts.sum().clamp(min=1)
            for j, (count, v) in enumerate(zip(counts.tolist(), share.tolist())):
                out[f"expert_tokens/l{i}/e{j}"] = count
                out[f"expert_load/l{i}/e{j}"] = v
            imbalance.append((share.max() / share.mean()).item())
            out[f"load_imbalance/l{i}"] = imbalance[-1]
            routed = s["routed_per_expert"]
            violation.append((routed.max() / routed.mean().clamp(min=1e-12) - 1.0).item())
            out[f"max_violation/l{i}"] = violation[-1]
        out["moe_load_imbalance_max"] = max(imbalance)
        out["moe_max_violation"] = max(violation)
        return out


def score_bias_metrics(model: torch.nn.Module) -> dict[str, float]:
    """The sigmoid router's selection biases, per MoE layer i (numbered as in `MoEStats.metrics`):
    ``score_bias_min/l{i}``, ``score_bias_max/l{i}`` and ``score_bias_range/l{i}`` (max - min: how far the
    balancing has pulled the experts apart). Empty for a model without them. Every rank holds the same
    biases (`engine.update_score_biases`), so any rank's are the run's."""
    out: dict[str, float] = {}
    for i, (_, layer) in enumerate(moe_layers(model)):
        if layer.score_bias is None:
            continue
        low, high = layer.score_bias.min().item(), layer.score_bias.max().item()
        out.update({f"score_bias_min/l{i}": low, f"score_bias_max/l{i}": high, f"score_bias_range/l{i}": high - low})
    return out

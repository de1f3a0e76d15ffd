"""A short check of the training path on one accelerator: peak matmul, then a dense and an MoE model
trained for a few dozen steps through the same DeepSpeed engine the Ray Train workers use.

Prints tokens/s, model TFLOP/s and MFU (FLOPs per token from ``models.accounting`` over the
datasheet bf16 peak on known GPUs, else the measured matmul peak) and writes
``benchmarks/results/gpu_check.json``. Meant for a machine with one GPU, in under 5 minutes:

    benchmarks/gpu_check.sh                                   # llama_1b and moe_8x_top2, bf16
    .venv/bin/python benchmarks/gpu_check.py --device cpu --dense debug_dense --moe debug_moe \\
        --seq-len 64 --micro-batch 2 --steps 3                # the same code path on a CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"


def init_world(device: str) -> None:
    """A one-process world (the env:// rendezvous the workers use), NCCL on GPU, gloo on CPU."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def run_model(preset: str, args, device: torch.device, peak: float) -> dict:
    from models import PRESETS
    from models.accounting import flops_per_token, param_counts
    from pipeline.config import OptimizerSection, TrainSection
    from pipeline.training.engine import build_engine, train_step
    from pipeline.training.layout import ParallelDims

    cfg = PRESETS[preset].replace(max_seq_len=max(args.seq_len, PRESETS[preset].max_seq_len))
    train = TrainSection(steps=args.steps + 2, global_batch_size=args.micro_batch,
                         micro_batch_size_per_rank=args.micro_batch, zero_stage=1,
                         activation_checkpointing=args.activation_checkpointing, compile=args.compile,
                         loss_chunk_tokens=args.loss_chunk_tokens)
    optim = OptimizerSection(lr=1e-4, warmup_steps=1)
    dims = ParallelDims(1, 1, args.micro_batch, args.micro_batch, args.seq_len)
    engine, _ = build_engine(cfg, train, optim, dims, precision=args.precision, device=device, seed=0)
    g = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g)
        return [(x[:, :-1], x[:, 1:])]

    for _ in range(2):  # warm-up: kernels, allocator
        train_step(engine, batch(), device, loss_chunk_tokens=train.loss_chunk_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step(engine, batch(), device, loss_chunk_tokens=train.loss_chunk_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens_per_s = args.steps * args.micro_batch * args.seq_len / elapsed
    fpt = flops_per_token(cfg, args.seq_len)["total"]
    row = {
        "preset": preset, "params": param_counts(cfg)["total"], "active_params": param_counts(cfg)["active"],
        "tokens_per_s": tokens_per_s, "model_tflops_per_s": tokens_per_s * fpt / 1e12,
        "mfu": tokens_per_s * fpt / peak, "final_loss": loss.item(),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
    }
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    from models.layers.loss import DEFAULT_CHUNK_TOKENS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--dense", default="llama_1b")
    p.add_argument("--moe", default="moe_8x_top2")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="train.compile: the blocks and the output end compiled")
    p.add_argument("--loss-chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="train.loss_chunk_tokens (0: the whole logits)")
    args = p.parse_args()
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    init_world(args.device)
    from pipeline.training.metrics import measure_matmul_flops, peak_flops_per_worker

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    measured = measure_matmul_flops(8192 if args.device == "cuda" else 512,
                                    torch.bfloat16 if args.precision == "bf16" else torch.float32, str(device), 1.0)
    peak, source = peak_flops_per_worker(device, args.precision)
    print(f"device {torch.cuda.get_device_name(0) if args.device == 'cuda' else platform.processor() or 'cpu'}; "
          f"measured matmul {measured / 1e12:.1f} TFLOP/s; MFU peak {peak / 1e12:.1f} TFLOP/s ({source})")
    rows = [run_model(args.dense, args, device, peak), run_model(args.moe, args, device, peak)]
    print(f"{'preset':<12} {'params':>8} {'active':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GB':>7}")
    for r in rows:
        mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        print(f"{r['preset']:<12} {r['params'] / 1e6:>7.0f}M {r['active_params'] / 1e6:>7.0f}M "
              f"{r['tokens_per_s']:>10.0f} {r['model_tflops_per_s']:>8.2f} {r['mfu']:>6.1%} {mem:>7}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"device": args.device, "precision": args.precision, "measured_peak": measured,
                                   "mfu_peak": peak, "mfu_peak_source": source, "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

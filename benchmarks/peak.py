"""The attainable matmul throughput of this machine: the MFU denominator on CPU.

Times (M x K) @ (K x N) matmuls with the shapes of our layers (tokens x d_model into the attention
and feed-forward widths, and a square reference), fp32 and bf16, with the given thread counts.
Prints a table and writes ``benchmarks/results/peak.json``.

    .venv/bin/python benchmarks/peak.py [--threads 1 2] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import matmul_rate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "peak.json"
# (M, K, N): a micro-batch of 4 x 256 tokens through d_model 128 / 256 / 512 layers, and 1024^3.
SHAPES = [(1024, 128, 384), (1024, 256, 704), (1024, 512, 1408), (1024, 512, 512), (1024, 1024, 1024)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = []
    print(f"{'threads':>7} {'dtype':>9} {'M x K x N':>18} {'GFLOP/s median':>15} {'range':>17}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for m, k, n in SHAPES:
                runs = [matmul_rate(m, k, n, dtype, args.seconds) / 1e9 for _ in range(args.repeats)]
                med = statistics.median(runs)
                rows.append({"threads": threads, "dtype": str(dtype).removeprefix("torch."), "shape": [m, k, n],
                             "gflops_median": med, "gflops_min": min(runs), "gflops_max": max(runs)})
                print(f"{threads:>7} {rows[-1]['dtype']:>9} {f'{m}x{k}x{n}':>18} {med:>15.1f} "
                      f"{f'{min(runs):.1f}-{max(runs):.1f}':>17}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "processor": platform.processor(),
                                   "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

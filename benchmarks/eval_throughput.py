"""Evaluation tokens/s on CPU: the evaluate stage's scoring pass before and after ``eval.cpus``.

Before, the evaluate task held one CPU and so scored with one torch thread; now it holds ``eval.cpus``
CPUs and runs as many threads (``eval.threads``). This times the stage's own scoring function
(``pipeline.evaluation.text_metrics.summed_nll``, fp32, the validation pass's batch size) on a
``--preset`` model (random weights: speed does not depend on them) over random token blocks, with 1
thread and with ``--threads`` threads, interleaved ``--repeats`` times, and reports tokens/s and the
ratio. Both runs give the same loss (checked: float sums in another order, so to 1e-5).

    .venv/bin/python benchmarks/eval_throughput.py [--preset cpu_medium] [--threads 2] [--repeats 3]

Prints a table and writes ``benchmarks/results/eval_throughput.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import summary, write_result  # noqa: E402
from models import build_model  # noqa: E402
from pipeline.evaluation.text_metrics import summed_nll  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu_medium")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8, help="eval.batch_size")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model(args.preset, max_seq_len=args.seq_len).eval()
    vocab = model.cfg.vocab_size
    blocks = np.random.default_rng(0).integers(5, vocab, size=(args.blocks, args.seq_len + 1)).astype(np.int64)
    x, y = blocks[:, :-1], blocks[:, 1:]
    summed_nll(model, x[: args.batch_size], y[: args.batch_size], args.batch_size)  # warm-up
    rates: dict[int, list[float]] = {1: [], args.threads: []}
    losses: dict[int, float] = {}
    for _ in range(args.repeats):
        for threads in rates:
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            nll, n = summed_nll(model, x, y, args.batch_size)
            rates[threads].append(n / (time.perf_counter() - t0))
            losses[threads] = nll / n
    assert abs(losses[1] - losses[args.threads]) < 1e-5, losses
    ratios = [b / a for a, b in zip(rates[1], rates[args.threads])]
    print(f"{args.preset}: {args.blocks} blocks of {args.seq_len} tokens, batch {args.batch_size}, fp32")
    print(f"{'torch threads':>13} {'tokens/s median':>16} {'range':>17}")
    for threads, r in rates.items():
        s = summary(r)
        span = f"{s['min']:.0f}-{s['max']:.0f}"
        print(f"{threads:>13} {s['median']:>16.0f} {span:>17}")
    print(f"{args.threads} threads / 1 thread: {summary(ratios)['median']:.2f}")
    path = write_result("eval_throughput", {
        "preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size, "blocks": args.blocks,
        "rows": [{"threads": t, "tokens_per_s": summary(r)} for t, r in rates.items()],
        "checks": [{"name": f"evaluation tokens/s, eval.cpus={args.threads} / one CPU (before)",
                    "measured": summary(ratios), "target": None, "op": ">=", "format": "ratio"}],
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Training throughput of our model against Hugging Face's Llama in the same bare PyTorch loop.

For each preset: (a) ``models.Transformer`` and (b) ``transformers.LlamaForCausalLM`` built from the
same config and weights (through ``models.export.save_hf``), trained with the same AdamW on the same
random batches, fp32, one process with ``--threads`` threads. A and B are interleaved, ``--repeats``
times; each repeat times ``--steps`` optimizer steps after 2 warm-up steps. Tokens/s is the median
over repeats (range beside it); MFU = tokens/s x FLOPs per token / measured fp32 matmul peak, with
FLOPs per token = 6N + 12·L·H·Q·T (``models.accounting``, PaLM appendix B).

Not yet here (see issue 8): the full Ray Train + DeepSpeed path with 1 and 2 workers, bf16 autocast
and torch.compile, MoE against dense, peak memory.

    .venv/bin/python benchmarks/train_throughput.py [--presets cpu_small cpu_medium] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models import build_model
from models.accounting import flops_per_token
from models.export import save_hf
from models.loss import lm_loss
from pipeline.training.metrics import measure_matmul_flops

RESULTS = Path(__file__).resolve().parent / "results" / "train_throughput.json"


def hf_twin(model):
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as d:
        save_hf(model, model.cfg, d)
        return LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32)


def steps_per_second(model, logits_of, batches, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step(x):
        loss = lm_loss(logits_of(model, x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for x in batches[:2]:
        step(x)
    t0 = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    return steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["cpu_small", "cpu_medium"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    peak = measure_matmul_flops(512, torch.float32, seconds=1.0)
    print(f"fp32 matmul peak with {args.threads} threads: {peak / 1e9:.1f} GFLOP/s (512^3)")
    rows = []
    header = f"{'preset':<11} {'impl':<9} {'tokens/s':>9} {'range':>15} {'MFU':>6} {'vs HF':>6}"
    print(header)
    for name in args.presets:
        torch.manual_seed(0)
        ours = build_model(name, vocab_size=args.vocab, max_seq_len=args.seq_len)
        hf = hf_twin(ours)
        tokens_per_step = args.batch * args.seq_len
        fpt = flops_per_token(ours.cfg, args.seq_len)["total"]
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g) for _ in range(4)]
        runs: dict[str, list[float]] = {"conduit": [], "hf_llama": []}
        for _ in range(args.repeats):  # interleaved: A, B, A, B, ...
            runs["conduit"].append(steps_per_second(ours, lambda m, x: m(x).logits, batches, args.steps))
            runs["hf_llama"].append(steps_per_second(hf, lambda m, x: m(input_ids=x).logits, batches, args.steps))
        med = {k: statistics.median(v) * tokens_per_step for k, v in runs.items()}
        for impl, v in runs.items():
            tps = [s * tokens_per_step for s in v]
            row = {"preset": name, "impl": impl, "tokens_per_s": med[impl], "min": min(tps), "max": max(tps),
                   "mfu": med[impl] * fpt / peak, "ratio_vs_hf": med[impl] / med["hf_llama"],
                   "flops_per_token": fpt, "threads": args.threads, "batch": args.batch, "seq_len": args.seq_len}
            rows.append(row)
            spread = f"{row['min']:.0f}-{row['max']:.0f}"
            print(f"{name:<11} {impl:<9} {row['tokens_per_s']:>9.0f} {spread:>15} {row['mfu']:>6.1%} "
                  f"{row['ratio_vs_hf']:>6.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__,
                                   "peak_fp32_flops": peak, "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

"""Mamba against the Transformer of the same width and depth, on this CPU, in one run.

The Transformer is ``--preset`` (cpu_small: d 128, 4 layers, 4 heads, SwiGLU, RoPE); the Mamba model
keeps its vocabulary, d_model and context with twice its layers, which matches its parameter count
(expand 2, state 16, conv 4: for cpu_small, preset ``mamba``).
Interleaved A/B pairs, repeated (``--repeats``), median and range:

1. Training (one process, ``--threads`` threads, fp32, AdamW, random tokens, LM loss): tokens/s of
   the Transformer, of Mamba with the chunked parallel scan at each ``--chunks`` length, and of Mamba
   with a per-token loop for the scan (chunk 1: what the parallel scan replaces). The ratio
   Mamba / Transformer uses the default chunk (``models.families.mamba.model.SCAN_CHUNK``).
2. Generation (batch 1, greedy, eval mode): milliseconds per new token after a short and after a long
   context. The Transformer's KV cache grows with the context; Mamba's state does not.

One thread by default: the scan is thousands of small elementwise ops per step, and with 2 threads on
a shared 2-core machine each op's thread barrier made steps vary from 1.4 s to 120 s; 1 thread gave
repeatable times for both models.

Prints tables and writes ``benchmarks/results/mamba.json``.

    .venv/bin/python benchmarks/mamba_speed.py [--preset cpu_small] [--seq-len 256] [--batch 8]
    # tiny, to check that it runs (seconds):
    .venv/bin/python benchmarks/mamba_speed.py --preset debug_dense --seq-len 32 --batch 2 --steps 1 --repeats 1 \
        --chunks 16 --contexts 8 24 --decode-tokens 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import summary, write_result
from models import ModelConfig, build_model, get_preset
from models.accounting import param_counts
from models.families.mamba import model as mamba_module
from models.layers.loss import lm_loss


def mamba_like(cfg: ModelConfig) -> ModelConfig:
    """The Mamba model of `cfg`'s vocabulary, width and context, and about its parameters (2x the layers)."""
    return ModelConfig(arch="mamba", pos_encoding="none", vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                       n_layers=2 * cfg.n_layers, max_seq_len=cfg.max_seq_len)


def train_tokens_per_s(model, ids_BT: torch.Tensor, steps: int, chunk: int | None = None) -> float:
    """Tokens/s of `steps` AdamW steps after one warm-up step (the optimizer's state is allocated then)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if chunk is not None:
        for block in model.layers:
            block.mixer.scan_chunk = chunk
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        loss = lm_loss(model(ids_BT[:, :-1]).logits, ids_BT[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    elapsed = time.perf_counter() - start
    return steps * ids_BT.shape[0] * (ids_BT.shape[1] - 1) / elapsed


@torch.no_grad()
def decode_ms_per_token(model, context: int, new_tokens: int) -> float:
    """Milliseconds per new token, greedy, after a prompt of `context` tokens (batch 1)."""
    model.eval()
    for block in model.layers if model.cfg.arch == "mamba" else ():
        block.mixer.scan_chunk = mamba_module.SCAN_CHUNK
    ids = torch.randint(0, model.cfg.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    cache = model.new_kv_cache(1, max_len=context + new_tokens)
    nxt = model(ids, kv_cache=cache).logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(new_tokens):
        nxt = model(nxt, kv_cache=cache).logits[:, -1].argmax(-1, keepdim=True)
    model.train()
    return 1000 * (time.perf_counter() - start) / new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu_small")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument("--contexts", type=int, nargs=2, default=[16, 224])
    ap.add_argument("--decode-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    dec_cfg = get_preset(args.preset).replace(max_seq_len=max(args.seq_len, sum(args.contexts)))
    mam_cfg = mamba_like(dec_cfg)
    torch.manual_seed(0)
    models = {"transformer": build_model(dec_cfg), "mamba": build_model(mam_cfg)}
    ids_BT = torch.randint(0, dec_cfg.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    variants = [("transformer", None)] + [("mamba", c) for c in args.chunks] + [("mamba", 1)]
    names = ["transformer"] + [f"mamba_chunk{c}" for c in args.chunks] + ["mamba_token_loop"]
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    ratios: list[float] = []
    default_name = f"mamba_chunk{mamba_module.SCAN_CHUNK}"
    for _ in range(args.repeats):
        row = {}
        for name, (arch, chunk) in zip(names, variants):
            steps = 1 if chunk == 1 else args.steps  # the token loop is slow; one step shows it
            row[name] = train_tokens_per_s(models[arch], ids_BT, steps, chunk)
            tok_s[name].append(row[name])
        if default_name in row:
            ratios.append(row[default_name] / row["transformer"])

    decode = {}
    for arch, model in models.items():
        for ctx in args.contexts:
            decode[f"{arch}_ctx{ctx}"] = summary([decode_ms_per_token(model, ctx, args.decode_tokens)
                                                  for _ in range(args.repeats)])

    print(f"training, fp32, {args.threads} threads, batch {args.batch} x {args.seq_len} tokens "
          f"({param_counts(dec_cfg)['total']:,} vs {param_counts(mam_cfg)['total']:,} parameters)")
    print(f"{'model':<20} {'tokens/s median':>16} {'range':>20}")
    for name in names:
        s = summary(tok_s[name])
        print(f"{name:<20} {s['median']:>16,.0f} {s['min']:>9,.0f}-{s['max']:,.0f}")
    if ratios:
        r = summary(ratios)
        print(f"mamba (chunk {mamba_module.SCAN_CHUNK}) / transformer: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
    print(f"\ngeneration, batch 1: ms per new token after a context of {args.contexts[0]} and {args.contexts[1]} tokens")
    for arch in models:
        a, b = (decode[f"{arch}_ctx{c}"]["median"] for c in args.contexts)
        print(f"{arch:<20} {a:>8.2f} {b:>8.2f}")

    checks = []
    if ratios:
        checks.append({"name": "Mamba / Transformer training tokens/s", "measured": summary(ratios),
                       "target": None, "op": ">="})
    path = write_result("mamba", {
        "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
        "repeats": args.repeats, "threads": args.threads, "default_chunk": mamba_module.SCAN_CHUNK,
        "params": {"transformer": param_counts(dec_cfg)["total"], "mamba": param_counts(mam_cfg)["total"]},
        "train_tokens_per_s": {n: summary(v) for n, v in tok_s.items()},
        "decode_ms_per_token": decode, "checks": checks,
        # What benchmarks/report.py draws as the table (a generic list of rows).
        "rows": [{"model": n, "train tokens/s": summary(tok_s[n])} for n in names]
        + [{"model": f"{k} decode", "ms per token": v} for k, v in decode.items()],
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

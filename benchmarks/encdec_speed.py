"""The encoder-decoder against the decoder-only Transformer, on this CPU, in one run.

The decoder is ``--preset`` (cpu_small: d 128, 4 layers); the encoder-decoder is ``--encdec-preset``
(encdec: d 128, 4 encoder + 4 decoder layers, the paper's Post-LN / ReLU / sinusoidal layout).
Both train on the same blocks of ``--seq-len`` + 1 tokens: the decoder on next-token prediction, the
encoder-decoder on their T5 span corruption (15% noise, mean span 3, as the pipeline does), so
tokens/s counts block tokens for both, the unit the training loop logs. Interleaved A/B pairs,
repeated (``--repeats``), median and range. Generation: milliseconds per new token (batch 1, greedy)
after a context (decoder) or a source (encoder-decoder, whose encoder runs once) of each ``--contexts``
length, the encoder's time included in the first token and spread over the ``--decode-tokens``.

Prints a table and writes ``benchmarks/results/encdec.json``.

    .venv/bin/python benchmarks/encdec_speed.py [--seq-len 256] [--batch 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import summary, write_result
from models import build_model, get_preset
from models.accounting import param_counts
from models.families.encdec.model import generate_encdec
from models.generate import generate
from models.layers.loss import lm_loss
from pipeline.data.span_corruption import SpanCorruption


def train_tokens_per_s(model, blocks_BL: torch.Tensor, steps: int, corruption: SpanCorruption | None) -> float:
    """Block tokens/s of `steps` AdamW steps after one warm-up step (span corruption timed too)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        if corruption is None:
            loss = lm_loss(model(blocks_BL[:, :-1]).logits, blocks_BL[:, 1:])
        else:
            enc, dec_in, tgt = corruption.batch(blocks_BL, salt=i)
            loss = lm_loss(model(enc, dec_in).logits, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * blocks_BL.shape[0] * (blocks_BL.shape[1] - 1) / (time.perf_counter() - start)


@torch.no_grad()
def decode_ms_per_token(model, context: int, new_tokens: int) -> float:
    model.eval()
    ids = torch.randint(10, model.cfg.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    if model.cfg.arch == "encoder_decoder":
        generate_encdec(model, ids, decoder_start_id=0, max_new_tokens=new_tokens)
    else:
        generate(model, ids, max_new_tokens=new_tokens, temperature=0.0)
    model.train()
    return 1000 * (time.perf_counter() - start) / new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu_small")
    ap.add_argument("--encdec-preset", default="encdec")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", type=int, nargs=2, default=[16, 224])
    ap.add_argument("--decode-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    longest = max(args.seq_len + 1, sum(args.contexts) + args.decode_tokens)
    dec_cfg = get_preset(args.preset).replace(max_seq_len=longest)
    enc_cfg = get_preset(args.encdec_preset).replace(max_seq_len=longest)
    torch.manual_seed(0)
    models = {"decoder": build_model(dec_cfg), "encoder_decoder": build_model(enc_cfg)}
    corruption = SpanCorruption(enc_cfg.denoise_noise_density, enc_cfg.denoise_mean_span_length, 5, seed=0)
    blocks = torch.randint(10, dec_cfg.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    tok_s: dict[str, list[float]] = {n: [] for n in models}
    ratios = []
    for _ in range(args.repeats):
        row = {n: train_tokens_per_s(m, blocks, args.steps, corruption if n == "encoder_decoder" else None)
               for n, m in models.items()}
        for n, v in row.items():
            tok_s[n].append(v)
        ratios.append(row["encoder_decoder"] / row["decoder"])
    decode = {f"{n}_ctx{c}": summary([decode_ms_per_token(m, c, args.decode_tokens) for _ in range(args.repeats)])
              for n, m in models.items() for c in args.contexts}

    S, T = corruption.lengths(args.seq_len + 1)
    params = {n: param_counts(m.cfg)["total"] for n, m in models.items()}
    print(f"training, fp32, {args.threads} threads, batch {args.batch} x {args.seq_len} block tokens "
          f"(encoder-decoder: {S} source + {T} target tokens per block); parameters {params}")
    for n in models:
        s = summary(tok_s[n])
        print(f"{n:<16} {s['median']:>10,.0f} tokens/s ({s['min']:,.0f}-{s['max']:,.0f})")
    r = summary(ratios)
    print(f"encoder_decoder / decoder: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
    for n in models:
        a, b = (decode[f"{n}_ctx{c}"]["median"] for c in args.contexts)
        print(f"{n:<16} generation ms/token after {args.contexts[0]}: {a:.2f}, after {args.contexts[1]}: {b:.2f}")
    path = write_result("encdec", {
        "preset": args.preset, "encdec_preset": args.encdec_preset, "seq_len": args.seq_len, "batch": args.batch,
        "steps": args.steps, "repeats": args.repeats, "threads": args.threads, "params": params,
        "source_target_tokens": [S, T], "train_tokens_per_s": {n: summary(v) for n, v in tok_s.items()},
        "ratio": r, "decode_ms_per_token": decode,
        "checks": [{"name": "encoder-decoder / decoder training tokens/s", "measured": r, "target": None,
                    "op": ">="}],
        "rows": [{"model": n, "train tokens/s": summary(tok_s[n])} for n in models]
        + [{"model": f"{k} decode", "ms per token": v} for k, v in decode.items()],
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Sequence parallelism's memory and speed: the live tensors of a training step per rank, and tokens/s, with
every sequence held whole by each rank (sp = 1) or split over two ranks (sp = 2, DeepSpeed-Ulysses).

Two processes in a gloo world on this machine, one thread each, a dense GQA model (``--d-model``, 4 layers,
8 heads over 4 key/value heads, the chunked loss), micro-batch 1, at sequence lengths 2k, 4k and 8k. At
sp = 1 the two ranks are data-parallel, each a whole sequence; at sp = 2 both hold halves of one sequence
and attention runs on all positions for half the heads after an all-to-all. Per rank, counted by a
``TorchDispatchMode`` over every tensor the step creates (``pipeline.plan.measure.LiveBytes``; the weights
are there before and not counted): the activations kept at the end of forward, and the peak over forward
and backward (activations, gradients, temporaries). Then:

- activations per rank at sp = 2 over sp = 1, at each length (target <= 0.6);
- the longest length whose per-rank peak fits a budget (sp = 1's peak at 4k), from a straight-line fit of
  peak against length for each sp (the attention kernel's memory grows linearly: no T x T scores), sp = 2
  over sp = 1 (target >= 1.8);
- tokens/s of the two ranks together at sp = 2 over sp = 1 (what the all-to-alls and the smaller matmuls
  cost; reported, no target).

Prints a table and writes ``benchmarks/results/sequence_parallel.json``.

    .venv/bin/python benchmarks/sequence_parallel.py [--lengths 2048 4096 8192] [--d-model 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result

TARGET_ACTIVATIONS = 0.6
TARGET_LENGTH = 1.8
BUDGET_AT = 4096


def _model_cfg(d_model: int, max_len: int):
    from models import ModelConfig

    return ModelConfig(vocab_size=512, d_model=d_model, n_layers=4, n_heads=8, num_kv_heads=4, max_seq_len=max_len)


def _one(model, cfg, length: int, sp: int, rank: int, group, repeats: int) -> dict:
    """One length and layout on this rank: bytes of the first step, median seconds of the timed ones."""
    import torch
    import torch.distributed as dist

    from pipeline.plan.measure import LiveBytes
    from pipeline.training.sequence_parallel import shard

    g = torch.Generator().manual_seed(length + (rank if sp == 1 else 0))  # sp 1: each rank its own sequence
    ids = torch.randint(cfg.vocab_size, (1, length + 1), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    offset = 0
    if sp > 1:
        (inputs, offset), (targets, _) = shard(inputs, rank, sp), shard(targets, rank, sp)
    model.position_offset = offset

    def step(counter=None):
        out = model(inputs, targets_BT=targets, chunk_tokens=512)
        if counter is not None:
            counter.saved = counter.current
        out.loss.backward()
        for p in model.parameters():  # the data-parallel all-reduce (over both ranks either way)
            dist.all_reduce(p.grad)
            p.grad = None

    counter = LiveBytes(existing=[*model.parameters(), inputs, targets])
    with counter:
        step(counter)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"length": length, "sp": sp, "activations": counter.saved, "peak": counter.peak,
            "step_s": statistics.median(times)}


def worker(out: Path, lengths: list[int], d_model: int, repeats: int) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from models import build_model
    from pipeline.training.sequence_parallel import install

    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = _model_cfg(d_model, max(lengths))
    torch.manual_seed(0)
    whole = build_model(cfg)
    torch.manual_seed(0)
    split = build_model(cfg)
    install(split, cfg, dist.group.WORLD)
    rows = []
    for length in lengths:
        for sp, model in ((1, whole), (world, split)):
            rows.append(_one(model, cfg, length, sp, rank, dist.group.WORLD, repeats))
    (out / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _launch(out: Path, args) -> list[list[dict]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(out), "--lengths",
                                       *map(str, args.lengths), "--d-model", str(args.d_model), "--repeats",
                                       str(args.repeats)], env=env))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a rank failed (its output is above)")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a + b x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def summarize(ranks: list[list[dict]], lengths: list[int]) -> dict:
    """Per (length, sp): the larger rank's bytes and the slower rank's time; the checks."""
    by = {}
    for rows in zip(*ranks):
        key = (rows[0]["length"], rows[0]["sp"])
        by[key] = {"activations": max(r["activations"] for r in rows), "peak": max(r["peak"] for r in rows),
                   "step_s": max(r["step_s"] for r in rows)}
    sp2 = max(sp for _, sp in by)
    table, checks = [], []
    for length in lengths:
        one, two = by[(length, 1)], by[(length, sp2)]
        tokens_1, tokens_2 = 2 * length / one["step_s"], length / two["step_s"]
        table.append({"length": length, "activations sp1 MiB": round(one["activations"] / 2**20, 1),
                      "activations sp2 MiB": round(two["activations"] / 2**20, 1),
                      "sp2 / sp1 activations": round(two["activations"] / one["activations"], 3),
                      "peak sp1 MiB": round(one["peak"] / 2**20, 1), "peak sp2 MiB": round(two["peak"] / 2**20, 1),
                      "tokens/s sp1": round(tokens_1), "tokens/s sp2": round(tokens_2),
                      "sp2 / sp1 tokens/s": round(tokens_2 / tokens_1, 3)})
        checks.append({"name": f"{length} tokens: activations per rank, sp 2 / sp 1",
                       "measured": two["activations"] / one["activations"], "target": TARGET_ACTIVATIONS,
                       "op": "<=", "format": "ratio"})
    budget = by[(BUDGET_AT, 1)]["peak"]
    longest = {}
    for sp in (1, sp2):
        a, b = _fit([(length, by[(length, sp)]["peak"]) for length in lengths])
        longest[sp] = (budget - a) / b
    checks.append({"name": f"longest length within sp 1's peak at {BUDGET_AT} tokens, sp 2 / sp 1",
                   "measured": longest[sp2] / longest[1], "target": TARGET_LENGTH, "op": ">=", "format": "ratio"})
    for length, row in zip(lengths, table):
        checks.append({"name": f"{length} tokens: tokens/s of the two ranks, sp 2 / sp 1", "target": None,
                       "op": ">=", "measured": row["sp2 / sp1 tokens/s"], "format": "ratio"})
    return {"rows": table, "checks": checks, "budget_bytes": budget,
            "longest_within_budget": {f"sp{k}": round(v) for k, v in longest.items()}, "raw": ranks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--worker", type=Path)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.lengths, args.d_model, args.repeats)
        return
    if BUDGET_AT not in args.lengths:
        raise SystemExit(f"--lengths must include {BUDGET_AT} (the budget is sp 1's peak there)")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = _launch(Path(tmp), args)
    result = summarize(ranks, args.lengths)
    result["args"] = {"lengths": args.lengths, "d_model": args.d_model, "repeats": args.repeats}
    result["summary"] = (
        f"Two gloo ranks of one thread; a {args.d_model}-wide, 4-layer GQA model (8 heads, 4 key/value heads), "
        "micro-batch 1, chunked loss. sp 1: each rank a whole sequence (data-parallel); sp 2: each rank half of "
        "one sequence, attention on all positions for half the heads (DeepSpeed's DistributedAttention). Bytes: "
        "every tensor the step creates, counted per rank (the larger rank's); activations are what forward "
        f"keeps; the budget is sp 1's peak at {BUDGET_AT} tokens, and each layout's longest length within it "
        "comes from a straight-line fit of its peaks over the lengths measured.")
    print(f"{'length':>7} {'act sp1':>9} {'act sp2':>9} {'ratio':>6} {'peak sp1':>9} {'peak sp2':>9} "
          f"{'tok/s sp1':>10} {'tok/s sp2':>10}")
    for r in result["rows"]:
        print(f"{r['length']:>7} {r['activations sp1 MiB']:>9} {r['activations sp2 MiB']:>9} "
              f"{r['sp2 / sp1 activations']:>6} {r['peak sp1 MiB']:>9} {r['peak sp2 MiB']:>9} "
              f"{r['tokens/s sp1']:>10} {r['tokens/s sp2']:>10}")
    print("longest within budget:", result["longest_within_budget"])
    write_result("sequence_parallel", result)


if __name__ == "__main__":
    main()

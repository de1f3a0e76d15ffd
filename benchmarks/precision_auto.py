"""``train.precision: auto`` on this CPU: does its probe predict which precision trains faster?

For each shape (a model, a micro-batch, a sequence length, a worker layout), a gloo world of ``workers``
processes with ``threads`` torch threads each runs:

- the probe as training runs it (``pipeline.training.precision_choice``: one micro-batch forward and
  backward on a fresh model, fp32 and bf16 autocast interleaved, the mean over workers of the medians),
  ``--probes`` times, to see how far repeated probes of one shape spread;
- the truth: full training steps with DeepSpeed's engine as the train stage builds it
  (``pipeline.training.engine.build_engine``: gradient accumulation, the gradient all-reduce, clipping,
  AdamW), fp32 then amp_bf16 then fp32 then amp_bf16, ``--steps`` timed steps each after two untimed; each
  precision's median step.

A row's probe is right when the precision it picks (``choose``: amp_bf16 where its micro-step takes at
most 0.95 of fp32's) is the faster one in full steps, or the two are within that margin of each other.
Also printed: the share of a full fp32 step that is not forward and backward (the optimizer, the
all-reduce, data), which a bf16 gain is diluted by.

    .venv/bin/python benchmarks/precision_auto.py [--steps 6] [--probes 3] [--shapes smoke demo ...]

Prints a table and writes ``benchmarks/results/precision_auto.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (preset, vocab, seq_len, micro_batch, global_batch, workers, threads per worker)
SHAPES = {
    "smoke": ("debug_dense", 512, 64, 4, 16, 2, 1),  # configs/smoke.yaml
    "demo": ("cpu_small", 4096, 128, 8, 32, 2, 1),  # configs/demo.yaml (its tokenizer's 4096 words)
    "cpu_small_1x2": ("cpu_small", 4096, 128, 8, 32, 1, 2),  # one worker with both cores: the bare loop's
    "cpu_medium_2x1": ("cpu_medium", 4096, 256, 8, 32, 2, 1),
    "cpu_medium_1x2": ("cpu_medium", 4096, 256, 8, 32, 1, 2),
}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from models import build_model
    from models.presets import PRESETS
    from pipeline.config.schema import OptimizerSection, TrainSection
    from pipeline.training import precision_choice as pc
    from pipeline.training.engine import build_engine, train_step
    from pipeline.training.layout import ParallelDims

    preset, vocab, seq, micro, global_batch, workers, threads = SHAPES[args.shape]
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    model_cfg = PRESETS[preset].replace(vocab_size=vocab, max_seq_len=max(seq, PRESETS[preset].max_seq_len))
    dims = ParallelDims(world, 1, global_batch, micro, seq)
    g = torch.Generator().manual_seed(rank)
    accum = global_batch // (micro * world)
    batches = [[(torch.randint(vocab, (micro, seq), generator=g), torch.randint(vocab, (micro, seq), generator=g))
                for _ in range(accum)] for _ in range(4)]
    barrier = dist.barrier if world > 1 else (lambda: None)

    def agree(n: int) -> int:
        most = torch.tensor([n])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    probes = []
    for _ in range(args.probes):
        torch.manual_seed(0)
        model = build_model(model_cfg, device=cpu)
        medians = pc.time_micro_steps(pc.micro_step(model, batches[0][0], cpu, 0), barrier=barrier, agree=agree)
        sums = torch.tensor([medians["fp32"], medians["amp_bf16"]], dtype=torch.float64)
        dist.all_reduce(sums)
        probes.append((sums / world).tolist())
        del model

    train = TrainSection(steps=1000, global_batch_size=global_batch, micro_batch_size_per_rank=micro, zero_stage=1)
    step_s: dict[str, list[float]] = {"fp32": [], "amp_bf16": []}
    for precision in ("fp32", "amp_bf16", "fp32", "amp_bf16"):
        engine, _ = build_engine(model_cfg, train, OptimizerSection(), dims, precision=precision, device=cpu, seed=0)
        for i in range(2 + args.steps):
            barrier()
            t0 = time.perf_counter()
            train_step(engine, batches[i % len(batches)], cpu)
            if i >= 2:
                step_s[precision].append(time.perf_counter() - t0)
        del engine
    if rank == 0:
        Path(args.out).write_text(json.dumps({"probes": probes, "step_s": step_s, "accum": accum}))
    dist.destroy_process_group()


def run_shape(name: str, args) -> dict:
    import socket

    workers, threads = SHAPES[name][5], SHAPES[name][6]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", "--shape", name, "--out", str(out), "--steps", str(args.steps),
             "--probes", str(args.probes)], cwd=ROOT,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(r),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
                 "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(workers)]
        logs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name} failed:\n" + "\n".join(log[-3000:] for log in logs))
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--probes", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--shape")
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from benchmarks.common import machine, write_result
    from pipeline.training.precision_choice import MARGIN, choose, machine_id

    rows = []
    print(f"machine: {machine_id()}")
    print(f"{'shape':<16} {'probe bf16 speedup (each probe)':<34} {'picks':<9} {'full-step speedup':>17} "
          f"{'faster':<9} {'not fwd+bwd':>11} {'right':>6}")
    for name in args.shapes:
        r = run_shape(name, args)
        speedups = [f / b for f, b in r["probes"]]
        picks = [choose(f, b) for f, b in r["probes"]]
        fp32 = statistics.median(r["step_s"]["fp32"])
        bf16 = statistics.median(r["step_s"]["amp_bf16"])
        full = fp32 / bf16
        faster = "amp_bf16" if full > 1 else "fp32"
        # fp32's micro-step x micro-steps per step, against the whole step: the rest is precision-blind.
        fwd_bwd = statistics.median([f for f, _ in r["probes"]]) * r["accum"]
        rest = max(0.0, 1 - fwd_bwd / fp32)
        right = all(pk == faster or MARGIN < full < 1 / MARGIN for pk in picks)
        row = {"shape": name, "preset": SHAPES[name][0], "seq_len": SHAPES[name][2], "micro_batch": SHAPES[name][3],
               "workers": SHAPES[name][5], "threads": SHAPES[name][6], "probe_speedups": speedups, "picks": picks,
               "full_step_s": {"fp32": fp32, "amp_bf16": bf16}, "full_step_speedup": full, "faster": faster,
               "share_not_fwd_bwd_fp32": rest, "probe_right": right}
        rows.append(row)
        print(f"{name:<16} {' '.join(f'{s:.2f}' for s in speedups):<34} {'/'.join(sorted(set(picks))):<9} "
              f"{full:>17.2f} {faster:<9} {rest:>11.0%} {'yes' if right else 'NO':>6}", flush=True)
    table = [{"shape": r["shape"], "model": r["preset"], "seq x micro": f"{r['seq_len']} x {r['micro_batch']}",
              "workers x threads": f"{r['workers']} x {r['threads']}",
              "probe bf16 speedups": " ".join(f"{v:.2f}" for v in r["probe_speedups"]),
              "picks": "/".join(sorted(set(r["picks"]))), "full-step bf16 speedup": round(r["full_step_speedup"], 2),
              "faster": r["faster"], "step not fwd+bwd (fp32)": f"{r['share_not_fwd_bwd_fp32']:.0%}",
              "probe right": "yes" if r["probe_right"] else "NO"} for r in rows]
    checks = [{"name": "shapes whose every probe picked the precision faster in full steps (or within the margin)",
               "measured": sum(r["probe_right"] for r in rows) / len(rows), "target": 1.0, "op": ">=",
               "format": "ratio"}]
    for r in rows:
        checks.append({"name": f"{r['shape']}: full-step bf16 autocast speedup over fp32", "target": None, "op": ">=",
                       "measured": r["full_step_speedup"], "format": "ratio"})
    summary = (f"On {machine_id()}. Probe: the micro-step timing train.precision auto runs before training "
               f"(pipeline.training.precision_choice; amp_bf16 where its micro-step takes <= {MARGIN} of fp32's), "
               f"repeated {args.probes} times per shape. Full step: DeepSpeed's engine as the train stage builds it "
               f"(ZeRO-1, gradient accumulation, all-reduce, clipping, AdamW), {args.steps} timed steps per "
               "precision, twice each, interleaved. 'step not fwd+bwd': the share of a full fp32 step that is "
               "the optimizer, the all-reduce and the rest, which is the same in both precisions and dilutes a gain.")
    path = write_result("precision_auto", {"machine": machine(), "cpu": machine_id(), "margin": MARGIN,
                                           "args": {"steps": args.steps, "probes": args.probes, "shapes": args.shapes},
                                           "rows": table, "runs": rows, "checks": checks, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Where the full path's step time goes, next to the bare PyTorch loop (one process, no Ray).

``train_throughput.py`` measures Conduit's full path (Ray Train + DeepSpeed, 1 worker) against a bare
loop (model, ``torch.optim.AdamW`` over all parameters, nothing else). Between the two sit: the
optimizer's weight-decay groups and LR schedule, gradient clipping (a global norm over all gradients),
DeepSpeed's engine (ZeRO's flat fp32 buffers, its backward hooks, its step), and the loop's own
per-step work. This script builds the same model once per variant in one process (gloo, world size 1,
the engine ``pipeline.training.engine.build_engine`` makes) and times them one step each in turn,
``--steps`` rounds per repeat (each phase's median step), ``--repeats`` times:

- ``bare``: the bare loop of ``train_throughput.py``;
- ``bare_groups_sched``: plus ``make_optimizer``'s decay groups and LambdaLR schedule;
- ``bare_groups_sched_clip``: plus ``clip_grad_norm_`` at ``optimizer.grad_clip``;
- ``engine_zero{0,1}``: ``build_engine`` + ``train_step`` (the loop's step), ZeRO 0 and 1, clipping on
  (ZeRO 1 on one rank runs as stage 0: ``engine.engine_zero_stage``);
- ``engine_zero1_kept``: ZeRO 1 kept on one rank, as before issue 18 (flat fp32 copies, bucketed "reduction");
- ``engine_zero1_noclip``: ZeRO 1 with ``grad_clip=0``.

Every variant's AdamW is the one Conduit trains with (``engine.fused_adamw``: fused on the CPU).

Each step is split into forward, backward and optimizer step (``time.perf_counter`` around each), so
the table says which phase the extra time is in. Writes ``benchmarks/results/full_path_profile.json``.

    .venv/bin/python benchmarks/full_path_profile.py [--preset cpu_medium] [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import summary, write_result  # noqa: E402
from models import build_model, get_preset  # noqa: E402
from models.layers.loss import lm_loss  # noqa: E402

PHASES = ("forward", "backward", "step")


class Bare:
    """The bare loop, optionally with the full path's optimizer groups, schedule and clipping."""

    def __init__(self, cfg, train, optim, groups_sched: bool, clip: bool):
        from pipeline.training.engine import fused_adamw, make_optimizer, seed_everything

        seed_everything(0)
        self.model = build_model(cfg)
        self.clip = optim.grad_clip if clip else 0.0
        if groups_sched:
            self.opt, self.sched = make_optimizer(self.model, optim, train.steps, cfg.d_model)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused_adamw(self.model))
            self.sched = None

    def step(self, x_BT: torch.Tensor, t: dict[str, float]) -> None:
        t0 = time.perf_counter()
        loss = lm_loss(self.model(x_BT[:, :-1]).logits.float(), x_BT[:, 1:])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.sched is not None:
            self.sched.step()
        t3 = time.perf_counter()
        for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
            t[k] += v


class Engine:
    """``build_engine``'s DeepSpeed engine, stepped the way ``engine.train_step`` steps it."""

    def __init__(self, cfg, train, optim, dims, keep_stage: bool = False):
        """``keep_stage``: run the configured ZeRO stage even on one rank (as before issue 18; see
        ``pipeline.training.engine.engine_zero_stage``)."""
        from pipeline.training import engine as engine_module

        chosen = engine_module.engine_zero_stage
        if keep_stage:
            engine_module.engine_zero_stage = lambda t, d, p: t.zero_stage
        try:
            self.engine, _ = engine_module.build_engine(cfg, train, optim, dims, precision="fp32",
                                                        device=torch.device("cpu"), seed=0)
        finally:
            engine_module.engine_zero_stage = chosen

    def step(self, x_BT: torch.Tensor, t: dict[str, float]) -> None:
        t0 = time.perf_counter()
        out = self.engine(x_BT[:, :-1])
        loss = lm_loss(out.logits.float(), x_BT[:, 1:])
        t1 = time.perf_counter()
        self.engine.backward(loss + out.aux_loss)
        t2 = time.perf_counter()
        self.engine.step()
        t3 = time.perf_counter()
        for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
            t[k] += v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu_medium")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant per repeat")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist

    from pipeline.config import load_config
    from pipeline.training.layout import ParallelDims

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(args.threads)
    cfg = get_preset(args.preset).replace(vocab_size=args.vocab, max_seq_len=args.seq_len)
    defaults = load_config(None, [])
    train, optim = defaults.train, defaults.optimizer
    dims = ParallelDims(1, 1, args.batch, args.batch, args.seq_len)
    variants = {
        "bare": lambda: Bare(cfg, train, optim, groups_sched=False, clip=False),
        "bare_groups_sched": lambda: Bare(cfg, train, optim, groups_sched=True, clip=False),
        "bare_groups_sched_clip": lambda: Bare(cfg, train, optim, groups_sched=True, clip=True),
        "engine_zero0": lambda: Engine(cfg, dataclasses.replace(train, zero_stage=0), optim, dims),
        "engine_zero1": lambda: Engine(cfg, dataclasses.replace(train, zero_stage=1), optim, dims),
        "engine_zero1_kept": lambda: Engine(cfg, dataclasses.replace(train, zero_stage=1), optim, dims, keep_stage=True),
        "engine_zero1_noclip": lambda: Engine(cfg, dataclasses.replace(train, zero_stage=1),
                                              dataclasses.replace(optim, grad_clip=0.0), dims),
    }
    runners = {name: make() for name, make in variants.items()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g) for _ in range(4)]
    times: dict[str, list[dict[str, float]]] = {n: [] for n in runners}
    for runner in runners.values():  # warm-up: AdamW's state, the allocator's caches
        scratch = dict.fromkeys(PHASES, 0.0)
        for x in batches[:2]:
            runner.step(x, scratch)
    for r in range(args.repeats):
        # Step by step in turn (bare, bare_groups_sched, ..., bare, ...): a slow spell of this shared
        # machine hits every variant alike. Per phase, a repeat's time is its median step's.
        steps: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
        for i in range(args.steps):
            for name, runner in runners.items():
                t = dict.fromkeys(PHASES, 0.0)
                runner.step(batches[i % len(batches)], t)
                steps[name].append(t)
        for name, per_step in steps.items():
            times[name].append({k: statistics.median(t[k] for t in per_step) for k in PHASES})
        print(f"repeat {r + 1}/{args.repeats}: " + "  ".join(
            f"{n} {sum(times[n][-1].values()) * 1e3:.0f} ms" for n in runners), flush=True)

    tokens = args.batch * args.seq_len
    rows = {}
    for name, per_repeat in times.items():
        rows[name] = {k: summary([t[k] for t in per_repeat]) for k in PHASES}
        rows[name]["total"] = summary([sum(t.values()) for t in per_repeat])
        rows[name]["tokens_per_s"] = summary([tokens / sum(t.values()) for t in per_repeat])
        # Per repeat, against that repeat's bare loop: the ratio train_throughput reports as full_1w_vs_bare.
        rows[name]["vs_bare"] = summary([sum(b.values()) / sum(t.values())
                                         for t, b in zip(per_repeat, times["bare"])])
    print(f"\n{args.preset}, batch {args.batch} x {args.seq_len}, {args.threads} threads, fp32; ms per step (median)")
    print(f"{'variant':<24} {'forward':>8} {'backward':>9} {'step':>7} {'total':>7} {'x bare':>7}")
    for name, row in rows.items():
        print(f"{name:<24} " + " ".join(f"{row[k]['median'] * 1e3:>{w}.1f}" for k, w in
                                      (("forward", 8), ("backward", 9), ("step", 7), ("total", 7)))
              + f" {row['vs_bare']['median']:>7.2f}")
    result = {"config": {**vars(args), "zero_stage_default": train.zero_stage, "grad_clip": optim.grad_clip,
                         "weight_decay": optim.weight_decay}, "rows": rows}
    print(f"wrote {write_result('full_path_profile', result)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

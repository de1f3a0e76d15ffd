"""``train.precision: auto`` on a CPU: fp32 or bf16 autocast, chosen by timing this run's own micro-steps.

Whether bf16 autocast pays on a CPU depends on the chip (AMX or AVX512-BF16 or neither), on the model's
widths and on the worker layout (threads per worker, workers per node sharing the memory bus), so a matmul
micro-benchmark predicts it badly: on the demo's layout it can lose while the same preset's bare loop gains
1.5x. So every worker, together (the layout the run will train in), times a few forward-and-backward passes
of one of the run's own micro-batches on a freshly built copy of the run's model, in each precision, the two
interleaved so that drift on a shared machine falls on both. The mean over the workers of each precision's
median decides for all of them: ``amp_bf16`` where its micro-step takes at most ``MARGIN`` of fp32's, fp32
otherwise. The optimizer step, the gradient all-reduce and the data loading are the same in both precisions
(fp32 weights and gradients either way), so they only dilute a gain; they do not change its sign.

Why a 0.95 margin: repeated probes of one shape on one machine agree within about 3% of each other
(``benchmarks/precision_auto.py``: the demo's bf16 speedup 1.14-1.18, smoke's 0.62-0.66), and bf16
rounds the activations, so it is taken only where it is clearly faster. Each precision is timed at least
``REPEATS`` times, more where a micro-step is short (single timings of milliseconds scatter).

The result is cached per machine (CPU model and its bf16 instructions, cores, torch's version) and run shape
(model, micro-batch, sequence length, threads, workers per node, world size, compile) in
``$XDG_CACHE_HOME/conduit/precision.json``; a later run of that shape on that machine reads it instead of
measuring again (and a restarted run keeps its choice).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import machine_cache

CANDIDATES = ("fp32", "amp_bf16")
MARGIN = 0.95  # amp_bf16 only where its micro-step takes <= 95% of fp32's
REPEATS = 5  # the fewest timed micro-steps of each precision, after one untimed of each
BUDGET_S = 1.5  # more timed micro-steps where they are short: up to this many seconds of the slower's
MOST_REPEATS = 30
CACHE_FILE = "precision.json"
BF16_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``auto`` chose and why: the mean over workers of each precision's median micro-step."""

    precision: str  # "fp32" or "amp_bf16"
    fp32_s: float
    amp_bf16_s: float
    source: str  # "measured" or "cached"
    machine: str

    @property
    def speedup(self) -> float:
        """fp32's micro-step over amp_bf16's (> 1: bf16 is faster)."""
        return self.fp32_s / self.amp_bf16_s

    def tags(self) -> dict[str, str]:
        return {"precision": self.precision, "precision.auto": self.source,
                "precision.auto.fp32_micro_step_s": f"{self.fp32_s:.5f}",
                "precision.auto.amp_bf16_micro_step_s": f"{self.amp_bf16_s:.5f}",
                "precision.auto.bf16_speedup": f"{self.speedup:.3f}",
                "precision.auto.rule": f"amp_bf16 where its micro-step <= {MARGIN} x fp32's",
                "precision.auto.machine": self.machine}


def choose(fp32_s: float, amp_bf16_s: float, margin: float = MARGIN) -> str:
    """The rule: amp_bf16 where it takes at most ``margin`` of fp32's time, else fp32."""
    if fp32_s <= 0 or amp_bf16_s <= 0:
        raise ValueError(f"micro-step times must be positive: fp32 {fp32_s}, amp_bf16 {amp_bf16_s}")
    return "amp_bf16" if amp_bf16_s <= margin * fp32_s else "fp32"


def machine_id() -> str:
    """The CPU as far as precision is concerned: its model name, its bf16 instructions, cores and torch."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    bf16 = ",".join(f for f in BF16_FLAGS if f in flags) or "no-bf16-isa"
    return f"{name} | {bf16} | {os.cpu_count()} cpus | torch {torch.__version__}"


def shape_key(model: dict, micro_batch: int, seq_len: int, threads: int, local_world_size: int,
              world_size: int, compile: bool) -> str:
    """The run's shape as far as the choice goes (the model's config dict, JSON-sorted, and the layout)."""
    blob = json.dumps({"model": model, "micro_batch": micro_batch, "seq_len": seq_len, "threads": threads,
                       "local_world_size": local_world_size, "world_size": world_size, "compile": compile},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path() -> Path:
    return machine_cache.cache_dir() / CACHE_FILE


def read_cached(machine: str, key: str, path: Path | None = None) -> PrecisionChoice | None:
    """The cached choice for this machine and shape, or None (no file, no entry, or a file unreadable)."""
    path = path or cache_path()
    try:
        entry = json.loads(path.read_text()).get(machine, {}).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or entry.get("precision") not in CANDIDATES:
        return None
    try:
        return PrecisionChoice(precision=entry["precision"], fp32_s=float(entry["fp32_s"]),
                               amp_bf16_s=float(entry["amp_bf16_s"]), source="cached", machine=machine)
    except (KeyError, TypeError, ValueError):
        return None


def write_cached(choice: PrecisionChoice, key: str, path: Path | None = None) -> None:
    """Adds the choice to the cache (`machine_cache.update`: under the file's lock, written atomically)."""
    entry = {k: v for k, v in asdict(choice).items() if k not in ("source", "machine")}
    machine_cache.update(path or cache_path(), (choice.machine, key), entry)


def time_micro_steps(step: Callable[[str], None], repeats: int = REPEATS,
                     barrier: Callable[[], None] = lambda: None,
                     agree: Callable[[int], int] = lambda n: n, budget_s: float = BUDGET_S,
                     most: int = MOST_REPEATS) -> dict[str, float]:
    """Each candidate's median over its timed calls of ``step(precision)``, after one untimed call of each;
    the candidates interleaved, and every rank entering each timed call together (``barrier``).

    At least ``repeats`` timed calls of each; more where the calls are short, up to ``budget_s`` of the
    slower candidate's time (judged from the first timed round) and at most ``most``, the same count on
    every rank (``agree``: the largest over ranks), since a short micro-step's single timings scatter more."""
    for precision in CANDIDATES:
        step(precision)
    times: dict[str, list[float]] = {p: [] for p in CANDIDATES}

    def one_round() -> None:
        for precision in CANDIDATES:
            barrier()
            t0 = time.perf_counter()
            step(precision)
            times[precision].append(time.perf_counter() - t0)

    one_round()
    slowest = max(ts[0] for ts in times.values())
    rounds = agree(min(most, max(repeats, math.ceil(budget_s / slowest) if slowest > 0 else most)))
    for _ in range(rounds - 1):
        one_round()
    return {p: statistics.median(ts) for p, ts in times.items()}


def micro_step(model: torch.nn.Module, micro_batch: tuple[torch.Tensor, ...], device: torch.device,
               loss_chunk_tokens: int) -> Callable[[str], None]:
    """One forward and backward of ``model`` on ``micro_batch`` (its inputs, then the targets) in a given
    precision: fp32, or the forward under bf16 autocast as DeepSpeed's ``torch_autocast`` runs it."""
    *inputs, targets = (x.to(device) for x in micro_batch)

    def step(precision: str) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "amp_bf16"):
            out = model(*inputs, targets_BT=targets, chunk_tokens=loss_chunk_tokens)
        (out.loss + out.aux_loss).backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def decide(machine: str, key: str, measure: Callable[[], dict[str, float]], rank: int, world: int,
           device: torch.device) -> PrecisionChoice:
    """Every rank's part: rank 0's cached choice if it has one, else every rank measures and the means
    over ranks decide. Every rank returns the same choice (one broadcast, one all-reduce)."""
    cached = read_cached(machine, key) if rank == 0 else None
    word = torch.tensor([1.0, CANDIDATES.index(cached.precision), cached.fp32_s, cached.amp_bf16_s]
                        if cached else [0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=device)
    if world > 1:
        dist.broadcast(word, src=0)
    if word[0].item() == 1.0:
        return PrecisionChoice(precision=CANDIDATES[int(word[1].item())], fp32_s=word[2].item(),
                               amp_bf16_s=word[3].item(), source="cached", machine=machine)
    medians = measure()
    sums = torch.tensor([medians["fp32"], medians["amp_bf16"]], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(sums)
    fp32_s, bf16_s = (sums / world).tolist()
    choice = PrecisionChoice(precision=choose(fp32_s, bf16_s), fp32_s=fp32_s, amp_bf16_s=bf16_s,
                             source="measured", machine=machine)
    if rank == 0:
        try:
            write_cached(choice, key)
        except OSError as e:  # a read-only HOME: the run goes on, measuring again next time
            print(f"warning: precision auto: could not cache the choice in {cache_path()}: {e}", flush=True)
    return choice

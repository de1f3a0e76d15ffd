"""``train.compile: auto``: torch.compile (inductor, by regions) where it pays back its compile time.

On a GPU it is on (fused pointwise kernels pay at any length a GPU run has), but with ZeRO-3, which it
cannot run under. On a CPU the gain is small (4-31% of a step in ``benchmarks/RESULTS.md``) and compiling
costs each worker seconds to tens of seconds, so it is decided per run:

1. An upper bound first, from the eager step time the precision choice measured (or a few micro-steps
   timed here): if even saving ``MAX_SAVED`` of every step over the run's planned steps would not repay
   ``MIN_COMPILE_S``, compile is off and nothing is compiled to find out (every short run: smoke, tests).
2. Else the cache, or a measurement: on every worker at once, a fresh copy of the model is compiled the
   way training compiles it, the first compiled micro-step timed (the compile time, on this machine's
   inductor cache as it is), then compiled and eager micro-steps interleaved; the means over workers.
3. On where the time saved over the planned steps, (eager - compiled) x micro-steps per step x steps,
   exceeds the compile time. The run then compiles its own model, mostly from inductor's cache, which
   is kept across runs in ``$XDG_CACHE_HOME/conduit/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` says where.

Cached like the precision (per machine and run shape, with the precision in the shape) in
``$XDG_CACHE_HOME/conduit/compile.json``; the decision itself is made again from the cached times and
each run's own step count.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import machine_cache
from pipeline.training import precision_choice as pc

MAX_SAVED = 0.5  # the most of an eager CPU step compile is assumed able to save, for the bound
MIN_COMPILE_S = 5.0  # the least compiling the regions is assumed to cost, for the bound
REPEATS = 3
CACHE_FILE = "compile.json"


@dataclass(frozen=True)
class CompileChoice:
    """What ``auto`` chose and from what (times are per micro-step, means over workers)."""

    compile: bool
    reason: str  # "gpu", "zero3", "bound", "measured", "cached"
    eager_s: float
    compiled_s: float | None = None
    compile_s: float | None = None
    saved_s: float | None = None  # over the run's planned steps

    def tags(self) -> dict[str, str]:
        tags = {"compile": str(self.compile).lower(), "compile.auto": self.reason,
                "compile.auto.eager_micro_step_s": f"{self.eager_s:.5f}"}
        if self.compiled_s is not None:
            tags.update({"compile.auto.compiled_micro_step_s": f"{self.compiled_s:.5f}",
                         "compile.auto.compile_s": f"{self.compile_s:.2f}",
                         "compile.auto.saved_over_run_s": f"{self.saved_s:.2f}"})
        tags["compile.auto.rule"] = ("on where (eager - compiled) x micro-steps x steps > compile time; skipped "
                                     f"without compiling where {MAX_SAVED} x eager step x steps <= {MIN_COMPILE_S} s")
        return tags


def worth_measuring(eager_micro_s: float, micro_steps: int, steps: int) -> bool:
    """The bound: could compile repay its least cost over this run even saving ``MAX_SAVED`` of each step?"""
    return MAX_SAVED * eager_micro_s * micro_steps * steps > MIN_COMPILE_S


def pays(eager_s: float, compiled_s: float, compile_s: float, micro_steps: int, steps: int) -> tuple[bool, float]:
    """(on?, seconds saved over the run net of nothing): on where the time saved exceeds the compile time."""
    saved = (eager_s - compiled_s) * micro_steps * steps
    return saved > compile_s, saved


def cache_path() -> Path:
    return pc.cache_path().with_name(CACHE_FILE)


def inductor_cache_dir() -> str:
    """Where inductor keeps its compiled kernels: ``TORCHINDUCTOR_CACHE_DIR`` where the user set it, else
    Conduit's cache (inductor's own default is a folder under /tmp, which a reboot empties, and inductor
    writes that default into the variable once it has looked, so that value counts as unset)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return current
    return str(pc.cache_path().parent / "inductor")


def time_compile(step: Callable[[str], None], repeats: int = REPEATS,
                 barrier: Callable[[], None] = lambda: None) -> dict[str, float]:
    """``step("eager")`` once untimed; ``step("compiled")`` once timed (its compile); then ``repeats`` of
    each interleaved, timed. Returns the eager and compiled medians and the compile time."""
    step("eager")
    barrier()
    t0 = time.perf_counter()
    step("compiled")
    compile_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for kind in ("eager", "compiled"):
            barrier()
            t0 = time.perf_counter()
            step(kind)
            times[kind].append(time.perf_counter() - t0)
    return {"eager": statistics.median(times["eager"]), "compiled": statistics.median(times["compiled"]),
            "compile": compile_s}


def decide(machine: str, key: str, eager_micro_s: float, micro_steps: int, steps: int,
           measure: Callable[[], dict[str, float]], rank: int, world: int, device: torch.device) -> CompileChoice:
    """Every rank's part on a CPU: the bound, then rank 0's cached times or every rank measuring (the
    means over ranks). Every rank returns the same choice."""
    if not worth_measuring(eager_micro_s, micro_steps, steps):
        return CompileChoice(False, "bound", eager_micro_s)
    cached = _read(machine, key) if rank == 0 else None
    word = torch.tensor([1.0, *cached] if cached else [0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=device)
    if world > 1:
        dist.broadcast(word, src=0)
    if word[0].item() == 1.0:
        eager_s, compiled_s, compile_s = word[1:].tolist()
        reason = "cached"
    else:
        m = measure()
        sums = torch.tensor([m["eager"], m["compiled"], m["compile"]], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(sums)
        eager_s, compiled_s, compile_s = (sums / world).tolist()
        reason = "measured"
        if rank == 0:
            try:
                _write(machine, key, eager_s, compiled_s, compile_s)
            except OSError as e:
                print(f"warning: compile auto: could not cache the times in {cache_path()}: {e}", flush=True)
    on, saved = pays(eager_s, compiled_s, compile_s, micro_steps, steps)
    return CompileChoice(on, reason, eager_s, compiled_s, compile_s, saved)


def _read(machine: str, key: str) -> tuple[float, float, float] | None:
    import json

    try:
        entry = json.loads(cache_path().read_text()).get(machine, {}).get(key)
        return float(entry["eager_s"]), float(entry["compiled_s"]), float(entry["compile_s"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _write(machine: str, key: str, eager_s: float, compiled_s: float, compile_s: float) -> None:
    machine_cache.update(cache_path(), (machine, key), {"eager_s": eager_s, "compiled_s": compiled_s,
                                                       "compile_s": compile_s})

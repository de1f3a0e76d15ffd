"""The training workers' ``auto`` settings, decided on the run itself before its engine is built:
``train.precision: auto`` on a CPU (``precision_choice``) and ``train.compile: auto`` (``compile_choice``).

Both time one of the run's own micro-batches (the loader's first, span-corrupted for an encoder-decoder)
forward and backward on fresh copies of the run's model, on every worker at once, so that the threads and
the workers sharing a node are the run's. The copies are freed before the engine's model is built.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models import ModelConfig
from pipeline.config import RunConfig
from pipeline.data import span_corruption
from pipeline.data.span_corruption import corrupt_micro_batches
from pipeline.data.token_blocks import TokenBlocks
from pipeline.training import compile_choice as cc
from pipeline.training import precision_choice as pc
from pipeline.training.layout import ParallelDims
from pipeline.training.loader import BlockLoader


@dataclass
class Decided:
    """What the workers train with, and how each ``auto`` got there (None: the config's value was used)."""

    precision: str
    compile: bool
    precision_choice: pc.PrecisionChoice | None = None
    compile_choice: cc.CompileChoice | None = None
    # auto tags decided without measuring: kept from the checkpoint resumed from, or why nothing was timed
    kept: dict[str, str] | None = None

    def auto_tags(self) -> dict[str, str]:
        auto = dict(self.kept or {})
        if self.precision_choice:
            auto.update(self.precision_choice.tags())
        if self.compile_choice:
            auto.update(self.compile_choice.tags())
        return auto

    def tags(self) -> dict[str, str]:
        return {"precision": self.precision, "compile": str(self.compile).lower(), **self.auto_tags()}

    def record(self) -> dict:
        """``train_precision.json`` (beside the weights and in every checkpoint): the precision and the compile
        trained with, and their ``auto`` tags."""
        auto = self.auto_tags()
        return {"precision": self.precision, "compile": self.compile, **({"auto": auto} if auto else {})}


class _Probe:
    """The run's first micro-batch and models built from the run's seed (made on use), and the rank's world:
    a barrier before each timed call, and the count of timed calls agreed over ranks."""

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, tokens, dims: ParallelDims, device: torch.device,
                 rank: int, world: int, micro_batch=None):
        self.cfg, self.model_cfg, self.tokens, self.dims, self.device = cfg, model_cfg, tokens, dims, device
        self.rank, self.world = rank, world
        self._batch = micro_batch

    def micro_batch(self):
        if self._batch is None:
            loader = BlockLoader(TokenBlocks.of_artifact(self.tokens, "train"), self.dims, self.rank,
                                 seed=self.cfg.run.seed)
            batch = loader.next_step()[0]
            corruption = span_corruption.for_run(self.cfg)
            self._batch = corrupt_micro_batches(corruption, [batch], salt=0)[0] if corruption else batch
        return self._batch

    def model(self) -> torch.nn.Module:
        from models import build_model

        torch.manual_seed(self.cfg.run.seed)
        return build_model(self.model_cfg, device=self.device)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def agree(self, n: int) -> int:
        """The largest ``n`` over ranks, so that every rank times as many micro-steps."""
        if self.world == 1:
            return n
        most = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())


def decide(cfg: RunConfig, model_cfg: ModelConfig, tokens, dims: ParallelDims, device: torch.device, rank: int,
           world: int, local_world: int, precision: str, micro_batch=None, resumed: dict | None = None) -> Decided:
    """The precision (``precision``: the stage's, "auto" on a CPU) and the compile the run trains with.

    Args:
        tokens: the tokenize artifact the loader reads the micro-batch to time from.
        micro_batch: that micro-batch given instead (its inputs then its targets).
        resumed: the record of the checkpoint the run resumes from (``Decided.record``), or None. What it
            trained in is kept for each setting left at ``auto``, on any layout (see ``kept``).
    """
    t = cfg.train
    kept = _kept(resumed, precision, t)
    if kept is not None:
        return kept
    if dims.sp_size > 1:  # a probe would time whole sequences on one rank: not what the run does
        return _unmeasured(precision, t)
    probe = _Probe(cfg, model_cfg, tokens, dims, device, rank, world, micro_batch)
    machine = pc.machine_id() if device.type == "cpu" else ""
    p_choice = None
    if precision == "auto":
        key = pc.shape_key(model_cfg.to_dict(), t.micro_batch_size_per_rank, cfg.tokenize.seq_len,
                           torch.get_num_threads(), local_world, world, t.compile)
        p_choice = _choose_precision(probe, machine, key)
        precision = p_choice.precision
    if t.compile != "auto":
        return Decided(precision, bool(t.compile), p_choice)
    if t.zero_stage == 3:
        return Decided(precision, False, p_choice, cc.CompileChoice(False, "zero3", 0.0))
    if device.type == "cuda":
        return Decided(precision, True, p_choice, cc.CompileChoice(True, "gpu", 0.0))
    if p_choice is not None:
        eager_s = p_choice.amp_bf16_s if precision == "amp_bf16" else p_choice.fp32_s
    else:
        eager_s = _eager_micro_step(probe, precision)
    c_key = pc.shape_key({**model_cfg.to_dict(), "precision": precision}, t.micro_batch_size_per_rank,
                         cfg.tokenize.seq_len, torch.get_num_threads(), local_world, world, False)
    c_choice = _choose_compile(probe, machine, c_key, precision, eager_s)
    return Decided(precision, c_choice.compile, p_choice, c_choice)


SEQUENCE_PARALLEL = "not measured: sequence parallelism"  # the auto tags where nothing was timed


def _unmeasured(precision: str, train) -> Decided:
    """Sequence parallelism: ``auto`` takes fp32 and eager without timing (the probe times a whole micro-batch
    on each rank, while a run splits each sequence over its group and attends across it)."""
    tags = {}
    if precision == "auto":
        precision, tags["precision.auto"] = "fp32", SEQUENCE_PARALLEL
    compile_ = train.compile
    if compile_ == "auto":
        compile_, tags["compile.auto"] = False, SEQUENCE_PARALLEL
    return Decided(precision, bool(compile_), kept=tags)


KEPT = "checkpoint"  # the precision.auto / compile.auto tag of a choice kept from the checkpoint resumed from


def _kept(resumed: dict | None, precision: str, train) -> Decided | None:
    """A resumed run keeps what its checkpoint trained in, for every setting left at ``auto``: the same
    precision whatever the new layout (a run that changed precision halfway would not be the run it
    continues), and no time spent measuring again. None where there is nothing to keep: no checkpoint, one
    from before the record was kept, or a precision that ``auto`` cannot choose here (a GPU run's bf16
    resumed on a CPU), and then the run chooses afresh."""
    if not resumed:
        return None
    was, auto = resumed.get("precision"), resumed.get("auto") or {}
    kept_now: list[str] = []
    if precision == "auto":  # a CPU: auto chooses between fp32 and amp_bf16
        if was not in pc.CANDIDATES:
            return None
        precision = was
        kept_now.append("precision.auto")
    compile_ = train.compile
    if compile_ == "auto":
        if not isinstance(resumed.get("compile"), bool):
            return None
        compile_ = resumed["compile"] and train.zero_stage != 3
        kept_now.append("compile.auto")
    tags = {k: str(v) for k, v in auto.items() if k.startswith(tuple(kept_now))}
    tags.update({name: KEPT for name in kept_now})
    if "compile.auto" in tags and train.zero_stage == 3:
        tags["compile.auto"] = "zero3"
    return Decided(precision, bool(compile_), kept=tags)


def _choose_precision(probe: _Probe, machine: str, key: str) -> pc.PrecisionChoice:
    def measure() -> dict[str, float]:
        model = probe.model()
        try:
            step = pc.micro_step(model, probe.micro_batch(), probe.device, probe.cfg.train.loss_chunk_tokens)
            return pc.time_micro_steps(step, barrier=probe.barrier, agree=probe.agree)
        finally:
            del model
            gc.collect()

    return pc.decide(machine, key, measure, probe.rank, probe.world, probe.device)


def _choose_compile(probe: _Probe, machine: str, key: str, precision: str, eager_s: float) -> cc.CompileChoice:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cc.inductor_cache_dir()  # kept across runs
    t = probe.cfg.train

    def measure() -> dict[str, float]:
        from pipeline.training.parallelize import compile_regions

        eager, compiled = probe.model(), probe.model()
        compile_regions(compiled)
        try:
            steps = {kind: pc.micro_step(m, probe.micro_batch(), probe.device, t.loss_chunk_tokens)
                     for kind, m in (("eager", eager), ("compiled", compiled))}
            return cc.time_compile(lambda kind: steps[kind](precision), barrier=probe.barrier)
        finally:
            del eager, compiled, steps
            gc.collect()

    return cc.decide(machine, key, eager_s, probe.dims.grad_accum_steps, t.steps, measure, probe.rank, probe.world,
                     probe.device)


def _eager_micro_step(probe: _Probe, precision: str) -> float:
    """A forced precision: its micro-step timed here (one untimed, three timed), the mean over ranks."""
    import statistics
    import time

    model = probe.model()
    try:
        step = pc.micro_step(model, probe.micro_batch(), probe.device, probe.cfg.train.loss_chunk_tokens)
        step(precision)
        times = []
        for _ in range(3):
            probe.barrier()
            t0 = time.perf_counter()
            step(precision)
            times.append(time.perf_counter() - t0)
    finally:
        del model
        gc.collect()
    mean = torch.tensor([statistics.median(times)], dtype=torch.float64, device=probe.device)
    if probe.world > 1:
        dist.all_reduce(mean)
    return mean.item() / probe.world


def resolved_train(train, decided: Decided):
    """The train section with ``compile`` as decided (what ``parallelize`` reads)."""
    return dataclasses.replace(train, compile=decided.compile)

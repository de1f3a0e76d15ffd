"""Each rank's training function: one DeepSpeed engine per rank, trained on packed token blocks.

``main(config)`` gets everything through its argument, a ``pipeline.training.launch.LoopConfig`` built by
the train stage (its docstring lists the fields); ``pipeline.training.launch`` runs it on Ray Train's
workers, or in the stage's task.

Checkpoints (every ``checkpoint.every`` steps, when ``checkpoint.every_s`` has passed at a log step, at a
sweep's rung steps, and at the end) go to the training's record (``pipeline.training.checkpoint``), which a
restarted attempt resumes from, exactly. A checkpoint also carries rank 0's metric history and the steps
the group (re)started at, so that after a restart ``train_metrics.json`` is whole and
``train_starts.json`` says where each start began.

``main`` reads as its steps: set up the rank (``_setup``), restore (``CheckpointManager.restore``),
tag the run with what MFU is computed from (``_start_tracking``), train (``_train``: each step's
update, validation, logging and checkpoint), and write the weights (``_export``).

With ``validation.every``, every rank scores its share of a fixed validation subset at those steps
(``pipeline.training.validation``); ``val_loss`` joins that step's metrics, and
``validation.early_stop_patience`` may end training early.

Rank 0 hands its live metrics to an ``Outbox``: training never waits for MLflow and never dies from
it; what a server that is down could not take is delivered when it answers again.

Tests only, ``LoopConfig.failpoints``: ``{"pause_after_final_checkpoint_s": s}`` holds every rank still for s
seconds right after the final checkpoint, for a test to SIGKILL one there; ``{"fail_once_after_step":
{"step": n, "marker": path}}`` raises once after step n.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from models import ModelConfig
from models.accounting import flops_per_token
from models.export import save_safetensors
from pipeline.config import RunConfig, config_from_dict
from pipeline.data import span_corruption
from pipeline.data.span_corruption import SpanCorruption, corrupt_micro_batches
from pipeline.data.token_blocks import TokenBlocks
from pipeline.store.contracts import (INIT_DIGEST_TAG, TRAIN_METRICS_FILE, WEIGHTS_FILE, state_digest,
                                      write_train_metrics, write_train_precision, write_train_starts)
from pipeline.training import autotune
from pipeline.training.checkpoint import CheckpointManager, CheckpointRecord, precision_record, resume_checkpoint
from pipeline.training.engine import (
    build_engine, engine_zero_stage, full_state_dict, local_threads, loss_definition, train_step,
)
from pipeline.training.device import assigned_cpus
from pipeline.training.loop_config import LoopConfig
from pipeline.training.layout import ParallelDims
from pipeline.training.loader import BlockLoader
from pipeline.training.metrics import MoEStats, peak_flops_per_worker, peak_memory_gib, score_bias_metrics
from pipeline.training.outbox import Outbox
from pipeline.training.validation import stop_early, validation_loss

FLUSH_TIMEOUT_S = 300.0  # at the end, how long to wait for MLflow to take what is still queued


# DeepSpeed's ZeRO gathers with torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates
# (for all_gather_single) with a FutureWarning per rank: DeepSpeed's call, not ours, so that one
# message is filtered in the training workers.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)


@dataclass
class _Rank:
    """One rank's training: what it was built with, and what it has done so far."""

    config: LoopConfig
    cfg: RunConfig
    model_cfg: ModelConfig
    rank: int
    world: int
    device: torch.device
    dims: ParallelDims
    engine: Any
    scheduler: Any
    loader: BlockLoader
    corruption: SpanCorruption | None  # None unless the model is an encoder-decoder
    checkpoints: CheckpointManager
    precision: str  # resolved: what the engine trains in
    decided: autotune.Decided | None = None  # the precision and compile trained with, and how auto chose them
    start_step: int = 0
    history: list[dict] = field(default_factory=list)  # rank 0's logged metrics, one dict per logged step
    starts: list[int] = field(default_factory=list)  # the step each start of this training began at
    val_blocks: TokenBlocks | None = None
    val_losses: list[float] = field(default_factory=list)
    stopped: bool = False
    tracker: Outbox | None = None
    flops_per_token: float = 0.0
    cluster_peak: float = 0.0
    moe_stats: MoEStats | None = None
    window_t0: float = 0.0
    window_tokens: int = 0
    last_checkpoint: float = 0.0


def main(config: LoopConfig) -> None:
    if config.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported: its accelerator is fixed then
    outbox = _rank0_outbox(config)
    try:
        _main(config, outbox)
    except BaseException:
        # A restart in the same process (pipeline.training.launch, in the stage's task) opens a new outbox, which asks MLflow which
        # steps the run holds: what this attempt logged must be there first, or it would be sent twice. A
        # cancelled task's process (KeyboardInterrupt) runs other tasks after: its sender thread ends here.
        if outbox is not None:
            outbox.close(timeout_s=FAILED_FLUSH_TIMEOUT_S)
        raise


FAILED_FLUSH_TIMEOUT_S = 30.0  # a failed attempt's wait for its queued metrics (MLflow may be the failure)


def _main(config: LoopConfig, outbox: Outbox | None) -> None:
    phase = (lambda text: outbox.set_tags({PHASE_TAG: text})) if outbox is not None else (lambda text: None)
    cfg = config_from_dict(config.run_config)
    phase("building the model and DeepSpeed's engine" + (" (DeepSpeed compiles its CPU Adam op on a node's "
                                                         "first run)" if cfg.train.offload_optimizer else ""))
    run = _setup(config)
    run.tracker = outbox
    if outbox is not None:
        outbox.set_tags({**run.decided.tags(), "threads_per_worker": str(torch.get_num_threads())})
    restored = run.checkpoints.restore(on_load=lambda where: phase(f"loading the checkpoint {Path(where).name}"))
    if restored.loader_state is not None:
        run.loader.load_state_dict(restored.loader_state)
    run.start_step, run.history, run.starts = restored.step, restored.history, restored.starts
    if run.rank == 0:
        print(f"training from step {run.start_step}" + (f" ({run.checkpoints.resume.path})" if run.start_step else ""),
              flush=True)
    if outbox is not None and config.init_state is not None and run.start_step == 0 \
            and run.engine.zero_optimization_stage() < 3 and run.dims.ep_size == 1:  # else a rank holds a part
        # train.init_from: the weights training starts from, by digest (the lineage test compares the parent's)
        outbox.set_tags({INIT_DIGEST_TAG: state_digest(run.engine.module.state_dict())})
    if outbox is not None:  # the steps before the checkpoint, for a run that lacks them (a new driver's)
        for entry in run.history:
            outbox.log_metrics({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])
    _prepare_validation(run)
    _start_tracking(run)
    monitor = _system_metrics(run)
    phase(TRAINING_PHASE)
    try:
        _train(run)
        phase("writing the model")
        _export(run)
    finally:
        if monitor is not None:
            monitor.finish()


PHASE_TAG = "conduit.phase"  # on the train stage's run: what training is doing (the driver's status line)
TRAINING_PHASE = "training"


def _rank0_outbox(config: LoopConfig) -> Outbox | None:
    """Rank 0's outbox to the stage's MLflow run (metrics, tags, phases), started before anything slow."""
    import ray.train

    if ray.train.get_context().get_world_rank() != 0:
        return None
    return Outbox(config.tracker, once_per_step="loss")  # a restart re-logs no step the run holds


def _system_metrics(run: _Rank):
    """On each node's first worker: MLflow's system metrics monitor (CPU, memory, disk, network and GPU
    use, ``system/...``) on the train run, a sample every ``tracking.system_metrics_every_s``; the
    node's number in the names when there are several nodes. None when off, or on other workers."""
    import ray.train

    every = run.cfg.tracking.system_metrics_every_s
    ctx = ray.train.get_context()
    if not every or ctx.get_local_rank() != 0:
        return None
    from pipeline import tracking

    tracker = run.config.tracker
    several = run.world > ctx.get_local_world_size()
    return tracking.start_system_metrics(tracker.run_id, tracker.uri, every,
                                         node_id=f"node{ctx.get_node_rank()}" if several else None)


def _setup(config: LoopConfig) -> _Rank:
    """The rank's threads, device, engine, loader and checkpoint manager, from the stage's loop config."""
    import ray
    import ray.train

    cfg = config_from_dict(config.run_config)
    t = cfg.train
    ctx = ray.train.get_context()
    rank, world = dist.get_rank(), dist.get_world_size()
    reserved = assigned_cpus()  # the stage's worker_cpus (None where the stage was called outside Ray: tests)
    torch.set_num_threads(local_threads(ctx.get_local_world_size(), cfg.parallel.threads_per_worker, reserved))
    device = torch.device("cuda", ctx.get_local_rank()) if config.device == "cuda" else torch.device("cpu")
    model_cfg = cfg.model_config()
    dims = ParallelDims(world, cfg.parallel.ep_size, t.global_batch_size, t.micro_batch_size_per_rank,
                        cfg.tokenize.seq_len, cfg.parallel.sequence_parallel_size)
    record = CheckpointRecord(config.checkpoints)
    resume = resume_checkpoint(record, cfg.checkpoint.resume_from, warn=lambda m: rank == 0 and print(m, flush=True))
    # precision auto (on a CPU) and compile auto: what the checkpoint resumed from trained in, else timed on
    # this run's own micro-steps, on every worker at once
    decided = autotune.decide(cfg, model_cfg, config.tokens, dims, device, rank, world,
                              ctx.get_local_world_size(), config.precision, resumed=precision_record(resume))
    precision, t = decided.precision, autotune.resolved_train(t, decided)
    init_state = None
    if config.init_state is not None:  # train.init_from: the parent's weights, in Ray's object store
        init_state = ray.get(config.init_state)
    engine, scheduler = build_engine(model_cfg, t, cfg.optimizer, dims, precision=precision, device=device,
                                     seed=cfg.run.seed, init_state=init_state)
    # The stage the engine runs (engine_zero_stage): what DeepSpeed's own checkpoint files depend on.
    layout = {"world_size": world, "ep_size": dims.ep_size,
              "zero_stage": engine_zero_stage(t, dims, precision)}
    if model_cfg.num_experts:  # checkpoints from before the experts were stacked resume through canonical.pt
        layout["experts"] = "stacked"
    if dims.sp_size > 1:  # the same weights on every rank of a group, but DeepSpeed partitions over all ranks
        layout["sp_size"] = dims.sp_size
    checkpoints = CheckpointManager(engine, scheduler, layout, record, resume, precision=decided.record())
    # Each rank reads only its blocks, where the artifact is: in place, or ranged reads of the object store.
    loader = BlockLoader(TokenBlocks.of_artifact(config.tokens, "train"), dims, rank, seed=cfg.run.seed)
    return _Rank(config=config, cfg=cfg, model_cfg=model_cfg, rank=rank, world=world, device=device, dims=dims,
                 engine=engine, scheduler=scheduler, loader=loader, corruption=span_corruption.for_run(cfg),
                 checkpoints=checkpoints, precision=precision, decided=decided)


def _prepare_validation(run: _Rank) -> None:
    """The validation blocks, and the losses and early stop of the restored history (every rank has it)."""
    va = run.cfg.validation
    if va.every:
        run.val_blocks = TokenBlocks.of_artifact(run.config.tokens, "validation")
    run.val_losses = [h["val_loss"] for h in run.history if "val_loss" in h]
    run.stopped = stop_early(run.val_losses, va.early_stop_patience)  # a run resumed after it had stopped


def _start_tracking(run: _Rank) -> None:
    """Rank 0's outbox to MLflow, and the tags MFU is computed from (every worker's peak, summed)."""
    run.flops_per_token = flops_per_token(run.model_cfg, run.cfg.tokenize.seq_len)["total"]
    peak, peak_source = peak_flops_per_worker(run.device, run.precision)
    cluster_peak = torch.tensor(peak, dtype=torch.float64, device=run.device)
    dist.all_reduce(cluster_peak)  # MFU's denominator: every worker's peak, summed
    run.cluster_peak = cluster_peak.item()
    run.moe_stats = MoEStats() if run.model_cfg.is_moe else None
    if run.rank == 0:
        # repr: every digit, so that mfu = tokens_per_s * mfu.flops_per_token / mfu.peak_flops can be checked.
        run.tracker.set_tags({"mfu.peak_flops": repr(run.cluster_peak), "mfu.peak_source": peak_source,
                              "mfu.flops_per_token": run.flops_per_token,
                              "mfu.formula": "6N + 6*L*H*(Q+V)*T (PaLM app. B; Q = V = head_dim but for MLA)",
                              "train.loss": loss_definition(run.cfg.train.label_smoothing)})


def _train(run: _Rank) -> None:
    """The steps from where training (re)starts: update, validate, log, checkpoint, each when due."""
    from tqdm import tqdm

    t, every = run.cfg.train, run.cfg.checkpoint.every
    bar = tqdm(total=t.steps, initial=run.start_step, desc="train", unit="step",
               disable=run.rank != 0 or not t.progress_bar, mininterval=1.0)
    run.window_t0, run.window_tokens, run.last_checkpoint = time.perf_counter(), 0, time.monotonic()
    for step in range(run.start_step, t.steps):
        if run.stopped:
            break
        batches = run.loader.next_step()
        if run.corruption is not None:  # an encoder-decoder: each block span-corrupted, fresh noise per step
            batches = corrupt_micro_batches(run.corruption, batches, salt=step)
        loss = train_step(run.engine, batches, run.device, run.moe_stats, t.label_smoothing, t.loss_chunk_tokens)
        run.window_tokens += run.dims.global_batch_tokens
        done = step + 1
        val_loss = _validate(run, done)
        due_by_time = False
        if done % t.log_every == 0 or done == t.steps:
            due_by_time = _log(run, done, loss, val_loss, bar)
        if run.stopped and run.rank == 0:
            print(f"early stop at step {done}: no better validation loss in the last "
                  f"{run.cfg.validation.early_stop_patience} "
                  f"validations (best {min(run.val_losses):.4f})", flush=True)
        if done == t.steps or run.stopped or due_by_time or (every and done % every == 0) \
                or done in run.config.checkpoint_steps:
            run.last_checkpoint = time.monotonic()
            run.checkpoints.save(done, run.loader.state_dict(), run.history, run.starts)
            if done == t.steps:
                time.sleep(run.config.failpoints.get("pause_after_final_checkpoint_s", 0))
        if val_loss is not None and run.config.report_validation:
            # after the step's checkpoint: a sweep's scheduler may end the trial on this report and
            # resume it later from that checkpoint. Every rank, at the same step (Ray Train's report is
            # collective); in the stage's task the launch takes it (LoopConfig.report).
            import ray.train

            (run.config.report or ray.train.report)({"step": done, "val_loss": val_loss})
        _fail_once(run.config.failpoints.get("fail_once_after_step"), done)
        bar.update(1)
    bar.close()


def _fail_once(failpoint: dict | None, done: int) -> None:
    """Tests only: ``{"step": n, "marker": path}`` raises once, after step n (and its checkpoint, if one is
    due), in the first process to get there (it creates ``marker``; the restarted attempt finds it)."""
    if not failpoint or done != failpoint["step"]:
        return
    try:
        Path(failpoint["marker"]).touch(exist_ok=False)
    except FileExistsError:
        return
    raise RuntimeError(f"failpoint: fail_once_after_step {done}")


def _validate(run: _Rank, done: int) -> float | None:
    """At ``validation.every`` steps (log steps too, the config makes sure): the validation loss, and
    whether training stops early."""
    va = run.cfg.validation
    if not (va.every and done % va.every == 0):
        return None
    val_loss = validation_loss(run.engine, run.val_blocks, run.dims, run.rank, va.batches, run.device,
                               dist.all_reduce, run.corruption, run.cfg.train.loss_chunk_tokens)
    run.val_losses.append(val_loss)
    run.stopped = stop_early(run.val_losses, va.early_stop_patience)
    return val_loss


def _log(run: _Rank, done: int, loss: torch.Tensor, val_loss: float | None, bar) -> bool:
    """A log step: the global batch's loss, throughput and MFU to rank 0's history and MLflow. Returns
    whether ``checkpoint.every_s`` has passed (rank 0's clock decides, so every rank agrees)."""
    t = run.cfg.train
    # One all-reduce: the global batch's loss (the mean over ranks) and rank 0's word on the checkpoint clock.
    every_s = run.cfg.checkpoint.every_s
    late = run.rank == 0 and every_s > 0 and time.monotonic() - run.last_checkpoint >= every_s
    reduced = torch.stack([loss.detach().float(), torch.tensor(float(late), device=loss.device)])
    dist.all_reduce(reduced)
    elapsed = time.perf_counter() - run.window_t0
    tokens_per_s = run.window_tokens / elapsed
    metrics = {
        "loss": reduced[0].item() / run.world,
        "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": float(run.engine.get_global_grad_norm() or 0.0),
        "tokens_per_s": tokens_per_s,
        "model_tflops_per_s": tokens_per_s * run.flops_per_token / 1e12,
        "mfu": tokens_per_s * run.flops_per_token / run.cluster_peak,
        "peak_memory_gib": peak_memory_gib(run.device),  # rank 0's
    }
    if val_loss is not None:
        metrics["val_loss"] = val_loss
    if run.moe_stats is not None:
        run.moe_stats.all_reduce()
        metrics.update(run.moe_stats.metrics())
        metrics.update(score_bias_metrics(run.engine.module))
        run.moe_stats = MoEStats()
    run.window_t0, run.window_tokens = time.perf_counter(), 0
    if run.rank == 0:
        run.history.append({"step": done, **metrics})
        run.tracker.log_metrics(metrics, step=done)
        loss_name = "smoothed_loss" if t.label_smoothing else "loss"
        bar.set_postfix(**{loss_name: f"{metrics['loss']:.3f}"}, tok_s=f"{metrics['tokens_per_s']:.0f}")
    return bool(reduced[1].item())


def _export(run: _Rank) -> None:
    """The consolidated weights (every rank joins the gather), written by rank 0 with the metric history
    and the starts into the stage's folder, which may be on another node; then MLflow's queue flushed."""
    state = full_state_dict(run.engine, run.cfg.train.zero_stage)
    if run.rank != 0:
        return
    out = run.config.out
    with tempfile.TemporaryDirectory(prefix="conduit-train-out-") as tmp:
        save_safetensors(state, run.model_cfg, Path(tmp) / WEIGHTS_FILE)
        write_train_metrics(Path(tmp), run.history)
        write_train_starts(Path(tmp), run.starts)
        write_train_precision(Path(tmp), run.decided.record())
        out.put(tmp)
    undelivered = run.tracker.close(timeout_s=FLUSH_TIMEOUT_S)
    if undelivered:
        print(f"warning: MLflow at {run.config.tracker.uri} did not answer for {FLUSH_TIMEOUT_S:.0f} s; "
              f"{undelivered} logged steps are not in the run but are in {Path(out.path) / TRAIN_METRICS_FILE}",
              flush=True)

"""The Ray Train worker function: one DeepSpeed engine per rank, trained on packed token blocks.

``main(config)`` gets everything through its argument (a plain dict built by the train stage):
    run_config     the resolved RunConfig as a dict
    tokens         the tokenize ``Artifact``; each rank reads only the blocks it trains on
                   (``pipeline.data.token_blocks``: memory-mapped in place for a local artifact root,
                   ranged reads of the shards in an object store, nothing fetched whole)
    out            the train artifact's folder, a ``pipeline.storage.NodeFolder`` on the stage's node,
                   where rank 0 puts the weights and the metric history (``pipeline.stage_io``)
    tracker        a StageTracker for live metrics (rank 0 only logs)
    device         "cpu" or "cuda" (resolved by the stage)
    precision      "fp32" / "bf16" / "fp16" (resolved)
    failpoints     tests only: {"pause_after_final_checkpoint_s": s} holds every rank still for s seconds
                   right after the final checkpoint of a first start, for a test to SIGKILL one there

Checkpoints (every ``train.checkpoint_every`` steps and at the end) are reported to Ray Train, so
``FailureConfig(max_failures)`` restarts the workers from the latest one, exactly. A checkpoint also
carries rank 0's metric history and the steps the group (re)started at, so that after a restart
``train_metrics.json`` is whole and ``train_starts.json`` says where each start began.

With ``train.eval_every``, every rank scores its share of a fixed validation subset at those steps
(``pipeline.training.validation``); ``val_loss`` joins that step's metrics, and
``train.early_stop_patience`` may end training early.

Rank 0 hands its live metrics to an ``Outbox``: training never waits for MLflow and never dies from
it; what a server that is down could not take is delivered when it answers again.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from models.accounting import flops_per_token
from models.export import save_safetensors
from pipeline.config import config_from_dict
from pipeline.data.token_blocks import TokenBlocks
from pipeline.stage_io import TRAIN_METRICS_FILE, WEIGHTS_FILE, write_train_metrics, write_train_starts
from pipeline.training.canonical import load_canonical, save_canonical
from pipeline.training.checksums import verify_checkpoint, write_checksums
from pipeline.training.resume import usable_checkpoint
from pipeline.data import span_corruption
from pipeline.data.span_corruption import corrupt_micro_batches
from pipeline.training.data import BlockLoader
from pipeline.training.engine import (
    build_engine, engine_zero_stage, full_state_dict, load_state, local_threads, loss_definition, save_state,
    train_step,
)
from pipeline.training.metrics import MoEStats, peak_flops_per_worker, peak_memory_gib
from pipeline.training.outbox import Outbox
from pipeline.training.parallel import ParallelDims
from pipeline.training.validation import stop_early, validation_loss

LAYOUT_FILE = "layout.json"
RUN_LOG_FILE = "run_log.json"  # in a checkpoint: rank 0's metric history and the steps training started at
FLUSH_TIMEOUT_S = 300.0  # at the end, how long to wait for MLflow to take what is still queued


# DeepSpeed's ZeRO gathers with torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates
# (for all_gather_single) with a FutureWarning per rank: DeepSpeed's call, not ours, so that one
# message is filtered in the training workers.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)


def main(config: dict) -> None:
    if config["device"] == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported: its accelerator is fixed then
    import ray.train
    from tqdm import tqdm

    cfg = config_from_dict(config["run_config"])
    t = cfg.train
    ctx = ray.train.get_context()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(local_threads(ctx.get_local_world_size(), cfg.parallel.threads_per_worker))
    device = torch.device("cuda", ctx.get_local_rank()) if config["device"] == "cuda" else torch.device("cpu")

    model_cfg = cfg.model_config()
    dims = ParallelDims(world, cfg.parallel.ep_size, t.global_batch_size, t.micro_batch_size_per_rank,
                        cfg.tokenize.seq_len)
    engine, scheduler = build_engine(model_cfg, t, dims, precision=config["precision"], device=device,
                                     seed=cfg.run.seed)
    corruption = span_corruption.for_run(cfg)  # None unless the model is an encoder-decoder
    # Each rank reads only its blocks, where the artifact is: in place, or ranged reads of the object store.
    loader = BlockLoader(TokenBlocks.of_artifact(config["tokens"], "train"), dims, rank, seed=cfg.run.seed)
    start_step = 0
    history: list[dict] = []  # rank 0's logged metrics, one dict per logged step
    starts: list[int] = []  # the step each start of this training began at
    # The stage the engine runs (engine_zero_stage): what DeepSpeed's own checkpoint files depend on.
    layout = {"world_size": world, "ep_size": dims.ep_size,
              "zero_stage": engine_zero_stage(t, dims, config["precision"])}
    resume = ray.train.get_checkpoint()  # set when Ray Train restarts this worker group
    if resume is not None:  # its latest; one that does not verify gives way to the newest earlier one
        resume = usable_checkpoint(resume, verify_checkpoint, warn=lambda m: rank == 0 and print(m, flush=True))
    if resume is None and t.resume_from:  # continue another run, on this run's layout
        resume = ray.train.Checkpoint(t.resume_from)
    if resume is not None:
        with resume.as_directory() as ckpt_dir:
            verify_checkpoint(ckpt_dir)  # before anything of it is read: DeepSpeed's loader unpickles
            saved = json.loads((Path(ckpt_dir) / LAYOUT_FILE).read_text())
            if saved == layout:  # DeepSpeed's own checkpoint: bit-exact
                start_step, loader_state = load_state(engine, ckpt_dir)
            else:  # another world size, ZeRO stage or ep_size: the layout-independent one
                start_step, loader_state = load_canonical(engine, ckpt_dir, scheduler=scheduler)
            run_log = Path(ckpt_dir) / RUN_LOG_FILE
            if run_log.is_file():  # absent in checkpoints written before it existed
                saved_log = json.loads(run_log.read_text())
                history = [h for h in saved_log["history"] if h["step"] <= start_step]
                starts = saved_log["starts"]
        loader.load_state_dict(loader_state)
    starts.append(start_step)
    val_blocks = None
    if t.eval_every:
        val_blocks = TokenBlocks.of_artifact(config["tokens"], "validation")
    val_losses = [h["val_loss"] for h in history if "val_loss" in h]  # every rank has the restored history
    stopped = stop_early(val_losses, t.early_stop_patience)  # a run resumed after it had stopped

    tracker = Outbox(config["tracker"]) if rank == 0 else None
    flops_tok = flops_per_token(model_cfg, cfg.tokenize.seq_len)["total"]
    peak, peak_source = peak_flops_per_worker(device, config["precision"])
    cluster_peak = torch.tensor(peak, dtype=torch.float64, device=device)
    dist.all_reduce(cluster_peak)  # MFU's denominator: every worker's peak, summed
    if rank == 0:
        # repr: every digit, so that mfu = tokens_per_s * mfu.flops_per_token / mfu.peak_flops can be checked.
        tracker.set_tags({"mfu.peak_flops": repr(cluster_peak.item()), "mfu.peak_source": peak_source,
                          "mfu.flops_per_token": flops_tok,
                          "mfu.formula": "6N + 6*L*H*(Q+V)*T (PaLM app. B; Q = V = head_dim but for MLA)",
                          "train.loss": loss_definition(t.label_smoothing)})
    moe_stats = MoEStats() if model_cfg.is_moe else None
    bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step",
               disable=rank != 0 or not t.progress_bar, mininterval=1.0)
    window_t0, window_tokens = time.perf_counter(), 0
    last_checkpoint = time.monotonic()
    for step in range(start_step, t.steps):
        if stopped:
            break
        batches = loader.next_step()
        if corruption is not None:  # an encoder-decoder: each block span-corrupted, fresh noise per step
            batches = corrupt_micro_batches(corruption, batches, salt=step)
        loss = train_step(engine, batches, device, moe_stats, t.label_smoothing)
        window_tokens += dims.global_batch_tokens
        done = step + 1
        due_by_time = False
        val_loss = None
        if t.eval_every and done % t.eval_every == 0:  # a log step too (the config makes sure)
            val_loss = validation_loss(engine, val_blocks, dims, rank, t.eval_batches, device, dist.all_reduce,
                                       corruption)
            val_losses.append(val_loss)
            stopped = stop_early(val_losses, t.early_stop_patience)
        if done % t.log_every == 0 or done == t.steps:
            # One all-reduce: the global batch's loss (the mean over ranks) and rank 0's word on whether
            # train.checkpoint_every_s has passed (the ranks' clocks differ; all must agree).
            late = (rank == 0 and t.checkpoint_every_s > 0
                    and time.monotonic() - last_checkpoint >= t.checkpoint_every_s)
            reduced = torch.stack([loss.detach().float(), torch.tensor(float(late), device=loss.device)])
            dist.all_reduce(reduced)
            loss, due_by_time = reduced[0], bool(reduced[1].item())
            elapsed = time.perf_counter() - window_t0
            metrics = {
                "loss": loss.item() / world,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                "tokens_per_s": window_tokens / elapsed,
                "model_tflops_per_s": window_tokens / elapsed * flops_tok / 1e12,
                "mfu": window_tokens / elapsed * flops_tok / cluster_peak.item(),
                "peak_memory_gib": peak_memory_gib(device),  # rank 0's
            }
            if val_loss is not None:
                metrics["val_loss"] = val_loss
            if moe_stats is not None:
                moe_stats.all_reduce()
                metrics.update(moe_stats.metrics())
                moe_stats = MoEStats()
            window_t0, window_tokens = time.perf_counter(), 0
            if rank == 0:
                history.append({"step": done, **metrics})
                tracker.log_metrics(metrics, step=done)
                loss_name = "smoothed_loss" if t.label_smoothing else "loss"
                bar.set_postfix(**{loss_name: f"{metrics['loss']:.3f}"}, tok_s=f"{metrics['tokens_per_s']:.0f}")
        if stopped and rank == 0:
            print(f"early stop at step {done}: no better validation loss in the last {t.early_stop_patience} "
                  f"validations (best {min(val_losses):.4f})", flush=True)
        if done == t.steps or stopped or due_by_time or (t.checkpoint_every and done % t.checkpoint_every == 0):
            last_checkpoint = time.monotonic()
            _checkpoint(engine, scheduler, done, loader.state_dict(), layout, {"history": history, "starts": starts})
            if done == t.steps:
                time.sleep(config.get("failpoints", {}).get("pause_after_final_checkpoint_s", 0))
        bar.update(1)
    bar.close()

    state = full_state_dict(engine, t.zero_stage)
    if rank == 0:
        out = config["out"]
        # Written here, then put into the stage's folder, which may be on another node.
        with tempfile.TemporaryDirectory(prefix="conduit-train-out-") as tmp:
            save_safetensors(state, model_cfg, Path(tmp) / WEIGHTS_FILE)
            write_train_metrics(Path(tmp), history)
            write_train_starts(Path(tmp), starts)
            out.put(tmp)
        undelivered = tracker.close(timeout_s=FLUSH_TIMEOUT_S)
        if undelivered:
            print(f"warning: MLflow at {config['tracker'].uri} did not answer for {FLUSH_TIMEOUT_S:.0f} s; "
                  f"{undelivered} logged steps are not in the run but are in {Path(out.path) / TRAIN_METRICS_FILE}",
                  flush=True)


def _checkpoint(engine, scheduler, step: int, loader_state: dict, layout: dict, run_log: dict) -> None:
    """Every rank saves its part into its own folder; Ray Train merges them into one checkpoint.

    Beside DeepSpeed's checkpoint (resumes bit-exactly onto the same layout) rank 0 writes the
    layout and a layout-independent ``canonical.pt`` for resuming on another number of workers,
    ZeRO stage or expert-parallel size. Each rank then records its files' checksums
    (``pipeline.training.checksums``).
    """
    import ray.train

    with tempfile.TemporaryDirectory() as tmp:
        save_state(engine, tmp, step=step, loader_state=loader_state)
        save_canonical(engine, tmp, step=step, scheduler=scheduler, loader_state=loader_state)
        if dist.get_rank() == 0:
            (Path(tmp) / LAYOUT_FILE).write_text(json.dumps(layout))
            (Path(tmp) / RUN_LOG_FILE).write_text(json.dumps(run_log))
        write_checksums(tmp, dist.get_rank())  # last: what verify_checkpoint checks before a resume loads it
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))

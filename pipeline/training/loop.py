"""The Ray Train worker function: one DeepSpeed engine per rank, trained on packed token blocks.

``main(config)`` gets everything through its argument (a plain dict built by the train stage):
    run_config     the resolved RunConfig as a dict
    tokens_dir     the tokenize artifact folder
    out_dir        where rank 0 writes model.safetensors and train_metrics.json
    tracker        a StageTracker for live metrics (rank 0 only logs)
    device         "cpu" or "cuda" (resolved by the stage)
    precision      "fp32" / "bf16" / "fp16" (resolved)
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from models import build_model
from models.accounting import flops_per_token
from models.export import save_safetensors
from models.loss import lm_loss
from models.schedules import lr_multiplier
from pipeline.config import config_from_dict
from pipeline.training.data import BlockLoader
from pipeline.training.ds_config import build_ds_config
from pipeline.training.parallel import ParallelDims


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decoupled weight decay on matrices only (not norms, biases or embeddings)."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay, other = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (other if p.ndim < 2 or id(p) in no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def _schedule_kwargs(cfg) -> dict:
    t = cfg.train
    if t.schedule == "inverse_sqrt":
        return {"d_model": cfg.model_config().d_model, "warmup": max(1, t.warmup_steps)}
    if t.schedule == "constant":
        return {}
    return {"warmup": t.warmup_steps, "total": t.steps, "min_ratio": t.min_lr_ratio}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(config: dict) -> None:
    if config["device"] == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported: its accelerator is fixed then
    import deepspeed
    import ray.train
    from tqdm import tqdm

    cfg = config_from_dict(config["run_config"])
    t = cfg.train
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = ray.train.get_context().get_local_world_size()
    torch.set_num_threads(cfg.parallel.threads_per_worker or max(1, (os.cpu_count() or 1) // local_world))
    device = torch.device("cuda", ray.train.get_context().get_local_rank()) if config["device"] == "cuda" else torch.device("cpu")

    model_cfg = cfg.model_config()
    dims = ParallelDims(world, cfg.parallel.ep_size, t.global_batch_size, t.micro_batch_size_per_rank, cfg.tokenize.seq_len)
    seed_everything(cfg.run.seed)  # the same initial weights on every rank
    model = build_model(model_cfg, device=device)
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2))
    kw = _schedule_kwargs(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(t.schedule, s + 1, **kw))
    ds_config = build_ds_config(dims=dims, zero_stage=t.zero_stage, precision=config["precision"], grad_clip=t.grad_clip)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)

    loader = BlockLoader(Path(config["tokens_dir"]) / "train.tokens.npy", dims, rank, seed=cfg.run.seed)
    start_step = 0
    resume = ray.train.get_checkpoint()
    if resume is not None:
        with resume.as_directory() as ckpt_dir:
            _, client_state = engine.load_checkpoint(ckpt_dir, tag="latest_conduit")
        loader.load_state_dict(client_state["loader"])
        start_step = client_state["step"]
        torch.set_rng_state(client_state["torch_rng"])

    tracker = config["tracker"] if rank == 0 else None
    flops_tok = flops_per_token(model_cfg, cfg.tokenize.seq_len)["total"]
    history: list[dict] = []
    bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step",
               disable=rank != 0 or not t.progress_bar, mininterval=1.0)
    window_t0, window_tokens = time.perf_counter(), 0
    for step in range(start_step, t.steps):
        losses = []
        for inputs_BT, targets_BT in loader.next_step():
            out = engine(inputs_BT.to(device))
            loss = lm_loss(out.logits.float(), targets_BT.to(device)) + out.aux_loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        window_tokens += dims.global_batch_tokens
        done = step + 1
        if done % t.log_every == 0 or done == t.steps:
            mean_loss = torch.stack(losses).mean()
            dist.all_reduce(mean_loss)  # the global batch's loss, averaged over ranks
            elapsed = time.perf_counter() - window_t0
            metrics = {
                "loss": mean_loss.item() / world,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                "tokens_per_s": window_tokens / elapsed,
                "model_tflops_per_s": window_tokens / elapsed * flops_tok / 1e12,
            }
            window_t0, window_tokens = time.perf_counter(), 0
            if rank == 0:
                history.append({"step": done, **metrics})
                tracker.log_metrics(metrics, step=done)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        bar.update(1)
    bar.close()

    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag="latest_conduit", client_state={
            "loader": loader.state_dict(), "step": t.steps, "torch_rng": torch.get_rng_state(),
        })
        ray.train.report({"step": t.steps}, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    _export(engine, t.zero_stage, model_cfg, Path(config["out_dir"]), rank)
    if rank == 0:
        (Path(config["out_dir"]) / "train_metrics.json").write_text(json.dumps(history, indent=1))


def _export(engine, zero_stage: int, model_cfg, out_dir: Path, rank: int) -> None:
    """Rank 0 writes the consolidated fp32 weights; under ZeRO-3 every rank joins the gather."""
    import deepspeed

    module = engine.module
    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if rank == 0:
                save_safetensors(module, model_cfg, out_dir / "model.safetensors")
    elif rank == 0:
        save_safetensors(module, model_cfg, out_dir / "model.safetensors")
    dist.barrier()

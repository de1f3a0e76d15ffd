"""train: token blocks -> a trained model (``model.safetensors``), via Ray Train + DeepSpeed.

Ray Train's ``TorchTrainer`` starts ``parallel.num_workers`` workers and their process group
(gloo on CPU, NCCL on GPU); each runs ``pipeline.training.loop.main``. DeepSpeed checkpoints are
reported to Ray Train under ``<out_dir>/ray`` so that a failed worker restarts from the latest one.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import RunConfig, hash_view
from pipeline.stage_io import read_train_metrics
from pipeline.stages.stage import Resources, Stage
from pipeline.training.device import backend_for, resolve_device, resolve_precision


def hash_config(cfg: RunConfig) -> dict:
    return {
        "model": cfg.model_config().to_dict(),
        "train": hash_view(cfg.train),
        "parallel": hash_view(cfg.parallel),
        "seed": cfg.run.seed,
    }


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipeline.training.loop import main

    # On a cluster the GPUs are on the workers' nodes, not necessarily on this task's node.
    device = resolve_device(cfg.parallel.device, gpus_in_cluster=ray.cluster_resources().get("GPU", 0))
    precision = resolve_precision(cfg.train.precision, device)
    tracker.set_tags({"device": device, "precision": precision, "backend": backend_for(device)})
    trainer = TorchTrainer(
        main,
        train_loop_config={
            "run_config": cfg.to_dict(),
            "tokens_dir": str(inputs["tokenize"].path),
            "out_dir": str(out_dir),
            "tracker": tracker,
            "device": device,
            "precision": precision,
        },
        torch_config=TorchConfig(backend=backend_for(device)),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.parallel.num_workers, use_gpu=device == "cuda",
                                               placement_strategy=cfg.parallel.placement_strategy),
        run_config=ray.train.RunConfig(
            name="train",
            storage_path=cfg.train.checkpoint_storage or str(out_dir / "ray"),
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
        ),
    )
    result = trainer.fit()
    if result.error:
        raise RuntimeError(f"training failed: {result.error}") from result.error
    history = read_train_metrics(out_dir)
    return {
        "steps": cfg.train.steps,
        "tokens": cfg.train.steps * cfg.train.global_batch_size * cfg.tokenize.seq_len,
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "device": device,
        "precision": precision,
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
    }


# Holds no CPU itself: its Ray Train workers hold theirs (and the GPUs).
STAGE = Stage(name="train", version=1, inputs=("tokenize",),
              hash_config=hash_config, run=run, resources=Resources(cpus=0))

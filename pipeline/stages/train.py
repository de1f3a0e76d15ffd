"""train: token blocks -> a trained model (``model.safetensors``), via Ray Train + DeepSpeed.

Ray Train's ``TorchTrainer`` starts ``parallel.num_workers`` workers and their process group
(gloo on CPU, NCCL on GPU); each runs ``pipeline.training.loop.main``. A run of one worker on a CPU
(``parallel.launcher`` auto, or in_task) runs the same loop in this stage's own task instead
(``pipeline.training.in_task``: the same checkpoints, restarts and callbacks, without Ray Train's
controller and actors); several workers on CPUs (auto, or ray_tasks) run it as Ray tasks in a placement
group, with this task in the controller's place (``pipeline.training.rank_tasks``).

Checkpoints live outside the artifact folder, in the Ray Train run ``train-<artifact hash>`` under
``checkpoint.storage`` (default ``<artifact_root>/checkpoints``). So:
- a failed worker group restarts from the latest one (``FailureConfig``);
- a rerun after the driver died (the runner clears the unsealed artifact folder) finds them, since
  Ray Train restores a run it finds at ``storage/name``, and continues instead of starting at step 0;
- two configs (or a config and its ``--force``d rerun) sharing one storage never see each other's;
- once the artifact is sealed only the final checkpoint is kept (``checkpoint.resume_from`` can continue
  from it), and ``--force train`` removes them all first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.config import RunConfig, hash_view
from pipeline.data.fs import filesystem_for
from pipeline.store.contracts import CHECKPOINT_PREFIX, read_train_metrics, read_train_precision, read_train_starts
from pipeline.stages.stage import Resources, Stage
from pipeline.store.backends import NodeFolder, join
from pipeline.training.device import backend_for, resolve_device, resolve_precision, worker_cpus
from pipeline.training.in_task import assigned_cpus, uses_in_task
from pipeline.training.layout import check_split
from pipeline.training.rank_tasks import uses_rank_tasks

# Tests only: JSON in the train stage's environment, e.g. {"pause_after_final_checkpoint_s": 30}, which
# the training loop gets as its ``failpoints`` (see pipeline.training.loop).
FAILPOINTS_ENV = "CONDUIT_FAILPOINTS"


def hash_config(cfg: RunConfig) -> dict:
    return {
        "model": hash_view(cfg.model_config()),
        "train": hash_view(cfg.train),
        "optimizer": hash_view(cfg.optimizer),
        "validation": hash_view(cfg.validation),
        "checkpoint": hash_view(cfg.checkpoint),  # resume_from only: the rest changes no result
        "parallel": hash_view(cfg.parallel),
        "seed": cfg.run.seed,
    }


def training_dataset(cfg: RunConfig, tokens) -> dict:
    """The tokenize artifact as the MLflow dataset the run trains on (``StageTracker.log_input_dataset``):
    its hash as the digest, and the source paths and document / token counts per split as the profile."""
    splits = tokens.manifest["counts"]["splits"]
    return {
        "name": ", ".join(cfg.data.train_paths)[:200],
        "source": f"{cfg.artifact_root().rstrip('/')}/{tokens.stage}/{tokens.hash}",
        "digest": tokens.hash,
        "context": "training",
        "profile": {
            "source_paths": cfg.data.train_paths, "data_root": str(cfg.data_root()),
            "shard_hash": tokens.manifest["inputs"]["shard"],
            "tokenizer_hash": tokens.manifest["inputs"]["tokenizer"],
            "documents": {s: v["documents"] for s, v in splits.items()},
            "tokens": {s: v["tokens_in_documents"] for s, v in splits.items()},
            "bytes": {s: v["bytes"] for s, v in splits.items()},
        },
    }


CHECKPOINTS_DIR = "checkpoints"  # under the artifact root, beside the stage folders
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's record of the checkpoints it kept


def checkpoint_location(cfg: RunConfig, hash_: str) -> tuple[str, str]:
    """Ray Train's ``(storage_path, name)`` for the train artifact ``hash_`` of ``cfg``."""
    storage = cfg.checkpoint.storage or join(cfg.artifact_root(), CHECKPOINTS_DIR)
    return storage, f"train-{hash_}"


def _run_dir(cfg: RunConfig, hash_: str) -> tuple[pafs.FileSystem, str]:
    storage, name = checkpoint_location(cfg, hash_)
    fs, path = filesystem_for(storage)
    return fs, f"{path.rstrip('/')}/{name}"


def discard_checkpoints(cfg: RunConfig, hash_: str) -> None:
    """``--force train``: start from step 0, so remove every checkpoint of this hash."""
    fs, run_dir = _run_dir(cfg, hash_)
    if fs.get_file_info(run_dir).type != pafs.FileType.NotFound:
        fs.delete_dir(run_dir)


def recover_unreadable_snapshot(cfg: RunConfig, hash_: str) -> str | None:
    """Ray Train rewrites its snapshot in place (truncate, then write): a controller killed meanwhile (its driver
    SIGKILLed) leaves it empty or cut, and the next controller fails to start on it. Such a snapshot is moved
    aside (``<snapshot>.unreadable``), so Ray Train starts a new record in the same run folder, and the newest
    checkpoint folder the run left is returned for the workers to resume from (``resume_checkpoint``, which
    verifies it and falls back to an earlier one). None when the snapshot reads, or there is none.
    """
    fs, run_dir = _run_dir(cfg, hash_)
    path = f"{run_dir}/{SNAPSHOT_FILE}"
    try:
        with fs.open_input_stream(path) as f:
            json.loads(f.read().decode("utf-8"))
        return None
    except FileNotFoundError:
        return None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError: cut short while being rewritten
        pass
    fs.move(path, f"{path}.unreadable")
    folders = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(run_dir))
                     if i.type == pafs.FileType.Directory and i.base_name.startswith(CHECKPOINT_PREFIX))
    storage, name = checkpoint_location(cfg, hash_)
    return f"{storage.rstrip('/')}/{name}/{folders[-1]}" if folders else None


def keep_final_checkpoint(cfg: RunConfig, hash_: str) -> None:
    """After sealing: delete every checkpoint folder of this run but the latest one Ray Train kept."""
    fs, run_dir = _run_dir(cfg, hash_)
    with fs.open_input_stream(f"{run_dir}/{SNAPSHOT_FILE}") as f:
        kept = json.loads(f.read().decode("utf-8"))["checkpoint_results"]
    final = max(kept, key=lambda r: r["metrics"]["step"])["checkpoint_dir_name"]
    for info in fs.get_file_info(pafs.FileSelector(run_dir)):
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        if info.type == pafs.FileType.Directory and name.startswith("checkpoint_") and name != final:
            fs.delete_dir(info.path)


# Bytes per parameter of one checkpoint: DeepSpeed's (fp32 weights, Adam's two moments, ~16) and the
# layout-independent canonical.pt (weights and moments, 12), plus DeepSpeed's scripts and the run log.
CHECKPOINT_BYTES_PER_PARAM = 28
CHECKPOINT_FIXED_BYTES = 2**20


def disk_need(cfg: RunConfig, inputs: dict, hash_: str) -> list[tuple[str | None, int, str]]:
    """The fp32 weights in the artifact folder; ``checkpoint.keep`` checkpoints plus the one being
    written (Ray Train deletes the oldest after the new one is reported) in the checkpoint storage."""
    from models.accounting import param_counts

    params = param_counts(cfg.model_config())["total"]
    storage, name = checkpoint_location(cfg, hash_)
    kept = cfg.checkpoint.keep + 1
    return [(None, 4 * params, f"fp32 weights of {params:,} parameters"),
            (f"{storage.rstrip('/')}/{name}", (CHECKPOINT_BYTES_PER_PARAM * params + CHECKPOINT_FIXED_BYTES) * kept,
             f"{kept} checkpoints x {CHECKPOINT_BYTES_PER_PARAM} B x {params:,} parameters")]


def parent_state(cfg: RunConfig, tokens) -> tuple[dict, dict[str, str]]:
    """The weights ``train.init_from`` names (a registered version ``models:/NAME/VERSION``, or a
    finished train artifact ``train:HASH`` under this run's artifact root), checked against this run,
    and the lineage tags that name it.

    Raises:
        LookupError: no such version or artifact.
        ValueError: its architecture differs from ``model`` beyond the context and RoPE scaling, or it was
            trained with another tokenizer than this run's, each named.
    """
    import tempfile

    from models.config import continuation_problems
    from models.export import load_safetensors
    from pipeline import tracking
    from pipeline.store.backends import store_for
    from pipeline.store.contracts import WEIGHTS_FILE

    ref = cfg.train.init_from
    tokenizer = tokens.manifest["inputs"].get("tokenizer")
    if ref.startswith("train:"):
        store, train_hash = store_for(cfg.artifact_root()), ref.removeprefix("train:")
        if not store.is_complete("train", train_hash):
            raise LookupError(f"train.init_from={ref}: no finished train artifact {train_hash} under "
                              f"{cfg.artifact_root()}")
        parent_art = store.fetch(store.load("train", train_hash))
        parent_tokens = store.load("tokenize", parent_art.manifest["inputs"]["tokenize"])
        their_tokenizer = parent_tokens.manifest["inputs"].get("tokenizer")
        parent = load_safetensors(str(Path(parent_art.path) / WEIGHTS_FILE))
        tags = {"conduit.init_from": ref, "conduit.init_from_train_hash": train_hash}
    else:
        name, version = ref.removeprefix("models:/").rsplit("/", 1)
        uri = cfg.tracking_uri()
        info = tracking.get_version(uri, name, int(version))  # LookupError naming it
        their_tokenizer = info.tags.get("conduit.tokenizer_hash")
        with tempfile.TemporaryDirectory(prefix="conduit-init-") as tmp:
            parent = load_safetensors(str(tracking.download_weights(uri, ref, tmp)))
        tags = {"conduit.init_from": ref, "conduit.init_from_run": info.run_id or "",
                "conduit.init_from_train_hash": info.tags.get("conduit.train_hash", "")}
    if their_tokenizer != tokenizer:
        raise ValueError(f"train.init_from={ref}: that model was trained with tokenizer artifact {their_tokenizer}, "
                         f"this run tokenizes with {tokenizer}; continue it on the data and tokenizer settings of "
                         "its own run")
    problems = continuation_problems(parent.cfg, cfg.model_config())
    if problems:
        raise ValueError(f"train.init_from={ref}: model differs from that model's beyond the context and RoPE "
                         f"scaling: {'; '.join(problems)}")
    return parent.state_dict(), tags


def check_sequence_parallel(cfg: RunConfig) -> None:
    """``parallel.sequence_parallel_size`` > 1 on a model whose shards cannot be computed alone is refused
    by name (``sequence_parallel.check_shardable``, on the model built on the meta device: no memory)."""
    import torch

    from models import build_model
    from pipeline.training.sequence_parallel import check_shardable

    model_cfg = cfg.model_config()
    with torch.device("meta"):
        model = build_model(model_cfg, device="meta")
    check_shardable(model_cfg, model, cfg.parallel.sequence_parallel_size)


def cpus_per_worker(cfg: RunConfig, device: str, free_by_node=None) -> int | None:
    """What each worker on a CPU reserves, and so its threads (``device.worker_cpus``): the most the nodes'
    free CPUs (``free_by_node()``, by default ``free_cpus_by_node``) place for every worker, or
    ``parallel.threads_per_worker``. None on GPUs (Ray Train's default: a GPU each)."""
    if device == "cuda":
        return None
    if cfg.parallel.threads_per_worker:
        return cfg.parallel.threads_per_worker
    return worker_cpus(None, cfg.parallel.num_workers, (free_by_node or free_cpus_by_node)(),
                       cfg.parallel.placement_strategy)


def free_cpus_by_node(settle_s: float = 0.5) -> list[float]:
    """Each node's free CPUs. Ray's view of them trails the tasks that just ended (the stages before
    this one, their leases handed back within about 0.1 s): while some node shows fewer free CPUs than it
    has, it is read again every 20 ms for up to ``settle_s``, and each node's most is kept."""
    import time

    import ray

    try:  # Ray keeps no public call for it
        from ray._private.state import available_resources_per_node

        def read() -> dict[str, float]:
            return {node: r.get("CPU", 0.0) for node, r in available_resources_per_node().items()}
    except (ImportError, AttributeError):  # a Ray without it: the cluster's free CPUs as if on one node
        def read() -> dict[str, float]:
            return {"cluster": ray.available_resources().get("CPU", 0.0)}
    total = ray.cluster_resources().get("CPU", 0.0)
    free = read()
    deadline = time.monotonic() + settle_s
    while sum(free.values()) < total and time.monotonic() < deadline:
        time.sleep(0.02)
        free = {node: max(cpus, free.get(node, 0.0)) for node, cpus in read().items()}
    return list(free.values())


def _device(cfg: RunConfig) -> str:
    import ray

    # On a cluster the GPUs are on the workers' nodes, not necessarily on this task's node.
    return resolve_device(cfg.parallel.device, gpus_in_cluster=ray.cluster_resources().get("GPU", 0))


def in_task(cfg: RunConfig, device: str) -> bool:
    """Whether this run trains in the stage's own task (``pipeline.training.in_task``), not Ray Train's workers."""
    return uses_in_task(cfg.parallel.launcher, cfg.parallel.num_workers, device, bool(cfg.cluster.stage_resources))


def launcher(cfg: RunConfig, device: str) -> str:
    """Who runs the training loop: ``in_task`` (this stage's task), ``ray_tasks`` (Ray tasks, one a rank) or
    ``ray_train`` (Ray Train's workers), from ``parallel.launcher`` and the run's workers and device."""
    if in_task(cfg, device):
        return "in_task"
    if uses_rank_tasks(cfg.parallel.launcher, cfg.parallel.num_workers, device):
        if device != "cpu":
            from pipeline.base import ConfigError

            raise ConfigError(f"parallel.launcher=ray_tasks trains on CPUs, and this run's device is {device}: "
                              f"use parallel.launcher=ray_train (or auto) there")
        return "ray_tasks"
    return "ray_train"


def task_resources(cfg: RunConfig, inputs: dict) -> Resources:
    """What the stage's task holds on the running cluster (``resources_on``)."""
    return resources_on(cfg, _device(cfg))


def resources_on(cfg: RunConfig, device: str, free_by_node=None) -> Resources:
    """Training in Ray Train's workers: nothing (they hold the CPUs and GPUs). Training in the task: what its
    one worker would have held (a GPU; on a CPU ``cpus_per_worker``, from ``free_by_node()``, each node's
    free CPUs, by default the running cluster's)."""
    if not in_task(cfg, device):
        return Resources(cpus=0)
    if device == "cuda":
        return Resources(cpus=0, gpus=1)
    return Resources(cpus=cpus_per_worker(cfg, device, free_by_node))


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    import ray

    from pipeline.training.ray_train import failure_callback, reap_orphaned_placement_groups, train_worker

    device = _device(cfg)
    precision = resolve_precision(cfg.train.precision, device)
    if cfg.parallel.sequence_parallel_size > 1:  # before any worker starts: can a shard be computed alone?
        check_sequence_parallel(cfg)
        tracker.set_tags({"sequence_parallel_size": str(cfg.parallel.sequence_parallel_size)})
    if cfg.validation.every:  # before any worker starts: the validation subset must exist
        check_split(cfg.validation.batches, cfg.train.global_batch_size,
                    inputs["tokenize"].manifest["counts"]["splits"]["validation"]["blocks"])
    storage, name = checkpoint_location(cfg, out_dir.name)  # the folder is <artifact_root>/train/<hash>
    tracker.set_tags({"device": device, "precision": precision, "backend": backend_for(device),
                      "checkpoints": f"{storage}/{name}"})
    tracker.log_input_dataset(**training_dataset(cfg, inputs["tokenize"]))
    init_state, lineage = None, {}
    if cfg.train.init_from:
        state, lineage = parent_state(cfg, inputs["tokenize"])
        tracker.set_tags(lineage)
        init_state = ray.put(state)  # every worker, on any node, reads it from the object store
    # A controller that died with an earlier attempt of this stage (its task killed) left its workers'
    # placement group holding CPUs this trainer needs.
    reap_orphaned_placement_groups()
    recovered = recover_unreadable_snapshot(cfg, out_dir.name)
    if recovered:
        print(f"warning: Ray Train's record of this training's checkpoints was cut short (its controller died while "
              f"writing it); resuming from the newest checkpoint it left, {recovered}", flush=True)
        tracker.set_tags({"checkpoint.recovered": recovered})
    who = launcher(cfg, device)
    here = who == "in_task"
    if here:  # the task holds what its worker uses (task_resources, placed before it started)
        cpus = assigned_cpus() if device == "cpu" else None
    else:
        cpus = cpus_per_worker(cfg, device)  # after the reaping: what is free now
    if cpus:
        tracker.set_tags({"cpus_per_worker": str(int(cpus))})
    tracker.set_tags({"conduit.launcher": who})
    loop_config = {
        "run_config": cfg.to_dict(),
        "tokens": inputs["tokenize"],  # each worker reads its own blocks of it, where it is
        "out": NodeFolder.here(out_dir),  # rank 0 may be on another node than this task
        "tracker": tracker,
        "device": device,
        "precision": precision,
        # Fault tests widen a moment to SIGKILL a worker in.
        "failpoints": json.loads(os.environ.get(FAILPOINTS_ENV, "{}")),
        "init_state": init_state,
        "recovered_checkpoint": recovered,
        # In a sweep's trial, each validation loss also goes to Ray Tune (the trainer's callbacks).
        "report_validation": bool(getattr(tracker, "train_callbacks", ())),
        # Steps that always get a checkpoint, saved before that step's validation report: a synchronous
        # sweep's rungs, where the trial is paused and later resumed (``pipeline.sweep.run``).
        "checkpoint_steps": sorted({s for cb in getattr(tracker, "train_callbacks", ())
                                    for s in getattr(cb, "checkpoint_steps", ())}),
    }
    callbacks = [failure_callback(tracker, cfg.checkpoint.max_failures), *getattr(tracker, "train_callbacks", ())]
    tracker.set_tags({"conduit.phase": "training in the stage's task" if here else
                      f"starting {cfg.parallel.num_workers} training worker"
                      f"{'s' if cfg.parallel.num_workers > 1 else ''}"})
    if here:
        from pipeline.training import in_task as local

        result = local.fit(train_worker, loop_config, storage=storage, name=name, keep=cfg.checkpoint.keep,
                           max_failures=cfg.checkpoint.max_failures, callbacks=callbacks,
                           backend=backend_for(device), recovered=recovered)
    elif who == "ray_tasks":
        from pipeline.training import rank_tasks

        result = rank_tasks.fit(
            train_worker, loop_config, num_workers=cfg.parallel.num_workers, cpus=cpus,
            strategy=cfg.parallel.placement_strategy, storage=storage, name=name, keep=cfg.checkpoint.keep,
            max_failures=cfg.checkpoint.max_failures, callbacks=callbacks, backend=backend_for(device),
            recovered=recovered,
            on_placed=lambda: tracker.set_tags({"conduit.phase": f"starting {cfg.parallel.num_workers} ranks"}))
    else:
        result = _fit_with_ray_train(cfg, device, cpus, storage, name, loop_config, callbacks)
    if result.error:
        raise RuntimeError(f"training failed: {result.error}") from result.error
    history = read_train_metrics(out_dir)
    starts = read_train_starts(out_dir)
    chosen = read_train_precision(out_dir)  # where precision was auto on a CPU: what the workers chose
    precision = chosen["precision"] if chosen else precision
    return {
        "starts": starts,  # [0] for a run that never restarted; a rerun after a crash begins past 0
        "steps": cfg.train.steps,
        "steps_trained": history[-1]["step"],  # below steps when validation.early_stop_patience stopped it
        "tokens": history[-1]["step"] * cfg.train.global_batch_size * cfg.tokenize.seq_len,
        "first_loss": history[0]["loss"],
        "final_loss": history[-1]["loss"],
        "val_losses": {h["step"]: h["val_loss"] for h in history if "val_loss" in h},
        "loss_label_smoothing": cfg.train.label_smoothing,  # > 0: the two losses above are smoothed
        "device": device,
        "precision": precision,
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        **({"init_from": lineage} if lineage else {}),
    }


def _fit_with_ray_train(cfg: RunConfig, device: str, cpus: int | None, storage: str, name: str, loop_config: dict,
                        callbacks: list):
    """``parallel.num_workers`` Ray Train workers run the loop; returns Ray Train's ``Result``."""
    import ray.train
    from ray.train.torch import TorchConfig

    from pipeline.training.ray_train import train_worker, trainer_class

    trainer = trainer_class()(
        train_worker,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend=backend_for(device)),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.parallel.num_workers, use_gpu=device == "cuda",
                                               placement_strategy=cfg.parallel.placement_strategy,
                                               resources_per_worker={"CPU": cpus} if cpus else None),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            callbacks=callbacks,
        ),
    )
    return trainer.fit()


# Holds no CPU itself when Ray Train's workers train (they hold theirs, and the GPUs); else what its one
# worker would (task_resources).
STAGE = Stage(name="train", version=1, inputs=("tokenize",),
              hash_config=hash_config, run=run, resources_for=task_resources,
              discard_state=discard_checkpoints, after_seal=keep_final_checkpoint, disk_need=disk_need,
              read_in_place=("tokenize",))

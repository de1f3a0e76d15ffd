"""train: token blocks -> a trained model (``model.safetensors``), via Ray Train + DeepSpeed.

The stage builds the loop's config (``LoopConfig``) and how its ranks run (``Launch``) and goes through the one
door into training, ``pipeline.training.launch.launch``: ``parallel.num_workers`` Ray Train workers and their
process group (gloo on CPU, NCCL on GPU), or, for one worker on a CPU (``parallel.launcher`` auto, or
in_task), Ray Train's local mode in this stage's own task.

Checkpoints live outside the artifact folder, at ``<checkpoint.storage>/train-<artifact hash>`` (default
``<artifact_root>/checkpoints``; ``pipeline.training.checkpoint.record``). So:
- a failed worker group restarts from the latest one;
- a rerun after the driver died (the runner clears the unsealed artifact folder) finds them and continues
  instead of starting at step 0;
- two configs (or a config and its ``--force``d rerun) sharing one storage never see each other's;
- once the artifact is sealed only the final checkpoint is kept (``checkpoint.resume_from`` can continue
  from it), and ``--force train`` removes them all first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.config import RunConfig, hash_view
from pipeline.store.contracts import read_train_metrics, read_train_precision, read_train_starts
from pipeline.stages.stage import Resources, Stage
from pipeline.store.backends import NodeFolder
from pipeline.training.device import (assigned_cpus, backend_for, resolve_device, resolve_precision,
                                      trains_in_process, worker_cpus)
from pipeline.training.layout import check_split
from pipeline.training.loop_config import CheckpointPlace

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


def checkpoint_place(cfg: RunConfig, hash_: str) -> CheckpointPlace:
    """Where the train artifact ``hash_`` of ``cfg`` keeps its checkpoints (``checkpoint.storage``)."""
    from pipeline.training.checkpoint.record import place_for

    return place_for(cfg.checkpoint.storage, cfg.artifact_root(), hash_, cfg.checkpoint.keep)


def discard_checkpoints(cfg: RunConfig, hash_: str) -> None:
    """``--force train``: start from step 0, so remove every checkpoint of this hash."""
    from pipeline.training.checkpoint.record import discard_checkpoints as discard

    discard(checkpoint_place(cfg, hash_))


def keep_final_checkpoint(cfg: RunConfig, hash_: str) -> None:
    """After sealing: every checkpoint of this training but the newest deleted."""
    from pipeline.training.checkpoint.record import CheckpointRecord

    CheckpointRecord(checkpoint_place(cfg, hash_)).keep_only_newest()


# Bytes per parameter of one checkpoint: DeepSpeed's (fp32 weights, Adam's two moments, ~16) and the
# layout-independent canonical.pt (weights and moments, 12), plus DeepSpeed's scripts and the run log.
CHECKPOINT_BYTES_PER_PARAM = 28
CHECKPOINT_FIXED_BYTES = 2**20


def disk_need(cfg: RunConfig, inputs: dict, hash_: str) -> list[tuple[str | None, int, str]]:
    """The fp32 weights in the artifact folder; ``checkpoint.keep`` checkpoints plus the one being
    written (the oldest is deleted after the new one is recorded) in the checkpoint storage."""
    from models.accounting import param_counts

    from pipeline.store.backends import join

    params = param_counts(cfg.model_config())["total"]
    place = checkpoint_place(cfg, hash_)
    kept = cfg.checkpoint.keep + 1
    return [(None, 4 * params, f"fp32 weights of {params:,} parameters"),
            (join(place.storage, place.name), (CHECKPOINT_BYTES_PER_PARAM * params + CHECKPOINT_FIXED_BYTES) * kept,
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

    from pipeline.compat import free_resources_by_node

    def read() -> dict[str, float]:
        return {node: r.get("CPU", 0.0) for node, r in free_resources_by_node().items()}

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


def in_process(cfg: RunConfig, device: str) -> bool:
    """Whether this run trains in the stage's own task (Ray Train's local mode), not on Ray Train's workers."""
    return trains_in_process(cfg.parallel.launcher, cfg.parallel.num_workers, device, bool(cfg.cluster.stage_resources))


def task_resources(cfg: RunConfig, inputs: dict) -> Resources:
    """What the stage's task holds on the running cluster (``resources_on``)."""
    return resources_on(cfg, _device(cfg))


def resources_on(cfg: RunConfig, device: str, free_by_node=None) -> Resources:
    """Training in Ray Train's workers: nothing (they hold the CPUs and GPUs). Training in the task: what its
    one worker would have held (a GPU; on a CPU ``cpus_per_worker``, from ``free_by_node()``, each node's
    free CPUs, by default the running cluster's)."""
    if not in_process(cfg, device):
        return Resources(cpus=0)
    if device == "cuda":
        return Resources(cpus=0, gpus=1)
    return Resources(cpus=cpus_per_worker(cfg, device, free_by_node))


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    from pipeline.training.launch import launch

    device = _device(cfg)
    precision = resolve_precision(cfg.train.precision, device)
    _check_before_workers(cfg, inputs, tracker)
    place = checkpoint_place(cfg, out_dir.name)  # the folder is <artifact_root>/train/<hash>
    tracker.set_tags({"device": device, "precision": precision, "backend": backend_for(device),
                      "checkpoints": f"{place.storage}/{place.name}"})
    tracker.log_input_dataset(**training_dataset(cfg, inputs["tokenize"]))
    loop, lineage = _loop_config(cfg, inputs, out_dir, tracker, device, precision, place)
    how = _launch(cfg, device, tracker)
    outcome = launch(loop, how)
    if outcome.error:
        raise RuntimeError(f"training failed: {outcome.error}") from outcome.error
    return _result(cfg, out_dir, device, precision, place, lineage)


def _check_before_workers(cfg: RunConfig, inputs: dict, tracker) -> None:
    """What is refused before any worker starts: a model whose sequence cannot be split over
    ``parallel.sequence_parallel_size`` ranks, a validation subset the split does not hold."""
    if cfg.parallel.sequence_parallel_size > 1:
        check_sequence_parallel(cfg)
        tracker.set_tags({"sequence_parallel_size": str(cfg.parallel.sequence_parallel_size)})
    if cfg.validation.every:
        check_split(cfg.validation.batches, cfg.train.global_batch_size,
                    inputs["tokenize"].manifest["counts"]["splits"]["validation"]["blocks"])


def _loop_config(cfg: RunConfig, inputs: dict, out_dir: Path, tracker, device: str, precision: str,
                 place: CheckpointPlace):
    """The loop's config, and the lineage tags of ``train.init_from`` (empty without it)."""
    import ray

    from pipeline.training.loop_config import LoopConfig

    init_state, lineage = None, {}
    if cfg.train.init_from:
        state, lineage = parent_state(cfg, inputs["tokenize"])
        tracker.set_tags(lineage)
        init_state = ray.put(state)  # every worker, on any node, reads it from the object store
    callbacks = getattr(tracker, "train_callbacks", ())  # a sweep trial's: validation losses to Ray Tune
    loop = LoopConfig(
        run_config=cfg.to_dict(),
        tokens=inputs["tokenize"],  # each worker reads its own blocks of it, where it is
        out=NodeFolder.here(out_dir),  # rank 0 may be on another node than this task
        tracker=tracker, device=device, precision=precision, checkpoints=place, init_state=init_state,
        report_validation=bool(callbacks),
        # Steps that always get a checkpoint, saved before that step's validation report: a synchronous
        # sweep's rungs, where the trial is paused and later resumed (``pipeline.sweep.run``).
        checkpoint_steps=tuple(sorted({s for cb in callbacks for s in getattr(cb, "checkpoint_steps", ())})),
        failpoints=json.loads(os.environ.get(FAILPOINTS_ENV, "{}")),  # fault tests widen a moment to act in
    )
    return loop, lineage


def _launch(cfg: RunConfig, device: str, tracker):
    """How the ranks run: in this task or on Ray Train's workers, with what CPUs, and the run's callbacks
    (the failures on its tags, a sweep trial's reports to Tune)."""
    from pipeline.training.launch import Launch
    from pipeline.training.ray_train import failure_callback, reap_orphaned_placement_groups

    here = in_process(cfg, device)
    if here:  # the task holds what its worker uses (task_resources, placed before it started)
        cpus = assigned_cpus() if device == "cpu" else None
    else:
        # A controller that died with an earlier attempt of this stage (its task killed) left its workers'
        # placement group holding CPUs this trainer needs.
        reap_orphaned_placement_groups()
        cpus = cpus_per_worker(cfg, device)  # after the reaping: what is free now
    if cpus:
        tracker.set_tags({"cpus_per_worker": str(int(cpus))})
    n = cfg.parallel.num_workers
    tracker.set_tags({"conduit.launcher": "in_task" if here else "ray_train",
                      "conduit.phase": "training in the stage's task" if here else
                      f"starting {n} training worker{'s' if n > 1 else ''}"})
    callbacks = [failure_callback(tracker, cfg.checkpoint.max_failures), *getattr(tracker, "train_callbacks", ())]
    return Launch(num_workers=n, device=device, cpus=cpus, placement_strategy=cfg.parallel.placement_strategy,
                  max_failures=cfg.checkpoint.max_failures, callbacks=tuple(callbacks), in_process=here)


def _result(cfg: RunConfig, out_dir: Path, device: str, precision: str, place: CheckpointPlace,
            lineage: dict) -> dict:
    """The stage's manifest counts, from what rank 0 wrote into the artifact folder."""
    from pipeline.training.checkpoint.record import CheckpointRecord

    history = read_train_metrics(out_dir)
    starts = read_train_starts(out_dir)
    chosen = read_train_precision(out_dir)  # where precision was auto on a CPU: what the workers chose
    record = CheckpointRecord(place)
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
        "precision": chosen["precision"] if chosen else precision,
        "checkpoint": record.uri_of(record.entries[-1]) if record.entries else None,
        **({"init_from": lineage} if lineage else {}),
    }


# Holds no CPU itself when Ray Train's workers train (they hold theirs, and the GPUs); else what its one
# worker would (task_resources).
STAGE = Stage(name="train", version=2, inputs=("tokenize",),
              hash_config=hash_config, run=run, resources_for=task_resources,
              discard_state=discard_checkpoints, after_seal=keep_final_checkpoint, disk_need=disk_need,
              read_in_place=("tokenize",))

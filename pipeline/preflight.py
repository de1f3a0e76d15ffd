"""Resource preflight: does the Ray cluster have what the config asks for, before the first stage?

Ray Train waits for the resources of its worker group without a deadline, so a run that asks for
more workers than the cluster has CPUs (or GPUs) would shard, train a tokenizer and tokenize, then
hang in the train stage. ``check_cluster_resources`` is called by the runner right after it connects
to Ray and turns that into an error with the numbers asked for and available.

What a training worker reserves: on GPUs, Ray Train's default for ``ScalingConfig(use_gpu=True)`` (a GPU
each, no CPU); on a CPU, ``parallel.threads_per_worker`` CPUs, or when that is unset the most that the
nodes' free CPUs place for every worker as the train stage starts, at least one (``device.worker_cpus``). The device and
precision rules themselves are ``pipeline.training.device``'s; this module applies them to the
cluster's totals instead of waiting for the train stage to find out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pipeline.base import is_uri
from pipeline.config import ConfigError, RunConfig
from pipeline.training.device import resolve_device, resolve_precision, trains_in_process

TRAIN_STAGE = "train"  # the stage whose Ray Train workers this module judges


def worker_resources(device: str, threads_per_worker: int | None = None) -> dict[str, float]:
    """What one Ray Train worker reserves at least on ``device`` ("cpu" or "cuda"): a GPU, or on a CPU its
    ``parallel.threads_per_worker`` CPUs, else one (it takes more where more are free: ``device.worker_cpus``)."""
    return {"GPU": 1.0} if device == "cuda" else {"CPU": float(threads_per_worker or 1)}


def check_cluster_resources(cfg: RunConfig, resources: Mapping[str, float],
                            stages_to_run: Collection[str] | None = None,
                            node_cpus: Collection[float] | None = None,
                            node_gpus: Collection[float] | None = None) -> None:
    """Refuse a config that asks for more than the cluster has.

    Args:
        cfg: the run's config.
        resources: the cluster's total resources, as ``ray.cluster_resources()`` returns them.
        stages_to_run: the stages this run will execute (not cached); None: all. Only the train
            stage starts workers, so a run without it (``--only shard``, or train cached) is not
            judged by them.
        node_cpus: each node's CPUs (None: not judged per node): a worker's CPUs must fit on one node, and
            the workers must be placeable by ``parallel.placement_strategy`` (``check_placement``).
        node_gpus: each node's GPUs, in the order of ``node_cpus`` (None: none anywhere).

    Raises:
        ConfigError: a ``cluster.stage_resources`` name no node has; ``parallel.device=cuda`` on a
            cluster without GPUs; ``train.precision=fp16`` where training runs on CPU; more CPUs or
            GPUs for ``parallel.num_workers`` workers than the cluster has; on GPUs of a known type, a
            planned peak per GPU above its memory (``pipeline.plan.fit``); ``parallel.sequence_parallel_size``
            on a model whose sequence cannot be split (``sequence_parallel.check_shardable``). Each message
            names the fields, what they ask for and what is there.
    """
    missing = [r for r in cfg.cluster.stage_resources if resources.get(r, 0.0) <= 0]
    if missing and (stages_to_run is None or stages_to_run):
        raise ConfigError(
            f"cluster.stage_resources={cfg.cluster.stage_resources}: no node of the Ray cluster has {missing}, so "
            "the stage tasks would wait for them forever; start a node with ray start --resources "
            f"'{{\"{missing[0]}\": 100}}' or leave it out"
        )
    if stages_to_run is not None and TRAIN_STAGE not in stages_to_run:
        return
    if cfg.parallel.sequence_parallel_size > 1:  # before any stage: else the train stage refuses it after them
        from pipeline.stages.train import check_sequence_parallel  # the model on the meta device: imports torch

        try:
            check_sequence_parallel(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    p = cfg.parallel
    have = {"CPU": float(resources.get("CPU", 0.0)), "GPU": float(resources.get("GPU", 0.0))}
    available = f"the Ray cluster has {have['CPU']:g} CPUs and {have['GPU']:g} GPUs"
    if p.device == "cuda" and have["GPU"] < 1:
        raise ConfigError(f"parallel.device=cuda but {available}; use parallel.device=cpu or auto, "
                          "or a cluster with GPUs")
    device = resolve_device(p.device, gpus_in_cluster=have["GPU"])
    try:
        resolve_precision(cfg.train.precision, device)
    except ValueError as e:  # the rule's own message, with the cluster that made the device cpu
        raise ConfigError(f"{e} (parallel.device={p.device} trains on {device}: {available})") from e
    for name, per_worker in worker_resources(device, p.threads_per_worker).items():
        asked = per_worker * p.num_workers
        if asked > have[name]:
            raise ConfigError(
                f"parallel.num_workers={p.num_workers} training workers on {device} need {asked:g} {name}s "
                f"({per_worker:g} each) but {available}; Ray Train would wait for them forever. Lower "
                "parallel.num_workers (and train.global_batch_size with it)"
                f"{' or parallel.threads_per_worker' if name == 'CPU' and p.threads_per_worker else ''} or add nodes"
            )
    largest = max(node_cpus, default=0.0) if node_cpus is not None else None
    if device == "cpu" and p.threads_per_worker and largest is not None and p.threads_per_worker > largest:
        raise ConfigError(
            f"parallel.threads_per_worker={p.threads_per_worker}: each training worker reserves that many CPUs on "
            f"one node, but the largest node of the Ray cluster has {largest:g}; Ray Train would wait for it "
            f"forever. Use at most {largest:g}, or leave it unset")
    if node_cpus is not None and p.num_workers > 1 and not (device == "cpu" and trains_in_process(
            p.launcher, p.num_workers, device, bool(cfg.cluster.stage_resources))):
        check_placement(p.placement_strategy, p.num_workers, worker_resources(device, p.threads_per_worker),
                        node_cpus, node_gpus)
    if device == "cuda":
        from pipeline.plan.fit import check_memory_fits  # the planner is heavier than this module's own checks

        check_memory_fits(cfg, resources)


def check_placement(strategy: str, num_workers: int, per_worker: Mapping[str, float], node_cpus: Collection[float],
                    node_gpus: Collection[float] | None = None) -> None:
    """Refuse workers that ``parallel.placement_strategy`` cannot place on the cluster's nodes, rather than let
    Ray Train wait for their placement group forever: ``STRICT_SPREAD`` needs a node for each worker, each
    holding one worker's resources; ``STRICT_PACK`` one node holding all of them. (``PACK`` and ``SPREAD``
    place wherever the totals fit, which ``check_cluster_resources`` has checked.)

    Raises:
        ConfigError: naming the strategy, the workers and their resources, and what the nodes have.
    """
    gpus = list(node_gpus) if node_gpus is not None else [0.0] * len(node_cpus)
    nodes = list(zip(node_cpus, gpus))
    want_cpu, want_gpu = per_worker.get("CPU", 0.0), per_worker.get("GPU", 0.0)
    have = ", ".join(f"{c:g} CPUs" + (f" and {g:g} GPUs" if g else "") for c, g in nodes)
    each = " and ".join(f"{n:g} {name}s" for name, n in (("CPU", want_cpu), ("GPU", want_gpu)) if n)
    what = f"{num_workers} workers of {each}"
    if strategy == "STRICT_SPREAD":
        fitting = sum(c >= want_cpu and g >= want_gpu for c, g in nodes)
        if fitting < num_workers:
            raise ConfigError(
                f"parallel.placement_strategy=STRICT_SPREAD puts each of the {what} on a node of its own, but only "
                f"{fitting} of the cluster's {len(nodes)} nodes ({have}) can hold one; Ray Train would wait for "
                "them forever. Use PACK or SPREAD, fewer workers, or more nodes")
    elif strategy == "STRICT_PACK":
        if not any(c >= want_cpu * num_workers and g >= want_gpu * num_workers for c, g in nodes):
            raise ConfigError(
                f"parallel.placement_strategy=STRICT_PACK puts all {what} on one node, but no node of the cluster "
                f"({have}) holds them; Ray Train would wait for them forever. Use PACK or SPREAD, or fewer workers")


class DiskError(RuntimeError):
    """A stage's output location is not writable or has less free space than the stage needs."""


MIN_FREE_BYTES = 64 * 2**20  # what any stage writes at least (manifests, plots, small files)


def check_disk(cfg: RunConfig, item, stage, inputs: Mapping) -> None:
    """Before a stage runs: can it write its outputs, and is there room for them?

    Every local location the stage writes (its artifact folder, and for train the checkpoint storage)
    must be writable (a probe file is created and removed) and its filesystem must have the free space
    the stage's ``disk_need`` estimates, summed over locations on one filesystem. Object-store
    locations (``s3://``...) have no free space to check and are left to the store.

    Args:
        cfg: the resolved run config.
        item: the runner's plan item (stage name, hash, artifact path).
        stage: the Stage record.
        inputs: its upstream artifacts by stage name.

    Raises:
        DiskError: naming the path, the bytes needed (and what they are for) and the bytes free.
    """
    import os
    import shutil
    import tempfile
    from pathlib import Path

    needs = list(stage.disk_need(cfg, inputs, item.hash)) if stage.disk_need else []
    needs.append((None, MIN_FREE_BYTES, "manifest and small files"))
    by_device: dict[int, list[tuple[Path, int, str]]] = {}
    for location, need, what in needs:
        location = str(item.path) if location is None else location
        if is_uri(location):
            continue
        path = Path(location)
        probe_dir = path if path.exists() else path.parent
        try:
            probe_dir.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".conduit-probe-", dir=probe_dir)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise unwritable(item.stage, probe_dir, e) from e
        by_device.setdefault(os.stat(probe_dir).st_dev, []).append((probe_dir, need, what))
    for places in by_device.values():
        need = sum(n for _, n, _ in places)
        free = shutil.disk_usage(places[0][0]).free
        if need > free:
            where = "; ".join(f"{_gib(n)} at {p} for {what}" for p, n, what in places)
            raise DiskError(f"stage {item.stage} needs about {_gib(need)} of free disk ({where}) but that "
                            f"filesystem has {_gib(free)} free; free some space or point run.artifact_root / "
                            "checkpoint.storage elsewhere")


def unwritable(stage: str, place: object, error: OSError) -> DiskError:
    """The error for stage ``stage``, which cannot write to ``place`` (a folder or URI) because of ``error``."""
    return DiskError(f"stage {stage} cannot write to {place}: {error.strerror or error}. Point "
                     "run.artifact_root (or checkpoint.storage) at a writable folder")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

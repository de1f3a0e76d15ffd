"""Several training ranks as Ray tasks: Ray Train's run of N workers without its controller and actors.

Ray Train starts, for every run, a controller actor, a synchronization actor and one actor per worker:
each a fresh process that imports its share of Ray Train, torch and DeepSpeed before the first step
(``benchmarks/fixed_costs.py``: about 23 CPU-seconds of a 30-step, two-worker stage outside its steps, on
a 2-core Xeon). Here each rank is a Ray *task* instead, in a placement group (``parallel.placement_strategy``,
gang-scheduled as Ray Train's workers are), so it runs in one of Ray's pooled worker processes, where an
earlier stage or run may have imported torch and DeepSpeed already; and the stage's own task does what
the controller did. The training function (``pipeline.training.loop.main``) is unchanged: it reaches
this module through Ray Train's hook (``set_train_fn_utils``), as ``pipeline.training.in_task`` does
for a world of one.

What Ray Train did for such a run, this module does:

- the ranks meet through a torch ``TCPStore`` that the stage's task serves (a key prefix per attempt):
  each says its node, from which the local ranks and node ranks follow (Ray Train's order: by node, in
  rank order), then they form torch's process group over it (gloo on CPUs);
- a checkpoint is every rank's part in one folder, named by rank 0 (through the store), in Ray Train's
  layout; rank 0 registers it in the run's record (``CheckpointRecord``: Ray Train's own snapshot file)
  once every rank's part is in storage, then calls the run's callbacks (a sweep's validation reports reach
  Tune after the checkpoint they follow is recorded). So a rerun, ``checkpoint.resume_from``, Ray Train, or
  the one-worker launcher all find the checkpoints as before;
- a rank that fails (raises, or its process dies) fails the attempt: the others are cancelled (as Ctrl-C
  would, then killed if they have not ended ``STUCK_S`` later: a rank waiting in a collective for the failed
  one cannot take the interrupt), the failure reaches the failure callback
  (the run's tags), and all ranks start again from the newest checkpoint, at most ``checkpoint.max_failures``
  times (Ray Train's ``FailureConfig``);
- the stage cancelled (Ctrl-C, a sweep's stop) cancels its ranks the same way and removes their placement
  group; a retry of a stage whose task was killed removes the group the killed attempt left;
- each rank destroys its process group at the end (its process takes other tasks after), and forgets the
  groups DeepSpeed cached from it.

It trains on CPUs: on GPUs Ray gives each task its own ``CUDA_VISIBLE_DEVICES`` and the local-rank device
numbering Ray Train sets up would not hold, so ``parallel.launcher: auto`` keeps Ray Train there.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import time
from typing import Any, Callable

from pipeline.training.in_task import CheckpointRecord, InTaskResult, end_process_group

CANCEL_GRACE_S = 20.0  # a cancelled rank's time to end on its own (its metrics flushed) before it is killed
STUCK_S = 3.0  # ... and once another rank has ended (it may wait in a collective for that one)
STORE_TIMEOUT = datetime.timedelta(minutes=30)  # a rank's wait on another (torch's default collective timeout)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")


def uses_rank_tasks(launcher: str, num_workers: int, device: str) -> bool:
    """Whether the train stage's ranks run as Ray tasks: ``parallel.launcher`` ray_tasks, or auto with several
    workers on CPUs."""
    if launcher == "ray_tasks":
        return True
    return launcher == "auto" and num_workers > 1 and device == "cpu"


def placement(ranks: list[str]) -> list[tuple[int, int, int]]:
    """Each rank's (local rank, local world size, node rank), from the node each rank runs on: nodes
    numbered in the order their first rank comes, local ranks in rank order within a node."""
    nodes = list(dict.fromkeys(ranks))
    return [(ranks[:r].count(node), ranks.count(node), nodes.index(node)) for r, node in enumerate(ranks)]


def _save_part(store, record: CheckpointRecord, rank: int, world: int, index: int, metrics: dict, local_dir: str):
    """This rank's part of report ``index``'s checkpoint, put into the folder rank 0 names; on rank 0, once
    every rank's part is there, the checkpoint recorded and returned (None on the other ranks)."""
    if rank == 0:
        name = record.new_name()
        store.set(f"checkpoint/{index}", name)
    else:
        name = store.get(f"checkpoint/{index}").decode()
    record.upload(local_dir, name)
    store.set(f"uploaded/{index}/{rank}", "1")
    if rank != 0:
        return None
    store.wait([f"uploaded/{index}/{r}" for r in range(world)])
    return record.register(metrics, name)


def _utils_class():
    """``RankTrainFnUtils``, made on first use (Ray Train's train_fn_utils module is imported only here)."""
    from ray.train.v2._internal.execution.train_fn_utils import LocalTrainFnUtils

    class RankTrainFnUtils(LocalTrainFnUtils):
        """What ``ray.train.report`` / ``get_checkpoint`` / ``get_context`` reach in a rank's task."""

        def __init__(self, experiment_name: str, rank: int, world: int, local: tuple[int, int, int], store,
                     record: CheckpointRecord, callbacks: list, restored) -> None:
            local_rank, local_world, node_rank = local
            super().__init__(experiment_name=experiment_name, world_size=world, world_rank=rank,
                             local_rank=local_rank, local_world_size=local_world, node_rank=node_rank)
            self._rank, self._world, self._store = rank, world, store
            self._record, self._callbacks, self._restored = record, callbacks, restored
            self._reports = 0  # this rank's reports so far: the same count on every rank (reports are collective)
            self._syncs = 0  # barriers and broadcasts so far (collective too)

        def report(self, metrics, checkpoint=None, checkpoint_dir_name=None, **_ignored) -> None:
            index = self._reports
            self._reports += 1
            self._last_metrics = metrics
            persisted = None
            if checkpoint is not None:
                persisted = _save_part(self._store, self._record, self._rank, self._world, index, metrics,
                                       checkpoint.path)
                self._last_checkpoint = persisted or self._last_checkpoint
            elif self._rank == 0:
                self._record.add(metrics, None)
            if self._rank == 0:
                for cb in self._callbacks:
                    cb.after_report(run_context=None, metrics=[dict(metrics)], checkpoint=persisted)

        def get_checkpoint(self):
            return self._restored

        def is_distributed(self) -> bool:
            return True

        def barrier(self) -> None:
            self._syncs += 1
            self._store.set(f"barrier/{self._syncs}/{self._rank}", "1")
            self._store.wait([f"barrier/{self._syncs}/{r}" for r in range(self._world)])

        def broadcast_from_rank_zero(self, data: Any) -> Any:
            self._syncs += 1
            key = f"broadcast/{self._syncs}"
            if self._rank == 0:
                self._store.set(key, pickle.dumps(data))
                return data
            return pickle.loads(self._store.get(key))

    return RankTrainFnUtils


def run_rank(train_fn: Callable[[dict], None], config: dict, rank: int, world: int, address: tuple[str, int],
             attempt: str, backend: str, run: dict, callbacks: list, restored_path: str | None) -> None:
    """One rank of an attempt (the body of its Ray task): meet the others, form the process group, train.

    Args:
        address: the stage task's store (host, port); ``attempt``: this attempt's key prefix in it.
        run: ``storage``, ``name`` and ``keep`` of the run's checkpoint record.
        callbacks: the run's Ray Train callbacks' ``after_report`` are called by rank 0 (others get none).
        restored_path: the checkpoint this attempt starts from, or None.
    """
    import ray
    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train.v2._internal.execution.train_fn_utils import set_train_fn_utils

    from pipeline.base import interruptible

    interruptible()  # the stage's cancel reaches this rank as Ctrl-C would, however Ray was started
    threads = torch.get_num_threads()  # the loop sets its own; this process takes other tasks after
    saved = {var: os.environ.get(var) for var in RANK_VARIABLES}
    store = dist.PrefixStore(attempt, dist.TCPStore(address[0], address[1], is_master=False,
                                                     timeout=STORE_TIMEOUT))
    try:
        store.set(f"node/{rank}", ray.get_runtime_context().get_node_id())
        nodes = [store.get(f"node/{r}").decode() for r in range(world)]
        local = placement(nodes)[rank]
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local[0]), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(local[1]), "NODE_RANK": str(local[2])})
        end_process_group()  # one this process kept from an earlier run (the one-worker launcher's)
        dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=world,
                                timeout=STORE_TIMEOUT)
        record = CheckpointRecord(run["storage"], run["name"], run["keep"])
        restored = ray.train.Checkpoint(restored_path, filesystem=record.fs) if restored_path else None
        set_train_fn_utils(_utils_class()(run["name"], rank, world, local, store, record,
                                          callbacks if rank == 0 else [], restored))
        if rank == 0:
            print(f"training as {world} ranks in Ray tasks, "
                  f"{'from ' + restored_path if restored_path else 'from step 0'}", flush=True)
        train_fn(config)
    finally:
        set_train_fn_utils(None)
        end_process_group()
        torch.set_num_threads(threads)
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _cause(error: BaseException) -> BaseException:
    """The rank's own exception inside Ray's wrapper (a RayTaskError names the task; its cause is the error)."""
    return getattr(error, "cause", None) or error


def _end(refs: list, grace_s: float) -> None:
    """The ranks still running cancelled as Ctrl-C would (their metrics flushed), and killed if they have not
    ended ``grace_s`` after, or ``STUCK_S`` after another rank ended: a rank waiting in a collective for one that
    has ended waits on (gloo does not close a group's connections while the ended rank's process lives, and
    that process is Ray's, kept for other tasks). Returns once all have ended, so their bundles are free again."""
    import ray

    pending = [r for r in refs if not ray.wait([r], timeout=0)[0]]
    for ref in pending:
        ray.cancel(ref, force=False)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        if len(pending) < len(refs):
            deadline = min(deadline, time.monotonic() + STUCK_S)
        wait_s = max(0.0, min(1.0, deadline - time.monotonic()))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        ray.wait(pending, num_returns=len(pending), timeout=60)


def _attempt(refs: list) -> tuple[int, BaseException] | None:
    """Waits for an attempt's ranks: None when all finished, else the first failure (its rank, its error)."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except Exception as e:  # noqa: BLE001 - a rank's error or its process's death fails the attempt
            return refs.index(ready[0]), _cause(e)
    return None


def _remove_leftover(group_name: str) -> None:
    """The placement group an earlier attempt of this training left, removed: Ray keeps a group whose creating
    task was killed (SIGKILL, its node lost, out of memory) until the job ends, holding its CPUs, and Ray's
    retry of the stage would wait for them. Only this training's stage makes a group of that name, and the
    artifact's lock lets one such stage run at a time."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        leftover = get_placement_group(group_name)
    except ValueError:  # none
        return
    print(f"removing the placement group {group_name} that an earlier attempt of this training left", flush=True)
    remove_placement_group(leftover)


@contextlib.contextmanager
def _placed(group_name: str, num_workers: int, cpus: float, strategy: str):
    """A placement group of a bundle of ``cpus`` CPUs per rank, ready; removed on the way out."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    _remove_leftover(group_name)
    pg = placement_group([{"CPU": cpus}] * num_workers, strategy=strategy, name=group_name)
    try:
        ray.get(pg.ready())
        yield pg
    finally:
        remove_placement_group(pg)  # it ends any rank still running in it


def _run_attempt(pg, ranks: list[tuple], cpus: float) -> tuple[int, BaseException] | None:
    """One attempt: a task per rank (``ranks``: each one's ``run_rank`` arguments) in its bundle, waited for;
    the first failure (its rank, its error) or None. The ranks still running end on the way out (a failure,
    the stage cancelled)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rank_task = ray.remote(run_rank)
    refs = [rank_task.options(
        name=f"conduit.train.rank{rank}", num_cpus=cpus, max_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
    ).remote(*args) for rank, args in enumerate(ranks)]
    try:
        return _attempt(refs)
    finally:
        try:
            _end(refs, CANCEL_GRACE_S)
        except KeyboardInterrupt:  # interrupted again while waiting: removing the group ends the ranks in it
            pass


def fit(train_fn: Callable[[dict], None], config: dict, *, num_workers: int, cpus: float | None,
        strategy: str, storage: str, name: str, keep: int, max_failures: int, callbacks: list,
        backend: str = "gloo", recovered: str | None = None,
        on_placed: Callable[[], None] | None = None) -> InTaskResult:
    """Run ``train_fn(config)`` on ``num_workers`` ranks as Ray tasks (the module's docstring).

    Args:
        cpus: CPUs each rank holds (its bundle, and its threads); None: 1.
        strategy: the placement group's strategy (``parallel.placement_strategy``).
        storage, name, keep, max_failures, callbacks, recovered: as ``pipeline.training.in_task.fit``.
        on_placed: called once the placement group is ready (the ranks are about to start).

    Returns:
        The newest checkpoint, and the error that ended the run once restarts ran out (else None).
    """
    import ray
    import torch.distributed as dist

    cpus = cpus or 1
    server = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    address = (ray.util.get_node_ip_address(), server.port)
    run = {"storage": storage, "name": name, "keep": keep}
    failures = 0
    with _placed(f"conduit-ranks-{name}", num_workers, cpus, strategy) as pg:
        if on_placed is not None:
            on_placed()
        while True:
            latest = CheckpointRecord(storage, name, keep).latest()
            restored = latest.path if latest is not None else recovered
            failed = _run_attempt(pg, [(train_fn, config, rank, num_workers, address, f"attempt{failures}/",
                                        backend, run, callbacks, restored) for rank in range(num_workers)], cpus)
            latest = CheckpointRecord(storage, name, keep).latest()
            if failed is None:
                return InTaskResult(checkpoint=latest, error=None, failures=failures)
            failures += 1
            rank, error = failed
            for cb in callbacks:
                if hasattr(cb, "after_exception"):
                    cb.after_exception(run_context=None, worker_exceptions={rank: error})
            if 0 <= max_failures < failures:
                return InTaskResult(checkpoint=latest, error=error, failures=failures)

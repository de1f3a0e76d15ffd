"""One training worker in the train stage's own task: Ray Train's run without its controller and actors.

A run of one worker on a CPU (``parallel.launcher``: ``in_task``, or ``auto`` there) needs none of what
Ray Train starts around its workers: no process group to form between processes, no worker group to
watch and restart, no placement group. Yet each run paid for them: a controller actor, a
synchronization actor and a worker actor, each a fresh process importing its share of Ray Train, torch
and DeepSpeed (``benchmarks/fixed_costs.py``: about two thirds of a 30-step stage's CPU-seconds outside
its steps). Here the training function (``pipeline.training.loop.main``, unchanged) runs in the stage's
task, a Ray worker process that may have imported torch and DeepSpeed for an earlier run already.

What Ray Train did for such a run, this module does, through the same calls the loop makes
(``ray.train.get_context``, ``get_checkpoint``, ``report``; they reach ``InTaskTrainFnUtils`` through
Ray Train's own hook for its local mode, ``set_train_fn_utils``):

- checkpoints go where Ray Train puts them, in its layout: ``<storage>/<name>/checkpoint_<time>/`` and
  the run's ``checkpoint_manager_snapshot.json`` (Ray Train's own record, written with its own model),
  the newest ``checkpoint.keep`` kept. So the stage's after-seal pruning, ``checkpoint.resume_from``,
  a rerun after the driver died, and a later Ray Train run of the same artifact (a rerun on a GPU
  cluster) all find them as before;
- a failure restarts the training function from the newest checkpoint, at most ``checkpoint.max_failures``
  times, and each failure reaches the failure callback (the run's tags) as Ray Train's would; a process
  that dies (SIGKILL, out of memory) takes the task with it and Ray's task retry starts the stage again,
  which resumes from the same checkpoints;
- reports reach the run's callbacks (``after_report``), so a sweep trial's validation losses still go
  to Ray Tune;
- the process group is torch's, of one rank (gloo, or NCCL on a GPU), kept for the process's later runs.

Ray Train's local mode (``ScalingConfig(num_workers=0)``) runs the function in-process too, but persists no
checkpoint, restarts nothing and calls no callback: it is for debugging, not for runs a user keeps.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow.fs as pafs

from pipeline.data.fs import filesystem_for
from pipeline.store.contracts import CHECKPOINT_PREFIX

SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's record of the checkpoints it kept


def uses_in_task(launcher: str, num_workers: int, device: str, stages_confined: bool = False) -> bool:
    """Whether the train stage trains in its own task: ``parallel.launcher`` in_task, or auto with one
    worker on a CPU. Auto keeps Ray Train on a GPU (its worker gets the GPU Ray assigns it) and where
    ``cluster.stage_resources`` confines the stage tasks to some nodes (``stages_confined``): training
    workers are placed by ``parallel.placement_strategy``, not there."""
    if launcher == "in_task":
        return True
    return launcher == "auto" and num_workers == 1 and device == "cpu" and not stages_confined


def assigned_cpus() -> float | None:
    """The CPUs Ray reserved for this process's task or actor; None outside a Ray worker (a driver calling
    the stage directly, as tests do)."""
    import ray

    context = ray.get_runtime_context()
    if not ray.is_initialized() or context.worker.mode != ray.WORKER_MODE:
        return None
    return context.get_assigned_resources().get("CPU")


class CheckpointRecord:
    """A Ray Train run's checkpoints at ``<storage>/<name>``, read and written in Ray Train's layout.

    Args:
        storage: ``checkpoint.storage`` (a local folder or an object-store URI).
        name: the run's name (``train-<artifact hash>``).
        keep: how many of the newest checkpoints stay (``checkpoint.keep``).
    """

    def __init__(self, storage: str, name: str, keep: int) -> None:
        self.fs, base = filesystem_for(storage)
        self.uri = f"{storage.rstrip('/')}/{name}"
        self.dir = f"{base.rstrip('/')}/{name}"
        self.keep = keep
        self.results: list[dict] = []  # {"checkpoint_dir_name", "metrics"}, oldest first
        self.indices: list[int] = []  # the report index of each
        self.reports = 0  # every report so far, with a checkpoint or not (Ray Train's current_report_index)
        self._read()

    def _read(self) -> None:
        try:
            with self.fs.open_input_stream(f"{self.dir}/{SNAPSHOT_FILE}") as f:
                saved = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            return
        self.results = [{"checkpoint_dir_name": r["checkpoint_dir_name"], "metrics": r["metrics"]}
                        for r in saved["checkpoint_results"]]
        self.indices = list(saved["checkpoint_report_indices"])
        self.reports = saved["current_report_index"]

    def latest(self):
        """The newest kept checkpoint as a ``ray.train.Checkpoint``, or None."""
        import ray.train

        if not self.results:
            return None
        return ray.train.Checkpoint(f"{self.dir}/{self.results[-1]['checkpoint_dir_name']}", filesystem=self.fs)

    def add(self, metrics: dict, local_dir: str | None):
        """One report: with ``local_dir``, that folder uploaded as a new checkpoint (then the record, then
        the checkpoints beyond ``keep`` deleted, in Ray Train's order: a crash between leaves an extra
        folder, never a record naming a missing one). Returns the new ``ray.train.Checkpoint`` or None."""
        if local_dir is None:
            self.reports += 1
            return None
        name = self.new_name()
        self.upload(local_dir, name)
        return self.register(metrics, name)

    def new_name(self) -> str:
        """The folder name of the next checkpoint (Ray Train's: ``checkpoint_<time>``), after every kept one."""
        name = f"{CHECKPOINT_PREFIX}{datetime.datetime.now().strftime('%Y-%m-%d_%H-%M-%S.%f')}"
        if self.results and name <= self.results[-1]["checkpoint_dir_name"]:  # a clock stepped back: keep the order
            name = self.results[-1]["checkpoint_dir_name"] + "0"
        return name

    def upload(self, local_dir: str, name: str) -> None:
        """A rank's part of checkpoint ``name``: its files, copied into the folder (several ranks' parts merge
        there, as Ray Train merges its workers')."""
        self.fs.create_dir(f"{self.dir}/{name}", recursive=True)
        pafs.copy_files(local_dir, f"{self.dir}/{name}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)

    def register(self, metrics: dict, name: str):
        """Checkpoint ``name``, whole in storage, recorded as this report's; the ones beyond ``keep`` deleted
        after the record is written. Returns it as a ``ray.train.Checkpoint``."""
        import ray.train

        index = self.reports  # Ray Train's index of this report: 0 for a run's first
        self.reports += 1
        self.results.append({"checkpoint_dir_name": name, "metrics": dict(metrics)})
        self.indices.append(index)
        dropped = self.results[:-self.keep] if self.keep else []
        if self.keep:
            self.results, self.indices = self.results[-self.keep:], self.indices[-self.keep:]
        self._write()
        for r in dropped:
            self.fs.delete_dir(f"{self.dir}/{r['checkpoint_dir_name']}")
        return ray.train.Checkpoint(f"{self.dir}/{name}", filesystem=self.fs)

    def _write(self) -> None:
        """The record, through Ray Train's own model of it (its version and field names)."""
        from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
            _CheckpointManagerState,
            _TrainingResultState,
        )

        states = [_TrainingResultState(checkpoint_dir_name=r["checkpoint_dir_name"], metrics=r["metrics"])
                  for r in self.results]
        snapshot = _CheckpointManagerState(
            checkpoint_results=states, checkpoint_report_indices=self.indices,
            latest_checkpoint_result=states[-1] if states else None, pending_training_results=[],
            pending_validation_specs=[], current_report_index=self.reports, validated_checkpoint_dir_names=[],
            timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[])
        data = snapshot.json().encode("utf-8")
        path = f"{self.dir}/{SNAPSHOT_FILE}"
        if isinstance(self.fs, pafs.LocalFileSystem):  # whole or not at all (Ray Train truncates, then writes)
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:  # an object store's put is whole already
            with self.fs.open_output_stream(path) as f:
                f.write(data)


def _utils_class():
    """``InTaskTrainFnUtils``, made on first use: Ray Train's train_fn_utils module is imported only here."""
    from ray.train.v2._internal.execution.train_fn_utils import LocalTrainFnUtils

    class InTaskTrainFnUtils(LocalTrainFnUtils):
        """What ``ray.train.report`` / ``get_checkpoint`` / ``get_context`` reach in the stage's task: a
        world of one whose checkpoints persist in ``record`` and whose reports reach ``callbacks``."""

        def __init__(self, experiment_name: str, record: CheckpointRecord, callbacks: list, restored) -> None:
            super().__init__(experiment_name=experiment_name)
            self._record, self._callbacks, self._restored = record, callbacks, restored

        def report(self, metrics, checkpoint=None, checkpoint_dir_name=None, **_ignored) -> None:
            persisted = self._record.add(metrics, checkpoint.path if checkpoint is not None else None)
            self._last_metrics = metrics
            if persisted is not None:
                self._last_checkpoint = persisted
            for cb in self._callbacks:
                cb.after_report(run_context=None, metrics=[dict(metrics)], checkpoint=persisted)

        def get_checkpoint(self):
            return self._restored  # what this attempt starts from (Ray Train's get_checkpoint: the same)

    return InTaskTrainFnUtils


@dataclass
class InTaskResult:
    """What ``fit`` returns: Ray Train's ``Result`` fields the train stage reads."""

    checkpoint: Any
    error: BaseException | None
    failures: int


RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}  # what DeepSpeed reads


def _process_group(backend: str) -> None:
    """torch's process group of this one rank, made once a process (DeepSpeed finds it and makes none)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() == 1:
            return
        end_process_group()  # left by ranks of several (``pipeline.training.rank_tasks``): not expected, but not ours
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def end_process_group() -> None:
    """torch's default process group and the groups made from it destroyed, and those DeepSpeed cached
    forgotten (its module keeps them, e.g. the expert-parallel groups, and would hand a later run's engine
    groups that are gone)."""
    import sys

    import torch.distributed as dist

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for attr, value in vars(groups).items():
            if attr.startswith("_") and attr.isupper() and ("GROUP" in attr or "PARALLEL" in attr):
                if isinstance(value, dict):
                    value.clear()
                elif not isinstance(value, str):
                    setattr(groups, attr, None)
        groups.mesh_device = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _set_rank_env() -> dict:
    """This one rank's variables, for the run only (the task's process, which Ray reuses, may run other
    tasks after); returns what they were, for ``_restore_env``."""
    saved = {var: os.environ.get(var) for var in RANK_ENV}
    os.environ.update({var: value for var, value in RANK_ENV.items() if var not in os.environ})
    return saved


def _restore_env(saved: dict) -> None:
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


def fit(train_fn: Callable[[dict], None], config: dict, *, storage: str, name: str, keep: int,
        max_failures: int, callbacks: list, backend: str = "gloo",
        recovered: str | None = None) -> InTaskResult:
    """Run ``train_fn(config)`` here as Ray Train would run it on one worker (the module's docstring).

    Args:
        storage, name: the Ray Train run's place (``checkpoint.storage``, ``train-<hash>``).
        keep: checkpoints kept (``checkpoint.keep``).
        max_failures: restarts allowed (``checkpoint.max_failures``; -1: no limit, as Ray Train's).
        callbacks: Ray Train user callbacks; ``after_report`` and ``after_exception`` are called.
        recovered: a checkpoint folder to start from when the run's record has none (the train stage's
            recovery of a record cut short).

    Returns:
        The newest checkpoint, and the error that ended the run once restarts ran out (else None).
    """
    import ray.train
    import torch
    from ray.train.v2._internal.execution.train_fn_utils import set_train_fn_utils

    threads = torch.get_num_threads()  # the loop sets its own; this process may run other tasks after
    saved_env = _set_rank_env()
    failures = 0
    try:
        _process_group(backend)
        record = CheckpointRecord(storage, name, keep)
        utils_class = _utils_class()
        while True:
            restored = record.latest()
            if restored is None and recovered:
                restored = ray.train.Checkpoint(recovered)
            set_train_fn_utils(utils_class(name, record, callbacks, restored))
            print(f"training in the train stage's task (one worker), "
                  f"{'from ' + restored.path if restored is not None else 'from step 0'}", flush=True)
            try:
                train_fn(config)
                return InTaskResult(checkpoint=record.latest(), error=None, failures=failures)
            except Exception as e:  # noqa: BLE001 - as Ray Train: a failed attempt restarts from its checkpoint
                failures += 1
                for cb in callbacks:
                    if hasattr(cb, "after_exception"):
                        cb.after_exception(run_context=None, worker_exceptions={0: e})
                if 0 <= max_failures < failures:
                    return InTaskResult(checkpoint=record.latest(), error=e, failures=failures)
    finally:
        set_train_fn_utils(None)
        torch.set_num_threads(threads)
        _restore_env(saved_env)

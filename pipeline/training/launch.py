"""The one door into training: ``launch(loop, how)`` runs ``pipeline.training.loop.main`` through Ray Train's
public API, on as many workers as the run asks for, and returns how it ended.

- Several workers (or a GPU, or stage tasks confined to some nodes): Ray Train's ``TorchTrainer``
  starts the workers and their process group (gloo on CPUs, NCCL on GPUs), restarts the group after a
  failure up to ``checkpoint.max_failures`` times (``FailureConfig``) and calls the run's callbacks.
- One worker on a CPU: Ray Train's local mode (``ScalingConfig(num_workers=0)``) runs the loop in the train
  stage's own task, a Ray worker process that may have imported torch and DeepSpeed for an earlier run
  already, with none of the controller and worker actors a Ray Train run starts (each a fresh process).
  Local mode is for debugging in Ray's words: it makes no process group, restarts nothing and calls no
  callback. So here, and only here, the launch makes the one-rank process group (its backend from the
  run's device), starts the loop again after a failure (``_attempts``) and hands the loop's reports to the
  callbacks itself (``LoopConfig.report``).

Checkpoints are the loop's own in both (``pipeline.training.checkpoint``: written to ``checkpoint.storage``
under the training's name, recorded, kept and found the same way whoever launched the ranks), so a run
begun by one launch resumes under the other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipeline.training.loop_config import LoopConfig


@dataclass(frozen=True)
class Launch:
    """How the ranks run: ``num_workers`` of them on ``device``, each holding ``cpus`` CPUs (None: Ray
    Train's default, a GPU each), placed by ``placement_strategy``; ``in_process``: the one rank in this
    process (Ray Train's local mode); ``max_failures``: restarts allowed (-1: no limit); ``callbacks``: Ray
    Train user callbacks (``after_report``, ``after_exception``)."""

    num_workers: int
    device: str
    cpus: float | None
    placement_strategy: str
    max_failures: int
    callbacks: Sequence[Any] = ()
    in_process: bool = False

    @property
    def backend(self) -> str:
        from pipeline.training.device import backend_for

        return backend_for(self.device)


@dataclass
class Outcome:
    """How training ended: ``error`` is the failure that ended it once restarts ran out, else None."""

    error: BaseException | None
    failures: int = 0


def train_worker(config: LoopConfig) -> None:
    """Each rank's function: ``loop.main``, imported in the rank, so that the stage's task, which hands this
    function to Ray Train, imports neither torch nor the loop until it trains itself."""
    from pipeline.training.loop import main

    main(config)


def launch(loop: LoopConfig, how: Launch) -> Outcome:
    """Train: ``loop`` on the ranks ``how`` describes (the module's docstring).

    Returns:
        ``Outcome``; a failure past ``checkpoint.max_failures`` is returned, not raised. An interrupt
        (Ctrl-C, a cancelled stage task) is raised.
    """
    if how.in_process:
        return _in_this_process(loop, how)
    return _on_ray_train_workers(loop, how)


def _run_config(loop: LoopConfig, how: Launch, callbacks: Sequence[Any]):
    import ray.train

    return ray.train.RunConfig(name=loop.checkpoints.name, storage_path=loop.checkpoints.storage,
                               failure_config=ray.train.FailureConfig(max_failures=how.max_failures),
                               callbacks=list(callbacks))


def _on_ray_train_workers(loop: LoopConfig, how: Launch) -> Outcome:
    import ray.train
    from ray.train.torch import TorchConfig

    from pipeline.training.ray_train import trainer_class

    trainer = trainer_class()(
        train_worker, train_loop_config=loop, torch_config=TorchConfig(backend=how.backend),
        scaling_config=ray.train.ScalingConfig(num_workers=how.num_workers, use_gpu=how.device == "cuda",
                                               placement_strategy=how.placement_strategy,
                                               resources_per_worker={"CPU": how.cpus} if how.cpus else None),
        run_config=_run_config(loop, how, how.callbacks))
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:  # Ray Train raises once the group's restarts ran out
        return Outcome(error=e, failures=max(how.max_failures, 0) + 1)
    return Outcome(error=result.error)


def _in_this_process(loop: LoopConfig, how: Launch) -> Outcome:
    """One rank here, through Ray Train's local mode, in a one-rank process group made for the run (and
    ended after it: the task's process, which Ray reuses, may run other tasks), with this rank's variables
    set for the run only."""
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    def report(metrics: dict) -> None:
        for cb in how.callbacks:
            cb.after_report(run_context=None, metrics=[dict(metrics)], checkpoint=None)

    loop = replace(loop, report=report)
    trainer = TorchTrainer(
        train_worker, train_loop_config=loop, scaling_config=ray.train.ScalingConfig(num_workers=0),
        run_config=_run_config(loop, how, ()))
    threads = torch.get_num_threads()  # the loop sets its own; this process may run other tasks after
    saved = _set_env(RANK_ENV)
    def attempt() -> None:
        print("training in the train stage's task (one worker)", flush=True)
        _one_rank(trainer.fit, how.backend)

    try:
        return _attempts(attempt, how.max_failures, how.callbacks)
    finally:
        torch.set_num_threads(threads)
        _set_env(saved)


def _attempts(attempt: Callable[[], object], max_failures: int, callbacks: Sequence[Any]) -> Outcome:
    """``attempt()`` again after each failure, at most ``max_failures`` times (-1: no limit), each failure told
    to the callbacks (``after_exception``) as Ray Train's controller tells them; the loop resumes from its
    newest checkpoint each time. An interrupt is not a failure: it ends the run."""
    failures = 0
    while True:
        try:
            attempt()
            return Outcome(error=None, failures=failures)
        except Exception as e:  # noqa: BLE001 - as Ray Train: a failed attempt restarts from its checkpoint
            failures += 1
            for cb in callbacks:
                if hasattr(cb, "after_exception"):
                    cb.after_exception(run_context=None, worker_exceptions={0: e})
            if 0 <= max_failures < failures:
                return Outcome(error=e, failures=failures)


RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}  # what DeepSpeed reads


def _set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """``values`` set (None: unset) in this process's environment; returns what they were."""
    before = {var: os.environ.get(var) for var in values}
    for var, value in values.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    return before


def _one_rank(run: Callable[[], object], backend: str) -> None:
    """``run()`` in a process group of this one rank (torch's, ``backend``), ended after it."""
    import torch.distributed as dist

    if dist.is_initialized():  # a group left by another run in this process (none should be): not ours
        end_process_group()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        run()
    finally:
        end_process_group()


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

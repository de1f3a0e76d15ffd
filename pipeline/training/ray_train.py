"""Ray Train as Conduit starts it (``pipeline.training.launch``): the trainer class, the callback that tells a
run's failures, and the placement groups dead controllers leave.

Ray Train (2.60) starts a few helper actors with every run beside its controller and workers. Two of
them cost every run of ours time and a process each and give nothing back here, so ``trainer_class``
leaves them out:

- ``PlacementGroupCleaner``, a detached actor that removes the run's placement group if the controller
  dies. It asks whether the controller lives through the dashboard's state API, found the way ``ray
  status`` finds a cluster: ``RAY_ADDRESS``, else ``/tmp/ray/ray_current_cluster``, else any GCS on the
  machine. Where the dashboard is off (our embedded Ray, the tests' clusters) that never answers, and
  where the last ``ray start`` on the machine left the address of a cluster that is gone, each question
  waits 40 s on the dead address; the controller's shutdown then waits up to 12 s for the cleaner to
  stop: every training run ended 12 s late. ``reap_orphaned_placement_groups`` does its work instead,
  from GCS directly (no dashboard), and covers what the cleaner does not see (a controller killed
  before its workers started): the train stage calls it before it starts its trainer, and a sweep
  every few seconds.
- ``DatasetManager``, started for every run to hand out Ray Data shards; ours read their token blocks
  themselves and pass no ``datasets``.
"""

from __future__ import annotations


def trainer_class():
    """``ray.train.torch.TorchTrainer`` without the two helper actors above (the module's docstring)."""
    from ray.train.torch import TorchTrainer

    from pipeline.compat import ray_train_helper_callbacks

    PlacementGroupCleanerCallback, DatasetsCallback = ray_train_helper_callbacks()

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            left_out = (PlacementGroupCleanerCallback,) + (() if self.datasets else (DatasetsCallback,))
            return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, left_out)]

    return Trainer


def failure_phase(failures: int, max_failures: int, worker_exceptions: dict) -> dict[str, str]:
    """The train run's tags after the worker group's ``failures``-th failure: what failed (each rank's
    error, first line) and, while ``checkpoint.max_failures`` allows, the restart that follows."""
    what = "; ".join(f"rank {rank}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
                     for rank, e in sorted(worker_exceptions.items()))
    phase = (f"restarting after a failure (attempt {failures + 1} of {max_failures + 1}): {what}"
             if failures <= max_failures else f"failed {failures} times, more than checkpoint.max_failures="
                                                f"{max_failures} allows: {what}")
    return {"conduit.phase": phase, "conduit.restarts": str(min(failures, max_failures)),
            "conduit.last_failure": what[:5000]}


def failure_callback(tracker, max_failures: int):
    """A Ray Train callback (it runs in the controller): each worker-group failure on the run's tags. Here,
    not beside the train stage: the controller imports what the callback's code refers to, and the stages
    package would bring the evaluation's libraries (matplotlib, scipy) into every controller (~4 s)."""
    import ray.train

    class TellFailures(ray.train.UserCallback):
        def __init__(self) -> None:
            self.failures = 0

        def after_exception(self, run_context, worker_exceptions) -> None:
            self.failures += 1
            try:
                tracker.set_tags(failure_phase(self.failures, max_failures, worker_exceptions))
            except Exception as e:  # noqa: BLE001 - MLflow down must not change how training recovers
                print(f"could not record the failure on MLflow: {e!r}", flush=True)

    return TellFailures()


def reap_orphaned_placement_groups() -> list[str]:
    """Remove this job's placement groups whose creator is a dead Ray Train controller: the worker groups
    of controllers that died with their stage task (a killed or retried train stage, a sweep's stopped
    trial). Nothing else is touched (a group made by the driver, by Tune for a trial, or by any other
    actor, dead or alive).

    Why: GCS keeps a placement group until both its creating actor and its job are gone. A controller
    killed with its train stage (Tune stops a trial by killing its actor, which takes the trial's stage
    task and its controller along; a node or task failure does the same) leaves its group holding CPUs
    until the driver exits, and the next training waits for CPUs that never come back. Nothing else can
    use such a group (its creator is gone), so it goes. Reads GCS's placement group table
    (``pipeline.compat.placement_groups_of_dead_actors``: the public listing has no creator).

    Returns:
        The ids of the groups removed.
    """
    import ray
    from ray.util.placement_group import remove_placement_group

    from pipeline.compat import placement_groups_of_dead_actors

    removed = []
    for pg, creator_class in placement_groups_of_dead_actors(ray.get_runtime_context().get_job_id()):
        if "TrainController" in creator_class:
            remove_placement_group(pg)
            removed.append(pg.id.hex())
    return removed

"""The sweep's schedulers: ASHA that marks the trials it stops, and the rung of a synchronous halving.

``RecordingASHA``: ASHA that marks the trials it stops, so that a sweep labels as stopped only what
ASHA stopped, and that ranks a diverged trial (a metric that is not finite) last (``pipeline.sweep.ranking``).

Why: Tune keeps no per-trial record of the scheduler's decision (``AsyncHyperBandScheduler`` counts
its stops; the controller ends a stopped trial as TERMINATED, as it ends one that returned). A trial
that ends without finishing for another reason (the sweep interrupted before it ran, or while it ran)
must not be reported as pruned. So this subclass writes the step of its STOP decision onto Tune's own
``Trial`` object, where the sweep's callback reads it (``stopped_at``); the callback then tags the
trial's MLflow run, which is the record that outlives the process (a resumed sweep reads the tag).

``RungEnd``: one rung of synchronous successive halving (``scheduler: sha``), which the sweep runs as
one Tune run per rung (``pipeline.sweep.run``): each trial of the rung trains until its first validation
at or past the rung's step, where this scheduler ends it and marks it paused there. The sweep then
ranks the rung's trials and resumes the best in the next rung, from the checkpoint written at that step.

Imported only where Tune runs (``run_sweep``): importing it imports Ray Tune.
"""

from __future__ import annotations

from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler, TrialScheduler

from pipeline.sweep import ranking

STOPPED_AT = "conduit_stopped_at_step"  # the attribute on Tune's Trial


class RecordingASHA(AsyncHyperBandScheduler):
    """``ASHAScheduler`` (the same arguments and decisions) that marks each trial it stops, and ranks a
    metric that is not finite as the sweep does (``ranking.as_scheduled``: the worst)."""

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        decision = super().on_trial_result(tune_controller, trial, self._ranked(result))
        if decision == TrialScheduler.STOP:
            setattr(trial, STOPPED_AT, result.get(self._time_attr))
        return decision

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        super().on_trial_complete(tune_controller, trial, self._ranked(result))  # ASHA records the last result

    def _ranked(self, result: dict) -> dict:
        """``result`` with its metric as ASHA must compare it: a NaN would never be stopped, an infinity
        would set a cutoff no finite trial meets."""
        value = result.get(self._metric)
        if value is None or ranking.finite(value):
            return result
        return {**result, self._metric: ranking.as_scheduled(value, self._mode)}


def stopped_at(trial) -> int | None:
    """The step at which ``RecordingASHA`` stopped ``trial``, or None when it did not stop it."""
    return getattr(trial, STOPPED_AT, None)


PAUSED_AT = "conduit_paused_at_step"  # the attribute on Tune's Trial


class RungEnd(FIFOScheduler):
    """First in, first out, but a trial that reports a step at or past ``step`` is stopped and marked
    paused at it (``paused_at``); ``step`` None: the last rung, whose trials train to the end."""

    def __init__(self, step: int | None, time_attr: str = "step") -> None:
        super().__init__()
        self.step, self._time_attr = step, time_attr

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        reached = result.get(self._time_attr)
        if self.step is not None and not result.get("finished") and reached is not None and reached >= self.step:
            setattr(trial, PAUSED_AT, reached)
            return TrialScheduler.STOP
        return super().on_trial_result(tune_controller, trial, result)


def paused_at(trial) -> int | None:
    """The step at which ``RungEnd`` ended ``trial``'s rung, or None."""
    return getattr(trial, PAUSED_AT, None)

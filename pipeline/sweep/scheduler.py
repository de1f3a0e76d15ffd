"""ASHA that marks the trials it stops, so that a sweep labels as stopped only what ASHA stopped.

Why: Tune keeps no per-trial record of the scheduler's decision (``AsyncHyperBandScheduler`` counts
its stops; the controller ends a stopped trial as TERMINATED, as it ends one that returned). A trial
that ends without finishing for another reason (the sweep interrupted before it ran, or while it ran)
must not be reported as pruned. So this subclass writes the step of its STOP decision onto Tune's own
``Trial`` object, where the sweep's callback reads it (``stopped_at``); the callback then tags the
trial's MLflow run, which is the record that outlives the process (a resumed sweep reads the tag).

Imported only where Tune runs (``run_sweep``): importing it imports Ray Tune.
"""

from __future__ import annotations

from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

STOPPED_AT = "conduit_stopped_at_step"  # the attribute on Tune's Trial


class RecordingASHA(AsyncHyperBandScheduler):
    """``ASHAScheduler`` (the same arguments and decisions) that marks each trial it stops."""

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision == TrialScheduler.STOP:
            setattr(trial, STOPPED_AT, result.get(self._time_attr))
        return decision


def stopped_at(trial) -> int | None:
    """The step at which ``RecordingASHA`` stopped ``trial``, or None when it did not stop it."""
    return getattr(trial, STOPPED_AT, None)

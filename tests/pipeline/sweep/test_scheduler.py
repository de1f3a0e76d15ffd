"""A sweep labels as stopped only what ASHA stopped (issue #51): ``RecordingASHA`` makes Tune's own
ASHA decisions and marks each trial it stops on Tune's Trial; a trial that ended unfinished for any
other reason (the sweep interrupted) is reported as incomplete, with Tune's state, not as pruned."""

from __future__ import annotations

import math

import pytest
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from pipeline.sweep.run import FAILED, FINISHED, INCOMPLETE, STOPPED, TrialOutcome, trial_status
from pipeline.sweep.scheduler import RecordingASHA, stopped_at

# (trial, step, val_loss) in the order Tune delivers them: trial 0 sets the bar at each rung, trial 1
# trails it at the first rung (step 10), trial 2 beats it there and trails at the second (step 20).
RESULTS = [(0, 10, 2.0), (0, 20, 1.5), (0, 30, 1.2), (1, 10, 3.0), (2, 10, 1.9), (2, 20, 1.8), (2, 30, 1.0)]


def _decisions(scheduler) -> tuple[list[str], list[Trial]]:
    scheduler.set_search_properties("val_loss", "min")
    trials = [Trial("trainable", config={"trial": i}, stub=True) for i in range(3)]
    for t in trials:
        scheduler.on_trial_add(None, t)
    decisions = []
    for i, step, loss in RESULTS:
        if decisions and any(d == TrialScheduler.STOP and RESULTS[k][0] == i for k, d in enumerate(decisions)):
            continue  # a stopped trial reports nothing more
        decisions.append(scheduler.on_trial_result(None, trials[i], {"step": step, "val_loss": loss}))
    return decisions, trials


def test_recording_asha_decides_as_asha_and_marks_only_what_it_stopped():
    args = dict(time_attr="step", max_t=31, grace_period=10, reduction_factor=2)
    theirs, _ = _decisions(ASHAScheduler(**args))
    ours, trials = _decisions(RecordingASHA(**args))
    assert ours == theirs
    assert theirs.count(TrialScheduler.STOP) == 2  # the sequence does exercise stopping, at two rungs
    assert [stopped_at(t) for t in trials] == [None, 10, 20]


def test_an_unfinished_trial_is_stopped_only_when_its_run_says_asha_stopped_it():
    stopped_tags = {"conduit.sweep_status": STOPPED, "conduit.sweep_stopped_at_step": "10"}
    assert trial_status(None, {"step": 10, "val_loss": 3.0}, stopped_tags) == STOPPED
    assert trial_status(None, {"step": 30, "finished": True}, {}) == FINISHED
    assert trial_status(RuntimeError("boom"), {"step": 10}, stopped_tags) == FAILED
    # Interrupted: while running (its run says running), or before it ran (no result, no run).
    assert trial_status(None, {"step": 20, "val_loss": 1.8}, {"conduit.sweep_status": "running"}) == INCOMPLETE
    assert trial_status(None, {}, {}) == INCOMPLETE
    o = TrialOutcome(0, {}, status=INCOMPLETE, step=20, tune_status=Trial.PENDING)
    assert o.label == "incomplete at step 20 (Tune: PENDING)"
    assert TrialOutcome(1, {}, status=INCOMPLETE, tune_status=Trial.PENDING).label == \
        "incomplete before its first step (Tune: PENDING)"
    assert TrialOutcome(2, {}, status=STOPPED, step=10).label == "stopped at step 10"


def test_a_rung_ends_each_trial_at_its_first_report_at_or_past_the_rung_and_marks_it_paused():
    """``RungEnd`` (``scheduler: sha``, one Tune run per rung): a trial goes on below the rung's step and is
    stopped, marked paused at the step it reported, at or past it; the last rung (no step) stops nothing."""
    from pipeline.sweep.scheduler import RungEnd, paused_at

    rung = RungEnd(20)
    trials = [Trial("trainable", config={"trial": i}, stub=True) for i in range(3)]
    assert rung.on_trial_result(None, trials[0], {"step": 10, "val_loss": 2.0}) == TrialScheduler.CONTINUE
    assert paused_at(trials[0]) is None
    assert rung.on_trial_result(None, trials[0], {"step": 20, "val_loss": 1.5}) == TrialScheduler.STOP
    assert rung.on_trial_result(None, trials[1], {"step": 25, "val_loss": 1.7}) == TrialScheduler.STOP  # past it
    assert [paused_at(t) for t in trials] == [20, 25, None]
    assert stopped_at(trials[0]) is None  # paused, not stopped: the sweep decides after the rung
    last = RungEnd(None)
    for step in (10, 20, 30):
        assert last.on_trial_result(None, trials[2], {"step": step, "val_loss": 1.0}) == TrialScheduler.CONTINUE
    assert last.on_trial_result(None, trials[2], {"step": 30, "finished": True}) == TrialScheduler.CONTINUE
    assert paused_at(trials[2]) is None


@pytest.mark.parametrize("mode, bar, diverged, good", [("min", 2.0, math.nan, 1.5), ("min", 2.0, -math.inf, 1.5),
                                                       ("max", 1.0, math.nan, 2.0), ("max", 1.0, math.inf, 2.0)])
def test_recording_asha_ranks_a_diverged_trial_below_every_finite_one(mode, bar, diverged, good):
    """A validation loss that is not finite ranks worst at a rung (``pipeline.sweep.ranking``): ASHA itself never
    stopped a NaN (``reward < cutoff`` is false) and let an infinite one set a cutoff no finite trial meets."""
    asha = RecordingASHA(time_attr="step", max_t=31, grace_period=10, reduction_factor=2)
    asha.set_search_properties("val_loss", mode)
    trials = [Trial("trainable", config={"trial": i}, stub=True) for i in range(4)]
    for t in trials:
        asha.on_trial_add(None, t)
    assert asha.on_trial_result(None, trials[0], {"step": 10, "val_loss": bar}) == TrialScheduler.CONTINUE
    assert asha.on_trial_result(None, trials[1], {"step": 10, "val_loss": diverged}) == TrialScheduler.STOP
    asha.on_trial_complete(None, trials[1], {"step": 10, "val_loss": diverged})
    # the diverged value recorded at the rung (as the worst) moves no cutoff past a finite trial
    assert asha.on_trial_result(None, trials[2], {"step": 10, "val_loss": good}) == TrialScheduler.CONTINUE
    asha.on_trial_complete(None, trials[0], {"step": 10, "val_loss": diverged})  # its last report diverged
    assert asha.on_trial_result(None, trials[3], {"step": 10, "val_loss": good}) == TrialScheduler.CONTINUE
    assert [stopped_at(t) for t in trials] == [None, 10, None, None]

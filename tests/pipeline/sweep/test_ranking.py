"""A diverged trial (a metric that is NaN or infinite) ranks below every trial with a finite value and is never
the best: not at a rung of synchronous halving, not in ASHA's cutoffs, not in the summary (so ``register: best``
never registers it); when every trial diverged the sweep has no best and says which trials and values.

Python leaves a NaN where it stands in a sort (every comparison with it is false) and ``min`` returns it when it
comes first, so each of these picked a diverged trial before ``pipeline.sweep.ranking``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from pipeline.sweep import run as sweep_run
from pipeline.sweep.run import FINISHED, STOPPED

NAN, INF = math.nan, math.inf


def _spec(mode: str = "min", n: int = 4, rungs=(10,), register: str = "best") -> SimpleNamespace:
    return SimpleNamespace(name="s", mode=mode, metric="val_loss", rungs=list(rungs), reduction_factor=2,
                           start_order=list(range(n)), register=register, dimensions=(),
                           trials=[SimpleNamespace(index=i, values={"optim.lr": 10.0 ** -i}) for i in range(n)])


def _ended(index: int, metrics: dict) -> tuple:
    """Tune's (Result, Trial) of one trial."""
    config = {"trial": index}
    return (SimpleNamespace(config=config, metrics=metrics, error=None),
            SimpleNamespace(config=config, status="TERMINATED"))


class FakeRungs:
    """``_tuner`` for ``_fit_rungs``: each rung's Tune run gives each of its trials the result ``losses``
    says (at the rung's step; the last rung finishes them), and records which trials each rung ran."""

    def __init__(self, losses: dict[int, float]):
        self.losses, self.ran = losses, []

    def __call__(self, spec, base, trainable, storage, name, order, scheduler, outcomes, echo):
        self.ran.append(sorted(order))
        step = scheduler.step
        ended = [_ended(i, {"step": step, "val_loss": self.losses[i]} if step is not None else
                        {"step": 30, "val_loss": self.losses[i], "finished": True}) for i in order]
        grid = ResultGrid(r for r, _ in ended)
        grid._experiment_analysis = SimpleNamespace(trials=[t for _, t in ended])
        return SimpleNamespace(fit=lambda: grid)


class ResultGrid(list):
    """Tune's ResultGrid as ``_fit_rungs`` reads it: the results, and Tune's trials beside them."""


def _fit(monkeypatch, spec, losses) -> tuple[FakeRungs, list, list[str]]:
    tuner, stopped, lines = FakeRungs(losses), [], []
    monkeypatch.setattr(sweep_run, "_tuner", tuner)
    monkeypatch.setattr(sweep_run, "_mark_stopped",
                        lambda uri, exp, sweep, name, last, by: stopped.append((name, last["val_loss"], by)))
    sweep_run._fit_rungs(spec, None, None, "/nowhere", None, "uri", "exp", "sweep", lines.append)
    return tuner, stopped, lines


@pytest.mark.parametrize("mode, losses, promoted, stopped", [
    # trial 0 diverged: Python's sort kept it first, so it was promoted and trial 1 (2.0) stopped
    ("min", {0: NAN, 1: 2.0, 2: 1.0, 3: 3.0}, [1, 2], [("trial_003", 3.0), ("trial_000", NAN)]),
    ("min", {0: 2.0, 1: -INF, 2: 1.0, 3: 3.0}, [0, 2], [("trial_003", 3.0), ("trial_001", -INF)]),
    ("max", {0: NAN, 1: 2.0, 2: INF, 3: 1.0}, [1, 3], [("trial_000", NAN), ("trial_002", INF)]),
    # only one finite: it alone goes on, though the rung keeps two (a diverged trial never does)
    ("min", {0: NAN, 1: INF, 2: 1.0, 3: NAN}, [2], [("trial_000", NAN), ("trial_001", INF), ("trial_003", NAN)]),
])
def test_synchronous_halving_stops_a_diverged_trial_and_promotes_the_best_finite(monkeypatch, mode, losses,
                                                                                 promoted, stopped):
    tuner, marked, lines = _fit(monkeypatch, _spec(mode), losses)
    assert tuner.ran == [[0, 1, 2, 3], promoted]
    assert [(name, repr(loss)) for name, loss, _ in marked] == [(name, repr(loss)) for name, loss in stopped]
    assert {by for _, _, by in marked} == {"synchronous successive halving (rung 1)"}
    assert [line for line in lines if "stopped" in line] == [
        f"{name}: stopped at step 10 (val_loss {loss}): "
        + ("not among the best 2 of the 4" if math.isfinite(loss) else "not finite: never among the best")
        + " at rung 1" for name, loss in stopped]


def test_a_rung_where_every_trial_diverged_promotes_none_and_runs_no_later_rung(monkeypatch):
    tuner, marked, lines = _fit(monkeypatch, _spec("min"), {0: NAN, 1: INF, 2: -INF, 3: NAN})
    assert tuner.ran == [[0, 1, 2, 3]]
    assert [name for name, _, _ in marked] == ["trial_000", "trial_001", "trial_002", "trial_003"]
    assert lines[-1] == ("sweep s: rung 1: no trial has a finite val_loss (trial_000 nan, trial_001 inf, "
                         "trial_002 -inf, trial_003 nan): none goes on")


class FakeTracker:
    """``StageTracker`` of the sweep's run, recording what the summary writes."""

    written: dict = {}

    def __init__(self, uri, run_id):
        self.run_id = run_id

    def set_tags(self, tags):
        FakeTracker.written.setdefault("tags", {}).update(tags)

    def log_metrics(self, metrics):
        FakeTracker.written.setdefault("metrics", {}).update(metrics)

    def log_table(self, table, name):
        FakeTracker.written["table"] = table

    def log_figure(self, figure, name):
        pass


def _summarise(monkeypatch, spec, ended) -> tuple:
    FakeTracker.written = {}
    monkeypatch.setattr(sweep_run, "StageTracker", FakeTracker)
    monkeypatch.setattr(sweep_run, "metric_figure", lambda spec, trials: None)
    monkeypatch.setattr(sweep_run, "_trial_runs",
                        lambda uri, exp, sweep, name, running: [(f"run_{name}", {"conduit.sweep_status": STOPPED})])
    lines = []
    return sweep_run._summarise(spec, ended, "uri", "exp", "sweep", lines.append), FakeTracker.written, lines


def _finished(index: int, value: float) -> tuple:
    return _ended(index, {"step": 30, "val_loss": value, "finished": True, "run_id": f"run_{index}"})


@pytest.mark.parametrize("mode, values, best", [
    ("min", [NAN, 2.0, 1.0], 2),  # min() returned the NaN that came first
    ("min", [1.5, -INF, 1.0], 2),
    ("max", [NAN, 2.0, 1.0], 1),
    ("max", [1.0, INF, 2.0], 2),
])
def test_the_best_trial_is_the_best_finite_one(monkeypatch, mode, values, best):
    result, written, lines = _summarise(monkeypatch, _spec(mode, n=3), [_finished(i, v) for i, v in enumerate(values)])
    assert result.best.index == best
    assert written["tags"]["conduit.sweep_best_trial"] == f"trial_{best:03d}"
    assert written["metrics"] == {"best_val_loss": values[best]}
    assert lines[-1] == f"best: trial_{best:03d} (val_loss {values[best]:.4f})"


def test_when_every_trial_diverged_there_is_no_best_and_the_sweep_names_them(monkeypatch):
    ended = [_finished(0, NAN), _finished(1, INF),
             _ended(2, {"step": 10, "val_loss": NAN})]  # stopped at a rung (its run says so)
    result, written, lines = _summarise(monkeypatch, _spec("min", n=3), ended)
    assert result.best is None
    assert [o.status for o in result.trials] == [FINISHED, FINISHED, STOPPED]
    message = ("no best trial: no trial finished with a finite val_loss (trial_000 finished: val_loss nan; "
               "trial_001 finished: val_loss inf; trial_002 stopped at step 10: last val_loss nan); "
               "nothing is registered")
    assert lines[-1] == message
    assert written["tags"]["conduit.sweep_no_best"] == message
    assert "conduit.sweep_best_trial" not in written["tags"] and "metrics" not in written


class FakeRuns:
    """The MLflow calls ``_mark_stopped`` makes: each trial's run and one unfinished stage run under it."""

    def __init__(self, monkeypatch):
        self.tags, self.ended = {}, {}
        monkeypatch.setattr(sweep_run, "_trial_runs", lambda uri, exp, sweep, name, running: [(f"run_{name}", {})])
        monkeypatch.setattr(sweep_run.tracking, "search_runs", lambda uri, exp, query: [
            (f"{query.split(chr(39))[-2]}/train", {})])
        monkeypatch.setattr(sweep_run.tracking, "end_run", lambda uri, run_id, status="FINISHED":
                            self.ended.__setitem__(run_id, status))
        runs = self

        class Tracker:
            def __init__(self, uri, run_id):
                self.run_id = run_id

            def set_tags(self, tags):
                runs.tags.setdefault(self.run_id, {}).update(tags)

        monkeypatch.setattr(sweep_run, "StageTracker", Tracker)


def test_a_stopped_trial_is_said_stopped_by_the_scheduler_that_stopped_it(monkeypatch):
    """Synchronous halving's stops were described as ASHA's."""
    from pipeline.sweep.scheduler import STOPPED_AT

    runs = FakeRuns(monkeypatch)
    monkeypatch.setattr(sweep_run, "_tuner", FakeRungs({0: 1.0, 1: 2.0}))
    sweep_run._fit_rungs(_spec("min", n=2), None, None, "/nowhere", None, "uri", "exp", "sweep", lambda line: None)
    assert runs.tags["run_trial_001"]["mlflow.note.content"] == \
        "trial_001: stopped at step 10 by synchronous successive halving (rung 1)"
    assert runs.tags["run_trial_001/train"] == {"conduit.error": "the sweep's scheduler stopped at step 10"}
    assert runs.ended == {"run_trial_001/train": "KILLED", "run_trial_001": "KILLED"}

    asha_stopped = SimpleNamespace(config={"trial": 2}, last_result={"step": 20, "val_loss": 3.0}, **{STOPPED_AT: 20})
    lines = []
    sweep_run._outcomes_class()("uri", "exp", "sweep", lines.append).on_trial_complete(0, [], asha_stopped)
    assert runs.tags["run_trial_002"]["mlflow.note.content"] == "trial_002: stopped at step 20 by ASHA"
    assert runs.tags["run_trial_002/train"] == {"conduit.error": "the sweep's scheduler stopped at step 20"}
    assert lines == ["trial_002: stopped at step 20 (val_loss 3.0) by ASHA"]

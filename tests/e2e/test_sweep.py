"""Sweeps end to end. On the session's Ray: three learning rates of the smoke pipeline, ASHA on the
validation loss, one trial at a time. The data stages run once, before the trials (an artifact root of
its own: the module does not wait for the session's smoke run); the trials nest in MLflow under the
sweep's run; those that trail are stopped at a rung, honestly (their runs KILLED and tagged, no train
artifact sealed); the best finished trial's model is registered with the sweep's run id; running the
sweep again resumes it without running a trial twice; then a sweep whose trials fail is retried and
reported. As a user runs it: a killed ``jobs.sweep`` driver, run again, resumes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from pipeline import tracking
from pipeline.runner import make_plan, resolve
from pipeline.store.backends import store_for
from pipeline.sweep.run import FAILED, FINISHED, STOPPED, run_sweep
from pipeline.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = 30
# The first trial sets the bar at each rung; the tiny rate trails it there and is stopped; the last finishes.
RATES = [3e-3, 1e-6, 1e-2]


def short_trials(tmp_path: Path) -> list[str]:
    """The trials' overrides: STEPS steps on one worker, a validation every 10, a few batches of evaluation."""
    return [f"run.workdir={tmp_path / 'work'}", f"run.artifact_root={tmp_path / 'artifacts'}", f"train.steps={STEPS}",
            "train.log_every=5", "validation.every=10", "validation.batches=1", "parallel.num_workers=1",
            "eval.max_batches=2", "eval.max_new_tokens=4", "eval.context_lengths=[]", "eval.max_text_tokens=512",
            "eval.lambada_max_examples=16", "train.progress_bar=false"]


def test_a_sweep_prunes_registers_the_best_and_resumes(tmp_path, ray_cluster, capfd):
    """On the session's Ray (a sweep joins a running Ray as a pipeline does, and leaves it running)."""
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"sweep": {
        "name": "e2e_lr", "base": str(ROOT / "configs" / "smoke.yaml"),
        "overrides": [*short_trials(tmp_path), "register.model_name=conduit-sweep-e2e"],
        "space": {"optimizer.lr": {"grid": RATES}},
        "scheduler": "asha", "grace_steps": 10, "reduction_factor": 2, "max_concurrent": 1, "register": "best",
        "order": "as_written",
    }}))
    spec = load_sweep(path)
    lines: list[str] = []
    free_before = ray_cluster.available_resources().get("CPU", 0)
    result = run_sweep(spec, echo=lines.append)
    by_rate = {o.values["optimizer.lr"]: o for o in result.trials}

    # The good rates finish; the tiny ones are stopped at a rung before the last step.
    assert by_rate[3e-3].status == FINISHED and by_rate[1e-2].status == FINISHED, lines
    for rate in (1e-6,):
        o = by_rate[rate]
        assert o.status == STOPPED and o.step < STEPS and o.label == f"stopped at step {o.step}", (o, lines)
        assert o.val_loss > max(by_rate[3e-3].val_loss, by_rate[1e-2].val_loss)
    assert result.best.values["optimizer.lr"] in (3e-3, 1e-2)
    assert result.best.metric == min(by_rate[3e-3].metric, by_rate[1e-2].metric)
    # Stopped while its training went on reporting validation losses to a queue that died with the trial: no
    # training error, no traceback of its on the sweep's console (Ray forwards every task's output to it,
    # prefixed with the task's name: each trial's one worker trains in its train stage's task,
    # pipeline.training.launch). The trial's own process may print Ray's SIGTERM handler exiting it (Tune
    # stops a trial with SIGTERM): that is the stop itself.
    console = "".join(capfd.readouterr())
    training = [ln for ln in console.splitlines() if "(conduit.train" in ln]
    assert sum("training in the train stage's task (one worker)" in ln for ln in training) == len(RATES), \
        console[-5000:]
    assert sum(ln.endswith("training from step 0") for ln in training) == len(RATES), console[-5000:]
    assert not [ln for ln in training if "Traceback" in ln or "Error" in ln], training
    # The stopped trial's Train controller died with it, leaving its workers' placement group, which GCS keeps
    # while the job (this test's process) lives: the sweep removed it, and every CPU free before is free again.
    deadline = time.monotonic() + 60
    while ray_cluster.available_resources().get("CPU", 0) < free_before:
        assert time.monotonic() < deadline, (ray_cluster.available_resources(), free_before)
        time.sleep(0.5)

    # The data stages ran once, before the trials, under the sweep's run; never in a trial.
    assert [ln for ln in lines if ": running" in ln and ln.startswith("data: ")] == \
        [f"data: {n}: running ({h})" for n, h in ((p.stage, p.hash) for p in make_plan(resolve(spec.trials[0].cfg))
                                                   if p.stage in ("shard", "tokenizer", "tokenize"))]
    c = tracking.client(result.tracking_uri)
    runs = {r.info.run_id: r for r in c.search_runs([c.get_run(result.run_id).info.experiment_id], max_results=500)}
    sweep = runs[result.run_id]
    data_runs = [r for r in runs.values() if r.data.tags.get("conduit.sweep_role") == "data stages"]
    assert len(data_runs) == 1 and data_runs[0].data.tags["mlflow.parentRunId"] == result.run_id
    trial_runs = {r.data.tags["conduit.sweep_trial"]: r for r in runs.values()
                  if r.data.tags.get("mlflow.parentRunId") == result.run_id and "conduit.sweep_trial" in r.data.tags}
    assert sorted(trial_runs) == [f"trial_{i:03d}" for i in range(len(RATES))]
    stage_runs = {rid: r for rid, r in runs.items() if "conduit.stage" in r.data.tags}
    for name, run in trial_runs.items():
        stages = {r.data.tags["conduit.stage"]: r for r in stage_runs.values()
                  if r.data.tags.get("mlflow.parentRunId") == run.info.run_id}
        assert not {"shard", "tokenizer", "tokenize"} & set(stages), name  # cached: no stage run of theirs
        o = by_rate[float(run.data.params["sweep.optimizer.lr"])]
        if o.status == FINISHED:
            assert run.info.status == "FINISHED" and set(stages) == {"train", "evaluate"}
            assert run.data.tags["conduit.sweep_status"] == FINISHED
            val = [m.value for m in c.get_metric_history(stages["train"].info.run_id, "val_loss")]
            assert len(val) == STEPS // 10  # the validation curve, every 10 steps
        else:  # stopped: KILLED, saying where and why, its training unsealed
            assert run.info.status == "KILLED" and run.data.tags["conduit.sweep_status"] == STOPPED
            assert int(run.data.tags["conduit.sweep_stopped_at_step"]) == o.step
            assert stages["train"].info.status == "KILLED" and "evaluate" not in stages
            # ended by the trial's stop (its task cancelled, its process kept: EndStagesOnStop), then tagged why
            assert stages["train"].data.tags["conduit.error"] == f"the sweep's scheduler stopped at step {o.step}"
            cfg = resolve(spec.trials[o.index].cfg)
            train_hash = next(p.hash for p in make_plan(cfg) if p.stage == "train")
            assert not store_for(cfg.artifact_root()).is_complete("train", train_hash)

    # The sweep's run: the table, the picture, the best, and the best model registered with the sweep's id.
    table = json.loads(Path(c.download_artifacts(result.run_id, "trials.json", str(tmp_path))).read_text())
    status = [row[table["columns"].index("status")] for row in table["data"]]  # MLflow's table layout
    assert status.count("finished") == 2 and sum(s.startswith("stopped at step") for s in status) == 1
    assert "plots/metric_by_field.png" in [a.path for a in c.list_artifacts(result.run_id, "plots")]
    assert sweep.info.status == "FINISHED" and sweep.data.tags["conduit.sweep_best_trial"] == f"trial_{result.best.index:03d}"
    assert result.registered["model_name"] == "conduit-sweep-e2e"
    mv = c.get_model_version("conduit-sweep-e2e", str(result.registered["version"]))
    assert mv.tags["conduit.sweep_run_id"] == result.run_id

    # Run again: Tune's experiment is restored; no trial runs again (finished and stopped stay as they ended).
    again = run_sweep(load_sweep(path), echo=lines.append)
    assert [(o.status, o.step) for o in again.trials] == [(o.status, o.step) for o in result.trials]
    after = c.search_runs([sweep.info.experiment_id], filter_string="tags.`conduit.sweep_trial` != ''", max_results=500)
    assert len(after) == len(RATES)
    assert ray_cluster.is_initialized()  # the session's Ray is still up

    # As the shipped sweep runs (configs/sweeps/smoke_lr.yaml: asha, the seeded shuffled order, two trials
    # at once): the two trials train side by side, each worker on its share of the CPUs, and both finish
    # (grace_steps 21, the most ASHA takes for 20 steps: its one rung, at 21, lies past the last report;
    # the default, 1, puts rungs at 1, 2, 4, 8 and 16 and stops whichever trial reaches one behind).
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(yaml.safe_dump({"sweep": {
        "name": "e2e_defaults", "base": str(ROOT / "configs" / "smoke.yaml"),
        "overrides": [f"run.workdir={tmp_path / 'work'}", f"run.artifact_root={tmp_path / 'artifacts'}",
                      "train.steps=20", "validation.every=10", "validation.batches=1", "parallel.num_workers=1",
                      "eval.max_batches=2", "eval.max_new_tokens=4", "eval.context_lengths=[]",
                      "eval.max_text_tokens=512", "eval.lambada_max_examples=16", "train.progress_bar=false"],
        "space": {"optimizer.lr": {"grid": [3e-3, 1e-2]}}, "max_concurrent": 2, "register": "none",
        "grace_steps": 21,
    }}))
    spec = load_sweep(defaults)
    assert (spec.scheduler, spec.max_concurrent, spec.order) == ("asha", 2, "shuffled")
    both = run_sweep(spec, echo=lines.append)
    assert [o.status for o in both.trials] == [FINISHED, FINISHED], lines
    cpus = int(ray_cluster.cluster_resources()["CPU"])
    trial_runs = [c.get_run(o.run_id) for o in both.trials]
    assert {r.data.params["parallel.threads_per_worker"] for r in trial_runs} == {str(max(1, cpus // 2))}
    (first, second) = sorted(trial_runs, key=lambda r: r.info.start_time)
    assert second.info.start_time < first.info.end_time  # side by side, not one after the other

    # A sweep whose trials fail (each names a model to start from that does not exist: a real failure, at
    # its train stage; the data stages are the sweep's above, cached): each is tried max_failures + 1
    # times, then reported failed with its error, and the sweep goes on; a rerun tries neither again.
    missing = ["train:00000000deadbeef", "train:00000000feedface"]
    failing = tmp_path / "failing.yaml"
    failing.write_text(yaml.safe_dump({"sweep": {
        "name": "e2e_fail", "base": str(ROOT / "configs" / "smoke.yaml"),
        "overrides": [f"run.workdir={tmp_path / 'work'}", f"run.artifact_root={tmp_path / 'artifacts'}",
                      "checkpoint.max_failures=1", "parallel.num_workers=1"],
        "space": {"train.init_from": {"grid": missing}},
        "scheduler": "none", "max_concurrent": 1,
    }}))
    fail_lines: list[str] = []
    failed = run_sweep(load_sweep(failing), echo=fail_lines.append)
    assert [o.status for o in failed.trials] == [FAILED, FAILED] and failed.best is None, fail_lines
    assert not [ln for ln in fail_lines if ": running" in ln and ln.startswith("data: ")]  # cached
    for o, ref in zip(failed.trials, missing):
        assert ref in o.error and "no finished train artifact" in o.error, o
        assert f"trial_{o.index:03d}: failed" in "\n".join(fail_lines)
        run = c.get_run(o.run_id)
        assert run.info.status == "FAILED" and run.data.tags["conduit.sweep_status"] == FAILED
        assert run.data.tags["conduit.sweep_attempts"] == "2"  # the first try and one retry (max_failures=1)
        assert ref in run.data.tags["conduit.error"]
    assert c.get_run(failed.run_id).data.tags["conduit.sweep_failed"] == "2"
    again = run_sweep(load_sweep(failing), echo=fail_lines.append)
    assert [o.status for o in again.trials] == [FAILED, FAILED]
    assert [c.get_run(o.run_id).data.tags["conduit.sweep_attempts"] for o in failed.trials] == ["2", "2"]


def test_synchronous_halving_ranks_each_rung_and_resumes_the_best_from_it(tmp_path, ray_cluster):
    """``scheduler: sha`` on the session's Ray, two trials at a time: four rates, 30 steps, rungs at 10 and
    20 (grace 10, reduction factor 2). Every trial trains to step 10 and pauses there; the best two resume
    from their step-10 checkpoints to 20, the best of those to the end. Each trial stopped at a rung trails
    every trial that went on from it; the winner trained from 0, 10 and 20, its last train run holds its
    whole validation curve, each step once; a pause is not an attempt, and a rerun runs nothing again."""
    from pipeline.store.contracts import read_train_starts

    rates = [1e-6, 3e-3, 1e-2, 3e-4]
    path = tmp_path / "sha.yaml"
    path.write_text(yaml.safe_dump({"sweep": {
        "name": "e2e_sha", "base": str(ROOT / "configs" / "smoke.yaml"),
        "overrides": short_trials(tmp_path),
        "space": {"optimizer.lr": {"grid": rates}},
        "scheduler": "sha", "grace_steps": 10, "reduction_factor": 2, "max_concurrent": 2, "register": "none",
    }}))
    spec = load_sweep(path)
    assert spec.rungs == [10, 20]
    lines: list[str] = []
    result = run_sweep(spec, echo=lines.append)
    assert sorted((o.status, o.step) for o in result.trials) == \
        sorted([(FINISHED, STEPS), (STOPPED, 20), (STOPPED, 10), (STOPPED, 10)]), lines
    assert sum("paused at step 10 " in ln for ln in lines) == 4 and sum("paused at step 20 " in ln for ln in lines) == 2

    c = tracking.client(result.tracking_uri)
    exp = c.get_run(result.run_id).info.experiment_id
    curves, train_runs = {}, {}
    for o in result.trials:
        run = c.get_run(o.run_id)
        assert run.data.tags["conduit.sweep_attempts"] == "1", o  # a pause and its resume are one attempt
        trains = c.search_runs([exp], f"tags.`mlflow.parentRunId` = '{o.run_id}' and tags.`conduit.stage` = 'train'")
        train_runs[o.index] = sorted(trains, key=lambda r: r.info.start_time)
        # the last rung's train run holds the whole curve (a resumed run logs the steps before its checkpoint)
        curves[o.index] = sorted((m.step, m.value) for m in c.get_metric_history(train_runs[o.index][-1].info.run_id,
                                                                                  "val_loss"))
        assert [s for s, _ in curves[o.index]] == list(range(10, o.step + 1, 10)), (o, curves[o.index])
        if o.status == STOPPED:
            assert run.info.status == "KILLED" and run.data.tags["conduit.sweep_status"] == STOPPED
            assert int(run.data.tags["conduit.sweep_stopped_at_step"]) == o.step
    at = {i: dict(curve) for i, curve in curves.items()}  # each trial's validation loss by step
    best = result.best.index
    for rung in (10, 20):  # each trial stopped at a rung trails every trial that went on from it
        went_on = [o.index for o in result.trials if o.step > rung]
        for o in result.trials:
            if o.status == STOPPED and o.step == rung:
                assert all(at[o.index][rung] > at[i][rung] for i in went_on), (o, at)
    # The winner: paused at 10 and 20 (its train runs KILLED, saying so), resumed from those very steps.
    assert [r.info.status for r in train_runs[best]] == ["KILLED", "KILLED", "FINISHED"]
    assert [r.data.tags["conduit.error"] for r in train_runs[best][:2]] == [
        f"the sweep's scheduler paused at step {s} (a rung); a later rung resumes from that step" for s in (10, 20)]
    cfg = resolve(spec.trials[best].cfg)
    train_hash = next(p.hash for p in make_plan(cfg) if p.stage == "train")
    assert read_train_starts(Path(cfg.artifact_root()) / "train" / train_hash) == [0, 10, 20]
    assert c.get_run(result.run_id).data.tags["conduit.sweep_best_trial"] == f"trial_{best:03d}"

    # Run again: every rung restored, nothing trains again.
    before = len(c.search_runs([exp], "tags.`conduit.stage` = 'train'", max_results=500))
    again = run_sweep(load_sweep(path), echo=lines.append)
    assert [(o.status, o.step) for o in again.trials] == [(o.status, o.step) for o in result.trials]
    assert len(c.search_runs([exp], "tags.`conduit.stage` = 'train'", max_results=500)) == before


def test_a_killed_sweep_driver_resumes_without_redoing_or_adding_trials(tmp_path):
    """``jobs.sweep`` as a user runs it (its own embedded Ray), SIGKILLed once the second trial has two
    checkpoints; the same command again finishes the sweep: the first trial is not trained again, the
    second resumes from its checkpoints, no trial is added, and each trial has one MLflow run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from pipeline.stages.train import checkpoint_place
    from pipeline.store.contracts import read_train_starts
    from tests.pipeline.training.test_fault_tolerance import registered_checkpoints

    work = tmp_path / "work"
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"sweep": {
        "name": "killed", "base": str(ROOT / "configs" / "smoke.yaml"),
        "overrides": [f"run.workdir={work}", f"run.artifact_root={tmp_path / 'artifacts'}", "train.steps=160",
                      "train.log_every=5", "validation.every=20", "validation.batches=1", "checkpoint.every=10",
                      "parallel.num_workers=1", "eval.max_batches=2", "eval.max_new_tokens=4",
                      "eval.context_lengths=[]", "eval.max_text_tokens=512", "eval.lambada_max_examples=16"],
        "space": {"optimizer.lr": {"grid": [3e-3, 1e-2]}},
        "scheduler": "none", "max_concurrent": 1, "order": "as_written",
    }}))
    spec = load_sweep(path)
    cfgs = [resolve(t.cfg) for t in spec.trials]
    hashes = [next(p.hash for p in make_plan(c) if p.stage == "train") for c in cfgs]
    place = checkpoint_place(cfgs[1], hashes[1])
    second = Path(place.storage) / place.name

    def start() -> subprocess.Popen:
        log = open(tmp_path / f"driver-{time.monotonic_ns()}.log", "w")
        return subprocess.Popen([sys.executable, "-m", "jobs.sweep", str(path)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    driver = start()
    deadline = time.monotonic() + 900
    while registered_checkpoints(second) < 2:
        assert driver.poll() is None, "the sweep ended before the second trial had two checkpoints"
        assert time.monotonic() < deadline, "no two checkpoints of the second trial within 15 minutes"
        time.sleep(0.1)
    ray_procs = psutil.Process(driver.pid).children(recursive=True)
    # The driver and its embedded Ray killed together (its session's process group), as a closed terminal
    # or a lost machine ends them: what is tested is the resume. That a killed driver's Ray also ends on its
    # own (which takes a minute): tests/pipeline/training/test_fault_tolerance.py.
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    psutil.wait_procs(ray_procs, timeout=60)
    assert start().wait(timeout=900) == 0, "the rerun failed: see its log in tmp_path"

    store = store_for(cfgs[0].artifact_root())
    for h in hashes:
        assert store.is_complete("train", h)
    starts = [read_train_starts(Path(cfgs[0].artifact_root()) / "train" / h) for h in hashes]
    assert starts[0] == [0], starts  # the first not trained again
    assert len(starts[1]) == 2 and starts[1][0] == 0 and starts[1][1] >= 20, starts  # resumed, not restarted
    uri = cfgs[0].tracking_uri()
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(cfgs[0].tracking.experiment).experiment_id
    sweeps = c.search_runs([exp], "tags.`conduit.sweep` = 'killed'")
    assert len(sweeps) == 1 and sweeps[0].info.status == "FINISHED"  # the rerun continued the same sweep run
    trials = c.search_runs([exp], "tags.`conduit.sweep_trial` != ''")
    assert sorted(r.data.tags["conduit.sweep_trial"] for r in trials) == ["trial_000", "trial_001"]
    assert {r.info.status for r in trials} == {"FINISHED"}
    assert not c.search_runs([exp], "attributes.status = 'RUNNING'")


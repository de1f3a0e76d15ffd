"""Run a sweep (``pipeline.sweep.spec``) with Ray Tune: the trials are pipelines that share every cached stage.

Order of work:

1. The data stages (shard, tokenizer, tokenize) of each distinct data config among the trials run once,
   here, before any trial: the trials find them cached.
2. Ray Tune runs the trials, ``max_concurrent`` at a time (and as many as the cluster's CPUs allow:
   a trial holds none itself, its train stage's Ray Train workers hold theirs). Each trial is the
   pipeline up to evaluate for its config, in an MLflow run nested under the sweep's (its stage runs
   under it). Inside, the training runs as in any pipeline (one worker in its train stage's task, more on
   Ray Train); with ``val_loss`` as the metric, each validation loss goes from the training to Tune
   (``ValidationToTune``, Ray's documented route for Train inside Tune), where ASHA may stop the trial.
   With ``sha`` (synchronous successive halving) each rung is a Tune run of its own (``_fit_rungs``):
   every trial pauses at the rung's step, and the best resume from it in the next rung.
   Tune runs the next trial in the process a trial leaves (``reuse_actors``); a stopped trial's running
   stage task is cancelled first (``EndStagesOnStop``), so the processes its stages ran in stay warm.
3. A stopped trial ends as "stopped at step N" with its last validation loss, on its MLflow run (KILLED)
   and in the summary; its train artifact is never sealed (training did not finish), and a rerun
   of the sweep does not run it again. A failed trial is retried ``checkpoint.max_failures`` times
   (resuming from its checkpoints), then reported as failed; the others go on.
4. The summary: a table of the trials, a picture of the metric against each swept field, and with
   ``register: best`` the best finished trial's model registered (its register stage, tagged with
   the sweep's run id).

A killed sweep driver, run again with the same command, restores Tune's experiment
(``<workdir>/sweeps/<name>``): finished and stopped trials stay as they ended, unfinished ones run again and
resume from their checkpoints (their finished stages are cached), and no trial is added.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Callable

from pipeline import tracking
from pipeline.stage_tracker import StageTracker
from pipeline.config import RunConfig, config_from_dict
from pipeline.runner import ORDER, Nesting, connect_ray, make_plan, resolve, run_pipeline
from pipeline.sweep import ranking
from pipeline.sweep.spec import SweepSpec
from pipeline.training.device import worker_cpus
from pipeline import compat
from pipeline.training.ray_train import reap_orphaned_placement_groups

FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"
PAUSED = "paused"  # sha: ended at a rung, to be resumed in the next one or stopped there (a run's sweep_status)
INCOMPLETE = "incomplete"  # ended without finishing, not stopped by the scheduler and without an error (interrupted)


@dataclass
class TrialOutcome:
    """How one trial ended: ``status`` (finished, stopped by the sweep's scheduler (ASHA, or a rung of
    synchronous halving), failed, or incomplete: anything else,
    with Tune's state of the trial in ``tune_status``), the last step and validation loss it reported,
    the sweep's metric, its MLflow run and, for a failure, the error."""

    index: int
    values: dict
    status: str = FAILED
    step: int | None = None
    val_loss: float | None = None
    metric: float | None = None
    run_id: str | None = None
    error: str | None = None
    tune_status: str | None = None

    @property
    def label(self) -> str:
        if self.status == STOPPED:
            return f"stopped at step {self.step}"
        if self.status == INCOMPLETE:
            at = "before its first step" if self.step is None else f"at step {self.step}"
            return f"incomplete {at} (Tune: {self.tune_status})"
        return self.status


@dataclass
class SweepResult:
    """The sweep's MLflow run, each trial's outcome (in trial order) and the best finished trial."""

    run_id: str
    tracking_uri: str
    trials: list[TrialOutcome] = field(default_factory=list)
    best: TrialOutcome | None = None
    registered: dict | None = None


def validation_to_tune_class() -> type:
    """The Ray Train callback (made inside a Tune trial) that hands Tune the reports that carry a
    validation loss, and no other (checkpoint reports carry only a step). Its ``checkpoint_steps`` (a
    synchronous sweep's rungs) are steps the training always checkpoints at, before it reports.

    When Tune stops the trial and ends its process, the queue the reports travel on goes with it; a
    report in flight then finds the queue gone. That is the trial ending, not the training failing: the
    report is dropped (the training is being cancelled: ``EndStagesOnStop``), rather than raised as a
    controller error with a traceback on the sweep's console for every stopped trial.
    """
    from ray.exceptions import RayActorError
    from ray.tune.integration.ray_train import TuneReportCallback

    class ValidationToTune(TuneReportCallback):
        checkpoint_steps: tuple = ()

        def after_report(self, run_context, metrics, checkpoint):
            if metrics and "val_loss" in metrics[0]:
                try:
                    self._training_actor_item_queue.put({"step": metrics[0]["step"],
                                                         "val_loss": metrics[0]["val_loss"]})
                except RayActorError:
                    pass  # the trial was stopped (its process and its queue are gone)

    return ValidationToTune


STOP_WAIT_S = 60.0  # a stopped trial's wait for its stage task to end (its metrics flushed, 30 s at most)


class EndStagesOnStop:
    """Mixed into each trial's Tune trainable: when Tune stops the trial (ASHA, the end of a rung of
    synchronous halving, or the sweep interrupted),
    its running stage task is cancelled as Ctrl-C would end it, and waited for, before the trial's
    process goes or takes the next trial (Tune reuses it: ``reuse_actors``). Else Ray would end the task
    with that process, and with the task its worker process, whose imports (torch, DeepSpeed, the stages)
    the next trial's stage would find warm there (``pipeline.training.launch``, in the task): a cold start for each
    stopped trial, which the full grid never pays. The stage's MLflow run ends KILLED (``_mark_stopped``
    then says why)."""

    def cleanup(self):
        from pipeline.runner import cancel_stage_tasks

        cancel_stage_tasks(STOP_WAIT_S)
        super().cleanup()

    def reset_config(self, new_config):
        from pipeline.runner import allow_stage_tasks, cancel_stage_tasks

        cancel_stage_tasks(STOP_WAIT_S)  # a stopped trial's thread ends with its stage; a finished one's has
        reset = super().reset_config(new_config)
        allow_stage_tasks()
        return reset


def _validation_to_tune(checkpoint_steps: tuple = ()):
    callback = validation_to_tune_class()()
    callback.checkpoint_steps = tuple(checkpoint_steps)
    return callback


def _trial(config: dict, *, trials: list[dict], sweep_run_id: str, uri: str, experiment_id: str, metric: str,
           sweep_name: str, checkpoint_steps: tuple = ()) -> None:
    """One trial, in a Tune trial's process: its pipeline up to evaluate, in its own MLflow run (or, in
    a later rung of ``sha``, the rest of it: the train stage resumes from the rung's checkpoint)."""
    from ray import tune

    t = trials[config["trial"]]
    cfg = config_from_dict(t["cfg"], source=f"<sweep {sweep_name} {t['name']}>")
    run_id = _trial_run(uri, experiment_id, sweep_run_id, t["name"])
    callbacks = (_validation_to_tune(checkpoint_steps),) if metric == "val_loss" else ()
    nest = Nesting(run_id=run_id, params={f"sweep.{k}": v for k, v in t["values"].items()}, train_callbacks=callbacks)
    result = run_pipeline(cfg, until="evaluate", echo=lambda line: print(f"{t['name']}: {line}", flush=True),
                          nest=nest)
    counts = result.artifacts["train"].manifest["counts"]
    metrics = json.loads((result.artifacts["evaluate"].path / "metrics.json").read_text())["metrics"]
    val_losses = {int(k): v for k, v in counts.get("val_losses", {}).items()}
    last_val = val_losses[max(val_losses)] if val_losses else None
    value = last_val if metric == "val_loss" else metrics.get(metric)
    if value is None:
        raise ValueError(f"sweep metric {metric!r} is not among the evaluate stage's metrics ({sorted(metrics)[:8]}...)")
    StageTracker(uri, run_id).set_tags({"conduit.sweep_status": FINISHED, "conduit.sweep_metric": value})
    tune.report({"step": counts["steps_trained"], "val_loss": last_val if last_val is not None else value,
                 metric: value, "finished": True, "run_id": run_id})


def trial_threads(cfg: RunConfig, max_concurrent: int, node_cpus: list[float]) -> RunConfig:
    """The trial's config with ``parallel.threads_per_worker`` set, when the sweep leaves it unset, to the
    most CPUs per worker that the cluster's nodes (``node_cpus``, each node's CPUs) place for the training
    workers of ``max_concurrent`` trials (``device.worker_cpus``; a worker reserves as many CPUs as it runs
    threads, so never more than one node has).

    A lone pipeline's workers split their node's cores among themselves; a sweep's trials train side by
    side, so that split would give each worker every core and the trials would fight for them (two
    1-worker trials on 2 cores ran 150 steps in 44 s that way, in 10 s with a thread each).
    """
    if cfg.parallel.threads_per_worker is not None or cfg.parallel.device == "cuda" or sum(node_cpus) < 1:
        return cfg
    workers = max(1, max_concurrent) * cfg.parallel.num_workers
    threads = worker_cpus(None, workers, node_cpus, cfg.parallel.placement_strategy)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, threads_per_worker=threads))


def _trial_run(uri: str, experiment_id: str, sweep_run_id: str, name: str) -> str:
    """The trial's MLflow run: the one an earlier attempt left (a killed sweep driver took the trial's
    process along, or Tune restarts the trial after a failure, or Tune's saved state predates the
    trial's end, or ``sha`` resumes a trial it paused at a rung), RUNNING again under this process with the
    stage runs it left RUNNING marked FAILED; else a new one. So a trial has one run, however often it starts.
    A resumed pause is not counted as an attempt (``conduit.sweep_attempts``)."""
    from pipeline.runner import DRIVER_TAG, driver_identity

    for run_id, tags in _trial_runs(uri, experiment_id, sweep_run_id, name, running=False):
        tracker = StageTracker(uri, run_id)
        paused = tags.get("conduit.sweep_status") == PAUSED
        attempts = int(tags.get("conduit.sweep_attempts", "1")) + (0 if paused else 1)
        tracker.set_tags({DRIVER_TAG: json.dumps(driver_identity()), "conduit.sweep_status": "running",
                          "conduit.sweep_attempts": attempts})
        why = ("the trial was paused at a rung of the sweep and this stage's task had not ended when it resumed"
               if paused else "the trial's process died during this stage")
        for child, _ in tracking.search_runs(uri, experiment_id, f"attributes.status = 'RUNNING' and "
                                                                 f"tags.`mlflow.parentRunId` = '{run_id}'"):
            StageTracker(uri, child).set_tags({"conduit.error": why})
            tracking.end_run(uri, child, "FAILED")
        tracking.client(uri).update_run(run_id, status="RUNNING")
        return run_id
    return tracking.start_run(uri, experiment_id, name, parent_id=sweep_run_id, tags={
        "conduit.sweep_run_id": sweep_run_id, "conduit.sweep_trial": name, "conduit.sweep_status": "running",
        "conduit.sweep_attempts": 1})


def _data_stages_once(spec: SweepSpec, echo: Callable[[str], None], sweep_run_id: str) -> None:
    """The data stages of each distinct data config among the trials, once, before the trials."""
    seen = set()
    for trial in spec.trials:
        cfg = resolve(trial.cfg)
        data = ORDER[:ORDER.index("tokenize") + 1]
        key = tuple((p.stage, p.hash) for p in make_plan(cfg, until="tokenize") if p.stage in data)
        if key in seen:
            continue
        seen.add(key)
        run_pipeline(cfg, until="tokenize", echo=lambda line: echo(f"data: {line}"),
                     nest=Nesting(parent_run_id=sweep_run_id, tags={"conduit.sweep_run_id": sweep_run_id,
                                                                   "conduit.sweep_role": "data stages"}))


def _sweep_run(spec: SweepSpec, uri: str, experiment_id: str) -> str:
    """The sweep's MLflow run: the one of an earlier attempt of this sweep (same name and trials), which
    a rerun continues, or a new one."""
    key = spec.fingerprint
    found = tracking.search_runs(uri, experiment_id, f"tags.`conduit.sweep_key` = '{key}'")
    if found:
        return found[0][0]
    run_id = tracking.start_run(uri, experiment_id, spec.name, tags={
        "conduit.sweep": spec.name, "conduit.sweep_key": key, "conduit.sweep_file": str(spec.path),
        "conduit.sweep_trials": len(spec.trials)})
    tracker = StageTracker(uri, run_id)
    tracker.log_params({"sweep.metric": spec.metric, "sweep.mode": spec.mode, "sweep.scheduler": spec.scheduler,
                        "sweep.trials": len(spec.trials), "sweep.max_concurrent": spec.max_concurrent,
                        **{f"space.{d.path}": f"{d.kind} {list(d.values)}" for d in spec.dimensions}})
    return run_id


def run_sweep(spec: SweepSpec, echo: Callable[[str], None] = print) -> SweepResult:
    """Run the sweep (module docstring) and return each trial's outcome and the best.

    Raises:
        ConfigError, TrackingUnavailable, ClusterError: as ``run_pipeline`` does, before any trial.
    """
    import ray
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from pipeline.sweep.scheduler import RecordingASHA

    base = resolve(spec.trials[0].cfg)
    uri = base.tracking_uri()
    tracking.check_reachable(uri)
    started_ray = connect_ray(base)
    try:
        base.workdir().mkdir(parents=True, exist_ok=True)
        local_store = uri.startswith("sqlite:")
        exp_id = tracking.ensure_experiment(uri, base.tracking.experiment, artifact_location=str(
            base.workdir() / "mlartifacts") if local_store else None)
        sweep_run = _sweep_run(spec, uri, exp_id)
        echo(f"sweep {spec.name}: {len(spec.trials)} trials, MLflow run {sweep_run}"
             + (f"; {len(spec.dropped)} invalid samples dropped" if spec.dropped else ""))
        _data_stages_once(spec, echo, sweep_run)
        cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        trials = [{"name": t.name, "values": t.values, "cfg": trial_threads(resolve(t.cfg), spec.max_concurrent,
                                                                             cpus).to_dict()} for t in spec.trials]
        trial_fn = tune.with_parameters(_trial, trials=trials, sweep_run_id=sweep_run, uri=uri, experiment_id=exp_id,
                                        metric=spec.metric, sweep_name=spec.name,
                                        checkpoint_steps=tuple(spec.rungs) if spec.scheduler == "sha" else ())
        compat.mix_into_function_trainable(trial_fn, EndStagesOnStop)
        trainable = tune.with_resources(trial_fn, {"cpu": 0, "memory": 2**20})
        # (no CPU: its train stage's workers hold those; Tune needs a non-empty bundle)
        storage = str(base.workdir() / "sweeps")
        outcomes = _outcomes_class()(uri, exp_id, sweep_run, echo)
        if spec.scheduler == "sha":
            ended = _fit_rungs(spec, base, trainable, storage, outcomes, uri, exp_id, sweep_run, echo)
        else:
            # max_t one past the last step: ASHA stops a trial that reaches max_t, and a trial that trains to
            # the end must go on to evaluate and report that it finished.
            scheduler = (RecordingASHA(time_attr="step", max_t=base.train.steps + 1, grace_period=spec.grace_steps,
                                       reduction_factor=spec.reduction_factor)
                         if spec.scheduler == "asha" else FIFOScheduler())
            grid = _tuner(spec, base, trainable, storage, spec.name, spec.start_order, scheduler, outcomes,
                          echo).fit()
            ended = list(zip(grid, grid._experiment_analysis.trials))
        reap_orphaned_placement_groups()  # the last stopped trials' (the reaper runs between Tune's steps)
        result = _summarise(spec, ended, uri, exp_id, sweep_run, echo)
        if spec.register == "best" and result.best is not None:
            result.registered = _register_best(spec, result, uri, sweep_run, echo)
        tracking.end_run(uri, sweep_run)
        return result
    finally:
        if started_ray:
            ray.shutdown()


def _tuner(spec: SweepSpec, base: RunConfig, trainable, storage: str, name: str, order: list[int], scheduler,
           outcomes, echo: Callable[[str], None]):
    """Tune's run ``<storage>/<name>`` of the trials ``order`` (their indices, in the order they start):
    restored where an earlier attempt of the sweep left it (finished and stopped trials stay as they
    ended, unfinished ones run again), else new."""
    from ray import tune

    path = f"{storage}/{name}"
    if tune.Tuner.can_restore(path):
        echo(f"sweep {spec.name}: resuming the trials of {path}")
        return tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=False,
                                  restart_errored=False)
    return tune.Tuner(
        trainable,
        param_space={"trial": tune.grid_search(order)},
        tune_config=tune.TuneConfig(metric="val_loss" if spec.metric == "val_loss" else spec.metric,
                                    mode=spec.mode, scheduler=scheduler,
                                    max_concurrent_trials=spec.max_concurrent, reuse_actors=True),
        run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=base.checkpoint.max_failures),
                                  callbacks=[outcomes]),
    )


def _fit_rungs(spec: SweepSpec, base: RunConfig, trainable, storage: str, outcomes, uri: str, experiment_id: str,
               sweep_run: str, echo: Callable[[str], None]) -> list:
    """``sha``, synchronous successive halving: one Tune run per rung (``spec.rungs``, then the end). Every
    trial of a rung trains to the rung's step, where ``RungEnd`` pauses it (the training checkpoints at
    that step before it reports the validation loss the trial is ranked on). When all have, the best
    ``1/reduction_factor`` of them (at least one; never one whose validation loss is not finite:
    ``pipeline.sweep.ranking``) go on to the next rung, resuming from that checkpoint, and the rest are
    stopped there. The last rung's trials train to the end and evaluate. A rung that
    does not end (a trial of it neither paused, finished nor failed: the sweep interrupted) ends the
    halving there. Each rung's Tune run is ``<storage>/<name>.sha/rung_<k>``: a rerun restores them in
    turn, and the same ranking picks the same trials again.

    Returns:
        ``(Tune's Result, Tune's Trial)`` of each trial, from the last rung it ran in.
    """
    from pipeline.sweep.scheduler import RungEnd

    alive, ended = list(spec.start_order), {}
    rungs = [*spec.rungs, None]
    for k, step in enumerate(rungs):
        goal = f"to step {step}" if step is not None else "to the end"
        echo(f"sweep {spec.name}: rung {k + 1} of {len(rungs)}: {len(alive)} trial(s) {goal}")
        grid = _tuner(spec, base, trainable, f"{storage}/{spec.name}.sha", f"rung_{k}", alive, RungEnd(step),
                      outcomes, echo).fit()
        compared, open_ = [], []
        for res, trial in zip(grid, grid._experiment_analysis.trials):
            index, last = (res.config or trial.config)["trial"], res.metrics or {}
            ended[index] = (res, trial)
            if res.error is not None or last.get("finished"):
                continue
            if step is not None and (last.get("step") or 0) >= step and last.get("val_loss") is not None:
                compared.append((index, last))
            else:
                open_.append(index)
        if step is None or not compared:
            break
        if open_:
            echo(f"sweep {spec.name}: rung {k + 1} did not end (trials {open_} neither reached step {step}, "
                 f"finished nor failed): no later rung runs")
            break
        ranked = ranking.ranked(compared, spec.mode, value=lambda r: r[1]["val_loss"], index=lambda r: r[0])
        keep = max(1, len(ranked) // spec.reduction_factor)
        promoted = [index for index, last in ranked[:keep] if ranking.finite(last["val_loss"])]
        for index, last in ranked:
            if index in promoted:
                continue
            why = (f"not among the best {keep} of the {len(ranked)}" if ranking.finite(last["val_loss"]) else
                   "not finite: never among the best")
            echo(f"trial_{index:03d}: stopped at step {last.get('step')} (val_loss {last.get('val_loss')}): {why} "
                 f"at rung {k + 1}")
            _mark_stopped(uri, experiment_id, sweep_run, f"trial_{index:03d}", last,
                          by=f"synchronous successive halving (rung {k + 1})")
        if not promoted:
            echo(f"sweep {spec.name}: rung {k + 1}: no trial has a finite val_loss ("
                 + ", ".join(f"trial_{index:03d} {last['val_loss']}" for index, last in ranked) + "): none goes on")
            break
        alive = [i for i in alive if i in promoted]
    return [ended[i] for i in sorted(ended)]


REAP_EVERY_S = 5.0


def _outcomes_class():
    import time

    from ray.tune import Callback

    class Outcomes(Callback):
        """On the driver: each validation loss on the trial's MLflow run as the curve, a trial that ASHA
        stopped marked so (its runs KILLED), one that a rung of synchronous halving paused marked paused, and
        one that ended unfinished for another reason said so."""

        def __init__(self, uri: str, experiment_id: str, sweep_run: str, echo: Callable[[str], None]) -> None:
            self.uri, self.experiment_id, self.sweep_run, self.echo = uri, experiment_id, sweep_run, echo
            self.reaped_at = 0.0

        def on_step_begin(self, iteration, trials, **info):
            if time.monotonic() - self.reaped_at >= REAP_EVERY_S:  # Tune's loop turns many times a second
                self.reaped_at = time.monotonic()
                for pg in reap_orphaned_placement_groups():
                    print(f"sweep: removed placement group {pg} of a stopped trial's training", flush=True)

        def __getstate__(self) -> dict:  # Tune saves its run config; the console (an open file) stays here
            return {**self.__dict__, "echo": print}

        def on_trial_complete(self, iteration, trials, trial, **info):
            last = trial.last_result or {}
            if last.get("finished"):
                self.echo(f"{_name(trial)}: finished at step {last.get('step')}, val_loss {last.get('val_loss')}")
                return
            from pipeline.sweep.scheduler import paused_at, stopped_at

            if paused_at(trial) is not None:
                self.echo(f"{_name(trial)}: paused at step {last.get('step')} (val_loss {last.get('val_loss')}) "
                          f"until the rung's other trials reach it")
                _mark_paused(self.uri, self.experiment_id, self.sweep_run, _name(trial), last)
                return
            if stopped_at(trial) is None:
                self.echo(f"{_name(trial)}: ended at step {last.get('step')} without finishing, not stopped by "
                          f"the scheduler (Tune: {trial.status})")
                return
            self.echo(f"{_name(trial)}: stopped at step {last.get('step')} (val_loss {last.get('val_loss')}) by ASHA")
            _mark_stopped(self.uri, self.experiment_id, self.sweep_run, _name(trial), last, by="ASHA")

        def on_trial_error(self, iteration, trials, trial, **info):
            self.echo(f"{_name(trial)}: failed ({trial.error_file or 'see the log'})")
            for run_id, _ in _trial_runs(self.uri, self.experiment_id, self.sweep_run, _name(trial), running=True):
                StageTracker(self.uri, run_id).set_tags({"conduit.sweep_status": FAILED})
                tracking.end_run(self.uri, run_id, "FAILED")

    return Outcomes


def _name(trial) -> str:
    return f"trial_{trial.config['trial']:03d}"


def _trial_runs(uri: str, experiment_id: str, sweep_run: str, name: str, running: bool) -> list:
    query = f"tags.`conduit.sweep_run_id` = '{sweep_run}' and tags.`conduit.sweep_trial` = '{name}'"
    if running:
        query += " and attributes.status = 'RUNNING'"
    return tracking.search_runs(uri, experiment_id, query)


def _mark_stopped(uri: str, experiment_id: str, sweep_run: str, name: str, last: dict, by: str) -> None:
    """A trial the scheduler stopped: its run and its running stage runs KILLED, tagged with the step and
    the last validation loss, and said stopped ``by`` the scheduler that stopped it (ASHA, or a rung of
    synchronous halving)."""
    status = f"stopped at step {last.get('step')}"
    for run_id, _ in _trial_runs(uri, experiment_id, sweep_run, name, running=False):
        StageTracker(uri, run_id).set_tags({
            "conduit.sweep_status": STOPPED, "conduit.sweep_stopped_at_step": last.get("step"),
            "conduit.sweep_last_val_loss": last.get("val_loss"), "mlflow.note.content": f"{name}: {status} by {by}"})
        # RUNNING, or KILLED by the trial's own stop (EndStagesOnStop), which may come first
        for child, tags in tracking.search_runs(uri, experiment_id, f"attributes.status != 'FINISHED' and "
                                                                    f"tags.`mlflow.parentRunId` = '{run_id}'"):
            if "conduit.error" in tags:
                continue  # failed earlier, for its own reason
            StageTracker(uri, child).set_tags({"conduit.error": f"the sweep's scheduler {status}"})
            tracking.end_run(uri, child, "KILLED")
        tracking.end_run(uri, run_id, "KILLED")


def _mark_paused(uri: str, experiment_id: str, sweep_run: str, name: str, last: dict) -> None:
    """A trial ``sha`` paused at a rung: its run tagged with the step and the validation loss, its stage
    runs not yet finished with why (its train stage's run ends KILLED as its task is cancelled). The next
    rung resumes it (``_trial_run``), or the sweep stops it (``_mark_stopped``)."""
    status = f"paused at step {last.get('step')}"
    for run_id, _ in _trial_runs(uri, experiment_id, sweep_run, name, running=False):
        StageTracker(uri, run_id).set_tags({
            "conduit.sweep_status": PAUSED, "conduit.sweep_paused_at_step": last.get("step"),
            "conduit.sweep_last_val_loss": last.get("val_loss"),
            "mlflow.note.content": f"{name}: {status} at a rung of the sweep's successive halving"})
        for child, tags in tracking.search_runs(uri, experiment_id, f"attributes.status != 'FINISHED' and "
                                                                    f"tags.`mlflow.parentRunId` = '{run_id}'"):
            if "conduit.error" not in tags:
                StageTracker(uri, child).set_tags({"conduit.error": f"the sweep's scheduler {status} (a rung); "
                                                                    f"a later rung resumes from that step"})


def trial_status(error: BaseException | None, last: dict, run_tags: dict) -> str:
    """How a trial ended, from Tune's result (its error and last reported metrics) and its MLflow run's
    tags: failed, finished, stopped (only where the sweep tagged the run as stopped by its scheduler:
    ``RecordingASHA``'s stop, or a rung of synchronous halving), else incomplete (the sweep was interrupted
    before or while the trial ran)."""
    if error is not None:
        return FAILED
    if last.get("finished"):
        return FINISHED
    if run_tags.get("conduit.sweep_status") == STOPPED:
        return STOPPED
    return INCOMPLETE


def _summarise(spec: SweepSpec, ended: list, uri: str, experiment_id: str, sweep_run: str,
               echo: Callable[[str], None]) -> SweepResult:
    """Each trial's outcome (``ended``: Tune's Result and Trial of each), the best finished one (none when no
    finished trial's metric is finite: ``pipeline.sweep.ranking``; the sweep then says which trials ended
    how), the table and the pictures on the sweep's run."""
    outcomes = {t.index: TrialOutcome(t.index, t.values) for t in spec.trials}
    # A trial that failed before it reported has no config in its result; Tune's own trial has it.
    for r, tune_trial in ended:
        o = outcomes[(r.config or tune_trial.config)["trial"]]
        last = r.metrics or {}
        o.step, o.val_loss, o.tune_status = last.get("step"), last.get("val_loss"), tune_trial.status
        runs = ([] if last.get("finished") else
                _trial_runs(uri, experiment_id, sweep_run, f"trial_{o.index:03d}", running=False))
        tags = runs[0][1] if runs else {}
        o.run_id = last.get("run_id") or (runs[0][0] if runs else None)
        o.status = trial_status(r.error, last, tags)
        if o.status == FAILED:
            o.error = f"{type(r.error).__name__}: {r.error}"[:500]
        elif o.status == FINISHED:
            o.metric = last.get(spec.metric)
    trials = [outcomes[i] for i in sorted(outcomes)]
    for o in trials:
        if o.status == FAILED and o.run_id is not None:
            StageTracker(uri, o.run_id).set_tags({"conduit.error": o.error or "",
                                                           "conduit.sweep_status": FAILED})
    finished = [o for o in trials if o.status == FINISHED and o.metric is not None]
    best = ranking.best(finished, spec.mode, value=lambda o: o.metric, index=lambda o: o.index)
    result = SweepResult(sweep_run, uri, trials, best)
    tracker = StageTracker(uri, sweep_run)
    table = {"trial": [f"trial_{o.index:03d}" for o in trials], "status": [o.label for o in trials],
             "step": [o.step for o in trials], "val_loss": [o.val_loss for o in trials],
             spec.metric: [o.metric for o in trials], "run_id": [o.run_id for o in trials],
             **{d.path: [o.values.get(d.path) for o in trials] for d in spec.dimensions}}
    tracker.log_table(table, "trials.json")
    tracker.log_figure(metric_figure(spec, trials), "plots/metric_by_field.png")
    tags = {"conduit.sweep_finished": len(finished),
            "conduit.sweep_stopped": sum(o.status == STOPPED for o in trials),
            "conduit.sweep_failed": sum(o.status == FAILED for o in trials),
            "conduit.sweep_incomplete": sum(o.status == INCOMPLETE for o in trials)}
    if best is not None:
        tags.update({"conduit.sweep_best_trial": f"trial_{best.index:03d}", "conduit.sweep_best_metric": best.metric,
                     "conduit.sweep_best_run": best.run_id or ""})
        tracker.log_metrics({f"best_{spec.metric}": best.metric})
    else:
        tags["conduit.sweep_no_best"] = _no_best(spec, trials)
    tracker.set_tags(tags)
    for o in trials:
        shown = (f"{spec.metric} {o.metric:.4f}" if o.metric is not None else
                 f"last val_loss {o.val_loss:.4f}" if o.val_loss is not None else f"{spec.metric} -")
        echo(f"trial_{o.index:03d} {o.label}: {shown} "
             + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in o.values.items()))
    echo(f"best: trial_{best.index:03d} ({spec.metric} {best.metric:.4f})" if best is not None
         else tags["conduit.sweep_no_best"])
    return result


def _no_best(spec: SweepSpec, trials: list[TrialOutcome]) -> str:
    """Why the sweep has no best trial: how each trial ended and with what value (a diverged one's is not
    finite), and, with ``register: best``, that nothing is registered."""
    def ended(o: TrialOutcome) -> str:
        if o.metric is not None:
            return f"{o.label}: {spec.metric} {o.metric}"
        return f"{o.label}: last val_loss {o.val_loss}" if o.val_loss is not None else o.label

    return (f"no best trial: no trial finished with a finite {spec.metric} ("
            + "; ".join(f"trial_{o.index:03d} {ended(o)}" for o in trials) + ")"
            + ("; nothing is registered" if spec.register == "best" else ""))


def metric_figure(spec: SweepSpec, trials: list[TrialOutcome]):
    """The metric (or, for a stopped trial, its last validation loss, hollow) against each swept field."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = spec.dimensions
    fig, axes = plt.subplots(1, len(dims), figsize=(4.5 * len(dims), 3.6), squeeze=False)
    for ax, d in zip(axes[0], dims):
        for status, style in ((FINISHED, dict(marker="o")), (STOPPED, dict(marker="o", facecolors="none"))):
            pts = [(o.values[d.path], o.metric if status == FINISHED else o.val_loss) for o in trials
                   if o.status == status and (o.metric if status == FINISHED else o.val_loss) is not None]
            if pts and all(isinstance(x, (int, float)) for x, _ in pts):
                ax.scatter([x for x, _ in pts], [y for _, y in pts], edgecolors="C0", label=status, **style)
            elif pts:
                ax.scatter([str(x) for x, _ in pts], [y for _, y in pts], edgecolors="C0", label=status, **style)
        if d.kind == "loguniform" or (d.kind in ("grid", "choice") and _log_spaced(d.values)):
            ax.set_xscale("log")
        ax.set_xlabel(d.path)
        ax.set_ylabel(spec.metric)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # no trial finished or reported a validation loss
            ax.text(0.5, 0.5, "no trial has a value", transform=ax.transAxes, ha="center", va="center")
    fig.suptitle(f"sweep {spec.name}: {spec.metric} by field (hollow: stopped early, last val_loss)")
    fig.tight_layout()
    return fig


def _log_spaced(values) -> bool:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return len(nums) == len(values) and len(nums) > 2 and min(nums) > 0 and max(nums) / min(nums) >= 100 \
        and not all(float(v).is_integer() for v in nums) and math.isfinite(max(nums))


def _register_best(spec: SweepSpec, result: SweepResult, uri: str, sweep_run: str,
                   echo: Callable[[str], None]) -> dict:
    """Register the best trial's model: its pipeline again with register (every earlier stage cached),
    the version tagged with the sweep's run id."""
    cfg = resolve(spec.trials[result.best.index].cfg)
    out = run_pipeline(cfg, echo=lambda line: echo(f"register best: {line}"),
                       nest=Nesting(parent_run_id=sweep_run, tags={"conduit.sweep_run_id": sweep_run,
                                                                  "conduit.sweep_role": "register the best trial"}))
    counts = out.artifacts["register"].manifest["counts"]
    version = counts.get("version")
    if version is not None:
        tracking.client(uri).set_model_version_tag(cfg.register.model_name, str(version), "conduit.sweep_run_id",
                                                   sweep_run)
    StageTracker(uri, sweep_run).set_tags({"conduit.sweep_registered": f"{cfg.register.model_name}/{version}"})
    return {"model_name": cfg.register.model_name, "version": version}


"""The one door into training (``pipeline.training.launch``): one worker in the train stage's own task (Ray
Train's local mode) against Ray Train's one worker on the same config: the same weights, history and
checkpoint record; a failure restarts from the newest checkpoint in the same process; a record one launch
wrote is resumed by the other; and the stage's task SIGKILLed on the session's Ray is retried and resumes
exactly. Ray Train's workers restarting after a SIGKILL: tests/pipeline/training/test_fault_tolerance.py.

The direct calls (``train_once``, as the fault tests make them) train in this test's process, which is
what the stage's task runs; the SIGKILL test goes through ``run_pipeline`` and Ray's task."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from pipeline import tracking
from pipeline.compat import ray_node_of_this_process
from pipeline.config import config_from_dict, load_config
from pipeline.runner import run_pipeline
from pipeline.store.contracts import read_train_starts
from pipeline.training.checkpoint.record import RECORD_FILE, CheckpointRecord
from pipeline.training.device import trains_in_process
from pipeline.training.launch import RANK_ENV, Launch, LoopConfig, launch
from pipeline.training.loop_config import CheckpointPlace
from tests.pipeline.training.test_fault_tolerance import (
    DATA_STAGES,
    ROOT,
    artifact_run_dir,
    assert_same_weights,
    loss_history,
    registered_steps,
    train_once,
)

TIMINGS = {"tokens_per_s", "model_tflops_per_s", "mfu", "peak_memory_gib"}

# 100 steps, a checkpoint every 20 (all kept until the stage seals), two threads wherever it trains (the
# same reduction order in this process and in a Ray task holding two CPUs).
ONE = ["parallel.num_workers=1", "parallel.threads_per_worker=2", "train.steps=100", "checkpoint.every=20",
       "checkpoint.keep=5"]


def fail_once(monkeypatch, tmp_path: Path, step: int) -> None:
    monkeypatch.setenv("CONDUIT_FAILPOINTS", json.dumps(
        {"fail_once_after_step": {"step": step, "marker": str(tmp_path / f"failed-after-{step}")}}))


def tags_of(art) -> dict:
    uri = config_from_dict(art.manifest["run_config"]).tracking_uri()
    return tracking.client(uri).search_runs([tracking.ensure_experiment(uri, "fault")])[0].data.tags


@pytest.fixture(scope="module")
def data_stages(tmp_path_factory, ray_cluster) -> str:
    """An artifact root holding the smoke config's data stages, sealed. This module's own, not the session's
    smoke run's: so it is not tied to the xdist worker that runs that (tests/xdist_plan.py)."""
    tmp = tmp_path_factory.mktemp("in_task_data")
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [f"run.workdir={tmp / 'work'}",
                                                       f"run.artifact_root={tmp / 'artifacts'}"])
    run_pipeline(cfg, until="tokenize", echo=lambda line: None)
    return str(tmp / "artifacts")


def seeded(tmp_path: Path, data_stages: str) -> Path:
    """A fresh artifact root with a copy of the sealed data stages (a pipeline run there trains from scratch)."""
    root = tmp_path / "artifacts"
    for stage in DATA_STAGES:
        shutil.copytree(Path(data_stages) / stage, root / stage)
    return root


@pytest.fixture(scope="module")
def in_task(tmp_path_factory, data_stages):
    """The uninterrupted in-task run (its checkpoints all kept)."""
    return train_once(tmp_path_factory.mktemp("in_task"), "in_task", [*ONE, "parallel.launcher=in_task"], kill=False,
                      data_root=data_stages, prune=False)


def test_auto_trains_one_cpu_worker_in_the_task_and_everything_else_with_ray_train():
    assert trains_in_process("auto", 1, "cpu") and trains_in_process("in_task", 1, "cpu")
    assert not trains_in_process("auto", 2, "cpu") and not trains_in_process("auto", 1, "cuda")
    assert not trains_in_process("ray_train", 1, "cpu")
    # stage tasks kept on some nodes (cluster.stage_resources): a worker goes where the placement strategy puts it
    assert not trains_in_process("auto", 1, "cpu", stages_confined=True)
    assert trains_in_process("in_task", 1, "cpu", stages_confined=True)  # asked for: trains on the stage nodes


def assert_same_records(art, rt_art, steps: tuple) -> list[str]:
    """Both runs' checkpoint records: a checkpoint at each of ``steps``, all kept, each folder named by its step
    and nothing else beside them, and the same files in the newest folder (returned)."""
    entries = []
    for a in (art, rt_art):
        run_dir = artifact_run_dir(a)
        entries.append(json.loads((run_dir / RECORD_FILE).read_text())["checkpoints"])
        assert [e["step"] for e in entries[-1]] == list(steps)
        assert sorted(p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()) == [e["folder"] for e in entries[-1]]
    assert entries[0] == entries[1]
    files = [sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
             for d in (artifact_run_dir(a) / e[-1]["folder"] for a, e in zip((art, rt_art), entries))]
    assert files[0] == files[1] and "canonical.pt" in files[0]
    return files[0]


@pytest.mark.slow
def test_in_task_trains_ray_trains_weights_and_keeps_its_checkpoint_record(tmp_path, in_task, data_stages):
    weights, history, _, art = in_task
    rt_weights, rt_history, _, rt_art = train_once(tmp_path, "ray_train", [*ONE, "parallel.launcher=ray_train"],
                                                   kill=False, data_root=data_stages, prune=False)
    assert art.hash == rt_art.hash  # the launcher changes no result, so it is not in the hash
    assert_same_weights(weights, rt_weights)
    untimed = [[{k: v for k, v in h.items() if k not in TIMINGS} for h in hs] for hs in (history, rt_history)]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 10  # every logged value but the timings, exactly
    assert read_train_starts(art.path) == read_train_starts(rt_art.path) == [0]
    assert tags_of(art)["conduit.launcher"] == "in_task" and tags_of(rt_art)["conduit.launcher"] == "ray_train"
    # The record: the same checkpoints (every 20 steps, all 5 kept), each folder holding the same files.
    assert_same_records(art, rt_art, (20, 40, 60, 80, 100))


def failed_once_after_30(tmp_path: Path, uninterrupted, overrides: list[str], data_stages: str, monkeypatch) -> dict:
    """The uninterrupted run's config (``overrides``) trained again, failing once after step 30 with one restart
    allowed: it restarts from step 20 and ends with ``uninterrupted``'s weights and MLflow history (each step
    once). Returns the train run's tags."""
    weights, history, _, straight = uninterrupted
    fail_once(monkeypatch, tmp_path, 30)
    resumed, resumed_history, _, art = train_once(tmp_path, "failed", [*overrides, "checkpoint.max_failures=1"],
                                                  kill=False, data_root=data_stages)
    assert (tmp_path / "failed-after-30").exists()
    assert read_train_starts(art.path) == [0, 20]
    assert_same_weights(weights, resumed)
    assert [h["loss"] for h in resumed_history] == [h["loss"] for h in history]
    assert loss_history(art) == loss_history(straight) != []
    tags = tags_of(art)
    assert tags["conduit.restarts"] == "1", tags
    return tags


@pytest.mark.slow
def test_a_failure_in_the_task_restarts_it_from_the_newest_checkpoint(tmp_path, in_task, data_stages,
                                                                      monkeypatch):
    """Fails once after step 30: the restart, in the same process, starts at 20 (the newest checkpoint),
    and ends with the uninterrupted run's weights and MLflow history (each step once)."""
    tags = failed_once_after_30(tmp_path, in_task, ONE, data_stages, monkeypatch)
    assert tags["conduit.last_failure"] == "rank 0: RuntimeError: failpoint: fail_once_after_step 30", tags
    assert tags["conduit.launcher"] == "in_task"


@pytest.mark.slow
def test_ray_train_resumes_a_run_the_task_began(tmp_path, in_task, data_stages, monkeypatch):
    """The in-task run fails after step 30 with no restart allowed (the stage fails); the rerun, on Ray
    Train's worker, restores the record the task wrote and continues from step 20 to the same weights."""
    weights, _, _, _ = in_task
    storage = tmp_path / "shared-storage"
    fail_once(monkeypatch, tmp_path, 30)
    common = [*ONE, f"checkpoint.storage={storage}", "checkpoint.max_failures=0"]
    with pytest.raises(RuntimeError, match="training failed: failpoint: fail_once_after_step 30"):
        train_once(tmp_path, "task", [*common, "parallel.launcher=in_task"], kill=False, data_root=data_stages)
    (run_dir,) = storage.iterdir()
    assert registered_steps(run_dir) == [20]
    monkeypatch.delenv("CONDUIT_FAILPOINTS")
    resumed, _, _, art = train_once(tmp_path, "ray", [*common, "parallel.launcher=ray_train"], kill=False,
                                    data_root=data_stages)
    assert read_train_starts(art.path) == [0, 20]
    assert tags_of(art)["conduit.launcher"] == "ray_train"
    assert_same_weights(weights, resumed)


def whole_pipeline(tmp_path: Path, data_stages: str, ray_cluster, *overrides: str):
    """The in-task run's config for ``run_pipeline`` (its data stages cached, a train stage of its own), and the
    session's Ray folder (whose raylet starts the stage tasks)."""
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [
        f"run.workdir={tmp_path / 'work'}", f"run.artifact_root={seeded(tmp_path, data_stages)}", "train.log_every=10",
        "train.progress_bar=false", "optimizer.adam_eps=0.0001", *ONE, *overrides])
    return cfg, ray_node_of_this_process().get_session_dir_path()


def session_processes(session_dir: str, title) -> list[int]:
    """Pids of this session's processes (children of its raylet) whose title ``title(cmdline)`` accepts."""
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if title(" ".join(proc.info["cmdline"] or []).strip()) and session_dir in " ".join(proc.parent().cmdline()):
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):  # gone meanwhile, or no parent
            continue
    return pids


def _stage_task_pids(session_dir: str) -> list[int]:
    """The train stage's task processes under this session's raylet."""
    return session_processes(session_dir, lambda cmd: cmd == "ray::conduit.train")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_once_checkpointed_twice(tmp_path: Path, cfg, victim):
    """``run_pipeline(cfg, until="train")`` while a watcher SIGKILLs a process once training has recorded two
    checkpoints: ``victim()``'s first item (a pid; it returns None while there is none to kill yet). Returns
    the pipeline's result and what ``victim`` returned for the kill."""
    killed: list[tuple] = []
    done = threading.Event()

    def kill_after_two_checkpoints() -> None:
        while not done.is_set():
            runs = list((tmp_path / "artifacts" / "checkpoints").glob("train-*"))
            found = victim() if runs and len(registered_steps(runs[0])) >= 2 else None
            if found:
                os.kill(found[0], signal.SIGKILL)
                killed.append(found)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_after_two_checkpoints)
    killer.start()
    try:
        result = run_pipeline(cfg, until="train", echo=lambda line: None)
    finally:
        done.set()
        killer.join()
    assert killed, "the train stage finished before two checkpoints were recorded"
    return result, killed[0]


@pytest.mark.slow
def test_a_killed_train_task_is_retried_and_resumes_exactly(tmp_path, in_task, data_stages, ray_cluster):
    """The whole pipeline up to train on the session's Ray; once two checkpoints are recorded, the stage's
    task is SIGKILLed. Ray retries the task, which resumes from the newest checkpoint: the same weights as
    the uninterrupted run, and MLflow holds each logged step once."""
    weights, history, _, straight = in_task
    cfg, session = whole_pipeline(tmp_path, data_stages, ray_cluster)
    result, _ = kill_once_checkpointed_twice(tmp_path, cfg,
                                             lambda: (pids[0],) if (pids := _stage_task_pids(session)) else None)
    art = result.artifacts["train"]
    assert art.hash == straight.hash
    starts = read_train_starts(art.path)
    assert len(starts) == 2 and starts[0] == 0 and starts[1] in (40, 60, 80), starts
    assert_same_weights(weights, load_file(art.path / "model.safetensors"))
    c = tracking.client(result.tracking_uri)
    (train_run,) = c.search_runs([c.get_run(result.run_id).info.experiment_id], "tags.`conduit.stage` = 'train'")
    logged = sorted((m.step, m.value) for m in c.get_metric_history(train_run.info.run_id, "loss"))
    assert logged == loss_history(straight)
    assert [h["loss"] for h in history] == [v for _, v in logged]


def cancel_once_checkpointed(tmp_path: Path, cfg, pids_of, count: int = 1, before_cancel=lambda: None):
    """``run_pipeline(cfg, until="train")`` in a thread, its stage task cancelled (``runner.cancel_stage_tasks``,
    as a stopped sweep trial's) once training has recorded a checkpoint and ``pids_of()`` names ``count``
    processes (``before_cancel()`` then runs); this process's pipelines are let start stage tasks again after.
    Returns what the pipeline raised and those pids."""
    from pipeline.runner import allow_stage_tasks, cancel_stage_tasks

    ended: list[BaseException] = []

    def pipeline() -> None:
        try:
            run_pipeline(cfg, until="train", echo=lambda line: None)
        except BaseException as e:  # noqa: BLE001 - what the test checks
            ended.append(e)

    thread = threading.Thread(target=pipeline)
    thread.start()
    deadline = time.monotonic() + 300
    while True:
        runs = list((tmp_path / "artifacts" / "checkpoints").glob("train-*"))
        pids = pids_of()
        if runs and registered_steps(runs[0]) and len(pids) == count:
            break
        assert thread.is_alive() and time.monotonic() < deadline, ended
        time.sleep(0.01)
    before_cancel()
    try:
        assert cancel_stage_tasks(wait_s=60) == 1
        thread.join(60)
    finally:
        allow_stage_tasks()  # this process's later pipelines (other tests) start stage tasks again
    assert not thread.is_alive()
    return ended, pids


@pytest.mark.slow
def test_a_cancelled_train_task_ends_killed_and_its_process_lives_on(tmp_path, data_stages, ray_cluster):
    """``runner.cancel_stage_tasks``, as a stopped sweep trial calls it (``sweep.run.EndStagesOnStop``): once
    training has a checkpoint, the train stage's task is cancelled as Ctrl-C would end it. The pipeline
    raises Ray's TaskCancelledError, the stage's and the pipeline's MLflow runs end KILLED with the steps
    logged so far (each once, none missing), and the task's process, torch and DeepSpeed imported, is still
    there for the next task (a forced cancel, or its owner's death, ends it). 5000 steps: the cancel comes
    long before the end however slowly this test's watcher sees the first checkpoint."""
    from ray.exceptions import TaskCancelledError

    from pipeline.runner import allow_stage_tasks, cancel_stage_tasks

    steps = 5000
    cfg, session = whole_pipeline(tmp_path, data_stages, ray_cluster, f"train.steps={steps}")
    ended, pids = cancel_once_checkpointed(tmp_path, cfg, lambda: _stage_task_pids(session))
    assert len(ended) == 1 and isinstance(ended[0], TaskCancelledError), ended
    assert alive(pids[0])
    try:
        assert cancel_stage_tasks(wait_s=1) == 0  # nothing in flight now
    finally:
        allow_stage_tasks()

    c = tracking.client(cfg.tracking_uri())
    exp = c.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    (train_run,) = c.search_runs([exp], "tags.`conduit.stage` = 'train'")
    assert train_run.info.status == "KILLED"
    assert c.get_run(train_run.data.tags["mlflow.parentRunId"]).info.status == "KILLED"
    logged = sorted(m.step for m in c.get_metric_history(train_run.info.run_id, "loss"))
    assert logged and logged == list(range(10, logged[-1] + 1, 10)) and logged[-1] < steps, logged


class _Reports:
    """A sweep trial's Ray Train callback, as the train stage sees it (``sweep.run.validation_to_tune_class``):
    its ``checkpoint_steps`` (a synchronous sweep's rungs), and for each report it is handed, its step and the
    steps the training had recorded a checkpoint at by then."""

    checkpoint_steps = (10,)

    def __init__(self, run_dir) -> None:
        self.run_dir, self.seen = run_dir, []

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self.seen.append((metrics[0]["step"], registered_steps(self.run_dir())))


@pytest.mark.slow
def test_a_rung_step_is_checkpointed_before_its_validation_is_reported(tmp_path, data_stages, monkeypatch):
    """A callback's ``checkpoint_steps`` get a checkpoint (here step 10, where ``checkpoint.every=0`` saves
    none), and it is recorded before that step's validation loss is reported: a sweep that pauses a trial on
    that report resumes it from that very step."""
    from tests.pipeline.training import test_fault_tolerance as ft

    storage = tmp_path / "storage"
    reports, tracker = _Reports(lambda: next(storage.iterdir())), ft.StageTracker
    monkeypatch.setattr(ft, "StageTracker", lambda uri, run_id: tracker(uri, run_id, (reports,)))
    train_once(tmp_path, "rung", [*ONE, "parallel.launcher=in_task", "train.steps=30", "checkpoint.every=0",
                                  "validation.every=10", "validation.batches=1", f"checkpoint.storage={storage}",
                                  "checkpoint.keep=3"], kill=False, data_root=data_stages)
    assert reports.seen == [(10, [10]), (20, [10]), (30, [10, 30])]


def test_a_stage_task_started_with_sigint_ignored_can_be_cancelled():
    """Ray cancels a running task by interrupting its main thread as SIGINT would, which does nothing where
    SIGINT is ignored (every process of a Ray started in the background: CI's): a stage task gives it
    Python's handler back first (``runner.interruptible``), and leaves a handled SIGINT as it is."""
    import signal as sig

    from pipeline.runner import interruptible

    before = sig.getsignal(sig.SIGINT)
    try:
        sig.signal(sig.SIGINT, sig.SIG_IGN)
        interruptible()
        assert sig.getsignal(sig.SIGINT) is sig.default_int_handler
        mine = lambda signum, frame: None  # noqa: E731
        sig.signal(sig.SIGINT, mine)
        interruptible()
        assert sig.getsignal(sig.SIGINT) is mine
    finally:
        sig.signal(sig.SIGINT, before)


def in_process(tmp_path, fn, callbacks=(), max_failures=0):
    """``launch`` of ``fn`` (in place of the training loop) as one rank in this process."""
    from pipeline.training import launch as module

    loop = LoopConfig(run_config={}, tokens=None, out=None, tracker=None, device="cpu", precision="fp32",
                      checkpoints=CheckpointPlace(str(tmp_path), "train-x", keep=1))
    how = Launch(num_workers=1, device="cpu", cpus=None, placement_strategy="PACK", max_failures=max_failures,
                 callbacks=callbacks, in_process=True)
    original = module.train_worker
    module.train_worker = fn
    try:
        return launch(loop, how)
    finally:
        module.train_worker = original


def test_the_rank_variables_and_process_group_are_the_runs_only(tmp_path, monkeypatch):
    """RANK, WORLD_SIZE and the others are this one rank's while its training runs, in a process group of one,
    and gone again after, the group too: the task's process, which Ray reuses, may run other tasks."""
    import torch.distributed as dist

    for var in RANK_ENV:
        monkeypatch.delenv(var, raising=False)
    seen: dict = {}

    def train(config) -> None:
        seen.update({v: os.environ.get(v) for v in RANK_ENV}, world=dist.get_world_size(), rank=dist.get_rank())

    for _ in range(2):
        seen.clear()
        assert in_process(tmp_path, train).error is None
        assert seen == {**RANK_ENV, "world": 1, "rank": 0}
        assert not set(RANK_ENV) & set(os.environ) and not dist.is_initialized()


def test_a_failed_attempt_is_told_to_the_callbacks_and_restarted_up_to_max_failures(tmp_path):
    """As Ray Train's controller: each failure to ``after_exception``, a new attempt while ``max_failures``
    allows, the last failure returned once it does not; an interrupt is no failure: it ends the run."""
    told: list[str] = []

    class Tell:
        def after_exception(self, run_context, worker_exceptions) -> None:
            told.append(str(worker_exceptions[0]))

    attempts: list[int] = []

    def fails_twice(config) -> None:
        attempts.append(len(attempts))
        if len(attempts) <= 2:
            raise RuntimeError(f"attempt {len(attempts)}")

    outcome = in_process(tmp_path, fails_twice, callbacks=(Tell(),), max_failures=2)
    assert outcome.error is None and outcome.failures == 2 and told == ["attempt 1", "attempt 2"]
    attempts.clear(), told.clear()
    outcome = in_process(tmp_path, fails_twice, callbacks=(Tell(),), max_failures=1)
    assert str(outcome.error) == "attempt 2" and outcome.failures == 2 and len(attempts) == 2

    def interrupted(config) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        in_process(tmp_path, interrupted, callbacks=(Tell(),), max_failures=3)
    assert not set(RANK_ENV) & set(os.environ)


def test_ending_the_process_group_forgets_deepspeeds_groups_of_it(tmp_path):
    """DeepSpeed caches the groups it made (expert parallel, ...) in its module: after a run ends they are
    forgotten, so that the next run in the process (a reused task process) makes its own."""
    code = """
import deepspeed.utils.groups as groups
import torch.distributed as dist
from pipeline.training.launch import end_process_group
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
groups._EXPERT_PARALLEL_GROUP = {"ep_size_1": dist.new_group([0])}
groups._WORLD_GROUP = dist.group.WORLD
end_process_group()
assert groups._EXPERT_PARALLEL_GROUP == {} and groups._WORLD_GROUP is None and not dist.is_initialized()
print("forgotten")
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("forgotten"), out.stderr[-2000:]


def test_the_record_keeps_the_newest_and_names_only_whole_checkpoints(tmp_path):
    """``CheckpointRecord`` alone: ``keep`` 2 of four checkpoints, each folder named by its step, the record
    written whole before the oldest is deleted; a folder the record does not name (an attempt that died while
    its ranks uploaded) is never resumed from and is emptied when its step is saved again; after sealing only
    the newest is left."""
    record = CheckpointRecord(CheckpointPlace(str(tmp_path), "train-x", keep=2))
    assert record.entries == []
    for step in (10, 20, 30, 40):
        src = tmp_path / f"local{step}"
        (src / "sub").mkdir(parents=True)
        (src / "sub" / "state.bin").write_bytes(bytes([step]) * 100)
        record.clear_folder(step)
        record.upload(str(src), step)
        record.register(step)
    run_dir = tmp_path / "train-x"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint_000000030", "checkpoint_000000040", RECORD_FILE]
    # a partial folder of step 50 (no record of it) is not what a new record reads as newest
    (run_dir / "checkpoint_000000050").mkdir()
    (run_dir / "checkpoint_000000050" / "partial").write_text("cut short")
    again = CheckpointRecord(CheckpointPlace(str(tmp_path), "train-x", keep=2))
    assert [e["step"] for e in again.newest_first()] == [40, 30]
    assert (Path(again.path_of(again.entries[-1])) / "sub" / "state.bin").read_bytes() == bytes([40]) * 100
    again.clear_folder(50)
    assert list((run_dir / "checkpoint_000000050").iterdir()) == []
    again.keep_only_newest()
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint_000000040", RECORD_FILE]
    assert [e["step"] for e in CheckpointRecord(again.place).entries] == [40]

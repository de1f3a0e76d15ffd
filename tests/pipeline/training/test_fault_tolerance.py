"""Faults during training, each really injected, each ending with exactly the weights of an
uninterrupted run: a training worker SIGKILLed (Ray Train restarts the group from the latest
checkpoint), the driver SIGKILLed (the rerun of the same command continues from that checkpoint and
marks the dead attempt's MLflow runs FAILED), and two configs sharing one checkpoint storage."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from models.accounting import param_counts
from pipeline import tracking
from pipeline.stage_tracker import StageTracker
from pipeline.config import config_from_dict, load_config
from pipeline.console import describe
from pipeline.runner import make_plan, resolve
from pipeline.store.contracts import read_train_precision, read_train_starts
from pipeline.stages import STAGES
from pipeline.compat import ray_node_of_this_process
from pipeline.stages.train import CHECKPOINT_BYTES_PER_PARAM, CHECKPOINT_FIXED_BYTES, checkpoint_place
from pipeline.training.checkpoint.record import RECORD_FILE
from pipeline.store.backends import store_for
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def train_worker_pids() -> list[int]:
    """Pids of this session's Ray Train workers: children of our own raylet, whatever other Ray clusters share
    the machine (the state API needs a dashboard, which the test cluster lacks)."""
    import psutil

    session = ray_node_of_this_process().get_session_dir_path()
    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "RayTrainWorker" not in cmd:
            continue
        parent = proc.parent()
        if parent is not None and session in " ".join(parent.cmdline()):
            pids.append(proc.info["pid"])
    return pids


def registered_steps(ray_dir: Path) -> list[int]:
    """Steps of the checkpoints the training has recorded (a folder on disk may not be yet)."""
    try:
        return [e["step"] for e in json.loads((ray_dir / RECORD_FILE).read_text())["checkpoints"]]
    except FileNotFoundError:  # not written yet (the record is renamed in whole)
        return []


def registered_checkpoints(ray_dir: Path) -> int:
    return len(registered_steps(ray_dir))


def kill_workers(ray_dir: Path, killed: list[int], done: threading.Event, final_step: int,
                 damaged: list[int]) -> None:
    """SIGKILL one training worker once two checkpoints are registered, after truncating a file of the
    latest one (the restart must skip it for the one before), then one worker of the restarted group
    once the final checkpoint is registered (the loop holds still there: the CONDUIT_FAILPOINTS pause)."""
    for ready in (lambda steps: len(steps) >= 2, lambda steps: final_step in steps):
        while not ready(registered_steps(ray_dir)) or len(set(train_worker_pids()) - set(killed)) < 2:
            if done.is_set():
                return  # training ended first; the test then fails on `killed`
            time.sleep(0.02)
        if not killed:
            latest = json.loads((ray_dir / RECORD_FILE).read_text())["checkpoints"][-1]
            with open(ray_dir / latest["folder"] / "canonical.pt", "r+b") as f:
                f.truncate(100)
            damaged.append(latest["step"])
        pid = max(set(train_worker_pids()) - set(killed))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)


STEPS, EVERY = 60, 20  # three checkpoints: a kill after two, a kill at the last
TRAIN = [f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "train.log_every=10", "train.progress_bar=false",
         "optimizer.adam_eps=0.0001"]


def ray_run_dir(cfg, hash_: str) -> Path:
    place = checkpoint_place(cfg, hash_)
    return Path(place.storage) / place.name


def artifact_run_dir(art) -> Path:
    """Where the checkpoints of a sealed train artifact are, from the config in its manifest."""
    return ray_run_dir(config_from_dict(art.manifest["run_config"]), art.hash)


DATA_STAGES = ("shard", "tokenizer", "tokenize")


def train_once(tmp: Path, name: str, overrides: list[str], kill: bool, data_root: str, prune: bool = True,
               damaged: list[int] | None = None, status_lines: list[str] | None = None):
    """The smoke config's train stage, called directly, on the data stages the session's smoke run
    sealed under ``data_root`` (tests/smoke_run.py: the same data config, so the same hashes). The
    stage writes into ``<tmp>/<name>/train/<hash>`` and keeps its checkpoints in
    ``<tmp>/<name>/checkpoints`` (unless ``overrides`` name a ``checkpoint.storage``), so runs
    of one config never see each other's. With ``kill``, workers of the train stage are SIGKILLed
    (``kill_workers``; the step of the checkpoint it damaged goes to ``damaged``). With ``status_lines``,
    the driver's status line (``console.describe`` of ``tracking.stage_progress``, as ``StageStatus``
    polls it) is read every 0.2 s while the stage runs, and each new line appended."""
    work = tmp / name
    cfg = resolve(load_config(ROOT / "configs" / "smoke.yaml", [
        f"run.workdir={work}", f"run.artifact_root={data_root}", f"checkpoint.storage={work / 'checkpoints'}",
        *TRAIN, *overrides]))
    uri = cfg.tracking_uri()
    work.mkdir(parents=True)
    exp = tracking.ensure_experiment(uri, "fault", artifact_location=str(work / "mlartifacts"))
    plan = {p.stage: p for p in make_plan(cfg)}
    store = store_for(cfg.artifact_root())
    arts = {stage: store.load(stage, plan[stage].hash) for stage in DATA_STAGES}
    assert all(store.check(a) is None for a in arts.values()), "the smoke run's data stages are not sealed"
    tracker = StageTracker(uri, tracking.start_run(uri, exp, "train", tags={"conduit.hash": plan["train"].hash}))
    killed: list[int] = []
    killer, done = None, threading.Event()
    watcher = None
    if status_lines is not None:
        def watch() -> None:
            t0 = time.monotonic()
            while not done.wait(0.2):
                line = describe("train", time.monotonic() - t0, tracking.stage_progress(uri, "fault", plan["train"].hash,
                                                                                        timeout_s=5), cfg)
                line = line.split(", ", 1)[1] if ", " in line else ""  # without the time, which always changes
                if line and (not status_lines or status_lines[-1] != line):
                    status_lines.append(line)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    if kill:
        killer = threading.Thread(target=kill_workers,
                                  args=(ray_run_dir(cfg, plan["train"].hash), killed, done, cfg.train.steps,
                                        [] if damaged is None else damaged))
        killer.start()
    # prune=False keeps every checkpoint Ray Train kept (not just the final one) for a test to resume from
    record = STAGES["train"] if prune else dataclasses.replace(STAGES["train"], after_seal=None)
    try:
        arts["train"] = record.execute(cfg, plan["train"].hash, work / "train" / plan["train"].hash, arts, tracker)
    finally:
        done.set()
        if killer:
            killer.join()
        if watcher:
            watcher.join()
    history = json.loads((arts["train"].path / "train_metrics.json").read_text())
    return load_file(arts["train"].path / "model.safetensors"), history, killed, arts["train"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, smoke_artifact_root):
    return train_once(tmp_path_factory.mktemp("straight"), "straight", [], kill=False, data_root=smoke_artifact_root,
                      prune=False)


def loss_history(art) -> list[tuple[int, float]]:
    """The train run's ``loss`` history in MLflow, as (step, value) in step order (repeats kept)."""
    uri = config_from_dict(art.manifest["run_config"]).tracking_uri()
    c = tracking.client(uri)
    (run,) = c.search_runs([tracking.ensure_experiment(uri, "fault")], filter_string="attributes.run_name = 'train'")
    return sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, "loss"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "the weights differ from the uninterrupted run's"


def test_killed_workers_resume_from_checkpoints_exactly(tmp_path, straight, smoke_artifact_root, monkeypatch):
    """One worker killed mid-run, and one of the restarted group killed after the final checkpoint
    (before the weights are written): the stage still seals, with the uninterrupted run's weights."""
    straight, straight_history, _, straight_art = straight
    monkeypatch.setenv("CONDUIT_FAILPOINTS", json.dumps({"pause_after_final_checkpoint_s": 120}))
    damaged: list[int] = []
    lines: list[str] = []
    resumed, resumed_history, killed, art = train_once(tmp_path, "killed", ["checkpoint.max_failures=2"], kill=True,
                                                       data_root=smoke_artifact_root, damaged=damaged,
                                                       status_lines=lines)
    assert len(killed) == 2
    # The group restarted past a checkpoint, then at the final one; the history is whole: every
    # logged step once, as in the uninterrupted run, with the same losses.
    starts = read_train_starts(art.path)
    assert len(starts) == 3 and starts[0] == 0 and EVERY <= starts[1] < STEPS and starts[1] % EVERY == 0, starts
    assert starts[2] == STEPS, starts
    # The latest checkpoint at the first kill had a truncated file: the restart skipped it for the one
    # before (or, had a newer one been registered by the time the worker died, took that one).
    assert len(damaged) == 1 and starts[1] != damaged[0], (starts, damaged)
    assert art.manifest["counts"]["starts"] == starts
    # The train run said what happened (the status line shows it while no step goes by): two restarts,
    # the last failure's ranks and errors, and what the last attempt was doing when it ended.
    uri = config_from_dict(art.manifest["run_config"]).tracking_uri()
    tags = tracking.client(uri).search_runs([tracking.ensure_experiment(uri, "fault")])[0].data.tags
    assert tags["conduit.restarts"] == "2" and tags["conduit.last_failure"].startswith("rank "), tags
    assert tags["conduit.phase"] == "writing the model", tags
    # ... and the driver's status line said it while no step went by: read as the driver reads it, during
    # the run, it went from steps to the restart (which attempt, which rank failed and why) and back.
    restarts = [i for i, ln in enumerate(lines) if ln.startswith("step ") and "restarting after a failure (attempt "
                in ln and ": rank " in ln]
    assert restarts and any(ln.startswith("step ") and "loss " in ln for ln in lines[:restarts[0]]), lines
    assert any("loading the checkpoint checkpoint_" in ln or "building the model" in ln
               for ln in lines[restarts[0] + 1:]), lines
    # MLflow holds each logged step once, with the uninterrupted run's values: the restarted groups
    # recomputed steps their predecessors had logged, and sent none of them again.
    assert loss_history(art) == loss_history(straight_art) != []
    assert [h["step"] for h in resumed_history] == [h["step"] for h in straight_history]
    assert [h["loss"] for h in resumed_history] == [h["loss"] for h in straight_history]
    assert art.manifest["counts"]["first_loss"] == straight_history[0]["loss"]
    assert_same_weights(straight, resumed)
    # Sealed: only the final checkpoint is left (checkpoint.resume_from can continue from it).
    left = sorted(p.name for p in artifact_run_dir(art).glob("checkpoint_*") if p.is_dir())
    assert len(left) == 1 and Path(art.manifest["counts"]["checkpoint"]).name == left[0], left
    # The disk preflight's estimate of a checkpoint holds for the real one.
    params = param_counts(config_from_dict(art.manifest["run_config"]).model_config())["total"]
    size = sum(f.stat().st_size for f in (artifact_run_dir(art) / left[0]).rglob("*") if f.is_file())
    assert size <= CHECKPOINT_BYTES_PER_PARAM * params + CHECKPOINT_FIXED_BYTES, (size, params)


def command_of(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:80]
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return f"(pid {proc.pid}, ended)"


def cli_overrides(work: Path, data_root: str) -> list[str]:
    """The driver tests' config: the smoke config with TRAIN, the session smoke run's artifact root
    (its data stages cached) and checkpoints of this test's own."""
    return [f"run.workdir={work}", f"run.artifact_root={data_root}", f"checkpoint.storage={work / 'checkpoints'}",
            *TRAIN]


def run_cli(work: Path, data_root: str, *extra: str) -> subprocess.Popen:
    """``python -m jobs.run configs/smoke.yaml`` as a user starts it (its own embedded Ray)."""
    cmd = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", *cli_overrides(work, data_root),
           "eval.max_batches=2", "eval.max_text_tokens=512", "eval.lambada_max_examples=16",
           "eval.max_new_tokens=4", *extra]
    with open(work.parent / f"{work.name}-{time.monotonic_ns()}.log", "w") as log:  # the child keeps its own copy
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def a_ray_that_died_uncleanly():
    """``ray start --head`` in Ray's default temp dir, then SIGKILL of every process it started: what
    is left is ``/tmp/ray/ray_current_cluster`` naming a cluster that no longer exists, which a plain
    ``ray.init()`` would try to join (STACK.md). Removed afterwards, unless it was there before."""
    from ray._common.utils import get_ray_address_file

    address_file = Path(get_ray_address_file(None))
    before = address_file.read_bytes() if address_file.exists() else None
    gcs = free_port()
    ports = [f"--port={gcs}", f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"]
    started = subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--head", "--num-cpus=0",
                              "--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                              *ports], capture_output=True, text=True, timeout=120, start_new_session=True)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert address_file.read_text().strip().endswith(f":{gcs}"), address_file.read_text()
        # Its processes: those that name its session folder or its GCS port, and their children (the
        # agents, which rename themselves).
        commands = {p: " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])}
        (gcs_cmd,) = [c for c in commands.values() if "gcs_server" in c and f"--gcs_server_port={gcs}" in c]
        session = re.search(r"(/\S*/session_[\w-]+)/logs", gcs_cmd).group(1)
        mine = {p for p, c in commands.items() if session in c or re.search(rf":{gcs}\b", c)}
        mine |= {child for p in list(mine) for child in p.children(recursive=True)}
        assert len(mine) >= 3, [commands.get(p) for p in mine]  # GCS, raylet, monitors, agents
        for p in mine:
            with contextlib.suppress(psutil.NoSuchProcess):  # one may end as its parent goes
                p.kill()
        psutil.wait_procs(list(mine), timeout=30)
        assert address_file.exists()  # SIGKILL leaves it: the cluster it names is gone
        yield address_file
    finally:
        if before is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_bytes(before)


def dashboard_http_addresses(procs: list[psutil.Process]) -> set[str]:
    """The addresses the embedded Ray's dashboard serves its UI and the Jobs API on, among ``procs``: of the
    dashboard process's listening sockets, those whose HTTP answer comes from its aiohttp server (the same
    process's Prometheus exporter, which Ray binds to every interface, answers from another server)."""
    import requests

    dashboard = next(p for p in procs if "dashboard/dashboard.py" in " ".join(p.cmdline()))
    served = set()
    for c in dashboard.net_connections(kind="tcp"):
        if c.status != psutil.CONN_LISTEN:
            continue
        try:
            answer = requests.get(f"http://127.0.0.1:{c.laddr.port}/api/version", timeout=10)
        except requests.RequestException:
            continue
        if "aiohttp" in answer.headers.get("Server", ""):
            served.add(c.laddr.ip)
    return served


def test_a_killed_driver_costs_no_training_and_its_runs_are_marked_failed(tmp_path, straight, smoke_artifact_root):
    """The driver SIGKILLed once two checkpoints are registered; then, with another Ray on the machine
    dead uncleanly (``/tmp/ray/ray_current_cluster`` left behind), the same command again: the rerun
    starts its own Ray, continues from the checkpoints, ends with the uninterrupted run's weights, and
    marks the dead attempt's MLflow runs FAILED."""
    weights, _, _, straight_art = straight
    work = tmp_path / "driver"
    work.mkdir()
    cfg = resolve(load_config(ROOT / "configs" / "smoke.yaml", cli_overrides(work, smoke_artifact_root)))
    plan = {p.stage: p for p in make_plan(cfg)}
    train_hash = plan["train"].hash
    assert train_hash == straight_art.hash  # evaluate's settings are outside the train hash
    assert [s for s in DATA_STAGES if plan[s].cached] == list(DATA_STAGES)  # the smoke run's, reused
    run_dir = ray_run_dir(cfg, train_hash)
    driver = run_cli(work, smoke_artifact_root, "cluster.include_dashboard=true")  # as the demo: dashboard, agents
    deadline = time.monotonic() + 600
    while registered_checkpoints(run_dir) < 2:
        assert driver.poll() is None, "the pipeline ended before two checkpoints: nothing to kill"
        assert time.monotonic() < deadline, "no two checkpoints within 10 minutes"
        time.sleep(0.05)
    ray_procs = psutil.Process(driver.pid).children(recursive=True)
    assert dashboard_http_addresses(ray_procs) == {"127.0.0.1"}  # cluster.dashboard_host's default, as bound
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    # The killed driver's embedded Ray goes with it: every process it had started (GCS, raylet, the
    # dashboard and its agents, which Ray renames ray::DashboardAgent, workers) ends on its own.
    named = {p.pid: command_of(p) for p in ray_procs}
    assert any("DashboardAgent" in c for c in named.values()), named
    with a_ray_that_died_uncleanly():  # started while the killed driver's processes wind down
        _, alive = psutil.wait_procs(ray_procs, timeout=120)
        assert not alive, f"processes of the killed driver's Ray still run: {[named[p.pid] for p in alive]}"
        # what is asserted ends at train (evaluate and register: tests/e2e/test_smoke.py)
        rerun = run_cli(work, smoke_artifact_root, "--until", "train")
        assert rerun.wait(timeout=900) == 0, "the rerun failed: see its log beside the workdir"
    train_dir = Path(cfg.artifact_root()) / "train" / train_hash
    starts = read_train_starts(train_dir)
    # The first attempt started at 0; the rerun began past its two checkpoints, not at step 0.
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 2 * EVERY and starts[1] % EVERY == 0, starts
    assert_same_weights(weights, load_file(train_dir / "model.safetensors"))
    # MLflow: the dead attempt's parent and train runs are FAILED, the rerun's FINISHED.
    uri = cfg.tracking_uri()
    exp = tracking.ensure_experiment(uri, cfg.tracking.experiment)
    runs = tracking.client(uri).search_runs([exp], max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.info.status for r in parents) == ["FAILED", "FINISHED"], [r.info.status for r in parents]
    dead = next(r for r in parents if r.info.status == "FAILED")
    dead_children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == dead.info.run_id]
    assert "RUNNING" not in [r.info.status for r in dead_children]
    assert any(r.data.tags.get("conduit.stage") == "train" and r.info.status == "FAILED" for r in dead_children)


def test_two_configs_share_a_checkpoint_storage_without_seeing_each_other(tmp_path, straight, smoke_artifact_root):
    """Config A (the uninterrupted run, ``straight``: 60 steps, checkpoints at 20, 40 and 60), then config
    B (another learning rate and length) on A's ``checkpoint.storage``: B trains from step 0 on its
    own (it used to restore A's final step and fail); ``--force train`` on B removes exactly B's
    checkpoints (the runner calls the stage's ``discard_state``, checked with toy stages in
    test_runner_failures.py), and A's stay for the tests that resume from them."""
    _, a_history, _, a = straight
    storage = Path(config_from_dict(a.manifest["run_config"]).checkpoint.storage)
    # One worker: what is shared here is the storage, and one worker starts in half the CPU time of two.
    # B checkpoints whenever checkpoint.every_s has passed at a log step (every 10 steps): here
    # always, so at 10, 20 and 30.
    _, b_history, _, b = train_once(tmp_path, "b", [
        f"checkpoint.storage={storage}", "train.steps=30", "checkpoint.every=0",
        "parallel.num_workers=1", "checkpoint.every_s=0.000001", "optimizer.lr=0.002"],
        kill=False, data_root=smoke_artifact_root)
    recorded = {art.hash: registered_steps(storage / f"train-{art.hash}") for art in (a, b)}
    # A's two kept (checkpoint.keep, not pruned), B's final one only (pruned when its artifact was sealed)
    assert recorded == {a.hash: [STEPS - EVERY, STEPS], b.hash: [30]}
    assert a.hash != b.hash
    assert read_train_starts(a.path) == read_train_starts(b.path) == [0]
    assert b_history[-1]["step"] == 30
    assert b_history[-1]["loss"] != next(h["loss"] for h in a_history if h["step"] == 30)
    assert sorted(p.name for p in storage.iterdir()) == sorted([f"train-{a.hash}", f"train-{b.hash}"])
    STAGES["train"].discard_state(config_from_dict(b.manifest["run_config"]), b.hash)
    assert [p.name for p in storage.iterdir()] == [f"train-{a.hash}"]


def test_resume_on_one_worker_from_a_checkpoint_on_s3(tmp_path, straight, smoke_artifact_root, moto_s3):
    """2 workers trained to step STEPS - EVERY (40); that checkpoint, copied to S3 (a moto server), is continued by
    1 worker (``checkpoint.resume_from=s3://...``, through the layout-independent canonical.pt since the
    world size differs) to step STEPS (60): same weights as the 2-worker run, and its own checkpoint is
    reported to ``checkpoint.storage=s3://...``."""
    import pyarrow.fs as pafs

    weights, _, _, train_art = straight
    first_kept = sorted(p for p in artifact_run_dir(train_art).glob("checkpoint_*") if p.is_dir())[0]
    assert first_kept.name.startswith("checkpoint_")  # keep_checkpoints=2 (not pruned here): 40, 60
    assert json.loads((first_kept / "layout.json").read_text()) == {"world_size": 2, "ep_size": 1, "zero_stage": 1}
    query = f"endpoint_override={moto_s3}&scheme=http"
    fs = pafs.S3FileSystem(endpoint_override=moto_s3, scheme="http", allow_bucket_creation=True)
    fs.create_dir("conduit-ckpt")
    pafs.copy_files(str(first_kept), f"conduit-ckpt/from/{first_kept.name}",
                    source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    assert read_train_precision(train_art.path)["precision"] == "fp32"  # what auto chose for 2 workers
    assert json.loads((first_kept / "train_precision.json").read_text()) == read_train_precision(train_art.path)
    # precision auto: the continuation keeps the checkpoint's precision (read from S3 before its engine is
    # built) rather than timing both again on its own layout (one worker, two threads)
    resumed, history, _, art = train_once(tmp_path, "s3", [
        "parallel.num_workers=1",
        f"checkpoint.resume_from=s3://conduit-ckpt/from/{first_kept.name}?{query}",
        f"checkpoint.storage=s3://conduit-ckpt/runs?{query}"], kill=False, data_root=smoke_artifact_root)
    # Continued at 40 (the first start, 0, is the 2-worker run's, carried by the checkpoint with its
    # history), so the history runs whole from the first logged step to the last.
    assert read_train_starts(art.path) == [0, STEPS - EVERY]
    assert [h["step"] for h in history] == list(range(10, STEPS + 1, 10))
    assert max((weights[k] - resumed[k]).abs().max().item() for k in weights) < 1e-5
    kept = read_train_precision(art.path)
    assert kept["precision"] == "fp32" and kept["auto"]["precision.auto"] == "checkpoint"
    assert kept["compile"] == read_train_precision(train_art.path)["compile"]
    written = [i.path for i in fs.get_file_info(pafs.FileSelector("conduit-ckpt/runs", recursive=True))]
    final = [p for p in written if p.endswith("/layout.json")]
    assert len(final) == 1 and f"{final[0].rsplit('/', 1)[0]}/canonical.pt" in written


def test_a_prune_that_fails_after_sealing_leaves_the_stage_done_with_a_warning(tmp_path, smoke_artifact_root, capsys):
    """The real train stage on one worker, two checkpoints (10, 20; both kept): once the first is registered, one of
    its files is made immutable (``chattr +i``: the tests run as root, whom permissions do not stop), so the
    stage's pruning after sealing (``keep_final_checkpoint``) fails on it for real. The stage is done, its
    artifact verifies, the driver is told, and both checkpoints stay."""
    overrides = ["parallel.num_workers=1", "train.steps=20", "checkpoint.every=10", "checkpoint.keep=2"]
    work = tmp_path / "prune"
    cfg = resolve(load_config(ROOT / "configs" / "smoke.yaml", [
        f"run.workdir={work}", f"run.artifact_root={smoke_artifact_root}", f"checkpoint.storage={work / 'checkpoints'}",
        *TRAIN, *overrides]))
    ray_dir = ray_run_dir(cfg, next(p.hash for p in make_plan(cfg) if p.stage == "train"))
    locked: list[Path] = []
    done = threading.Event()

    def lock_the_first_checkpoint() -> None:
        while not done.is_set():
            if 10 in registered_steps(ray_dir):
                target = ray_dir / "checkpoint_000000010" / "canonical.pt"
                subprocess.run(["chattr", "+i", str(target)], check=True)
                locked.append(target)
                return
            time.sleep(0.02)

    locker = threading.Thread(target=lock_the_first_checkpoint)
    locker.start()
    try:
        _, history, _, art = train_once(tmp_path, "prune", overrides, kill=False, data_root=smoke_artifact_root)
    finally:
        done.set()
        locker.join()
        for path in locked:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    assert locked, "the first checkpoint was never registered"
    assert history[-1]["step"] == 20
    assert store_for(cfg.artifact_root()).check(art) is None  # sealed and whole
    out = capsys.readouterr().out
    assert f"warning: stage train ({art.hash}) is done, but cleaning up its resumable state failed: " in out, out[-3000:]
    assert "Operation not permitted" in out or "PermissionError" in out, out[-3000:]
    assert len([p for p in ray_dir.glob("checkpoint_*") if p.is_dir()]) == 2  # nothing pruned, nothing lost


def test_a_recorded_checkpoint_that_is_gone_gives_way_to_the_one_before(tmp_path, straight, smoke_artifact_root):
    """The record is written whole (renamed in, or an object store's put), so a kill never leaves it cut; but
    the checkpoint it names newest may be gone or damaged (a disk, a person). The uninterrupted run's kept
    checkpoints (40 and 60, ``checkpoint.keep`` 2) copied without the newest folder: the stage resumes from
    step 40, the newest that verifies, and ends with the uninterrupted run's weights (the warning rank 0 prints
    then: tests/pipeline/training/test_resume_choice.py)."""
    import shutil

    weights, _, _, straight_art = straight
    storage = tmp_path / "storage"
    source = artifact_run_dir(straight_art)
    copy = storage / source.name
    shutil.copytree(source, copy)
    assert registered_steps(copy) == [STEPS - EVERY, STEPS]
    shutil.rmtree(copy / "checkpoint_000000060")
    resumed, history, _, art = train_once(tmp_path, "gone", [f"checkpoint.storage={storage}"], kill=False,
                                          data_root=smoke_artifact_root)
    assert art.hash == straight_art.hash
    assert read_train_starts(art.path) == [0, STEPS - EVERY]
    assert_same_weights(weights, resumed)

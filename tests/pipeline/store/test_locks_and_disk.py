"""Two drivers of one config, and a disk that is full or unwritable (docs/reliability.md, faults 7 and 8).

Locks are held by real processes (a second Python started here, SIGKILLed where the test says so);
the disk checks use real paths: a place even root cannot write (sysfs), a file size limit set with
``RLIMIT_FSIZE`` in a child process, and a stage whose estimate is larger than any disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.store import locks
from pipeline.store.artifacts import is_complete
from pipeline.config import load_config
from pipeline.preflight import DiskError, check_disk
from pipeline.runner import main_exit_code, make_plan, resolve, run_pipeline
from pipeline.stages import STAGES, Stage, in_order

ROOT = Path(__file__).resolve().parents[3]

HOLDER = textwrap.dedent("""
    import sys, time
    from pipeline.store import locks
    root, release_after = sys.argv[1], float(sys.argv[2])
    lock = locks.acquire(root, "train", "0123456789abcdef", run_id="run-of-the-holder")
    print("held", flush=True)
    time.sleep(release_after)
    lock.release()
    print("released", flush=True)
    time.sleep(600)
""")


def start_holder(root: str, release_after: float = 600.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, root, str(release_after)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def holder(tmp_path):
    procs: list[subprocess.Popen] = []

    def start(root: str, release_after: float = 600.0) -> subprocess.Popen:
        procs.append(start_holder(root, release_after))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_second_driver_is_told_who_holds_the_stage(tmp_path, holder):
    proc = holder(str(tmp_path))
    with pytest.raises(locks.StageLocked) as e:
        locks.acquire(str(tmp_path), "train", "0123456789abcdef")
    msg = str(e.value)
    assert f"pid {proc.pid} on " in msg and "run-of-the-holder" in msg
    assert str(tmp_path / "train" / ".0123456789abcdef.lock") in msg and "run.lock_wait_s" in msg
    assert main_exit_code(e.value) == 2  # jobs.run's exit status: something the user can fix (wait, or stop it)


def test_a_lock_left_by_a_killed_driver_is_taken_over(tmp_path, holder):
    proc = holder(str(tmp_path))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = locks.acquire(str(tmp_path), "train", "0123456789abcdef")
    assert lock.took_over is not None and lock.took_over["pid"] == proc.pid
    record = json.loads((tmp_path / "train" / ".0123456789abcdef.lock").read_text())
    assert record["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "train" / ".0123456789abcdef.lock").exists()
    # Released cleanly: the next holder takes over from nobody.
    again = locks.acquire(str(tmp_path), "train", "0123456789abcdef")
    assert again.took_over is None
    again.release()


def test_a_waiting_driver_gets_the_lock_when_the_holder_lets_go(tmp_path, holder):
    proc = holder(str(tmp_path), release_after=1.5)
    told: list[str] = []
    t0 = time.monotonic()
    lock = locks.acquire(str(tmp_path), "train", "0123456789abcdef", wait_s=60, on_wait=told.append)
    assert time.monotonic() - t0 < 30
    assert proc.stdout.readline().strip() == "released"
    assert lock.took_over is None
    assert len(told) == 1 and f"pid {proc.pid}" in told[0]
    lock.release()


def test_object_store_locks_name_the_holder_and_are_taken_over_from_a_dead_one(moto_s3, holder):
    import pyarrow.fs as pafs

    pafs.S3FileSystem(endpoint_override=moto_s3, scheme="http", allow_bucket_creation=True).create_dir("locks")
    root = f"s3://locks/artifacts?endpoint_override={moto_s3}&scheme=http"
    proc = holder(root)
    with pytest.raises(locks.StageLocked) as e:
        locks.acquire(root, "train", "0123456789abcdef")
    assert f"pid {proc.pid}" in str(e.value) and "s3://locks/artifacts/train/.0123456789abcdef.lock" in str(e.value)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = locks.acquire(root, "train", "0123456789abcdef")
    assert lock.took_over["pid"] == proc.pid
    lock.release()
    assert locks.acquire(root, "train", "0123456789abcdef").took_over is None


# Two drivers of one config through the runner: toy stages a -> b -> c; b blocks until told to go.

def toy_hash(cfg):
    return {"seed": cfg.run.seed}


def toy_run(name):
    def run(cfg, inputs, out_dir, tracker):
        if name == "b":
            (cfg.workdir() / "b_started").touch()  # its folder exists from here on
            deadline = time.monotonic() + 120
            while not (cfg.workdir() / "go_b").exists():
                assert time.monotonic() < deadline, "the test never let b go"
                time.sleep(0.1)
        with open(cfg.workdir() / "ran.log", "a", encoding="utf-8") as log:
            log.write(name + "\n")
        (out_dir / "out.txt").write_text(name)
        return {}
    return run


TOY = in_order([Stage(name=n, version=1, inputs=i, hash_config=toy_hash, run=toy_run(n))
                for n, i in (("a", ()), ("b", ("a",)), ("c", ("b",)))])


def test_a_second_driver_stops_or_waits_and_then_uses_what_the_first_built(tmp_path, ray_cluster):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [f"run.workdir={tmp_path / 'work'}", f"tracking.uri={uri}", "tracking.experiment=toy"])
    work = cfg.workdir()
    first_lines: list[str] = []
    first = threading.Thread(target=run_pipeline, args=(cfg,), kwargs={"stages": TOY, "echo": first_lines.append})
    first.start()
    deadline = time.monotonic() + 120
    # "b: running" is echoed before the Ray task starts and makes b's folder: wait for the task itself.
    while not (work / "b_started").exists():
        assert time.monotonic() < deadline and first.is_alive(), first_lines
        time.sleep(0.1)

    with pytest.raises(locks.StageLocked, match=rf"pid {os.getpid()} on .* holds .*/b/\.[0-9a-f]{{16}}\.lock"):
        run_pipeline(cfg, stages=TOY, echo=lambda line: None)
    b_dir = {p.stage: p for p in make_plan(resolve(cfg), stages=TOY)}["b"].path
    assert b_dir.is_dir() and not is_complete(b_dir), "the second driver cleared the first one's folder"

    second_lines: list[str] = []
    threading.Timer(2.0, (work / "go_b").touch).start()
    waited = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, lock_wait_s=120.0))
    run_pipeline(waited, stages=TOY, echo=second_lines.append)
    first.join(timeout=120)
    assert (work / "ran.log").read_text().split() == ["a", "b", "c"]  # each stage ran once, by the first
    assert any(line.startswith("b: waiting for the lock") for line in second_lines), second_lines
    assert "b: cached" in " ".join(second_lines) and "c: cached" in " ".join(second_lines), second_lines
    assert not list(work.glob("artifacts/*/.*.lock")), "a released lock leaves no file"


# The disk.

def smoke_plan(tmp_path, *overrides):
    cfg = resolve(load_config(ROOT / "configs" / "smoke.yaml", [f"run.workdir={tmp_path}", *overrides]))
    return cfg, {p.stage: p for p in make_plan(cfg)}


def test_an_unwritable_artifact_root_is_named_before_the_stage_runs(tmp_path):
    # sysfs refuses new folders, to root too (CI and this machine run tests as root, which chmod does not stop).
    cfg, plan = smoke_plan(tmp_path, "run.artifact_root=/sys/conduit-artifacts")
    with pytest.raises(DiskError, match=r"stage shard cannot write to /sys/conduit-artifacts/shard"):
        check_disk(cfg, plan["shard"], STAGES["shard"], {})


# A folder root cannot create files in (sysfs): the tests run as root, whom chmod does not stop.
READ_ONLY = Path("/sys/kernel")


def test_an_unwritable_place_stops_the_runner_before_the_stage_and_keeps_what_is_done(tmp_path, ray_cluster):
    """Through the runner: stage b's folder in the artifact root, then its state folder (as train's
    checkpoint storage), cannot be written; each time b is refused before it runs, naming the place
    (exit 2), and a, finished, stays."""
    stateful = in_order([TOY["a"], dataclasses.replace(TOY["b"], disk_need=lambda cfg, inputs, h: [
        (f"{cfg.checkpoint.storage}/toy-{h}", 1 << 20, "toy checkpoints")]), TOY["c"]])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [f"run.workdir={tmp_path / 'work'}", f"tracking.uri={uri}", "tracking.experiment=toy"]
    cfg = load_config(None, [*common, f"checkpoint.storage={tmp_path / 'checkpoints'}"])
    plan = {p.stage: p for p in make_plan(resolve(cfg), stages=stateful)}
    b_folder = plan["b"].path.parent  # <artifact_root>/b: b's lock and artifact folder go there
    b_folder.parent.mkdir(parents=True)
    b_folder.symlink_to(READ_ONLY)
    lines: list[str] = []
    with pytest.raises(DiskError, match=rf"^stage b cannot write to {b_folder}: ") as e:
        run_pipeline(cfg, stages=stateful, echo=lines.append)
    assert main_exit_code(e.value) == 2
    assert [ln.split(" ")[:2] for ln in lines] == [["a:", "running"], ["a:", "done"]]

    b_folder.unlink()
    cfg = load_config(None, [*common, f"checkpoint.storage={READ_ONLY}/conduit-checkpoints"])
    lines = []
    with pytest.raises(DiskError, match=rf"^stage b cannot write to {READ_ONLY}/conduit-checkpoints: ") as e:
        run_pipeline(cfg, stages=stateful, echo=lines.append)
    assert main_exit_code(e.value) == 2
    assert lines == [f"a: cached ({plan['a'].hash})"]
    assert (cfg.workdir() / "ran.log").read_text().split() == ["a"]
    client = tracking.client(uri)
    runs = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert sorted(f"{r.data.tags.get('conduit.stage', 'parent')} {r.info.status}" for r in runs) == \
        ["a FINISHED", "parent FAILED", "parent FAILED"]  # b's run never started


def test_a_stage_bigger_than_the_free_disk_is_refused_with_the_numbers(tmp_path):
    # 64 layers of d_model 16384: about 2e11 parameters, whose checkpoints no test machine has room for.
    cfg, plan = smoke_plan(tmp_path, "model.d_model=16384", "model.n_heads=128", "model.num_kv_heads=128",
                           "model.n_layers=64", "model.d_ff=65536")
    inputs = {}  # train's estimate needs no upstream artifact
    with pytest.raises(DiskError) as e:
        check_disk(cfg, plan["train"], STAGES["train"], inputs)
    msg = str(e.value)
    storage = f"{cfg.artifact_root()}/checkpoints/train-{plan['train'].hash}"
    assert "stage train needs about" in msg and "GiB free" in msg
    assert f"at {Path(storage).parent} for 3 checkpoints" in msg  # the run's folder does not exist yet: its parent
    assert "3 checkpoints x 28 B x" in msg  # keep_checkpoints=2, plus the one being written
    # The smoke model itself fits.
    cfg, plan = smoke_plan(tmp_path)
    check_disk(cfg, plan["train"], STAGES["train"], {})


def test_a_stage_that_does_not_fit_fails_before_running_and_keeps_what_is_done(tmp_path, ray_cluster):
    huge = in_order([TOY["a"], dataclasses.replace(TOY["b"], disk_need=lambda cfg, i, h: [(None, 2**62, "toy output")]),
                     TOY["c"]])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [f"run.workdir={tmp_path / 'work'}", f"tracking.uri={uri}", "tracking.experiment=toy"])
    with pytest.raises(DiskError, match=r"stage b needs about [0-9.]+ GiB of free disk \(.* for toy output"):
        run_pipeline(cfg, stages=huge, echo=lambda line: None)
    assert (cfg.workdir() / "ran.log").read_text().split() == ["a"]
    plan = {p.stage: p for p in make_plan(resolve(cfg), stages=huge)}
    assert plan["a"].cached and not plan["b"].cached
    client = tracking.client(uri)
    parents = [r for r in client.search_runs([client.get_experiment_by_name("toy").experiment_id])
               if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.status for r in parents] == ["FAILED"]


WRITE_LIMITED = textwrap.dedent("""
    import resource, signal, sys
    from pipeline.config import load_config
    from pipeline.runner import make_plan, resolve
    from pipeline.stages import STAGES
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    cfg = resolve(load_config("configs/smoke.yaml", [f"run.workdir={sys.argv[1]}"]))
    item = make_plan(cfg)[0]
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    try:
        STAGES["shard"].execute(cfg, item.hash, item.path, {}, None)
    except OSError as e:
        print("ERROR", e)
        print("FOLDER", item.path)
""")


def test_a_write_that_fails_mid_stage_names_the_folder_and_leaves_no_manifest(tmp_path):
    out = subprocess.run([sys.executable, "-c", WRITE_LIMITED, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("ERROR", "FOLDER")))
    assert "ERROR" in lines, out.stdout + out.stderr
    folder = Path(lines["FOLDER"])
    assert "File too large" in lines["ERROR"] and f"while stage shard wrote into {folder}" in lines["ERROR"]
    assert folder.is_dir() and not is_complete(folder)


def test_disk_estimates_read_upstream_manifests_not_their_files(tmp_path):
    """On an object-store root the driver has manifests but no copy of the files: the estimates of the
    stages that read upstream artifacts use only what the manifests record."""
    from pipeline.store.artifacts import Artifact

    cfg, plan = smoke_plan(tmp_path)
    gone = tmp_path / "not-on-this-node"
    shard = Artifact("shard", "1" * 16, gone, {"counts": {"documents": {"train": 3, "validation": 1},
                                                          "bytes": {"train": 1000, "validation": 24}}})
    train = Artifact("train", "2" * 16, gone, {"files": {"model.safetensors": {"bytes": 4321, "sha256": "0" * 64}}})
    assert [n for _, n, _ in STAGES["tokenize"].disk_need(cfg, {"shard": shard}, plan["tokenize"].hash)] == [4096]
    assert [n for _, n, _ in STAGES["register"].disk_need(cfg, {"train": train}, plan["register"].hash)] == [4321]

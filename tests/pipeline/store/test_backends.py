"""The storage seam against an S3 server (moto): an object-store artifact root caches, seals (manifest
last), verifies and fetches (once per node) as a local root does, and the runner drives it with toy
stages whose bodies only ever see local folders, through the store's faults: an upload cut off, a node
that lost its scratch folder, a store that does not answer."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from pipeline.store import backends
from pipeline.store.artifacts import MANIFEST
from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.runner import StageFailed, main_exit_code, make_plan, resolve, run_pipeline
from pipeline.stages import Stage, in_order
from pipeline.stages.train import checkpoint_place
from pipeline.store.backends import LocalStore, NodeFolder, ObjectStore, StorageError, join, store_for

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def bucket(moto_s3):
    """A fresh bucket on the session's S3 server: ``(pyarrow S3FileSystem, root URI)``."""
    name = f"conduit-{uuid.uuid4().hex[:10]}"
    fs = pafs.S3FileSystem(endpoint_override=moto_s3, scheme="http", allow_bucket_creation=True)
    fs.create_dir(name)
    return fs, f"s3://{name}/art?endpoint_override={moto_s3}&scheme=http"


def body_writes(cfg, inputs, out_dir: Path, tracker) -> dict:
    """A stage body: sees only local folders, writes two files (one in a subfolder)."""
    assert all(Path(a.path).is_dir() for a in inputs.values())
    upstream = "".join((a.path / "out.txt").read_text() for a in inputs.values())
    (out_dir / "out.txt").write_text(upstream + "x" * 1000)
    (out_dir / "sub").mkdir()
    (out_dir / "sub" / "blob.bin").write_bytes(bytes(range(256)) * 100)
    return {"chars": len(upstream) + 1000}


ONE = Stage(name="one", version=1, inputs=(), hash_config=lambda cfg: {"seed": cfg.run.seed}, run=body_writes)


def test_a_stage_task_fetches_its_inputs_but_those_it_reads_in_place(bucket, tmp_path, monkeypatch):
    """The runner's stage task brings each input to its node, except what the stage reads where it
    lives (train's token shards: ranged reads by each worker), which keeps its URI and no local copy."""
    from pipeline.runner import _stage_task

    _, root = bucket
    sealed_in(ObjectStore(root, scratch=tmp_path / "node-a"), tmp_path)
    upstream = ObjectStore(root, scratch=tmp_path / "node-b").load("one", "h1")  # as the driver hands it over
    seen = {}

    class Tags:
        def set_tags(self, tags):
            pass

    def body(cfg, inputs, out_dir, tracker):
        seen.update({k: (a.uri, Path(a.path).exists()) for k, a in inputs.items()})
        (out_dir / "out.txt").write_text("y")
        return {}

    cfg = load_config(None, [f"run.artifact_root={root}", f"run.workdir={tmp_path}"])
    monkeypatch.setenv(backends.SCRATCH_ENV, str(tmp_path / "node-b"))
    for name, in_place in (("reads", ("one",)), ("fetches", ())):
        stage = Stage(name=name, version=1, inputs=("one",), hash_config=lambda cfg: {}, run=body,
                      read_in_place=in_place)
        _stage_task(stage, cfg.to_dict(), "h", {"one": upstream}, tracker=Tags())
        assert seen["one"][0] == upstream.uri
        assert seen["one"][1] == (not in_place), name  # fetched into node-b's cache, or not at all
        assert (tmp_path / "node-b" / "cache" / "one").exists() == (not in_place)
        assert ObjectStore(root).is_complete(name, "h")


def sealed_in(store, tmp_path: Path, hash_: str = "h1"):
    cfg = RunConfig()
    return store.publish(ONE.execute(cfg, hash_, store.prepare_build("one", hash_), {}, tracker=None))


def test_join_keeps_the_query_last_and_paths_stay_paths():
    assert join("s3://b/x?scheme=http&endpoint_override=h:1", "train", "ab") == \
        "s3://b/x/train/ab?scheme=http&endpoint_override=h:1"
    assert join("gs://b/", "checkpoints") == "gs://b/checkpoints"
    assert join("/data/art", "checkpoints") == "/data/art/checkpoints"
    assert isinstance(store_for("/data/art"), LocalStore) and isinstance(store_for("s3://b/x"), ObjectStore)


@pytest.mark.parametrize("field", ["run.artifact_root", "checkpoint.storage", "checkpoint.resume_from"])
def test_credentials_in_a_storage_uri_are_refused(tmp_path, field):
    with pytest.raises(ConfigError, match=rf"{field} has credentials in its URI"):
        load_config(None, [f"run.workdir={tmp_path}", f"{field}=s3://AKIA:secret@bucket/x"])


def test_checkpoints_default_under_a_uri_root_keyed_by_the_train_hash(tmp_path):
    cfg = resolve(load_config(None, [f"run.workdir={tmp_path}", "run.artifact_root=s3://b/art?scheme=http"]))
    place = checkpoint_place(cfg, "abc")
    assert (place.storage, place.name) == ("s3://b/art/checkpoints?scheme=http", "train-abc")


def test_publish_uploads_every_file_then_the_manifest_last(bucket, tmp_path, monkeypatch):
    fs, root = bucket
    finished: list[str] = []  # in the order the uploads complete
    real = backends._copy_out

    def slow_copy_out(src, f, dst):
        if not dst.endswith(MANIFEST):
            time.sleep(0.2)  # files take a while: a manifest sent while one is still in flight lands first
        n = real(src, f, dst)
        finished.append(dst.rsplit("/", 1)[-1])
        return n

    monkeypatch.setattr(backends, "_copy_out", slow_copy_out)
    store = ObjectStore(root, scratch=tmp_path / "node-a")
    art = sealed_in(store, tmp_path)
    assert sorted(finished[:-1]) == ["blob.bin", "out.txt"] and finished[-1] == MANIFEST  # every file done, then it
    assert art.uri == join(root, "one", "h1") and art.path == tmp_path / "node-a" / "cache" / "one" / "h1"
    assert not (tmp_path / "node-a" / "build" / "one" / "h1").exists()  # moved into the node's cache
    assert store.is_complete("one", "h1") and not store.is_complete("one", "h2")
    manifest_bytes = len(fs.open_input_file(f"{root.split('//')[1].split('?')[0]}/one/h1/{MANIFEST}").read())
    assert store.transfer.uploaded_bytes == 1000 + 25600 + manifest_bytes
    loaded = store.load("one", "h1")
    assert loaded.manifest == art.manifest and store.check(loaded) is None


def test_fetch_verifies_and_happens_once_per_node(bucket, tmp_path):
    _, root = bucket
    art = sealed_in(ObjectStore(root, scratch=tmp_path / "node-a"), tmp_path)
    node_b = ObjectStore(root, scratch=tmp_path / "node-b")
    driver_view = node_b.load("one", "h1")
    # Four "workers" of node b fetch at once: one downloads, the others wait for it and reuse it.
    stores = [ObjectStore(root, scratch=tmp_path / "node-b") for _ in range(4)]
    threads = [threading.Thread(target=s.fetch, args=(driver_view,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(s.transfer.fetched_bytes for s in stores) == 1000 + 25600
    local = node_b.fetch(driver_view)
    assert node_b.transfer.fetched_bytes == 0
    assert (local.path / "sub" / "blob.bin").read_bytes() == bytes(range(256)) * 100
    assert json.loads((local.path / MANIFEST).read_text()) == art.manifest
    # A copy of another build of the same hash (a --force elsewhere) is not trusted: fetched again.
    other = {**driver_view.manifest, "files": {**driver_view.manifest["files"]}}
    other["files"]["out.txt"] = {**other["files"]["out.txt"], "sha256": "0" * 64}
    with pytest.raises(StorageError, match=r"one/h1/out.txt.* does not match its manifest.*--force one"):
        node_b.fetch(type(driver_view)(**{**driver_view.__dict__, "manifest": other}))


def test_damage_in_the_store_is_found(bucket, tmp_path):
    fs, root = bucket
    sealed_in(ObjectStore(root, scratch=tmp_path / "node-a"), tmp_path)
    path = root.split("//", 1)[1].split("?")[0] + "/one/h1"
    store = ObjectStore(root, scratch=tmp_path / "node-c")
    with fs.open_output_stream(f"{path}/out.txt") as f:
        f.write(b"y" * 1000)  # same size, other bytes: found when a node fetches it
    art = store.load("one", "h1")
    assert store.check(art) is None
    with pytest.raises(StorageError, match="does not match its manifest"):
        store.fetch(art)
    assert not (tmp_path / "node-c" / "cache" / "one" / "h1").exists()  # nothing half-fetched is kept
    with fs.open_output_stream(f"{path}/sub/blob.bin") as f:
        f.write(b"short")
    assert store.check(art) == f"{join(root, 'one', 'h1', 'sub/blob.bin')} has 5 bytes, the manifest says 25600"
    fs.delete_file(f"{path}/out.txt")
    assert store.check(art) == f"{join(root, 'one', 'h1', 'out.txt')} is missing"


HOLDER = """
import sys, time
from pipeline.store.backends import ObjectStore
root, scratch, hash_ = sys.argv[1:4]
store = ObjectStore(root, scratch=__import__("pathlib").Path(scratch), cache_limit=None)
store.fetch(store.load("one", hash_))
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_the_node_cache_stays_under_its_bound_least_recently_used_first_never_what_is_held(bucket, tmp_path,
                                                                                             monkeypatch):
    _, root = bucket
    writer = ObjectStore(root, scratch=tmp_path / "node-a", cache_limit=None)
    for i in range(4):
        sealed_in(writer, tmp_path, f"h{i}")
    backends.release_held()
    size = 1000 + 25600  # one artifact's files
    node_b = tmp_path / "node-b"
    store = ObjectStore(root, scratch=node_b, cache_limit=int(2.5 * size))  # room for two
    cached = lambda: sorted(p.name for p in (node_b / "cache" / "one").iterdir() if not p.name.startswith("."))  # noqa: E731

    def fetch(hash_: str) -> None:
        time.sleep(0.02)  # distinct use times
        store.fetch(store.load("one", hash_))

    # Another process of node b (a training worker) fetches h0 and holds it.
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, root, str(node_b), "h0"], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        fetch("h1")
        backends.release_held()
        assert cached() == ["h0", "h1"]  # 2 x size: under the bound
        fetch("h2")
        backends.release_held()
        assert cached() == ["h0", "h2"]  # h0 is the oldest, but held: h1 went
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    fetch("h3")  # h0 is free now, and the oldest; h3 is held by this process until released
    assert cached() == ["h2", "h3"]
    fetch("h2")  # a cache hit is a use: h3 is now the older of the two
    backends.release_held()
    fetch("h1")
    assert cached() == ["h1", "h2"] and store.transfer.fetched_bytes == 4 * size  # h1, h2, h3, then h1 again
    backends.release_held()

    # A copy being fetched (its node lock held) is not removed either.
    with backends._node_lock(node_b / "cache" / "one" / "h1"):
        assert backends.evict_cache(node_b / "cache", 0) == [node_b / "cache" / "one" / "h2"]
    assert cached() == ["h1"]

    monkeypatch.setenv(backends.CACHE_LIMIT_ENV, "lots")
    with pytest.raises(StorageError, match=r"\$CONDUIT_SCRATCH_CACHE_GB='lots' must be a number of GB >= 0"):
        backends.cache_limit_bytes()
    monkeypatch.setenv(backends.CACHE_LIMIT_ENV, "0")
    assert backends.cache_limit_bytes() is None
    monkeypatch.delenv(backends.CACHE_LIMIT_ENV)
    assert backends.cache_limit_bytes() == 20 * 10**9


def test_node_folder_without_ray_is_a_local_folder(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.txt").write_text("hi")
    NodeFolder(str(tmp_path / "dst"), node_id=None).put(src)
    assert (tmp_path / "dst" / "d" / "f.txt").read_text() == "hi"


# ---- the runner on an object-store root ---------------------------------------------------------------
def counted(name: str):
    def run(cfg, inputs, out_dir, tracker):
        with open(cfg.workdir() / "ran.log", "a", encoding="utf-8") as log:
            log.write(name + "\n")
        return body_writes(cfg, inputs, out_dir, tracker)
    return run


TOY = in_order([
    Stage(name="a", version=1, inputs=(), hash_config=lambda cfg: {"seed": cfg.run.seed}, run=counted("a")),
    Stage(name="b", version=1, inputs=("a",), hash_config=lambda cfg: {}, run=counted("b")),
])


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """One sqlite MLflow store for the runner tests of this module (a new one runs MLflow's migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def toy_config(tmp_path: Path, root: str, mlflow_uri: str, experiment: str):
    work = tmp_path / "work"
    work.mkdir()
    return load_config(None, [f"run.workdir={work}", f"run.artifact_root={root}", f"tracking.uri={mlflow_uri}",
                              f"tracking.experiment={experiment}"])


def stored_files(fs, root: str) -> dict[str, int]:
    """Every object under the root URI: ``path below it -> bytes``."""
    base = root.split("//", 1)[1].split("?")[0]
    return {i.path[len(base) + 1:]: i.size for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))
            if i.type == pafs.FileType.File}


def test_the_runner_caches_on_an_object_store_like_on_a_local_root(bucket, tmp_path, ray_cluster, monkeypatch,
                                                                   mlflow_uri):
    fs, root = bucket
    cfg = toy_config(tmp_path, root, mlflow_uri, "s3toy")
    work = cfg.workdir()
    # The stage tasks' scratch is the session Ray's (its workers' environment); this is the driver's.
    monkeypatch.setenv(backends.SCRATCH_ENV, str(tmp_path / "scratch-1"))
    lines: list[str] = []
    first = run_pipeline(cfg, stages=TOY, echo=lines.append)
    assert (work / "ran.log").read_text().split() == ["a", "b"]
    assert [ln.split(" ")[1] for ln in lines] == ["running", "done", "running", "done"]
    assert "fetched 0.0 MB" in lines[3] and "uploaded 0.0 MB" in lines[3], lines
    assert first.transfers["b"].fetched_bytes == 0  # a was published on this node: its cache had it
    assert first.transfers["b"].uploaded_bytes > 26000
    bucket_path = root.split("//", 1)[1].split("?")[0]
    listed = {i.path[len(bucket_path) + 1:] for i in fs.get_file_info(pafs.FileSelector(bucket_path, recursive=True))
              if i.type == pafs.FileType.File}
    assert listed == {f"{s}/{first.artifacts[s].hash}/{f}" for s in "ab" for f in ("out.txt", "sub/blob.bin", MANIFEST)}

    # Another driver, on a fresh scratch folder: everything is cached, from the store alone.
    monkeypatch.setenv(backends.SCRATCH_ENV, str(tmp_path / "scratch-2"))
    plan = make_plan(resolve(cfg), stages=TOY)
    assert [(p.cached, p.run) for p in plan] == [(True, False), (True, False)]
    assert plan[0].path == join(root, "a", plan[0].hash)
    lines.clear()
    again = run_pipeline(cfg, stages=TOY, echo=lines.append)
    assert lines == [f"a: cached ({plan[0].hash})", f"b: cached ({plan[1].hash})"]
    assert again.artifacts["b"].manifest == first.artifacts["b"].manifest

    # A damaged file in the store: the stage is rebuilt (and uploaded again), like a local root's.
    with fs.open_output_stream(f"{bucket_path}/a/{plan[0].hash}/out.txt") as f:
        f.write(b"short")
    lines.clear()
    run_pipeline(cfg, stages=TOY, echo=lines.append)
    assert lines[0].startswith(f"a: the cached artifact is damaged ({join(root, 'a', plan[0].hash, 'out.txt')} has 5")
    assert (work / "ran.log").read_text().split() == ["a", "b", "a"]
    assert store_for(root).check(store_for(root).load("a", plan[0].hash)) is None


def a_whose_upload_is_cut_off(cfg, inputs, out_dir, tracker):
    """Stage a's body. While ``cut_upload`` is in the workdir, its upload dies part-way (in the stage
    task's process, where ``publish`` runs): ``sub/blob.bin``'s stream breaks after 1000 of its bytes,
    which the store keeps, as a connection that drops mid-file leaves them. That attempt also writes a
    file the next one does not, to show what clearing leaves."""
    out = counted("a")(cfg, inputs, out_dir, tracker)
    if not (cfg.workdir() / "cut_upload").exists():
        return out
    (out_dir / "only-in-the-cut-attempt.txt").write_text("stale")
    real = backends._copy_out

    def copy_out(src, fs, dst):
        if src.name != "blob.bin":
            return real(src, fs, dst)
        backends._copy_out = real  # cut once: this worker process uploads normally from here on
        with fs.open_output_stream(dst) as stream:
            stream.write(src.read_bytes()[:1000])
        raise ConnectionResetError(f"the connection dropped while uploading {dst} (injected)")

    backends._copy_out = copy_out
    return out


CUT = in_order([dataclasses.replace(TOY["a"], run=a_whose_upload_is_cut_off)])


def test_an_upload_cut_off_leaves_no_manifest_and_the_next_run_redoes_the_stage(bucket, tmp_path, ray_cluster,
                                                                              mlflow_uri):
    fs, root = bucket
    cfg = toy_config(tmp_path, root, mlflow_uri, "s3cut")
    (cfg.workdir() / "cut_upload").touch()
    with pytest.raises(StageFailed, match=r"stage a failed: ConnectionResetError\('the connection dropped"):
        run_pipeline(cfg, stages=CUT, echo=lambda line: None)
    a = make_plan(resolve(cfg), stages=CUT)[0]
    assert not a.cached
    assert stored_files(fs, root) == {f"a/{a.hash}/only-in-the-cut-attempt.txt": 5, f"a/{a.hash}/out.txt": 1000,
                                      f"a/{a.hash}/sub/blob.bin": 1000}  # what got through, and no manifest

    (cfg.workdir() / "cut_upload").unlink()
    lines: list[str] = []
    done = run_pipeline(cfg, stages=CUT, echo=lines.append)
    assert lines[0] == f"a: running ({a.hash})"
    assert (cfg.workdir() / "ran.log").read_text().split() == ["a", "a"]
    stored = stored_files(fs, root)
    assert set(done.artifacts["a"].manifest["files"]) == {"out.txt", "sub/blob.bin"}
    assert stored == {f"a/{a.hash}/out.txt": 1000, f"a/{a.hash}/sub/blob.bin": 25600,  # the leftover is gone
                      f"a/{a.hash}/{MANIFEST}": stored[f"a/{a.hash}/{MANIFEST}"]}


def test_a_node_that_lost_its_scratch_folder_fetches_the_inputs_again(bucket, tmp_path, ray_cluster, mlflow_uri):
    _, root = bucket
    cfg = toy_config(tmp_path, root, mlflow_uri, "s3scratch")
    first = run_pipeline(cfg, stages=TOY, until="a", echo=lambda line: None)
    # The folder of the node's stage tasks (the session Ray's workers have their own environment): a's
    # task left its copy there, which b's task on this node would read without a download.
    scratch = ray_cluster.get(ray_cluster.remote(backends.scratch_root).remote())
    a_copy = scratch / "cache" / "a" / first.artifacts["a"].hash
    assert (a_copy / "out.txt").is_file()
    shutil.rmtree(scratch)

    lines: list[str] = []
    then = run_pipeline(cfg, stages=TOY, echo=lines.append)
    assert lines[0] == f"a: cached ({first.artifacts['a'].hash})" and lines[1].startswith("b: running")
    assert then.transfers["b"].fetched_bytes == 1000 + 25600  # a's files, from the store
    assert (a_copy / "out.txt").is_file() and json.loads((a_copy / MANIFEST).read_text()) == first.artifacts["a"].manifest
    b_copy = scratch / "cache" / "b" / then.artifacts["b"].hash
    assert (b_copy / "out.txt").read_text() == "x" * 2000  # b read a's whole out.txt


def test_a_store_that_does_not_answer_stops_the_run_before_any_stage(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = f"s3://conduit/art?endpoint_override=127.0.0.1:{port}&scheme=http"
    cfg = load_config(None, [f"run.workdir={tmp_path}", f"run.artifact_root={root}",
                             f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    lines: list[str] = []
    with pytest.raises(StorageError, match=rf"^run\.artifact_root='{re.escape(root)}': the store did not answer") as e:
        run_pipeline(cfg, stages=TOY, echo=lines.append)
    assert main_exit_code(e.value) == 2
    printed = capsys.readouterr().err
    assert printed.startswith("error: run.artifact_root=") and printed.count("\n") == 1, printed
    assert lines == [] and not (tmp_path / "mlflow.db").exists()  # planning failed: no stage, no MLflow run


class NullTracker:
    def log_metrics(self, m, step=None):
        pass


@pytest.mark.slow
def test_ray_tokenize_reads_the_shards_and_the_model_from_the_store(bucket, tmp_path, data_root, ray_cluster):
    """The tokenize tasks may run on any node: on an object-store root they read the shard files from
    the store and the model from their own node's copy, and pack what the in-process engine packs."""
    from pipeline.stages import STAGES
    from pipeline.store.backends import cluster_readable

    _, root = bucket
    common = [f"run.workdir={tmp_path}", f"run.artifact_root={root}", f"data.data_root={data_root}",
              "data.max_documents=400", "tokenize.seq_len=32", "tokenize.num_actors=1"]
    cfg = resolve(load_config(None, [*common, "tokenize.engine=ray"]))
    plan = {p.stage: p for p in make_plan(cfg)}
    task_node = ObjectStore(root, scratch=tmp_path / "task-node")
    arts = {}
    for name in ("shard", "tokenizer"):
        built = STAGES[name].execute(cfg, plan[name].hash, task_node.prepare_build(name, plan[name].hash), arts,
                                     NullTracker())
        arts[name] = task_node.publish(built)
    paths, fs = cluster_readable(arts["shard"], sorted(arts["shard"].path.glob("*.parquet")))
    assert fs is not None and all(p.startswith(root.split("//")[1].split("?")[0] + "/shard/") for p in paths)

    h = plan["tokenize"].hash
    on_ray = STAGES["tokenize"].execute(cfg, h, tmp_path / "ray" / h, arts, NullTracker())
    local_cfg = resolve(load_config(None, [*common, "tokenize.engine=local"]))
    local = STAGES["tokenize"].execute(local_cfg, h, tmp_path / "local" / h, arts, NullTracker())
    assert on_ray.manifest["counts"]["engine"] == "ray" and local.manifest["counts"]["engine"] == "local"
    assert on_ray.manifest["files"] == local.manifest["files"]  # names, sizes and sha256 of every file
    # The actor's node (the session Ray's workers: their own scratch) fetched the model for itself.
    worker_scratch = backends.scratch_root()  # the workers inherited this process's environment
    assert (worker_scratch / "cache" / "tokenizer" / plan["tokenizer"].hash / "tokenizer.model").is_file()

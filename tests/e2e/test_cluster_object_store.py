"""A Ray cluster of two nodes that share no filesystem, only a bucket on an S3 server (moto).

The head (one CPU) and a second ``ray start`` (two CPUs and the ``conduit_stages`` resource) each have
their own scratch folder (``CONDUIT_SCRATCH_DIR`` of the node's processes). The smoke pipeline, with
fewer steps, runs with ``run.artifact_root`` in the bucket: every stage task on the second node
(``cluster.stage_resources``), the two training workers one per node (``STRICT_SPREAD``), so the
head's worker reads its token blocks from the bucket (ranged reads, nothing fetched to the head) and
rank 0's outputs may have to cross nodes. Every artifact and the kept checkpoint end up in the bucket; a second driver on a fresh
scratch folder then finds every stage cached. MLflow is a server whose artifacts, the registered model
among them, go to the same bucket (``--artifacts-destination``, proxied): the nodes need no keys for
it. (That a local artifact root or a sqlite MLflow store is refused on a cluster of several nodes is
checked without one, in test_runner.py.)

The drivers are subprocesses (``python -m jobs.run``): the pytest process keeps the session's own Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pyarrow.fs as pafs
import pytest

from pipeline.runner import ORDER
from pipeline.store.backends import SCRATCH_ENV
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow

# The smoke config, shortened: what is tested is where bytes go, not what the model learns.
SHORT = ["train.steps=4", "optimizer.warmup_steps=1", "checkpoint.every=2", "train.log_every=2",
         "train.progress_bar=false", "eval.max_batches=2", "eval.max_text_tokens=256",
         "eval.lambada_max_examples=8", "eval.max_new_tokens=4", "eval.prompts=[Hi]", "register.hf_export=false"]


# A task on the head puts a folder into a NodeFolder on node2: the branch that carries rank 0's
# outputs to the train stage's node when Ray Train puts rank 0 elsewhere (which it may or may not do
# in the pipeline run above).
PUT_ACROSS_NODES = """
import pathlib, sys, tempfile
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from pipeline.store.backends import NodeFolder
ray.init(address=sys.argv[1], log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
node2 = next(n["NodeID"] for n in alive if n["Resources"].get("conduit_stages"))
head = next(n["NodeID"] for n in alive if n["NodeID"] != node2)

@ray.remote(num_cpus=0)
def put_from_here(folder):
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "sub").mkdir()
        (pathlib.Path(tmp) / "sub" / "w.bin").write_bytes(b"weights")
        folder.put(tmp)
    return ray.get_runtime_context().get_node_id()

ran_on = ray.get(put_from_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))
                 .remote(NodeFolder(sys.argv[2], node2)))
assert ran_on == head != node2
print("put across nodes")
"""


@pytest.fixture
def bucket(moto_s3):
    """A fresh bucket on the session's S3 server: ``(its name, pyarrow S3FileSystem)``."""
    name = f"conduit-{uuid.uuid4().hex[:8]}"
    fs = pafs.S3FileSystem(endpoint_override=moto_s3, scheme="http", allow_bucket_creation=True)
    fs.create_dir(name)
    return name, fs


class ArtifactProxyServer:
    """``mlflow server`` whose artifacts (registered models included) go, proxied, to ``<bucket>/mlflow``,
    as ``infra/local/up --artifacts-destination`` starts it. Started before the Ray nodes, so that its
    ~18 s of start-up overlaps theirs; ``wait_healthy`` then waits for ``/health``. Its port is chosen
    free but taken only when the server binds it, seconds later: if something else (a Ray process of
    the nodes starting meanwhile) took it first, the server starts again on another one."""

    def __init__(self, tmp_path: Path, bucket: str, moto_s3: str) -> None:
        self.tmp_path, self.bucket, self.moto_s3 = tmp_path, bucket, moto_s3
        self.log = tmp_path / "mlflow-server.log"
        self.start()

    def start(self) -> None:
        self.port = free_port()
        env = {**os.environ, "MLFLOW_S3_ENDPOINT_URL": f"http://{self.moto_s3}"}
        cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.tmp_path / 'mlflow-server.db'}",
               "--artifacts-destination", f"s3://{self.bucket}/mlflow", "--host", "127.0.0.1", "--port",
               str(self.port), "--workers", "1"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp_path,
                                         start_new_session=True)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 240, restarts: int = 2) -> str:
        """The server's URI once ``/health`` answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text()
                if "address already in use" in text and restarts > 0:
                    restarts -= 1
                    self.start()
                    continue
                raise AssertionError(f"mlflow server exited:\n{text[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.uri
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            time.sleep(0.5)
        raise AssertionError(f"mlflow server did not answer in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it may have ended on its own
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def mlflow_server(tmp_path, bucket, moto_s3):
    server = ArtifactProxyServer(tmp_path, bucket[0], moto_s3)
    try:
        yield server
    finally:
        server.stop()


def node_processes(temp_dir: Path) -> list[psutil.Process]:
    """The Ray processes of this test's cluster: those whose command line names its temp dir."""
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        if str(temp_dir) in " ".join(p.info["cmdline"] or []):
            procs.append(p)
    return procs


@pytest.fixture
def two_nodes(tmp_path):
    """``(gcs address, environment for drivers)`` of a head and a second node, each with its own scratch."""
    token = tmp_path / "ray_auth_token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    temp_dir = Path(tempfile.mkdtemp(prefix="conduit-2n-", dir="/tmp"))  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    gcs = free_port()
    common = ["--node-ip-address", "127.0.0.1", "--temp-dir", str(temp_dir), "--disable-usage-stats",
              "--dashboard-agent-listen-port", str(free_port())]
    nodes = {
        "head": ["--head", "--port", str(gcs), "--num-cpus", "1", "--include-dashboard", "false",
                 "--ray-client-server-port", str(free_port())],
        "node2": ["--address", f"127.0.0.1:{gcs}", "--num-cpus", "2", "--resources", '{"conduit_stages": 100}'],
    }
    try:
        for name, args in nodes.items():
            common[-1] = str(free_port())
            done = subprocess.run([str(BIN / "ray"), "start", *args, *common], cwd=ROOT, capture_output=True,
                                  text=True, timeout=120, start_new_session=True,
                                  env={**env, SCRATCH_ENV: str(tmp_path / f"scratch-{name}")})
            assert done.returncode == 0, f"ray start ({name}) failed:\n{done.stdout}\n{done.stderr}"
        yield f"127.0.0.1:{gcs}", env
    finally:
        procs = node_processes(temp_dir)  # nothing of this cluster outlives the test: no graceful stop needed
        for p in procs:
            p.kill()
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def drive(work: Path, env: dict, scratch: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={work}", *SHORT, *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**env, SCRATCH_ENV: str(scratch), "OMP_NUM_THREADS": "1"})


def test_a_two_node_cluster_with_only_an_object_store_in_common(tmp_path, bucket, mlflow_server, two_nodes, moto_s3):
    address, env = two_nodes
    bucket, fs = bucket
    tracking_uri = mlflow_server.wait_healthy()
    root = f"s3://{bucket}/art?endpoint_override={moto_s3}&scheme=http"
    work = tmp_path / "work"
    cluster = [f"run.artifact_root={root}", f"cluster.address={address}", "cluster.stage_resources=[conduit_stages]",
               "parallel.placement_strategy=STRICT_SPREAD", f"tracking.uri={tracking_uri}"]
    started = time.monotonic()
    first = drive(work, env, tmp_path / "scratch-driver-1", *cluster)
    assert first.returncode == 0, f"the pipeline failed:\n{first.stdout[-4000:]}\n{first.stderr[-6000:]}"
    lines = first.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines if ": done in" in ln] == ORDER, first.stdout
    hashes = {ln.split(":")[0]: ln.split("(")[1].split(";")[0].rstrip(")") for ln in lines if ": done in" in ln}

    # Everything is in the bucket: each artifact with its manifest, and the kept checkpoint.
    listed = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{bucket}/art", recursive=True))
              if i.type == pafs.FileType.File]
    for stage, h in hashes.items():
        manifest = json.loads(fs.open_input_stream(f"{bucket}/art/{stage}/{h}/manifest.json").read())
        assert {p for p in listed if p.startswith(f"{bucket}/art/{stage}/{h}/")} == \
            {f"{bucket}/art/{stage}/{h}/{f}" for f in [*manifest["files"], "manifest.json"]}
    run_dir = f"{bucket}/art/checkpoints/train-{hashes['train']}"
    checkpoints = {p.split("/")[4] for p in listed if p.startswith(f"{run_dir}/checkpoint_") and p.count("/") > 4}
    assert len(checkpoints) == 1, checkpoints  # sealed: only the final one is kept
    assert any(p.endswith("/layout.json") for p in listed)
    # The registered model went through the MLflow server into the bucket too.
    models = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{bucket}/mlflow", recursive=True))
              if i.type == pafs.FileType.File]
    assert any(p.endswith("/MLmodel") for p in models) and any(p.endswith("/model.safetensors") for p in models), models

    # Where the work happened: every stage task on node2 (its cache holds what it published), a
    # training worker on the head, which read its token blocks from the bucket in ranges: the head's
    # scratch has no copy of any artifact.
    node2_cache = tmp_path / "scratch-node2" / "cache"
    assert sorted(p.name for p in node2_cache.iterdir()) == sorted(ORDER)
    head_cache = tmp_path / "scratch-head" / "cache"
    assert not head_cache.exists() or list(head_cache.rglob("*.npy")) == [], list(head_cache.rglob("*"))
    assert not (tmp_path / "scratch-driver-1" / "cache").exists()  # the driver moves no artifact bytes

    # A driver on a fresh scratch folder finds every stage cached, from the bucket alone.
    second = drive(work, env, tmp_path / "scratch-driver-2", *cluster)
    assert second.returncode == 0, second.stderr[-4000:]
    assert [ln for ln in second.stdout.splitlines() if ln.split(":")[0] in ORDER] == \
        [f"{s}: cached ({hashes[s]})" for s in ORDER]

    out = tmp_path / "on-node2"
    put = subprocess.run([sys.executable, "-c", PUT_ACROSS_NODES, address, str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    assert put.returncode == 0, put.stderr[-3000:]
    assert (out / "sub" / "w.bin").read_bytes() == b"weights"
    print(f"two-node pipeline, its rerun and a put across nodes: {time.monotonic() - started:.0f} s")

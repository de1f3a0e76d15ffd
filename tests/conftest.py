"""Shared test fixtures: a new machine's HOME, one local Ray cluster per session, the shared data root."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# A new machine for every session: HOME and the XDG folders point into a fresh temporary directory
# before anything below imports Ray, MLflow, DeepSpeed or datasets, so nothing that an earlier run
# left under the real HOME (Ray's ~/.ray/auth_token, compiled ops in ~/.cache, caches and configs)
# can make a test pass. Test subprocesses, Ray clusters and Ray workers inherit it. DeepSpeed's ops
# are then compiled once per session (TORCH_EXTENSIONS_DIR under this HOME) unless the caller sets
# TORCH_EXTENSIONS_DIR itself to reuse a build.
REAL_HOME = os.environ.get("HOME", "")
TEST_HOME = Path(tempfile.mkdtemp(prefix="conduit-test-home-"))
os.environ.update(
    HOME=str(TEST_HOME),
    XDG_CACHE_HOME=str(TEST_HOME / ".cache"),
    XDG_CONFIG_HOME=str(TEST_HOME / ".config"),
    XDG_DATA_HOME=str(TEST_HOME / ".local" / "share"),
    XDG_STATE_HOME=str(TEST_HOME / ".local" / "state"),
    MPLCONFIGDIR=str(TEST_HOME / ".config" / "matplotlib"),
)
for _var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "CONDUIT_INFRA_ENV"):
    os.environ.pop(_var, None)  # a developer's cluster pointers and tokens never reach the tests

pytest_plugins = ["tests.profiling", "tests.smoke_run"]

from pipeline.config import DEFAULT_DATA_ROOT
from pipeline.runner import ray_runtime_env, worker_env
from tests.xdist_plan import GroupScheduling, plan

os.environ.update(worker_env())
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every MLflow server a test starts runs without MLflow's GenAI job runner, as infra/local/up's does
# (7 helper processes, each importing MLflow: seconds of CPU per start and a seventh of a core idle).
os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
# Credentials for the tests' S3 server (moto accepts any), set before Ray starts so that Ray Train
# workers inherit them too; real AWS settings in the environment are left as they are.
for _key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
    os.environ.setdefault(_key, "conduit-test")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


GROUPS_FILE = TEST_HOME / "xdist-groups.json"  # the controller's HOME: its workers write it, it reads it


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """The xdist controller tells each worker where to write the test groups (tests/xdist_plan.py)."""
    node.workerinput["conduit_groups_file"] = str(GROUPS_FILE)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") == "loadgroup":
        return GroupScheduling(config, log, GROUPS_FILE)
    return None


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker: the groups and order of tests/xdist_plan.py."""
    groups_file = getattr(config, "workerinput", {}).get("conduit_groups_file")
    if groups_file:
        plan(items, Path(groups_file))


def pytest_unconfigure(config):
    """An xdist controller runs no fixture: its HOME (whose compiled ops the workers shared) goes here."""
    if not hasattr(config, "workerinput"):
        shutil.rmtree(TEST_HOME, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def fresh_home():
    """The session's temporary HOME (set above, at import); removed when the session ends."""
    assert os.environ["HOME"] == str(TEST_HOME) and TEST_HOME != Path(REAL_HOME)
    yield TEST_HOME
    shutil.rmtree(TEST_HOME)


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = Path(os.environ.get("CONDUIT_DATA_ROOT", DEFAULT_DATA_ROOT))
    assert (root / "tinyshakespeare" / "input.txt").is_file(), f"the shared corpora are missing under {root}"
    return root


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session. Four logical CPUs on two cores: two training workers
    plus stage tasks must fit at once (STACK.md: streaming on 2 logical CPUs deadlocks)."""
    import ray

    # address="local": our own, never whatever /tmp/ray/ray_current_cluster names (a test leaves a
    # stale one there on purpose, and the other xdist worker may be starting its Ray meanwhile)
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=ray_runtime_env())
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def moto_s3():
    """An S3-compatible server (moto) on a free local port for the session; yields ``host:port``.
    It accepts any credentials; tests create their own buckets."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """The session's real MLflow tracking + registry server (tests/servers.py); ``.uri`` is its URI.
    A test that stops it must start it again before it ends."""
    from tests.servers import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    server.start()
    yield server
    server.stop()

"""Shared test fixtures: one local Ray cluster per session, the shared data root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.config import DEFAULT_DATA_ROOT
from pipeline.runner import worker_env

os.environ.update(worker_env())
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Credentials for the tests' S3 server (moto accepts any), set before Ray starts so that Ray Train
# workers inherit them too; real AWS settings in the environment are left as they are.
for _key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
    os.environ.setdefault(_key, "conduit-test")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


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

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": worker_env()})
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

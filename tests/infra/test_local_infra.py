"""The jobs CLIs and infra/local's env file without a cluster. infra/local/up and down against real
processes (both services answer, the env file names them, down stops exactly those processes) are
tested in tests/jobs/test_submit.py, on the services its jobs run on: one ``up`` per session."""

from __future__ import annotations

import pytest

from tests.infra.local_infra import jobs_cli

pytestmark = pytest.mark.slow


def test_env_file_is_read_by_the_jobs_clis_and_missing_cluster_is_named(tmp_path):
    (tmp_path / "env").write_text("# nothing here\n")
    out = jobs_cli("status", CONDUIT_INFRA_ENV=str(tmp_path / "env"))
    assert out.returncode != 0 and "no Ray cluster address" in out.stderr and "infra/local/up" in out.stderr

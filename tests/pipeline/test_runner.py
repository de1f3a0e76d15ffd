"""Runner logic that needs no cluster: planning, --force/--only selection, the shared-storage guard."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.runner import check_shared_storage, downstream, make_plan, resolve


def test_downstream_is_transitive():
    assert downstream({"tokenizer"}) == {"tokenizer", "tokenize", "train", "evaluate", "register"}
    assert downstream({"evaluate"}) == {"evaluate", "register"}
    assert downstream(set()) == set()


def test_plan_on_an_empty_root_runs_everything_and_names_bad_stages(tmp_path):
    cfg = resolve(load_config(None, [f"run.workdir={tmp_path}"]))
    assert [p.run for p in make_plan(cfg)] == [True] * 6
    with pytest.raises(ConfigError, match=r"unknown stage 'trian'"):
        make_plan(cfg, force=("trian",))


def test_until_runs_a_prefix_and_force_stays_inside_it(tmp_path):
    cfg = resolve(load_config(None, [f"run.workdir={tmp_path}"]))
    plan = make_plan(cfg, until="train")
    assert [(p.stage, p.run) for p in plan] == [("shard", True), ("tokenizer", True), ("tokenize", True),
                                                ("train", True), ("evaluate", False), ("register", False)]
    assert [p.hash for p in plan] == [p.hash for p in make_plan(cfg)]  # the same artifacts as a full run
    assert [p.forced for p in make_plan(cfg, until="tokenize", force=("tokenizer",))] == \
        [False, True, True, False, False, False]
    with pytest.raises(ConfigError, match=r"unknown stage 'trian'"):
        make_plan(cfg, until="trian")
    with pytest.raises(ConfigError, match=r"--only and --until exclude each other"):
        make_plan(cfg, only="train", until="train")


SERVER = "tracking.uri=http://mlflow:5000"


@pytest.mark.parametrize("nodes,overrides,ok", [
    (1, [], True),
    (2, [], False),
    (2, ["cluster.shared_storage=true"], True),
    (3, ["run.artifact_root=s3://bucket/conduit", "checkpoint.storage=s3://bucket/ckpt", SERVER], True),
    (2, ["run.artifact_root=s3://bucket/conduit", SERVER], True),
    (2, ["run.artifact_root=s3://bucket/conduit", "checkpoint.storage=/local/ckpt", SERVER], False),
])
def test_multi_node_needs_shared_storage(tmp_path, nodes, overrides, ok):
    cfg = load_config(None, [f"run.workdir={tmp_path}", *overrides])
    if ok:
        check_shared_storage(cfg, nodes)
    else:
        with pytest.raises(ConfigError, match=rf"the Ray cluster has {nodes} nodes but .* is a local path"):
            check_shared_storage(cfg, nodes)


def test_multi_node_refuses_a_sqlite_tracking_store(tmp_path):
    """Stage tasks on other nodes log to MLflow: a sqlite file on the driver's machine is out of their reach."""
    cfg = load_config(None, [f"run.workdir={tmp_path}", "run.artifact_root=s3://bucket/conduit"])
    with pytest.raises(ConfigError, match=r"2 nodes but tracking.uri=sqlite:///.* is a file on this machine"):
        check_shared_storage(cfg, 2)
    check_shared_storage(cfg, 1)
    check_shared_storage(load_config(None, [f"run.workdir={tmp_path}", "cluster.shared_storage=true"]), 2)


def test_ray_job_id_comes_from_the_job_config(monkeypatch):
    from pipeline.runner import ray_job_submission_id

    monkeypatch.delenv("RAY_JOB_SUBMISSION_ID", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert ray_job_submission_id() is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"metadata": {"job_submission_id": "raysubmit_abc"}}')
    assert ray_job_submission_id() == "raysubmit_abc"
    monkeypatch.setenv("RAY_JOB_SUBMISSION_ID", "raysubmit_xyz")
    assert ray_job_submission_id() == "raysubmit_xyz"

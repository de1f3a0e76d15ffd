"""The Stage record and the stage table: defaults, the resource rule, and the order check."""

from __future__ import annotations

import pytest

from pipeline.store.artifacts import is_complete, verify
from pipeline.config import load_config
from pipeline.stages import evaluate, in_order, ORDER, Resources, Stage, STAGES, train


def body(cfg, inputs, out_dir, tracker):
    return {}


def stage(name: str, *inputs: str, **kw) -> Stage:
    return Stage(name=name, version=1, inputs=inputs, hash_config=lambda cfg: {}, run=body, **kw)


def test_the_pipeline_table_and_its_task_resources():
    assert ORDER == ["shard", "tokenizer", "tokenize", "train", "evaluate", "register"]
    assert all(name == s.name for name, s in STAGES.items())
    cfg = load_config(None)
    # tokenize's, train's and evaluate's depend on the running cluster (evaluate.resources_on: without GPUs, 1 CPU).
    fixed = {name: s.task_resources(cfg, {}) for name, s in STAGES.items()
             if name not in ("tokenize", "train", "evaluate")}
    # Stages that fan out (Ray tasks, Ray Train workers) or only do I/O hold no CPU themselves.
    assert fixed == {"shard": Resources(cpus=0), "tokenizer": Resources(cpus=1), "register": Resources(cpus=0)}
    assert evaluate.resources_on(cfg, gpus_in_cluster=0) == Resources(cpus=1)
    # train: nothing while Ray Train's workers train (two workers, or ray_train); one worker in the task holds
    # what that worker would: the most CPUs a node has free (or threads_per_worker), or a GPU.
    free = lambda: [3.0, 1.0]  # noqa: E731 - two nodes' free CPUs
    assert train.resources_on(cfg, "cpu", free) == Resources(cpus=0)  # the default two workers
    one = load_config(None, ["parallel.num_workers=1"])
    assert train.resources_on(one, "cpu", free) == Resources(cpus=3)
    assert train.resources_on(load_config(None, ["parallel.num_workers=1", "parallel.threads_per_worker=1"]),
                              "cpu", free) == Resources(cpus=1)
    assert train.resources_on(one, "cuda", free) == Resources(cpus=0)  # auto on a GPU: Ray Train's worker
    assert train.resources_on(load_config(None, ["parallel.num_workers=1", "parallel.launcher=in_task"]),
                              "cuda", free) == Resources(cpus=0, gpus=1)
    assert train.resources_on(load_config(None, ["parallel.num_workers=1", "parallel.launcher=ray_train"]),
                              "cpu", free) == Resources(cpus=0)
    assert train.resources_on(load_config(None, ["parallel.num_workers=1", "cluster.stage_resources=[pool]"]),
                              "cpu", free) == Resources(cpus=0)  # stage tasks confined: Ray Train places the worker
    assert STAGES["tokenize"].resources_for is not None  # in-process encoding or Ray tasks


def test_resources_default_to_one_cpu_and_a_rule_replaces_them():
    assert stage("x").task_resources(load_config(None), {}) == Resources(cpus=1.0, gpus=0.0)
    ruled = stage("y", resources_for=lambda cfg, inputs: Resources(cpus=cfg.tokenize.num_actors, gpus=1))
    assert ruled.task_resources(load_config(None, ["tokenize.num_actors=3"]), {}) == Resources(cpus=3, gpus=1)
    with pytest.raises(ValueError, match="amounts must be >= 0"):
        Resources(cpus=-1)


def test_the_table_refuses_duplicates_and_stages_before_their_inputs():
    assert list(in_order([stage("a"), stage("b", "a"), stage("c", "a", "b")])) == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"stage 'b' reads \['c'\], which do not come before it"):
        in_order([stage("a"), stage("b", "c"), stage("c")])
    with pytest.raises(ValueError, match="two stages are named 'a'"):
        in_order([stage("a"), stage("a")])
    with pytest.raises(ValueError, match="inputs other than itself"):
        stage("a", "a")


def test_a_failing_after_seal_leaves_the_stage_done_with_a_warning(tmp_path, capsys):
    def prune(cfg, hash_):
        raise OSError("the checkpoint store is gone")

    cfg = load_config(None, [f"run.workdir={tmp_path}"])
    art = stage("a", after_seal=prune).execute(cfg, "0" * 16, tmp_path / "a" / ("0" * 16), {}, None)
    assert is_complete(art.path) and verify(art) is None
    assert "warning: stage a (0000000000000000) is done, but cleaning up its resumable state failed: " \
           "OSError: the checkpoint store is gone" in capsys.readouterr().out

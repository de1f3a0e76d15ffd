"""The resource preflight: a config that asks for more than the Ray cluster has fails before any stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.preflight import check_cluster_resources
from pipeline.runner import run_pipeline
from pipeline.stages import Stage, in_order


def cfg_with(*overrides):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("overrides,resources", [
    ((), {"CPU": 2.0}),
    (("parallel.num_workers=4", "train.global_batch_size=16"), {"CPU": 4.0, "memory": 1e9}),
    (("parallel.device=cuda", "parallel.num_workers=2"), {"CPU": 1.0, "GPU": 2.0}),  # GPU workers hold no CPU
    (("train.precision=fp16",), {"CPU": 8.0, "GPU": 2.0}),  # auto resolves to cuda
    (("train.precision=bf16",), {"CPU": 2.0}),
])
def test_what_fits_passes(overrides, resources):
    check_cluster_resources(cfg_with(*overrides), resources)


@pytest.mark.parametrize("overrides,resources,pattern", [
    (("parallel.num_workers=4", "train.global_batch_size=16"), {"CPU": 2.0},
     r"parallel\.num_workers=4 training workers on cpu need 4 CPUs \(1 each\) but the Ray cluster has 2 CPUs "
     r"and 0 GPUs; Ray Train would wait for them forever"),
    (("parallel.device=cuda", "parallel.num_workers=4", "train.global_batch_size=16"), {"CPU": 64.0, "GPU": 2.0},
     r"parallel\.num_workers=4 training workers on cuda need 4 GPUs \(1 each\) but the Ray cluster has 64 CPUs "
     r"and 2 GPUs"),
    (("parallel.threads_per_worker=2",), {"CPU": 3.0},
     r"parallel\.num_workers=2 training workers on cpu need 4 CPUs \(2 each\) but the Ray cluster has 3 CPUs "
     r"and 0 GPUs; Ray Train would wait for them forever\. Lower parallel\.num_workers \(and "
     r"train\.global_batch_size with it\) or parallel\.threads_per_worker or add nodes"),
    (("parallel.device=cuda",), {"CPU": 64.0},
     r"parallel\.device=cuda but the Ray cluster has 64 CPUs and 0 GPUs"),
    (("train.precision=fp16",), {"CPU": 64.0},
     r"train\.precision=fp16 needs a GPU.*\(parallel\.device=auto trains on cpu: the Ray cluster has 64 CPUs and 0 GPUs\)"),
    (("train.precision=fp16", "parallel.device=cpu"), {"CPU": 64.0, "GPU": 8.0},
     r"train\.precision=fp16 needs a GPU.*parallel\.device=cpu trains on cpu"),
])
def test_what_does_not_fit_names_asked_and_available(overrides, resources, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_cluster_resources(cfg_with(*overrides), resources)


def test_a_worker_that_no_node_can_hold_is_refused():
    """threads_per_worker is what each worker reserves on one node: 3 fits a cluster of 4 CPUs in total, but
    not on two nodes of 2 (it would wait for a node that does not exist)."""
    cfg = cfg_with("parallel.threads_per_worker=3", "parallel.num_workers=1", "train.global_batch_size=4")
    check_cluster_resources(cfg, {"CPU": 4.0}, node_cpus=[4.0])
    with pytest.raises(ConfigError, match=r"parallel\.threads_per_worker=3: each training worker reserves that many "
                                          r"CPUs on one node, but the largest node of the Ray cluster has 2"):
        check_cluster_resources(cfg, {"CPU": 4.0}, node_cpus=[2.0, 2.0])


def test_workers_the_placement_strategy_cannot_place_are_refused_naming_it():
    """STRICT_SPREAD needs a node per worker, STRICT_PACK one node for all: 2 workers of 2 CPUs on one node of 4
    (or two of 2) would otherwise wait for their placement group forever."""
    spread = cfg_with("parallel.placement_strategy=STRICT_SPREAD", "parallel.threads_per_worker=2")
    check_cluster_resources(spread, {"CPU": 4.0}, node_cpus=[2.0, 2.0])
    with pytest.raises(ConfigError, match=r"parallel\.placement_strategy=STRICT_SPREAD puts each of the 2 workers of "
                                          r"2 CPUs on a node of its own, but only 1 of the cluster's 1 nodes \(4 CPUs\) "
                                          r"can hold one; Ray Train would wait for them forever"):
        check_cluster_resources(spread, {"CPU": 4.0}, node_cpus=[4.0])
    pack = cfg_with("parallel.placement_strategy=STRICT_PACK", "parallel.threads_per_worker=2")
    check_cluster_resources(pack, {"CPU": 4.0}, node_cpus=[4.0])
    with pytest.raises(ConfigError, match=r"STRICT_PACK puts all 2 workers of 2 CPUs on one node, but no node of the "
                                          r"cluster \(2 CPUs, 2 CPUs\) holds them"):
        check_cluster_resources(pack, {"CPU": 4.0}, node_cpus=[2.0, 2.0])
    gpus = cfg_with("parallel.placement_strategy=STRICT_SPREAD", "parallel.device=cuda")
    check_cluster_resources(gpus, {"CPU": 8.0, "GPU": 2.0}, node_cpus=[4.0, 4.0], node_gpus=[1.0, 1.0])
    with pytest.raises(ConfigError, match=r"2 workers of 1 GPUs on a node of its own, but only 1"):
        check_cluster_resources(gpus, {"CPU": 8.0, "GPU": 2.0}, node_cpus=[4.0, 4.0], node_gpus=[2.0, 0.0])
    # one worker on a CPU trains in the stage's task: no placement group to place
    check_cluster_resources(cfg_with("parallel.placement_strategy=STRICT_SPREAD", "parallel.num_workers=1",
                                     "train.global_batch_size=4"), {"CPU": 4.0}, node_cpus=[4.0])


def test_only_a_run_that_trains_is_judged_by_its_workers():
    too_many = cfg_with("parallel.num_workers=8", "train.global_batch_size=32", "parallel.device=cuda")
    check_cluster_resources(too_many, {"CPU": 2.0}, ["shard", "tokenizer"])  # --only tokenizer, say
    check_cluster_resources(too_many, {"CPU": 2.0}, [])  # everything cached
    with pytest.raises(ConfigError, match=r"parallel\.device=cuda but the Ray cluster has 2 CPUs and 0 GPUs"):
        check_cluster_resources(too_many, {"CPU": 2.0}, ["tokenize", "train", "evaluate"])


def test_against_the_session_ray(ray_cluster):
    have = ray_cluster.cluster_resources()
    cpus = int(have["CPU"])
    check_cluster_resources(cfg_with("parallel.num_workers=2"), have)
    too_many = cpus + 1
    with pytest.raises(ConfigError, match=rf"need {too_many} CPUs \(1 each\) but the Ray cluster has {cpus} CPUs"):
        check_cluster_resources(cfg_with(f"parallel.num_workers={too_many}",
                                         f"train.global_batch_size={4 * too_many}"), have)


def never_run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    raise AssertionError("the preflight should have stopped the run before any stage")


def test_run_pipeline_refuses_before_the_first_stage(tmp_path, ray_cluster):
    """On the session's real Ray (CPUs, no GPU): too many workers, cuda without GPUs and fp16 on the CPU are each
    refused after connecting, before MLflow or any stage."""
    cpus = int(ray_cluster.cluster_resources()["CPU"])
    stages = in_order([Stage(name="train", version=1, inputs=(), hash_config=lambda c: {}, run=never_run)])
    for overrides, pattern in (
            ((f"parallel.num_workers={2 * cpus}", f"train.global_batch_size={8 * cpus}"), rf"need {2 * cpus} CPUs"),
            (("parallel.device=cuda",), rf"parallel\.device=cuda but the Ray cluster has {cpus} CPUs and 0 GPUs"),
            (("train.precision=fp16",), r"train\.precision=fp16 needs a GPU")):
        cfg = load_config(None, [f"run.workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                 *overrides])
        with pytest.raises(ConfigError, match=pattern):
            run_pipeline(cfg, stages=stages, echo=lambda s: None)
        assert not (tmp_path / "mlflow.db").exists()  # refused before MLflow or any stage


def test_run_pipeline_refuses_stage_resources_the_cluster_lacks_before_the_first_stage(tmp_path, ray_cluster):
    """On the session's real Ray (no node has the resource): refused after connecting, before MLflow or a stage."""
    cfg = load_config(None, [f"run.workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
                             "cluster.stage_resources=[no_such_accelerator]"])
    stages = in_order([Stage(name="shard", version=1, inputs=(), hash_config=lambda c: {}, run=never_run)])
    with pytest.raises(ConfigError, match=r"cluster.stage_resources=\['no_such_accelerator'\]: no node"):
        run_pipeline(cfg, stages=stages, echo=lambda s: None)
    assert not (tmp_path / "mlflow.db").exists()


def test_stage_resources_that_no_node_has_are_refused():
    cfg = cfg_with("cluster.stage_resources=[stages]")
    check_cluster_resources(cfg, {"CPU": 4.0, "stages": 100.0})
    check_cluster_resources(cfg, {"CPU": 4.0}, [])  # everything cached: no stage task runs
    with pytest.raises(ConfigError, match=r"cluster.stage_resources=\['stages'\]: no node .* has \['stages'\]"):
        check_cluster_resources(cfg, {"CPU": 4.0}, ["shard"])

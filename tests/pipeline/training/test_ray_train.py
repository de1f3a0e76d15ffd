"""The trainer class Conduit starts Ray Train with: Ray's own less the placement group cleaner (whose
liveness question needs the dashboard and, with a stale ``/tmp/ray/ray_current_cluster``, held every
run's end 12 s) and the Ray Data shard manager (we pass no datasets)."""

from __future__ import annotations

import time

import pytest

from pipeline.training.ray_train import trainer_class


def _touch(config):
    from pathlib import Path

    Path(config["path"]).write_text("ran")


def _trainers(path: str = ""):
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    kwargs = dict(train_loop_config={"path": path}, torch_config=TorchConfig(backend="gloo"),
                  scaling_config=ray.train.ScalingConfig(num_workers=1))
    return TorchTrainer(_touch, **kwargs), trainer_class()(_touch, **kwargs)


def test_the_trainer_leaves_out_the_cleaner_and_the_dataset_manager_and_keeps_the_rest():
    plain, ours = (t._create_default_callbacks() for t in _trainers())
    names = [type(cb).__name__ for cb in plain]
    assert "PlacementGroupCleanerCallback" in names and "DatasetsCallback" in names, names  # what Ray adds
    assert [type(cb).__name__ for cb in ours] == [n for n in names
                                                  if n not in ("PlacementGroupCleanerCallback", "DatasetsCallback")]


@pytest.mark.slow
def test_a_run_starts_neither_actor_and_gives_its_cpus_back(ray_cluster, tmp_path):
    ray = ray_cluster
    from ray._private.state import state

    before = set(state.actor_table(None))
    total = ray.cluster_resources()["CPU"]
    result = _trainers(str(tmp_path / "ran"))[1].fit()
    assert result.error is None and (tmp_path / "ran").read_text() == "ran"
    started = [a["ActorClassName"] for aid, a in state.actor_table(None).items() if aid not in before]
    assert "TrainController" in started and "RayTrainWorker" in started, started
    assert not [n for n in started if "PlacementGroupCleaner" in n or "DatasetManager" in n], started
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < total:  # the run's placement group is gone
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)

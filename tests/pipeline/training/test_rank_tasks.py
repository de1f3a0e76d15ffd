"""Two training ranks as Ray tasks (``pipeline.training.rank_tasks``, two workers' default on CPUs) against
Ray Train's two workers on the same config: the same weights, history and checkpoint record; a rank that
fails restarts every rank from the newest checkpoint; a cancelled stage ends its ranks and frees their
CPUs, their processes kept; a SIGKILLed stage task takes its ranks and their placement group along, and its
retry resumes exactly.

The direct calls (``train_once``) start the ranks from this test's process, as the stage's task would; the
cancel and kill tests go through ``run_pipeline`` and the stage's task on the session's Ray."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from safetensors.torch import load_file

from pipeline import tracking
from pipeline.base import ConfigError
from pipeline.config import load_config
from pipeline.runner import run_pipeline
from pipeline.stages import train
from pipeline.store.contracts import read_train_starts
from pipeline.training.rank_tasks import placement, uses_rank_tasks
from tests.pipeline.training.test_fault_tolerance import (
    ROOT,
    artifact_run_dir,
    assert_same_weights,
    loss_history,
    train_once,
)
from tests.pipeline.training.test_in_task import (  # noqa: F401 - data_stages: a fixture, used by name
    TIMINGS,
    alive,
    assert_same_records,
    cancel_once_checkpointed,
    data_stages,
    failed_once_after_30,
    kill_once_checkpointed_twice,
    seeded,
    session_processes,
    tags_of,
)

# Two workers of a thread each, 60 steps, a checkpoint every 20 (all kept until the stage seals).
TWO = ["parallel.num_workers=2", "parallel.threads_per_worker=1", "train.steps=60", "checkpoint.every=20",
       "checkpoint.keep=5"]


def test_auto_runs_several_cpu_workers_as_rank_tasks_and_gpus_on_ray_train():
    assert uses_rank_tasks("auto", 2, "cpu") and uses_rank_tasks("ray_tasks", 2, "cpu")
    assert not uses_rank_tasks("auto", 1, "cpu") and not uses_rank_tasks("auto", 2, "cuda")
    assert not uses_rank_tasks("ray_train", 2, "cpu") and not uses_rank_tasks("in_task", 1, "cpu")
    two = load_config(None, ["parallel.num_workers=2"])
    assert train.launcher(two, "cpu") == "ray_tasks" and train.launcher(two, "cuda") == "ray_train"
    assert train.launcher(load_config(None, ["parallel.num_workers=1"]), "cpu") == "in_task"
    assert train.launcher(load_config(None, ["parallel.num_workers=2", "parallel.launcher=ray_train"]),
                          "cpu") == "ray_train"
    asked = load_config(None, ["parallel.num_workers=2", "parallel.launcher=ray_tasks"])
    with pytest.raises(ConfigError, match="parallel.launcher=ray_tasks trains on CPUs, and this run's device is "
                                          "cuda: use parallel.launcher=ray_train"):
        train.launcher(asked, "cuda")
    # the stage's task holds no CPU while ranks train: their placement group holds them
    assert train.resources_on(two, "cpu", free_by_node=lambda: [4.0]).cpus == 0


def test_ranks_are_numbered_as_ray_train_numbers_its_workers():
    """Nodes in the order their first rank comes; local ranks in rank order within a node."""
    assert placement(["a", "a"]) == [(0, 2, 0), (1, 2, 0)]
    assert placement(["b", "a", "b", "a", "c"]) == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1), (0, 1, 2)]


def test_barrier_and_broadcast_wait_for_every_rank(tmp_path):
    """Ray Train's ``barrier`` and ``broadcast_from_rank_zero`` as a rank's task answers them (through the
    attempt's store), for two ranks in two threads: each barrier holds until both reach it, however many come
    one after another, and rank 0's value reaches rank 1."""
    import torch.distributed as dist

    from pipeline.training.in_task import CheckpointRecord
    from pipeline.training.rank_tasks import _utils_class

    store = dist.HashStore()
    utils = [_utils_class()("run", rank, 2, (rank, 2, 0), store, CheckpointRecord(str(tmp_path), "run", 1), [], None)
             for rank in (0, 1)]
    seen: list[tuple] = []

    def rank_one() -> None:
        time.sleep(0.3)
        seen.append(("1 at barrier 1", time.monotonic()))
        utils[1].barrier()
        time.sleep(0.3)
        seen.append(("1 at barrier 2", time.monotonic()))
        utils[1].barrier()
        seen.append(("1 got", utils[1].broadcast_from_rank_zero(None)))

    thread = threading.Thread(target=rank_one)
    thread.start()
    utils[0].barrier()
    first = time.monotonic()
    utils[0].barrier()
    second = time.monotonic()
    assert utils[0].broadcast_from_rank_zero({"name": "checkpoint_x"}) == {"name": "checkpoint_x"}
    thread.join(10)
    assert [s[0] for s in seen] == ["1 at barrier 1", "1 at barrier 2", "1 got"]
    assert first >= seen[0][1] and second >= seen[1][1]  # rank 0 left each barrier only after rank 1 came
    assert seen[2][1] == {"name": "checkpoint_x"}


FORGETS = """
import deepspeed.utils.groups as groups
import torch.distributed as dist
from pipeline.training.in_task import end_process_group

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
groups._EXPERT_PARALLEL_GROUP["ep_size_1"] = dist.new_group([0])
groups._WORLD_GROUP = dist.group.WORLD
end_process_group()
assert not dist.is_initialized()
assert groups._EXPERT_PARALLEL_GROUP == {} and groups._WORLD_GROUP is None
end_process_group()  # nothing to end: no error
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a later run's group
print("ok")
"""


def test_ending_the_process_group_forgets_deepspeeds_groups_of_it():
    """A rank's process takes other tasks after: the next run's engine must not get groups of a destroyed
    process group from DeepSpeed's module. In a process of its own (this one's groups are other tests')."""
    done = subprocess.run([sys.executable, "-c", FORGETS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, data_stages):
    """The uninterrupted run of two ranks as Ray tasks (its checkpoints all kept)."""
    return train_once(tmp_path_factory.mktemp("ranks"), "ranks", [*TWO, "parallel.launcher=ray_tasks"], kill=False,
                      data_root=data_stages, prune=False)


@pytest.mark.slow
def test_rank_tasks_train_ray_trains_weights_and_keep_its_checkpoint_record(tmp_path, ranks, data_stages):
    weights, history, _, art = ranks
    rt_weights, rt_history, _, rt_art = train_once(tmp_path, "ray_train", [*TWO, "parallel.launcher=ray_train"],
                                                   kill=False, data_root=data_stages, prune=False)
    assert art.hash == rt_art.hash  # the launcher changes no result
    assert_same_weights(weights, rt_weights)
    untimed = [[{k: v for k, v in h.items() if k not in TIMINGS} for h in hs] for hs in (history, rt_history)]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 6
    assert read_train_starts(art.path) == read_train_starts(rt_art.path) == [0]
    assert loss_history(art) == loss_history(rt_art) != []
    assert tags_of(art)["conduit.launcher"] == "ray_tasks" and tags_of(rt_art)["conduit.launcher"] == "ray_train"
    # each checkpoint is both ranks' parts merged into one folder, as Ray Train merges its workers'
    files = assert_same_records(art, rt_art, (20, 40, 60))
    assert {"checksums_rank00000.json", "checksums_rank00001.json"} <= set(files), files


@pytest.mark.slow
def test_a_rank_that_fails_restarts_every_rank_from_the_newest_checkpoint(tmp_path, ranks, data_stages,
                                                                          monkeypatch):
    """One rank raises after step 30 (the other waits in a collective for it): every rank restarts from step
    20, and the run ends with the uninterrupted run's weights and MLflow history (each step once)."""
    tags = failed_once_after_30(tmp_path, ranks, TWO, data_stages, monkeypatch)
    assert tags["conduit.launcher"] == "ray_tasks", tags
    assert tags["conduit.last_failure"] in (f"rank {r}: RuntimeError: failpoint: fail_once_after_step 30"
                                            for r in (0, 1)), tags


def whole_pipeline(tmp_path, data_stages, *overrides: str):
    return load_config(ROOT / "configs" / "smoke.yaml", [
        f"run.workdir={tmp_path / 'work'}", f"run.artifact_root={seeded(tmp_path, data_stages)}", "train.log_every=10",
        "train.progress_bar=false", "optimizer.adam_eps=0.0001", *TWO, *overrides])


def rank_pids(session_dir: str) -> list[int]:
    """This session's processes running a rank now."""
    return session_processes(session_dir, lambda cmd: cmd.startswith("ray::conduit.train.rank"))


def stage_task_pid(session_dir: str) -> int | None:
    """This session's process running the train stage's task now."""
    pids = session_processes(session_dir, lambda cmd: cmd == "ray::conduit.train")
    return pids[0] if pids else None


def live_placement_groups() -> list[dict]:
    import ray

    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_cancelled_stage_ends_its_ranks_and_frees_their_cpus(tmp_path, data_stages, ray_cluster):
    """``runner.cancel_stage_tasks`` (a stopped sweep trial, Ctrl-C) once training has a checkpoint: the
    ranks end as the stage does (TaskCancelledError; the train run KILLED with the steps logged so far,
    each once), their placement group is removed and every CPU is free again, and a rank's process, torch
    and DeepSpeed imported, lives on for later tasks."""
    from ray.exceptions import TaskCancelledError

    steps = 5000
    cfg = whole_pipeline(tmp_path, data_stages, f"train.steps={steps}")
    session = ray_cluster._private.worker._global_node.get_session_dir_path()
    before = live_placement_groups()

    def placed() -> None:
        assert len(live_placement_groups()) == len(before) + 1

    ended, pids = cancel_once_checkpointed(tmp_path, cfg, lambda: rank_pids(session), count=2, before_cancel=placed)
    assert len(ended) == 1 and isinstance(ended[0], TaskCancelledError), ended
    wait_until(lambda: live_placement_groups() == before, 30, "the ranks' placement group removed")  # GCS: async
    wait_until(lambda: ray_cluster.available_resources().get("CPU") == ray_cluster.cluster_resources()["CPU"], 30,
               "every CPU free again")
    wait_until(lambda: not rank_pids(session), 10, "the ranks' processes back to idle")
    # A rank that ends on the interrupt keeps its process; one that waits in a collective for a rank that has
    # ended cannot take the interrupt and is killed (STUCK_S): whichever ends first, at least one lives on.
    assert any(alive(p) for p in pids), pids

    c = tracking.client(cfg.tracking_uri())
    exp = c.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    (train_run,) = c.search_runs([exp], "tags.`conduit.stage` = 'train'")
    assert train_run.info.status == "KILLED" and train_run.data.tags["conduit.launcher"] == "ray_tasks"
    logged = sorted(m.step for m in c.get_metric_history(train_run.info.run_id, "loss"))
    assert logged and logged == list(range(10, logged[-1] + 1, 10)) and logged[-1] < steps, logged


@pytest.mark.slow
def test_a_killed_stage_task_takes_its_ranks_along_and_its_retry_resumes_exactly(tmp_path, ranks, data_stages,
                                                                                   ray_cluster):
    """The stage's task SIGKILLed once two checkpoints are recorded: its ranks die with it (their owner is
    gone); Ray keeps their placement group (its creating task is dead, but the job lives), which Ray's retry of
    the task removes before placing its own, and resumes from the newest checkpoint, to the uninterrupted run's
    weights. No group is left."""
    weights, _, _, straight = ranks
    cfg = whole_pipeline(tmp_path, data_stages)
    before = live_placement_groups()
    session = ray_cluster._private.worker._global_node.get_session_dir_path()

    def stage_and_ranks():
        pid, ranks_now = stage_task_pid(session), rank_pids(session)
        return (pid, ranks_now) if pid and len(ranks_now) == 2 else None

    result, (_, ranks_then) = kill_once_checkpointed_twice(tmp_path, cfg, stage_and_ranks)
    art = result.artifacts["train"]
    assert art.hash == straight.hash
    starts = read_train_starts(art.path)
    assert len(starts) == 2 and starts[0] == 0 and starts[1] in (40, 60), starts
    assert_same_weights(weights, load_file(art.path / "model.safetensors"))
    assert not any(alive(p) for p in ranks_then), "a rank of the killed task outlived it"
    assert live_placement_groups() == before

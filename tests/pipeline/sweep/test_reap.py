"""A stopped trial's Train controller dies with the trial; the placement group it made for its workers
must not keep its CPUs for the rest of the sweep (GCS keeps a dead actor's group while its job lives)."""

from __future__ import annotations

import time

import pytest

from pipeline.sweep.run import reap_orphaned_placement_groups

pytestmark = pytest.mark.slow


def test_a_dead_actors_placement_group_is_removed_and_its_cpus_come_back(ray_cluster):
    ray = ray_cluster
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    @ray.remote(num_cpus=0)
    class Controller:  # makes a worker group's placement group, as Ray Train's controller does
        def make(self, cpus: float) -> str:
            pg = placement_group([{"CPU": cpus}])
            ray.get(pg.ready(), timeout=60)
            return pg.id.hex()

    total = ray.cluster_resources()["CPU"]
    doomed, alive = Controller.remote(), Controller.remote()
    orphan = ray.get(doomed.make.remote(1))
    kept = ray.get(alive.make.remote(1))
    mine = placement_group([{"CPU": 1}])  # the driver's own
    ray.get(mine.ready(), timeout=60)
    assert ray.available_resources().get("CPU", 0) == total - 3
    ray.kill(doomed)
    deadline = time.monotonic() + 60
    while placement_group_table()[orphan]["state"] != "REMOVED":
        assert time.monotonic() < deadline, "the dead actor's placement group was never removed"
        removed = reap_orphaned_placement_groups()
        assert kept not in removed and mine.id.hex() not in removed
        time.sleep(0.5)
    assert placement_group_table()[kept]["state"] == "CREATED"
    assert placement_group_table()[mine.id.hex()]["state"] == "CREATED"
    remove_placement_group(mine)
    ray.kill(alive)
    reap_orphaned_placement_groups()  # the live one's, now that it is dead too
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < total:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)

"""A stopped trial's Train controller dies with the trial; the placement group it made for its workers
must not keep its CPUs for the rest of the sweep (GCS keeps a dead actor's group while its job lives)."""

from __future__ import annotations

import time

import pytest

from pipeline.training.ray_train import reap_orphaned_placement_groups

pytestmark = pytest.mark.slow


def test_a_dead_actors_placement_group_is_removed_and_its_cpus_come_back(ray_cluster):
    ray = ray_cluster
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

    def placement_group_from(hex_id: str) -> PlacementGroup:
        return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(hex_id)))

    class Maker:
        def make(self, cpus: float) -> str:
            pg = placement_group([{"CPU": cpus}])
            ray.get(pg.ready(), timeout=60)
            return pg.id.hex()

    TrainController = ray.remote(num_cpus=0)(type("TrainController", (Maker,), {}))  # as Ray Train's is named
    Other = ray.remote(num_cpus=0)(type("Other", (Maker,), {}))

    total = ray.cluster_resources()["CPU"]
    doomed, alive, other = TrainController.remote(), TrainController.remote(), Other.remote()
    orphan = ray.get(doomed.make.remote(1))
    kept = ray.get(alive.make.remote(1))
    others = ray.get(other.make.remote(1))  # a dead actor's group that is not a Train controller's: left alone
    mine = placement_group([{"CPU": 1}])  # the driver's own
    ray.get(mine.ready(), timeout=60)
    assert ray.available_resources().get("CPU", 0) == total - 4
    ray.kill(doomed)
    ray.kill(other)
    deadline = time.monotonic() + 60
    while placement_group_table()[orphan]["state"] != "REMOVED":
        assert time.monotonic() < deadline, "the dead actor's placement group was never removed"
        removed = reap_orphaned_placement_groups()
        assert kept not in removed and mine.id.hex() not in removed and others not in removed
        time.sleep(0.5)
    assert placement_group_table()[kept]["state"] == "CREATED"
    assert placement_group_table()[mine.id.hex()]["state"] == "CREATED"
    assert placement_group_table()[others]["state"] == "CREATED"
    remove_placement_group(mine)
    remove_placement_group(placement_group_from(others))
    ray.kill(alive)
    reap_orphaned_placement_groups()  # the live one's, now that it is dead too
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < total:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)

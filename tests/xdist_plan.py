"""How ``make test`` splits the suite over two pytest-xdist workers (``-n 2 --dist loadgroup``).

Most of the suite waits on one core: a server starting, a CLI importing, a Ray cluster coming up,
a job being followed. Two workers fill the second core with another module's work. What must not
happen is an expensive setup built twice, once per worker:

- Every module that uses one of the ``SHARED`` session fixtures (the session's smoke pipeline run,
  the session's MLflow server and its tiny registered model) is in that fixture's group, and a group
  runs on one worker. A module that uses two such fixtures joins their groups.
- Every other module that uses a module-scoped fixture (a server, a cluster, a DeepSpeed launch) is a
  group of its own: its tests stay together, so that fixture is built once.
- Modules without such fixtures (the fast unit tests) are spread test by test.

The groups go to the workers heaviest first (``FIRST``, from the seconds each took in a measured
run), so that the long ones start at once and the short ones fill in at the end. A worker keeps
its own session Ray cluster; DeepSpeed's ops are built once, in the controller's
``TORCH_EXTENSIONS_DIR``, which both workers inherit (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

# Session fixtures too expensive to build on both workers, and the group of the modules using each.
SHARED = {
    "smoke": "smoke-run",
    "smoke_artifact_root": "smoke-run",
    "mlflow_server": "mlflow-server",
    "tiny_model": "mlflow-server",
    "tiny_vllm_model": "mlflow-server",
}

# Groups to hand out first, heaviest first (seconds on a 2-core machine, serially, in the last
# measured run): the smoke run with everything built on it, the local infra cluster's jobs, the
# MLflow server's modules, the DeepSpeed worlds, the two-node cluster.
FIRST = (
    "smoke-run",
    "tests/jobs/test_submit.py",
    "mlflow-server",
    "tests/pipeline/training/test_distributed_training.py",
    "tests/e2e/test_cluster_object_store.py",
    "tests/pipeline/test_runner_recovery.py",
)


def module_groups(items: list[pytest.Item]) -> dict[str, str]:
    """``{module path: group}`` for the modules that must stay on one worker."""
    shared: dict[str, set[str]] = {}
    scoped: set[str] = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name in info.names_closure:
            defs = info.name2fixturedefs.get(name, ())
            if not defs:
                continue
            used = defs[-1]  # the definition that applies here (a module may override a shared one)
            if name in SHARED and used.scope == "session":
                shared.setdefault(path, set()).add(SHARED[name])
            elif used.scope in ("module", "package"):
                scoped.add(path)
    # Groups that one module joins become one group (and so one worker), with the first name.
    merged = {name: name for name in SHARED.values()}

    def root(name: str) -> str:
        while merged[name] != name:
            name = merged[name]
        return name

    for names in shared.values():
        first, *rest = sorted(names)
        for other in rest:
            merged[root(other)] = root(first)
    groups = {path: root(min(names)) for path, names in shared.items()}
    groups.update({path: path for path in scoped if path not in groups})
    return groups


def plan(items: list[pytest.Item], groups_file: Path) -> None:
    """In a worker: put the ``FIRST`` groups at the front of the collection, in that order (the rest
    keep their collection order), and write ``{module path: group}`` to ``groups_file`` for the
    controller's scheduler (xdist's own ``xdist_group`` marks no longer reach it under pytest 9,
    whose node ids cannot be suffixed)."""
    groups = module_groups(items)

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        key = groups.get(path, path)  # a group, or the module of a test that is not in one
        return FIRST.index(key) if key in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: within a group, and among the rest, collection order stays
    tmp = groups_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(groups_file)  # both workers write the same table; each write is whole


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with ``module_groups``' scopes: a group's modules are one unit of
    work, any other test is a unit of its own. Units go out in collection order."""

    def __init__(self, config: pytest.Config, log, groups_file: Path):
        super().__init__(config, log)
        self._groups_file = groups_file
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # read once the workers have collected (schedule() runs after)
            self._groups = json.loads(self._groups_file.read_text())
        return self._groups.get(nodeid.split("::")[0], nodeid)

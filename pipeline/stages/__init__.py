"""The six stages, in dependency order.

Each stage module ends in its ``STAGE`` record (``pipeline.stages.stage.Stage``): name, version,
inputs, ``hash_config``, ``run`` and the resources of its task. ``STAGES`` is the table the runner
walks; ``STAGES[name].execute(...)`` runs one stage body under the artifact contract without Ray.

The table is made on first use (PEP 562), so that importing one stage module (a stage task's worker
unpickling its record) does not import the others and their libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.base import STAGE_ORDER
from pipeline.stages.stage import Resources, Stage, in_order

if TYPE_CHECKING:
    ORDER: list[str]
    STAGES: dict[str, Stage]


def _table() -> dict[str, Stage]:
    import importlib

    table = in_order(importlib.import_module(f"pipeline.stages.{name}").STAGE for name in STAGE_ORDER)
    if tuple(table) != STAGE_ORDER:  # the command lines offer STAGE_ORDER's names without importing this table
        raise RuntimeError(f"the stage table {list(table)} differs from pipeline.base.STAGE_ORDER {list(STAGE_ORDER)}")
    return table


def __getattr__(name: str):
    if name == "STAGES":
        globals()["STAGES"] = _table()
        return globals()["STAGES"]
    if name == "ORDER":
        globals()["ORDER"] = list(__getattr__("STAGES"))
        return globals()["ORDER"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ORDER", "STAGES", "Resources", "Stage", "in_order"]

"""The six stages, in dependency order.

Each stage module ends in its ``STAGE`` record (``pipeline.stages.stage.Stage``): name, version,
inputs, ``hash_config``, ``run`` and the resources of its task. ``STAGES`` is the table the runner
walks; ``STAGES[name].execute(...)`` runs one stage body under the artifact contract without Ray.
"""

from __future__ import annotations

from pipeline.base import STAGE_ORDER
from pipeline.stages import evaluate, register, shard, tokenize, tokenizer, train
from pipeline.stages.stage import Resources, Stage, in_order

STAGES: dict[str, Stage] = in_order(m.STAGE for m in (shard, tokenizer, tokenize, train, evaluate, register))
if tuple(STAGES) != STAGE_ORDER:  # the command lines offer STAGE_ORDER's names without importing this table
    raise RuntimeError(f"the stage table {list(STAGES)} differs from pipeline.base.STAGE_ORDER {list(STAGE_ORDER)}")
ORDER: list[str] = list(STAGES)

__all__ = ["ORDER", "STAGES", "Resources", "Stage", "in_order"]

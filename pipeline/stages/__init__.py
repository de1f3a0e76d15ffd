"""The six stages, in dependency order, and the one function that runs a stage body.

Each stage module has ``NAME``, ``VERSION`` (bump when its output changes), ``INPUTS`` (upstream
stage names), ``hash_config(cfg)`` (the config view that changes its output) and
``run(cfg, inputs, out_dir, tracker) -> counts``. ``execute_stage`` wraps a body with the artifact
contract; it needs no Ray, so tests call it directly.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

from pipeline.artifacts import Artifact, prepare_dir, write_manifest
from pipeline.config import RunConfig
from pipeline.stages import evaluate, register, shard, tokenize, tokenizer, train

STAGES: dict[str, ModuleType] = {m.NAME: m for m in (shard, tokenizer, tokenize, train, evaluate, register)}
ORDER: list[str] = list(STAGES)


def execute_stage(name: str, cfg: RunConfig, hash_: str, out_dir: Path, inputs: dict[str, Artifact],
                  tracker) -> Artifact:
    """Run one stage body into ``out_dir`` and seal it with its manifest.

    Args:
        name: stage name.
        cfg: the resolved run config.
        hash_: the artifact hash the runner computed for this stage.
        out_dir: ``<artifact_root>/<name>/<hash_>``; cleared first if an earlier attempt left it unsealed.
        inputs: upstream artifacts by stage name.
        tracker: the stage's StageTracker.

    Returns:
        The sealed Artifact.
    """
    stage = STAGES[name]
    missing = [i for i in stage.INPUTS if i not in inputs]
    if missing:
        raise ValueError(f"stage {name} needs inputs {missing}")
    started = time.time()
    prepare_dir(out_dir)
    counts = stage.run(cfg, inputs, out_dir, tracker)
    return write_manifest(
        out_dir, stage=name, hash_=hash_, stage_config=stage.hash_config(cfg), run_config=cfg.to_dict(),
        inputs={i: inputs[i].hash for i in stage.INPUTS}, counts=counts, started_at=started,
    )

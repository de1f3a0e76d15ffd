"""``LoopConfig``: everything each rank's training loop (``pipeline.training.loop.main``) is given, typed;
and ``CheckpointPlace``, where a training's checkpoints go.

Its own module, importing nothing of Conduit's, so that the launch (which must not import the loop, and with
it torch, until it trains), the loop and the checkpoint record all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckpointPlace:
    """Where one training's checkpoints go: ``checkpoint.storage``, the training's name (``train-<hash>``)
    and how many of the newest are kept (``checkpoint.keep``)."""

    storage: str
    name: str
    keep: int


@dataclass(frozen=True)
class LoopConfig:
    """What every rank's loop gets (``loop.main``), built by the train stage.

    Attributes:
        run_config: the resolved ``RunConfig`` as a dict.
        tokens: the tokenize artifact; each rank reads only the blocks it trains on.
        out: the train artifact's folder (a ``NodeFolder``: rank 0 may be on another node than the stage).
        tracker: the stage's MLflow run (rank 0 logs through an outbox).
        device: "cpu" or "cuda"; precision: resolved, or "auto" on a CPU (the ranks time both).
        checkpoints: where this training's checkpoints go (``CheckpointPlace``).
        init_state: ``train.init_from``'s weights, an object in Ray's store, or None.
        report_validation: each validation loss also goes to the run's callbacks (a sweep's trial: Tune).
        checkpoint_steps: steps that always get a checkpoint, saved before that step's validation report
            (a synchronous sweep's rungs, where the trial is paused and later resumed).
        failpoints: tests only (``loop``'s docstring).
        report: where the loop's reports go where no Ray Train controller takes them (the launch sets it
            for local mode); None: ``ray.train.report``.
    """

    run_config: dict
    tokens: Any
    out: Any
    tracker: Any
    device: str
    precision: str
    checkpoints: CheckpointPlace
    init_state: Any = None
    report_validation: bool = False
    checkpoint_steps: tuple[int, ...] = ()
    failpoints: dict = field(default_factory=dict)
    report: Callable[[dict], None] | None = None

"""The plan of a pipeline run: every stage's artifact hash and whether it runs, from the config alone.

Hashes depend on the config and the input hashes only, so the plan needs no data and no Ray; a dry run
(``jobs.run --dry-run``) prints it without importing the runner's libraries (MLflow, Ray). The runner
(`pipeline.runner`) walks the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ConfigError, RunConfig, config_from_dict
from pipeline.stages import STAGES, Stage
from pipeline.store.artifacts import content_hash
from pipeline.store.backends import store_for


@dataclass
class PlanItem:
    stage: str
    hash: str
    path: Path | str  # the artifact's folder, or its URI in an object store (pipeline.store.backends)
    cached: bool
    run: bool  # False: skipped because cached, or outside --only
    forced: bool = False  # --force (or downstream of it): state kept to resume an attempt is discarded


def resolve(cfg: RunConfig) -> RunConfig:
    """Make every location absolute, so that each process (and node) reads the same places."""
    d = cfg.to_dict()
    d["run"]["workdir"] = str(cfg.workdir())
    d["run"]["artifact_root"] = cfg.artifact_root()
    d["data"]["data_root"] = str(cfg.data_root())
    d["tracking"]["uri"] = cfg.tracking_uri()
    return config_from_dict(d, source="<resolved>")


def downstream(names: set[str], stages: dict[str, Stage] = STAGES) -> set[str]:
    """``names`` and every stage of ``stages`` (a table in dependency order) that depends on them, transitively."""
    out = set(names)
    for stage in stages.values():
        if any(i in out for i in stage.inputs):
            out.add(stage.name)
    return out


def make_plan(cfg: RunConfig, only: str | None = None, force: tuple[str, ...] = (),
              stages: dict[str, Stage] = STAGES, until: str | None = None) -> list[PlanItem]:
    """Hash every stage and decide what runs.

    Args:
        only: run just this stage (its inputs must be cached).
        until: run the stages up to and including this one, none after it.
        force: rerun these stages and everything downstream of them, cached or not.
        stages: the stage table in dependency order (``pipeline.stages.in_order``); the pipeline's six by default.

    Raises:
        ConfigError: an unknown stage name, or ``only`` whose inputs are not finished.
    """
    for name in [*force, *([only] if only else []), *([until] if until else [])]:
        if name not in stages:
            raise ConfigError(f"unknown stage {name!r}; stages are {list(stages)}")
    if only and until:
        raise ConfigError("--only and --until exclude each other: --only runs one stage, --until a prefix")
    last = list(stages).index(until) if until else len(stages) - 1
    forced = downstream(set(force), stages)
    store = store_for(cfg.artifact_root())
    hashes: dict[str, str] = {}
    plan = []
    for index, (name, stage) in enumerate(stages.items()):
        h = content_hash(name, stage.version, stage.hash_config(cfg), {i: hashes[i] for i in stage.inputs})
        hashes[name] = h
        path = store.location(name, h)
        cached = store.is_complete(name, h)
        selected = (only is None or name == only) and index <= last
        plan.append(PlanItem(name, h, path, cached, run=selected and (name in forced or not cached),
                             forced=selected and name in forced))
    if only:
        by_name = {p.stage: p for p in plan}
        missing = [i for i in stages[only].inputs if not by_name[i].cached]
        if missing:
            raise ConfigError(f"--only {only}: its inputs {missing} are not finished; run them first")
    return plan


def format_plan(plan: list[PlanItem]) -> str:
    lines = [f"{'stage':<10} {'hash':<17} {'status':<8} path"]
    for p in plan:
        status = "run" if p.run else ("cached" if p.cached else "skip")
        lines.append(f"{p.stage:<10} {p.hash:<17} {status:<8} {p.path}")
    return "\n".join(lines)

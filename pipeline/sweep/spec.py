"""The sweep file: a base config, a search space over its fields, what to optimise and how to prune.

    sweep:
      name: smoke_lr                     # the sweep's MLflow run and Tune experiment (default: the file's stem)
      base: smoke.yaml                   # the pipeline config every trial starts from (relative to this file)
      overrides: [train.steps=150]       # fixed for every trial, as on the jobs.run command line
      space:                             # any config field: section.field
        optimizer.lr: {loguniform: [1.0e-4, 3.0e-2]}
        model.n_layers: {grid: [2, 4]}   # or {choice: [...]}, {uniform: [low, high]}
      samples: 4                         # draws of the random fields per grid point (default 1)
      seed: 0                            # the draws' seed
      metric: val_loss                   # what train's validation reports (validation.every); or an
      mode: min                          #   evaluate metric (e.g. val_bits_per_byte), read at the end
      scheduler: asha                    # asha or sha (both on the validation loss), or none
      grace_steps: 50                    # steps a trial always gets (default validation.every); reduction_factor: 2
      max_concurrent: 2                  # trials at once (the cluster's resources bound it too)
      order: shuffled                    # the trials start in a seeded random order (or as_written)
      register: best                     # best (the best trial's model) or none
      skip_invalid: false                # true: drop the samples that make an invalid config, run the rest

The trials are drawn here, before anything runs, with the seed: the grid fields crossed, each random
field drawn ``samples`` times per grid point. Every trial's config is built and validated; a field that
does not exist, an empty space or a bad range is refused naming the field, and a sample that makes an
invalid config is refused naming the field and value (or dropped, with ``skip_invalid``). So a sweep is a
fixed, numbered list of trials: a rerun (``jobs.sweep`` again) is the same list, and never more.

The trials start in a random order drawn with the seed (``order: shuffled``, the default), not in the
order the grid lists them: ASHA measures each trial against those that reached a rung before it, and a
grid in rising order of quality (learning rates from low to high, below the best) would have every
newcomer beat the median so far and so run to the end.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.config import ConfigError, RunConfig, load_config

KINDS = ("grid", "choice", "uniform", "loguniform")
SCHEDULERS = ("asha", "sha", "none")  # sha: synchronous successive halving
KEYS = ("name", "base", "overrides", "space", "samples", "seed", "metric", "mode", "scheduler", "grace_steps",
        "reduction_factor", "max_concurrent", "register", "skip_invalid", "order")


@dataclass(frozen=True)
class Dimension:
    """One swept field: ``path`` (section.field), its kind and its values (grid/choice) or bounds."""

    path: str
    kind: str
    values: tuple

    def draw(self, rng: random.Random):
        if self.kind == "choice":
            return rng.choice(self.values)
        low, high = self.values
        if self.kind == "uniform":
            return rng.uniform(low, high)
        return math.exp(rng.uniform(math.log(low), math.log(high)))


@dataclass(frozen=True)
class Trial:
    """One trial: its number, the sampled values by field, and its validated pipeline config."""

    index: int
    values: dict
    cfg: RunConfig

    @property
    def name(self) -> str:
        return f"trial_{self.index:03d}"


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep file (module docstring) and its trials."""

    path: Path
    name: str
    base: Path
    overrides: tuple[str, ...]
    dimensions: tuple[Dimension, ...]
    samples: int
    seed: int
    metric: str
    mode: str
    scheduler: str
    grace_steps: int
    reduction_factor: int
    max_concurrent: int
    register: str
    skip_invalid: bool
    order: str = "shuffled"  # shuffled (seeded) or as_written: the order the trials start in
    trials: tuple[Trial, ...] = field(default=())
    dropped: tuple[str, ...] = field(default=())  # why each dropped sample (skip_invalid) was invalid

    @property
    def fingerprint(self) -> str:
        """What identifies this sweep across reruns: its name, its trials' configs and, for ``sha``, its rungs
        (a rerun continues the trials where the rungs left them)."""
        import hashlib
        import json

        rungs = ["sha", self.rungs] if self.scheduler == "sha" else []
        text = json.dumps([self.name, [t.cfg.to_dict() for t in self.trials], *rungs], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def start_order(self) -> list[int]:
        """The trials' indices in the order they start (``order``; shuffled with the seed)."""
        indices = [t.index for t in self.trials]
        if self.order == "shuffled":
            random.Random(f"{self.seed}:order").shuffle(indices)
        return indices

    @property
    def rungs(self) -> list[int]:
        """``sha``'s rungs: the steps where its trials are compared, ``grace_steps`` times each power of
        ``reduction_factor``, each at the first validation at or past it, before the last step (whose
        trials, the best of the last rung, train to the end)."""
        cfg = self.trials[0].cfg
        every, steps, out, r = cfg.validation.every, cfg.train.steps, [], self.grace_steps
        while every:
            at = -(-r // every) * every
            if at >= steps:
                break
            if not out or at > out[-1]:
                out.append(at)
            r *= self.reduction_factor
        return out

    @property
    def validation_metric(self) -> bool:
        """Whether the metric is the one train's validation reports while training (what ASHA prunes on)."""
        return self.metric == "val_loss"


def _override(path: str, value) -> str:
    """``section.field=value`` as the command line writes it (the value in YAML)."""
    return f"{path}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def _dimension(where: str, path, spec) -> Dimension:
    if not isinstance(path, str) or path.count(".") != 1:
        raise ConfigError(f"{where}: space keys are config fields as section.field (e.g. optimizer.lr), got {path!r}")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ConfigError(f"{where}: space.{path} must be one of {{grid: [...]}}, {{choice: [...]}}, "
                          f"{{uniform: [low, high]}}, {{loguniform: [low, high]}}; got {spec!r}")
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: space.{path}.{kind} must be a non-empty list, got {values!r}")
    if kind in ("uniform", "loguniform"):
        if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{where}: space.{path}.{kind} must be [low, high] numbers, got {values!r}")
        low, high = values
        if not low < high or (kind == "loguniform" and low <= 0):
            raise ConfigError(f"{where}: space.{path}.{kind} [{low}, {high}] must have low < high"
                              + (" and low > 0" if kind == "loguniform" else ""))
    return Dimension(path, kind, tuple(values))


def is_sweep_file(path: str | Path) -> bool:
    """Whether ``path`` is a sweep file (its one top-level key is ``sweep``) rather than a pipeline config."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False  # the pipeline config loader reports what is wrong with it
    return isinstance(raw, dict) and set(raw) == {"sweep"}


def _check_field(where: str, cfg: RunConfig, path: str) -> None:
    """Refuse a swept field the config does not have, naming it and the section's fields."""
    import dataclasses

    from models.config import ModelConfig

    section, name = path.split(".")
    if section not in {f.name for f in dataclasses.fields(cfg)}:
        raise ConfigError(f"{where}: space.{path}: there is no config section {section!r}; the sections are "
                          f"{[f.name for f in dataclasses.fields(cfg)]}")
    names = (["preset", *(f.name for f in dataclasses.fields(ModelConfig))] if section == "model"
             else [f.name for f in dataclasses.fields(getattr(cfg, section))])
    if name not in names:
        raise ConfigError(f"{where}: space.{path}: section {section} has no field {name!r}; its fields are {names}")


def load_sweep(path: str | Path, extra_overrides: list[str] | None = None) -> SweepSpec:
    """Read and check a sweep file and draw its trials (module docstring).

    Args:
        path: the sweep YAML.
        extra_overrides: ``section.field=value`` for every trial, after the file's own.

    Raises:
        ConfigError: naming the file and the key, field or value at fault.
    """
    path = Path(path)
    where = str(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read sweep file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from e
    if not isinstance(raw, dict) or set(raw) != {"sweep"} or not isinstance(raw["sweep"], dict):
        raise ConfigError(f"{where}: a sweep file has one top-level key, sweep (see configs/sweeps/smoke_lr.yaml)")
    s = raw["sweep"]
    unknown = sorted(set(s) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown sweep key(s) {unknown}; the keys are {list(KEYS)}")
    if "base" not in s:
        raise ConfigError(f"{where}: sweep.base (the pipeline config the trials start from) is required")
    base = (path.parent / s["base"]).resolve()
    space = s.get("space") or {}
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"{where}: sweep.space is empty: name at least one field to search, e.g. "
                          "optimizer.lr: {loguniform: [1.0e-4, 1.0e-2]}")
    dims = tuple(_dimension(where, p, v) for p, v in space.items())
    overrides = [*(s.get("overrides") or []), *(extra_overrides or [])]

    def positive_int(key: str, default: int, minimum: int = 1) -> int:
        v = s.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{where}: sweep.{key} must be an int >= {minimum}, got {v!r}")
        return v

    def choice(key: str, default: str, allowed: tuple[str, ...]) -> str:
        v = s.get(key, default)
        if v not in allowed:
            raise ConfigError(f"{where}: sweep.{key} must be one of {list(allowed)}, got {v!r}")
        return v

    spec = SweepSpec(
        path=path, name=str(s.get("name") or path.stem), base=base, overrides=tuple(overrides), dimensions=dims,
        samples=positive_int("samples", 1), seed=positive_int("seed", 0, 0), metric=str(s.get("metric", "val_loss")),
        mode=choice("mode", "min", ("min", "max")), scheduler=choice("scheduler", "asha", SCHEDULERS),
        grace_steps=positive_int("grace_steps", 1), reduction_factor=positive_int("reduction_factor", 2, 2),
        max_concurrent=positive_int("max_concurrent", 1), register=choice("register", "none", ("best", "none")),
        skip_invalid=bool(s.get("skip_invalid", False)), order=choice("order", "shuffled", ("shuffled", "as_written")),
    )
    base_cfg = load_config(base, overrides)  # the base itself must be valid (names the file and field)
    for d in dims:
        _check_field(where, base_cfg, d.path)
    if spec.scheduler in ("asha", "sha") and not spec.validation_metric:
        raise ConfigError(f"{where}: sweep.scheduler {spec.scheduler} prunes on the validation loss training reports "
                          f"(metric val_loss); metric {spec.metric!r} is only known at the end: use scheduler none")
    if spec.scheduler in ("asha", "sha") and spec.grace_steps > base_cfg.train.steps + 1:
        raise ConfigError(f"{where}: sweep.grace_steps={spec.grace_steps} must be at most train.steps + 1 = "
                          f"{base_cfg.train.steps + 1} (the grace period cannot pass the last step; "
                          f"train.steps + 1 lets every trial finish)")
    fixed = [d.path for d in dims if d.path in ("train.steps", "validation.every")]
    if spec.scheduler == "sha" and fixed:
        raise ConfigError(f"{where}: sweep.scheduler sha compares every trial at the same steps, so it cannot "
                          f"sweep {fixed[0]}: use scheduler asha, or fix {fixed[0]} in sweep.overrides")
    if spec.validation_metric and not base_cfg.validation.every:
        raise ConfigError(f"{where}: metric val_loss needs validation during training: set validation.every in "
                          f"{base.name} or in sweep.overrides (e.g. validation.every=50)")
    if "grace_steps" not in s and base_cfg.validation.every:
        # ASHA compares validation losses: a rung before the first one would stop trials on nothing measured
        spec = dataclasses.replace(spec, grace_steps=min(base_cfg.validation.every, base_cfg.train.steps + 1))
    return _with_trials(spec)


def _with_trials(spec: SweepSpec) -> SweepSpec:
    """Draw the trials (grid crossed, random fields ``samples`` times each) and build their configs."""
    rng = random.Random(spec.seed)
    grid = [d for d in spec.dimensions if d.kind == "grid"]
    drawn = [d for d in spec.dimensions if d.kind != "grid"]
    trials, dropped = [], []
    points = list(itertools.product(*(d.values for d in grid))) or [()]
    for point in points:
        for _ in range(spec.samples if drawn else 1):
            values = {d.path: v for d, v in zip(grid, point)}
            values.update({d.path: d.draw(rng) for d in drawn})
            values = {d.path: values[d.path] for d in spec.dimensions}  # in the file's order
            name = f"trial_{len(trials):03d}"
            try:
                cfg = load_config(spec.base, [*spec.overrides, *(_override(p, v) for p, v in values.items()),
                                              f"run.name={spec.name}-{name}"])
            except ConfigError as e:
                shown = ", ".join(f"{p}={v!r}" for p, v in values.items())
                if not spec.skip_invalid:
                    raise ConfigError(f"{spec.path}: the sample {shown} makes an invalid config: {e} (no trial "
                                      "has started; fix the space, or set sweep.skip_invalid: true to run the "
                                      "others)") from e
                dropped.append(f"{shown}: {e}")
                continue
            trials.append(Trial(len(trials), values, cfg))
    if not trials:
        raise ConfigError(f"{spec.path}: every sample makes an invalid config: {dropped[0]}")
    return SweepSpec(**{**spec.__dict__, "trials": tuple(trials), "dropped": tuple(dropped)})


__all__ = ["Dimension", "SweepSpec", "Trial", "is_sweep_file", "load_sweep"]

"""The sweep file: trials drawn once, reproducibly, from the space; everything wrong with it refused before
any trial starts, naming the field and value."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parents[3]
SMOKE = str(ROOT / "configs" / "smoke.yaml")


def write(tmp_path: Path, **sweep) -> Path:
    body = {"base": SMOKE, "overrides": ["validation.every=50"], **sweep}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"sweep": body}))
    return path


def test_the_shipped_sweep_loads_with_eight_log_spaced_rates():
    spec = load_sweep(ROOT / "configs" / "sweeps" / "smoke_lr.yaml")
    rates = [t.values["optimizer.lr"] for t in spec.trials]
    assert len(rates) == 8 and rates == sorted(rates)
    assert [t.cfg.optimizer.lr for t in spec.trials] == rates
    assert all(t.cfg.train.steps == 150 and t.cfg.validation.every == 25 for t in spec.trials)
    assert [t.cfg.run.name for t in spec.trials] == [f"smoke_lr-trial_{i:03d}" for i in range(8)]


def test_asha_gives_every_trial_its_first_validation_unless_told_otherwise(tmp_path):
    """A sweep file without grace_steps: ASHA's first rung is the base's first validation step (the first
    loss it can compare), not step 1; one that names it gets that; at most train.steps + 1."""
    space = {"optimizer.lr": {"grid": [1e-3, 2e-3]}}
    assert load_sweep(write(tmp_path, space=space)).grace_steps == 50
    assert load_sweep(write(tmp_path, space=space, grace_steps=7)).grace_steps == 7
    short = write(tmp_path, space=space, overrides=["validation.every=50", "train.steps=20"])
    assert load_sweep(short).grace_steps == 21


def test_grid_crossed_with_random_draws_reproducibly(tmp_path):
    path = write(tmp_path, space={"optimizer.lr": {"loguniform": [1e-4, 1e-2]},
                                  "model.n_layers": {"grid": [1, 2]},
                                  "optimizer.weight_decay": {"uniform": [0.0, 0.2]}}, samples=3, seed=7)
    spec = load_sweep(path)
    assert len(spec.trials) == 2 * 3
    assert [t.values["model.n_layers"] for t in spec.trials] == [1, 1, 1, 2, 2, 2]
    for t in spec.trials:
        assert 1e-4 <= t.values["optimizer.lr"] <= 1e-2 and 0.0 <= t.values["optimizer.weight_decay"] <= 0.2
        assert t.cfg.optimizer.lr == t.values["optimizer.lr"] and t.cfg.model_config().n_layers == t.values["model.n_layers"]
    again = load_sweep(path)
    assert [t.values for t in again.trials] == [t.values for t in spec.trials]
    assert again.fingerprint == spec.fingerprint
    # log-uniform: the logs of the draws spread over [log 1e-4, log 1e-2], not bunched at the top
    logs = [math.log10(t.values["optimizer.lr"]) for t in load_sweep(write(
        tmp_path, space={"optimizer.lr": {"loguniform": [1e-4, 1e-2]}}, samples=200)).trials]
    assert min(logs) < -3.5 and max(logs) > -2.5 and abs(sum(logs) / len(logs) + 3) < 0.15


@pytest.mark.parametrize("space, message", [
    ({"optimizer.lrr": {"grid": [1e-3]}}, r"space.optimizer.lrr: section optimizer has no field 'lrr'"),
    ({"optimiser.lr": {"grid": [1e-3]}}, r"space.optimiser.lr: there is no config section 'optimiser'"),
    ({"model.d_modle": {"grid": [64]}}, r"space.model.d_modle: section model has no field 'd_modle'"),
    ({}, r"sweep.space is empty"),
    ({"optimizer.lr": {"grid": []}}, r"space.optimizer.lr.grid must be a non-empty list"),
    ({"optimizer.lr": {"loguniform": [0.0, 1e-2]}}, r"loguniform \[0.0, 0.01\] must have low < high and low > 0"),
    ({"optimizer.lr": {"uniform": [0.1, 0.01]}}, r"uniform \[0.1, 0.01\] must have low < high"),
    ({"optimizer.lr": {"normal": [0, 1]}}, r"space.optimizer.lr must be one of"),
    ({"lr": {"grid": [1e-3]}}, r"space keys are config fields as section.field"),
])
def test_a_bad_space_is_refused_naming_the_field(tmp_path, space, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(write(tmp_path, space=space))


def test_a_sample_that_makes_an_invalid_config_is_refused_before_any_trial(tmp_path):
    space = {"model.n_heads": {"grid": [4, 3, 8]}}  # d_model 64 (debug_dense): 3 heads do not divide it
    with pytest.raises(ConfigError, match=r"the sample model.n_heads=3 makes an invalid config: .*n_heads.*no trial "
                                          r"has started"):
        load_sweep(write(tmp_path, space=space))
    spec = load_sweep(write(tmp_path, space=space, skip_invalid=True))  # asked for: the others run
    assert [t.values["model.n_heads"] for t in spec.trials] == [4, 8]
    assert [t.index for t in spec.trials] == [0, 1] and len(spec.dropped) == 1 and "model.n_heads=3" in spec.dropped[0]


@pytest.mark.parametrize("sweep, message", [
    (dict(metric="val_bits_per_byte"), r"asha prunes on the validation loss"),
    (dict(overrides=["validation.every=0"]), r"metric val_loss needs validation during training: set validation.every"),
    (dict(scheduler="hyperband"), r"sweep.scheduler must be one of \['asha', 'sha', 'none'\], got 'hyperband'"),
    (dict(scheduler="sha", metric="val_bits_per_byte"), r"sha prunes on the validation loss"),
    (dict(scheduler="sha", space={"train.steps": {"grid": [100, 200]}}),
     r"sha compares every trial at the same steps, so it cannot sweep train.steps"),
    (dict(max_concurrent=0), r"sweep.max_concurrent must be an int >= 1, got 0"),
    (dict(order="random"), r"sweep.order must be one of \['shuffled', 'as_written'\], got 'random'"),
    (dict(trails=4), r"unknown sweep key\(s\) \['trails'\]"),
    (dict(overrides=["validation.every=50", "train.stepz=5"]), r"stepz"),
    (dict(overrides=["validation.every=10", "train.steps=20"], grace_steps=50),
     r"sweep.grace_steps=50 must be at most train.steps \+ 1 = 21"),
])
def test_bad_sweep_settings_are_named(tmp_path, sweep, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(write(tmp_path, **{"space": {"optimizer.lr": {"grid": [1e-3]}}, **sweep}))


@pytest.mark.parametrize("overrides, grace, factor, rungs", [
    (["validation.every=25", "train.steps=150"], 25, 4, [25, 100]),  # the shipped sweep's
    (["validation.every=25", "train.steps=150"], 25, 2, [25, 50, 100]),
    (["validation.every=20", "train.steps=150"], 25, 2, [40, 60, 100]),  # each at the first validation past it
    (["validation.every=10", "train.steps=30"], 10, 2, [10, 20]),
    (["validation.every=10", "train.steps=30"], 5, 2, [10, 20]),  # 5 and 10 meet at the first validation
    (["validation.every=50", "train.steps=50"], 50, 2, []),  # the first rung is the last step: no pause
])
def test_synchronous_halving_rungs_are_validation_steps_before_the_last(tmp_path, overrides, grace, factor, rungs):
    spec = load_sweep(write(tmp_path, space={"optimizer.lr": {"grid": [1e-3, 2e-3]}}, scheduler="sha",
                            grace_steps=grace, reduction_factor=factor, overrides=overrides))
    assert spec.rungs == rungs


def test_the_scheduler_of_a_synchronous_sweep_is_part_of_its_identity(tmp_path):
    """A rerun continues a sweep of the same fingerprint; an ``sha`` sweep's rungs are where its trials
    stand, so changing them (or the scheduler) makes another sweep. ASHA's and no scheduler's are the same
    as ever (only the trials), so a rerun after an upgrade continues them."""
    space = {"optimizer.lr": {"grid": [1e-3, 2e-3]}}
    asha = load_sweep(write(tmp_path, space=space, scheduler="asha")).fingerprint
    assert load_sweep(write(tmp_path, space=space, scheduler="none")).fingerprint == asha
    sha = load_sweep(write(tmp_path, space=space, scheduler="sha", grace_steps=50)).fingerprint
    assert sha != asha
    assert load_sweep(write(tmp_path, space=space, scheduler="sha", grace_steps=50)).fingerprint == sha
    assert load_sweep(write(tmp_path, space=space, scheduler="sha", grace_steps=100)).fingerprint != sha  # rungs


def test_an_end_metric_without_pruning_is_accepted(tmp_path):
    spec = load_sweep(write(tmp_path, space={"optimizer.lr": {"grid": [1e-3, 3e-3]}}, metric="val_bits_per_byte",
                            scheduler="none", overrides=[]))
    assert spec.metric == "val_bits_per_byte" and len(spec.trials) == 2


def test_trials_start_in_a_seeded_shuffled_order_unless_asked_as_written(tmp_path):
    """ASHA measures a trial against those that reached a rung before it: a grid in rising order of quality
    would have every newcomer beat the median so far. So the trials start shuffled, the same way on every
    run of the file (a rerun restores the same sweep); their numbers stay those of the file."""
    grid = {"optimizer.lr": {"grid": [1e-4 * 2 ** i for i in range(8)]}}
    spec = load_sweep(write(tmp_path, space=grid, seed=3))
    order = spec.start_order
    assert sorted(order) == list(range(8)) and order != list(range(8))
    assert load_sweep(write(tmp_path, space=grid, seed=3)).start_order == order  # reproducible
    assert load_sweep(write(tmp_path, space=grid, seed=4)).start_order != order  # the seed decides
    assert [t.index for t in spec.trials] == list(range(8))  # the numbering is the file's
    assert load_sweep(write(tmp_path, space=grid, order="as_written")).start_order == list(range(8))


def test_trials_that_train_side_by_side_split_the_cpus_and_keep_their_hashes():
    from pipeline.stages import STAGES
    from pipeline.sweep.run import trial_threads

    spec = load_sweep(ROOT / "configs" / "sweeps" / "smoke_lr.yaml")
    cfg = spec.trials[0].cfg
    assert cfg.parallel.threads_per_worker is None and cfg.parallel.num_workers == 1
    # 2 trials of 1 worker on 2 CPUs: a thread each (a lone pipeline's worker would take both cores).
    assert trial_threads(cfg, 2, [2.0]).parallel.threads_per_worker == 1
    assert trial_threads(cfg, 2, [16.0]).parallel.threads_per_worker == 8
    assert trial_threads(cfg, 4, [2.0]).parallel.threads_per_worker == 1  # never below one
    two_workers = load_sweep(ROOT / "configs" / "sweeps" / "smoke_lr.yaml", ["parallel.num_workers=2"]).trials[0].cfg
    assert trial_threads(two_workers, 2, [16.0]).parallel.threads_per_worker == 4
    # never more than a node has: one trial's one worker on two nodes of 2 CPUs reserves 2, not 4 (it
    # reserves what it runs threads on, and a bundle of 4 CPUs would wait for a node that does not exist)
    assert trial_threads(cfg, 1, [2.0, 2.0]).parallel.threads_per_worker == 2
    assert trial_threads(cfg, 2, [2.0, 2.0]).parallel.threads_per_worker == 2  # one trial a node
    chosen = load_sweep(ROOT / "configs" / "sweeps" / "smoke_lr.yaml", ["parallel.threads_per_worker=3"])
    assert trial_threads(chosen.trials[0].cfg, 2, [2.0]).parallel.threads_per_worker == 3  # the user's choice stays
    # A speed setting: the trial's train artifact is the same one either way (cached on any cluster).
    train = STAGES["train"]
    assert train.hash_config(trial_threads(cfg, 2, [2.0])) == train.hash_config(cfg)


def test_a_dry_run_of_a_synchronous_sweep_names_the_steps_its_trials_are_compared_at(tmp_path, capsys):
    from jobs.sweep import main

    path = write(tmp_path, space={"optimizer.lr": {"grid": [1e-3, 2e-3]}}, scheduler="sha", grace_steps=25,
                 reduction_factor=2, overrides=["validation.every=25", "train.steps=150"])
    assert main([str(path), "--dry-run"]) == 0
    assert "scheduler sha (trials compared at steps 25, 50, 100), 1 at a time" in capsys.readouterr().out

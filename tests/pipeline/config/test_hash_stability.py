"""Hashes that survive upgrades: a field that a new Conduit adds with a default leaves every artifact
hash (and so every cached artifact) as it was; set to another value, it changes exactly the stages
that read it and those downstream."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from models import ModelConfig
from pipeline.config import CheckpointSection, RunConfig, TrainSection, hash_view, load_config
from pipeline.runner import make_plan

ROOT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class TomorrowsModelConfig(ModelConfig):
    """ModelConfig as a later Conduit might have it: one more field, with a default."""

    router_bias_update_rate: float = 0.0


@dataclasses.dataclass
class TomorrowsTrainSection(TrainSection):
    z_loss_coef: float = 0.0


def hashes(cfg: RunConfig) -> dict[str, str]:
    return {p.stage: p.hash for p in make_plan(cfg)}


def test_a_field_added_at_its_default_leaves_every_hash(tmp_path, monkeypatch):
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [f"run.workdir={tmp_path}"])
    today = hashes(cfg)
    real = RunConfig.model_config

    def tomorrows_model(rate: float):
        return lambda self: TomorrowsModelConfig(**real(self).to_dict(), router_bias_update_rate=rate)

    monkeypatch.setattr(RunConfig, "model_config", tomorrows_model(0.0))
    tomorrow = dataclasses.replace(cfg, train=TomorrowsTrainSection(**dataclasses.asdict(cfg.train)))
    assert isinstance(tomorrow.model_config(), TomorrowsModelConfig)
    assert hashes(tomorrow) == today

    # Set to something else, each new field enters the train hash, and so evaluate's and register's.
    with_z_loss = TomorrowsTrainSection(**dataclasses.asdict(cfg.train), z_loss_coef=1e-4)
    after = hashes(dataclasses.replace(tomorrow, train=with_z_loss))
    assert [s for s in after if after[s] != today[s]] == ["train", "evaluate", "register"]
    monkeypatch.setattr(RunConfig, "model_config", tomorrows_model(0.001))
    after = hashes(tomorrow)
    assert [s for s in after if after[s] != today[s]] == ["train", "evaluate", "register"]


def test_the_hash_view_leaves_out_defaults_and_logging_fields():
    train = TrainSection()
    assert hash_view(train) == {}
    changed = dataclasses.replace(train, steps=5, log_every=3)  # log_every changes no output: hash=False
    assert hash_view(changed) == {"steps": 5}
    assert hash_view(CheckpointSection(every=7, storage="/x", resume_from="/y")) == {"resume_from": "/y"}
    assert hash_view(ModelConfig()) == {}
    assert hash_view(ModelConfig(d_model=64)) == {"d_model": 64}

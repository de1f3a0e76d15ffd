"""The register stage refuses a model whose validation loss is not finite (its training diverged), naming the
model, the artifacts it came from and the value, before it exports or registers anything."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.config import load_config
from pipeline.stages import register
from pipeline.store.artifacts import Artifact
from pipeline.store.contracts import EvalReport


def _inputs(tmp_path: Path, val_loss: float) -> dict:
    evaluate = tmp_path / "evaluate"
    evaluate.mkdir()
    EvalReport(metrics={"val_loss": val_loss, "val_bits_per_byte": val_loss / math.log(2)}, samples={},
               references={}).write(evaluate)
    return {"train": Artifact("train", "7rain", tmp_path / "train", {"inputs": {}, "counts": {}}),
            "tokenizer": Artifact("tokenizer", "70ken", tmp_path / "tokenizer", {}),
            "evaluate": Artifact("evaluate", "eva1", evaluate, {})}


@pytest.fixture
def registry(monkeypatch) -> list:
    """What the stage registered (the MLflow registry and the Hugging Face export stand in)."""
    registered = []
    monkeypatch.setattr(register, "export_hf", lambda weights, tokenizer, out_dir: registered.append("hf export"))
    monkeypatch.setattr(register, "describe", lambda cfg, metrics: "a model")
    monkeypatch.setattr(tracking, "log_and_register_model",
                        lambda tracker, **kw: registered.append((kw["model_name"], kw["tags"]["metric.val_loss"])) or 3)
    return registered


@pytest.mark.parametrize("val_loss", [math.nan, math.inf, -math.inf])
def test_a_model_whose_validation_loss_is_not_finite_is_refused(tmp_path, registry, val_loss):
    cfg = load_config(None, ["register.model_name=tiny-lm"])
    with pytest.raises(ValueError) as refused:
        register.run(cfg, _inputs(tmp_path, val_loss), tmp_path / "out", tracker=None)
    assert str(refused.value) == (
        f"model tiny-lm is not registered: its validation loss is {val_loss} (evaluate artifact eva1 of train "
        f"artifact 7rain), not a finite number: its training diverged")
    assert registry == []


def test_a_model_whose_validation_loss_is_finite_is_registered(tmp_path, registry):
    cfg = load_config(None, ["register.model_name=tiny-lm", "register.hf_export=false"])
    counts = register.run(cfg, _inputs(tmp_path, 2.5), tmp_path / "out", tracker=None)
    assert registry == [("tiny-lm", "2.5")]
    assert counts["version"] == 3

"""register: trained weights + tokenizer + metrics -> an MLflow registered model version.

The version is an MLflow pyfunc model (``pipeline.tracking.ConduitLM``) that answers prompts with
generated text; it gets the configured alias (``challenger`` by default) and tags that lead back to
the data, config and metrics it came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import tracking
from pipeline.artifacts import code_version
from pipeline.config import REPO_ROOT, RunConfig, hash_view
from pipeline.stages.evaluate import METRICS_FILE
from pipeline.stages.tokenizer import MODEL_FILE
from pipeline.stages.train import WEIGHTS_FILE

NAME = "register"
VERSION = 1
INPUTS = ("tokenizer", "train", "evaluate")


def hash_config(cfg: RunConfig) -> dict:
    # The registry is where this stage's output lives, so its address is part of the identity.
    return {"register": hash_view(cfg.register), "tracking_uri": cfg.tracking_uri()}


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    metrics = json.loads((inputs["evaluate"].path / METRICS_FILE).read_text())["metrics"]
    tags = {
        "conduit.train_hash": inputs["train"].hash,
        "conduit.tokenizer_hash": inputs["tokenizer"].hash,
        "conduit.data_hash": inputs["train"].manifest["inputs"].get("tokenize", ""),
        "conduit.code_version": code_version(),
        **{f"metric.{k}": f"{v:.6g}" for k, v in metrics.items()},
    }
    description = (
        f"Conduit {cfg.model_config().num_experts and 'MoE' or 'dense'} LM "
        f"(preset {cfg.model['preset']}, d_model {cfg.model_config().d_model}, "
        f"{cfg.model_config().n_layers} layers), trained {cfg.train.steps} steps on "
        f"{', '.join(cfg.data.train_paths)}; validation bits/byte {metrics['val_bits_per_byte']:.3f}."
    )
    version = tracking.log_and_register_model(
        tracker,
        weights=inputs["train"].path / WEIGHTS_FILE,
        tokenizer=inputs["tokenizer"].path / MODEL_FILE,
        model_name=cfg.register.model_name,
        alias=cfg.register.alias,
        tags=tags,
        description=description,
        code_paths=[str(REPO_ROOT / "models"), str(REPO_ROOT / "pipeline")],
    )
    return {"model_name": cfg.register.model_name, "version": version, "alias": cfg.register.alias,
            "model_uri": f"models:/{cfg.register.model_name}@{cfg.register.alias}"}

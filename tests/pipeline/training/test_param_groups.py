"""Weight decay goes to matrices that map features, not to norms, biases, embeddings or Mamba's dynamics."""

from __future__ import annotations

from models import build_model
from pipeline.training.engine import param_groups


def test_mamba_dynamics_are_not_decayed():
    model = build_model("debug_mamba", device="meta")
    names = {id(p): n for n, p in model.named_parameters()}
    decay, other = (sorted(names[id(p)] for p in g["params"]) for g in param_groups(model, 0.1))
    layer0 = [n for n in decay if n.startswith("layers.0.")]
    assert layer0 == ["layers.0.mixer.conv1d.weight", "layers.0.mixer.dt_proj.weight", "layers.0.mixer.in_proj.weight",
                      "layers.0.mixer.out_proj.weight", "layers.0.mixer.x_proj.weight"]
    assert {"layers.0.mixer.A_log", "layers.0.mixer.D", "layers.0.mixer.dt_proj.bias", "layers.0.mixer.conv1d.bias",
            "layers.0.norm.weight", "tok_embeddings.weight", "norm.weight"} <= set(other)
    assert "lm_head.weight" in decay  # untied: an output projection like any other


def test_mamba2_dynamics_and_gated_norm_are_not_decayed():
    model = build_model("debug_mamba2", device="meta")
    names = {id(p): n for n, p in model.named_parameters()}
    decay, other = (sorted(names[id(p)] for p in g["params"]) for g in param_groups(model, 0.1))
    assert [n for n in decay if n.startswith("layers.0.")] == [
        "layers.0.mixer.conv1d.weight", "layers.0.mixer.in_proj.weight", "layers.0.mixer.out_proj.weight"]
    assert {"layers.0.mixer.A_log", "layers.0.mixer.D", "layers.0.mixer.dt_bias", "layers.0.mixer.norm.weight",
            "layers.0.mixer.conv1d.bias"} <= set(other)

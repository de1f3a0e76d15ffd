"""The Mamba-2 part of the Hugging Face export: names, config.json and its inverse for Mamba2ForCausalLM.

A Mamba-2 model (the family in `models.families.mamba2`) exports as Mamba2ForCausalLM. Our layout is
HF's with `backbone.` dropped and two renames (embeddings, norm_f): in_proj, the depthwise conv1d's
(E + 2 G N, 1, K) weight, dt_bias, A_log, D, the gated norm and out_proj are stored as they are.

Like Mamba's, a Mamba2Config has no context length: ours travels as `max_position_embeddings`, and a
config.json without one (as transformers writes it) loads with `hf_mamba.SSM_CONTEXT`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.families.mamba.hf_mamba import SSM_CONTEXT, check_ssm_config, renamer
from models.families.spec import HFFormat

# torch only in annotations, so that the family table, and a config checked against it, load without it.
if TYPE_CHECKING:
    import torch

_LAYER_PARTS = (
    "norm.weight", "mixer.in_proj.weight", "mixer.in_proj.bias", "mixer.conv1d.weight", "mixer.conv1d.bias",
    "mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.norm.weight", "mixer.out_proj.weight", "mixer.out_proj.bias",
)
_hf_name, _our_name = renamer(_LAYER_PARTS, "Mamba-2")


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of Mamba2ForCausalLM for `cfg`."""
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_heads": cfg.ssm_heads,
        "head_dim": cfg.ssm_head_dim,
        "state_size": cfg.ssm_state_size,
        "expand": cfg.ssm_expand,
        "n_groups": cfg.ssm_n_groups,
        "conv_kernel": cfg.ssm_conv_kernel,
        "chunk_size": cfg.ssm_chunk_size,
        "layer_norm_epsilon": cfg.norm_eps,
        "use_bias": cfg.bias,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "time_step_limit": [0.0, float("inf")],
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": cfg.max_seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a Mamba2ForCausalLM config.json describes.

    Raises:
        ValueError: naming the key when the checkpoint uses something our Mamba-2 does not compute.
    """
    expand = check_ssm_config(hf)
    limit = hf.get("time_step_limit", (0.0, float("inf")))
    # transformers writes infinity as {"__float__": "Infinity"} (JSON has none)
    limit = tuple(float(x["__float__"]) if isinstance(x, dict) else float(x) for x in limit)
    if limit != (0.0, float("inf")):
        raise ValueError(f"time_step_limit {limit} is not supported (Conduit's steps are unclamped)")
    if not hf.get("rms_norm", True) or hf.get("norm_before_gate", False):
        raise ValueError("rms_norm=false or norm_before_gate=true is not supported (the gated norm is "
                         "rmsnorm(y * silu(z)))")
    d = hf["hidden_size"]
    if hf["num_heads"] * hf["head_dim"] != expand * d:
        raise ValueError(f"num_heads x head_dim ({hf['num_heads']} x {hf['head_dim']}) must be expand x hidden_size "
                         f"({expand} x {d})")
    return ModelConfig(
        arch="mamba2", pos_encoding="none", vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"],
        max_seq_len=hf.get("max_position_embeddings", SSM_CONTEXT), ssm_state_size=hf.get("state_size", 128),
        ssm_expand=expand, ssm_conv_kernel=hf.get("conv_kernel", 4), ssm_head_dim=hf["head_dim"],
        ssm_n_groups=hf.get("n_groups", 1), ssm_chunk_size=hf.get("chunk_size", 256),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), bias=bool(hf.get("use_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), init_std=float(hf.get("initializer_range", 0.1)),
    )


def architecture(cfg: ModelConfig) -> tuple:
    """What config.json determines of a Mamba-2 model (the chunk size is a speed setting: left out)."""
    return (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.max_seq_len, cfg.ssm_state_size, cfg.ssm_expand,
            cfg.ssm_conv_kernel, cfg.ssm_head_dim, cfg.ssm_n_groups, cfg.norm_eps, cfg.bias, cfg.tie_embeddings)


FORMAT = HFFormat(
    name="Mamba2ForCausalLM",
    model_types=("mamba2",),
    unsupported_options=lambda cfg: [],
    hf_config=hf_config,
    config_from_hf=config_from_hf,
    to_hf=lambda state, cfg: {_hf_name(k): t for k, t in state.items()},
    from_hf=lambda tensors, cfg: {_our_name(k): t for k, t in tensors.items()},
    architecture=architecture,
)

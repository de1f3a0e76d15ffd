"""The Mamba part of the Hugging Face export: names, config.json and its inverse for MambaForCausalLM.

A Mamba model (the family in `models.families.mamba`) exports as MambaForCausalLM. Our layout is HF's with
`backbone.` dropped and three renames (embeddings, norm_f), so the conversion is a renaming here too:
conv1d keeps its (E, 1, K) weight, A_log and D are stored as they are.

HF's MambaConfig has no context length; ours travels in config.json as `max_position_embeddings`
(an extra key HF keeps and ignores) and is required on import.
"""

from __future__ import annotations

import re

import torch

from models.config import ModelConfig
from models.families.spec import HFFormat

_FIXED = {
    "tok_embeddings.weight": "backbone.embeddings.weight",
    "norm.weight": "backbone.norm_f.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_PARTS = (
    "norm.weight", "mixer.in_proj.weight", "mixer.in_proj.bias", "mixer.conv1d.weight", "mixer.conv1d.bias",
    "mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias", "mixer.A_log", "mixer.D",
    "mixer.out_proj.weight", "mixer.out_proj.bias",
)


def mamba_unsupported_options(cfg: ModelConfig) -> list[str]:
    """Options of a Mamba `cfg` HF's MambaForCausalLM cannot express (none today: every ssm_* field,
    bias and tying map onto MambaConfig; the Transformer-only fields are refused at validation)."""
    return []


def mamba_hf_name(name: str) -> str:
    """Our parameter name -> HF MambaForCausalLM checkpoint name."""
    if name in _FIXED:
        return _FIXED[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LAYER_PARTS:
        raise ValueError(f"no Hugging Face Mamba name for parameter {name!r}")
    return f"backbone.{name}"


def mamba_our_name(hf_name: str) -> str:
    """HF MambaForCausalLM checkpoint name -> our parameter name (inverse of `mamba_hf_name`)."""
    inverse = {v: k for k, v in _FIXED.items()}
    if hf_name in inverse:
        return inverse[hf_name]
    m = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", hf_name)
    if m is None or m.group(2) not in _LAYER_PARTS:
        raise ValueError(f"unexpected tensor {hf_name!r} in Hugging Face Mamba checkpoint")
    return hf_name.removeprefix("backbone.")


def mamba_hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of MambaForCausalLM for `cfg`."""
    return {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "state_size": cfg.ssm_state_size,
        "expand": cfg.ssm_expand,
        "conv_kernel": cfg.ssm_conv_kernel,
        "time_step_rank": cfg.resolved_ssm_dt_rank,
        "layer_norm_epsilon": cfg.norm_eps,
        "use_bias": cfg.bias,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "max_position_embeddings": cfg.max_seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def mamba_config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a MambaForCausalLM config.json describes.

    Raises:
        ValueError: naming the key when the checkpoint uses something our Mamba does not compute
            (conv without bias, another activation, a fractional expand) or lacks max_position_embeddings.
    """
    if not hf.get("use_conv_bias", True):
        raise ValueError("use_conv_bias=False is not supported (our Mamba's convolution has a bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hf['hidden_act']!r}")
    d, expand = hf["hidden_size"], hf.get("expand", 2)
    if int(expand) != expand:
        raise ValueError(f"expand must be a whole number, got {expand!r}")
    if "max_position_embeddings" not in hf:
        raise ValueError("config.json has no max_position_embeddings: add the context length to load a Mamba model")
    rank = hf.get("time_step_rank", "auto")
    return ModelConfig(
        arch="mamba",
        pos_encoding="none",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        max_seq_len=hf["max_position_embeddings"],
        ssm_state_size=hf.get("state_size", 16),
        ssm_expand=int(expand),
        ssm_conv_kernel=hf.get("conv_kernel", 4),
        ssm_dt_rank=None if rank == "auto" else int(rank),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        bias=bool(hf.get("use_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        init_std=float(hf.get("initializer_range", 0.1)),  # MambaConfig's default
    )


def mamba_architecture(cfg: ModelConfig) -> tuple:
    """What config.json determines of a Mamba model, with derived sizes resolved."""
    return (
        cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.max_seq_len, cfg.ssm_state_size, cfg.ssm_expand,
        cfg.ssm_conv_kernel, cfg.resolved_ssm_dt_rank, cfg.norm_eps, cfg.bias, cfg.tie_embeddings,
    )


FORMAT = HFFormat(
    name="MambaForCausalLM",
    model_types=("mamba",),
    unsupported_options=mamba_unsupported_options,
    hf_config=mamba_hf_config,
    config_from_hf=mamba_config_from_hf,
    to_hf=lambda state, cfg: {mamba_hf_name(k): t for k, t in state.items()},
    from_hf=lambda tensors, cfg: {mamba_our_name(k): t for k, t in tensors.items()},
    architecture=mamba_architecture,
)

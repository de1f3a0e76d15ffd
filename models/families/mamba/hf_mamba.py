"""The Mamba part of the Hugging Face export: names, config.json and its inverse for MambaForCausalLM.

A Mamba model (the family in `models.families.mamba`) exports as MambaForCausalLM. Our layout is HF's with
`backbone.` dropped and three renames (embeddings, norm_f), so the conversion is a renaming here too:
conv1d keeps its (E, 1, K) weight, A_log and D are stored as they are.

HF's MambaConfig has no context length; ours travels in config.json as `max_position_embeddings`
(an extra key HF keeps and ignores). A config.json without one, as transformers writes it, loads with
``SSM_CONTEXT``: a state-space model has no position limit, so the context is only how long a
sequence Conduit lets it read (and it sizes nothing).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.families.spec import HFFormat

# torch only in annotations, so that the family table, and a config checked against it, load without it.
if TYPE_CHECKING:
    import torch

SSM_CONTEXT = 65536  # the context of an imported Mamba / Mamba-2 model whose config.json names none

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


def renamer(layer_parts: tuple[str, ...], title: str):
    """The name maps of a Mamba-like checkpoint: ours -> HF's (``backbone.`` before each layer's part
    and the embeddings and final norm of ``_FIXED``) and its inverse, each raising ValueError on a name
    outside ``layer_parts``."""
    inverse = {v: k for k, v in _FIXED.items()}

    def hf_name(name: str) -> str:
        if name in _FIXED:
            return _FIXED[name]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None or m.group(2) not in layer_parts:
            raise ValueError(f"no Hugging Face {title} name for parameter {name!r}")
        return f"backbone.{name}"

    def our_name(hf: str) -> str:
        if hf in inverse:
            return inverse[hf]
        m = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", hf)
        if m is None or m.group(2) not in layer_parts:
            raise ValueError(f"unexpected tensor {hf!r} in Hugging Face {title} checkpoint")
        return hf.removeprefix("backbone.")

    return hf_name, our_name


mamba_hf_name, mamba_our_name = renamer(_LAYER_PARTS, "Mamba")


def check_ssm_config(hf: dict) -> int:
    """What Conduit's Mamba and Mamba-2 both need of a config.json; returns its (whole) ``expand``.

    Raises:
        ValueError: a conv without bias, another activation or a fractional expand, naming the key.
    """
    if not hf.get("use_conv_bias", True):
        raise ValueError("use_conv_bias=False is not supported (Conduit's convolution has a bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hf['hidden_act']!r}")
    expand = hf.get("expand", 2)
    if int(expand) != expand:
        raise ValueError(f"expand must be a whole number, got {expand!r}")
    return int(expand)


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
            (conv without bias, another activation, a fractional expand).
    """
    d, expand = hf["hidden_size"], check_ssm_config(hf)
    rank = hf.get("time_step_rank", "auto")
    return ModelConfig(
        arch="mamba",
        pos_encoding="none",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        max_seq_len=hf.get("max_position_embeddings", SSM_CONTEXT),
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

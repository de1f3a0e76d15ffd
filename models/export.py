"""Save and load weights: Conduit's own safetensors format and Hugging Face Llama / Mixtral / DeepseekV2 / V3.

Own format (`save_safetensors` / `load_safetensors`): one .safetensors file holding the state dict
(without lm_head.weight when tied) and, in the file's metadata under "conduit_model_config", the
ModelConfig as JSON. This is what the pipeline's evaluate and register stages read.

Hugging Face format (`save_hf` / `load_hf`): a folder with config.json and model.safetensors that
`transformers` loads as the class the model's family names (`models.families`): a decoder as LlamaForCausalLM
(dense) or MixtralForCausalLM (MoE) (`models.families.decoder.hf_llama`), or with multi-head latent attention as
DeepseekV2ForCausalLM or, with the sigmoid router, DeepseekV3ForCausalLM (`models.families.decoder.hf_deepseek`); a
Mamba model as MambaForCausalLM (`models.families.mamba.hf_mamba`); an encoder-decoder as MarianMTModel or
BartForConditionalGeneration (`models.families.encdec.hf_marian`). Each of those modules is one `HFFormat`: names,
config.json and their inverses. Our full config also goes into the safetensors metadata, so `load_hf` returns
exactly the saved ModelConfig (dropout, loss coefficients, ... included, which config.json cannot hold) as long as
config.json still describes the same architecture.

Only configurations HF's classes compute identically are exported; anything else raises ValueError
naming the option (see `hf_unsupported_options`). Training-only settings (dropout, z-loss coefficient)
do not change inference and are not checked.

This is the only models/ module that imports safetensors and json.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.families import family, hf_format_of_model_type
from models.families.decoder.model import Transformer
from models.families.encdec.model import EncoderDecoderLM
from models.families.mamba.model import MambaLM
from models.presets import model_class

CONFIG_METADATA_KEY = "conduit_model_config"


# --------------------------------------------------------------------------- own format


def _state_of(model_or_state: Transformer | dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU state dict in our names, without lm_head.weight when tied."""
    if isinstance(model_or_state, (Transformer, MambaLM, EncoderDecoderLM)):
        if model_or_state.cfg != cfg:
            raise ValueError("cfg differs from the model's own cfg; pass model.cfg")
        state = model_or_state.state_dict()
    elif isinstance(model_or_state, dict):
        state = model_or_state
    else:
        raise ValueError(f"expected a Transformer or a state dict, got {type(model_or_state).__name__}")
    out = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)  # the same storage as tok_embeddings.weight
    return out


def _materialise(cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device | str | None) -> Transformer:
    """Build `cfg` on meta, allocate on `device`, and copy `state` in (strict: all and only our keys)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.to_empty(device=torch.device("cpu" if device is None else device))
    model.tie_weights()
    state = dict(state)
    if cfg.tie_embeddings:
        if "lm_head.weight" in state:
            raise ValueError("tied model state must not contain a separate lm_head.weight")
        state["lm_head.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    return model


def save_safetensors(model: Transformer | dict[str, torch.Tensor], cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write weights and config to one safetensors file.

    Args:
        model: the Transformer (or its state dict).
        cfg: its config (stored as JSON in the metadata under "conduit_model_config").
        path: file to write (parent folder must exist).

    Raises:
        ValueError: when cfg is not the model's config.
    """
    tensors = _state_of(model, cfg)
    save_file(tensors, str(path), metadata={"format": "pt", CONFIG_METADATA_KEY: json.dumps(cfg.to_dict())})


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a safetensors file's metadata.

    Raises:
        ValueError: when the file has no Conduit config.
    """
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if CONFIG_METADATA_KEY not in metadata:
        raise ValueError(f"{path} has no {CONFIG_METADATA_KEY!r} metadata; not written by save_safetensors")
    return ModelConfig.from_dict(json.loads(metadata[CONFIG_METADATA_KEY]))


def load_safetensors(path: str | os.PathLike, device: torch.device | str | None = None) -> Transformer:
    """Load a model written by `save_safetensors`.

    Args:
        path: the .safetensors file.
        device: where to put the parameters (default CPU). Parameters are fp32 whatever the file holds.

    Returns:
        The Transformer, in training mode (call .eval() for inference).

    Raises:
        ValueError: on missing config metadata; RuntimeError (from load_state_dict) on mismatched tensors.
    """
    cfg = read_config(path)
    return _materialise(cfg, load_file(str(path)), device)


# --------------------------------------------------------------------------- Hugging Face format


def hf_unsupported_options(cfg: ModelConfig) -> list[str]:
    """Options of `cfg` that its family's Hugging Face class cannot express, as "field=value (reason)"."""
    return family(cfg).hf_format(cfg).unsupported_options(cfg)


def save_hf(
    model_or_state: Transformer | MambaLM | EncoderDecoderLM | dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    extra_config: dict | None = None,
) -> None:
    """Write config.json + model.safetensors loadable by the transformers class of `cfg`'s family.

    Args:
        model_or_state: the model or its state dict (our names).
        cfg: its config.
        out_dir: folder to create or fill.
        dtype: cast floating tensors to this dtype (default: keep).
        extra_config: more config.json keys, e.g. {"bos_token_id": 1, "eos_token_id": 2}; they must
            not overwrite the architecture keys.

    Raises:
        ValueError: naming every option HF cannot express, or on an unmapped parameter.
    """
    fmt = family(cfg).hf_format(cfg)
    problems = fmt.unsupported_options(cfg)
    if problems:
        raise ValueError("cannot export to Hugging Face format: " + "; ".join(problems))
    state = _state_of(model_or_state, cfg)
    renamed = fmt.to_hf(state, cfg)
    tensors = {k: t.to(dtype) if dtype is not None and t.is_floating_point() else t for k, t in renamed.items()}
    out_dtype = dtype if dtype is not None else state["tok_embeddings.weight"].dtype
    hf_cfg = fmt.hf_config(cfg, out_dtype)
    if extra_config:
        clash = sorted(set(extra_config) & set(hf_cfg))
        if clash:
            raise ValueError(f"extra_config must not override architecture keys {clash}")
        hf_cfg.update(extra_config)
    for key, value in fmt.config_defaults(hf_cfg).items():
        hf_cfg.setdefault(key, value)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    save_file(
        tensors,
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt", CONFIG_METADATA_KEY: json.dumps(cfg.to_dict())},
    )


# Fields config.json does not hold; restored from our metadata when present.
_TRAINING_ONLY_FIELDS = ("dropout", "ffn_multiple_of", "moe_z_loss_coef")


def _architecture(cfg: ModelConfig) -> tuple:
    """What config.json determines, with derived sizes resolved (d_ff=None and d_ff=192 can be equal)."""
    return family(cfg).hf_format(cfg).architecture(cfg)


def _with_metadata(derived: ModelConfig, metadata: dict) -> ModelConfig:
    """`derived` (from config.json) reconciled with our own config in the safetensors metadata."""
    if CONFIG_METADATA_KEY not in metadata:
        return derived
    # Our own config rides along in the metadata. If config.json still describes the same architecture
    # it is returned as is (an exact round trip); if config.json was edited, config.json wins and only
    # the fields it cannot hold are taken from the metadata.
    ours = ModelConfig.from_dict(json.loads(metadata[CONFIG_METADATA_KEY]))
    if _architecture(ours) == _architecture(derived) and not hf_unsupported_options(ours):
        return ours
    return derived.replace(**{k: getattr(ours, k) for k in _TRAINING_ONLY_FIELDS})


def load_hf(
    path: str | os.PathLike, device: torch.device | str | None = None
) -> Transformer | MambaLM | EncoderDecoderLM:
    """Load a folder (config.json + model.safetensors) of any class a family reads (Llama, Mixtral,
    DeepseekV2/V3, Mamba, Marian, BART) as our model.

    Reads the per-expert Mixtral layout that `save_hf` writes (experts.{e}.w1/w2/w3).

    Args:
        path: folder written by `save_hf` (or any single-file checkpoint of such a layout).
        device: where to put the parameters (default CPU).

    Returns:
        The model (fp32, training mode).

    Raises:
        ValueError: on an unsupported config or an unexpected tensor name.
    """
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    weights = os.path.join(path, "model.safetensors")
    with safe_open(weights, framework="pt") as f:
        metadata = f.metadata() or {}
    _, fmt = hf_format_of_model_type(hf.get("model_type"))
    cfg = _with_metadata(fmt.config_from_hf(hf), metadata)
    state = fmt.from_hf(load_file(weights), cfg)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return _materialise(cfg, state, device)

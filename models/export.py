"""Save and load weights: Conduit's own safetensors format and Hugging Face Llama / Mixtral / DeepseekV2.

Own format (`save_safetensors` / `load_safetensors`): one .safetensors file holding the state dict
(without lm_head.weight when tied) and, in the file's metadata under "conduit_model_config", the
ModelConfig as JSON. This is what the pipeline's evaluate and register stages read.

Hugging Face format (`save_hf` / `load_hf`): a folder with config.json and model.safetensors that
`transformers` loads as LlamaForCausalLM (dense) or MixtralForCausalLM (MoE), or, for multi-head
latent attention (attention='mla'), as DeepseekV2ForCausalLM, dense or MoE (the mapping, a renaming
plus a RoPE-row permutation and a shared-expert concatenation, is in `models.hf_deepseek`). Our layout was chosen so
that the conversion is a pure renaming: same RoPE feature pairing as HF's rotate_half (no q/k
permutation), same GQA head grouping, and per-expert w1/w2/w3 tensors in Mixtral's checkpoint naming.
Our full config also goes into the safetensors metadata, so `load_hf` returns exactly the saved
ModelConfig (dropout, loss coefficients, ... included, which config.json cannot hold) as long as
config.json still describes the same architecture.

A Mamba model (arch 'mamba') exports as MambaForCausalLM; its names and config.json live in
models/mamba_export.py. An encoder-decoder (arch 'encoder_decoder') exports as MarianMTModel, or with
learned positions as BartForConditionalGeneration (models/encdec_export.py).

Only configurations HF's classes compute identically are exported; anything else raises ValueError
naming the option (see `hf_unsupported_options`). Training-only settings (dropout, z-loss coefficient)
do not change inference and are not checked.

This is the only models/ module that imports safetensors and json.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models import hf_deepseek
from models.config import ModelConfig
from models.encdec import EncoderDecoderLM
from models import encdec_export
from models.encdec_export import TOKEN_ID_DEFAULTS, encdec_architecture, encdec_unsupported_options
from models.mamba import MambaLM
from models.mamba_export import (
    mamba_architecture, mamba_config_from_hf, mamba_hf_config, mamba_hf_name, mamba_our_name,
    mamba_unsupported_options,
)
from models.presets import model_class
from models.transformer import Transformer

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
    """Options of `cfg` that HF Llama / Mixtral (DeepseekV2 for MLA, Mamba for arch 'mamba') cannot express,
    as "field=value (reason)"."""
    if cfg.arch == "mamba":
        return mamba_unsupported_options(cfg)
    if cfg.arch == "encoder_decoder":
        return encdec_unsupported_options(cfg)
    if cfg.attention == "mla":
        return hf_deepseek.unsupported_options(cfg)
    problems = []
    if cfg.pos_encoding != "rope":
        problems.append(f"pos_encoding={cfg.pos_encoding!r} (HF Llama/Mixtral use rope)")
    if cfg.norm != "rmsnorm":
        problems.append(f"norm={cfg.norm!r} (HF Llama/Mixtral use rmsnorm)")
    if cfg.norm_position != "pre":
        problems.append(f"norm_position={cfg.norm_position!r} (HF Llama/Mixtral are pre-norm)")
    if cfg.ffn != "swiglu":
        problems.append(f"ffn={cfg.ffn!r} (HF Llama/Mixtral use swiglu)")
    if cfg.bias:
        problems.append("bias=True (HF export supports bias-free models only)")
    if cfg.num_experts > 0:
        if cfg.moe_every != 1:
            problems.append(f"moe_every={cfg.moe_every} (Mixtral has MoE in every layer)")
        if cfg.moe_first_dense_layers:
            problems.append(f"moe_first_dense_layers={cfg.moe_first_dense_layers} (Mixtral has MoE in every layer)")
        if cfg.moe_shared_experts:
            problems.append(f"moe_shared_experts={cfg.moe_shared_experts} (Mixtral has no shared experts)")
        if cfg.moe_capacity_factor is not None:
            problems.append(f"moe_capacity_factor={cfg.moe_capacity_factor} (Mixtral is dropless)")
        if not cfg.moe_renormalize:
            problems.append("moe_renormalize=False (Mixtral renormalises the top-k weights)")
    return problems


def _hf_name(name: str, moe: bool) -> str:
    """Our parameter name -> HF checkpoint name."""
    fixed = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None:
        raise ValueError(f"no Hugging Face name for parameter {name!r}")
    i, rest = m.groups()
    prefix = f"model.layers.{i}."
    layer_map = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn.w1.weight": "mlp.gate_proj.weight",
        "ffn.w3.weight": "mlp.up_proj.weight",
        "ffn.w2.weight": "mlp.down_proj.weight",
        "ffn.router.weight": "block_sparse_moe.gate.weight",
    }
    for p in ("q", "k", "v", "o"):
        layer_map[f"attn.{p}_proj.weight"] = f"self_attn.{p}_proj.weight"
    if rest in layer_map and (moe or not rest.startswith("ffn.router")):
        return prefix + layer_map[rest]
    e = re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])\.weight", rest)
    if moe and e is not None:
        return prefix + f"block_sparse_moe.experts.{e.group(1)}.{e.group(2)}.weight"
    raise ValueError(f"no Hugging Face name for parameter {name!r}")


def _hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling != 1.0:
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_base, "factor": cfg.rope_scaling}
    out = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attn_dropout,
        "attention_bias": False,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if cfg.attention == "mla":
        out.update(hf_deepseek.hf_config(cfg))
    elif cfg.num_experts > 0:
        out.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            intermediate_size=cfg.resolved_moe_d_ff,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.moe_top_k,
            router_aux_loss_coef=cfg.moe_aux_loss_coef,
            output_router_logits=False,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    else:
        out.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            intermediate_size=cfg.resolved_d_ff,
            mlp_bias=False,
        )
    return out


def save_hf(
    model_or_state: Transformer | dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    extra_config: dict | None = None,
) -> None:
    """Write config.json + model.safetensors loadable by transformers' Llama/Mixtral/DeepseekV2ForCausalLM.

    Args:
        model_or_state: the Transformer or its state dict (our names).
        cfg: its config.
        out_dir: folder to create or fill.
        dtype: cast floating tensors to this dtype (default: keep).
        extra_config: more config.json keys, e.g. {"bos_token_id": 1, "eos_token_id": 2}; they must
            not overwrite the architecture keys.

    Raises:
        ValueError: naming every option HF cannot express, or on an unmapped parameter.
    """
    problems = hf_unsupported_options(cfg)
    if problems:
        raise ValueError("cannot export to Hugging Face format: " + "; ".join(problems))
    moe = cfg.num_experts > 0
    state = _state_of(model_or_state, cfg)
    if cfg.arch == "mamba":
        renamed = {mamba_hf_name(name): t for name, t in state.items()}
    elif cfg.arch == "encoder_decoder":
        renamed = encdec_export.to_hf_tensors(state, cfg)
    elif cfg.attention == "mla":
        renamed = hf_deepseek.to_hf_tensors(state, cfg)
    else:
        renamed = {_hf_name(name, moe): t for name, t in state.items()}
    tensors = {k: t.to(dtype) if dtype is not None and t.is_floating_point() else t for k, t in renamed.items()}
    out_dtype = dtype if dtype is not None else state["tok_embeddings.weight"].dtype
    builders = {"mamba": mamba_hf_config, "encoder_decoder": encdec_export.hf_config}
    hf_cfg = builders.get(cfg.arch, _hf_config)(cfg, out_dtype)
    if extra_config:
        clash = sorted(set(extra_config) & set(hf_cfg))
        if clash:
            raise ValueError(f"extra_config must not override architecture keys {clash}")
        hf_cfg.update(extra_config)
    if cfg.arch == "encoder_decoder":
        for key, value in TOKEN_ID_DEFAULTS.items():
            hf_cfg.setdefault(key, value)
        hf_cfg.setdefault("decoder_start_token_id", hf_cfg["pad_token_id"])  # Marian's convention
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
    if cfg.arch == "mamba":
        return mamba_architecture(cfg)
    if cfg.arch == "encoder_decoder":
        return encdec_architecture(cfg)
    mla = cfg.attention == "mla"
    return (
        cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.resolved_num_kv_heads, cfg.max_seq_len,
        cfg.norm_eps, cfg.rope_base, cfg.rope_scaling, cfg.tie_embeddings, cfg.num_experts,
        cfg.moe_top_k if cfg.num_experts else None,
        cfg.resolved_moe_d_ff if cfg.num_experts else cfg.resolved_d_ff,
        cfg.moe_shared_experts if cfg.num_experts else None, cfg.moe_renormalize if cfg.num_experts else None,
        tuple(cfg.is_moe_layer(i) for i in range(cfg.n_layers)),
        cfg.attention, cfg.q_lora_rank if mla else None,
        tuple(getattr(cfg, f"resolved_{f}") for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                        "v_head_dim")) if mla else None,
    )


def _config_from_hf(hf: dict, metadata: dict) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mixtral", "deepseek_v2", "mamba", "marian", "bart"):
        raise ValueError(f"load_hf supports model_type 'llama', 'mixtral', 'deepseek_v2', 'mamba', 'marian' or "
                         f"'bart', got {model_type!r}")
    if model_type == "mamba":
        return _with_metadata(mamba_config_from_hf(hf), metadata)
    if model_type in ("marian", "bart"):
        return _with_metadata(encdec_export.config_from_hf(hf), metadata)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if model_type != "deepseek_v2" and hf.get("head_dim", d // heads) != d // heads:
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads ({d // heads})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hf['hidden_act']!r}")
    if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias are not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(f"rope_type must be 'default' or 'linear', got {rope_type!r}")
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf["rms_norm_eps"],
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
    )
    if model_type == "deepseek_v2":
        fields.update(hf_deepseek.config_fields(hf))
        fields.pop("num_kv_heads")  # MLA has no separate key/value heads
    elif model_type == "mixtral":
        fields.update(
            num_experts=hf["num_local_experts"],
            moe_top_k=hf["num_experts_per_tok"],
            moe_d_ff=hf["intermediate_size"],
            moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
        )
    else:
        fields["d_ff"] = hf["intermediate_size"]
    return _with_metadata(ModelConfig.from_dict(fields), metadata)


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


def _our_name(hf_name: str) -> str:
    """HF checkpoint name -> our parameter name (inverse of `_hf_name`, both MoE spellings)."""
    fixed = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m is None:
        raise ValueError(f"unexpected tensor {hf_name!r} in Hugging Face checkpoint")
    i, rest = m.groups()
    rest = rest.replace("block_sparse_moe.", "mlp.")  # Mixtral's legacy and current spellings
    layer_map = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn.w1.weight",
        "mlp.up_proj.weight": "ffn.w3.weight",
        "mlp.down_proj.weight": "ffn.w2.weight",
        "mlp.gate.weight": "ffn.router.weight",
    }
    for p in ("q", "k", "v", "o"):
        layer_map[f"self_attn.{p}_proj.weight"] = f"attn.{p}_proj.weight"
    if rest in layer_map:
        return f"layers.{i}.{layer_map[rest]}"
    e = re.fullmatch(r"mlp\.experts\.(\d+)\.(w[123])\.weight", rest)
    if e is not None:
        return f"layers.{i}.ffn.experts.{e.group(1)}.{e.group(2)}.weight"
    raise ValueError(f"unexpected tensor {hf_name!r} in Hugging Face checkpoint")


def load_hf(
    path: str | os.PathLike, device: torch.device | str | None = None
) -> Transformer | MambaLM | EncoderDecoderLM:
    """Load a Llama / Mixtral / DeepseekV2 / Mamba / Marian / BART folder (config.json + model.safetensors) as our model.

    Reads the per-expert Mixtral layout that `save_hf` writes (experts.{e}.w1/w2/w3).

    Args:
        path: folder written by `save_hf` (or any single-file Llama/Mixtral checkpoint of that layout).
        device: where to put the parameters (default CPU).

    Returns:
        The Transformer (fp32, training mode).

    Raises:
        ValueError: on an unsupported config or an unexpected tensor name.
    """
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    weights = os.path.join(path, "model.safetensors")
    with safe_open(weights, framework="pt") as f:
        metadata = f.metadata() or {}
    cfg = _config_from_hf(hf, metadata)
    if cfg.arch == "mamba":
        state = {mamba_our_name(k): v for k, v in load_file(weights).items()}
    elif cfg.arch == "encoder_decoder":
        state = encdec_export.from_hf_tensors(load_file(weights), cfg)
    elif cfg.attention == "mla":
        state = hf_deepseek.from_hf_tensors(load_file(weights), cfg)
    else:
        state = {_our_name(k): v for k, v in load_file(weights).items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return _materialise(cfg, state, device)

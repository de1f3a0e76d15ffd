"""Conduit decoder models <-> Hugging Face Llama (`LlamaForCausalLM`) and Mixtral (`MixtralForCausalLM`).

A dense decoder exports as Llama, an MoE decoder as Mixtral; both with multi-head attention (GQA/MQA
by num_kv_heads). Our layout was chosen so that the conversion is a pure renaming: the same RoPE
feature pairing as HF's rotate_half (no q/k permutation), the same GQA head grouping, and per-expert
w1/w2/w3 tensors in Mixtral's checkpoint naming. One table (`_LAYER_NAMES`) says which of our names is
which of theirs; import reads it backwards. `common_config` and `common_fields` are the config.json
keys every Llama-like class shares (DeepseekV2 adds its own: `models.families.decoder.hf_deepseek`).

Shape legend: none (names and dicts only).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.families.spec import HFFormat

# torch only in annotations, and the expert unstacking (a torch layer) imported by the one function that
# uses it, so that the family table, and a config checked against it, load without torch.
if TYPE_CHECKING:
    import torch

_FIXED = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
          "lm_head.weight": "lm_head.weight"}
# Our names after "layers.{i}." -> theirs after "model.layers.{i}.".
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
}
# MoE layers (Mixtral's checkpoint names): the router and each expert's w1/w2/w3.
_MOE_NAMES = {"ffn.router.weight": "block_sparse_moe.gate.weight"}
_EXPERT = (r"ffn\.experts\.(\d+)\.(w[123])\.weight", "block_sparse_moe.experts.{}.{}.weight")


def block_problems(cfg: ModelConfig, target: str) -> list[str]:
    """What a Llama-like block (RMSNorm, pre-norm, SwiGLU, no biases) cannot express of `cfg`, for the
    class `target` names (Llama/Mixtral, DeepseekV2/V3)."""
    needed = {"norm": "rmsnorm", "norm_position": "pre", "ffn": "swiglu", "bias": False}
    problems = [f"{name}={getattr(cfg, name)!r} ({target} has {value!r})" for name, value in needed.items()
                if getattr(cfg, name) != value]
    return problems


def unsupported_options(cfg: ModelConfig) -> list[str]:
    """Options of a decoder `cfg` (multi-head attention) Llama / Mixtral cannot express, as
    "field=value (reason)"."""
    problems = []
    if cfg.pos_encoding != "rope":
        problems.append(f"pos_encoding={cfg.pos_encoding!r} (HF Llama/Mixtral use rope)")
    problems += block_problems(cfg, "HF Llama/Mixtral")
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
        mixtral_router = {"moe_router": "softmax", "moe_n_group": 1, "moe_routed_scaling_factor": 1.0}
        problems += [f"{name}={getattr(cfg, name)!r} (Mixtral's router has {value!r}; DeepSeek-V3's router exports "
                     "with attention 'mla' as DeepseekV3)" for name, value in mixtral_router.items()
                     if getattr(cfg, name) != value]
    return problems


def hf_name(name: str, moe: bool) -> str:
    """Our parameter name -> the HF checkpoint's."""
    if name in _FIXED:
        return _FIXED[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is not None:
        i, rest = m.groups()
        names = {**_LAYER_NAMES, **_MOE_NAMES} if moe else _LAYER_NAMES
        if rest in names:
            return f"model.layers.{i}.{names[rest]}"
        e = re.fullmatch(_EXPERT[0], rest)
        if moe and e is not None:
            return f"model.layers.{i}." + _EXPERT[1].format(*e.groups())
    raise ValueError(f"no Hugging Face name for parameter {name!r}")


def our_name(name: str) -> str:
    """An HF checkpoint name -> ours (`hf_name` read backwards; Mixtral's `mlp.` spelling too)."""
    inverse = {theirs: ours for ours, theirs in _FIXED.items()}
    if name in inverse:
        return inverse[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is not None:
        i, rest = m.groups()
        rest = re.sub(r"^mlp\.(gate\.|experts\.)", r"block_sparse_moe.\1", rest)  # Mixtral's current spelling
        layer = {theirs: ours for ours, theirs in {**_LAYER_NAMES, **_MOE_NAMES}.items()}
        if rest in layer:
            return f"layers.{i}.{layer[rest]}"
        e = re.fullmatch(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", rest)
        if e is not None:
            return f"layers.{i}.ffn.experts.{e.group(1)}.{e.group(2)}.weight"
    raise ValueError(f"unexpected tensor {name!r} in Hugging Face checkpoint")


def rope_parameters(cfg: ModelConfig) -> tuple[dict, int]:
    """transformers' ``rope_parameters`` for ``cfg``'s RoPE scaling, and ``max_position_embeddings``.

    linear, yarn and llama3 are transformers' types of those names; NTK-aware scaling is the default
    type with its raised base (the same frequencies); dynamic NTK is transformers' ``dynamic``, which
    scales past ``max_position_embeddings``, so that is the original context there (an import gives
    back ``max_seq_len = factor x original``).
    """
    rs, base = cfg.rope, cfg.rope_base
    if rs.factor == 1.0 and rs.kind != "yarn" or cfg.pos_encoding != "rope":
        return {"rope_type": "default", "rope_theta": base}, cfg.max_seq_len
    if rs.kind == "linear":
        return {"rope_type": "linear", "rope_theta": base, "factor": rs.factor}, cfg.max_seq_len
    if rs.kind == "ntk":
        d = cfg.rope_head_dim
        return {"rope_type": "default", "rope_theta": base * rs.factor ** (d / (d - 2))}, cfg.max_seq_len
    if rs.kind == "dynamic":
        return {"rope_type": "dynamic", "rope_theta": base, "factor": rs.factor}, rs.original_max_seq_len
    if rs.kind == "yarn":
        out = {"rope_type": "yarn", "rope_theta": base, "factor": rs.factor, "beta_fast": rs.beta_fast,
               "beta_slow": rs.beta_slow, "original_max_position_embeddings": rs.original_max_seq_len}
        if rs.mscale is not None:
            out.update(mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
        return out, cfg.max_seq_len
    return {"rope_type": "llama3", "rope_theta": base, "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor, "original_max_position_embeddings": rs.original_max_seq_len
            }, cfg.max_seq_len


def rope_fields(hf: dict) -> dict:
    """The ModelConfig fields of a config.json's RoPE (``rope_parameters``, or the older ``rope_scaling``
    with ``type`` or ``rope_type``) and ``max_position_embeddings``.

    Raises:
        ValueError: a rope type Conduit does not compute (longrope, ...), or YaRN with
            ``attention_factor`` or ``truncate: false``, naming it.
    """
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    max_positions = hf["max_position_embeddings"]
    out = dict(rope_base=base, max_seq_len=max_positions)
    if kind == "default":
        return out
    if kind not in ("linear", "dynamic", "yarn", "llama3"):
        raise ValueError(f"rope_type must be one of default, linear, dynamic, yarn, llama3; got {kind!r}")
    factor = float(rope["factor"]) if rope.get("factor") is not None else None
    out.update(rope_scaling_type=kind)
    if kind == "linear":
        return {**out, "rope_scaling": factor}
    if kind == "dynamic":  # transformers scales past max_position_embeddings: that is the original context
        return {**out, "rope_scaling": factor, "rope_original_max_seq_len": max_positions,
                "max_seq_len": int(round(factor * max_positions))}
    original = int(rope.get("original_max_position_embeddings") or max_positions)
    out.update(rope_original_max_seq_len=original)
    if kind == "llama3":
        return {**out, "rope_scaling": factor, "rope_llama3_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_llama3_high_freq_factor": float(rope["high_freq_factor"])}
    if rope.get("attention_factor") is not None:
        raise ValueError("rope_parameters.attention_factor (YaRN's temperature given outright) is not supported; "
                         "Conduit derives it from factor (and mscale, mscale_all_dim)")
    if rope.get("truncate", True) is False:
        raise ValueError("rope_parameters.truncate=false (YaRN without rounding its band edges) is not supported")
    out.update(rope_scaling=factor if factor is not None else max_positions / original,
               rope_yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
               rope_yarn_beta_slow=float(rope.get("beta_slow") or 1.0))
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        out.update(rope_yarn_mscale=float(rope["mscale"]), rope_yarn_mscale_all_dim=float(rope["mscale_all_dim"]))
    return out


def common_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The config.json keys every Llama-like class (Llama, Mixtral, DeepseekV2) reads alike."""
    rope, max_positions = rope_parameters(cfg)
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attn_dropout,
        "attention_bias": False,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of LlamaForCausalLM (dense) or MixtralForCausalLM (MoE) for `cfg`."""
    out = common_config(cfg, dtype)
    if cfg.num_experts > 0:
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   intermediate_size=cfg.resolved_moe_d_ff, num_local_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=cfg.moe_aux_loss_coef,
                   output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    else:
        out.update(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=cfg.resolved_d_ff,
                   mlp_bias=False)
    return out


def common_fields(hf: dict, check_head_dim: bool = True) -> dict:
    """ModelConfig fields of the config.json keys Llama-like classes share.

    Raises:
        ValueError: naming the key, on what our decoder does not compute.
    """
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if check_head_dim and hf.get("head_dim", d // heads) != d // heads:
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads ({d // heads})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {hf['hidden_act']!r}")
    if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias are not supported")
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        norm_eps=hf["rms_norm_eps"],
        **rope_fields(hf),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
    )


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a Llama or Mixtral config.json describes."""
    fields = common_fields(hf)
    if hf.get("model_type") == "mixtral":
        fields.update(num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
                      moe_d_ff=hf["intermediate_size"],
                      moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))
    else:
        fields["d_ff"] = hf["intermediate_size"]
    return ModelConfig.from_dict(fields)


def architecture(cfg: ModelConfig) -> tuple:
    """What a Llama / Mixtral config.json determines of a decoder, with derived sizes resolved
    (d_ff=None and d_ff=192 can be equal)."""
    return (
        cfg.arch, cfg.attention, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.resolved_num_kv_heads,
        cfg.max_seq_len, cfg.norm_eps, cfg.rope_base, cfg.rope, cfg.tie_embeddings, cfg.num_experts,
        cfg.moe_top_k if cfg.num_experts else None,
        cfg.resolved_moe_d_ff if cfg.num_experts else cfg.resolved_d_ff,
        cfg.moe_shared_experts if cfg.num_experts else None, cfg.moe_renormalize if cfg.num_experts else None,
        tuple(cfg.is_moe_layer(i) for i in range(cfg.n_layers)),
    )


def to_hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> Llama / Mixtral checkpoint tensors: stacked experts unstacked, then renamed."""
    from models.layers.grouped_experts import unstack_expert_state

    return {hf_name(k, cfg.num_experts > 0): t for k, t in unstack_expert_state(state).items()}


FORMAT = HFFormat(
    name="LlamaForCausalLM",
    model_types=("llama", "mixtral"),
    unsupported_options=unsupported_options,
    hf_config=hf_config,
    config_from_hf=config_from_hf,
    to_hf=to_hf_tensors,
    from_hf=lambda tensors, cfg: {our_name(k): t for k, t in tensors.items()},
    architecture=architecture,
)

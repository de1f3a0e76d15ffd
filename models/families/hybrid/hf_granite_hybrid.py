"""The hybrid part of the Hugging Face export: names, config.json and its inverse for
``GraniteMoeHybridForCausalLM`` (IBM's Granite 4.0 class).

Why this class: of transformers' hybrid attention + Mamba-2 classes, GraniteMoeHybrid takes any pattern of
the two mixers (``layer_types``), a SwiGLU feed-forward after every layer, full RoPE or none, and its
Mamba-2 mixer is ours (the same in_proj split, conv, dt_bias, A_log, D, grouped gated norm). Bamba rotates
only half of each head (``partial_rotary_factor`` fixed at 0.5), which Conduit's attention does not do;
Nemotron-H's attention layers have no feed-forward and its MLP is a squared ReLU; Jamba's SSM is Mamba-1.
Granite's multipliers (embedding, residual, logits) are written as 1 and its attention multiplier as
1 / sqrt(head_dim), which is then the Transformer exactly.

The conversion is a renaming but for one tensor: Granite's ``shared_mlp.input_linear`` is our SwiGLU's
gate and up projections stacked (w1 over w3). What the class cannot express is refused at export,
naming the option: multi-head latent attention, MoE feed-forwards (Granite's MoE layers always add a
shared MLP and put experts in every layer), ALiBi or learned positions, LayerNorm, biases, another FFN.
Such a model still trains, evaluates and serves from Conduit's own safetensors.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.families.decoder.hf_llama import common_config, common_fields
from models.families.mamba.hf_mamba import check_ssm_config
from models.families.spec import HFFormat

# torch is imported by the functions that make tensors, so that the family table, and a config checked
# against it, load without it.
if TYPE_CHECKING:
    import torch

_FIXED = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
          "lm_head.weight": "lm_head.weight"}
# Our names after "layers.{i}." -> theirs after "model.layers.{i}." (w1 and w3 are stacked: see to_hf).
_LAYER_NAMES = {
    "mixer_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w2.weight": "shared_mlp.output_linear.weight",
    **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"mixer.{p}": f"mamba.{p}" for p in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                                            "norm.weight", "out_proj.weight")},
}
_GATE_UP = "shared_mlp.input_linear.weight"
# transformers' layer type names (and the older ones it still reads).
_KINDS = {"linear_attention": "M", "mamba": "M", "full_attention": "A", "attention": "A"}


def unsupported_options(cfg: ModelConfig) -> list[str]:
    """What GraniteMoeHybrid cannot express of a hybrid `cfg`, as "field=value (reason)"."""
    problems = []
    if cfg.attention != "mha":
        problems.append(f"attention={cfg.attention!r} (GraniteMoeHybrid's attention is multi-head with GQA)")
    if cfg.pos_encoding not in ("rope", "none"):
        problems.append(f"pos_encoding={cfg.pos_encoding!r} (GraniteMoeHybrid has rope or no positions)")
    if cfg.num_experts:
        problems.append(f"num_experts={cfg.num_experts} (GraniteMoeHybrid's MoE puts experts in every layer beside "
                        "a shared MLP; Conduit exports dense hybrids)")
    needed = {"norm": "rmsnorm", "ffn": "swiglu", "bias": False}
    problems += [f"{name}={getattr(cfg, name)!r} (GraniteMoeHybrid has {value!r})" for name, value in needed.items()
                 if getattr(cfg, name) != value]
    return problems


def to_hf(state: dict, cfg: ModelConfig) -> dict:
    """Our state dict -> GraniteMoeHybrid's tensors."""
    import torch

    out = {}
    for name, t in state.items():
        if name in _FIXED:
            out[_FIXED[name]] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"no Hugging Face name for parameter {name!r}")
        i, rest = m.groups()
        if rest == "ffn.w1.weight":
            out[f"model.layers.{i}.{_GATE_UP}"] = torch.cat([t, state[f"layers.{i}.ffn.w3.weight"]], dim=0)
        elif rest in _LAYER_NAMES:
            out[f"model.layers.{i}.{_LAYER_NAMES[rest]}"] = t
        elif rest != "ffn.w3.weight":
            raise ValueError(f"no Hugging Face name for parameter {name!r}")
    return out


def from_hf(tensors: dict, cfg: ModelConfig) -> dict:
    """GraniteMoeHybrid's tensors -> our state dict (raises ValueError on an unexpected tensor)."""
    inverse = {theirs: ours for ours, theirs in _LAYER_NAMES.items()}
    fixed = {theirs: ours for ours, theirs in _FIXED.items()}
    out = {}
    for name, t in tensors.items():
        if name in fixed:
            out[fixed[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None or (m.group(2) not in inverse and m.group(2) != _GATE_UP):
            raise ValueError(f"unexpected tensor {name!r} in Hugging Face GraniteMoeHybrid checkpoint")
        i, rest = m.groups()
        if rest == _GATE_UP:
            out[f"layers.{i}.ffn.w1.weight"], out[f"layers.{i}.ffn.w3.weight"] = t.chunk(2, dim=0)
        else:
            out[f"layers.{i}.{inverse[rest]}"] = t
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of GraniteMoeHybridForCausalLM for a hybrid `cfg`."""
    out = common_config(cfg, dtype)
    out.update(
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid",
        intermediate_size=cfg.resolved_d_ff, shared_intermediate_size=cfg.resolved_d_ff,
        num_local_experts=0, num_experts_per_tok=0,
        embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
        attention_multiplier=1.0 / math.sqrt(cfg.head_dim),
        position_embedding_type="rope" if cfg.pos_encoding == "rope" else None,
        layer_types=["full_attention" if k == "A" else "linear_attention" for k in cfg.hybrid_layers],
        mamba_n_heads=cfg.ssm_heads, mamba_d_head=cfg.ssm_head_dim, mamba_n_groups=cfg.ssm_n_groups,
        mamba_d_state=cfg.ssm_state_size, mamba_d_conv=cfg.ssm_conv_kernel, mamba_expand=cfg.ssm_expand,
        mamba_chunk_size=cfg.ssm_chunk_size, mamba_conv_bias=True, mamba_proj_bias=False,
        time_step_limit=[0.0, float("inf")],
    )
    return out


def _float(x) -> float:
    """A number as transformers writes it in config.json (infinity as {"__float__": "Infinity"})."""
    return float(x["__float__"]) if isinstance(x, dict) else float(x)


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a GraniteMoeHybrid config.json describes.

    Raises:
        ValueError: naming the key, on what Conduit's hybrid does not compute (experts, multipliers
            other than the plain Transformer's, a clamped time step, biases).
    """
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("num_local_experts", 0):
        raise ValueError(f"num_local_experts={hf['num_local_experts']}: GraniteMoeHybrid's MoE layers are not "
                         "supported (Conduit reads dense hybrids)")
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if _float(hf.get(key, 1.0)) != 1.0:
            raise ValueError(f"{key}={hf[key]} is not supported (Conduit's hybrid has none: 1.0)")
    scale = _float(hf.get("attention_multiplier", 1.0))
    if not math.isclose(scale, 1.0 / math.sqrt(d // heads), rel_tol=1e-6):
        raise ValueError(f"attention_multiplier={scale} is not supported (Conduit scales attention by 1/sqrt(head_dim) "
                         f"= {1.0 / math.sqrt(d // heads)})")
    if hf.get("mamba_proj_bias", False):
        raise ValueError("mamba_proj_bias=true is not supported")
    if not hf.get("mamba_conv_bias", True):
        raise ValueError("mamba_conv_bias=false is not supported (Conduit's convolution has a bias)")
    limit = tuple(_float(x) for x in (hf.get("time_step_limit") or (0.0, float("inf"))))
    if limit != (0.0, float("inf")):
        raise ValueError(f"time_step_limit {limit} is not supported (Conduit's steps are unclamped)")
    kinds = hf.get("layer_types") or ["linear_attention"] * hf["num_hidden_layers"]
    unknown = sorted({k for k in kinds if k not in _KINDS})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (attention or Mamba-2 layers only)")
    expand = check_ssm_config({"expand": hf.get("mamba_expand", 2), "hidden_act": hf.get("hidden_act", "silu")})
    n_heads_ssm = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = expand * d // n_heads_ssm if head_dim in (None, "auto") else head_dim
    if n_heads_ssm * head_dim != expand * d:
        raise ValueError(f"mamba_n_heads x mamba_d_head ({n_heads_ssm} x {head_dim}) must be mamba_expand x "
                         f"hidden_size ({expand} x {d})")
    fields = common_fields(hf)
    if hf.get("position_embedding_type") != "rope":
        fields = {k: v for k, v in fields.items() if not k.startswith("rope_")}
        fields["max_seq_len"] = hf["max_position_embeddings"]
        fields["pos_encoding"] = "none"
    return ModelConfig.from_dict(dict(
        fields, arch="hybrid", hybrid_layers="".join(_KINDS[k] for k in kinds),
        d_ff=hf.get("shared_intermediate_size", 1024), ssm_state_size=hf.get("mamba_d_state", 256),
        ssm_conv_kernel=hf.get("mamba_d_conv", 4), ssm_expand=expand, ssm_head_dim=head_dim,
        ssm_n_groups=hf.get("mamba_n_groups", 1), ssm_chunk_size=hf.get("mamba_chunk_size", 256)))


def architecture(cfg: ModelConfig) -> tuple:
    """What a GraniteMoeHybrid config.json determines of a hybrid (the chunk size is a speed setting)."""
    return (cfg.arch, cfg.hybrid_layers, cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.resolved_num_kv_heads,
            cfg.max_seq_len, cfg.norm_eps, cfg.pos_encoding, cfg.rope_base if cfg.pos_encoding == "rope" else None,
            cfg.rope if cfg.pos_encoding == "rope" else None, cfg.tie_embeddings, cfg.resolved_d_ff,
            cfg.ssm_state_size, cfg.ssm_expand, cfg.ssm_conv_kernel, cfg.ssm_head_dim, cfg.ssm_n_groups)


FORMAT = HFFormat(
    name="GraniteMoeHybridForCausalLM",
    model_types=("granitemoehybrid",),
    unsupported_options=unsupported_options,
    hf_config=hf_config,
    config_from_hf=config_from_hf,
    to_hf=to_hf,
    from_hf=from_hf,
    architecture=architecture,
)

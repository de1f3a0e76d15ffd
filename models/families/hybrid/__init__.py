"""Hybrid attention + Mamba-2 models (``arch: hybrid``): a layer pattern of the two mixers, each layer with a
feed-forward (Jamba, Bamba, Nemotron-H, Granite 4.0).

Built as `models.families.hybrid.model.HybridLM`; exported as GraniteMoeHybridForCausalLM
(`models.families.hybrid.hf_granite_hybrid`), the transformers class that takes any pattern of attention and
Mamba-2 layers with full RoPE (or none) and a dense SwiGLU after each. Its own field is ``hybrid_layers`` (one
letter per layer, "A" attention, "M" Mamba-2); it reads Mamba-2's ssm_* fields and every attention, position, FFN
and MoE field of the decoder. The layers are pre-norm, as every hybrid above.

Accounting: per layer two norms, the mixer (the attention kind's parameters, or a Mamba-2 mixer's) and
the FFN (dense, or MoE counted as the decoder counts it); the final norm and the embedding. FLOPs per
token: 6 N with N the active non-embedding parameters plus V D, the attention term 6 H (Q + V) T of each
attention layer, and 3 x the chunked scan's forward of each Mamba-2 layer. The KV cache holds the
attention layers' keys and values per token; the Mamba-2 layers add a fixed state per sequence.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families import mamba2
from models.families.hybrid import hf_granite_hybrid
from models.families.decoder import attention_sublayer, rope_tables
from models.families.parts import Activations, ffn_params, ffn_sublayer, norm_params, norm_saved, require
from models.families.spec import Family
from models.layers.kinds import attention_kind
from models.tensors import Module, block_ffn, embedding, norm, output_head

# The letters of ``hybrid_layers``. Here, not in torch's `model`, because the checks and accounting below read
# them too.
ATTENTION, MAMBA = "A", "M"


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    D, V = cfg.d_model, cfg.vocab_size
    embedding = V * D * (1 if cfg.tie_embeddings else 2)
    if cfg.pos_encoding == "learned":
        embedding += cfg.max_seq_len * D
    expert = ffn_params(cfg, cfg.resolved_moe_d_ff)
    non_embedding, inactive = norm_params(cfg), 0
    for i, kind in enumerate(cfg.hybrid_layers):
        non_embedding += 2 * norm_params(cfg)
        non_embedding += attention_kind(cfg).params(cfg) if kind == ATTENTION else mamba2.mixer_params(cfg)
        if cfg.is_moe_layer(i):
            non_embedding += D * cfg.num_experts + (cfg.num_experts + cfg.moe_shared_experts) * expert
            inactive += (cfg.num_experts - cfg.moe_top_k) * expert
        else:
            non_embedding += ffn_params(cfg, cfg.resolved_d_ff)
    total = embedding + non_embedding
    return {"total": total, "active": total - inactive, "embedding": embedding, "non_embedding": non_embedding,
            "active_non_embedding": non_embedding - inactive}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    n = param_counts(cfg)["active_non_embedding"] + cfg.vocab_size * cfg.d_model
    n_attention, n_mamba = cfg.hybrid_layers.count(ATTENTION), cfg.hybrid_layers.count(MAMBA)
    attn = n_attention * cfg.n_heads * attention_kind(cfg).score_and_value_width(cfg) * seq_len
    scan = n_mamba * mamba2.mixing_flops(cfg)
    return {"total": 6 * n + 6 * attn + 3 * scan, "forward": 2 * n + 2 * attn + scan}


def activations(cfg: ModelConfig, seq_len: int, b: int) -> Activations:
    """Per layer: its mixer sublayer (attention as the decoder's, or a Mamba-2 mixer with its norm and
    input), then its feed-forward sublayer."""
    mixer, mixer_widest = mamba2.mixer_activations(cfg, b)
    layers, widest = [], []
    for i, kind in enumerate(cfg.hybrid_layers):
        ffn, wide = ffn_sublayer(cfg, i, b)
        first = attention_sublayer(cfg, seq_len, b) if kind == ATTENTION else norm_saved(cfg, b) + mixer
        layers.append(first + ffn)
        widest.append(max(wide, 0 if kind == ATTENTION else mixer_widest))
    return Activations(stem=rope_tables(cfg, b), layers=tuple(layers), widest=tuple(widest),
                       inputs=(float(b * cfg.d_model),) * cfg.n_layers, stem_checkpointed=rope_tables(cfg, b, True))


def _check(cfg: ModelConfig) -> None:
    pattern = cfg.hybrid_layers
    if not isinstance(pattern, str) or len(pattern) != cfg.n_layers or set(pattern) - {ATTENTION, MAMBA}:
        example = ("MMMA" * cfg.n_layers)[:cfg.n_layers - 1] + "A"
        raise ValueError(f"hybrid_layers must name each of the n_layers ({cfg.n_layers}) layers with a letter, "
                         f"'A' (attention) or 'M' (Mamba-2), e.g. {example!r}; got {pattern!r}")
    if ATTENTION not in pattern or MAMBA not in pattern:
        raise ValueError(f"hybrid_layers {pattern!r} needs at least one 'A' and one 'M' (all Mamba-2 is arch "
                         "'mamba2', all attention arch 'decoder')")
    require(cfg, {"norm_position": "pre"}, why=" (its Mamba-2 and attention layers are pre-norm)")
    mamba2.check_sizes(cfg)


def modules(cfg: ModelConfig) -> list[Module]:
    """`models.families.hybrid.model.HybridLM`'s modules (`models.tensors`): per layer its mixer's norm, its
    attention or Mamba-2 mixer, and the feed-forward with its norm."""
    out = [embedding("tok_embeddings", cfg.vocab_size, cfg.d_model)]
    if cfg.pos_encoding == "learned":
        out.append(embedding("pos_embeddings", cfg.max_seq_len, cfg.d_model))
    for i, kind in enumerate(cfg.hybrid_layers):
        mixer = (attention_kind(cfg).modules(cfg, f"layers.{i}.attn") if kind == ATTENTION
                 else mamba2.mixer_modules(cfg, f"layers.{i}.mixer"))
        out += [norm(cfg, f"layers.{i}.mixer_norm"), *mixer, norm(cfg, f"layers.{i}.ffn_norm"),
                *block_ffn(cfg, f"layers.{i}.ffn", i)]
    return out + [norm(cfg, "norm"), output_head(cfg)]


FAMILY = Family(
    arch="hybrid",
    title="hybrid attention + Mamba-2",
    fields=mamba2.FAMILY.fields + ("hybrid_layers",),
    check=_check,
    model="models.families.hybrid.model:HybridLM",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    kv_cache_bytes_per_token=lambda cfg, bytes_per_element: (
        cfg.hybrid_layers.count(ATTENTION) * attention_kind(cfg).cache_width(cfg) * bytes_per_element),
    state_bytes_per_sequence=lambda cfg, bytes_per_element: (
        cfg.hybrid_layers.count(MAMBA) * mamba2.state_bytes(cfg, bytes_per_element)),
    hf_format=lambda cfg: hf_granite_hybrid.FORMAT,
    hf_formats=(hf_granite_hybrid.FORMAT,),
    modules=modules,
    draws_attention=False,
    activations=activations,
    describe=lambda cfg: (f"hybrid {cfg.hybrid_layers.count(ATTENTION)} attention + "
                          f"{cfg.hybrid_layers.count(MAMBA)} Mamba-2" + (" MoE" if cfg.num_experts else "")),
)

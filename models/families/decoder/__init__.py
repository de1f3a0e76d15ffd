"""The decoder-only Transformer (``arch: decoder``): dense or MoE, with either attention kind.

Built as `models.families.decoder.model.Transformer`; exported as Llama / Mixtral (mha) or DeepseekV2 / V3 (mla)
(`HF_FORMAT_OF_ATTENTION`, by attention kind). Accounting (PaLM, Chowdhery et al. 2022,
appendix B; `models.accounting` has the formulas):
- embedding: the token table, a learned position table if any, and the output head unless tied;
- active: total minus, in every MoE layer, the (E - k) routed experts a token does not visit;
- FLOPs per token: 6 N + 6 L H (Q + V) T training, 2 N + 2 L H (Q + V) T forward, with N the active
  non-embedding parameters plus V D, and Q + V the attention kind's score-and-value width (2 K for mha).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.decoder import hf_deepseek, hf_llama
from models.families.parts import Activations, dropout_saved, ffn_params, ffn_sublayer, norm_params, norm_saved
from models.families.spec import Family
from models.layers.kinds import attention_kind
from models.tensors import Module, block_ffn, embedding, norm, output_head

# The Hugging Face class a decoder exports as, by attention kind (`models.layers.kinds`): mha as Llama /
# Mixtral, mla as DeepseekV2, or DeepseekV3 when its MoE layers route with the sigmoid router. A new
# attention kind that decoders may use adds its format here.
HF_FORMAT_OF_ATTENTION = {
    "mha": lambda cfg: hf_llama.FORMAT,
    "mla": hf_deepseek.format_for,
}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    D, V = cfg.d_model, cfg.vocab_size
    embedding = V * D
    if cfg.pos_encoding == "learned":
        embedding += cfg.max_seq_len * D
    if not cfg.tie_embeddings:
        embedding += V * D
    expert = ffn_params(cfg, cfg.resolved_moe_d_ff)
    attention = attention_kind(cfg).params(cfg)
    non_embedding = 0
    inactive = 0
    for i in range(cfg.n_layers):
        non_embedding += 2 * norm_params(cfg) + attention
        if cfg.is_moe_layer(i):
            non_embedding += D * cfg.num_experts + (cfg.num_experts + cfg.moe_shared_experts) * expert
            inactive += (cfg.num_experts - cfg.moe_top_k) * expert
        else:
            non_embedding += ffn_params(cfg, cfg.resolved_d_ff)
    if cfg.norm_position == "pre":
        non_embedding += norm_params(cfg)
    total = embedding + non_embedding
    return {"total": total, "active": total - inactive, "embedding": embedding, "non_embedding": non_embedding,
            "active_non_embedding": non_embedding - inactive}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    n = param_counts(cfg)["active_non_embedding"] + cfg.vocab_size * cfg.d_model
    attn = cfg.n_layers * cfg.n_heads * attention_kind(cfg).score_and_value_width(cfg) * seq_len
    return {"total": 6 * n + 6 * attn, "forward": 2 * n + 2 * attn}


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_element: int) -> int:
    return cfg.n_layers * attention_kind(cfg).cache_width(cfg) * bytes_per_element


def rope_tables(cfg: ModelConfig, b: int, checkpointed: bool = False) -> float:
    """The RoPE cos and sin tables a forward keeps, bytes per token: the model's one fp32 pair, which in fp32
    every layer shares; in 16-bit the layers keep casts of their own (`models.layers.kinds`) and the pair
    is freed, unless the blocks are checkpointed (each checkpoint holds the tables it was called with)."""
    if cfg.pos_encoding != "rope" or (b < 4 and not checkpointed):
        return 0.0
    return 2 * 4 * attention_kind(cfg).rope_head_dim(cfg)


def attention_sublayer(cfg: ModelConfig, seq_len: int, b: int) -> float:
    """A block's attention sublayer, bytes per token: its norm with its input (the residual stream), the
    attention kind's own (`models.layers.kinds`) and the residual dropout's mask."""
    return norm_saved(cfg, b) + attention_kind(cfg).activation_width(cfg, seq_len, b)[0] + dropout_saved(cfg, 1)


def activations(cfg: ModelConfig, seq_len: int, b: int) -> Activations:
    """Per layer: the attention sublayer, then the feed-forward sublayer; widest is the FFN's hidden (k of
    them for MoE) or the attention's widest gradient."""
    layers, widest = [], []
    attention_widest = attention_kind(cfg).activation_width(cfg, seq_len, b)[1]
    for i in range(cfg.n_layers):
        ffn, wide = ffn_sublayer(cfg, i, b)
        layers.append(attention_sublayer(cfg, seq_len, b) + ffn)
        widest.append(max(wide, attention_widest))
    return Activations(stem=rope_tables(cfg, b), layers=tuple(layers), widest=tuple(widest),
                       inputs=(float(b * cfg.d_model),) * cfg.n_layers, stem_checkpointed=rope_tables(cfg, b, True))


def _check(cfg: ModelConfig) -> None:
    """Nothing beyond the attention kind's own checks (which every Transformer family runs)."""


def modules(cfg: ModelConfig) -> list[Module]:
    """`models.families.decoder.model.Transformer`'s modules (`models.tensors`)."""
    out = [embedding("tok_embeddings", cfg.vocab_size, cfg.d_model)]
    if cfg.pos_encoding == "learned":
        out.append(embedding("pos_embeddings", cfg.max_seq_len, cfg.d_model))
    for i in range(cfg.n_layers):
        out += [norm(cfg, f"layers.{i}.attn_norm"), *attention_kind(cfg).modules(cfg, f"layers.{i}.attn"),
                norm(cfg, f"layers.{i}.ffn_norm"), *block_ffn(cfg, f"layers.{i}.ffn", i)]
    if cfg.norm_position == "pre":
        out.append(norm(cfg, "norm"))
    return out + [output_head(cfg)]


FAMILY = Family(
    arch="decoder",
    title="decoder-only Transformer",
    fields=(),
    check=_check,
    model="models.families.decoder.model:Transformer",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    kv_cache_bytes_per_token=kv_cache_bytes_per_token,
    hf_format=lambda cfg: HF_FORMAT_OF_ATTENTION[cfg.attention](cfg),
    hf_formats=(hf_llama.FORMAT, hf_deepseek.FORMAT, hf_deepseek.FORMAT_V3),
    modules=modules,
    describe=lambda cfg: "MoE" if cfg.num_experts else "dense",
    activations=activations,
)

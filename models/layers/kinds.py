"""The attention kinds of a Transformer layer (``ModelConfig.attention``), as entries in one table.

The table sits beside the layers it describes and above them: no layer imports it. A family's model
looks its kind up here and hands the layers what they need (the attention module a block builds, the
cache shape ``KVCache.for_config`` allocates); which Hugging Face class a decoder of each kind exports
as is the decoder family's business (`models.families.decoder`).

- ``mha``: multi-head attention, with GQA/MQA through num_kv_heads (`models.layers.attention.Attention`);
  decoders export as Llama / Mixtral.
- ``mla``: multi-head latent attention (DeepSeek-V2): keys and values from one compressed latent per
  token (`models.layers.mla.MultiHeadLatentAttention`); decoders export as DeepseekV2, or as DeepseekV3 when
  their MoE layers route with the sigmoid router.

Parameters per layer (biases when ``bias``), with D d_model, H heads, G key/value heads, K head_dim:
    mha: D*H*K + 2*D*G*K + H*K*D
    mla: query (D*H*Q, or through the rank-rq latent D*rq + rq + rq*H*Q) + latent D*(R+P) + R
         + up-projection R*H*(Q-P+V) + output H*V*D, with Q = nope + P, R kv_lora_rank, P qk_rope_head_dim
KV-cache elements per layer and token: mha 2*G*K (a key and a value per key/value head); mla R + P
(the latent and the one shared RoPE key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from models.config import ModelConfig
from models.layers.attention import Attention
from models.layers.mla import MultiHeadLatentAttention

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class AttentionKind:
    """One value of ``ModelConfig.attention``: its module, its own fields and checks, its sizes.

    Attributes:
        name: the value of ``attention``.
        fields: ModelConfig fields only this kind reads; under another kind they must stay at their default.
        check: raises ValueError, naming the field, on a config this kind cannot run.
        build: the attention module of one layer.
        params: one layer's attention parameters.
        score_and_value_width: per head, the width of Q K^T plus that of A V (the attention FLOPs term).
        cache_width: per layer and token, the elements the KV cache holds.
        cache_shape: (heads, key width, value width or None for the key width) of ``KVCache``.
        rope_head_dim: how many features of each query/key head RoPE rotates.
        activation_width: per token at a sequence length, the elements one layer's attention keeps for
            backward beyond its input (its norm and residual are the block's), in a training forward.
    """

    name: str
    fields: tuple[str, ...]
    check: Callable[["ModelConfig"], None]
    build: Callable[["ModelConfig"], "nn.Module"]
    params: Callable[["ModelConfig"], int]
    score_and_value_width: Callable[["ModelConfig"], int]
    cache_width: Callable[["ModelConfig"], int]
    cache_shape: Callable[["ModelConfig"], tuple[int, int, int | None]]
    rope_head_dim: Callable[["ModelConfig"], int]
    activation_width: Callable[["ModelConfig", int], float] = lambda cfg, seq_len: 0.0


def _mha_params(cfg: ModelConfig) -> int:
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.resolved_num_kv_heads, cfg.head_dim
    weights = D * H * K + 2 * D * G * K + H * K * D
    biases = (H * K + 2 * G * K + D) if cfg.bias else 0
    return weights + biases


def _check_mha(cfg: ModelConfig) -> None:
    if cfg.pos_encoding == "rope" and cfg.head_dim % 2 != 0:
        raise ValueError(f"pos_encoding 'rope' needs an even head_dim, got d_model/n_heads = {cfg.head_dim}")


def _mla_params(cfg: ModelConfig) -> int:
    D, H = cfg.d_model, cfg.n_heads
    R, P = cfg.resolved_kv_lora_rank, cfg.resolved_qk_rope_head_dim
    Q, V = cfg.resolved_qk_nope_head_dim + P, cfg.resolved_v_head_dim
    b = 1 if cfg.bias else 0
    if cfg.q_lora_rank is None:
        query = D * H * Q + b * H * Q
    else:
        rq = cfg.q_lora_rank
        query = D * rq + b * rq + rq + rq * H * Q + b * H * Q  # q_a_proj, q_a_norm, q_b_proj
    latent = D * (R + P) + b * (R + P) + R  # kv_a_proj, kv_a_norm
    expand = R * H * (Q - P + V) + b * H * (Q - P + V)  # kv_b_proj
    out = H * V * D + b * D
    return query + latent + expand + out


def _check_mla(cfg: ModelConfig) -> None:
    if cfg.pos_encoding != "rope":
        raise ValueError(f"attention 'mla' carries positions in its decoupled RoPE features, so pos_encoding must be "
                         f"'rope', got {cfg.pos_encoding!r}")
    if cfg.num_kv_heads is not None:
        raise ValueError(f"num_kv_heads must be None with attention 'mla' (every head reads the shared latent), "
                         f"got {cfg.num_kv_heads!r}")
    if cfg.resolved_qk_rope_head_dim % 2 != 0:
        raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {cfg.resolved_qk_rope_head_dim}")


def _mha_activations(cfg: ModelConfig, seq_len: int) -> float:
    """mha through ``F.scaled_dot_product_attention`` (flash on CPU and GPU: no T x T scores kept): the
    value projection (G K), the rotated queries and keys (H K + G K; without RoPE the projections
    themselves), the attention output (H K) and its log-sum-exp (H); with attention dropout the explicit
    path keeps the probabilities (H T, and a byte mask)."""
    H, G, K = cfg.n_heads, cfg.resolved_num_kv_heads, cfg.head_dim
    kept = 2 * H * K + 2 * G * K + H
    if cfg.attn_dropout > 0:
        kept += 1.25 * H * seq_len
    return kept


def _mla_activations(cfg: ModelConfig, seq_len: int) -> float:
    """mla as `models.layers.mla` computes it, on the explicit path (its score and value widths differ):
    the latent projection (R + P) and its norm (2 R + 1), the query latent's norm (2 rq + 1) when queries
    are compressed, the scaled queries and keys (2 H Q), the softmax probabilities (H T), the values and
    the attention output (2 H V)."""
    H, R, P = cfg.n_heads, cfg.resolved_kv_lora_rank, cfg.resolved_qk_rope_head_dim
    Q, V = cfg.resolved_qk_nope_head_dim + P, cfg.resolved_v_head_dim
    query = 2 * cfg.q_lora_rank + 1 if cfg.q_lora_rank is not None else 0
    return (R + P) + 2 * R + 1 + query + 2 * H * Q + H * seq_len + 2 * H * V


MHA = AttentionKind(
    name="mha",
    fields=(),
    check=_check_mha,
    build=Attention,
    params=_mha_params,
    score_and_value_width=lambda cfg: 2 * cfg.head_dim,
    cache_width=lambda cfg: 2 * cfg.resolved_num_kv_heads * cfg.head_dim,
    cache_shape=lambda cfg: (cfg.resolved_num_kv_heads, cfg.head_dim, None),
    rope_head_dim=lambda cfg: cfg.head_dim,
    activation_width=_mha_activations,
)

MLA = AttentionKind(
    name="mla",
    fields=("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    check=_check_mla,
    build=MultiHeadLatentAttention,
    params=_mla_params,
    score_and_value_width=lambda cfg: (cfg.resolved_qk_nope_head_dim + cfg.resolved_qk_rope_head_dim
                                       + cfg.resolved_v_head_dim),
    cache_width=lambda cfg: cfg.resolved_kv_lora_rank + cfg.resolved_qk_rope_head_dim,
    cache_shape=lambda cfg: (1, cfg.resolved_kv_lora_rank, cfg.resolved_qk_rope_head_dim),
    rope_head_dim=lambda cfg: cfg.resolved_qk_rope_head_dim,
    activation_width=_mla_activations,
)

# The table: adding an attention kind is one module and one line here.
ATTENTION_KINDS: dict[str, AttentionKind] = {kind.name: kind for kind in (MHA, MLA)}


def attention_kind(cfg: ModelConfig) -> AttentionKind:
    """The entry of ``cfg.attention``."""
    return ATTENTION_KINDS[cfg.attention]

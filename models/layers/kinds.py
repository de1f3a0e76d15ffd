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
from models.tensors import Module, linear, rms_norm

# Each kind's module is imported by its `build`, so that the table, and a config checked against it, load
# without torch.
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
        modules: one layer's attention modules under a path, with the parameters each holds
            (`models.tensors`: what the built module holds, without building it).
        activation_width: (saved, widest): bytes per token one layer's attention keeps for backward beyond
            its input (its norm is the block's), in a training forward at a sequence length and activation
            bytes b, and the widest tensor per token its backward makes.
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
    modules: Callable[["ModelConfig", str], list[Module]]
    activation_width: Callable[["ModelConfig", int, int], tuple[float, float]] = lambda cfg, seq_len, b: (0.0, 0.0)


def _build_mha(cfg: ModelConfig) -> nn.Module:
    from models.layers.attention import Attention

    return Attention(cfg)


def _build_mla(cfg: ModelConfig) -> nn.Module:
    from models.layers.mla import MultiHeadLatentAttention

    return MultiHeadLatentAttention(cfg)


def _mha_params(cfg: ModelConfig) -> int:
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.resolved_num_kv_heads, cfg.head_dim
    weights = D * H * K + 2 * D * G * K + H * K * D
    biases = (H * K + 2 * G * K + D) if cfg.bias else 0
    return weights + biases


def _mha_modules(cfg: ModelConfig, path: str) -> list[Module]:
    """`models.layers.attention.Attention`: q/k/v/o_proj."""
    D, H, G, K, b = cfg.d_model, cfg.n_heads, cfg.resolved_num_kv_heads, cfg.head_dim, cfg.bias
    return [linear(f"{path}.q_proj", D, H * K, b), linear(f"{path}.k_proj", D, G * K, b),
            linear(f"{path}.v_proj", D, G * K, b), linear(f"{path}.o_proj", H * K, D, b)]


def _check_mha(cfg: ModelConfig) -> None:
    if cfg.pos_encoding == "rope" and cfg.head_dim % 2 != 0:
        raise ValueError(f"pos_encoding 'rope' needs an even head_dim, got d_model/n_heads = {cfg.head_dim}")


def _mla_modules(cfg: ModelConfig, path: str) -> list[Module]:
    """`models.layers.mla.MultiHeadLatentAttention`: the query (whole, or through its latent), the key/value
    latent and its norm, the up-projection and the output."""
    D, H, b = cfg.d_model, cfg.n_heads, cfg.bias
    R, P = cfg.resolved_kv_lora_rank, cfg.resolved_qk_rope_head_dim
    Q, V = cfg.resolved_qk_nope_head_dim + P, cfg.resolved_v_head_dim
    if cfg.q_lora_rank is None:
        query = [linear(f"{path}.q_proj", D, H * Q, b)]
    else:
        rq = cfg.q_lora_rank
        query = [linear(f"{path}.q_a_proj", D, rq, b), rms_norm(f"{path}.q_a_norm", rq),
                 linear(f"{path}.q_b_proj", rq, H * Q, b)]
    return query + [linear(f"{path}.kv_a_proj", D, R + P, b), rms_norm(f"{path}.kv_a_norm", R),
                    linear(f"{path}.kv_b_proj", R, H * (Q - P + V), b), linear(f"{path}.o_proj", H * V, D, b)]


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


def _rope_casts(cfg: ModelConfig, b: int, tables: int) -> float:
    """In 16-bit, each layer casts the fp32 RoPE cos and sin to the activations' dtype, and its backward
    keeps the casts (``tables`` of rope_head_dim each); in fp32 the shared tables are the model's."""
    return tables * cfg.rope_head_dim * b if b < 4 and cfg.pos_encoding == "rope" else 0.0


def _mha_activations(cfg: ModelConfig, seq_len: int, b: int) -> tuple[float, float]:
    """mha through ``F.scaled_dot_product_attention`` (flash on CPU and GPU: no T x T scores kept): the
    value projection (G K), the rotated queries and keys (H K + G K; without RoPE the projections
    themselves), the attention output (H K) and its fp32 log-sum-exp (H); in 16-bit, the four RoPE tables
    cast for the queries and keys; with attention dropout the explicit path keeps the probabilities
    (H T, and a byte mask). Its backward makes nothing wider than the FFN's."""
    H, G, K = cfg.n_heads, cfg.resolved_num_kv_heads, cfg.head_dim
    kept = b * (2 * H * K + 2 * G * K) + 4 * H + _rope_casts(cfg, b, 4)
    if cfg.attn_dropout > 0:
        kept += (b + 1) * H * seq_len
    return kept, 0.0


def _mla_activations(cfg: ModelConfig, seq_len: int, b: int) -> tuple[float, float]:
    """mla as `models.layers.mla` computes it, on the explicit path (its score and value widths differ),
    in fp32 whatever the weights: the latent projection and its norm's input and rsqrt (R + P + 1), the
    scaled queries and keys (2 H Q), the softmax probabilities (H T) and the values (H V); in the
    activations' dtype the latent norm's two products (2 R), the attention output (H V) and, in 16-bit,
    the two RoPE tables cast; the query latent's norm (rq + 1 in fp32, rq) when queries are compressed.
    Its backward makes the scores' gradient (H T, fp32)."""
    H, R, P = cfg.n_heads, cfg.resolved_kv_lora_rank, cfg.resolved_qk_rope_head_dim
    Q, V = cfg.resolved_qk_nope_head_dim + P, cfg.resolved_v_head_dim
    query = 4 * (cfg.q_lora_rank + 1) + b * cfg.q_lora_rank if cfg.q_lora_rank is not None else 0
    fp32 = 4 * (R + P + 1 + 2 * H * Q + H * seq_len + H * V)
    return fp32 + b * (2 * R + H * V) + query + _rope_casts(cfg, b, 2), 4 * H * seq_len  # the scores' gradient


MHA = AttentionKind(
    name="mha",
    fields=(),
    check=_check_mha,
    build=_build_mha,
    params=_mha_params,
    modules=_mha_modules,
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
    build=_build_mla,
    params=_mla_params,
    modules=_mla_modules,
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

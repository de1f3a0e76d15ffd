"""The attention kinds of a Transformer layer (``ModelConfig.attention``), as entries in one table.

- ``mha``: multi-head attention, with GQA/MQA through num_kv_heads (`models.attention.Attention`);
  decoders export as Llama / Mixtral.
- ``mla``: multi-head latent attention (DeepSeek-V2): keys and values from one compressed latent per
  token (`models.mla.MultiHeadLatentAttention`); decoders export as DeepseekV2, or as DeepseekV3 when
  their MoE layers route with the sigmoid router.

Parameters per layer (biases when ``bias``), with D d_model, H heads, G key/value heads, K head_dim:
    mha: D*H*K + 2*D*G*K + H*K*D
    mla: query (D*H*Q, or through the rank-rq latent D*rq + rq + rq*H*Q) + latent D*(R+P) + R
         + up-projection R*H*(Q-P+V) + output H*V*D, with Q = nope + P, R kv_lora_rank, P qk_rope_head_dim
KV-cache elements per layer and token: mha 2*G*K (a key and a value per key/value head); mla R + P
(the latent and the one shared RoPE key).
"""

from __future__ import annotations

from models import hf_deepseek, hf_llama
from models.attention import Attention
from models.config import ModelConfig
from models.families.spec import AttentionKind
from models.mla import MultiHeadLatentAttention


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
    hf_format=lambda cfg: hf_llama.FORMAT,
    hf_formats=(hf_llama.FORMAT,),
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
    hf_format=hf_deepseek.format_for,
    hf_formats=(hf_deepseek.FORMAT, hf_deepseek.FORMAT_V3),
)

# The table: adding an attention kind is one module and one line here.
ATTENTION_KINDS: dict[str, AttentionKind] = {kind.name: kind for kind in (MHA, MLA)}


def attention_kind(cfg: ModelConfig) -> AttentionKind:
    """The entry of ``cfg.attention``."""
    return ATTENTION_KINDS[cfg.attention]

"""Parameter and FLOP accounting, computed analytically from the config (no model is built).

Definitions:
- embedding: token embedding table + learned position table (if any) + the output head when it is
  NOT tied (a tied head is the embedding table, counted once).
- non_embedding: everything else (attention, FFN / experts / routers / shared experts, norms, biases).
- active: parameters one token actually uses: total minus, in every MoE layer, the (E - k) routed
  experts it does not visit. Shared experts and routers are always active.

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B):
    total   = 6 * N + 12 * L * H * K * T
    forward = 2 * N +  4 * L * H * K * T
with N = active non-embedding parameters + V * D (the output projection is a matmul whatever the tying;
the input lookup is not), L layers, H query heads, K head_dim, T the sequence length. The attention
term counts Q K^T and A V (2 matmuls * 2 FLOPs per multiply-add) over the full T keys, as PaLM does,
i.e. it does not halve for the causal mask. total = forward + backward (backward = 2 * forward).
Under MLA the two matmuls have different widths, Q K^T over qk_nope_head_dim + qk_rope_head_dim and
A V over v_head_dim, so its attention term is 6 * L * H * (Q + V) * T (forward 2 * ...), which is
PaLM's when Q = V = K. The key/value up-projection (kv_b_proj) is in N: it runs once per token in
training, like every other projection.
Use `total * tokens_per_second / peak_flops` for MFU.

Mamba (arch 'mamba'): the same 6 * N for the projections and the convolution, and in place of the
attention term the selective scan's 9 * E * N FLOPs per token and layer forward (Gu & Dao 2023, section
3.3.2, which counts 9 B L D N for the scan), times 3 for forward + backward. Unlike attention it does not
grow with T.

Encoder-decoder (arch 'encoder_decoder'): N and the attention term per token of either stack, with the
source and target streams taken as equally long (S = T = seq_len): half the FLOPs of one source token
through the encoder plus one target token through the decoder, whose attention term counts self- and
cross-attention. Span corruption makes the source longer than the target, so this is an estimate.
The decoder's cache holds what the formula below gives per target token, and the cross-attention keys
and values take the same bytes per source token, once per request.

KV-cache bytes per token (`kv_cache_bytes_per_token`), what `models.attention.KVCache` stores per
generated or prompt token, over all layers:
    mha / gqa / mqa:  L * 2 * G * K * bytes       (a key and a value for each of G key/value heads)
    mla:              L * (R + P) * bytes          (the latent c_KV and the one shared RoPE key)
with G num_kv_heads (H for MHA, 1 for MQA), R kv_lora_rank, P qk_rope_head_dim.
"""

from __future__ import annotations

from models.config import ModelConfig


def _ffn_params(cfg: ModelConfig, hidden: int) -> int:
    D = cfg.d_model
    if cfg.ffn == "swiglu":
        return 3 * D * hidden + ((2 * hidden + D) if cfg.bias else 0)
    return 2 * D * hidden + ((hidden + D) if cfg.bias else 0)


def _norm_params(cfg: ModelConfig) -> int:
    if cfg.norm == "rmsnorm":
        return cfg.d_model
    return cfg.d_model * (2 if cfg.bias else 1)


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


def _attention_params(cfg: ModelConfig) -> int:
    if cfg.attention == "mla":
        return _mla_params(cfg)
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.resolved_num_kv_heads, cfg.head_dim
    weights = D * H * K + 2 * D * G * K + H * K * D
    biases = (H * K + 2 * G * K + D) if cfg.bias else 0
    return weights + biases


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the model `cfg` describes (equal to sum(p.numel()) of the built model).

    Args:
        cfg: the model config.

    Returns:
        dict with total, active, embedding, non_embedding and active_non_embedding.
    """
    if cfg.arch == "mamba":
        return _mamba_param_counts(cfg)
    if cfg.arch == "encoder_decoder":
        return _encdec_param_counts(cfg)
    D, V = cfg.d_model, cfg.vocab_size
    embedding = V * D
    if cfg.pos_encoding == "learned":
        embedding += cfg.max_seq_len * D
    if not cfg.tie_embeddings:
        embedding += V * D

    expert = _ffn_params(cfg, cfg.resolved_moe_d_ff)
    non_embedding = 0
    inactive = 0
    for i in range(cfg.n_layers):
        non_embedding += 2 * _norm_params(cfg) + _attention_params(cfg)
        if cfg.is_moe_layer(i):
            non_embedding += D * cfg.num_experts + (cfg.num_experts + cfg.moe_shared_experts) * expert
            inactive += (cfg.num_experts - cfg.moe_top_k) * expert
        else:
            non_embedding += _ffn_params(cfg, cfg.resolved_d_ff)
    if cfg.norm_position == "pre":
        non_embedding += _norm_params(cfg)

    total = embedding + non_embedding
    return {
        "total": total,
        "active": total - inactive,
        "embedding": embedding,
        "non_embedding": non_embedding,
        "active_non_embedding": non_embedding - inactive,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Training and forward FLOPs per token (formula in the module docstring).

    Args:
        cfg: the model config.
        seq_len: T, the training sequence length.

    Returns:
        dict with total (forward + backward) and forward.

    Raises:
        ValueError: if seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = param_counts(cfg)["active_non_embedding"] + cfg.vocab_size * cfg.d_model
    if cfg.arch == "mamba":
        scan = 9 * cfg.n_layers * cfg.ssm_d_inner * cfg.ssm_state_size
        return {"total": 6 * n + 3 * scan, "forward": 2 * n + scan}
    if cfg.arch == "encoder_decoder":
        n_enc, n_dec, L_enc = _encdec_stack_params(cfg)
        n = (n_enc + n_dec + cfg.vocab_size * cfg.d_model) / 2
        attn = (L_enc + 2 * cfg.n_layers) * cfg.n_heads * 2 * cfg.head_dim * seq_len / 2
        return {"total": round(6 * n + 6 * attn), "forward": round(2 * n + 2 * attn)}
    if cfg.attention == "mla":
        qk_plus_v = cfg.resolved_qk_nope_head_dim + cfg.resolved_qk_rope_head_dim + cfg.resolved_v_head_dim
    else:
        qk_plus_v = 2 * cfg.head_dim
    attn = cfg.n_layers * cfg.n_heads * qk_plus_v * seq_len  # = 2 * L * H * K * T for MHA
    return {"total": 6 * n + 6 * attn, "forward": 2 * n + 2 * attn}


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """Bytes the KV cache holds per token over all layers (formula in the module docstring).

    Args:
        cfg: the model config.
        bytes_per_element: 2 for a bf16/fp16 cache (the default), 4 for fp32.

    Returns:
        Bytes per cached token.

    Raises:
        ValueError: if bytes_per_element < 1.
    """
    if bytes_per_element < 1:
        raise ValueError(f"bytes_per_element must be >= 1, got {bytes_per_element}")
    if cfg.arch == "mamba":
        return 0  # a fixed-size state (models.mamba.MambaState), nothing per token
    if cfg.attention == "mla":
        per_layer = cfg.resolved_kv_lora_rank + cfg.resolved_qk_rope_head_dim
    else:
        per_layer = 2 * cfg.resolved_num_kv_heads * cfg.head_dim
    return cfg.n_layers * per_layer * bytes_per_element


def _mamba_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """`param_counts` of a Mamba model: per layer a norm, in_proj (D -> 2E), the depthwise conv (E x K and
    its bias), x_proj (E -> R + 2N), dt_proj (R -> E with bias), A_log (E x N), D (E) and out_proj (E -> D)."""
    D, V, E, N = cfg.d_model, cfg.vocab_size, cfg.ssm_d_inner, cfg.ssm_state_size
    R, K = cfg.resolved_ssm_dt_rank, cfg.ssm_conv_kernel
    layer = (D + D * 2 * E + E * K + E + E * (R + 2 * N) + R * E + E + E * N + E + E * D
             + ((2 * E + D) if cfg.bias else 0))
    embedding = V * D * (1 if cfg.tie_embeddings else 2)
    non_embedding = cfg.n_layers * layer + D
    total = embedding + non_embedding
    return {"total": total, "active": total, "embedding": embedding, "non_embedding": non_embedding,
            "active_non_embedding": non_embedding}


def _encdec_stack_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(encoder, decoder) non-embedding parameters and the encoder depth. An encoder layer is a decoder
    layer without cross-attention: two norms, self-attention, FFN; a decoder layer adds a norm and the
    cross-attention; pre-norm stacks end in one norm each, and embedding_norm adds one per stack."""
    final = _norm_params(cfg) if cfg.norm_position == "pre" else 0
    enc_layer = 2 * _norm_params(cfg) + _attention_params(cfg) + _ffn_params(cfg, cfg.resolved_d_ff)
    dec_layer = enc_layer + _norm_params(cfg) + _attention_params(cfg)
    final += _norm_params(cfg) if cfg.embedding_norm else 0
    L_enc = cfg.resolved_n_encoder_layers
    return L_enc * enc_layer + final, cfg.n_layers * dec_layer + final, L_enc


def _encdec_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """`param_counts` of an encoder-decoder: one shared token table, one learned position table per stack."""
    D, V = cfg.d_model, cfg.vocab_size
    embedding = V * D * (1 if cfg.tie_embeddings else 2)
    if cfg.pos_encoding == "learned":
        embedding += 2 * cfg.max_seq_len * D
    n_enc, n_dec, _ = _encdec_stack_params(cfg)
    total = embedding + n_enc + n_dec
    return {"total": total, "active": total, "embedding": embedding, "non_embedding": n_enc + n_dec,
            "active_non_embedding": n_enc + n_dec}

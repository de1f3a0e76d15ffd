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
Use `total * tokens_per_second / peak_flops` for MFU.

Mamba (arch 'mamba'): the same 6 * N for the projections and the convolution, and in place of the
attention term the selective scan's 9 * E * N FLOPs per token and layer forward (Gu & Dao 2023, section
3.3.2, which counts 9 B L D N for the scan), times 3 for forward + backward. Unlike attention it does not
grow with T.
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


def _attention_params(cfg: ModelConfig) -> int:
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
    attn = cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return {"total": 6 * n + 12 * attn, "forward": 2 * n + 4 * attn}


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

"""Mamba (``arch: mamba``, Gu & Dao 2023): selective state-space blocks, no attention.

Built as `models.mamba.MambaLM`, exported as MambaForCausalLM (`models.hf_mamba`). Its own fields are
the ssm_* sizes. A Mamba block is pre-norm RMSNorm with no positions, attention or experts, so a
config asking for those is refused rather than silently ignored.

Accounting: per layer a norm, in_proj (D -> 2E), the depthwise conv (E x K and its bias), x_proj
(E -> R + 2N), dt_proj (R -> E with bias), A_log (E x N), D (E) and out_proj (E -> D). FLOPs: 6 N for
the projections and the convolution, and in place of attention the selective scan's 9 E N per token and
layer forward (Gu & Dao, section 3.3.2), times 3 for forward + backward; it does not grow with T. The
generation state is fixed-size (`models.mamba.MambaState`): nothing is cached per token.
"""

from __future__ import annotations

from models import hf_mamba
from models.config import ModelConfig
from models.families.parts import require
from models.families.spec import Family
from models.mamba import MambaLM


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    D, V, E, N = cfg.d_model, cfg.vocab_size, cfg.ssm_d_inner, cfg.ssm_state_size
    R, K = cfg.resolved_ssm_dt_rank, cfg.ssm_conv_kernel
    layer = (D + D * 2 * E + E * K + E + E * (R + 2 * N) + R * E + E + E * N + E + E * D
             + ((2 * E + D) if cfg.bias else 0))
    embedding = V * D * (1 if cfg.tie_embeddings else 2)
    non_embedding = cfg.n_layers * layer + D
    total = embedding + non_embedding
    return {"total": total, "active": total, "embedding": embedding, "non_embedding": non_embedding,
            "active_non_embedding": non_embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    n = param_counts(cfg)["active_non_embedding"] + cfg.vocab_size * cfg.d_model
    scan = 9 * cfg.n_layers * cfg.ssm_d_inner * cfg.ssm_state_size
    return {"total": 6 * n + 3 * scan, "forward": 2 * n + scan}


def _check(cfg: ModelConfig) -> None:
    require(cfg, {"attention": "mha", "pos_encoding": "none", "norm": "rmsnorm", "norm_position": "pre",
                  "num_experts": 0, "attn_dropout": 0.0},
            why=" (Mamba has no attention, positions or experts)", hint="; the presets debug_mamba and mamba set it")


FAMILY = Family(
    arch="mamba",
    title="Mamba",
    fields=("ssm_state_size", "ssm_conv_kernel", "ssm_expand", "ssm_dt_rank"),
    check=_check,
    model_class=MambaLM,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    kv_cache_bytes_per_token=lambda cfg, bytes_per_element: 0,
    hf_format=lambda cfg: hf_mamba.FORMAT,
    hf_formats=(hf_mamba.FORMAT,),
    draws_attention=False,
    describe=lambda cfg: "Mamba",
)

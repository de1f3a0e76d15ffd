"""Mamba-2 (``arch: mamba2``, Dao & Gu 2024): state-space dual blocks, trained by the chunked algorithm.

Built as `models.mamba2.Mamba2LM`, exported as Mamba2ForCausalLM (`models.hf_mamba2`). Its own fields
are ssm_head_dim, ssm_n_groups and ssm_chunk_size, beside the ssm_state_size, ssm_conv_kernel and
ssm_expand it shares with Mamba. Like Mamba, no positions, attention or experts.

Accounting: per layer a norm, in_proj (D -> E + C + H, C = E + 2 G N the conv width), the depthwise
conv (C x K and its bias), dt_bias, A_log and D (H each), the gated norm (E) and out_proj (E -> D).
FLOPs, forward per token and layer, of the chunked algorithm as computed (Q = ssm_chunk_size): the
within-chunk scores C B^T and their product with the inputs, 2 Q H (N + P) (the whole Q x Q block,
masked half included), and the chunk states in and out, 4 H P N; times 3 for forward + backward. It does
not grow with T. The generation state is fixed-size (`models.mamba2.Mamba2State`).
"""

from __future__ import annotations

from models import hf_mamba2
from models.config import ModelConfig
from models.families.mamba import require_ssm, stack_counts, stack_flops
from models.families.spec import Family
from models.mamba2 import Mamba2LM


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    D, E, N, K = cfg.d_model, cfg.ssm_d_inner, cfg.ssm_state_size, cfg.ssm_conv_kernel
    H, G = cfg.ssm_heads, cfg.ssm_n_groups
    conv = E + 2 * G * N
    layer = D + D * (E + conv + H) + conv * K + conv + 3 * H + E + E * D + (((E + conv + H) + D) if cfg.bias else 0)
    return stack_counts(cfg, layer)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    H, P, N, Q = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state_size, cfg.ssm_chunk_size
    return stack_flops(cfg, param_counts(cfg), cfg.n_layers * (2 * Q * H * (N + P) + 4 * H * P * N))


def _check(cfg: ModelConfig) -> None:
    require_ssm(cfg, "Mamba-2", "debug_mamba2 and mamba2")
    for name in ("ssm_head_dim", "ssm_n_groups", "ssm_chunk_size"):
        if not isinstance(getattr(cfg, name), int) or isinstance(getattr(cfg, name), bool) or getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be an int >= 1, got {getattr(cfg, name)!r}")
    if cfg.ssm_d_inner % cfg.ssm_head_dim:
        raise ValueError(f"ssm_head_dim ({cfg.ssm_head_dim}) must divide the inner width ssm_expand x d_model "
                         f"({cfg.ssm_d_inner})")
    if cfg.ssm_heads % cfg.ssm_n_groups:
        raise ValueError(f"ssm_n_groups ({cfg.ssm_n_groups}) must divide the heads ({cfg.ssm_heads} = "
                         f"{cfg.ssm_d_inner} / ssm_head_dim {cfg.ssm_head_dim})")


FAMILY = Family(
    arch="mamba2",
    title="Mamba-2",
    fields=("ssm_state_size", "ssm_conv_kernel", "ssm_expand", "ssm_head_dim", "ssm_n_groups", "ssm_chunk_size"),
    check=_check,
    model_class=Mamba2LM,
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    kv_cache_bytes_per_token=lambda cfg, bytes_per_element: 0,
    hf_format=lambda cfg: hf_mamba2.FORMAT,
    hf_formats=(hf_mamba2.FORMAT,),
    draws_attention=False,
    describe=lambda cfg: "Mamba-2",
)

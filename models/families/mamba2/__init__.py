"""Mamba-2 (``arch: mamba2``, Dao & Gu 2024): state-space dual blocks, trained by the chunked algorithm.

Built as `models.families.mamba2.model.Mamba2LM`, exported as Mamba2ForCausalLM
(`models.families.mamba2.hf_mamba2`). Its own fields are ssm_head_dim, ssm_n_groups and ssm_chunk_size, beside the
ssm_state_size, ssm_conv_kernel and ssm_expand it shares with Mamba. Like Mamba, no positions, attention or
experts.

Accounting: per layer a norm, in_proj (D -> E + C + H, C = E + 2 G N the conv width), the depthwise
conv (C x K and its bias), dt_bias, A_log and D (H each), the gated norm (E) and out_proj (E -> D).
FLOPs, forward per token and layer, of the chunked algorithm as computed (Q = ssm_chunk_size): the
within-chunk scores C B^T and their product with the inputs, 2 Q H (N + P) (the whole Q x Q block,
masked half included), and the chunk states in and out, 4 H P N; times 3 for forward + backward. It does
not grow with T. The generation state is fixed-size (`models.families.mamba2.model.Mamba2State`): per layer and sequence
(K - 1)(E + 2 G N) conv inputs in the model's dtype and H P N fp32 state values (`state_bytes`).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.mamba import require_ssm, stack_counts, stack_flops, stack_modules
from models.families.mamba2 import hf_mamba2
from models.families.parts import Activations, norm_saved
from models.families.spec import Family
from models.tensors import Module, linear


def mixer_params(cfg: ModelConfig) -> int:
    """One Mamba-2 mixer's parameters (its block's norm not included)."""
    D, E, N, K = cfg.d_model, cfg.ssm_d_inner, cfg.ssm_state_size, cfg.ssm_conv_kernel
    H, G = cfg.ssm_heads, cfg.ssm_n_groups
    conv = E + 2 * G * N
    return D * (E + conv + H) + conv * K + conv + 3 * H + E + E * D + (((E + conv + H) + D) if cfg.bias else 0)


def mixing_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of one mixer's chunked scan (module docstring), beyond its projections."""
    H, P, N, Q = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state_size, cfg.ssm_chunk_size
    return 2 * Q * H * (N + P) + 4 * H * P * N


def state_bytes(cfg: ModelConfig, bytes_per_element: int) -> int:
    """One mixer's generation state per sequence: the conv's last K - 1 inputs (E + 2 G N wide, in the
    model's dtype) and the (H, P, N) state in fp32."""
    conv = cfg.ssm_d_inner + 2 * cfg.ssm_n_groups * cfg.ssm_state_size
    ssm = cfg.ssm_heads * cfg.ssm_head_dim * cfg.ssm_state_size
    return conv * (cfg.ssm_conv_kernel - 1) * bytes_per_element + ssm * 4


def mixer_activations(cfg: ModelConfig, b: int) -> tuple[float, float]:
    """(saved, widest) bytes per token of one Mamba-2 mixer in a training forward, as `model` computes it.

    The scan runs in fp32 whatever the weights: dt, its softplus and decays (4 H), B and C spread over the
    heads (5 H N), the within-chunk scores, decays and their product (3 H Q), the chunk states (H P N / Q),
    the running state sums (7 N). In fp32 it also keeps in_proj's output (2 E + 2 G N + H, the widest), the
    padded conv input, the conv and its SiLU (3 C, C = E + 2 G N) and the inputs, gate, skip and gated norm
    (8 E). In 16-bit the padded conv input and the conv (2 C) and the gated norm's two products (2 E) are
    in the activations' dtype, and the scan keeps fp32 copies of the inputs, gate and outputs (9 E) instead
    of in_proj's output and the SiLU."""
    E, N, G, H = cfg.ssm_d_inner, cfg.ssm_state_size, cfg.ssm_n_groups, cfg.ssm_heads
    P, Q = cfg.ssm_head_dim, cfg.ssm_chunk_size
    conv = E + 2 * G * N
    in_proj = 2 * E + 2 * G * N + H
    scan = 4 * H + 5 * H * N + 3 * H * Q + H * P * N / Q + 7 * N
    if b == 4:
        return 4 * (in_proj + 3 * conv + 8 * E + scan), 4 * in_proj
    return b * (2 * conv + 2 * E) + 4 * (9 * E + scan), b * in_proj


def activations(cfg: ModelConfig, seq_len: int, b: int) -> Activations:
    """Per layer: its norm with its input, and its mixer (`mixer_activations`)."""
    saved, widest = mixer_activations(cfg, b)
    L = cfg.n_layers
    return Activations(stem=0.0, layers=(norm_saved(cfg, b) + saved,) * L, widest=(widest,) * L,
                       inputs=(float(b * cfg.d_model),) * L)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    return stack_counts(cfg, cfg.d_model + mixer_params(cfg))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    return stack_flops(cfg, param_counts(cfg), cfg.n_layers * mixing_flops(cfg))


def check_sizes(cfg: ModelConfig) -> None:
    """Mamba-2's own sizes: whole, positive, and dividing as the heads and groups need (naming the field)."""
    for name in ("ssm_head_dim", "ssm_n_groups", "ssm_chunk_size"):
        if not isinstance(getattr(cfg, name), int) or isinstance(getattr(cfg, name), bool) or getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be an int >= 1, got {getattr(cfg, name)!r}")
    if cfg.ssm_d_inner % cfg.ssm_head_dim:
        raise ValueError(f"ssm_head_dim ({cfg.ssm_head_dim}) must divide the inner width ssm_expand x d_model "
                         f"({cfg.ssm_d_inner})")
    if cfg.ssm_heads % cfg.ssm_n_groups:
        raise ValueError(f"ssm_n_groups ({cfg.ssm_n_groups}) must divide the heads ({cfg.ssm_heads} = "
                         f"{cfg.ssm_d_inner} / ssm_head_dim {cfg.ssm_head_dim})")


def _check(cfg: ModelConfig) -> None:
    require_ssm(cfg, "Mamba-2", "debug_mamba2 and mamba2")
    check_sizes(cfg)


def mixer_modules(cfg: ModelConfig, path: str) -> list[Module]:
    """`models.families.mamba2.model.Mamba2Mixer`: the per-head dynamics (dt_bias, A_log, D) it holds itself,
    the input projection, the depthwise convolution over x, B and C, the gated norm and the output."""
    D, E, N, G, K, H = (cfg.d_model, cfg.ssm_d_inner, cfg.ssm_state_size, cfg.ssm_n_groups, cfg.ssm_conv_kernel,
                        cfg.ssm_heads)
    conv = E + 2 * G * N
    return [Module(path, (H, H, H)), linear(f"{path}.in_proj", D, E + conv + H, cfg.bias),
            Module(f"{path}.conv1d", (conv * K, conv)), Module(f"{path}.norm", (E,)),
            linear(f"{path}.out_proj", E, D, cfg.bias)]


FAMILY = Family(
    arch="mamba2",
    title="Mamba-2",
    fields=("ssm_state_size", "ssm_conv_kernel", "ssm_expand", "ssm_head_dim", "ssm_n_groups", "ssm_chunk_size"),
    check=_check,
    model="models.families.mamba2.model:Mamba2LM",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    kv_cache_bytes_per_token=lambda cfg, bytes_per_element: 0,
    state_bytes_per_sequence=lambda cfg, bytes_per_element: cfg.n_layers * state_bytes(cfg, bytes_per_element),
    hf_format=lambda cfg: hf_mamba2.FORMAT,
    hf_formats=(hf_mamba2.FORMAT,),
    modules=lambda cfg: stack_modules(cfg, mixer_modules),
    draws_attention=False,
    describe=lambda cfg: "Mamba-2",
    activations=activations,
)

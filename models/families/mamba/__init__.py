"""Mamba (``arch: mamba``, Gu & Dao 2023): selective state-space blocks, no attention.

Built as `models.families.mamba.model.MambaLM`, exported as MambaForCausalLM (`models.families.mamba.hf_mamba`).
Its own fields are the ssm_* sizes. A Mamba block is pre-norm RMSNorm with no positions, attention or experts, so a
config asking for those is refused rather than silently ignored.

Accounting: per layer a norm, in_proj (D -> 2E), the depthwise conv (E x K and its bias), x_proj
(E -> R + 2N), dt_proj (R -> E with bias), A_log (E x N), D (E) and out_proj (E -> D). FLOPs: 6 N for
the projections and the convolution, and in place of attention the selective scan's 9 E N per token and
layer forward (Gu & Dao, section 3.3.2), times 3 for forward + backward; it does not grow with T. The
generation state is fixed-size (`models.families.mamba.model.MambaState`): nothing is cached per token; per layer and
sequence it holds (K - 1) E conv inputs in the model's dtype and E N fp32 state values.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.mamba import hf_mamba
from models.families.parts import Activations, norm_saved, require
from models.families.spec import Family
from models.tensors import Module, embedding, linear, output_head, rms_norm

# Steps per chunk of the parallel scan (`model`): the fastest of 1-32 on CPU (benchmarks/mamba_speed.py). Here,
# not in torch's `model`, because the accounting below counts the states it keeps.
SCAN_CHUNK = 4


def stack_counts(cfg: ModelConfig, layer: int) -> dict[str, int]:
    """The parameter counts of an SSM language model of ``layer`` parameters per block: the blocks,
    the final norm and the embedding (and untied head); every parameter is active."""
    D, V = cfg.d_model, cfg.vocab_size
    embedding = V * D * (1 if cfg.tie_embeddings else 2)
    non_embedding = cfg.n_layers * layer + D
    total = embedding + non_embedding
    return {"total": total, "active": total, "embedding": embedding, "non_embedding": non_embedding,
            "active_non_embedding": non_embedding}


def stack_flops(cfg: ModelConfig, counts: dict[str, int], mixing: int) -> dict[str, int]:
    """6 x the matmul parameters (head included) + 3 x the sequence mixing's forward FLOPs per token."""
    n = counts["active_non_embedding"] + cfg.vocab_size * cfg.d_model
    return {"total": 6 * n + 3 * mixing, "forward": 2 * n + mixing}


def require_ssm(cfg: ModelConfig, title: str, presets: str) -> None:
    """No attention, positions or experts: what every SSM family refuses, naming the field."""
    require(cfg, {"attention": "mha", "pos_encoding": "none", "norm": "rmsnorm", "norm_position": "pre",
                  "num_experts": 0, "attn_dropout": 0.0},
            why=f" ({title} has no attention, positions or experts)", hint=f"; the presets {presets} set it")


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    D, E, N = cfg.d_model, cfg.ssm_d_inner, cfg.ssm_state_size
    R, K = cfg.resolved_ssm_dt_rank, cfg.ssm_conv_kernel
    layer = (D + D * 2 * E + E * K + E + E * (R + 2 * N) + R * E + E + E * N + E + E * D
             + ((2 * E + D) if cfg.bias else 0))
    return stack_counts(cfg, layer)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    return stack_flops(cfg, param_counts(cfg), 9 * cfg.n_layers * cfg.ssm_d_inner * cfg.ssm_state_size)


def activations(cfg: ModelConfig, seq_len: int, b: int) -> Activations:
    """Per layer and token: its norm with its input; then the mixer. In fp32: in_proj's output (2 E, the
    widest), the padded conv input, the conv, the two SiLUs, delta's projection, bias and softplus, the skip
    and gate products (9 E beyond in_proj), x_proj's output (R + 2 N) and the scan's one state per chunk
    (E N / SCAN_CHUNK). In 16-bit the conv input, the conv, its activation and the output cast (4 E) and
    x_proj's output stay in the activations' dtype, and the scan keeps fp32 copies of its inputs (delta,
    its softplus, x, gate and skip terms: 7 E; B and C: 2 N) beside its states. The scan's backward
    (`model._SelectiveScan`) recomputes one chunk at a time and holds about nine (B, SCAN_CHUNK, E, N) fp32
    tensors at once (the log decays, states, their shifted copy, the decays, the outputs' gradient and its
    shifted decays, the states' gradient, the decay gradient and an einsum's product): per sequence, not per
    token, so it enters the widest term divided by the sequence length."""
    E, N, R = cfg.ssm_d_inner, cfg.ssm_state_size, cfg.resolved_ssm_dt_rank
    states = E * N / SCAN_CHUNK
    if b == 4:
        mixer = 4 * (11 * E + R + 2 * N + states)
    else:
        mixer = b * (4 * E + R + 2 * N) + 4 * (7 * E + 2 * N + states)
    L = cfg.n_layers
    widest = 2.0 * E * b + 9 * 4 * SCAN_CHUNK * E * N / seq_len
    return Activations(stem=0.0, layers=(norm_saved(cfg, b) + mixer,) * L, widest=(widest,) * L,
                       inputs=(float(b * cfg.d_model),) * L)


def _check(cfg: ModelConfig) -> None:
    require_ssm(cfg, "Mamba", "debug_mamba and mamba")


def stack_modules(cfg: ModelConfig, mixer) -> list[Module]:
    """`models.families.mamba.model.MambaLM`'s modules (`models.tensors`), each layer an RMSNorm and the
    modules ``mixer(cfg, path)`` lists."""
    out = [embedding("tok_embeddings", cfg.vocab_size, cfg.d_model)]
    for i in range(cfg.n_layers):
        out += [rms_norm(f"layers.{i}.norm", cfg.d_model), *mixer(cfg, f"layers.{i}.mixer")]
    return out + [rms_norm("norm", cfg.d_model), output_head(cfg)]


def mixer_modules(cfg: ModelConfig, path: str) -> list[Module]:
    """`models.families.mamba.model.MambaMixer`: the dynamics (A_log, D) it holds itself, and its projections
    and depthwise convolution."""
    D, E, N, R, K = cfg.d_model, cfg.ssm_d_inner, cfg.ssm_state_size, cfg.resolved_ssm_dt_rank, cfg.ssm_conv_kernel
    return [Module(path, (E * N, E)), linear(f"{path}.in_proj", D, 2 * E, cfg.bias),
            Module(f"{path}.conv1d", (E * K, E)), linear(f"{path}.x_proj", E, R + 2 * N, False),
            linear(f"{path}.dt_proj", R, E, True), linear(f"{path}.out_proj", E, D, cfg.bias)]


FAMILY = Family(
    arch="mamba",
    title="Mamba",
    fields=("ssm_state_size", "ssm_conv_kernel", "ssm_expand", "ssm_dt_rank"),
    check=_check,
    model="models.families.mamba.model:MambaLM",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    kv_cache_bytes_per_token=lambda cfg, bytes_per_element: 0,
    state_bytes_per_sequence=lambda cfg, bytes_per_element: cfg.n_layers * (
        cfg.ssm_d_inner * (cfg.ssm_conv_kernel - 1) * bytes_per_element + cfg.ssm_d_inner * cfg.ssm_state_size * 4),
    hf_format=lambda cfg: hf_mamba.FORMAT,
    hf_formats=(hf_mamba.FORMAT,),
    modules=lambda cfg: stack_modules(cfg, mixer_modules),
    draws_attention=False,
    describe=lambda cfg: "Mamba",
    activations=activations,
)

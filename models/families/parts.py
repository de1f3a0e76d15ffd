"""Parameter counts of the parts the families share (an FFN, a norm), computed from the config.

Shape legend: D d_model, H n_heads, G key/value heads, K head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig


def ffn_params(cfg: ModelConfig, hidden: int) -> int:
    """One feed-forward of width `hidden`: SwiGLU's three matrices or two, and their biases."""
    D = cfg.d_model
    if cfg.ffn == "swiglu":
        return 3 * D * hidden + ((2 * hidden + D) if cfg.bias else 0)
    return 2 * D * hidden + ((hidden + D) if cfg.bias else 0)


def norm_params(cfg: ModelConfig) -> int:
    """One norm over d_model: RMSNorm's weight, or LayerNorm's weight and (with bias) its bias."""
    if cfg.norm == "rmsnorm":
        return cfg.d_model
    return cfg.d_model * (2 if cfg.bias else 1)


def require(cfg: ModelConfig, needed: dict[str, object], why: str = "", hint: str = "") -> None:
    """Refuse a config whose fields differ from what a family needs, naming the first such field.

    Raises:
        ValueError: "<field> must be <needed> when arch is <arch><why>, got <value><hint>".
    """
    for name, value in needed.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"{name} must be {value!r} when arch is {cfg.arch!r}{why}, got {getattr(cfg, name)!r}"
                             f"{hint}")


# ---- activations: what a training forward keeps for backward ---------------------------------------
# Counted from the code, operator by operator (checked against the live tensors of a real step in fp32
# and in bf16, pipeline.plan.measure): every tensor an autograd node saves, in bytes per token, for
# activations of ``b`` bytes (4: fp32 or amp_bf16, 2: bf16 or fp16). What the code computes in fp32
# whatever the weights (norm statistics, softmax, the SSM scans) counts 4 bytes in both. A tensor two
# nodes save is counted once; a tensor a node only reads and frees is not counted.


@dataclass(frozen=True)
class Activations:
    """What one training forward keeps, in bytes per token of a micro-batch.

    Attributes:
        stem: kept outside the layers (position tables).
        layers: per layer, what it keeps (the residual stream it reads included).
        widest: per layer, the widest tensor its backward makes (the transient of its backward).
        inputs: per layer, what activation checkpointing keeps of it (the block's inputs).
        stem_checkpointed: kept outside the layers under activation checkpointing (the checkpoints hold
            the tables every block is called with); None: the same as ``stem``.
    """

    stem: float
    layers: tuple[float, ...]
    widest: tuple[float, ...]
    inputs: tuple[float, ...]
    stem_checkpointed: float | None = None


def norm_saved(cfg: ModelConfig, b: int) -> float:
    """A norm with its input, per token. RMSNorm keeps its input in fp32 (the input itself in fp32, a copy
    otherwise) and its rsqrt, then x * rsqrt (in the activation dtype) and its product with the weight
    (the next matmul's input); LayerNorm keeps its input and output and its fp32 mean and rstd."""
    if cfg.norm == "rmsnorm":
        return 4 * (cfg.d_model + 1) + b * 2 * cfg.d_model
    return b * 2 * cfg.d_model + 8


def ffn_saved(cfg: ModelConfig, hidden: int, b: int) -> float:
    """A feed-forward's saved bytes per token beyond its input: SwiGLU keeps w1 x, silu(w1 x), w3 x and
    their product; GELU w1 x and its activation; ReLU only its output (which its backward reads)."""
    return {"swiglu": 4, "gelu": 2, "relu": 1}[cfg.ffn] * hidden * b


def moe_saved(cfg: ModelConfig, b: int) -> float:
    """An MoE feed-forward's saved bytes per token beyond its input: the router's logits and
    probabilities (2 E), the top-k values, indices and slot order (about 6 k), and for each of the k
    routed copies its gathered input, the experts' hidden (as a dense FFN of moe_d_ff) and its output
    before and after the gate (k (2 D + FFN)); each shared expert as a dense FFN plus its output."""
    k, D, F = cfg.moe_top_k, cfg.d_model, cfg.resolved_moe_d_ff
    routed = b * (2 * cfg.num_experts + 6 * k + 2 * k * D) + k * ffn_saved(cfg, F, b)
    return routed + cfg.moe_shared_experts * (ffn_saved(cfg, F, b) + b * D)


def dropout_saved(cfg: ModelConfig, sites: int) -> float:
    """Dropout's masks, one byte per element, at ``sites`` D-wide places (none without dropout)."""
    return sites * cfg.d_model if cfg.dropout > 0 else 0.0


def ffn_sublayer(cfg: ModelConfig, layer: int, b: int) -> tuple[float, float]:
    """(saved, widest) bytes per token of a layer's feed-forward sublayer: its norm with its input (the
    residual sum before it) and its FFN (dense or MoE)."""
    if cfg.is_moe_layer(layer):
        widest = cfg.moe_top_k * cfg.resolved_moe_d_ff * b
        body = moe_saved(cfg, b)
    else:
        widest = cfg.resolved_d_ff * b
        body = ffn_saved(cfg, cfg.resolved_d_ff, b)
    return norm_saved(cfg, b) + body + dropout_saved(cfg, 1), widest

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
# Counted from the code, operator by operator, for an fp32 step (checked against the live tensors of a
# real step, pipeline.plan.measure): every tensor an autograd node saves, in elements per token. A
# tensor two nodes save is counted once; a tensor a node only reads and frees is not counted.


@dataclass(frozen=True)
class Activations:
    """What one training forward keeps, per token of a micro-batch.

    Attributes:
        stem: elements kept outside the layers (the embedding output, position tables).
        layers: per layer, the elements it keeps (its input included: the residual stream it reads).
        widest: per layer, the widest tensor its backward makes per token (the transient of its backward).
        inputs: per layer, what activation checkpointing keeps of it (the block's input).
    """

    stem: float
    layers: tuple[float, ...]
    widest: tuple[float, ...]
    inputs: tuple[float, ...]


def norm_saved(cfg: ModelConfig) -> float:
    """A norm's saved elements per token: RMSNorm keeps x * rsqrt and its product with the weight (the
    next matmul's input) and the rsqrt; LayerNorm its output, mean and rstd (its input is the residual)."""
    return 2 * cfg.d_model + 1 if cfg.norm == "rmsnorm" else cfg.d_model + 2


def ffn_saved(cfg: ModelConfig, hidden: int) -> float:
    """A feed-forward's saved elements per token beyond its input: SwiGLU keeps w1 x, silu(w1 x), w3 x and
    their product; GELU w1 x and its activation; ReLU only its output (which its backward reads)."""
    return {"swiglu": 4, "gelu": 2, "relu": 1}[cfg.ffn] * hidden


def moe_saved(cfg: ModelConfig) -> float:
    """An MoE feed-forward's saved elements per token beyond its input: the router's logits and
    probabilities (2 E), the top-k values, indices and slot order (about 6 k), and for each of the k
    routed copies its gathered input, the experts' hidden (as a dense FFN of moe_d_ff) and its output
    before and after the gate (k (2 D + FFN)); each shared expert as a dense FFN plus its output."""
    k, D, F = cfg.moe_top_k, cfg.d_model, cfg.resolved_moe_d_ff
    routed = 2 * cfg.num_experts + 6 * k + k * (2 * D + ffn_saved(cfg, F))
    return routed + cfg.moe_shared_experts * (ffn_saved(cfg, F) + D)


def dropout_saved(cfg: ModelConfig, sites: int) -> float:
    """Dropout's masks (one byte per element, a quarter of an fp32 element) at ``sites`` D-wide places."""
    return sites * cfg.d_model / 4 if cfg.dropout > 0 else 0.0


def ffn_sublayer(cfg: ModelConfig, layer: int) -> tuple[float, float]:
    """(saved, widest) per token of a layer's feed-forward sublayer: its norm, its FFN (dense or MoE)
    and the residual sum it writes."""
    if cfg.is_moe_layer(layer):
        widest = cfg.moe_top_k * cfg.resolved_moe_d_ff
        body = moe_saved(cfg)
    else:
        widest = cfg.resolved_d_ff
        body = ffn_saved(cfg, cfg.resolved_d_ff)
    return norm_saved(cfg) + body + cfg.d_model + dropout_saved(cfg, 1), widest

"""Parameter counts of the parts the families share (an FFN, a norm), computed from the config.

Shape legend: D d_model, H n_heads, G key/value heads, K head_dim.
"""

from __future__ import annotations

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

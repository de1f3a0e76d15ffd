"""Normalisation layers: RMSNorm (our own) and LayerNorm.

Shape legend: B batch, T time (sequence), D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): y = x * rsqrt(mean(x^2) + eps) * weight.

    The statistic is computed in fp32 and the result cast back, as in Llama, so that bf16 activations
    do not lose the small-variance case. The output has the input's dtype (an fp32 weight does not
    promote bf16 activations).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x32_BTD = x_BTD.float()
        ms_BT1 = x32_BTD.pow(2).mean(dim=-1, keepdim=True)
        return (x32_BTD * torch.rsqrt(ms_BT1 + self.eps)).to(x_BTD.dtype) * self.weight.to(x_BTD.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al. 2016): (x - mean) / sqrt(var + eps) * weight + bias, bias optional."""

    def __init__(self, dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x_BTD, self.weight.shape, self.weight, self.bias, self.eps)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The norm selected by `cfg.norm` over d_model features (LayerNorm has a bias iff `cfg.bias`)."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.d_model, cfg.norm_eps, cfg.bias)
    raise ValueError(f"norm must be one of ['rmsnorm', 'layernorm'], got {cfg.norm!r}")

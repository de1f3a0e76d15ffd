"""Position-wise feed-forward networks: ReLU, GELU and SwiGLU.

- relu / gelu: y = w2(act(w1 x))  (Vaswani et al. 2017; GELU is the exact erf form, Hendrycks & Gimpel)
- swiglu:      y = w2(silu(w1 x) * w3 x)  (Shazeer 2020); w1 = gate, w3 = up, w2 = down, which map
  to Hugging Face Llama's gate_proj / up_proj / down_proj and Mixtral's experts.N.w1/w3/w2.

Shape legend: N tokens (any leading shape), D d_model, F hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """One feed-forward network (also used as an MoE expert).

    Args:
        d_model: input and output width D.
        hidden: hidden width F.
        kind: "swiglu", "gelu" or "relu".
        bias: whether the linears have biases.

    Raises:
        ValueError: on an unknown kind.
    """

    def __init__(self, d_model: int, hidden: int, kind: str, bias: bool) -> None:
        super().__init__()
        if kind not in ("swiglu", "gelu", "relu"):
            raise ValueError(f"ffn must be one of ['swiglu', 'gelu', 'relu'], got {kind!r}")
        self.kind = kind
        self.w1 = nn.Linear(d_model, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, d_model, bias=bias)
        self.w3 = nn.Linear(d_model, hidden, bias=bias) if kind == "swiglu" else None

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            h_NF = F.silu(self.w1(x_ND)) * self.w3(x_ND)
        elif self.kind == "gelu":
            h_NF = F.gelu(self.w1(x_ND))
        else:
            h_NF = F.relu(self.w1(x_ND))
        return self.w2(h_NF)

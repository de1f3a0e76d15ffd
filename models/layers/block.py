"""One Transformer block: attention and feed-forward sublayers with residuals, pre- or post-norm.

pre  (GPT-2 / Llama, Xiong et al. 2020): x = x + drop(attn(norm1(x)));  x = x + drop(ffn(norm2(x)))
post (Vaswani et al. 2017):              x = norm1(x + drop(attn(x)));  x = norm2(x + drop(ffn(x)))

Norm names follow their placement in the pre-norm layout (`attn_norm` before attention, `ffn_norm`
before the FFN), which maps onto HF Llama's input_layernorm / post_attention_layernorm.

Shape legend: B batch, T time, S key time, D d_model, H heads.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.layers.attention import KVCache
from models.layers.ffn import FeedForward
from models.layers.moe import MoEFeedForward
from models.layers.norms import build_norm


def build_ffn(cfg: ModelConfig, is_moe: bool) -> nn.Module:
    """A layer's feed-forward: MoE experts, or the dense FFN of ``cfg.ffn`` and ``cfg.resolved_d_ff``."""
    return MoEFeedForward(cfg) if is_moe else FeedForward(cfg.d_model, cfg.resolved_d_ff, cfg.ffn, cfg.bias)


@torch.no_grad()
def init_ffn(ffn: nn.Module, std: float, resid_std: float, generator: torch.Generator | None) -> None:
    """Redraw a feed-forward's residual projections (w2 of the dense FFN, every expert's and shared
    expert's) ~ normal(0, resid_std), and zero a sigmoid router's score bias (after ``init_base``)."""
    ffns = [ffn] if isinstance(ffn, FeedForward) else []
    if isinstance(ffn, MoEFeedForward):
        ffn.experts.reset_parameters(std, resid_std, generator)
        ffns = list(ffn.shared_experts)
        if ffn.score_bias is not None:
            ffn.score_bias.zero_()
    for dense in ffns:
        nn.init.normal_(dense.w2.weight, 0.0, resid_std, generator=generator)


class TransformerBlock(nn.Module):
    """Attention (multi-head or multi-head latent, `cfg.attention`) + (dense or MoE) feed-forward.

    Args:
        cfg: model config.
        layer_idx: 0-based index; decides whether the FFN is MoE (`cfg.is_moe_layer`).
        attn: the layer's attention module, built by the model from its attention kind
            (``models.layers.kinds``): the block takes it rather than asking the table.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, attn: nn.Module) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.pre_norm = cfg.norm_position == "pre"
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.attn_norm = build_norm(cfg)
        self.attn: nn.Module = attn
        self.ffn_norm = build_norm(cfg)
        self.ffn: nn.Module = build_ffn(cfg, self.is_moe)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        attn_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        return_attention: bool,
        mask_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict | None]:
        """Apply the block. ``mask_BT`` (the new tokens' padding mask) is for blocks that read it
        (``models.families.hybrid.model``'s Mamba-2 layers); attention reads ``attn_mask``.

        Returns:
            (x_BTD, attention weights (B, H, T, S) or None, MoE aux loss or None, MoE stats or None).
        """
        attn_in = self.attn_norm(x_BTD) if self.pre_norm else x_BTD
        a_BTD, weights = self.attn(attn_in, rope_cos_sin, attn_mask, kv_cache, self.layer_idx, return_attention)
        x_BTD = x_BTD + self.resid_dropout(a_BTD)
        if not self.pre_norm:
            x_BTD = self.attn_norm(x_BTD)

        ffn_in = self.ffn_norm(x_BTD) if self.pre_norm else x_BTD
        aux, stats = None, None
        if self.is_moe:
            f_BTD, aux, stats = self.ffn(ffn_in)
        else:
            f_BTD = self.ffn(ffn_in)
        x_BTD = x_BTD + self.resid_dropout(f_BTD)
        if not self.pre_norm:
            x_BTD = self.ffn_norm(x_BTD)
        return x_BTD, weights, aux, stats

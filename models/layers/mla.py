"""Multi-head latent attention (MLA), DeepSeek-V2 (DeepSeek-AI 2024, section 2.1).

Keys and values of all heads come from one low-rank latent per token, and that latent is all the KV
cache keeps (besides one small RoPE key), so a cached token costs kv_lora_rank + qk_rope_head_dim
numbers per layer instead of 2 * G * head_dim.

Per token x (D wide), with H heads, r = kv_lora_rank, n = qk_nope_head_dim, p = qk_rope_head_dim,
v = v_head_dim:
    queries   q = q_proj(x)                            or, with q_lora_rank r_q,
              q = q_b_proj(q_a_norm(q_a_proj(x)))      (the query latent c_Q is r_q wide)
              split per head into q_nope (n) and q_rope (p); RoPE rotates q_rope.
    latent    [c, k_rope] = kv_a_proj(x)               c: r wide, k_rope: p wide, ONE for all heads
              c_KV = kv_a_norm(c);  RoPE rotates k_rope.        <- the cache holds c_KV and k_rope
    expand    [k_nope, value] = kv_b_proj(c_KV)        per head: n and v features
    attend    k = [k_nope, k_rope] (k_rope shared by every head), q = [q_nope, q_rope],
              softmax(q k^T / sqrt(n + p)) value -> o_proj (H * v -> D).
Position enters only through the p "decoupled" RoPE features: RoPE on the expanded keys would make the
key depend on position after the up-projection, and the latent could then not be cached as is (paper,
section 2.1.3).

The two latent norms are RMSNorms with eps 1e-6, DeepSeek-V2's value (its reference code and
Hugging Face's DeepseekV2 hard-code it), whatever cfg.norm_eps is. RoPE uses Conduit's split-halves
feature pairing (models.layers.positions); Hugging Face's DeepseekV2 pairs adjacent features, and
models.export permutes the RoPE rows of q and kv_a to match (the attention scores are unchanged).
The cache stores c_KV and k_rope, and keys and values are re-expanded from them every step (the
"absorbed" form that folds kv_b_proj into q and o_proj is a further speed-up left out here).

Shape legend: B batch, T query time, S key time, D d_model, H heads, R kv_lora_rank, P qk_rope_head_dim,
N qk_nope_head_dim, V v_head_dim, Q = N + P query/key width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.layers.attention import KVCache, explicit_attention
from models.layers.norms import RMSNorm
from models.layers.positions import apply_rope, yarn_softmax_scale

MLA_LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """Causal self-attention through a compressed key/value latent (see the module docstring).

    Parameters (names follow Hugging Face DeepseekV2's, so export is a renaming plus a RoPE-row permutation):
    q_proj or q_a_proj / q_a_norm / q_b_proj, kv_a_proj (HF kv_a_proj_with_mqa), kv_a_norm (HF
    kv_a_layernorm), kv_b_proj, o_proj.

    Args:
        cfg: model config with attention "mla" (the attention-kind table, ``models.layers.kinds``, builds
            this module for those configs only; its MLA checks have run on ``cfg``).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.kv_lora_rank = cfg.resolved_kv_lora_rank
        self.nope_dim = cfg.resolved_qk_nope_head_dim
        self.rope_dim = cfg.resolved_qk_rope_head_dim
        self.v_dim = cfg.resolved_v_head_dim
        self.attn_dropout = cfg.attn_dropout
        # As Attention.core: sequence parallelism's attention over all positions, called as
        # core(q_BHTQ, k_BHTQ, v_BHTV, dropout_p, softmax_scale) -> out_BHTV; None: scaled_dot_product_attention.
        self.core = None
        D, H, Q = cfg.d_model, cfg.n_heads, self.nope_dim + self.rope_dim
        # 1/sqrt(N + P), as the paper; DeepSeek's YaRN multiplies it by mscale(s, mscale_all_dim)^2.
        mscale2 = yarn_softmax_scale(cfg.rope)
        self.softmax_scale = None if mscale2 == 1.0 else Q ** -0.5 * mscale2
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * Q, bias=cfg.bias)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * Q, bias=cfg.bias)
        self.kv_a_proj = nn.Linear(D, self.kv_lora_rank + self.rope_dim, bias=cfg.bias)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, MLA_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=cfg.bias)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=cfg.bias)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
        return_attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over the current tokens (and the cached latents); same contract as `Attention.forward`.

        Args:
            x_BTD: normalised input.
            rope_cos_sin: (cos, sin) for qk_rope_head_dim features, from `positions.rope_cos_sin`.
            attn_mask: from `build_attention_mask`; None = plain causal (not allowed with a cache).
            kv_cache: cache of latents (`KVCache.for_config` of an MLA config), or None.
            layer_idx: which of the cache's layers is ours.
            return_attention: use the explicit path and return the weights.

        Returns:
            (y_BTD, weights_BHTS or None).

        Raises:
            ValueError: without RoPE tables, or on a cache without a mask.
        """
        if rope_cos_sin is None:
            raise ValueError("multi-head latent attention needs the RoPE tables (pos_encoding 'rope')")
        B, T, _ = x_BTD.shape
        H, N, P = self.n_heads, self.nope_dim, self.rope_dim
        q_flat = self.q_proj(x_BTD) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BTD)))
        q_BHTQ = q_flat.view(B, T, H, N + P).transpose(1, 2)
        q_nope_BHTN, q_rope_BHTP = q_BHTQ.split([N, P], dim=-1)
        q_rope_BHTP = apply_rope(q_rope_BHTP, *rope_cos_sin)

        latent_BTR, k_rope_BTP = self.kv_a_proj(x_BTD).split([self.kv_lora_rank, P], dim=-1)
        # One "head" each, so the cache stores them in its (B, G, S, *) layout with G = 1.
        c_B1TR = self.kv_a_norm(latent_BTR).unsqueeze(1)
        k_rope_B1TP = apply_rope(k_rope_BTP.unsqueeze(1), *rope_cos_sin)
        if kv_cache is not None:
            if attn_mask is None:
                raise ValueError("attention with a KV cache needs an explicit attn_mask")
            c_B1SR, k_rope_B1SP = kv_cache.update(layer_idx, c_B1TR, k_rope_B1TP)
        else:
            c_B1SR, k_rope_B1SP = c_B1TR, k_rope_B1TP
        S = c_B1SR.shape[2]

        kv_BSH_ = self.kv_b_proj(c_B1SR.squeeze(1)).view(B, S, H, N + self.v_dim).transpose(1, 2)
        k_nope_BHSN, v_BHSV = kv_BSH_.split([N, self.v_dim], dim=-1)
        k_BHSQ = torch.cat([k_nope_BHSN, k_rope_B1SP.expand(B, H, S, P)], dim=-1)
        q_BHTQ = torch.cat([q_nope_BHTN, q_rope_BHTP], dim=-1)
        dropout_p = self.attn_dropout if self.training else 0.0

        if return_attention:
            out_BHTV, weights_BHTS = explicit_attention(q_BHTQ, k_BHSQ, v_BHSV, attn_mask, dropout_p,
                                                        self.softmax_scale)
        elif self.core is not None:
            if kv_cache is not None or attn_mask is not None:
                raise ValueError("an installed attention core (sequence parallelism) attends plain causal "
                                 "training sequences only: no KV cache or padding mask")
            out_BHTV, weights_BHTS = self.core(q_BHTQ, k_BHSQ, v_BHSV, dropout_p, self.softmax_scale), None
        else:
            # SDPA scales by 1/sqrt(q's width) = 1/sqrt(N + P) unless told (softmax_scale).
            out_BHTV = F.scaled_dot_product_attention(
                q_BHTQ, k_BHSQ, v_BHSV, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=attn_mask is None,
                scale=self.softmax_scale,
            )
            weights_BHTS = None
        y_BTD = self.o_proj(out_BHTV.transpose(1, 2).reshape(B, T, H * self.v_dim))
        return y_BTD, weights_BHTS

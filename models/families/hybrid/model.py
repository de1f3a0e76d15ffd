"""Hybrid language models: attention layers among Mamba-2 layers (Jamba, Bamba, Nemotron-H, Granite 4.0).

``cfg.hybrid_layers`` names each layer's sequence mixer, one letter per layer: "A" the Transformer's
attention (either kind, any of its position options), "M" a Mamba-2 mixer (``models.families.mamba2.model``). Every
layer then has the feed-forward sublayer, dense or MoE by ``cfg.is_moe_layer`` as in the Transformer:

    x = x + drop(mixer(mixer_norm(x)))        mixer: attention (A) or Mamba-2 (M)
    x = x + drop(ffn(ffn_norm(x)))

A few attention layers give the model exact recall over the context; the Mamba-2 layers carry the rest
at a fixed cost per token. The model is a ``Transformer`` with these blocks (its forward, positions,
masks, output end and loss are the Transformer's), so training, evaluation and serving take it as they
take any decoder. Generation keeps both kinds of state in one object (``HybridState``): a ``KVCache``
of the attention layers (its rows and slots are what batching moves) with the Mamba-2 layers'
``Mamba2State`` beside it, moved row for row with the cache.

Names follow transformers' ``GraniteMoeHybridForCausalLM`` (``models.families.hybrid.hf_granite_hybrid``): the
attention's q/k/v/o_proj and the Mamba-2 mixer's in_proj, conv1d, dt_bias, A_log, D, norm, out_proj.

Shape legend: B batch, T time, D d_model, L layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.config import ModelConfig
from models.families.decoder.model import Transformer, init_base
from models.families.hybrid import ATTENTION, MAMBA
from models.families.mamba2.model import Mamba2Mixer, Mamba2State
from models.layers.attention import KVCache
from models.layers.block import build_ffn, init_ffn
from models.layers.head import LMHead
from models.layers.kinds import attention_kind
from models.layers.norms import build_norm


def layer_slots(cfg: ModelConfig) -> list[tuple[str, int]]:
    """Each layer's kind and its index among the layers of that kind (its slot in ``HybridState``)."""
    seen = {ATTENTION: 0, MAMBA: 0}
    out = []
    for kind in cfg.hybrid_layers:
        out.append((kind, seen[kind]))
        seen[kind] += 1
    return out


class HybridState(KVCache):
    """Generation state of a hybrid model: the attention layers' ``KVCache`` (this object, with one
    layer per "A") and ``ssm``, a ``Mamba2State`` with one layer per "M". Row operations (``put_row``,
    ``gather_rows``) move a row's keys, values and SSM state together; ``span`` and ``can_put`` are the
    cache's (the SSM state has no slots)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        heads, key_dim, value_dim = attention_kind(cfg).cache_shape(cfg)
        super().__init__(cfg.hybrid_layers.count(ATTENTION), batch_size, heads, key_dim,
                         cfg.max_seq_len if max_len is None else max_len, device, dtype, value_dim=value_dim)
        self.ssm = Mamba2State(cfg, batch_size, device, dtype, n_layers=cfg.hybrid_layers.count(MAMBA))

    def put_row(self, slot: int, src: "HybridState", row: int) -> None:
        """``KVCache.put_row``, and the row's SSM state with it."""
        super().put_row(slot, src, row)
        self.ssm.put_row(slot, src.ssm, row)

    @classmethod
    def gather_rows(cls, parts: list[tuple["HybridState", torch.Tensor]], max_len: int = 0, spare: int = 0,
                    free_rows: int = 0) -> "HybridState":
        """``KVCache.gather_rows`` of the attention layers and ``Mamba2State.gather_rows`` of the SSM
        layers, the same rows in the same order."""
        kv = KVCache.gather_rows(parts, max_len=max_len, spare=spare, free_rows=free_rows)
        out = cls.__new__(cls)
        out.__dict__.update(vars(kv))
        out.ssm = Mamba2State.gather_rows([(c.ssm, rows) for c, rows in parts], free_rows=free_rows)
        return out


class HybridBlock(nn.Module):
    """One layer: a sequence mixer (attention or Mamba-2) and the feed-forward, each pre-norm with a
    residual (module docstring).

    Args:
        cfg: model config (arch 'hybrid').
        layer_idx: 0-based layer index (its letter in ``cfg.hybrid_layers``; MoE by ``cfg.is_moe_layer``).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kind, self.slot = layer_slots(cfg)[layer_idx]
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mixer_norm = build_norm(cfg)
        if self.kind == ATTENTION:
            self.attn: nn.Module = attention_kind(cfg).build(cfg)
        else:
            self.mixer = Mamba2Mixer(cfg)
        self.ffn_norm = build_norm(cfg)
        self.ffn: nn.Module = build_ffn(cfg, self.is_moe)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        attn_mask: torch.Tensor | None,
        kv_cache: HybridState | None,
        return_attention: bool,
        mask_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict | None]:
        """Apply the layer (``TransformerBlock.forward``'s arguments and returns; ``mask_BT``, the padding
        mask of the new tokens, is what a Mamba-2 mixer reads). A Mamba-2 layer returns no attention weights."""
        h_BTD = self.mixer_norm(x_BTD)
        weights = None
        if self.kind == ATTENTION:
            a_BTD, weights = self.attn(h_BTD, rope_cos_sin, attn_mask, kv_cache, self.slot, return_attention)
        else:
            a_BTD = self.mixer(h_BTD, mask_BT, None if kv_cache is None else kv_cache.ssm, self.slot)
        x_BTD = x_BTD + self.resid_dropout(a_BTD)
        aux, stats = None, None
        if self.is_moe:
            f_BTD, aux, stats = self.ffn(self.ffn_norm(x_BTD))
        else:
            f_BTD = self.ffn(self.ffn_norm(x_BTD))
        return x_BTD + self.resid_dropout(f_BTD), weights, aux, stats


class HybridLM(Transformer):
    """Hybrid attention + Mamba-2 language model (arch 'hybrid'): a ``Transformer`` whose layers are
    ``HybridBlock``s and whose generation state is a ``HybridState``.

    Args:
        cfg: the model config.
    """

    ARCH = "hybrid"  # the family's name in the table (models.families), as its Family record spells it
    SEQUENCE_SHARDABLE = False  # its Mamba-2 layers scan the whole sequence: a shard's scan needs the state before it

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        if not isinstance(cfg, ModelConfig) or cfg.arch != self.ARCH:
            raise ValueError(f"HybridLM expects a ModelConfig of its arch, got {cfg!r}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos_encoding == "learned" else None
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(HybridBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = build_norm(cfg)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        self.tie_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Every parameter: linears and embeddings ~ normal(0, init_std), biases 0, norms 1; the two
        residual projections of each layer (the mixer's output, attention o_proj or Mamba-2 out_proj, and
        the FFN's w2, experts included) ~ normal(0, init_std / sqrt(2 n_layers)); the Mamba-2 dynamics
        as ``Mamba2Mixer.init_dynamics``; a sigmoid router's score bias 0."""
        self.tie_weights()
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        init_base(self, std, generator)
        for block in self.layers:
            if block.kind == ATTENTION:
                nn.init.normal_(block.attn.o_proj.weight, 0.0, resid_std, generator=generator)
            else:
                nn.init.normal_(block.mixer.out_proj.weight, 0.0, resid_std, generator=generator)
                block.mixer.init_dynamics(generator)
            init_ffn(block.ffn, std, resid_std, generator)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> HybridState:
        """An empty generation state on this model's device and dtype (max_len, the attention layers'
        slots, defaults to max_seq_len)."""
        p = self.tok_embeddings.weight
        return HybridState(self.cfg, batch_size, max_len, device=p.device, dtype=p.dtype)


__all__ = ["HybridBlock", "HybridLM", "HybridState", "layer_slots"]

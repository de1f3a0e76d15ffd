"""The decoder-only Transformer language model.

Layout (names chosen to map one-to-one onto Hugging Face Llama / Mixtral tensors):
    tok_embeddings (V, D) -> [+ pos_embeddings (learned) | + sinusoidal] -> dropout
    -> layers[i]: TransformerBlock (attn_norm, attn.{q,k,v,o}_proj or MLA's attn.{q,kv_a,kv_b,o}_proj...,
       ffn_norm, ffn)
    -> norm (pre-norm models only; a post-norm block already ends in a norm) -> lm_head (D -> V)
With `tie_embeddings`, lm_head.weight is the same Parameter as tok_embeddings.weight.

`__init__` only creates parameters; `init_weights()` sets all of them. The only buffers are a sigmoid
router's score biases (`models.layers.moe`), which `init_weights()` zeroes too (positions.py computes its
tables per call), so this works on the meta device:

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()

Shape legend: B batch, T time (new tokens), S key time, D d_model, V vocab, H heads.
"""

from __future__ import annotations

import math
import torch
from torch import nn

from models.config import ModelConfig
from models.layers.attention import KVCache, build_attention_mask
from models.layers.base import ModelOutput, init_base
from models.layers.block import TransformerBlock, init_ffn
from models.layers.head import LMHead, head_output
from models.layers.kinds import attention_kind
from models.layers.norms import LayerNorm, RMSNorm, build_norm
from models.layers.positions import alibi_slopes, rope_cos_sin, sinusoidal_table


class Transformer(nn.Module):
    """Decoder-only Transformer LM configured by a `ModelConfig`.

    Args:
        cfg: the model config.
    """

    ARCH = "decoder"  # the family's name in the table (models.families), as its Family record spells it
    # Every layer mixes positions only in attention (the rest is per token), so a sequence may be split over
    # ranks with an attention core that sees all of it installed (pipeline.training.sequence_parallel).
    SEQUENCE_SHARDABLE = True
    # Where a forward's first token sits in its sequence when the caller does not say: a sequence-parallel
    # rank holds a shard of every training sequence (pipeline.training.sequence_parallel sets it per model).
    position_offset = 0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"Transformer expects a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos_encoding == "learned" else None
        self.emb_dropout = nn.Dropout(cfg.dropout)
        kind = attention_kind(cfg)  # the block takes its attention module from the kind table (models.layers.kinds)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i, kind.build(cfg)) for i in range(cfg.n_layers))
        self.norm = build_norm(cfg) if cfg.norm_position == "pre" else None
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head share tok_embeddings' Parameter when cfg.tie_embeddings (idempotent).

        Called again by `init_weights` because `to_empty` from the meta device may create separate
        Parameters for the two names.
        """
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Set every parameter.

        Linear and embedding weights ~ normal(0, init_std); the residual output projections
        (attn.o_proj, and w2 of every dense FFN, expert and shared expert) ~ normal(0, init_std /
        sqrt(2 * n_layers)) so the residual stream's variance does not grow with depth (GPT-2);
        biases 0; norm weights 1 and biases 0; a sigmoid router's score bias 0.

        Args:
            generator: optional RNG for reproducible initialisation (default: the global RNG).
        """
        self.tie_weights()
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        init_base(self, std, generator)
        for block in self.layers:
            nn.init.normal_(block.attn.o_proj.weight, 0.0, resid_std, generator=generator)
            init_ffn(block.ffn, std, resid_std, generator)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_attention: bool = False,
        targets_BT: torch.Tensor | None = None,
        position_offset: int | None = None,
        **loss_options,
    ) -> ModelOutput:
        """Next-token logits for every input position, or with ``targets_BT`` their loss.

        Position ids count real tokens: with a padding mask, token t of a row gets position
        (number of real tokens before it), so left padding does not shift positions. With a cache, the
        new tokens continue from the cached ones; pass a mask for the new tokens only.

        Args:
            input_ids_BT: token ids.
            attention_mask_BT: 1 = real token, 0 = pad (keys that are pads are never attended to);
                None = all real.
            kv_cache: a `KVCache` to read and extend (incremental decoding), or None.
            return_attention: return per-layer attention weights (explicit, slower path).
            targets_BT: next-token targets (``ignore_index`` where none): the output then holds their
                loss and no logits (see ``models.layers.head.LMHead``).
            position_offset: the position of the first input token, for a shard of a longer sequence
                (sequence parallelism: each rank holds consecutive positions of it); None: the model's
                ``position_offset`` (0 unless sequence parallelism set it). Not with a cache or a padding mask.
            **loss_options: ``LMHead.forward``'s (label_smoothing, chunk_tokens, reduction, ignore_index).

        Returns:
            ModelOutput.

        Raises:
            ValueError: on bad shapes or when the sequence would exceed max_seq_len.
        """
        cfg = self.cfg
        if input_ids_BT.dim() != 2:
            raise ValueError(f"input_ids_BT must be 2-D (B, T), got shape {tuple(input_ids_BT.shape)}")
        B, T = input_ids_BT.shape
        if attention_mask_BT is not None and attention_mask_BT.shape != input_ids_BT.shape:
            raise ValueError(
                f"attention_mask_BT shape {tuple(attention_mask_BT.shape)} != input shape {(B, T)}"
            )
        if position_offset is None:
            position_offset = self.position_offset
        if position_offset and (kv_cache is not None or attention_mask_BT is not None):
            raise ValueError("position_offset is for a shard of an unpadded training sequence: not with a "
                             "KV cache or an attention mask")
        if kv_cache is None and position_offset + T > cfg.max_seq_len:
            raise ValueError(f"sequence length {position_offset + T} exceeds max_seq_len {cfg.max_seq_len}")

        device = input_ids_BT.device
        if kv_cache is not None:
            mask_BT = torch.ones_like(input_ids_BT) if attention_mask_BT is None else attention_mask_BT
            # Positions, not slots, are bounded (a batch's rows may have joined at different slots).
            new_B = mask_BT.to(device=kv_cache.next_pos_B.device, dtype=torch.long).sum(dim=1)
            row = int((kv_cache.next_pos_B + new_B).argmax()) if B else 0
            if B and int(kv_cache.next_pos_B[row] + new_B[row]) > cfg.max_seq_len:
                raise ValueError(f"sequence length {int(kv_cache.next_pos_B[row])} cached + {int(new_B[row])} new "
                                 f"exceeds max_seq_len {cfg.max_seq_len}")
            positions_BT = kv_cache.begin_step(mask_BT)
        elif attention_mask_BT is not None:
            positions_BT = (attention_mask_BT.long().cumsum(dim=1) - 1).clamp(min=0)
        else:
            positions_BT = torch.arange(position_offset, position_offset + T, device=device).unsqueeze(0).expand(B, T)

        x_BTD = self.tok_embeddings(input_ids_BT)
        if self.pos_embeddings is not None:
            x_BTD = x_BTD + self.pos_embeddings(positions_BT)
        elif cfg.pos_encoding == "sinusoidal":
            x_BTD = x_BTD + sinusoidal_table(positions_BT, cfg.d_model).to(x_BTD.dtype)
        x_BTD = self.emb_dropout(x_BTD)

        rope = (
            rope_cos_sin(positions_BT, cfg.rope_head_dim, cfg.rope_base, cfg.rope)
            if cfg.pos_encoding == "rope"
            else None
        )
        slopes_H = alibi_slopes(cfg.n_heads).to(device) if cfg.pos_encoding == "alibi" else None
        attn_mask = build_attention_mask(cfg, positions_BT, attention_mask_BT, kv_cache, slopes_H)

        aux_loss = torch.zeros((), device=device, dtype=torch.float32)
        moe_stats: list[dict[str, torch.Tensor]] = []
        attentions: list[torch.Tensor] | None = [] if return_attention else None
        for block in self.layers:
            x_BTD, weights_BHTS, aux, stats = block(x_BTD, rope, attn_mask, kv_cache, return_attention,
                                                   attention_mask_BT)
            if attentions is not None:
                attentions.append(weights_BHTS)
            if aux is not None:
                aux_loss = aux_loss + aux
                moe_stats.append(stats)
        if kv_cache is not None:
            kv_cache.end_step()

        logits_BTV, loss = self.output(x_BTD, targets_BT, loss_options)
        return ModelOutput(logits_BTV, aux_loss, moe_stats, attentions, kv_cache, loss)

    def output(self, x_BTD: torch.Tensor, targets_BT: torch.Tensor | None,
               loss_options: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The model's output end: the final norm, then the head (``models.layers.head.head_output``): (logits,
        None), or (None, loss) with targets. One region of its own (``pipeline.training.parallelize``
        compiles it as a unit, as it does each block)."""
        if self.norm is not None:
            x_BTD = self.norm(x_BTD)
        return head_output(self.lm_head, x_BTD, targets_BT, loss_options)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty KV cache on this model's device and dtype (max_len defaults to max_seq_len)."""
        p = self.tok_embeddings.weight
        return KVCache.for_config(self.cfg, batch_size, max_len, device=p.device, dtype=p.dtype,
                                  shape=attention_kind(self.cfg).cache_shape(self.cfg))

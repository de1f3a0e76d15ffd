"""The encoder-decoder Transformer (Vaswani et al. 2017), built from Conduit's decoder parts.

Layout (names follow models.families.decoder.model, so the same attention, FFN, norm and position code serves both):
    tok_embeddings (V, D), shared by the encoder, the decoder and (with tie_embeddings) lm_head
    encoder: tok_embeddings [+ encoder_pos_embeddings | + sinusoidal] [-> encoder_embed_norm] -> dropout
             -> encoder_layers[i]: TransformerBlock with a bidirectional, padding-masked self-attention
             -> encoder_norm (pre-norm only)
    decoder: tok_embeddings [+ pos_embeddings | + sinusoidal] [-> embed_norm] -> dropout
             -> layers[i]: DecoderBlock = causal self-attention (KV cache), cross-attention over the
                encoder's output, feed-forward; each sublayer pre- or post-norm
             -> norm (pre-norm only) -> lm_head (D -> V)
n_encoder_layers and n_layers set the two depths; the embedding norms exist with cfg.embedding_norm (BART's
layernorm_embedding). Learned positions get one table per stack (as BART);
RoPE rotates queries and keys of self-attention only: cross-attention compares a decoder position with
encoder positions of another sequence, so it carries no position (as T5's relative bias does not).

Generation runs the encoder once, projects its output to every decoder layer's cross-attention keys
and values once (`EncoderState.cross_kv`), and decodes one token per step with the decoder's KV cache.

The model has no buffers and `init_weights()` sets every parameter, so it builds on the meta device
like `Transformer`.

Shape legend: B batch, S encoder (source) time, T decoder time, D d_model, V vocab, H query heads,
G key/value heads, K head_dim, L decoder layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.layers.attention import Attention, KVCache, build_attention_mask
from models.layers.base import ModelOutput, init_base
from models.layers.block import TransformerBlock
from models.layers.ffn import FeedForward
from models.layers.head import LMHead, head_output
from models.layers.kinds import attention_kind
from models.layers.norms import build_norm
from models.layers.positions import rope_cos_sin, sinusoidal_table
from models.layers.sampling import sample_next


@dataclass
class EncoderState:
    """The encoder's output as the decoder reads it.

    Attributes:
        hidden_BSD: the encoder's final hidden states.
        key_real_BS: True where the source token is real (pads are never attended to).
        cross_kv: per decoder layer, its cross-attention (keys, values), each (B, G, S, K); filled by
            `EncoderDecoderLM.encode` so that decoding steps never recompute them.
    """

    hidden_BSD: torch.Tensor
    key_real_BS: torch.Tensor
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]]


class CrossAttention(Attention):
    """Multi-head attention from decoder queries to encoder keys/values: Attention's q/k/v/o_proj (built
    by its constructor), without positions, cache or causal mask.

    Args:
        cfg: model config (d_model, n_heads, num_kv_heads, bias, attn_dropout).
    """

    def project_memory(self, memory_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the encoder output, (B, G, S, K) each."""
        B, S, _ = memory_BSD.shape
        k_BGSK = self.k_proj(memory_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BGSK = self.v_proj(memory_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return k_BGSK, v_BGSK

    def forward(
        self, x_BTD: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], key_mask_B11S: torch.Tensor
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTK = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        out_BHTK = F.scaled_dot_product_attention(
            q_BHTK, kv[0], kv[1], attn_mask=key_mask_B11S,
            dropout_p=self.attn_dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.o_proj(out_BHTK.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention and feed-forward, each with a residual, pre- or post-norm.

    Norms: attn_norm (self-attention), cross_norm (cross-attention), ffn_norm, placed as in
    models.layers.block (before the sublayer for pre-norm, after the residual sum for post-norm).

    Args:
        cfg: model config.
        layer_idx: 0-based index, the slot of this layer in the decoder's KV cache.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.pre_norm = cfg.norm_position == "pre"
        self.attn_norm = build_norm(cfg)
        self.attn = Attention(cfg)
        self.cross_norm = build_norm(cfg)
        self.cross_attn = CrossAttention(cfg)
        self.ffn_norm = build_norm(cfg)
        self.ffn = FeedForward(cfg.d_model, cfg.resolved_d_ff, cfg.ffn, cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x_BTD: torch.Tensor, norm: nn.Module, fn) -> torch.Tensor:
        y_BTD = fn(norm(x_BTD) if self.pre_norm else x_BTD)
        x_BTD = x_BTD + self.resid_dropout(y_BTD)
        return x_BTD if self.pre_norm else norm(x_BTD)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        self_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        cross_kv: tuple[torch.Tensor, torch.Tensor],
        cross_mask_B11S: torch.Tensor,
    ) -> torch.Tensor:
        x_BTD = self._sublayer(
            x_BTD, self.attn_norm, lambda h: self.attn(h, rope_cos_sin, self_mask, kv_cache, self.layer_idx)[0]
        )
        x_BTD = self._sublayer(x_BTD, self.cross_norm, lambda h: self.cross_attn(h, cross_kv, cross_mask_B11S))
        return self._sublayer(x_BTD, self.ffn_norm, self.ffn)


class EncoderDecoderLM(nn.Module):
    """Encoder-decoder Transformer configured by a `ModelConfig` with arch 'encoder_decoder'.

    Args:
        cfg: the model config.

    Raises:
        ValueError: when cfg.arch is not 'encoder_decoder'.
    """

    ARCH = "encoder_decoder"  # the family's name in the table (models.families), as its Family record spells it

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig) or cfg.arch != self.ARCH:
            raise ValueError(f"EncoderDecoderLM expects a ModelConfig with arch 'encoder_decoder', got {cfg!r}")
        self.cfg = cfg
        learned = cfg.pos_encoding == "learned"
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder_pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) if learned else None
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) if learned else None
        self.encoder_embed_norm = build_norm(cfg) if cfg.embedding_norm else None
        self.embed_norm = build_norm(cfg) if cfg.embedding_norm else None
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(TransformerBlock(cfg, i, attention_kind(cfg).build(cfg))
                                            for i in range(cfg.resolved_n_encoder_layers))
        self.layers = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.n_layers))
        pre = cfg.norm_position == "pre"
        self.encoder_norm = build_norm(cfg) if pre else None
        self.norm = build_norm(cfg) if pre else None
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head share tok_embeddings' Parameter when cfg.tie_embeddings (see Transformer.tie_weights)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Set every parameter as `Transformer.init_weights` does.

        Each residual output projection (self- and cross-attention o_proj, FFN w2) is drawn with std
        init_std / sqrt(2 * depth of its own stack), the GPT-2 rule applied to each stack separately.
        """
        self.tie_weights()
        std = self.cfg.init_std
        init_base(self, std, generator)
        for stack in (self.encoder_layers, self.layers):
            resid_std = std / math.sqrt(2 * len(stack))
            for block in stack:
                outs = [block.attn.o_proj, block.ffn.w2] + ([block.cross_attn.o_proj] if hasattr(block, "cross_attn") else [])
                for linear in outs:
                    nn.init.normal_(linear.weight, 0.0, resid_std, generator=generator)

    # ------------------------------------------------------------------ pieces

    def _embed(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor, table: nn.Embedding | None,
               norm: nn.Module | None) -> torch.Tensor:
        x_BTD = self.tok_embeddings(ids_BT)
        if table is not None:
            x_BTD = x_BTD + table(positions_BT)
        elif self.cfg.pos_encoding == "sinusoidal":
            x_BTD = x_BTD + sinusoidal_table(positions_BT, self.cfg.d_model).to(x_BTD.dtype)
        if norm is not None:
            x_BTD = norm(x_BTD)
        return self.emb_dropout(x_BTD)

    def _rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        cfg = self.cfg
        return rope_cos_sin(positions_BT, cfg.rope_head_dim, cfg.rope_base, cfg.rope) \
            if cfg.pos_encoding == "rope" else None

    def encode(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None = None) -> EncoderState:
        """Run the encoder once and project its output to every decoder layer's cross-attention keys/values.

        Args:
            input_ids_BS: source token ids.
            attention_mask_BS: 1 = real token, 0 = pad; None = all real. Positions count real tokens, so
                left and right padding give the real tokens the positions they have unpadded.

        Returns:
            The EncoderState the decoder reads.

        Raises:
            ValueError: on a bad shape or a source longer than max_seq_len.
        """
        if input_ids_BS.dim() != 2:
            raise ValueError(f"input_ids_BS must be 2-D (B, S), got shape {tuple(input_ids_BS.shape)}")
        B, S = input_ids_BS.shape
        if S > self.cfg.max_seq_len:
            raise ValueError(f"source length {S} exceeds max_seq_len {self.cfg.max_seq_len}")
        if attention_mask_BS is not None and attention_mask_BS.shape != input_ids_BS.shape:
            raise ValueError(f"attention_mask_BS shape {tuple(attention_mask_BS.shape)} != input shape {(B, S)}")
        real_BS = (torch.ones_like(input_ids_BS, dtype=torch.bool) if attention_mask_BS is None
                   else attention_mask_BS.to(torch.bool))
        positions_BS = (real_BS.long().cumsum(dim=1) - 1).clamp(min=0)
        # Bidirectional: every query sees every real key, and itself (so a pad query's row is never empty).
        own_SS = torch.eye(S, dtype=torch.bool, device=input_ids_BS.device)
        mask_B1SS = (real_BS[:, None, None, :] | own_SS).contiguous()
        x_BSD = self._embed(input_ids_BS, positions_BS, self.encoder_pos_embeddings, self.encoder_embed_norm)
        rope = self._rope(positions_BS)
        for block in self.encoder_layers:
            x_BSD = block(x_BSD, rope, mask_B1SS, None, False)[0]
        if self.encoder_norm is not None:
            x_BSD = self.encoder_norm(x_BSD)
        cross_kv = [block.cross_attn.project_memory(x_BSD) for block in self.layers]
        return EncoderState(x_BSD, real_BS, cross_kv)

    def decode(
        self,
        decoder_input_ids_BT: torch.Tensor,
        encoder_state: EncoderState,
        decoder_attention_mask_BT: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Decoder logits, (B, T, V), for new decoder tokens given the encoder's output (the arguments
        and errors of ``decode_hidden``)."""
        return self.lm_head(self.decode_hidden(decoder_input_ids_BT, encoder_state, decoder_attention_mask_BT,
                                               kv_cache))

    def decode_hidden(
        self,
        decoder_input_ids_BT: torch.Tensor,
        encoder_state: EncoderState,
        decoder_attention_mask_BT: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The decoder's final hidden states, (B, T, D), for new decoder tokens given the encoder's output.

        Args:
            decoder_input_ids_BT: decoder tokens (the shifted targets in training; the start token, then one
                sampled token per step, in generation).
            encoder_state: from `encode`.
            decoder_attention_mask_BT: 1 = real, 0 = pad, for the new tokens; None = all real.
            kv_cache: the decoder's self-attention cache (from `new_kv_cache`), or None.

        Raises:
            ValueError: on bad shapes or when the decoder sequence would exceed max_seq_len.
        """
        cfg = self.cfg
        if decoder_input_ids_BT.dim() != 2:
            raise ValueError(f"decoder_input_ids_BT must be 2-D (B, T), got {tuple(decoder_input_ids_BT.shape)}")
        B, T = decoder_input_ids_BT.shape
        past = kv_cache.length if kv_cache is not None else 0
        if past + T > cfg.max_seq_len:
            raise ValueError(f"decoder length {past} cached + {T} new exceeds max_seq_len {cfg.max_seq_len}")
        if kv_cache is not None:
            mask_BT = (torch.ones_like(decoder_input_ids_BT) if decoder_attention_mask_BT is None
                       else decoder_attention_mask_BT)
            positions_BT = kv_cache.begin_step(mask_BT)
        elif decoder_attention_mask_BT is not None:
            positions_BT = (decoder_attention_mask_BT.long().cumsum(dim=1) - 1).clamp(min=0)
        else:
            positions_BT = torch.arange(T, device=decoder_input_ids_BT.device).unsqueeze(0).expand(B, T)
        x_BTD = self._embed(decoder_input_ids_BT, positions_BT, self.pos_embeddings, self.embed_norm)
        rope = self._rope(positions_BT)
        self_mask = build_attention_mask(cfg, positions_BT, decoder_attention_mask_BT, kv_cache, None)
        cross_mask_B11S = encoder_state.key_real_BS[:, None, None, :]
        for block, kv in zip(self.layers, encoder_state.cross_kv):
            x_BTD = block(x_BTD, rope, self_mask, kv_cache, kv, cross_mask_B11S)
        if kv_cache is not None:
            kv_cache.end_step()
        if self.norm is not None:
            x_BTD = self.norm(x_BTD)
        return x_BTD

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        decoder_input_ids_BT: torch.Tensor,
        attention_mask_BS: torch.Tensor | None = None,
        decoder_attention_mask_BT: torch.Tensor | None = None,
        targets_BT: torch.Tensor | None = None,
        **loss_options,
    ) -> ModelOutput:
        """Teacher-forced logits of every decoder position (encode, then decode all of them at once), or
        with ``targets_BT`` their loss (``targets_BT`` and ``loss_options`` as ``Transformer.forward``'s).

        Returns:
            ModelOutput with logits (B, T, V) or the loss, and a zero aux_loss (no experts), so that
            training code written for `Transformer` reads it unchanged.
        """
        state = self.encode(input_ids_BS, attention_mask_BS)
        x_BTD = self.decode_hidden(decoder_input_ids_BT, state, decoder_attention_mask_BT)
        logits_BTV, loss = self.output(x_BTD, targets_BT, loss_options)
        return ModelOutput(logits_BTV, torch.zeros((), device=x_BTD.device), loss=loss)

    def output(self, x_BTD: torch.Tensor, targets_BT: torch.Tensor | None,
               loss_options: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The head (``decode_hidden`` already applied the final norm), as ``Transformer.output``."""
        return head_output(self.lm_head, x_BTD, targets_BT, loss_options)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty decoder self-attention cache on this model's device and dtype."""
        p = self.tok_embeddings.weight
        return KVCache.for_config(self.cfg, batch_size, max_len, device=p.device, dtype=p.dtype,
                                  shape=attention_kind(self.cfg).cache_shape(self.cfg))


@torch.no_grad()
def generate_encdec(
    model: EncoderDecoderLM,
    input_ids_BS: torch.Tensor,
    decoder_start_id: int,
    max_new_tokens: int,
    attention_mask_BS: torch.Tensor | None = None,
    eos_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Decode up to `max_new_tokens` tokens per source row: the encoder once, then a KV-cached decoder.

    Rows that produce `eos_id` keep emitting it while the others continue, as in `models.generate.generate`.

    Args:
        model: the encoder-decoder.
        input_ids_BS: source ids (pads allowed anywhere that attention_mask_BS marks them).
        decoder_start_id: the token the decoder starts from.
        max_new_tokens: budget per row (>= 1, at most max_seq_len - 1).
        attention_mask_BS: 1 = real source token; None = all real.
        eos_id: token that ends a row.
        temperature, top_k, top_p, generator: sampling, as `models.generate.sample_next` (0 = greedy).

    Returns:
        (B, n) generated ids, n <= max_new_tokens, without the start token.

    Raises:
        ValueError: on a budget outside 1..max_seq_len - 1.
    """
    if not 1 <= max_new_tokens <= model.cfg.max_seq_len - 1:
        raise ValueError(f"max_new_tokens must be in 1..{model.cfg.max_seq_len - 1} (max_seq_len - 1 for the start "
                         f"token), got {max_new_tokens}")
    was_training = model.training
    model.eval()
    try:
        B = input_ids_BS.shape[0]
        state = model.encode(input_ids_BS, attention_mask_BS)
        cache = model.new_kv_cache(B, max_len=max_new_tokens + 1)
        step_B1 = torch.full((B, 1), decoder_start_id, dtype=torch.long, device=input_ids_BS.device)
        finished_B = torch.zeros(B, dtype=torch.bool, device=input_ids_BS.device)
        out = []
        for _ in range(max_new_tokens):
            logits_BV = model.decode(step_B1, state, kv_cache=cache)[:, -1, :]
            next_B = sample_next(logits_BV, temperature, top_k, top_p, generator)
            if eos_id is not None:
                next_B = torch.where(finished_B, torch.full_like(next_B, eos_id), next_B)
                finished_B = finished_B | (next_B == eos_id)
            out.append(next_B)
            if eos_id is not None and bool(finished_B.all()):
                break
            step_B1 = next_B.unsqueeze(1)
    finally:
        model.train(was_training)
    return torch.stack(out, dim=1)

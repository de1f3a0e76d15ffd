"""Multi-head causal self-attention (MHA / GQA / MQA) and the KV cache.

softmax(Q K^T / sqrt(d_k)) V, with two interchangeable paths:
- fast: `F.scaled_dot_product_attention` (flash / memory-efficient kernels where available);
- explicit: the same formula written out, used when attention weights are requested
  (`return_attention=True`, e.g. for heatmaps). Both take the same mask, so they agree to rounding.

Masks are built once per forward by `build_attention_mask` and shared by every layer:
- `None` means "plain causal, query i sees keys 0..i" and lets SDPA use `is_causal=True`;
- a bool (B, 1, T, S) tensor, True = may attend (causal AND key is a real token, plus each query's own
  slot so that a pad query never has an empty row and never produces NaN);
- a float (B, H, T, S) additive tensor for ALiBi: the bias, with -inf where not allowed.

GQA: query head h reads key/value head h // (H / H_kv), the same grouping as Hugging Face `repeat_kv`.

Shape legend: B batch, T query time, S key time (cache + new), D d_model, H query heads,
G key/value heads, K head_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.layers.positions import alibi_bias, apply_rope


class KVCache:
    """Preallocated keys and values of every layer, for incremental decoding.

    One cache serves a batch of B rows that advance together: slot s of every row holds the token fed
    at step s. Pad tokens (attention_mask 0) take a slot but are masked out as keys, and do not advance
    their row's position counter, so a left-padded prompt decodes exactly like the unpadded one.

    Slots are not positions: a row that joined a running batch (``gather_rows``) starts at a later slot,
    its earlier slots masked, and the slots may outnumber ``max_seq_len`` while every row's own
    positions stay below it (the model checks positions, ``next_pos_B``).

    What a slot holds per layer is two tensors, written by `update` as "k" and "v":
    - attention 'mha': the RoPE'd keys and the values of the G key/value heads, (B, G, S, K) each;
    - attention 'mla': the compressed latent c_KV, (B, 1, S, kv_lora_rank), and the one RoPE'd key
      shared by all heads, (B, 1, S, qk_rope_head_dim) (see models.layers.mla). Per-head keys and values are
      re-expanded from these at every step; storing them would defeat MLA's purpose.
    `for_config` allocates them at the shape the attention kind gives (`models.layers.kinds`, asked by the
    model that owns the cache); `models.accounting.kv_cache_bytes_per_token` counts them.

    Attributes:
        length: number of filled slots (same for every row).
        max_len: capacity in slots.
        key_mask_BS: (B, max_len) bool, True where the slot holds a real token.
        positions_BS: (B, max_len) long, the position id of the token in each slot.
        next_pos_B: (B,) long, position id the next real token of each row will get.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        value_dim: int | None = None,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        k_shape = (batch_size, num_kv_heads, max_len, head_dim)
        v_shape = (batch_size, num_kv_heads, max_len, value_dim)
        self.k_BGSK = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v_BGSK = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.key_mask_BS = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.positions_BS = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.next_pos_B = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len
        self.batch_size = batch_size
        self._pending = 0  # tokens written by the step in progress (between begin_step and end_step)

    @classmethod
    def for_config(
        cls,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        shape: tuple[int, int, int | None],
    ) -> "KVCache":
        """An empty cache of `cfg`'s layers (max_len, in slots, defaults to cfg.max_seq_len). `shape` is
        (heads, key width, value width or None for the key width) per layer, as the attention kind says
        (``models.layers.kinds.AttentionKind.cache_shape``; the model that owns the cache asks it)."""
        max_len = cfg.max_seq_len if max_len is None else max_len
        heads, key_dim, value_dim = shape
        return cls(cfg.n_layers, batch_size, heads, key_dim, max_len, device, dtype, value_dim=value_dim)

    def begin_step(self, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        """Record the mask of T new tokens and return their position ids.

        Args:
            attention_mask_BT: 1/True for real tokens, 0/False for pads.

        Returns:
            (B, T) long positions: each row continues counting from its previous real token.

        Raises:
            ValueError: when the new tokens do not fit, or the batch size differs from the cache's.
        """
        B, T = attention_mask_BT.shape
        if B != self.batch_size:
            raise ValueError(f"KV cache holds batch size {self.batch_size}, got input batch size {B}")
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {T} new > max_len {self.max_len}")
        real_BT = attention_mask_BT.to(torch.bool)
        # cumsum - 1 counts real tokens before this one; pads get the position of the last real token.
        positions_BT = (self.next_pos_B.unsqueeze(1) + real_BT.long().cumsum(dim=1) - 1).clamp(min=0)
        sl = slice(self.length, self.length + T)
        self.key_mask_BS[:, sl] = real_BT
        self.positions_BS[:, sl] = positions_BT
        self.next_pos_B = self.next_pos_B + real_BT.long().sum(dim=1)
        self._pending = T
        return positions_BT

    def update(self, layer_idx: int, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values of one layer and return all keys/values so far, (B, G, S, K).

        Under MLA the pair is (latent, RoPE key), see the class docstring."""
        end = self.length + k_BGTK.shape[2]
        self.k_BGSK[layer_idx][:, :, self.length:end] = k_BGTK
        self.v_BGSK[layer_idx][:, :, self.length:end] = v_BGTK
        return self.k_BGSK[layer_idx][:, :, :end], self.v_BGSK[layer_idx][:, :, :end]

    def end_step(self) -> None:
        """Commit the step begun by `begin_step`."""
        self.length += self._pending
        self._pending = 0

    def _first_real_slot(self, rows_R: torch.Tensor) -> int:
        """The first filled slot that holds a real token of any of ``rows_R`` (``length`` if none)."""
        real_S = self.key_mask_BS[rows_R, : self.length].any(dim=0)
        return int(real_S.nonzero()[0]) if bool(real_S.any()) else self.length

    def span(self, rows_R: torch.Tensor) -> int:
        """Filled slots from the first that holds a real token of any of ``rows_R`` to the end."""
        return self.length - self._first_real_slot(rows_R.to(device=self.key_mask_BS.device, dtype=torch.long))

    def can_put(self, span: int, more: int) -> bool:
        """Whether ``put_row`` can place a row of ``span`` filled slots that will add ``more``."""
        return span <= self.length and self.length + more <= self.max_len

    def put_row(self, slot: int, src: "KVCache", row: int) -> None:
        """Write ``src``'s row ``row`` (its filled slots from its first real token) into row ``slot``,
        right-aligned at this cache's filled slots, the slots before it masked: a row joins a batch in
        place of one that left, and attends to exactly what it did in ``src``.

        Raises:
            ValueError: the row does not fit before this cache's end (``can_put``).
        """
        span = src.span(torch.tensor([row]))
        if span > self.length:
            raise ValueError(f"put_row: a row of {span} slots does not fit before slot {self.length}")
        dst, from_ = slice(self.length - span, self.length), slice(src.length - span, src.length)
        for layer in range(len(self.k_BGSK)):
            self.k_BGSK[layer][slot, :, dst] = src.k_BGSK[layer][row, :, from_]
            self.v_BGSK[layer][slot, :, dst] = src.v_BGSK[layer][row, :, from_]
        self.key_mask_BS[slot] = False
        self.key_mask_BS[slot, dst] = src.key_mask_BS[row, from_]
        self.positions_BS[slot, dst] = src.positions_BS[row, from_]
        self.next_pos_B[slot] = src.next_pos_B[row]

    @classmethod
    def gather_rows(cls, parts: list[tuple["KVCache", torch.Tensor]], max_len: int = 0, spare: int = 0,
                    free_rows: int = 0) -> "KVCache":
        """A new cache of the rows ``parts`` names, in that order, their filled slots right-aligned.

        Each row keeps its keys, values, positions and next position; slots before the earliest real
        token of a part's rows are dropped, and a part with fewer filled slots than the longest gets
        masked slots in front. So each row attends to exactly what it did before: this is how rows
        leave a running batch (one part, the rows that stay) and join it (the running rows plus the
        cache of the joining rows' prompts).

        Args:
            parts: (cache, row indices) pairs; the caches share layers, sizes, device and dtype.
            max_len: capacity in slots of the new cache, at least the filled slots plus ``spare``.
            spare: empty slots to leave after the filled ones.
            free_rows: empty rows to add after the gathered ones (for rows to ``put_row`` later).

        Raises:
            ValueError: no rows, or a part with a step in progress.
        """
        parts = [(c, rows.to(device=c.key_mask_BS.device, dtype=torch.long)) for c, rows in parts]
        if not parts or sum(len(rows) for _, rows in parts) == 0:
            raise ValueError("gather_rows needs at least one row")
        if any(c._pending for c, _ in parts):
            raise ValueError("gather_rows: a cache has a step in progress (begin_step without end_step)")
        spans = [c.length - c._first_real_slot(rows) for c, rows in parts]
        S = max(spans)
        first, _ = parts[0]
        k0, v0 = first.k_BGSK[0], first.v_BGSK[0]
        B = sum(len(rows) for _, rows in parts) + free_rows
        out = cls(len(first.k_BGSK), B, k0.shape[1], k0.shape[3], max(max_len, S + spare), k0.device, k0.dtype,
                  value_dim=v0.shape[3])
        at = 0
        for (c, rows), span in zip(parts, spans):
            b = slice(at, at + len(rows))
            src, dst = slice(c.length - span, c.length), slice(S - span, S)
            for layer in range(len(c.k_BGSK)):
                out.k_BGSK[layer][b, :, dst] = c.k_BGSK[layer][rows][:, :, src]
                out.v_BGSK[layer][b, :, dst] = c.v_BGSK[layer][rows][:, :, src]
            out.key_mask_BS[b, dst] = c.key_mask_BS[rows][:, src]
            out.positions_BS[b, dst] = c.positions_BS[rows][:, src]
            out.next_pos_B[b] = c.next_pos_B[rows]
            at += len(rows)
        out.length = S
        return out


def build_attention_mask(
    cfg: ModelConfig,
    q_pos_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor | None,
    kv_cache: KVCache | None,
    alibi_slopes_H: torch.Tensor | None,
) -> torch.Tensor | None:
    """The mask shared by all layers of one forward (see the module docstring for its three forms).

    Args:
        cfg: model config (for the head count).
        q_pos_BT: position ids of the queries.
        attention_mask_BT: 1 = real token, 0 = pad, for the new tokens; None = all real.
        kv_cache: cache after `begin_step` of this forward, or None.
        alibi_slopes_H: ALiBi slopes, or None when not using ALiBi.

    Returns:
        None, a bool (B, 1, T, S) mask, or a float (B, H, T, S) additive bias.
    """
    B, T = q_pos_BT.shape
    device = q_pos_BT.device
    if kv_cache is None and attention_mask_BT is None and alibi_slopes_H is None:
        return None
    if kv_cache is not None:
        start = kv_cache.length
        S = start + T
        key_real_BS = kv_cache.key_mask_BS[:, :S]
        k_pos_BS = kv_cache.positions_BS[:, :S]
    else:
        start, S = 0, T
        key_real_BS = (
            torch.ones(B, S, dtype=torch.bool, device=device)
            if attention_mask_BT is None
            else attention_mask_BT.to(torch.bool)
        )
        k_pos_BS = q_pos_BT
    q_slot_T1 = torch.arange(start, start + T, device=device).unsqueeze(1)
    k_slot_1S = torch.arange(S, device=device).unsqueeze(0)
    causal_TS = k_slot_1S <= q_slot_T1
    own_slot_TS = k_slot_1S == q_slot_T1
    allowed_BTS = (causal_TS.unsqueeze(0) & key_real_BS.unsqueeze(1)) | own_slot_TS.unsqueeze(0)
    if alibi_slopes_H is None:
        return allowed_BTS.unsqueeze(1)
    bias_BHTS = alibi_bias(alibi_slopes_H, q_pos_BT, k_pos_BS)
    return bias_BHTS.masked_fill(~allowed_BTS.unsqueeze(1), float("-inf"))


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections (named as in HF Llama).

    Args:
        cfg: model config (d_model, n_heads, num_kv_heads, bias, attn_dropout).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.resolved_num_kv_heads
        self.head_dim = cfg.head_dim
        self.attn_dropout = cfg.attn_dropout
        d_q, d_kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.d_model, d_q, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, d_kv, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, d_kv, bias=cfg.bias)
        self.o_proj = nn.Linear(d_q, cfg.d_model, bias=cfg.bias)
        # The attention over all positions of a causal training sequence, where something else computes it:
        # sequence parallelism (pipeline.training.sequence_parallel) installs one that exchanges sequence
        # shards for head shards around it. Called as core(q_BHTK, k_BGTK, v_BGTK, dropout_p) -> out_BHTK
        # on this rank's positions. None: scaled_dot_product_attention here.
        self.core = None

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
        return_attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over the current tokens (and the cached ones).

        Args:
            x_BTD: normalised input.
            rope_cos_sin: (cos, sin) from `positions.rope_cos_sin`, or None when not using RoPE.
            attn_mask: from `build_attention_mask`; None = plain causal (not allowed with a cache).
            kv_cache: cache to read and extend, or None.
            layer_idx: which of the cache's layers is ours.
            return_attention: use the explicit path and return the weights.

        Returns:
            (y_BTD, weights_BHTS or None).

        Raises:
            ValueError: on a cache without a mask.
        """
        B, T, _ = x_BTD.shape
        q_BHTK = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k_BGTK = self.k_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BGTK = self.v_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope_cos_sin is not None:
            q_BHTK = apply_rope(q_BHTK, *rope_cos_sin)
            k_BGTK = apply_rope(k_BGTK, *rope_cos_sin)
        if kv_cache is not None:
            if attn_mask is None:
                raise ValueError("attention with a KV cache needs an explicit attn_mask")
            k_BGSK, v_BGSK = kv_cache.update(layer_idx, k_BGTK, v_BGTK)
        else:
            k_BGSK, v_BGSK = k_BGTK, v_BGTK
        dropout_p = self.attn_dropout if self.training else 0.0

        if return_attention:
            out_BHTK, weights_BHTS = explicit_attention(q_BHTK, k_BGSK, v_BGSK, attn_mask, dropout_p)
        elif self.core is not None:
            if kv_cache is not None or attn_mask is not None:
                raise ValueError("an installed attention core (sequence parallelism) attends plain causal "
                                 "training sequences only: no KV cache, padding mask or ALiBi bias")
            out_BHTK, weights_BHTS = self.core(q_BHTK, k_BGSK, v_BGSK, dropout_p), None
        else:
            out_BHTK = F.scaled_dot_product_attention(
                q_BHTK, k_BGSK, v_BGSK,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=attn_mask is None,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )
            weights_BHTS = None
        y_BTD = self.o_proj(out_BHTK.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return y_BTD, weights_BHTS


def explicit_attention(
    q_BHTK: torch.Tensor,
    k_BGSK: torch.Tensor,
    v_BGSV: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QK^T * scale + mask) V written out, scale 1/sqrt(K) unless given; returns (out_BHTV,
    pre-dropout weights_BHTS).

    K is the query/key width (q's last dimension); values may be of another width V (MLA). Query head h
    reads key/value head h // (H / G).
    """
    group = q_BHTK.shape[1] // k_BGSK.shape[1]
    k_BHSK = k_BGSK.repeat_interleave(group, dim=1)
    v_BHSV = v_BGSV.repeat_interleave(group, dim=1)
    scores_BHTS = (q_BHTK @ k_BHSK.transpose(-2, -1)).float()
    scores_BHTS = scores_BHTS / math.sqrt(q_BHTK.shape[-1]) if scale is None else scores_BHTS * scale
    T, S = scores_BHTS.shape[-2:]
    if attn_mask is None:
        causal_TS = torch.ones(T, S, dtype=torch.bool, device=scores_BHTS.device).tril()
        scores_BHTS = scores_BHTS.masked_fill(~causal_TS, float("-inf"))
    elif attn_mask.dtype == torch.bool:
        scores_BHTS = scores_BHTS.masked_fill(~attn_mask, float("-inf"))
    else:
        scores_BHTS = scores_BHTS + attn_mask.float()
    weights_BHTS = torch.softmax(scores_BHTS, dim=-1).to(q_BHTK.dtype)
    probs_BHTS = F.dropout(weights_BHTS, p=dropout_p) if dropout_p > 0 else weights_BHTS
    return probs_BHTS @ v_BHSV, weights_BHTS

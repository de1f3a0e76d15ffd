"""Sequence parallelism, DeepSpeed-Ulysses style: each sequence of a micro-batch split over ``sp`` ranks.

Each rank of a sequence-parallel group holds ``T / sp`` consecutive positions of every sequence of the
micro-batch (``shard``). Everything that works per token (embeddings, norms, the feed-forward, the head and
the loss) runs on the shard; attention, the one place positions mix, runs on all ``T`` positions for
``H / sp`` of the heads: DeepSpeed's ``DistributedAttention`` exchanges the shard of every head for all
positions of a group of heads by an all-to-all before it and back after it (Jacobs et al. 2023,
"DeepSpeed Ulysses"). Grouped-query attention keeps each query head with its key/value head (DeepSpeed's
exchange follows the key/value groups); where there are fewer key/value heads than ranks, each is sent as
as many copies as it takes to give every rank one. RoPE and learned or sinusoidal positions
see each token's position in the whole sequence (the model's ``position_offset``).

The loss of a rank is the mean over its shard's tokens; every shard has as many, so the mean of the
ranks' losses is the loss of the whole sequence, and gradients averaged over the group (as data-parallel
gradients are) are its gradients. The all-to-all's backward carries each head's gradient back to the rank
that holds the shard.

A mixture of experts routes each token on its rank; its balancing loss, a product of statistics over the
tokens, is made from their means over the group (``ShardMean``), so it is the whole sequences' loss.

Models are refused by name where a shard cannot be computed on its own: families whose layers scan the
sequence (Mamba, Mamba-2, hybrids: the class says ``SEQUENCE_SHARDABLE``), ALiBi (its bias spans the whole
sequence inside the core), dynamic NTK (it scales by the longest position a forward sees), a capacity-limited
mixture of experts (a shard's capacity drops other tokens). Multi-head latent attention hands the core its
per-head keys and values (decompressed from the latent) and its softmax scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import ModelConfig


def check_shardable(model_cfg: ModelConfig, model: torch.nn.Module, sp: int) -> None:
    """Raise ``ValueError`` naming what stops ``model`` from being trained with ``sp`` ranks per sequence.

    Args:
        model_cfg: the model's config.
        model: the model (its class says whether its layers may be split along the sequence).
        sp: ``parallel.sequence_parallel_size``.
    """
    if sp == 1:
        return
    field = f"parallel.sequence_parallel_size={sp}"
    if not getattr(type(model), "SEQUENCE_SHARDABLE", False):
        raise ValueError(f"{field}: the {model_cfg.arch} family's layers read the whole sequence in order (a "
                         "scan, or an encoder), so a shard cannot be computed on its own; use 1")
    blocks = getattr(model, "layers", ())
    refusals = {  # an attention module without a replaceable core (multi-head latent attention's)
        f"model.attention={model_cfg.attention}": any(not hasattr(b.attn, "core") for b in blocks),
        "model.pos_encoding=alibi": model_cfg.pos_encoding == "alibi",
        "model.rope_scaling_type=dynamic": model_cfg.pos_encoding == "rope" and model_cfg.rope_scaling_type == "dynamic",
        # capacity is a share of the tokens of one call: a shard's would drop other tokens than the whole's
        f"model.moe_capacity_factor={model_cfg.moe_capacity_factor}": (model_cfg.num_experts > 0
                                                                       and model_cfg.moe_capacity_factor is not None),
    }
    refused = [name for name, hit in refusals.items() if hit]
    if refused:
        raise ValueError(f"{field} is not supported with {', '.join(refused)} yet (their terms span the whole "
                         "sequence); use 1")
    if model_cfg.n_heads % sp:
        raise ValueError(f"{field}: model.n_heads={model_cfg.n_heads} must be a multiple of it (each rank "
                         "attends for n_heads / sp heads)")


def shard(tokens_BT: torch.Tensor, rank: int, sp: int) -> tuple[torch.Tensor, int]:
    """Rank ``rank``'s consecutive ``T / sp`` positions of every row, and the position of its first one."""
    T = tokens_BT.shape[1]
    if T % sp:
        raise ValueError(f"sequence length {T} must be a multiple of parallel.sequence_parallel_size={sp}")
    width = T // sp
    return tokens_BT[:, rank * width:(rank + 1) * width], rank * width


def _causal_attention(q_BTHK: torch.Tensor, k_BTGK: torch.Tensor, v_BTGK: torch.Tensor,
                      dropout_p: float, scale: float | None = None) -> torch.Tensor:
    """Causal attention over all positions, for this rank's heads (DeepSpeed's layout: batch, time, heads);
    ``scale``: the softmax's (1/sqrt(q's width) when None)."""
    out_BHTK = F.scaled_dot_product_attention(
        q_BTHK.transpose(1, 2), k_BTGK.transpose(1, 2), v_BTGK.transpose(1, 2), dropout_p=dropout_p,
        is_causal=True, enable_gqa=k_BTGK.shape[2] != q_BTHK.shape[2], scale=scale)
    return out_BHTK.transpose(1, 2)


class UlyssesCore:
    """The attention core an attention module calls with its shard's q, k, v (``Attention.core``, and multi-head
    latent attention's ``MultiHeadLatentAttention.core`` with its per-head keys and values and its scale)."""

    def __init__(self, group: dist.ProcessGroup, n_heads: int, n_kv_heads: int) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        sp = dist.get_world_size(group)
        # Fewer key/value heads than ranks (DeepSpeed's exchange needs at least one per rank): each is sent
        # as several identical copies, sp / G of them (or one per query head), so every rank holds the one
        # its query heads read; the copies' gradients add up in repeat_interleave's backward.
        self.copies = 1 if n_kv_heads >= sp else (sp // n_kv_heads if sp % n_kv_heads == 0 else n_heads // n_kv_heads)
        # (B, T/sp, H, K) in, heads scattered (dim 2) and positions gathered (dim 1); the reverse after.
        self.attention = DistributedAttention(_causal_attention, group, scatter_idx=2, gather_idx=1,
                                              num_kv_heads=n_kv_heads * self.copies)

    def __call__(self, q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                 dropout_p: float, scale: float | None = None) -> torch.Tensor:
        if self.copies > 1:
            k_BGTK = k_BGTK.repeat_interleave(self.copies, dim=1)
            v_BGTK = v_BGTK.repeat_interleave(self.copies, dim=1)
        out_BTHK = self.attention(q_BHTK.transpose(1, 2).contiguous(), k_BGTK.transpose(1, 2).contiguous(),
                                  v_BGTK.transpose(1, 2).contiguous(), 0, None, dropout_p, scale)
        return out_BTHK.transpose(1, 2)


class ShardMean:
    """The mean over a sequence-parallel group of a statistic each rank computed on its shard (equal shards):
    an all-reduce whose backward all-reduces the gradient, so each rank's copy of a loss built on it sends
    every shard its part (DeepSpeed's average of the ranks' gradients then gives the whole loss's)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size = group, dist.get_world_size(group)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t, group=self.group) / self.size


def install(model: torch.nn.Module, model_cfg: ModelConfig, group: dist.ProcessGroup,
            seq_len: int | None = None) -> int:
    """Give every attention module of ``model`` the sequence-parallel core over ``group``; how many. With
    ``seq_len`` (the training sequences' length), the model's default ``position_offset`` becomes this
    rank's first position of them, so callers pass a shard as they would a whole sequence.

    Raises:
        ValueError: a model that cannot be split along the sequence (``check_shardable``).
    """
    sp = dist.get_world_size(group)
    check_shardable(model_cfg, model, sp)
    core = UlyssesCore(group, model_cfg.n_heads, model_cfg.resolved_num_kv_heads)  # MLA: n_heads, per head
    modules = [m for m in model.modules() if hasattr(m, "core")]  # every attention module's replaceable core
    for m in modules:
        m.core = core
    for m in model.modules():  # the mixtures of experts' balancing statistics: the whole sequences'
        if hasattr(m, "shard_mean"):
            m.shard_mean = ShardMean(group)
    if seq_len is not None:
        model.position_offset = dist.get_rank(group) * (seq_len // sp)
    return len(modules)


def groups(world: int, sp: int) -> dist.ProcessGroup | None:
    """This rank's sequence-parallel group: ranks ``[k * sp, (k + 1) * sp)``. Every rank must call it (each
    group is made on all ranks); None where ``sp`` is 1."""
    if sp == 1:
        return None
    mine = None
    for first in range(0, world, sp):
        group = dist.new_group(list(range(first, first + sp)))
        if first <= dist.get_rank() < first + sp:
            mine = group
    return mine

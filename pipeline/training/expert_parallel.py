"""Expert parallelism, applied to a built model from outside (models/ knows nothing of it).

Each MoE layer (``models.layers.moe.MoEFeedForward``) keeps its router, losses and statistics; what
changes is where its experts live and how tokens reach them:

* Rank ``r`` is expert-parallel rank ``r % ep_size`` (DeepSpeed's default group layout: the
  expert-parallel groups are blocks of ``ep_size`` consecutive ranks) and keeps experts
  ``[ep_rank * L, (ep_rank + 1) * L)``, ``L = num_experts / ep_size``: rows ``expert_rows`` of each
  stacked expert tensor (``models.layers.grouped_experts.StackedExperts``), as a StackedExperts of its own.
  This module owns that bookkeeping for everyone: ``global_expert_id`` maps a local expert to its
  index in the single-process model, ``canonical_names`` names a rank's block by the single-process
  model's stacked tensor, and ``gather_experts`` is the one gather of the blocks over the
  expert-parallel group into the whole stacked tensor (the weights export here and the canonical
  checkpoint in ``canonical`` both use it).
* ``AllToAllDispatcher`` replaces the layer's local dispatcher: kept token slots are ordered by
  expert (``models.layers.moe.SlotOrder``, as the local dispatcher does), sent to the owning rank with one
  all-to-all, regrouped by local expert and run through the local experts
  (``models.layers.grouped_experts.run_experts``), sent back with a second all-to-all and combined with their
  router weights. Both all-to-alls are autograd
  functions, so expert gradients arrive from every rank's tokens.
* DeepSpeed must know which parameters are experts, to reduce their gradients only within the
  expert-data-parallel group and to checkpoint them per expert. Its engine recognises experts
  only inside its own ``deepspeed.moe.layer.MoE`` modules (``engine.has_moe_layers``), with the
  experts at ``deepspeed_moe.experts.deepspeed_experts.<local id>``. ``ExpertShard`` is such a
  module: it holds the rank's block of stacked experts under exactly that path, as local expert 0
  (to DeepSpeed each rank has one expert, the block, so its checkpoint writes one expert file per
  rank), marks their parameters (``allreduce=False``, ``group_name``) and receives its process group
  from the engine. It is never called; the layer's forward uses it through the dispatcher.

Shared experts are not supported with ep_size > 1 (``pipeline.config.limits.ep_shared_experts``): DeepSpeed's
checkpoint code treats every parameter whose name contains "expert" as a routed expert.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.layers.grouped_experts import StackedExperts
from models.layers.grouped_experts import run_experts
from models.layers.moe import MoEFeedForward, RoutingDecision, SlotOrder
from pipeline.config import limits
SHARD_EXPERTS = "ep_shard.deepspeed_moe.experts.deepspeed_experts.0"


def _moe_base():
    from deepspeed.moe.layer import MoE

    return MoE


class _ExpertHolder(nn.Module):
    """``deepspeed_moe`` of an ExpertShard: ``experts.deepspeed_experts`` plus the EP group."""

    def __init__(self, local: StackedExperts):
        super().__init__()
        self.experts = nn.Module()
        self.experts.deepspeed_experts = nn.ModuleList([local])
        self.ep_group = None

    def _set_ep_group(self, group) -> None:  # called by DeepSpeed's MoE._create_process_groups
        self.ep_group = group


def make_expert_shard(num_experts: int, ep_size: int, local: StackedExperts) -> nn.Module:
    """An ``ExpertShard``: a ``deepspeed.moe.layer.MoE`` in type only, holding this rank's block of experts."""
    MoE = _moe_base()

    class ExpertShard(MoE):
        def __init__(self) -> None:
            nn.Module.__init__(self)  # not MoE.__init__: no gate or experts of DeepSpeed's own
            self.ep_size = ep_size
            # DeepSpeed's view: one expert (the block) per expert-parallel rank.
            self.num_experts = ep_size
            self.num_local_experts = 1
            # Ours: the layer's routed experts and how many of them each rank holds.
            self.routed_experts = num_experts
            self.experts_per_rank = num_experts // ep_size
            self.expert_group_name = f"ep_size_{ep_size}"
            self.enable_expert_tensor_parallelism = False
            self.use_residual = False
            self.deepspeed_moe = _ExpertHolder(local)
            for p in self.deepspeed_moe.parameters():
                p.allreduce = False
                p.group_name = self.expert_group_name

        @property
        def local_experts(self) -> StackedExperts:
            return self.deepspeed_moe.experts.deepspeed_experts[0]

        def forward(self, *args, **kwargs):
            raise RuntimeError("ExpertShard is a container; the MoE layer calls its experts via the dispatcher")

    return ExpertShard()


class AllToAllDispatcher:
    """Sends kept token slots to the ranks that own their experts, runs this rank's experts on what
    arrives, sends the outputs back and combines them (a ``models.layers.moe.Dispatcher``).

    Not an nn.Module on purpose: it only points at the layer's ExpertShard, whose parameters are
    registered there.

    Args:
        shard: the layer's ExpertShard: this rank's experts and, after ``deepspeed.initialize``, the
            expert-parallel group.
        impl: how the local experts run (``models.layers.grouped_experts.run_experts``), the layer's
            ``moe_expert_impl``.
    """

    def __init__(self, shard: nn.Module, impl: str = "auto"):
        self.shard = shard
        self.impl = impl

    def __call__(self, x_ND: torch.Tensor, routing: RoutingDecision) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        shard = self.shard
        group = shard.deepspeed_moe.ep_group
        if group is None:
            raise RuntimeError("expert-parallel group not set: deepspeed.initialize has not run on this model")
        ep, L = shard.ep_size, shard.experts_per_rank
        slots = SlotOrder.of(routing, shard.routed_experts)
        # Global experts come in blocks of L per expert-parallel rank (``global_expert_id``), so the
        # slot counts per expert are, viewed as (ep, L), what this rank sends to each rank's experts.
        send_counts_PL = slots.counts_E.view(ep, L).contiguous()
        recv_counts_PL = torch.empty_like(send_counts_PL)
        dist.all_to_all_single(recv_counts_PL, send_counts_PL, group=group)
        # The layer's one host sync: all_to_all_single takes its split sizes as Python ints.
        send_PL, recv_PL = torch.stack([send_counts_PL, recv_counts_PL]).tolist()
        send_splits, recv_splits = [sum(row) for row in send_PL], [sum(row) for row in recv_PL]

        x_send = slots.gather(x_ND)
        x_recv = all_to_all_single(x_send.new_empty(sum(recv_splits), x_ND.shape[1]), x_send,
                                   recv_splits, send_splits, group=group)
        # Received rows come grouped by (source rank, local expert). A stable sort by local expert
        # regroups them so that each local expert's rows are contiguous, for one grouped matmul.
        local_of_row = torch.arange(L, device=x_ND.device).repeat(ep).repeat_interleave(
            recv_counts_PL.reshape(-1), output_size=x_recv.shape[0])
        order_R = torch.argsort(local_of_row, stable=True)
        y_grouped = run_experts(shard.local_experts, x_recv.index_select(0, order_R), recv_counts_PL.sum(0), self.impl,
                                host_counts=[sum(col) for col in zip(*recv_PL)])
        y_recv = torch.empty_like(y_grouped).index_copy(0, order_R, y_grouped)  # back to arrival order
        y_back = all_to_all_single(y_recv.new_empty(len(slots.token_S), x_ND.shape[1]), y_recv, send_splits,
                                   recv_splits, group=group)
        return slots.combine(y_back, x_ND)


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]


def expert_shards(model: nn.Module) -> dict[str, nn.Module]:
    """MoE layer name -> its ExpertShard, for the layers ``apply_expert_parallel`` split (empty when none)."""
    return {name: layer.ep_shard for name, layer in moe_layers(model) if hasattr(layer, "ep_shard")}


# ---- the expert index: the one place that maps this rank's experts to the single-process model's -------
def global_expert_id(ep_rank: int, num_local_experts: int, local: int) -> int:
    """Local expert ``local`` of expert-parallel rank ``ep_rank`` is global expert ``ep_rank * L + local``.

    Args:
        ep_rank: the rank in the expert-parallel group.
        num_local_experts: L, experts per expert-parallel rank.
        local: the expert's index on that rank.

    Returns:
        The expert's index in the single-process model.
    """
    return ep_rank * num_local_experts + local


def local_expert_param(name: str) -> tuple[str, str] | None:
    """Split the name of an expert-parallel rank's block of experts (a parameter or state entry).

    Returns:
        ``(MoE layer name, name inside the StackedExperts)`` for
        ``<layer>.ep_shard.deepspeed_moe.experts.deepspeed_experts.0.<rest>``; None for any other name.
    """
    layer_name, sep, rest = name.partition(f".{SHARD_EXPERTS}.")
    return (layer_name, rest) if sep else None


def expert_name(layer_name: str, rest: str) -> str:
    """The single-process name of a layer's stacked expert tensor."""
    return f"{layer_name}.experts.{rest}"


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Each parameter's name in the single-process model (a rank's block of experts: the stacked tensor
    it is rows of). No collective."""
    names = {}
    for name, _ in model.named_parameters():
        parsed = local_expert_param(name)
        names[name] = name if parsed is None else expert_name(*parsed)
    return names


def expert_rows(model: nn.Module) -> dict[str, slice]:
    """For each of this rank's expert-block parameters, the rows of the single-process stacked tensor it holds."""
    shards = expert_shards(model)
    rows = {}
    for name, _ in model.named_parameters():
        parsed = local_expert_param(name)
        if parsed is not None:
            shard = shards[parsed[0]]
            L = shard.experts_per_rank
            ep_rank = dist.get_rank(shard.deepspeed_moe.ep_group)
            rows[name] = slice(global_expert_id(ep_rank, L, 0), global_expert_id(ep_rank, L, L))
    return rows


def gather_experts(shard: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """Every expert-parallel rank's block of ``tensor`` (a stacked weight, or an optimizer state of one),
    concatenated in global expert order: the single-process tensor.

    A collective over the shard's expert-parallel group: every rank of it calls this with its own block
    of the same tensor, in the same order.
    """
    gathered = [torch.empty_like(tensor) for _ in range(shard.ep_size)]
    dist.all_gather(gathered, tensor.contiguous(), group=shard.deepspeed_moe.ep_group)
    return torch.cat(gathered, dim=0)  # rank r holds experts [r L, (r + 1) L): global_expert_id


# ---- applying expert parallelism ---------------------------------------------------------------------
def apply_expert_parallel(model: nn.Module, ep_size: int, rank: int) -> None:
    """Keep this rank's experts in every MoE layer and route tokens to the others by all-to-all.

    Call after the model is built (the same weights on every rank) and before deepspeed.initialize.

    Raises:
        ValueError: the model breaks a limit of expert parallelism (``pipeline.config.limits``: a dense
            model, experts that ep_size does not divide, shared experts).
    """
    cfg = model.cfg
    limits.require(limits.ep_needs_moe(ep_size, cfg.num_experts))
    limits.require(limits.ep_divides_experts(ep_size, cfg.num_experts))
    limits.require(limits.ep_shared_experts(ep_size, cfg.moe_shared_experts))
    ep_rank = rank % ep_size
    for _, layer in moe_layers(model):
        E = layer.num_experts
        L = E // ep_size
        local = layer.experts.slice(global_expert_id(ep_rank, L, 0), global_expert_id(ep_rank, L, L))
        layer.experts = None  # the other ranks' experts are dropped here
        layer.ep_shard = make_expert_shard(E, ep_size, local)
        layer.dispatcher = AllToAllDispatcher(layer.ep_shard, layer.expert_impl)


def check_groups(model: nn.Module, rank: int) -> None:
    """After deepspeed.initialize: the engine's EP groups put this rank where we assumed."""
    for name, shard in expert_shards(model).items():
        got = dist.get_rank(shard.deepspeed_moe.ep_group)
        if got != rank % shard.ep_size:
            raise RuntimeError(f"{name}: DeepSpeed made this rank EP rank {got}, expected {rank % shard.ep_size}")


def canonical_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights in the single-process layout (each layer's experts stacked whole).

    Every rank must call it: each layer's experts are gathered over its expert-parallel group.
    """
    shards = expert_shards(model)
    state = {}
    for key, value in model.state_dict().items():  # the same order on every rank: collectives line up
        parsed = local_expert_param(key)
        if parsed is None:
            state[key] = value
        else:
            state[expert_name(*parsed)] = gather_experts(shards[parsed[0]], value.detach())
    return state


def moe_param_groups(groups: list[dict]) -> list[dict]:
    """Split optimizer groups so expert parameters sit in their own groups (DeepSpeed's ZeRO
    partitions those over the expert-data-parallel group only)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(groups)

"""Expert parallelism, applied to a built model from outside (models/ knows nothing of it).

Each MoE layer (``models.moe.MoEFeedForward``) keeps its router, losses and statistics; what
changes is where its experts live and how tokens reach them:

* Rank ``r`` is expert-parallel rank ``r % ep_size`` (DeepSpeed's default group layout: the
  expert-parallel groups are blocks of ``ep_size`` consecutive ranks) and keeps experts
  ``[ep_rank * L, (ep_rank + 1) * L)``, ``L = num_experts / ep_size``.
* ``AllToAllDispatcher`` replaces the layer's local dispatcher: kept token slots are sorted by
  expert, sent to the owning rank with one all-to-all, run through the local experts, sent back
  with a second all-to-all and combined with their router weights. Both all-to-alls are autograd
  functions, so expert gradients arrive from every rank's tokens.
* DeepSpeed must know which parameters are experts, to reduce their gradients only within the
  expert-data-parallel group and to checkpoint them per expert. Its engine recognises experts
  only inside its own ``deepspeed.moe.layer.MoE`` modules (``engine.has_moe_layers``), with the
  experts at ``deepspeed_moe.experts.deepspeed_experts.<local id>``. ``ExpertShard`` is such a
  module: it holds the local experts under exactly that path, marks their parameters
  (``allreduce=False``, ``group_name``) and receives its process group from the engine. It is
  never called; the layer's forward uses it through the dispatcher.

Shared experts are not supported with ep_size > 1 (``pipeline.limits.ep_shared_experts``): DeepSpeed's checkpoint code treats every
parameter whose name contains "expert" as a routed expert.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.moe import MoEFeedForward, RoutingDecision
from pipeline import limits


def _moe_base():
    from deepspeed.moe.layer import MoE

    return MoE


class _ExpertHolder(nn.Module):
    """``deepspeed_moe`` of an ExpertShard: ``experts.deepspeed_experts`` plus the EP group."""

    def __init__(self, local_experts: list[nn.Module]):
        super().__init__()
        self.experts = nn.Module()
        self.experts.deepspeed_experts = nn.ModuleList(local_experts)
        self.ep_group = None

    def _set_ep_group(self, group) -> None:  # called by DeepSpeed's MoE._create_process_groups
        self.ep_group = group


def make_expert_shard(num_experts: int, ep_size: int, local_experts: list[nn.Module]) -> nn.Module:
    """An ``ExpertShard``: a ``deepspeed.moe.layer.MoE`` in type only, holding this rank's experts."""
    MoE = _moe_base()

    class ExpertShard(MoE):
        def __init__(self) -> None:
            nn.Module.__init__(self)  # not MoE.__init__: no gate or experts of DeepSpeed's own
            self.ep_size = ep_size
            self.num_experts = num_experts
            self.num_local_experts = num_experts // ep_size
            self.expert_group_name = f"ep_size_{ep_size}"
            self.enable_expert_tensor_parallelism = False
            self.use_residual = False
            self.deepspeed_moe = _ExpertHolder(local_experts)
            for p in self.deepspeed_moe.parameters():
                p.allreduce = False
                p.group_name = self.expert_group_name

        def forward(self, *args, **kwargs):
            raise RuntimeError("ExpertShard is a container; the MoE layer calls its experts via the dispatcher")

    return ExpertShard()


class AllToAllDispatcher:
    """Sends kept token slots to the ranks that own their experts and combines the answers.

    Not an nn.Module on purpose: it only points at the layer's ExpertShard, whose parameters are
    registered there.
    """

    def __init__(self, shard: nn.Module):
        self.shard = shard

    def __call__(self, x_ND: torch.Tensor, routing: RoutingDecision, experts: nn.ModuleList) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        shard = self.shard
        group = shard.deepspeed_moe.ep_group
        if group is None:
            raise RuntimeError("expert-parallel group not set: deepspeed.initialize has not run on this model")
        ep, L, E = shard.ep_size, shard.num_local_experts, shard.num_experts
        N, K = routing.expert_indices_NK.shape
        expert_of_slot_S = torch.where(routing.kept_NK, routing.expert_indices_NK, E).reshape(-1)
        order_S = torch.argsort(expert_of_slot_S, stable=True)
        counts_E = torch.bincount(expert_of_slot_S, minlength=E + 1)[:E]
        n_kept = int(counts_E.sum())
        token_sorted = torch.arange(N, device=x_ND.device).repeat_interleave(K)[order_S[:n_kept]]
        weight_sorted = routing.expert_weights_NK.reshape(-1)[order_S[:n_kept]]

        # How many rows each rank sends to each of the receiver's local experts: (ep, L) both ways.
        recv_counts_PL = torch.empty_like(counts_E).view(ep, L)
        dist.all_to_all_single(recv_counts_PL, counts_E.view(ep, L).contiguous(), group=group)
        send_splits = counts_E.view(ep, L).sum(1).tolist()
        recv_splits = recv_counts_PL.sum(1).tolist()

        x_send = x_ND.index_select(0, token_sorted)
        x_recv = all_to_all_single(x_send.new_empty(sum(recv_splits), x_ND.shape[1]), x_send,
                                   recv_splits, send_splits, group=group)
        # Received rows come grouped by (source rank, local expert); run each local expert once.
        local_of_row = torch.arange(L, device=x_ND.device).repeat(ep).repeat_interleave(recv_counts_PL.reshape(-1))
        y_recv = torch.empty_like(x_recv)
        for j, expert in enumerate(shard.deepspeed_moe.experts.deepspeed_experts):
            rows = (local_of_row == j).nonzero(as_tuple=True)[0]
            y_recv = y_recv.index_copy(0, rows, expert(x_recv[rows]))  # runs on 0 rows too: grads stay defined
        y_back = all_to_all_single(y_recv.new_empty(n_kept, x_ND.shape[1]), y_recv, send_splits, recv_splits,
                                   group=group)
        y_back = y_back * weight_sorted.unsqueeze(1).to(y_back.dtype)
        return torch.zeros_like(x_ND).index_add_(0, token_sorted, y_back)


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]


def apply_expert_parallel(model: nn.Module, ep_size: int, rank: int) -> None:
    """Keep this rank's experts in every MoE layer and route tokens to the others by all-to-all.

    Call after the model is built (the same weights on every rank) and before deepspeed.initialize.

    Raises:
        ValueError: the model breaks a limit of expert parallelism (``pipeline.limits``: a dense
            model, experts that ep_size does not divide, shared experts).
    """
    cfg = model.cfg
    limits.require(limits.ep_needs_moe(ep_size, cfg.num_experts))
    limits.require(limits.ep_divides_experts(ep_size, cfg.num_experts))
    limits.require(limits.ep_shared_experts(ep_size, cfg.moe_shared_experts))
    ep_rank = rank % ep_size
    for name, layer in moe_layers(model):
        E = layer.num_experts
        L = E // ep_size
        local = [layer.experts[e] for e in range(ep_rank * L, (ep_rank + 1) * L)]
        layer.experts = nn.ModuleList()  # the other ranks' experts are dropped here
        layer.ep_shard = make_expert_shard(E, ep_size, local)
        layer.dispatcher = AllToAllDispatcher(layer.ep_shard)


def check_groups(model: nn.Module, rank: int) -> None:
    """After deepspeed.initialize: the engine's EP groups put this rank where we assumed."""
    for name, layer in moe_layers(model):
        shard = layer.ep_shard
        got = dist.get_rank(shard.deepspeed_moe.ep_group)
        if got != rank % shard.ep_size:
            raise RuntimeError(f"{name}: DeepSpeed made this rank EP rank {got}, expected {rank % shard.ep_size}")


def canonical_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights in the single-process layout (``...ffn.experts.<global id>...``).

    Every rank must call it: each layer's experts are gathered over its expert-parallel group.
    """
    state = {k: v for k, v in model.state_dict().items() if ".ep_shard." not in k}
    for name, layer in moe_layers(model):
        shard = getattr(layer, "ep_shard", None)
        if shard is None:
            continue
        group, L = shard.deepspeed_moe.ep_group, shard.num_local_experts
        for j, expert in enumerate(shard.deepspeed_moe.experts.deepspeed_experts):
            for pname, p in expert.state_dict().items():
                gathered = [torch.empty_like(p) for _ in range(shard.ep_size)]
                dist.all_gather(gathered, p.detach().contiguous(), group=group)
                for ep_rank, t in enumerate(gathered):
                    state[f"{name}.experts.{ep_rank * L + j}.{pname}"] = t
    return state


def moe_param_groups(groups: list[dict]) -> list[dict]:
    """Split optimizer groups so expert parameters sit in their own groups (DeepSpeed's ZeRO
    partitions those over the expert-data-parallel group only)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(groups)

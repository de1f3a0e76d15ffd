"""Mixture-of-experts feed-forward layer: top-k router, experts, shared experts.

Routing (`MoEFeedForward.route`) and expert computation (`MoEFeedForward.experts_forward`) are separate:

1. `route(x_ND) -> RoutingDecision`: router logits (linear D -> E, no bias, computed in fp32), the
   affinities, top-k experts per token, their combine weights (renormalised to sum to 1 over the k
   picks when `moe_renormalize`, then times `moe_routed_scaling_factor`), and a `kept_NK` mask from the
   capacity rule. It also holds what the losses need, so routing can be inspected or tested on its own.

Routers (`moe_router`):
- "softmax" (Mixtral, DeepSeek-V2): affinities softmax(logits); the top-k by affinity; gates the chosen
  affinities.
- "sigmoid" (DeepSeek-V3 technical report, section 2.1.2): affinities s_i = sigmoid(logit_i); the layer
  holds a per-expert `score_bias` b (a buffer, not trained by the gradient: the aux-loss-free balancing of
  Wang et al. 2024 moves it from outside) that is added only to choose: the top-k of s + b; the gates
  are the chosen s_i, without b.
Group-limited routing (`moe_n_group` > 1, V3): the experts fall into G equal groups in index order; a
group's score is the sum of its two highest (biased) affinities, and only a token's `moe_topk_group`
best groups are eligible for its top-k. The router probabilities of the losses and statistics
(`router_probs_NE`) are the softmax, or for sigmoid the affinities normalised to sum to 1 per token.
2. `experts_forward(x_ND, routing) -> y_ND` delegates to `self.dispatcher(x_ND, routing)`.

Extension point for expert parallelism: `dispatcher` is a plain attribute holding a `Dispatcher`: a
callable that runs the experts it was built with and returns for each token the weighted sum of its
kept experts' outputs (zeros for a token whose slots were all dropped). The default
`LocalDispatcher(self.experts)` runs every expert in this process. A distributed module
(pipeline.training) can, from outside and without editing models/, move the experts elsewhere and set
`layer.dispatcher = AllToAllDispatcher(...)` (permute tokens by expert, all-to-all to the ranks that own
them, run the local experts, all-to-all back, combine). Both order the kept slots by expert with
`SlotOrder` (here), so the grouping and the weighted combine are written once. The router, losses and
statistics stay here and need no change.

Expert storage: `experts` is a `models.layers.grouped_experts.StackedExperts`: one tensor per projection over
the experts (``experts.w13`` (E, 2F, D), gate rows then up rows, and ``experts.w2`` (E, D, F) for
SwiGLU), the layout the grouped matmul consumes, so no forward stacks anything. Expert e's slices
are the per-expert tensors of a Hugging Face Mixtral checkpoint (`block_sparse_moe.experts.{e}.w1/w2/w3`);
exports unstack them (`models.layers.grouped_experts.unstack_expert_state`) and a per-expert state dict
(an older checkpoint, an HF import) loads into the stacked layout.

Capacity (when `moe_capacity_factor` is not None):
    capacity = ceil(capacity_factor * N * k / E) token slots per expert, N = tokens in this call.
Slots are served first come, first served in the row-major order of the flattened (batch, time)
tokens: token n = b * T + t is ahead of every token with a larger n, whatever its k-rank (a token never
picks the same expert twice, so there is no tie inside a token). For each expert, the slots beyond its
first `capacity` are dropped: they contribute nothing, the remaining weights of that token are NOT
renormalised, and the residual connection carries the token past the layer. `moe_capacity_factor=None`
is dropless: every slot is kept. Pad tokens are routed like real ones (the layer has no padding mask).

Losses (returned as one differentiable scalar, coefficients from the config):
- load balance (Switch Transformer, generalised to k slots): E * sum_i f_i * P_i, with f_i the fraction
  of the N*k token-slot assignments (before capacity drops) that chose expert i, and P_i the mean router
  probability of expert i over tokens. Equals 1.0 for a perfectly uniform router. With
  `moe_aux_loss_scope` "sequence" (DeepSeek-V3's sequence-wise balance loss, eqs. 17-20 of its report)
  f and P are taken per sequence of T tokens and the loss is the mean over the B sequences; with one
  sequence both scopes agree.
- router z-loss (ST-MoE): mean over tokens of logsumexp(router_logits)^2.

Shape legend: B batch, T time, N = B*T tokens, D d_model, E experts, K top_k, F expert hidden width,
S kept token slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.layers.ffn import FeedForward
from models.layers.grouped_experts import StackedExperts, run_experts


@dataclass
class RoutingDecision:
    """Where each token goes.

    Attributes:
        expert_indices_NK: chosen experts, best first.
        expert_weights_NK: combine weights for the chosen experts (fp32).
        kept_NK: False for slots dropped by the capacity rule (all True when dropless).
        router_logits_NE: fp32 router logits.
        router_probs_NE: fp32 router probabilities: the softmax of the logits, or for a sigmoid router the
            affinities normalised over the experts.
        capacity: slots per expert, or None when dropless.
    """

    expert_indices_NK: torch.Tensor
    expert_weights_NK: torch.Tensor
    kept_NK: torch.Tensor
    router_logits_NE: torch.Tensor
    router_probs_NE: torch.Tensor
    capacity: int | None


@dataclass
class SlotOrder:
    """The kept token slots of a routing decision, grouped by expert (in token order within an expert).

    Attributes:
        token_S: the token each kept slot belongs to.
        weight_S: its combine weight (fp32).
        counts_E: kept slots per expert; slots ``[sum(counts_E[:e]), sum(counts_E[:e+1]))`` are expert e's.
    """

    token_S: torch.Tensor
    weight_S: torch.Tensor
    counts_E: torch.Tensor

    @classmethod
    def of(cls, routing: RoutingDecision, num_experts: int) -> SlotOrder:
        """Order the kept slots of ``routing`` by expert.

        Args:
            routing: the layer's routing decision.
            num_experts: E, all experts of the layer (wherever they live).

        Returns:
            The slot order.
        """
        N, K = routing.expert_indices_NK.shape
        E = num_experts
        device = routing.expert_indices_NK.device
        # Dropped slots go to a virtual expert E so that one stable sort groups the kept slots by expert.
        expert_of_slot_S = torch.where(routing.kept_NK, routing.expert_indices_NK, E).reshape(-1)
        order_S = torch.argsort(expert_of_slot_S, stable=True)
        # Counting by index_add rather than bincount: bincount's output size depends on the data, which
        # costs a host sync on a GPU.
        counts_E = torch.zeros(E + 1, dtype=torch.long, device=device).index_add_(
            0, expert_of_slot_S, torch.ones_like(expert_of_slot_S))[:E]
        if routing.capacity is not None:
            order_S = order_S[: int(counts_E.sum())]  # the one host sync: how many slots were kept
        token_S = order_S.div(K, rounding_mode="floor")  # slot s = n * K + k belongs to token n
        weight_S = routing.expert_weights_NK.reshape(-1).index_select(0, order_S)
        return cls(token_S, weight_S, counts_E)

    def gather(self, x_ND: torch.Tensor) -> torch.Tensor:
        """Each kept slot's token row, ``x_SD``, grouped by expert (backward: index_add, not index_put)."""
        return x_ND.index_select(0, self.token_S)

    def combine(self, y_SD: torch.Tensor, x_ND: torch.Tensor) -> torch.Tensor:
        """Per token, the weighted sum of its slots' expert outputs ``y_SD`` (zeros where all were dropped),
        summed in ``x_ND``'s dtype (under bf16 autocast the experts' outputs are bf16, the tokens fp32)."""
        y_SD = y_SD * self.weight_S.unsqueeze(1).to(y_SD.dtype)
        return torch.zeros_like(x_ND).index_add_(0, self.token_S, y_SD.to(x_ND.dtype))


class Dispatcher(Protocol):
    """What `MoEFeedForward.dispatcher` must be: runs the experts it was built with, (x_ND, routing) -> y_ND."""

    def __call__(self, x_ND: torch.Tensor, routing: RoutingDecision) -> torch.Tensor: ...


class LocalDispatcher:
    """Runs all experts in this process: order kept slots by expert, run the experts, combine.

    Every expert takes part, even on zero tokens, so that all expert parameters are part of the autograd
    graph in every step (data-parallel gradient reduction then needs no unused-parameter search).

    Args:
        experts: every expert of the layer, stacked. Held by reference (a dispatcher is not a module:
            the layer registers the experts).
        impl: how the experts run (``models.layers.grouped_experts.run_experts``): "auto", "grouped_mm" or "loop".
    """

    def __init__(self, experts: StackedExperts, impl: str = "auto") -> None:
        self.experts = experts
        self.impl = impl

    def __call__(self, x_ND: torch.Tensor, routing: RoutingDecision) -> torch.Tensor:
        slots = SlotOrder.of(routing, len(self.experts))
        y_SD = run_experts(self.experts, slots.gather(x_ND), slots.counts_E, self.impl)
        return slots.combine(y_SD, x_ND)


class MoEFeedForward(nn.Module):
    """Top-k routed experts plus optional shared experts (see the module docstring).

    Args:
        cfg: model config (num_experts, moe_top_k, moe_capacity_factor, moe_renormalize,
            moe_shared_experts, moe_*_coef, ffn, bias, resolved_moe_d_ff).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.num_experts < 1:
            raise ValueError(f"MoEFeedForward needs num_experts >= 1, got {cfg.num_experts}")
        self.num_experts = cfg.num_experts
        self.top_k = cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.renormalize = cfg.moe_renormalize
        self.router_kind = cfg.moe_router
        self.n_group, self.topk_group = cfg.moe_n_group, cfg.moe_topk_group
        self.routed_scaling_factor = cfg.moe_routed_scaling_factor
        self.bias_update_rate = cfg.moe_bias_update_rate
        self.aux_loss_coef = cfg.moe_aux_loss_coef
        self.aux_loss_scope = cfg.moe_aux_loss_scope
        self.z_loss_coef = cfg.moe_z_loss_coef
        hidden = cfg.resolved_moe_d_ff
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        # The sigmoid router's selection bias (fp32, zero at init; set by `init_weights`).
        self.score_bias: torch.Tensor | None
        if cfg.moe_router == "sigmoid":
            self.register_buffer("score_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.score_bias = None
        self.experts = StackedExperts(cfg.num_experts, cfg.d_model, hidden, cfg.ffn, cfg.bias)
        self.shared_experts = nn.ModuleList(
            FeedForward(cfg.d_model, hidden, cfg.ffn, cfg.bias) for _ in range(cfg.moe_shared_experts)
        )
        self.expert_impl = cfg.moe_expert_impl
        self.dispatcher: Dispatcher = LocalDispatcher(self.experts, self.expert_impl)
        # Where this call holds one of several equal shards of every sequence (sequence parallelism): the mean of
        # a per-shard statistic over the shards, differentiable (pipeline.training.sequence_parallel installs
        # it), so the balancing loss is the whole sequences'. None: the statistics are this call's own.
        self.shard_mean = None

    def route(self, x_ND: torch.Tensor) -> RoutingDecision:
        """Pick the top-k experts of every token and apply the capacity rule.

        Args:
            x_ND: flattened tokens.

        Returns:
            The routing decision.
        """
        N = x_ND.shape[0]
        E, K = self.num_experts, self.top_k
        logits_NE = F.linear(x_ND.float(), self.router.weight.float())
        if self.router_kind == "sigmoid":
            affinity_NE = torch.sigmoid(logits_NE)
            probs_NE = affinity_NE / affinity_NE.sum(dim=-1, keepdim=True)
            choice_NE = affinity_NE + self.score_bias
        else:
            affinity_NE = probs_NE = choice_NE = torch.softmax(logits_NE, dim=-1)
        if self.n_group > 1:
            choice_NE = self.eligible_groups(choice_NE)
        top_i_NK = torch.topk(choice_NE, K, dim=-1).indices
        top_p_NK = affinity_NE.gather(1, top_i_NK)
        weights_NK = top_p_NK / top_p_NK.sum(dim=-1, keepdim=True) if self.renormalize else top_p_NK
        if self.routed_scaling_factor != 1.0:
            weights_NK = weights_NK * self.routed_scaling_factor
        if self.capacity_factor is None:
            capacity = None
            kept_NK = torch.ones_like(top_i_NK, dtype=torch.bool)
        else:
            capacity = math.ceil(self.capacity_factor * N * K / E)
            # Row-major flattening of (N, K) puts token n's slots before token n+1's: first come, first served.
            onehot_SE = F.one_hot(top_i_NK.reshape(-1), E)
            rank_in_expert_S = (onehot_SE.cumsum(dim=0) - 1).gather(1, top_i_NK.reshape(-1, 1)).squeeze(1)
            kept_NK = (rank_in_expert_S < capacity).view(N, K)
        return RoutingDecision(top_i_NK, weights_NK, kept_NK, logits_NE, probs_NE, capacity)

    def eligible_groups(self, choice_NE: torch.Tensor) -> torch.Tensor:
        """``choice_NE`` with every expert outside a token's ``topk_group`` best groups at -inf (a group's
        score: the sum of its two highest choice scores)."""
        N, E = choice_NE.shape
        grouped_NGX = choice_NE.view(N, self.n_group, E // self.n_group)
        group_score_NG = grouped_NGX.topk(2, dim=-1).values.sum(dim=-1)
        best_NG = torch.zeros_like(group_score_NG, dtype=torch.bool).scatter_(
            1, group_score_NG.topk(self.topk_group, dim=-1).indices, True)
        return grouped_NGX.masked_fill(~best_NG[:, :, None], float("-inf")).view(N, E)

    def experts_forward(self, x_ND: torch.Tensor, routing: RoutingDecision) -> torch.Tensor:
        """Weighted sum of the kept experts' outputs per token, through the pluggable `dispatcher`."""
        return self.dispatcher(x_ND, routing)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Route, run experts (and shared experts), and compute the auxiliary losses.

        Args:
            x_BTD: normalised input.

        Returns:
            (y_BTD, aux_loss, stats): aux_loss is the differentiable scalar
            aux_loss_coef * load_balance_loss + z_loss_coef * z_loss; stats holds detached
            `tokens_per_expert` (E,) kept-slot counts, `routed_per_expert` (E,) slots routed before the
            capacity rule (the load the score bias balances), `load_balance_loss`, `z_loss`,
            `dropped_fraction` and `router_entropy` (mean over tokens, nats).
        """
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        routing = self.route(x_ND)
        y_ND = self.experts_forward(x_ND, routing)
        for shared in self.shared_experts:
            y_ND = y_ND + shared(x_ND)

        E, K = self.num_experts, self.top_k
        idx_S = routing.expert_indices_NK.reshape(-1)
        assigned_E = torch.zeros(E, dtype=torch.long, device=idx_S.device).index_add_(0, idx_S, torch.ones_like(idx_S))
        if self.aux_loss_scope == "sequence":
            # Slot s = (b * T + t) * K + k belongs to sequence b = s // (T K).
            seq_S = torch.arange(idx_S.numel(), device=idx_S.device).div(T * K, rounding_mode="floor")
            assigned_BE = torch.zeros(B * E, device=idx_S.device).index_add_(
                0, seq_S * E + idx_S, torch.ones(idx_S.numel(), device=idx_S.device)).view(B, E)
            P_BE = routing.router_probs_NE.view(B, T, E).mean(dim=1)
            f_BE = assigned_BE / (T * K)
            if self.shard_mean is not None:
                f_BE, P_BE = self.shard_mean(f_BE), self.shard_mean(P_BE)
            load_balance = E * (f_BE * P_BE).sum(dim=-1).mean()
        else:
            f_E = assigned_E.float() / routing.expert_indices_NK.numel()
            P_E = routing.router_probs_NE.mean(dim=0)
            if self.shard_mean is not None:
                f_E, P_E = self.shard_mean(f_E), self.shard_mean(P_E)
            load_balance = E * (f_E * P_E).sum()
        lse_N = torch.logsumexp(routing.router_logits_NE, dim=-1)
        z_loss = lse_N.pow(2).mean()
        aux_loss = self.aux_loss_coef * load_balance + self.z_loss_coef * z_loss

        with torch.no_grad():
            # Kept slots per expert without a boolean-mask gather (whose size would need a host sync).
            kept_E = torch.zeros(E, dtype=torch.long, device=idx_S.device).index_add_(
                0, idx_S, routing.kept_NK.reshape(-1).long())
            stats = {
                "routed_per_expert": assigned_E,
                "tokens_per_expert": kept_E,
                "load_balance_loss": load_balance.detach(),
                "z_loss": z_loss.detach(),
                "dropped_fraction": 1.0 - routing.kept_NK.float().mean(),
                "router_entropy": self._router_entropy(routing, lse_N),
            }
        return y_ND.view(B, T, D), aux_loss, stats

    @torch.no_grad()
    def update_score_bias(self, routed_E: torch.Tensor) -> None:
        """One auxiliary-loss-free balancing step: ``score_bias += rate * sign(mean(routed) - routed)``.

        Args:
            routed_E: token slots routed to each expert (before capacity) over the whole global batch of
                the optimizer step just taken: every micro-batch, every rank.
        """
        load_E = routed_E.to(self.score_bias.device, torch.float64)
        self.score_bias += (self.bias_update_rate * torch.sign(load_E.mean() - load_E)).float()

    def _router_entropy(self, routing: RoutingDecision, lse_N: torch.Tensor) -> torch.Tensor:
        """Mean over tokens of -sum p log p of the router probabilities (nats)."""
        p_NE = routing.router_probs_NE
        if self.router_kind == "softmax":  # log p = z - lse: reuses the z-loss's logsumexp (no log_softmax pass)
            return (lse_N - (p_NE * routing.router_logits_NE).sum(dim=-1)).mean()
        return -(p_NE * p_NE.clamp_min(1e-30).log()).sum(dim=-1).mean()

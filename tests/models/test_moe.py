"""Mixture of experts: routing, losses, capacity, equivalences and the dispatcher hook."""

from __future__ import annotations

import math

import pytest
import torch

from models.families.decoder.model import Transformer
from models.layers.ffn import FeedForward
from models.layers.grouped_experts import unstack_expert_state
from models.layers.moe import LocalDispatcher, MoEFeedForward, RoutingDecision, SlotOrder


def _moe(make_cfg, seed=0, scale=0.3, **kw) -> MoEFeedForward:
    cfg = make_cfg(**kw)
    torch.manual_seed(seed)
    layer = MoEFeedForward(cfg)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * scale
    return layer


def test_one_expert_top1_equals_the_dense_ffn(make_cfg):
    layer = _moe(make_cfg, num_experts=1, moe_top_k=1)
    dense = FeedForward(32, layer.experts.hidden, "swiglu", False)
    per_expert = unstack_expert_state({f"experts.{k}": v for k, v in layer.experts.state_dict().items()})
    dense.load_state_dict({k.removeprefix("experts.0."): v for k, v in per_expert.items()})
    x = torch.randn(2, 5, 32)
    y, aux, stats = layer(x)
    torch.testing.assert_close(y, dense(x))
    assert stats["tokens_per_expert"].tolist() == [10]
    # One expert: f = P = 1, so the load-balance loss is E * 1 * 1 = 1.
    assert stats["load_balance_loss"].item() == pytest.approx(1.0)


@torch.no_grad()
def per_token_reference(layer: MoEFeedForward, x_ND: torch.Tensor) -> torch.Tensor:
    """Loop over tokens: softmax router, top-k, optional renormalisation, weighted expert sum."""
    out = torch.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        logits = [float(x_ND[n] @ layer.router.weight[e]) for e in range(layer.num_experts)]
        z = max(logits)
        probs = [math.exp(v - z) for v in logits]
        probs = [p / sum(probs) for p in probs]
        chosen = sorted(range(layer.num_experts), key=lambda e: -probs[e])[: layer.top_k]
        total = sum(probs[e] for e in chosen) if layer.renormalize else 1.0
        for e in chosen:
            out[n] += probs[e] / total * layer.experts.expert(e, x_ND[n:n + 1])[0]
        for shared in layer.shared_experts:
            out[n] += shared(x_ND[n:n + 1])[0]
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_experts=4, moe_top_k=2),
        dict(num_experts=4, moe_top_k=2, moe_renormalize=False),
        dict(num_experts=3, moe_top_k=1, moe_shared_experts=2, moe_d_ff=24),
        dict(num_experts=4, moe_top_k=4, ffn="gelu", bias=True),
    ],
)
def test_dropless_equals_per_token_loop(make_cfg, kw):
    layer = _moe(make_cfg, **kw)
    x = torch.randn(3, 6, 32)
    y, _, stats = layer(x)
    expected = per_token_reference(layer, x.reshape(18, 32)).view(3, 6, 32)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-4)
    assert stats["dropped_fraction"].item() == 0.0
    assert stats["tokens_per_expert"].sum().item() == 18 * layer.top_k


def test_aux_and_z_loss_by_hand(make_cfg):
    layer = _moe(make_cfg, num_experts=3, moe_top_k=2, moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
    x = torch.randn(1, 5, 32)
    _, aux, stats = layer(x)
    logits = x[0] @ layer.router.weight.T  # (5, 3)
    probs = torch.softmax(logits, dim=-1)
    top2 = probs.topk(2, dim=-1).indices
    f = [sum(int(e in top2[n].tolist()) for n in range(5)) / (5 * 2) for e in range(3)]
    P = [probs[:, e].mean().item() for e in range(3)]
    load_balance = 3 * sum(fi * pi for fi, pi in zip(f, P))
    z = sum(math.log(sum(math.exp(v) for v in logits[n].tolist())) ** 2 for n in range(5)) / 5
    entropy = -(probs * probs.log()).sum(-1).mean().item()
    assert stats["load_balance_loss"].item() == pytest.approx(load_balance, rel=1e-5)
    assert stats["z_loss"].item() == pytest.approx(z, rel=1e-5)
    assert stats["router_entropy"].item() == pytest.approx(entropy, rel=1e-5)
    assert aux.item() == pytest.approx(0.1 * load_balance + 0.01 * z, rel=1e-5)
    aux.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def _forced_router(layer: MoEFeedForward, prefs: list[list[int]]) -> torch.Tensor:
    """Inputs that make token n rank experts as prefs[n] (one-hot inputs, router weights = scores)."""
    N, E = len(prefs), layer.num_experts
    scores = torch.zeros(E, N)
    for n, pref in enumerate(prefs):
        for rank, e in enumerate(pref):
            scores[e, n] = 5.0 - rank  # decreasing preference
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :N] = scores
    return torch.eye(32)[:N].unsqueeze(0)  # (1, N, 32): token n is basis vector n


def test_capacity_drops_exactly_the_late_tokens(make_cfg):
    # E = 2, k = 1, N = 6, factor 1.0 -> capacity = ceil(1.0 * 6 * 1 / 2) = 3 per expert.
    layer = _moe(make_cfg, num_experts=2, moe_top_k=1, moe_capacity_factor=1.0)
    x = _forced_router(layer, [[0, 1]] * 5 + [[1, 0]])  # five tokens want expert 0, the last wants 1
    routing = layer.route(x.reshape(6, 32))
    assert routing.capacity == 3
    assert routing.expert_indices_NK[:, 0].tolist() == [0, 0, 0, 0, 0, 1]
    assert routing.kept_NK[:, 0].tolist() == [True, True, True, False, False, True]
    y, _, stats = layer(x)
    assert (y[0, 3:5] == 0).all()  # dropped tokens get nothing (the residual carries them)
    for n in (0, 1, 2):
        w = routing.expert_weights_NK[n, 0]
        torch.testing.assert_close(y[0, n], w * layer.experts.expert(0, x[0, n:n + 1])[0])
    assert stats["tokens_per_expert"].tolist() == [3, 1]
    assert stats["dropped_fraction"].item() == pytest.approx(2 / 6)


def test_capacity_order_is_token_position_not_k_rank(make_cfg):
    # E = 3, k = 2, N = 3, factor 0.5 -> capacity = ceil(0.5 * 3 * 2 / 3) = 1 per expert.
    layer = _moe(make_cfg, num_experts=3, moe_top_k=2, moe_capacity_factor=0.5)
    # token 0 picks (1, 0); token 1 picks (0, 2); token 2 picks (2, 1)
    x = _forced_router(layer, [[1, 0, 2], [0, 2, 1], [2, 1, 0]])
    routing = layer.route(x.reshape(3, 32))
    assert routing.capacity == 1
    # Expert 0: token 0's 2nd choice came first, so token 1's 1st choice is dropped.
    # Expert 1: token 0 (1st choice) kept, token 2 (2nd choice) dropped. Expert 2: token 1 kept, token 2 dropped.
    assert routing.kept_NK.tolist() == [[True, True], [False, True], [False, False]]
    _, _, stats = layer(x)
    assert stats["tokens_per_expert"].tolist() == [1, 1, 1]
    assert stats["dropped_fraction"].item() == pytest.approx(3 / 6)


def test_large_capacity_is_dropless(make_cfg):
    layer = _moe(make_cfg, num_experts=4, moe_top_k=2)
    x = torch.randn(2, 7, 32)
    y_dropless, _, _ = layer(x)
    layer.capacity_factor = 4.0  # capacity = N*k, nothing can overflow
    y_cap, _, stats = layer(x)
    torch.testing.assert_close(y_cap, y_dropless)
    assert stats["dropped_fraction"].item() == 0.0


def test_dispatcher_is_pluggable(make_cfg):
    layer = _moe(make_cfg, num_experts=4, moe_top_k=2)
    x = torch.randn(2, 5, 32)
    expected, _, _ = layer(x)
    calls = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x_ND, routing):
            calls.append((x_ND.shape, routing.expert_indices_NK.shape, len(self.inner.experts)))
            return self.inner(x_ND, routing)

    layer.dispatcher = Recording(LocalDispatcher(layer.experts))
    y, _, _ = layer(x)
    torch.testing.assert_close(y, expected)
    assert calls == [(torch.Size([10, 32]), torch.Size([10, 2]), 4)]
    assert "dispatcher" not in dict(layer.named_children())  # not a module: state dict unchanged


def test_slot_order_groups_kept_slots_by_expert_and_combines_with_weights():
    # 3 tokens, top-2 over 3 experts; token 2's second slot (expert 0) was dropped by capacity.
    idx = torch.tensor([[1, 0], [0, 2], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    kept = torch.tensor([[True, True], [True, True], [True, False]])
    routing = RoutingDecision(idx, weights, kept, torch.zeros(3, 3), torch.zeros(3, 3), capacity=2)
    slots = SlotOrder.of(routing, num_experts=3)
    assert slots.counts_E.tolist() == [2, 2, 1]
    assert slots.token_S.tolist() == [0, 1, 0, 2, 1]  # expert 0: tokens 0, 1; expert 1: 0, 2; expert 2: 1
    assert slots.weight_S.tolist() == pytest.approx([0.4, 0.7, 0.6, 0.9, 0.3])
    x_ND = torch.arange(6.0).view(3, 2)
    assert slots.gather(x_ND).tolist() == [x_ND[t].tolist() for t in (0, 1, 0, 2, 1)]
    y = slots.combine(torch.ones(5, 2), x_ND)
    torch.testing.assert_close(y, torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.9, 0.9]]))


def test_all_expert_parameters_get_gradients(make_cfg):
    layer = _moe(make_cfg, num_experts=4, moe_top_k=1)
    x = _forced_router(layer, [[0, 1, 2, 3]] * 4)  # experts 1..3 receive no tokens
    y, aux, _ = layer(x)
    (y.sum() + aux).backward()
    for p in layer.parameters():
        assert p.grad is not None  # unused experts still join the graph (zero gradients)


def test_model_level_moe_outputs(make_cfg):
    cfg = make_cfg(n_layers=4, num_experts=4, moe_top_k=2, moe_every=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    out = model(torch.randint(0, 64, (2, 8)))
    assert [b.is_moe for b in model.layers] == [False, True, False, True]
    assert len(out.moe_stats) == 2
    expected = sum(cfg.moe_aux_loss_coef * s["load_balance_loss"] + cfg.moe_z_loss_coef * s["z_loss"]
                   for s in out.moe_stats)
    torch.testing.assert_close(out.aux_loss, expected)
    assert out.aux_loss.requires_grad
    for s in out.moe_stats:
        assert set(s) == {"tokens_per_expert", "routed_per_expert", "load_balance_loss", "z_loss", "dropped_fraction", "router_entropy"}
        assert s["tokens_per_expert"].shape == (4,) and s["tokens_per_expert"].sum() == 16 * 2


def test_stats_by_their_definitions(make_cfg):
    layer = _moe(make_cfg, num_experts=4, moe_top_k=2, moe_capacity_factor=0.5)
    x = torch.randn(2, 8, 32)
    _, _, stats = layer(x)
    routing = layer.route(x.reshape(16, 32))
    p = routing.router_probs_NE
    torch.testing.assert_close(stats["router_entropy"], -(p * p.log()).sum(-1).mean())
    kept = routing.expert_indices_NK[routing.kept_NK]
    assert stats["tokens_per_expert"].tolist() == torch.bincount(kept, minlength=4).tolist()
    assert stats["dropped_fraction"].item() == pytest.approx(1 - kept.numel() / 32)

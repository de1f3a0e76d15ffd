"""DeepSeek-V3's router as an option of the MoE layer: sigmoid affinities, a score bias that only
chooses, group-limited routing and the routed scaling factor; checked against the report's formulas
written out here, and the softmax router unchanged."""

from __future__ import annotations

import itertools

import pytest
import torch

from models import ModelConfig, build_model
from models.layers.moe import MoEFeedForward

BASE = dict(vocab_size=97, d_model=16, n_layers=2, n_heads=2, max_seq_len=16, num_experts=8, moe_top_k=2)


def layer(**fields) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(ModelConfig(**{**BASE, **fields}))


def v3_reference(logits_NE, bias_E, n_group, topk_group, k, scale, renormalize=True):
    """DeepSeek-V3 (technical report, section 2.1.2) token by token, in plain Python loops."""
    experts_per_group = logits_NE.shape[1] // n_group
    chosen, gates = [], []
    for logits in logits_NE.double():
        s = torch.sigmoid(logits)
        biased = s + bias_E.double()
        group_scores = [sum(sorted(biased[g * experts_per_group:(g + 1) * experts_per_group].tolist())[-2:])
                        for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_scores[g])[:topk_group]
        eligible = [e for g in groups for e in range(g * experts_per_group, (g + 1) * experts_per_group)]
        top = sorted(eligible, key=lambda e: -biased[e].item())[:k]
        g = torch.stack([s[e] for e in top])
        if renormalize:
            g = g / g.sum()
        chosen.append(top)
        gates.append((g * scale).tolist())
    return chosen, gates


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2), (4, 1), (2, 1)])
def test_sigmoid_router_is_deepseek_v3(n_group, topk_group):
    moe = layer(moe_router="sigmoid", moe_n_group=n_group, moe_topk_group=topk_group, moe_routed_scaling_factor=2.5)
    moe.score_bias.copy_(torch.linspace(-0.2, 0.3, 8))  # a non-zero bias, as training would leave it
    x = torch.randn(40, 16)
    routing = moe.route(x)
    logits = x @ moe.router.weight.T
    chosen, gates = v3_reference(logits, moe.score_bias, n_group, topk_group, 2, 2.5)
    assert routing.expert_indices_NK.tolist() == chosen
    torch.testing.assert_close(routing.expert_weights_NK.double(), torch.tensor(gates, dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    s = torch.sigmoid(logits)
    torch.testing.assert_close(routing.router_probs_NE, s / s.sum(-1, keepdim=True))


def test_the_bias_chooses_but_never_weighs():
    moe = layer(moe_router="sigmoid", moe_renormalize=False)
    moe.score_bias[5] = 10.0  # expert 5 wins every token's first slot
    x = torch.randn(32, 16)
    routing = moe.route(x)
    assert (routing.expert_indices_NK[:, 0] == 5).all()
    # Its gate is its affinity alone: sigmoid(logit), not sigmoid(logit) + 10.
    torch.testing.assert_close(routing.expert_weights_NK[:, 0], torch.sigmoid(x @ moe.router.weight[5]))


def test_only_the_best_groups_are_eligible():
    moe = layer(moe_router="sigmoid", moe_n_group=4, moe_topk_group=1)
    moe.score_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0]))  # group 3 best for every token
    routing = moe.route(torch.randn(24, 16))
    assert sorted(set(routing.expert_indices_NK.flatten().tolist())) == [6, 7]


def test_the_softmax_router_is_unchanged():
    moe = layer()
    assert moe.score_bias is None and "score_bias" not in moe.state_dict()
    x = torch.randn(30, 16)
    routing = moe.route(x)
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    top_p, top_i = probs.topk(2, dim=-1)
    assert torch.equal(routing.expert_indices_NK, top_i)
    torch.testing.assert_close(routing.expert_weights_NK, top_p / top_p.sum(-1, keepdim=True))


def test_softmax_with_groups_and_scaling():
    """Group limits and the scaling factor apply to the softmax router too (the gates sum to the factor)."""
    moe = layer(moe_n_group=2, moe_topk_group=1, moe_routed_scaling_factor=1.5)
    x = torch.randn(30, 16)
    routing = moe.route(x)
    groups = routing.expert_indices_NK // 4
    assert (groups[:, 0] == groups[:, 1]).all()  # both picks from the token's one eligible group
    torch.testing.assert_close(routing.expert_weights_NK.sum(-1), torch.full((30,), 1.5))


def test_the_score_bias_is_state_zeroed_at_init_and_no_parameter():
    cfg = ModelConfig(**{**BASE, "moe_router": "sigmoid"})
    model = build_model(cfg)  # built on the meta device, then to_empty and init_weights
    biases = {n: b for n, b in model.named_buffers()}
    assert sorted(biases) == ["layers.0.ffn.score_bias", "layers.1.ffn.score_bias"]
    assert all(torch.equal(b, torch.zeros(8)) for b in biases.values())
    assert not any("score_bias" in n for n, _ in model.named_parameters())
    state = model.state_dict()
    state["layers.1.ffn.score_bias"] = torch.arange(8.0)
    model.load_state_dict(state)
    assert torch.equal(model.layers[1].ffn.score_bias, torch.arange(8.0))


@pytest.mark.parametrize("fields, message", [
    ({"moe_router": "topk"}, r"moe_router must be one of"),
    ({"moe_routed_scaling_factor": 0.0}, r"moe_routed_scaling_factor must be > 0"),
    ({"moe_n_group": 3}, r"moe_n_group \(3\) must divide num_experts \(8\)"),
    ({"moe_n_group": 2, "moe_topk_group": 3}, r"moe_topk_group \(3\) must be in 1..moe_n_group \(2\)"),
    ({"moe_n_group": 8}, r"leaves 1 expert per group.*use at most 4 groups"),
    ({"moe_n_group": 4, "moe_topk_group": 1, "moe_top_k": 3},
     r"moe_topk_group \(1\) groups of 2 experts cannot hold moe_top_k \(3\) experts: raise moe_topk_group to at least 2"),
])
def test_impossible_routing_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BASE, **fields})


def test_every_group_choice_is_a_valid_topk():
    """Exhaustive over small layouts: picks are distinct, inside the eligible groups, best-first."""
    for n_group, topk_group, k in itertools.product((2, 4), (1, 2), (1, 2)):
        if topk_group > n_group:
            continue
        moe = layer(moe_router="sigmoid", moe_n_group=n_group, moe_topk_group=topk_group, moe_top_k=k)
        moe.score_bias.copy_(torch.linspace(0.3, -0.2, 8))  # a bias that reorders some tokens' picks
        routing = moe.route(torch.randn(16, 16))
        idx = routing.expert_indices_NK
        assert all(len(set(row)) == k for row in idx.tolist())
        groups_used = (idx // (8 // n_group))
        assert all(len(set(row)) <= topk_group for row in groups_used.tolist())
        # Best first: each token's picks in descending order of their biased score, ...
        biased = torch.sigmoid(routing.router_logits_NE) + moe.score_bias
        picked = biased.gather(1, idx)
        assert (picked[:, :-1] >= picked[:, 1:]).all(), (picked, idx)
        # ... and exactly DeepSeek-V3's picks, order included (the reference sorts them best first).
        chosen, _ = v3_reference(routing.router_logits_NE, moe.score_bias, n_group, topk_group, k, 1.0)
        assert idx.tolist() == chosen


def test_the_bias_step_moves_each_bias_by_the_rate_towards_balance():
    """b_i += gamma * sign(mean load - load_i): over-loaded experts down, under-loaded up, the mean one still."""
    moe = layer(moe_router="sigmoid", moe_bias_update_rate=0.001)
    moe.score_bias.copy_(torch.full((8,), 0.5))
    moe.update_score_bias(torch.tensor([10, 0, 5, 5, 5, 5, 5, 5]))  # mean 5
    torch.testing.assert_close(moe.score_bias, torch.tensor([0.499, 0.501, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]))
    x = torch.randn(12, 16)
    _, _, stats = moe(x.view(3, 4, 16))
    routed = stats["routed_per_expert"]  # every top-k pick, before capacity: what the bias step counts
    assert routed.sum() == 12 * 2 and torch.equal(routed, stats["tokens_per_expert"])  # dropless
    _, _, capped = layer(moe_router="sigmoid", moe_capacity_factor=0.5)(x.view(3, 4, 16))
    assert capped["routed_per_expert"].sum() == 24 and capped["tokens_per_expert"].sum() < 24  # before capacity


def test_a_bias_rate_needs_the_sigmoid_router():
    with pytest.raises(ValueError, match=r"moe_bias_update_rate=0.01 moves the sigmoid router's score bias"):
        ModelConfig(**{**BASE, "moe_bias_update_rate": 0.01})
    with pytest.raises(ValueError, match=r"moe_bias_update_rate must be >= 0"):
        ModelConfig(**{**BASE, "moe_router": "sigmoid", "moe_bias_update_rate": -0.1})


def v3_sequence_balance_reference(affinity_BTE, chosen_BTK):
    """DeepSeek-V3's sequence-wise balance loss (report, eqs. 17-20) in loops: per sequence,
    sum_i f_i P_i with f_i = E / (K T) * #{t: i chosen at t} and P_i = mean_t s_i,t / sum_j s_j,t; averaged
    over the sequences (the coefficient alpha outside)."""
    B, T, E = affinity_BTE.shape
    K = chosen_BTK.shape[-1]
    total = 0.0
    for b in range(B):
        for i in range(E):
            f = E / (K * T) * sum(int(i in chosen_BTK[b, t].tolist()) for t in range(T))
            P = sum(float(affinity_BTE[b, t, i] / affinity_BTE[b, t].sum()) for t in range(T)) / T
            total += f * P
    return total / B


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_the_sequence_wise_balance_loss_is_the_v3_formula_per_sequence(router):
    moe = layer(moe_router=router, moe_aux_loss_scope="sequence", moe_aux_loss_coef=1e-4, moe_z_loss_coef=0.0)
    torch.manual_seed(3)
    x_BTD = torch.randn(3, 5, 16)
    _, aux, stats = moe(x_BTD)
    routing = moe.route(x_BTD.reshape(15, 16))
    logits = routing.router_logits_NE.view(3, 5, 8)
    affinity = torch.sigmoid(logits) if router == "sigmoid" else torch.softmax(logits, dim=-1)
    expected = v3_sequence_balance_reference(affinity, routing.expert_indices_NK.view(3, 5, 2))
    assert stats["load_balance_loss"].item() == pytest.approx(expected, rel=1e-6)
    assert aux.item() == pytest.approx(1e-4 * expected, rel=1e-6)
    # One sequence: the batch scope's loss; three: the mean of the three alone, not the batch's.
    batch = layer(moe_router=router, moe_aux_loss_coef=1e-4, moe_z_loss_coef=0.0)
    alone = [batch(x_BTD[b : b + 1])[2]["load_balance_loss"].item() for b in range(3)]
    assert stats["load_balance_loss"].item() == pytest.approx(sum(alone) / 3, rel=1e-6)
    assert batch(x_BTD)[2]["load_balance_loss"].item() != pytest.approx(sum(alone) / 3, rel=1e-3)
    # It trains the router (through P; the counts are not differentiable).
    aux.backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_the_aux_loss_scope_is_checked_by_name():
    with pytest.raises(ValueError, match="moe_aux_loss_scope must be one of"):
        ModelConfig(**BASE, moe_aux_loss_scope="token")

"""A canonical.pt written before the experts were stacked loads into the stacked layout."""

from __future__ import annotations

import torch

from models.layers.grouped_experts import StackedExperts, unstack_expert_state
from pipeline.training.checkpoint.canonical import STATE_KEYS, _stacked


def test_per_expert_weights_and_adam_moments_are_stacked_alike():
    torch.manual_seed(0)
    stacked = {key: {f"layers.1.ffn.experts.{k}": v.detach().clone() for k, v in
                     StackedExperts(4, 8, 16, "swiglu", True).state_dict().items()} for key in STATE_KEYS}
    for key in STATE_KEYS:
        for t in stacked[key].values():
            t.normal_()  # each of weight, exp_avg, exp_avg_sq its own numbers
    per_expert = {key: unstack_expert_state(stacked[key]) for key in STATE_KEYS}
    dense = {"weight": torch.randn(3), "exp_avg": torch.randn(3), "exp_avg_sq": torch.rand(3)}
    old = {name: {key: per_expert[key][name] for key in STATE_KEYS} for name in per_expert["weight"]}
    old["layers.0.ffn.w1.weight"] = dense
    assert "layers.1.ffn.experts.3.w3.bias" in old
    new = _stacked(old)
    assert set(new) == {*stacked["weight"], "layers.0.ffn.w1.weight"}
    for name in stacked["weight"]:
        for key in STATE_KEYS:
            assert torch.equal(new[name][key], stacked[key][name]), (name, key)
    assert new["layers.0.ffn.w1.weight"] == dense
    assert _stacked(new).keys() == new.keys()  # a stacked checkpoint is left as it is

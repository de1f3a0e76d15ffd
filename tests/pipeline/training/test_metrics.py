from __future__ import annotations

import math

import pytest
import torch

from pipeline.training.metrics import MoEStats, gpu_peak_flops, measure_matmul_flops


def layer(counts, lb, z, dropped, entropy, routed=None):
    return {"tokens_per_expert": torch.tensor(counts), "routed_per_expert": torch.tensor(routed or counts),
            "load_balance_loss": torch.tensor(lb),
            "z_loss": torch.tensor(z), "dropped_fraction": torch.tensor(dropped),
            "router_entropy": torch.tensor(entropy)}


def test_moe_stats_average_over_micro_batches_and_layers():
    s = MoEStats()
    assert s.metrics() == {}
    s.add([layer([3, 1, 0, 4], 1.2, 2.0, 0.0, 1.0), layer([2, 2, 2, 2], 1.0, 4.0, 0.5, 1.2, routed=[3, 2, 2, 3])])
    s.add([layer([1, 3, 0, 4], 1.4, 6.0, 0.0, 1.4), layer([2, 2, 2, 2], 1.0, 8.0, 0.5, 1.4, routed=[5, 2, 2, 1])])
    m = s.metrics()
    assert m["moe_load_balance_loss"] == pytest.approx((1.2 + 1.0 + 1.4 + 1.0) / 4)
    assert m["moe_z_loss"] == pytest.approx(5.0)
    assert m["moe_dropped_fraction"] == pytest.approx(0.25)
    assert m["moe_router_entropy"] == pytest.approx(1.25)
    # layer 0: counts [4, 4, 0, 8] over 16 slots
    assert [m[f"expert_tokens/l0/e{j}"] for j in range(4)] == [4, 4, 0, 8]
    assert [m[f"expert_tokens/l1/e{j}"] for j in range(4)] == [4, 4, 4, 4]
    assert [m[f"expert_load/l0/e{j}"] for j in range(4)] == [0.25, 0.25, 0.0, 0.5]
    assert m["load_imbalance/l0"] == pytest.approx(0.5 / 0.25)
    assert m["load_imbalance/l1"] == pytest.approx(1.0)
    assert m["moe_load_imbalance_max"] == pytest.approx(2.0)
    # The aux-loss-free paper's max violation, on the routed slots (before capacity): layer 1 routed
    # [8, 4, 4, 4] although it kept an even [4, 4, 4, 4].
    assert m["max_violation/l0"] == pytest.approx(8 / 4 - 1)
    assert m["max_violation/l1"] == pytest.approx(8 / 5 - 1)
    assert m["moe_max_violation"] == pytest.approx(1.0)


def test_score_bias_metrics_are_each_layers_range():
    from models import ModelConfig, build_model
    from pipeline.training.metrics import score_bias_metrics

    cfg = dict(vocab_size=64, d_model=16, n_layers=3, n_heads=2, max_seq_len=16, num_experts=4, moe_top_k=2,
               moe_first_dense_layers=1)
    assert score_bias_metrics(build_model(ModelConfig(**cfg))) == {}  # softmax router: no bias
    model = build_model(ModelConfig(**cfg, moe_router="sigmoid"))
    model.layers[1].ffn.score_bias.copy_(torch.tensor([0.5, -0.25, 0.0, 0.125]))
    m = score_bias_metrics(model)
    assert m == {"score_bias_min/l0": -0.25, "score_bias_max/l0": 0.5, "score_bias_range/l0": 0.75,
                 "score_bias_min/l1": 0.0, "score_bias_max/l1": 0.0, "score_bias_range/l1": 0.0}


def test_dense_model_adds_nothing():
    s = MoEStats()
    s.add([])
    assert s.metrics() == {} and s.micro_batches == 0


def test_matmul_probe_measures_something_plausible():
    torch.set_num_threads(1)
    flops = measure_matmul_flops(128, seconds=0.05)
    assert 1e8 < flops < 1e13 and math.isfinite(flops)


def test_gpu_datasheet_lookup():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("Some Future GPU") is None

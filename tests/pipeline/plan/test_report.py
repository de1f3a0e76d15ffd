"""The plan's arithmetic over the layout: sequence parallelism, the advice, the terms adding up."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.plan.hardware import parse_cluster
from pipeline.plan.report import advise, plan

CLUSTER = parse_cluster("1x4xH100")


def test_sequence_parallelism_shards_activations_and_doubles_accumulation():
    base = ["parallel.num_workers=4", "train.global_batch_size=16", "train.micro_batch_size_per_rank=2",
            "train.zero_stage=2"]
    whole = plan(load_config("configs/gpu_125m.yaml", base), CLUSTER)
    split = plan(load_config("configs/gpu_125m.yaml", [*base, "parallel.sequence_parallel_size=2"]), CLUSTER)
    assert split.setup.tokens * 2 == whole.setup.tokens
    assert split.acts.layers * 2 == pytest.approx(whole.acts.layers, rel=1e-9)
    whole_grads, split_grads = (next(c for c in p.comm if c.name == "dense gradients") for p in (whole, split))
    assert split_grads.payload == 2 * whole_grads.payload  # twice the micro-steps, each reduced (ZeRO-2)
    ulysses = next(c for c in split.comm if c.kind == "all_to_all")
    cfg = split.setup.model
    width = 2 * cfg.n_heads * cfg.head_dim + 2 * max(cfg.resolved_num_kv_heads, 2) * cfg.head_dim
    accum = 16 // (2 * split.setup.micro_batch)
    assert ulysses.payload == 2 * cfg.n_layers * width * split.setup.tokens * 2 * accum
    assert split.time.compute_s == pytest.approx(whole.time.compute_s)  # the same tokens per device


def test_the_advice_fits_and_is_ordered_by_step_time():
    p = plan(load_config("configs/gpu_mla_moe.yaml", ["train.zero_stage=0"]), parse_cluster("1x8xL4"))
    assert not p.fits
    fixes = advise(p)
    assert fixes and all(q.fits for _, q in fixes)
    times = [q.time.step_s for _, q in fixes]
    assert times == sorted(times)
    assert p.peak == sum(p.terms().values()) and p.largest_term()[0] == "optimizer"


def test_an_experts_replicas_are_ep_size_apart_and_cross_nodes():
    p = plan(load_config("configs/gpu_moe.yaml", ["train.global_batch_size=128"]), parse_cluster("2x8xH100"))
    experts = next(c for c in p.comm if c.name == "experts gradients")
    dense = next(c for c in p.comm if c.name == "dense gradients")
    a2a = next(c for c in p.comm if c.kind == "all_to_all")
    assert (experts.group, experts.stride) == (2, 8) and not experts.within_node(8)  # ranks r and r + 8
    assert not dense.within_node(8) and a2a.within_node(8)  # ep groups: 8 consecutive ranks, one node

"""The published runs' shapes (benchmarks/plan_validation.py compares their GPU-hours): the configs are the
published models, and the planned compute is their FLOPs at the stated MFU."""

from __future__ import annotations

import pytest

from models.accounting import flops_per_token, param_counts
from pipeline.plan.hardware import GPUS, Cluster
from pipeline.plan.memory import Setup
from pipeline.plan.report import plan_setup
from pipeline.plan.validation import DEEPSEEK_V3, LLAMA3_8B


def test_the_shapes_are_the_published_models():
    llama, v3 = param_counts(LLAMA3_8B), param_counts(DEEPSEEK_V3)
    assert llama["total"] == 8_030_261_248  # Llama 3 8B's parameter count (its safetensors hold 8.03B)
    assert v3["total"] == pytest.approx(671e9, rel=0.001)  # "671B total parameters"
    assert v3["active"] == pytest.approx(37e9, rel=0.02)  # "37B activated for each token"


def test_planned_compute_is_the_flops_at_the_stated_mfu():
    setup = Setup(model=DEEPSEEK_V3, seq_len=4096, micro_batch=1, global_batch=16384, world=2048, ep_size=64,
                  zero_stage=1, precision="bf16", offload_optimizer=False, offload_params=False, checkpointing=False,
                  chunk_tokens=512, zero={"stage": 1})
    plan = plan_setup(setup, Cluster(256, 8, GPUS["H800"]), mfu=0.4, steps=1, tokens=int(14.8e12))
    flops = flops_per_token(DEEPSEEK_V3, 4096)["total"]
    assert plan.time.compute_s == pytest.approx(flops * 16384 * 4096 / 2048 / (989e12 * 0.4))
    assert plan.time.step_s == pytest.approx(plan.time.compute_s + plan.time.exposed_comm_s)
    assert not plan.fits  # 671B parameters without pipeline or tensor parallelism: the plan says so

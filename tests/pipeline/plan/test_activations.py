"""Activation and peak bytes of a micro-step against the live tensors of a real forward + backward on this
CPU (`pipeline.plan.measure`), within 15%: dense, MoE, MLA, Mamba, Mamba-2, hybrid and encoder-decoder at
two sizes, in fp32 and in bf16 (the weights and activations of DeepSpeed's bf16, which GPU plans assume), with
and without activation checkpointing.

MoE here is the single-process step: under expert parallelism a rank's experts receive the k routed
copies of every token of the ep group's micro-batches, as many as one process routes to all experts here
when routing is balanced, so what a rank keeps is the same count (the all-to-all's buffers are
counted by the communication test).
"""

from __future__ import annotations

import pytest
import torch

from pipeline.plan.activations import plan_activations
from pipeline.plan.measure import measure_step
from pipeline.plan.memory import Setup, model_shape
from pipeline.plan.validation import ACTIVATION_BATCH, ACTIVATION_CASES, ACTIVATION_CHUNK, ACTIVATION_SEQ

TOLERANCE = 0.15


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def planned(cfg, checkpointing: bool, chunk: int = ACTIVATION_CHUNK, precision: str = "fp32"):
    setup = Setup(model=cfg, seq_len=ACTIVATION_SEQ, micro_batch=ACTIVATION_BATCH, global_batch=ACTIVATION_BATCH,
                  world=1, ep_size=1, zero_stage=0, precision=precision, offload_optimizer=False,
                  offload_params=False, checkpointing=checkpointing, chunk_tokens=chunk, zero={})
    return plan_activations(setup, model_shape(cfg, 1), grads_as_they_come=True)


def check(name: str, checkpointing: bool, precision: str, chunk: int = ACTIVATION_CHUNK) -> None:
    cfg = ACTIVATION_CASES[name]
    got = measure_step(cfg, ACTIVATION_BATCH, ACTIVATION_SEQ, checkpointing=checkpointing, chunk_tokens=chunk,
                       dtype=DTYPES[precision])
    plan = planned(cfg, checkpointing, chunk, precision)
    assert plan.kept == pytest.approx(got.after_forward, rel=TOLERANCE), (name, plan.kept, got.after_forward)
    assert plan.peak == pytest.approx(got.peak, rel=TOLERANCE), (name, plan.peak, got.peak)


@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", [n for n in ACTIVATION_CASES if "d64" in n])
def test_small_models(name, checkpointing, precision):
    check(name, checkpointing, precision)


@pytest.mark.slow
@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", [n for n in ACTIVATION_CASES if "d128" in n])
def test_larger_models(name, checkpointing, precision):
    check(name, checkpointing, precision)


@pytest.mark.parametrize("precision", DTYPES)
def test_the_whole_logits_path(precision):
    """Loss chunk 0: the log-softmax of every token's logits is kept, and the planner counts it."""
    check("dense d64 L2", False, precision, chunk=0)


def test_checkpointing_keeps_a_layer_input_per_layer():
    """Exact arithmetic of the checkpointed count: each layer keeps its D-wide fp32 input."""
    cfg = ACTIVATION_CASES["dense d128 L4"]
    on, off = planned(cfg, True), planned(cfg, False)
    tokens = ACTIVATION_BATCH * ACTIVATION_SEQ
    assert on.output == off.output
    assert on.layers == tokens * (2 * cfg.head_dim + cfg.n_layers * cfg.d_model) * 4  # RoPE tables + inputs

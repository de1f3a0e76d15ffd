"""What the planner predicts of one training step, against the real step of a small model on this CPU.

- Model states: the bytes of the real parameters, their gradients after a backward and the AdamW state
  after ``optimizer.step()``, with the run's own optimizer (`pipeline.training.engine.make_optimizer`). A
  one-rank fp32 run is what the engine runs at stage 0, stepping that client AdamW
  (`pipeline.training.ds_config.engine_zero_stage`): the planner's fp32 stage-0 terms must equal them to
  the byte. AdamW also keeps a 0-d ``step`` counter per tensor, which the planner does not count (4 bytes
  a tensor): the test holds the state to the two moments plus those counters.
- FLOPs: torch's ``FlopCounterMode`` counts the matmuls of a real forward and backward (attention
  through SDPA's math backend, whose matmuls it sees; the experts through the per-expert loop, the same
  math as ``grouped_mm``, which it does not count). The planner's FLOPs per token (PaLM's 6N + the
  attention term) count every parameter, 1-D norm gains included, which do no matmul: the counted FLOPs
  must equal the planned ones less 6 (forward: 2) per 1-D parameter and token, exactly. The forward is
  counted on its own too, since activation checkpointing's recompute is planned from it.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models import build_model
from models.accounting import flops_per_token
from models.presets import PRESETS
from pipeline.config import OptimizerSection
from pipeline.plan.memory import Setup, model_shape, model_states
from pipeline.training.engine import make_optimizer

BATCH, SEQ = 2, 64

MODELS = {
    "dense gqa": PRESETS["cpu_small"].replace(num_kv_heads=2),
    "moe": PRESETS["cpu_moe"].replace(moe_expert_impl="loop"),
    "mla moe": PRESETS["cpu_mla_moe"].replace(moe_expert_impl="loop"),
}


def inputs(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", MODELS)
def test_fp32_model_states_are_the_bytes_of_a_real_step(name):
    cfg = MODELS[name]
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer, _ = make_optimizer(model, OptimizerSection(), steps=10, d_model=cfg.d_model)
    x, y = inputs(cfg)
    out = model(x, targets_BT=y, chunk_tokens=SEQ)
    (out.loss + out.aux_loss).backward()
    optimizer.step()

    params = list(model.parameters())
    state = [optimizer.state[p] for p in params]
    assert all(s.keys() == {"step", "exp_avg", "exp_avg_sq"} and s["step"].numel() == 1 for s in state)
    measured = {"weights": tensor_bytes(params),
                "gradients": tensor_bytes(p.grad for p in params),  # every parameter has one (no None)
                "optimizer": tensor_bytes(s[k] for s in state for k in ("exp_avg", "exp_avg_sq"))}
    setup = Setup(model=cfg, seq_len=SEQ, micro_batch=BATCH, global_batch=BATCH, world=1, ep_size=1, zero_stage=0,
                  precision="fp32", offload_optimizer=False, offload_params=False, checkpointing=False,
                  chunk_tokens=SEQ, zero={})
    assert model_states(setup, model_shape(cfg, 1)) == measured


@pytest.mark.parametrize("name", MODELS)
def test_training_flops_are_the_counted_matmuls_of_a_real_step(name):
    cfg = MODELS[name]
    torch.manual_seed(0)
    model = build_model(cfg)
    x, y = inputs(cfg)
    # chunk_tokens=0: the head's matmuls through autograd (the chunked loss's in-place addmm_ is not counted)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x, targets_BT=y, chunk_tokens=0)
        forward = counter.get_total_flops()
        (out.loss + out.aux_loss).backward()
        total = counter.get_total_flops()

    tokens = BATCH * SEQ
    no_matmul = sum(p.numel() for p in model.parameters() if p.ndim == 1)  # RMSNorm gains
    planned = flops_per_token(cfg, SEQ)
    assert forward == planned["forward"] * tokens - 2 * no_matmul * tokens
    assert total == planned["total"] * tokens - 6 * no_matmul * tokens

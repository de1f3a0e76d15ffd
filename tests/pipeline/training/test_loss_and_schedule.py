"""train.label_smoothing reaches the engine's loss; optimizer.schedule=noam is the paper's learning rate."""

from __future__ import annotations

import math

import pytest
import torch

from models import ModelConfig, build_model
from pipeline.config import ConfigError, OptimizerSection, load_config
from pipeline.training.engine import loss_definition, make_optimizer, train_step

TINY = ModelConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)


class _PlainEngine:
    """What ``train_step`` needs of a DeepSpeed engine, in one process: forward, backward, step, module."""

    def __init__(self, model: torch.nn.Module):
        self.model = self.module = model

    def __call__(self, inputs_BT, **loss_inputs):
        return self.model(inputs_BT, **loss_inputs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.model.zero_grad()


def smoothed_loss_by_hand(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, eps: float) -> float:
    """Mean over tokens of -sum_v q_v log p_v with q = (1 - eps) one-hot + eps / V, in float64."""
    V = logits_BTV.shape[-1]
    total, n = 0.0, 0
    for row, y in zip(logits_BTV.reshape(-1, V).double().tolist(), targets_BT.reshape(-1).tolist()):
        lse = math.log(sum(math.exp(v) for v in row))
        total += sum(-((1 - eps) * (v == y) + eps / V) * (row[v] - lse) for v in range(V))
        n += 1
    return total / n


@pytest.mark.parametrize("chunk", [0, 5])  # the whole logits; chunks of 5 tokens (5, 5, 2)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_engine_loss_is_the_smoothed_cross_entropy(eps, chunk):
    torch.manual_seed(0)
    model = build_model(TINY)
    x_BT = torch.randint(0, TINY.vocab_size, (2, 6))
    y_BT = torch.randint(0, TINY.vocab_size, (2, 6))
    with torch.no_grad():
        expected = smoothed_loss_by_hand(model(x_BT).logits, y_BT, eps)
    got = train_step(_PlainEngine(model), [(x_BT, y_BT)], torch.device("cpu"), label_smoothing=eps,
                     loss_chunk_tokens=chunk)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    if eps:  # really smoothed: differs from the plain cross-entropy
        assert abs(got.item() - smoothed_loss_by_hand(model(x_BT).logits.detach(), y_BT, 0.0)) > 1e-3


def test_loss_definition_names_the_smoothing():
    assert "smoothed" not in loss_definition(0.0)
    assert "label-smoothed" in loss_definition(0.1) and "eps=0.1" in loss_definition(0.1)


def test_label_smoothing_config_field_and_its_range():
    assert load_config(None, ["train.label_smoothing=0.1"]).train.label_smoothing == 0.1
    with pytest.raises(ConfigError, match=r"train\.label_smoothing=1\.0 must be in \[0, 1\)"):
        load_config(None, ["train.label_smoothing=1.0"])


@pytest.mark.parametrize("step, expected", [  # d_model 64, warmup 10: 64^-0.5 = 0.125, 10^-1.5 = 0.0316227766
    (1, 0.125 * 1 * 0.0316227766),
    (5, 0.125 * 5 * 0.0316227766),
    (10, 0.125 * 10 ** -0.5),  # the peak, 0.0395284708
    (40, 0.125 / 40 ** 0.5),  # half the peak
])
def test_noam_schedule_in_the_optimizer_is_the_paper_formula(step, expected):
    optim = OptimizerSection(warmup_steps=10, schedule="noam")
    assert optim.lr is None and optim.resolved_lr == 1.0  # the multiplier's default for noam
    model = build_model(TINY.replace(d_model=64, n_heads=4))
    optimizer, scheduler = make_optimizer(model, optim, 50, 64)
    for _ in range(step - 1):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-8)


def test_noam_lr_is_a_multiplier_and_other_schedules_keep_their_default():
    optim = OptimizerSection(warmup_steps=10, schedule="noam", lr=2.0)
    optimizer, _ = make_optimizer(build_model(TINY.replace(d_model=64, n_heads=4)), optim, 50, 64)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * 0.125 * 10 ** -1.5, rel=1e-8)
    assert OptimizerSection().resolved_lr == 3e-3
    assert OptimizerSection(schedule="inverse_sqrt").resolved_lr == 3e-3


def test_noam_needs_warmup():
    with pytest.raises(ConfigError, match=r"optimizer\.schedule=noam .* optimizer\.warmup_steps=0 must be >= 1"):
        load_config(None, ["optimizer.schedule=noam", "optimizer.warmup_steps=0"])

"""lm_loss against the smoothed cross-entropy written out; schedules against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from models.layers.loss import lm_loss
from models.schedules import inverse_sqrt, lr_multiplier, noam, warmup_cosine, warmup_stable_decay


def smoothed_ce_by_hand(logits_BTV, targets_BT, eps, ignore_index=-100):
    V = logits_BTV.shape[-1]
    total, count = 0.0, 0
    for b in range(targets_BT.shape[0]):
        for t in range(targets_BT.shape[1]):
            y = int(targets_BT[b, t])
            if y == ignore_index:
                continue
            row = logits_BTV[b, t].tolist()
            lse = math.log(sum(math.exp(v) for v in row))
            logp = [v - lse for v in row]
            target = [(1 - eps) * (v == y) + eps / V for v in range(V)]
            total += -sum(q * lp for q, lp in zip(target, logp))
            count += 1
    return total / count


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_lm_loss_matches_smoothed_cross_entropy(eps):
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    targets = torch.randint(0, 7, (2, 4))
    targets[0, 1] = -100
    targets[1, 3] = -100
    assert lm_loss(logits, targets, label_smoothing=eps).item() == pytest.approx(
        smoothed_ce_by_hand(logits, targets, eps), rel=1e-5
    )


def test_lm_loss_custom_ignore_index_and_bf16():
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 6)
    targets = torch.tensor([[1, 0, 2, 0, 5]])
    expected = smoothed_ce_by_hand(logits, targets, 0.0, ignore_index=0)
    assert lm_loss(logits, targets, ignore_index=0).item() == pytest.approx(expected, rel=1e-5)
    assert lm_loss(logits.bfloat16(), targets).dtype == torch.float32


def test_lm_loss_errors():
    with pytest.raises(ValueError, match="do not match"):
        lm_loss(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        lm_loss(torch.randn(1, 1, 5), torch.zeros(1, 1, dtype=torch.long), label_smoothing=1.0)


def test_inverse_sqrt_is_the_noam_formula():
    d, w = 512, 4000
    for step in (1, 10, 3999, 4000, 4001, 100000):
        expected = d ** -0.5 * min(step ** -0.5, step * w ** -1.5)
        assert inverse_sqrt(step, d, w) == pytest.approx(expected)
    # The peak is at step == warmup.
    assert inverse_sqrt(w, d, w) > inverse_sqrt(w - 1, d, w)
    assert inverse_sqrt(w, d, w) > inverse_sqrt(w + 1, d, w)
    with pytest.raises(ValueError, match="1-based"):
        inverse_sqrt(0, d, w)


@pytest.mark.parametrize("step, expected", [
    # d_model 512, warmup 4000 (the paper's base model), computed by hand:
    # 512^-0.5 = 0.04419417382, 4000^-1.5 = 3.952847075e-6, 4000^-0.5 = 0.01581138830.
    (1, 1.746928107e-07),  # 0.04419417382 * 1 * 3.952847075e-6
    (100, 1.746928107e-05),  # 0.04419417382 * 100 * 3.952847075e-6
    (4000, 6.987712430e-04),  # the peak: 0.04419417382 * 0.01581138830
    (16000, 3.493856215e-04),  # 0.04419417382 / sqrt(16000) = half the peak
])
def test_noam_is_the_paper_formula_at_hand_computed_steps(step, expected):
    assert noam(step, 512, 4000) == pytest.approx(expected, rel=1e-9)


def test_noam_rejects_bad_arguments():
    with pytest.raises(ValueError, match="1-based"):
        noam(0, 512, 4000)
    with pytest.raises(ValueError, match="warmup"):
        noam(1, 512, 0)


def test_warmup_cosine():
    w, total, r = 10, 110, 0.1
    assert warmup_cosine(1, w, total, r) == pytest.approx(0.1)
    assert warmup_cosine(5, w, total, r) == pytest.approx(0.5)
    assert warmup_cosine(10, w, total, r) == pytest.approx(1.0)
    for step in (11, 35, 60, 99, 110):
        progress = (step - w) / (total - w)
        expected = r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress))
        assert warmup_cosine(step, w, total, r) == pytest.approx(expected)
    assert warmup_cosine(60, w, total, r) == pytest.approx(0.55)  # half way: midpoint of 1 and 0.1
    assert warmup_cosine(500, w, total, r) == pytest.approx(r)
    assert warmup_cosine(1, 0, total, r) == pytest.approx(r + (1 - r) * 0.5 * (1 + math.cos(math.pi / total)))


def test_warmup_stable_decay():
    w, total = 10, 100  # decay_fraction 0.2 -> the last 20 steps, 81..100
    assert warmup_stable_decay(5, w, total) == pytest.approx(0.5)
    assert warmup_stable_decay(10, w, total) == pytest.approx(1.0)
    assert warmup_stable_decay(50, w, total) == 1.0
    assert warmup_stable_decay(80, w, total) == 1.0
    assert warmup_stable_decay(90, w, total) == pytest.approx(0.5)
    assert warmup_stable_decay(100, w, total) == pytest.approx(0.0)
    assert warmup_stable_decay(90, w, total, decay_fraction=0.2, min_ratio=0.2) == pytest.approx(0.6)
    assert warmup_stable_decay(100, w, total, min_ratio=0.2) == pytest.approx(0.2)


def test_schedule_values_stay_in_unit_interval():
    for step in range(1, 130):
        for kind, kw in (("cosine", dict(warmup=7, total=100)), ("wsd", dict(warmup=7, total=100)),
                         ("constant", dict(warmup=7))):
            assert 0.0 <= lr_multiplier(kind, step, **kw) <= 1.0


def test_lr_multiplier_dispatch():
    assert lr_multiplier("constant", 5) == 1.0
    assert lr_multiplier("constant", 2, warmup=4) == 0.5
    assert lr_multiplier("inverse_sqrt", 7, d_model=64, warmup=10) == inverse_sqrt(7, 64, 10)
    assert lr_multiplier("cosine", 30, warmup=5, total=50) == warmup_cosine(30, 5, 50)
    assert lr_multiplier("wsd", 45, warmup=5, total=50, decay_fraction=0.3) == warmup_stable_decay(45, 5, 50, 0.3)
    assert lr_multiplier("noam", 7, d_model=64, warmup=10) == noam(7, 64, 10)
    with pytest.raises(ValueError, match=r"\['constant', 'inverse_sqrt', 'noam', 'cosine', 'wsd'\]"):
        lr_multiplier("linear", 1)
    with pytest.raises(ValueError, match="warmup < total"):
        warmup_cosine(1, 10, 10)

"""Position encodings against their formulas, written out independently."""

from __future__ import annotations

import math

import pytest
import torch

from models.layers.positions import alibi_bias, alibi_slopes, apply_rope, rope_cos_sin, sinusoidal_table


def test_sinusoidal_matches_vaswani_formula():
    d, T = 10, 7
    pe = sinusoidal_table(torch.arange(T).unsqueeze(0), d)[0]
    for pos in range(T):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def rope_reference(x_TK: torch.Tensor, positions: list[float], base: float) -> torch.Tensor:
    """Rotate pairs (j, j + K/2) by angle pos * base^(-2j/K), one scalar at a time."""
    T, K = x_TK.shape
    out = torch.empty_like(x_TK)
    for t in range(T):
        for j in range(K // 2):
            theta = positions[t] * base ** (-2 * j / K)
            a, b = x_TK[t, j].item(), x_TK[t, j + K // 2].item()
            out[t, j] = a * math.cos(theta) - b * math.sin(theta)
            out[t, j + K // 2] = b * math.cos(theta) + a * math.sin(theta)
    return out


@pytest.mark.parametrize("base, scaling", [(10000.0, 1.0), (500.0, 1.0), (10000.0, 4.0)])
def test_rope_matches_pairwise_rotation(base, scaling):
    torch.manual_seed(0)
    T, K = 6, 8
    x = torch.randn(1, 1, T, K)
    pos = torch.tensor([[0, 1, 2, 5, 9, 30]])
    cos, sin = rope_cos_sin(pos, K, base, scaling)
    ours = apply_rope(x, cos, sin)[0, 0]
    ref = rope_reference(x[0, 0], [p / scaling for p in pos[0].tolist()], base)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    K = 16
    q, k = torch.randn(1, 1, 1, K), torch.randn(1, 1, 1, K)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), K, 10000.0, 1.0)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), K, 10000.0, 1.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)


def test_rope_scaling_is_position_interpolation():
    pos = torch.tensor([[0, 3, 8]])
    cos_s, sin_s = rope_cos_sin(pos, 8, 10000.0, 2.0)
    cos_h, sin_h = rope_cos_sin(torch.tensor([[0.0, 1.5, 4.0]]), 8, 10000.0, 1.0)
    torch.testing.assert_close(cos_s, cos_h)
    torch.testing.assert_close(sin_s, sin_h)


def test_alibi_slopes_power_of_two():
    # Press et al.: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    assert alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    assert alibi_slopes(4).tolist() == [2.0 ** -(2 * (i + 1)) for i in range(4)]


def test_alibi_slopes_non_power_of_two():
    # 6 heads: the 4-head slopes (2^-2, 2^-4, 2^-6, 2^-8), then every other 8-head slope
    # (2^-1, 2^-3, 2^-5, 2^-7) cut to the 2 missing heads: 2^-1, 2^-3.
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    # 12 heads: 8-head slopes then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd entries of the 16-head ones).
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))


def test_alibi_bias_is_minus_slope_times_distance():
    slopes = alibi_slopes(2)  # 1/16, 1/256
    pos = torch.arange(4).unsqueeze(0)
    bias = alibi_bias(slopes, pos, pos)
    for h in range(2):
        for i in range(4):
            for j in range(i + 1):
                assert bias[0, h, i, j].item() == pytest.approx(-slopes[h].item() * (i - j))

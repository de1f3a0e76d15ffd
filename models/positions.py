"""Position information: sinusoidal, learned absolute, RoPE and ALiBi.

Nothing here holds a buffer: every table is computed per call in fp32 from the config and the integer
positions. The cost is tiny (O(T * D)), and it means a model built on the meta device, materialised with
`to_empty` or cast to bf16 can never carry a stale or rounded position table.

Positions are explicit (B, T) integer tensors rather than `arange(T)`, so that left-padded rows and
KV-cache decoding see the same positions as an unpadded full forward.

Shape legend: B batch, T query time, S key time, D d_model, H heads, K head_dim.
"""

from __future__ import annotations

import math

import torch


def sinusoidal_table(positions_BT: torch.Tensor, d_model: int) -> torch.Tensor:
    """Vaswani et al. (2017) encodings: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).

    Args:
        positions_BT: integer positions.
        d_model: even model width.

    Returns:
        (B, T, D) fp32 table, sin on even and cos on odd features.
    """
    i_half = torch.arange(0, d_model, 2, device=positions_BT.device, dtype=torch.float32)
    inv_freq_half = torch.pow(10000.0, -i_half / d_model)  # (D/2,) = 1 / 10000^(2i/d)
    angles_BTh = positions_BT.float().unsqueeze(-1) * inv_freq_half
    pe_BTD = torch.empty(*positions_BT.shape, d_model, device=positions_BT.device, dtype=torch.float32)
    pe_BTD[..., 0::2] = torch.sin(angles_BTh)
    pe_BTD[..., 1::2] = torch.cos(angles_BTh)
    return pe_BTD


def rope_cos_sin(
    positions_BT: torch.Tensor, head_dim: int, base: float, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotary embeddings (Su et al. 2021) with linear position interpolation.

    Feature j of a head (j < K/2) is paired with feature j + K/2 (the "split halves" layout used by
    Hugging Face Llama's `rotate_half`), and the pair is rotated by angle (pos / scaling) * base^(-2j/K).
    Using HF's layout keeps our q/k projection weights identical to theirs, so export is a renaming.

    Args:
        positions_BT: integer positions.
        head_dim: K, even.
        base: the RoPE base (theta).
        scaling: positions are divided by this (1.0 = no interpolation).

    Returns:
        (cos, sin), each (B, 1, T, K) fp32, ready to broadcast over heads.
    """
    j = torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32)
    inv_freq = 1.0 / (base ** (j / head_dim))  # (K/2,)
    angles_BTh = (positions_BT.float() / scaling).unsqueeze(-1) * inv_freq
    angles_BTK = torch.cat([angles_BTh, angles_BTh], dim=-1)  # same angle for j and j + K/2
    return angles_BTK.cos().unsqueeze(1), angles_BTK.sin().unsqueeze(1)


def apply_rope(x_BHTK: torch.Tensor, cos_B1TK: torch.Tensor, sin_B1TK: torch.Tensor) -> torch.Tensor:
    """Rotate each (j, j + K/2) feature pair: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].

    Args:
        x_BHTK: queries or keys.
        cos_B1TK, sin_B1TK: from `rope_cos_sin`.

    Returns:
        The rotated tensor, same shape and dtype as `x_BHTK`.
    """
    half = x_BHTK.shape[-1] // 2
    x1, x2 = x_BHTK[..., :half], x_BHTK[..., half:]
    rotated_BHTK = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_B1TK.to(x_BHTK.dtype), sin_B1TK.to(x_BHTK.dtype)
    return x_BHTK * cos + rotated_BHTK * sin


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes (Press et al. 2022).

    For a power-of-two n the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8).
    Otherwise, with m the largest power of two below n, the slopes are the m slopes of an m-head model
    followed by the first n - m entries of every other slope (indices 0, 2, 4, ...) of a 2m-head model,
    as in the paper's reference implementation.

    Returns:
        (H,) fp32 slopes.
    """
    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    if n_heads & (n_heads - 1) == 0:
        slopes = power_of_two(n_heads)
    else:
        m = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(m) + power_of_two(2 * m)[0::2][: n_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes_H: torch.Tensor, q_pos_BT: torch.Tensor, k_pos_BS: torch.Tensor) -> torch.Tensor:
    """Additive ALiBi bias slope_h * (k_pos - q_pos): zero on the diagonal, negative for past keys.

    The paper writes the bias as -slope * (i - j); a per-row constant would not change the softmax, so
    this equals BLOOM's slope * j form as well.

    Returns:
        (B, H, T, S) fp32 bias.
    """
    dist_BTS = (k_pos_BS.unsqueeze(1) - q_pos_BT.unsqueeze(2)).float()
    return slopes_H.to(dist_BTS.device).view(1, -1, 1, 1) * dist_BTS.unsqueeze(1)

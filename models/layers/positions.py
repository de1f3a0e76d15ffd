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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE reaches past the context a model was trained at (``ModelConfig.rope``).

    ``factor`` s is the extension (1 = none); ``original_max_seq_len`` L the trained context. The
    methods, each computed as transformers' ``modeling_rope_utils`` computes it:

    - linear: positions are divided by s (position interpolation, Chen et al. 2023);
    - ntk: "NTK-aware" scaling, the base raised to base * s^(d/(d-2)) (d the rotated features), which
      stretches the low frequencies and keeps the high ones;
    - dynamic: NTK with the factor grown to the row's length n = max(its longest position + 1, L):
      base * (s n / L - (s - 1))^(d/(d-2)), so nothing changes up to L (transformers' "dynamic",
      per forward call: a cached decoder's earlier keys keep the frequencies they were made with). Each
      row of a batch has its own n, so a row's numbers never depend on the rows beside it (a served
      batch's rows get what they get alone; in training every row has the same positions);
    - yarn: per frequency band, interpolate (divide by s) the bands that turn fewer than ``beta_slow``
      times over L, keep those that turn more than ``beta_fast`` times, ramp linearly between, and
      scale cos and sin by the attention temperature 0.1 ln(s) + 1 (Peng et al. 2023); with
      DeepSeek's ``mscale`` and ``mscale_all_dim`` that factor is mscale(s, mscale) / mscale(s,
      mscale_all_dim), and MLA's softmax scale is multiplied by mscale(s, mscale_all_dim)^2;
    - llama3: wavelengths above L / ``low_freq_factor`` are divided by s, below L / ``high_freq_factor``
      kept, and smoothly blended between (Llama 3.1).
    """

    kind: str = "linear"  # one of models.config.ROPE_SCALING_TYPES
    factor: float = 1.0
    original_max_seq_len: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for an extension by ``factor``: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(rs: RopeScaling) -> float:
    """What DeepSeek's YaRN multiplies the softmax scale by: mscale(s, mscale_all_dim)^2 (1 otherwise)."""
    if rs.kind != "yarn" or not rs.mscale_all_dim:
        return 1.0
    return yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2


def _default_inv_freq(head_dim: int, base: float, device) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim))


def rope_inv_freq(head_dim: int, base: float, rs: RopeScaling, seq_len: int | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """The (K/2,) inverse frequencies of ``rs``'s method and the factor cos and sin are scaled by.

    Args:
        head_dim: K, the rotated features.
        base: the RoPE base (theta).
        rs: the scaling (its ``linear`` is applied to positions by ``rope_cos_sin``, not here).
        seq_len: the call's length (``dynamic`` only).
    """
    s, d = rs.factor, head_dim
    if rs.kind == "ntk":
        return _default_inv_freq(d, base * s ** (d / (d - 2)), device), 1.0
    if rs.kind == "dynamic":
        L = rs.original_max_seq_len
        n = max(seq_len or L, L)
        return _default_inv_freq(d, base * ((s * n / L) - (s - 1)) ** (d / (d - 2)), device), 1.0
    if rs.kind == "yarn":
        L = rs.original_max_seq_len
        factor = (yarn_mscale(s, rs.mscale) / yarn_mscale(s, rs.mscale_all_dim)
                  if rs.mscale and rs.mscale_all_dim else yarn_mscale(s))

        def correction_dim(rotations: float) -> float:  # the feature that turns `rotations` times over L
            return (d * math.log(L / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(rs.beta_fast)), 0)
        high = min(math.ceil(correction_dim(rs.beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
        pos_freqs = base ** (torch.arange(0, d, 2).to(device=device, dtype=torch.float) / d)
        keep = 1 - ramp  # 1: extrapolate (the band as trained), 0: interpolate (divided by s)
        return (1.0 / (s * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, factor
    inv_freq = _default_inv_freq(d, base, device)
    if rs.kind == "llama3" and s != 1.0:
        L = rs.original_max_seq_len
        low_wavelen, high_wavelen = L / rs.low_freq_factor, L / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s, inv_freq)
        smooth = (L / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return inv_freq, 1.0


def rope_cos_sin(
    positions_BT: torch.Tensor, head_dim: int, base: float, scaling: float | RopeScaling
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotary embeddings (Su et al. 2021), with a context-extension method.

    Feature j of a head (j < K/2) is paired with feature j + K/2 (the "split halves" layout used by
    Hugging Face Llama's `rotate_half`), and the pair is rotated by angle pos * inv_freq_j, inv_freq_j =
    base^(-2j/K) unscaled (see `RopeScaling` for the methods; linear divides the position by the factor).
    Using HF's layout keeps our q/k projection weights identical to theirs, so export is a renaming.

    Args:
        positions_BT: integer positions.
        head_dim: K, even.
        base: the RoPE base (theta).
        scaling: a `RopeScaling`, or a float: linear position interpolation by it (1.0 = none).

    Returns:
        (cos, sin), each (B, 1, T, K) fp32, ready to broadcast over heads.
    """
    rs = scaling if isinstance(scaling, RopeScaling) else RopeScaling("linear", float(scaling))
    if rs.kind == "linear" or rs.factor == 1.0 and rs.kind != "yarn":
        j = torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32)
        inv_freq = 1.0 / (base ** (j / head_dim))  # (K/2,)
        angles_BTh = (positions_BT.float() / (rs.factor if rs.kind == "linear" else 1.0)).unsqueeze(-1) * inv_freq
        attention_factor = 1.0
    elif rs.kind == "dynamic" and positions_BT.numel():
        # Per row: its frequencies from its own longest position (one computation per distinct length).
        lengths = [int(n) + 1 for n in positions_BT.amax(dim=1).tolist()]
        by_length = {n: rope_inv_freq(head_dim, base, rs, n, positions_BT.device)[0] for n in set(lengths)}
        inv_freq_B1h = torch.stack([by_length[n] for n in lengths]).unsqueeze(1)
        angles_BTh = positions_BT.float().unsqueeze(-1) * inv_freq_B1h
        attention_factor = 1.0
    else:
        inv_freq, attention_factor = rope_inv_freq(head_dim, base, rs, None, positions_BT.device)
        angles_BTh = positions_BT.float().unsqueeze(-1) * inv_freq
    angles_BTK = torch.cat([angles_BTh, angles_BTh], dim=-1)  # same angle for j and j + K/2
    cos, sin = angles_BTK.cos().unsqueeze(1), angles_BTK.sin().unsqueeze(1)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


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

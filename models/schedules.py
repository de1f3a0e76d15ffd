"""Learning-rate schedules as pure functions of the step.

Every function takes `step`, the 1-based index of the optimizer update being made (the first update is
step 1). With `torch.optim.lr_scheduler.LambdaLR`, whose counter starts at 0, pass
`lambda s: lr_multiplier(kind, s + 1, ...)`.

`warmup_cosine`, `warmup_stable_decay` and `constant` return a multiplier of the peak learning rate in
[0, 1]. `noam` returns the learning rate of "Attention Is All You Need" (Vaswani et al. 2017, section
5.3) itself, lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): the optimizer's base lr multiplies
it, so with a base lr of 1.0 it is the paper's schedule exactly. `inverse_sqrt` is the same curve kept
under its older name; the training config scales it by optimizer.lr whatever that is (3e-3 by default), so
it is the paper's schedule only at lr 1.0.
"""

from __future__ import annotations

import math


def _check_step(step: int) -> None:
    if step < 1:
        raise ValueError(f"step is 1-based and must be >= 1, got {step}")


def _warmup(step: int, warmup: int) -> float:
    # Linear ramp reaching 1.0 exactly at step == warmup.
    return min(1.0, step / warmup) if warmup > 0 else 1.0


def constant(step: int, warmup: int = 0) -> float:
    """1.0 after an optional linear warmup of `warmup` steps.

    Raises:
        ValueError: if step < 1 or warmup < 0.
    """
    _check_step(step)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    return _warmup(step, warmup)


def noam(step: int, d_model: int, warmup: int) -> float:
    """The learning rate of Vaswani et al. (2017), eq. 3: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

    It rises linearly for `warmup` steps, peaks at step == warmup with d_model^-0.5 * warmup^-0.5, then
    falls as step^-0.5. The value is an absolute learning rate (about 7e-4 at the peak for the paper's
    d_model 512 and warmup 4000), not a fraction of a peak.

    Args:
        step: 1-based update index.
        d_model: model width.
        warmup: warmup steps (>= 1).

    Returns:
        The learning rate at `step`.

    Raises:
        ValueError: if step < 1, d_model < 1 or warmup < 1.
    """
    _check_step(step)
    if d_model < 1 or warmup < 1:
        raise ValueError(f"d_model and warmup must be >= 1, got d_model={d_model}, warmup={warmup}")
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def inverse_sqrt(step: int, d_model: int, warmup: int) -> float:
    """The `noam` curve under its older name: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

    Kept for configs that use it; the training engine multiplies it by optimizer.lr like every schedule,
    and optimizer.lr's default for it is 3e-3, so use `noam` for the paper's schedule.

    Args:
        step: 1-based update index.
        d_model: model width.
        warmup: steps of linear increase; the peak is at step == warmup.

    Returns:
        The schedule value (not normalised to a peak of 1).

    Raises:
        ValueError: if step < 1, d_model < 1 or warmup < 1.
    """
    return noam(step, d_model, warmup)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to 1.0 at `warmup`, then cosine decay to `min_ratio` at `total`, then flat.

    After warmup: min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup))).

    Raises:
        ValueError: if step < 1, warmup < 0, total <= warmup or min_ratio outside [0, 1].
    """
    _check_step(step)
    _check_window(warmup, total, min_ratio)
    if step <= warmup:
        return _warmup(step, warmup)
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(
    step: int, warmup: int, total: int, decay_fraction: float = 0.2, min_ratio: float = 0.0
) -> float:
    """Warmup-stable-decay (MiniCPM, Hu et al. 2024): linear warmup, flat 1.0, then linear decay.

    The decay takes the last round(decay_fraction * total) steps, falling linearly from 1.0 to
    `min_ratio` at `total`: value = min_ratio + (1 - min_ratio) * (total - step) / decay_steps.

    Raises:
        ValueError: if step < 1, the window is inconsistent or decay_fraction is outside (0, 1].
    """
    _check_step(step)
    _check_window(warmup, total, min_ratio)
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}")
    decay_steps = max(1, round(decay_fraction * total))
    decay_start = total - decay_steps
    if decay_start < warmup:
        raise ValueError(f"decay ({decay_steps} steps) overlaps warmup ({warmup}) within total {total}")
    if step <= warmup:
        return _warmup(step, warmup)
    if step <= decay_start:
        return 1.0
    remaining = max(0, total - step) / decay_steps
    return min_ratio + (1.0 - min_ratio) * remaining


def _check_window(warmup: int, total: int, min_ratio: float) -> None:
    if warmup < 0 or total <= warmup:
        raise ValueError(f"need 0 <= warmup < total, got warmup={warmup}, total={total}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")


SCHEDULES = {
    "constant": constant,
    "inverse_sqrt": inverse_sqrt,
    "noam": noam,
    "cosine": warmup_cosine,
    "wsd": warmup_stable_decay,
}


def lr_multiplier(kind: str, step: int, **kw) -> float:
    """Dispatch to a schedule by name.

    Args:
        kind: one of "constant", "inverse_sqrt", "noam", "cosine", "wsd".
        step: 1-based update index.
        **kw: the schedule's own arguments (see each function).

    Returns:
        The schedule value at `step`.

    Raises:
        ValueError: on an unknown kind.
        TypeError: on arguments the schedule does not take.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule kind must be one of {list(SCHEDULES)}, got {kind!r}")
    return SCHEDULES[kind](step, **kw)

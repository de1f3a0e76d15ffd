"""How a sweep ranks its trials: the one order that every comparison of trials uses (a rung of synchronous
halving, ASHA's cutoffs, the best trial of the summary).

A trial whose metric is not finite (NaN, +inf or -inf: its training diverged) ranks below every trial with
a finite value, whatever the mode (for a metric where lower is better, -inf is no better than NaN), and is
never the best. Why a rule of its own: Python leaves a NaN where it stands in a sort (every comparison with
it is false) and ``min`` returns one that comes first, so a diverged trial could be promoted, or registered
as the best; ASHA never stops a trial whose reward is NaN (``reward < cutoff`` is false) and lets an
infinite one set a cutoff that no finite trial meets.

Imports nothing of Conduit, nor Ray: the scheduler and the sweep's driver both read it.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")
WORST = sys.float_info.max  # the worst finite value, as ASHA is handed a diverged trial's (``as_scheduled``)


def finite(value: float | None) -> bool:
    """Whether ``value`` can be ranked: a number that is not NaN nor infinite."""
    return value is not None and math.isfinite(value)


def rank_key(value: float | None, mode: str) -> tuple[int, float]:
    """Sort key of a trial's metric, best first for ``mode`` (min or max); not finite (or None) last."""
    if not finite(value):
        return (1, 0.0)
    return (0, value if mode == "min" else -value)


def ranked(trials: Iterable[T], mode: str, value: Callable[[T], float | None], index: Callable[[T], int]) -> list[T]:
    """``trials`` best first by ``value`` (``rank_key``); equal values, and the values not finite, in the order
    of their ``index``."""
    return sorted(trials, key=lambda t: (rank_key(value(t), mode), index(t)))


def best(trials: Iterable[T], mode: str, value: Callable[[T], float | None], index: Callable[[T], int]) -> T | None:
    """The best of ``trials`` (``ranked``), or None when none has a finite value."""
    first = ranked(trials, mode, value, index)[:1]
    return first[0] if first and finite(value(first[0])) else None


def as_scheduled(value: float, mode: str) -> float:
    """``value`` as a scheduler that compares raw values (ASHA) must see it to rank it as ``rank_key`` does:
    itself when finite, else the worst finite value for ``mode``."""
    if finite(value):
        return value
    return WORST if mode == "min" else -WORST

"""Promotion gates: may a registered version take the ``champion`` alias from the current one?

Pure logic on metric dicts (read from the versions' ``metric.<name>`` tags, which the register stage
writes at full precision); ``jobs/promote.py`` does the registry reads and writes through
``pipeline.tracking``. Gates come from the config's ``promote`` section:

- ``promote.metric`` (lower is better, held-out bits per byte by default) must be at least
  ``promote.min_improvement`` below the champion's;
- every metric in ``promote.not_lower`` (LAMBADA accuracy by default) must not be below the champion's.

With no champion yet every gate passes. A metric missing on either side fails its gate, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import PromoteSection

METRIC_TAG_PREFIX = "metric."
# Shown beside the gates in the comparison table when both versions have them.
HEADLINE_METRICS = ("val_bits_per_byte", "heldout_bits_per_byte", "wikitext2_bits_per_byte",
                    "lambada_accuracy", "lambada_perplexity", "word_order_gap")


@dataclass(frozen=True)
class GateResult:
    """One gate's outcome: the rule, both values, and whether the candidate passed."""

    rule: str
    metric: str
    candidate: float | None
    champion: float | None
    passed: bool
    detail: str


def metrics_from_tags(tags: dict[str, str]) -> dict[str, float]:
    """``{"metric.val_loss": "2.5"}`` -> ``{"val_loss": 2.5}``.

    Raises:
        ValueError: naming a metric tag whose value is not a number.
    """
    out = {}
    for key, value in tags.items():
        if key.startswith(METRIC_TAG_PREFIX):
            try:
                out[key[len(METRIC_TAG_PREFIX):]] = float(value)
            except ValueError as e:
                raise ValueError(f"version tag {key}={value!r} is not a number") from e
    return out


def _gate(rule: str, metric: str, candidate: dict, champion: dict, ok) -> GateResult:
    c, ch = candidate.get(metric), champion.get(metric)
    if c is None:
        return GateResult(rule, metric, None, ch, False, f"the candidate has no metric {metric!r}")
    if ch is None:
        return GateResult(rule, metric, c, None, False, f"the champion has no metric {metric!r}")
    passed, detail = ok(c, ch)
    return GateResult(rule, metric, c, ch, passed, detail)


def check_gates(section: PromoteSection, candidate: dict[str, float],
                champion: dict[str, float] | None) -> list[GateResult]:
    """Apply the configured gates.

    Args:
        section: the ``promote`` config section.
        candidate: the version to promote, metric name -> value.
        champion: the current holder of the target alias, or None when there is none.

    Returns:
        One result per gate, in config order (the bits-per-byte gate first).

    Raises:
        ValueError: on a negative ``promote.min_improvement``.
    """
    if section.min_improvement < 0:
        raise ValueError(f"promote.min_improvement={section.min_improvement} must be >= 0")
    margin = section.min_improvement
    rules = [(f"{section.metric} <= champion - {margin:g}", section.metric,
              lambda c, ch: (c <= ch - margin, f"needs <= {ch - margin:.6g}"))]
    rules += [(f"{m} >= champion", m, lambda c, ch: (c >= ch, f"needs >= {ch:.6g}")) for m in section.not_lower]
    if champion is None:
        return [GateResult(rule, m, candidate.get(m), None, True, "no champion yet") for rule, m, _ in rules]
    return [_gate(rule, m, candidate, champion, ok) for rule, m, ok in rules]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def comparison_table(candidate_version: int, champion_version: int | None, results: list[GateResult],
                     candidate: dict[str, float], champion: dict[str, float] | None) -> str:
    """Gates and headline metrics side by side, as aligned text."""
    champ = "none" if champion_version is None else f"v{champion_version}"
    lines = [f"{'gate / metric':<44} {'candidate v' + str(candidate_version):>14} {'champion ' + champ:>14}  result"]
    for r in results:
        lines.append(f"{r.rule:<44} {_fmt(r.candidate):>14} {_fmt(r.champion):>14}  "
                     f"{'pass' if r.passed else 'FAIL'} ({r.detail})")
    gated = {r.metric for r in results}
    for m in HEADLINE_METRICS:
        if m not in gated and m in candidate:
            lines.append(f"{m:<44} {_fmt(candidate[m]):>14} {_fmt((champion or {}).get(m)):>14}  info")
    return "\n".join(lines)


def promotion_tags(alias: str, *, who: str, when: str, previous: int | None, forced: bool,
                   reason: str | None, results: list[GateResult]) -> dict[str, str]:
    """Tags recorded on the promoted version under ``promotion.<alias>.*``."""
    prefix = f"promotion.{alias}."
    tags = {
        prefix + "by": who,
        prefix + "at": when,
        prefix + "previous_version": "none" if previous is None else str(previous),
        prefix + "forced": str(forced).lower(),
        prefix + "gates": "; ".join(f"{r.rule}: {'pass' if r.passed else 'FAIL'}" for r in results),
    }
    if reason:
        tags[prefix + "reason"] = reason
    return tags


def replaced_tags(alias: str, *, by_version: int, when: str) -> dict[str, str]:
    """Tags recorded on the version that loses ``alias``."""
    return {f"promotion.{alias}.replaced_by": str(by_version), f"promotion.{alias}.replaced_at": when}


def rollback_tags(alias: str, *, who: str, when: str, from_version: int, reason: str | None) -> dict[str, str]:
    """Tags recorded on the version that gets ``alias`` back by a rollback. Its own
    ``previous_version`` stays, so a second rollback walks one promotion further back."""
    prefix = f"promotion.{alias}."
    tags = {prefix + "rollback_from": str(from_version), prefix + "rollback_by": who, prefix + "rollback_at": when}
    if reason:
        tags[prefix + "rollback_reason"] = reason
    return tags

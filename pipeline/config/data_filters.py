"""The shard stage's quality filters and near-duplicate removal as config sections (``data.quality``,
``data.near_dedup``) with their field checks. The rules themselves are ``pipeline.data.quality`` and
``pipeline.data.near_dedup``, which take these sections as they are (the data floor reads no config code).
Every default is the published one (Gopher, C4, FineWeb); every filter is off until enabled."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

ORDER = ("language", "gopher_repetition", "gopher_quality", "c4_lines")  # the order the filters apply in


@dataclass
class LanguageFilter:
    enabled: bool = False
    languages: list[str] = field(default_factory=lambda: ["en"])  # codes py3langid knows (ISO 639-1 mostly)
    min_score: float = 0.65  # the normalised probability of the best language (FineWeb's bar)


@dataclass
class GopherRepetitionFilter:
    enabled: bool = False
    dup_line_frac: float = 0.30  # duplicated lines / lines
    dup_para_frac: float = 0.30  # duplicated paragraphs / paragraphs
    dup_line_char_frac: float = 0.20  # characters in duplicated lines / characters
    dup_para_char_frac: float = 0.20
    # characters of the most frequent 2-, 3-, 4-gram (times its count) / characters
    top_ngram_char_frac: list[float] = field(default_factory=lambda: [0.20, 0.18, 0.16])
    # characters in duplicated 5- ... 10-grams / characters
    dup_ngram_char_frac: list[float] = field(default_factory=lambda: [0.15, 0.14, 0.13, 0.12, 0.11, 0.10])


@dataclass
class GopherQualityFilter:
    enabled: bool = False
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # '#', '...' and '…' per word
    max_bullet_lines_frac: float = 0.9
    max_ellipsis_lines_frac: float = 0.3
    min_alpha_words_frac: float = 0.8  # words holding a letter / words
    min_stop_words: int = 2


@dataclass
class C4LinesFilter:
    enabled: bool = False
    min_words_per_line: int = 5
    min_sentences: int = 3
    max_word_length: int = 1000  # a line with a longer "word" is dropped
    drop_javascript_lines: bool = True
    drop_policy_lines: bool = True  # terms of use, privacy and cookie notices
    remove_citations: bool = True  # [1], [edit], [citation needed]
    drop_lorem_ipsum: bool = True
    drop_curly_bracket: bool = True


@dataclass
class QualitySection:
    language: LanguageFilter = field(default_factory=LanguageFilter)
    gopher_repetition: GopherRepetitionFilter = field(default_factory=GopherRepetitionFilter)
    gopher_quality: GopherQualityFilter = field(default_factory=GopherQualityFilter)
    c4_lines: C4LinesFilter = field(default_factory=C4LinesFilter)

    def enabled(self) -> list[str]:
        """The enabled filters' names, in ``ORDER``."""
        return [name for name in ORDER if getattr(self, name).enabled]


@dataclass
class NearDedupSection:
    enabled: bool = False
    ngram: int = 5  # words per shingle
    bands: int = 14
    rows: int = 8  # bands * rows permutations (FineWeb: 14 x 8)
    threshold: float = 0.8  # a candidate pair is joined when its exact Jaccard similarity is at least this
    seed: int = 1
    sample_pairs: int = 20  # removed documents written beside the one kept for them (near_duplicates.jsonl)


@lru_cache(maxsize=1)
def language_codes() -> frozenset[str]:
    """The languages py3langid's model (shipped inside the package) knows."""
    from pathlib import Path

    from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

    return frozenset(LanguageIdentifier.from_modelpath(Path(MODEL_DIR) / MODEL_FILE).nb_classes)


def check_quality(q: QualitySection) -> str | None:
    """The first bad threshold, named by its field, or None."""
    fracs = {
        "gopher_repetition": ("dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac"),
        "gopher_quality": ("max_symbol_word_ratio", "max_bullet_lines_frac", "max_ellipsis_lines_frac",
                           "min_alpha_words_frac"),
        "language": ("min_score",),
    }
    for name, keys in fracs.items():
        for k in keys:
            v = getattr(getattr(q, name), k)
            if not 0.0 <= v <= 1.0:
                return f"data.quality.{name}.{k}={v} must be in [0, 1]"
    rep = q.gopher_repetition
    for k, n in (("top_ngram_char_frac", 3), ("dup_ngram_char_frac", 6)):
        v = getattr(rep, k)
        if len(v) != n or not all(0.0 <= x <= 1.0 for x in v):
            return f"data.quality.gopher_repetition.{k}={v} must be {n} fractions in [0, 1]"
    g = q.gopher_quality
    if not 0 <= g.min_words <= g.max_words:
        return f"data.quality.gopher_quality: min_words={g.min_words} must be >= 0 and <= max_words={g.max_words}"
    if not 0 < g.min_mean_word_length <= g.max_mean_word_length:
        return (f"data.quality.gopher_quality: min_mean_word_length={g.min_mean_word_length} must be > 0 and "
                f"<= max_mean_word_length={g.max_mean_word_length}")
    if g.min_stop_words < 0:
        return f"data.quality.gopher_quality.min_stop_words={g.min_stop_words} must be >= 0"
    c = q.c4_lines
    for k in ("min_words_per_line", "min_sentences", "max_word_length"):
        if getattr(c, k) < 0:
            return f"data.quality.c4_lines.{k}={getattr(c, k)} must be >= 0"
    if q.language.enabled or q.language.languages != ["en"]:
        if not q.language.languages:
            return "data.quality.language.languages must name at least one language"
        known = language_codes()
        for code in q.language.languages:
            if code not in known:
                return (f"data.quality.language.languages: {code!r} is not a language the model knows "
                        f"(py3langid's codes: {', '.join(sorted(known))})")
    return None


def check_near_dedup(nd: NearDedupSection) -> str | None:
    """The first bad setting, named by its field, or None."""
    for k in ("ngram", "bands", "rows"):
        if getattr(nd, k) < 1:
            return f"data.near_dedup.{k}={getattr(nd, k)} must be >= 1"
    if nd.bands * nd.rows > 1024:
        return f"data.near_dedup: bands * rows = {nd.bands * nd.rows} permutations; at most 1024"
    if not 0.0 <= nd.threshold <= 1.0:
        return f"data.near_dedup.threshold={nd.threshold} must be in [0, 1]"
    if nd.seed < 0 or nd.sample_pairs < 0:
        return "data.near_dedup.seed and data.near_dedup.sample_pairs must be >= 0"
    return None

"""Quality filters of the shard stage: each looks at one document alone, so each runs in the input's
read task, after cleaning. Each is named, has its thresholds in ``data.quality.<name>``, and counts the
documents it removed (a document is counted under the first filter that removed it, in the order below),
with the rule that fired inside the filter in ``counts.quality``.

- ``language`` keeps documents whose language, by py3langid (langid.py's naive Bayes model over byte
  n-grams, 142 languages, shipped inside the package: nothing is downloaded), is one of ``languages``
  with a normalised probability of at least ``min_score`` (FineWeb keeps English at 0.65).
- ``gopher_repetition``: Gopher's repetition rules (Rae et al. 2021, appendix A, table A1): the share of
  duplicated lines and paragraphs (by count and by characters), the characters of the most frequent
  2-, 3- and 4-gram of words, and the characters in duplicated 5- to 10-grams, each against its limit.
- ``gopher_quality``: Gopher's quality rules: 50 to 100,000 words, a mean word length of 3 to 10
  characters, at most 0.1 symbols (``#``, ``...``, ``…``) per word, at most 90% of lines starting with a
  bullet, at most 30% ending in an ellipsis, at least 80% of words with a letter, and at least two of
  the stop words "the, be, to, of, and, that, have, with".
- ``c4_lines``: C4's page cleaning (Raffel et al. 2020, section 2.2): keep only lines that end in
  terminal punctuation and have at least 5 words; drop lines naming Javascript or a cookie / privacy /
  terms-of-use notice and citation markers; remove the page when "lorem ipsum" or a curly bracket is
  in it, or when fewer than 3 sentences are left. It changes the text it keeps (so the document's id).

The rules are written here rather than taken from datatrove: its filters are pipeline steps over its
own ``Document`` type, and its word tokenizers load NLTK or spaCy models that are downloaded on first
use, which a run here cannot do. The published thresholds are the defaults.
"""

from __future__ import annotations

import re
import string
from collections import Counter

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})  # Gopher's
_PUNCT = frozenset(string.punctuation + "“”‘’«»…–—")
_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
_TERMINAL = ('.', '!', '?', '"', '”', "'", '’')
_CITATION = re.compile(r"\s*(?:\[\d*\]|\[edit\]|\[citation needed\])", re.IGNORECASE)
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)]*(?=\s|$)")

_IDENTIFIER = None


def _identifier():
    global _IDENTIFIER
    if _IDENTIFIER is None:
        from pathlib import Path

        from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

        _IDENTIFIER = LanguageIdentifier.from_modelpath(Path(MODEL_DIR) / MODEL_FILE, norm_probs=True)
    return _IDENTIFIER


def language_of(text: str) -> tuple[str, float]:
    """(language code, normalised probability) of ``text`` by py3langid."""
    code, score = _identifier().classify(text)
    return code, float(score)


def words_of(text: str) -> list[str]:
    """Gopher's words: whitespace-separated tokens that are not punctuation alone."""
    return [w for w in text.split() if not all(ch in _PUNCT for ch in w)]


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(how many items repeat an earlier one, their characters)."""
    seen: set[str] = set()
    n = chars = 0
    for x in items:
        if x in seen:
            n += 1
            chars += len(x)
        else:
            seen.add(x)
    return n, chars


def _ngrams(words: list[str], n: int) -> list[str]:
    return [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]


def top_ngram_chars(words: list[str], n: int) -> int:
    """Characters covered by the most frequent n-gram: its length times its count (0 without repeats)."""
    grams = _ngrams(words, n)
    if not grams:
        return 0
    gram, count = Counter(grams).most_common(1)[0]
    return len(gram) * count if count > 1 else 0


def duplicated_ngram_chars(words: list[str], n: int) -> int:
    """Characters of the words inside n-grams that occurred earlier, each word counted once (a repeat
    skips its n words before looking again, so overlapping repeats are not counted twice)."""
    seen: set[tuple[str, ...]] = set()
    chars, i = 0, 0
    while i <= len(words) - n:
        gram = tuple(words[i:i + n])
        if gram in seen:
            chars += sum(len(w) for w in gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def gopher_repetition(text: str, f) -> str | None:
    """The first repetition rule ``text`` breaks, or None."""
    total = max(len(text), 1)
    paragraphs = [p for p in _PARAGRAPHS.split(text.strip()) if p]
    n, chars = _duplicates(paragraphs)
    if paragraphs and n / len(paragraphs) > f.dup_para_frac:
        return "dup_para_frac"
    if chars / total > f.dup_para_char_frac:
        return "dup_para_char_frac"
    lines = [ln for ln in _LINES.split(text.strip()) if ln]
    n, chars = _duplicates(lines)
    if lines and n / len(lines) > f.dup_line_frac:
        return "dup_line_frac"
    if chars / total > f.dup_line_char_frac:
        return "dup_line_char_frac"
    words = text.split()
    for n, limit in zip((2, 3, 4), f.top_ngram_char_frac):
        if top_ngram_chars(words, n) / total > limit:
            return f"top_{n}gram_char_frac"
    for n, limit in zip(range(5, 11), f.dup_ngram_char_frac):
        if duplicated_ngram_chars(words, n) / total > limit:
            return f"dup_{n}gram_char_frac"
    return None


def gopher_quality(text: str, f) -> str | None:
    """The first quality rule ``text`` breaks, or None."""
    words = words_of(text)
    if len(words) < f.min_words:
        return "min_words"
    if len(words) > f.max_words:
        return "max_words"
    mean = sum(len(w) for w in words) / max(len(words), 1)
    if mean < f.min_mean_word_length:
        return "min_mean_word_length"
    if mean > f.max_mean_word_length:
        return "max_mean_word_length"
    symbols = text.count("#") + text.count("...") + text.count("…")
    if symbols / max(len(words), 1) > f.max_symbol_word_ratio:
        return "max_symbol_word_ratio"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines:
        bullets = sum(ln.lstrip().startswith(("•", "-", "*", "‣", "◦")) for ln in lines)
        if bullets / len(lines) > f.max_bullet_lines_frac:
            return "max_bullet_lines_frac"
        ellipses = sum(ln.rstrip().endswith(("...", "…")) for ln in lines)
        if ellipses / len(lines) > f.max_ellipsis_lines_frac:
            return "max_ellipsis_lines_frac"
    alpha = sum(any(ch.isalpha() for ch in w) for w in words)
    if alpha / max(len(words), 1) < f.min_alpha_words_frac:
        return "min_alpha_words_frac"
    stops = sum(w.lower().strip(string.punctuation) in STOP_WORDS for w in words)
    if stops < f.min_stop_words:
        return "min_stop_words"
    return None


def c4_lines(text: str, f) -> tuple[str | None, str | None, int]:
    """C4's cleaning of one page: (the kept text or None, the rule that removed the page, lines dropped)."""
    lower = text.lower()
    if f.drop_lorem_ipsum and "lorem ipsum" in lower:
        return None, "lorem_ipsum", 0
    if f.drop_curly_bracket and "{" in text:
        return None, "curly_bracket", 0
    kept, dropped = [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if f.remove_citations:
            line = _CITATION.sub("", line).strip()
        words = line.split()
        low = line.lower()
        if (not line.endswith(_TERMINAL) or line.endswith("...") or len(words) < f.min_words_per_line
                or any(len(w) > f.max_word_length for w in words)
                or (f.drop_javascript_lines and "javascript" in low)
                or (f.drop_policy_lines and any(p in low for p in _POLICY))):
            dropped += 1
            continue
        kept.append(line)
    page = "\n".join(kept)
    if len(_SENTENCE_END.findall(page)) < f.min_sentences:
        return None, "min_sentences", dropped
    return page, None, dropped


class Filters:
    """The enabled filters of a ``data.quality`` section (``pipeline.config.data_filters``), in its order."""

    def __init__(self, q):
        self.q = q
        self.names = q.enabled()
        self.reasons: dict[str, Counter] = {n: Counter() for n in self.names}
        self.lines_dropped = 0

    def __bool__(self) -> bool:
        return bool(self.names)

    def apply(self, text: str) -> tuple[str | None, str | None]:
        """(the text to keep, or None, and then the name of the filter that removed it)."""
        q = self.q
        for name in self.names:
            if name == "language":
                code, score = language_of(text)
                reason = None if code in q.language.languages and score >= q.language.min_score else code
            elif name == "gopher_repetition":
                reason = gopher_repetition(text, q.gopher_repetition)
            elif name == "gopher_quality":
                reason = gopher_quality(text, q.gopher_quality)
            else:
                kept, reason, dropped = c4_lines(text, q.c4_lines)
                self.lines_dropped += dropped
                if kept is not None:
                    text = kept
            if reason is not None:
                self.reasons[name][reason] += 1
                return None, name
        return text, None

    def counts(self) -> dict:
        out = {n: dict(sorted(c.items())) for n, c in self.reasons.items()}
        if "c4_lines" in self.names:
            out["c4_lines_dropped_lines"] = self.lines_dropped
        return out

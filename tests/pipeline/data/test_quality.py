"""Quality filters (pipeline.data.quality), each rule against its published definition on hand-made
documents, and the filters through the shard stage's counts."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data import quality
from pipeline.config.data_filters import C4LinesFilter, GopherQualityFilter, GopherRepetitionFilter, QualitySection

PROSE = ("The river runs to the sea and that is where the boats have gone with the morning tide. "
         "Children of the village walk to the shore, and they wait with their mothers for the sails. ")


def prose(sentences: int) -> str:
    return PROSE * (sentences // 2)


def test_gopher_repetition_rules():
    f = GopherRepetitionFilter(enabled=True)
    # Duplicated paragraphs: 2 of 4 repeat an earlier one (0.5 > 0.3).
    text = "\n\n".join(["alpha beta gamma delta", "one two three four", "alpha beta gamma delta",
                        "alpha beta gamma delta"])
    assert quality.gopher_repetition(text, f) == "dup_para_frac"
    # Lines: 2 of 5 lines repeat (0.4 > 0.3); paragraphs do not (one paragraph).
    lines = ["a first line here", "another line there", "a first line here", "a first line here", "last one"]
    assert quality.gopher_repetition("\n".join(lines), f) == "dup_line_frac"
    # Characters of duplicated lines: 1 of 4 lines repeats (0.25 <= 0.3) but holds most characters.
    long = "x" * 200
    assert quality.gopher_repetition("\n".join([long, "b c", long, "d e"]), f) == "dup_line_char_frac"
    # The most frequent 2-gram: "to be" 3 times = 15 characters; over 20% of a 70-character text.
    words = "to be or not to be that is to be said".split()
    assert quality.top_ngram_chars(words, 2) == len("to be") * 3
    # Duplicated 5-grams: a 5-gram seen again counts its words' characters once, then skips ahead.
    w = "a b c d e a b c d e a b c d e".split()
    assert quality.duplicated_ngram_chars(w, 5) == 10  # the second and third copies, 5 letters each
    # Ordinary prose passes when its repeats are under every limit.
    story = ("Once upon a time a small fox lived near the old mill. Every morning she ran along the river, "
             "looked for mice in the tall grass, and came home before the farmer woke. One winter the mill "
             "stopped turning and the farmer left; the fox stayed, and her children grew up in its walls.")
    assert quality.gopher_repetition(story, f) is None


def test_gopher_repetition_uses_the_configured_limits():
    text = "\n\n".join(["alpha beta gamma delta", "one two three four", "alpha beta gamma delta"])  # 1 of 3
    assert quality.gopher_repetition(text, GopherRepetitionFilter(enabled=True)) == "dup_para_frac"
    relaxed = GopherRepetitionFilter(enabled=True, dup_para_frac=0.5, dup_para_char_frac=0.5, dup_line_frac=0.5,
                                     dup_line_char_frac=0.5, top_ngram_char_frac=[1.0, 1.0, 1.0],
                                     dup_ngram_char_frac=[1.0] * 6)
    assert quality.gopher_repetition(text, relaxed) is None


def test_gopher_quality_rules():
    f = GopherQualityFilter(enabled=True)
    assert quality.gopher_quality(prose(6), f) is None
    assert quality.gopher_quality("the river and the sea " * 5, f) == "min_words"  # 25 words < 50
    assert quality.gopher_quality(prose(6), GopherQualityFilter(max_words=20)) == "max_words"
    assert quality.gopher_quality("a an of to is it be " * 10 + "the and", f) == "min_mean_word_length"
    assert quality.gopher_quality(("incomprehensibilities " * 50) + "the and with", f) == "max_mean_word_length"
    assert quality.gopher_quality(prose(6) + " #tag" * 12, f) == "max_symbol_word_ratio"  # 12 / 86 > 0.1
    bullets = "\n".join(f"- the item number {i} and that with more words" for i in range(10))
    assert quality.gopher_quality(bullets, f) == "max_bullet_lines_frac"  # 10 of 10 lines > 0.9
    ellipses = "\n".join(f"the story goes on and on with line {i}..." for i in range(8)) + "\n" + prose(2)
    assert quality.gopher_quality(ellipses, f) == "max_ellipsis_lines_frac"  # 8 of 9 lines > 0.3
    numbers = " ".join(str(1000 + i) for i in range(60)) + " the and with the sea runs"
    assert quality.gopher_quality(numbers, f) == "min_alpha_words_frac"
    no_stops = " ".join(["river", "boats", "morning", "children", "village", "shore"] * 10)
    assert quality.gopher_quality(no_stops, f) == "min_stop_words"
    # Punctuation alone is not a word.
    assert quality.words_of("Hello , world ! -- yes") == ["Hello", "world", "yes"]


def test_c4_line_rules():
    f = C4LinesFilter(enabled=True)
    page = "\n".join([
        "Home | About | Contact",  # no terminal punctuation: dropped
        "The river runs to the sea every morning.",
        "Short line.",  # fewer than 5 words: dropped
        "Please enable Javascript to view this page properly.",  # javascript: dropped
        "This site uses cookies to improve your experience.",  # policy: dropped
        "The boats have gone with the tide [1] and the harbour is quiet.",
        "Children wait with their mothers on the shore!",
        "Is that the sound of the sails coming home?",
    ])
    kept, reason, dropped = quality.c4_lines(page, f)
    assert reason is None and dropped == 4
    assert kept.splitlines() == ["The river runs to the sea every morning.",
                                 "The boats have gone with the tide and the harbour is quiet.",
                                 "Children wait with their mothers on the shore!",
                                 "Is that the sound of the sails coming home?"]
    assert quality.c4_lines("Lorem ipsum dolor sit amet, consectetur adipiscing elit.", f)[1] == "lorem_ipsum"
    assert quality.c4_lines("function f() { return the value of the thing; }", f)[1] == "curly_bracket"
    two = "The first sentence is right here.\nThe second sentence is right here."
    assert quality.c4_lines(two, f)[1] == "min_sentences"  # 2 < 3 sentences left


def test_language_filter_keeps_the_configured_languages(data_root):
    en = (data_root / "tinystories" / "validation_head.txt").read_text(encoding="utf-8")[:2000]
    code, score = quality.language_of(en)
    assert code == "en" and score > 0.9
    q = QualitySection()
    q.language.enabled = True
    filters = quality.Filters(q)
    assert filters.apply(en) == (en, None)
    udhr = sorted((data_root / "multilingual" / "udhr").glob("*"))
    german = next(p for p in udhr if "deu" in p.name or p.name.startswith("de"))
    text = german.read_text(encoding="utf-8")[:2000]
    assert filters.apply(text) == (None, "language")
    assert filters.counts() == {"language": {quality.language_of(text)[0]: 1}}


def test_filters_apply_in_order_and_count_the_first_that_removes():
    q = QualitySection()
    q.gopher_quality.enabled = True
    q.c4_lines.enabled = True
    filters = quality.Filters(q)
    assert filters.names == ["gopher_quality", "c4_lines"]
    assert filters.apply("too short") == (None, "gopher_quality")
    text = prose(8) + "\nNavigation menu here"
    kept, by = filters.apply(text)
    assert by is None and "Navigation" not in kept
    assert filters.counts() == {"gopher_quality": {"min_words": 1}, "c4_lines": {}, "c4_lines_dropped_lines": 1}


@pytest.mark.parametrize("override, pattern", [
    ("data.quality.language.languages=[xx]", r"'xx' is not a language the model knows"),
    ("data.quality.gopher_repetition.dup_line_frac=1.5", r"dup_line_frac=1\.5 must be in \[0, 1\]"),
    ("data.quality.gopher_repetition.top_ngram_char_frac=[0.2]", r"top_ngram_char_frac=\[0\.2\] must be 3 fractions"),
    ("data.quality.gopher_quality.min_words=500", r"min_words=500 must be >= 0 and <= max_words=100"),
    ("data.quality.perplexity.enabled=true", r"unknown key data\.quality\.'perplexity'"),
])
def test_bad_quality_settings_are_named(override, pattern):
    extra = ["data.quality.gopher_quality.max_words=100"] if "min_words" in override else []
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override, *extra])

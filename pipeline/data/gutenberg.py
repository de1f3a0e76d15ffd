"""Rebuild the cleaned Project Gutenberg books of the data root's ``gutenberg/`` from the raw e-books.

The cleaned books are reference data (their sha256 are in ``pipeline.data.corpora``). The README of the
shared data folder (section "Processing") says what was done to the raw e-books; this module does the same
in code, and ``make data`` runs it on the raw e-books of ``RU-ECE/ECE451-Parallel`` at the pinned commit.
That keeps the cleaning reviewable and lets anyone rerun it on the raw e-books and get the same bytes.
It is pure stdlib on purpose, so it runs wherever the raw e-books are, with nothing of Conduit installed.

``clean_ebook`` runs the same steps on every book. ``BOOK_RULES`` holds the ``BookRules`` of the few books
that need more: three have end matter cut (the original processing did that for those books only), and
two have credits that the general credit rule does not recognise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START_MARKER = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK[^*]*\*\*\*[^\n]*\n", re.M)
END_MARKER = re.compile(r"^[ \t]*\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG EBOOK", re.M)
TAG = re.compile(r"[ \t]*\[(?:Illustration\b|Project Gutenberg )[^\]]*\]")
IMAGE_IDS = re.compile(r"\n+(?:\d{4}m\n+)+")
EBOOK_NOTE = re.compile(r"Project Gutenberg|\betexts?\b|electronic book|Transcriber['’]s Notes?:|\bwww\b", re.I)
CREDIT = re.compile(r"(?:Produced by|Transcribed from) |cover$|\[Picture: [^\]]*cover\]$")
PARAGRAPH = re.compile(r"\n*[^\n]+(?:\n[^\n]+)*\n*")
MAX_BLANK_LINES = 3


@dataclass(frozen=True)
class BookRules:
    """What one book needs beyond the general cleaning; the defaults need nothing more."""

    last_line: str | None = None
    """The book's last line, without its indentation. What follows it is end matter (publisher's ads,
    transcriber's notes) and is cut. ``None`` keeps everything up to the END marker."""
    credits: tuple[str, ...] = ()
    """First lines of leading credit paragraphs that do not look like credits (no "Produced by")."""


def decode(raw: bytes) -> str:
    """The e-book as text: UTF-8 without its BOM, CRLF line ends turned into LF ("CRLF → LF")."""
    return raw.decode("utf-8-sig").replace("\r\n", "\n")


def between_markers(text: str) -> str:
    """The text between the ``*** START OF …***`` and ``*** END OF …`` lines (the part that is kept).

    Raises:
        ValueError: if either marker is missing.
    """
    start = START_MARKER.search(text)
    if start is None:
        raise ValueError("no '*** START OF THE PROJECT GUTENBERG EBOOK … ***' line: not a Project Gutenberg e-book")
    end = END_MARKER.search(text, start.end())
    if end is None:
        raise ValueError("no '*** END OF THE PROJECT GUTENBERG EBOOK …' line after the START line")
    return text[start.end():end.start()]


def cut_end_matter(text: str, last_line: str | None) -> str:
    """Everything after the book's last line dropped (end matter of Dracula, A Study in Scarlet and
    The Scarlet Letter).

    Raises:
        ValueError: if ``last_line`` is not a line of ``text``.
    """
    if last_line is None:
        return text
    found = re.search(rf"^[ \t]*{re.escape(last_line)}[ \t]*$", text, re.M)
    if found is None:
        raise ValueError(f"the book's last line {last_line!r} is not in the text")
    return text[:found.end()]


def remove_tags(text: str) -> str:
    """``[Illustration…]`` and ``[Project Gutenberg Editor's Note…]`` tags removed; their lines stay, blank."""
    return TAG.sub("", text)


def strip_trailing_spaces(text: str) -> str:
    """Whitespace at line ends removed ("trailing spaces stripped"), no-break spaces included."""
    return re.sub(r"[^\S\n]+$", "", text, flags=re.M)


def drop_image_ids(text: str) -> str:
    """Lines of image ids such as ``0009m`` removed with the blank lines around them, leaving one blank line.

    Only four-digit ids (volume one of Monte Cristo) go: the original processing kept the five-digit
    ids of the later volumes (``20009m``), so this does too.
    """
    return IMAGE_IDS.sub("\n\n", text)


def paragraphs(text: str) -> list[str]:
    """``text`` cut into paragraphs, each with the blank lines after it (and the first with those before)."""
    return PARAGRAPH.findall(text)


def drop_ebook_notes(text: str) -> str:
    """Paragraphs about the e-book rather than the book dropped, wherever they are, with the blank lines
    after them. That is: editor's and transcriber's notes (they name Project Gutenberg, an etext or an
    electronic book, a web address, or are a "Transcriber's Notes:" heading) and the trailing "End of (the)
    Project Gutenberg EBook of …" line.
    """
    return "".join(p for p in paragraphs(text) if not EBOOK_NOTE.search(p))


def drop_credits(text: str, extra: tuple[str, ...]) -> str:
    """Leading producer/transcriber credit paragraphs dropped: "Produced by …", "Transcribed from …", a lone
    cover (``cover`` or a cover picture tag), and those whose first line is in ``extra``."""
    paras = paragraphs(text)
    while paras and (CREDIT.match(paras[0].strip()) or paras[0].strip().split("\n")[0] in extra):
        paras.pop(0)
    return "".join(paras)


def squeeze_blank_lines(text: str) -> str:
    """Runs of more than three blank lines cut to three; no blank lines at the start or end; a final newline."""
    text = re.sub("\n{%d,}" % (MAX_BLANK_LINES + 2), "\n" * (MAX_BLANK_LINES + 1), text)
    return text.strip("\n") + "\n"


def clean_ebook(raw: bytes, rules: BookRules = BookRules()) -> bytes:
    """Clean one raw Project Gutenberg e-book as the shipped ``gutenberg/`` books were cleaned.

    Args:
        raw: the e-book file as distributed (UTF-8, optionally with a BOM, CRLF or LF line ends).
        rules: what this book needs beyond the general cleaning (``BOOK_RULES[name]`` for the books there).

    Returns:
        The cleaned book: UTF-8 without BOM, LF line ends, ending in one newline.

    Raises:
        ValueError: if the START or END marker is missing, or ``rules.last_line`` is not in the book.
    """
    text = cut_end_matter(between_markers(decode(raw)), rules.last_line)
    text = strip_trailing_spaces(remove_tags(text))
    text = drop_image_ids(text)
    text = drop_ebook_notes(text)
    text = drop_credits(text, rules.credits)
    return squeeze_blank_lines(text).encode("utf-8")


BOOK_RULES: dict[str, BookRules] = {
    # End matter, cut for these three books only by the original processing.
    "pg00244_a_study_in_scarlet.txt": BookRules(last_line="Ipse domi simul ac nummos contemplor in arca.’”"),
    "pg00345_dracula.txt": BookRules(last_line="THE END"),
    "pg25344_scarlet_letter.txt": BookRules(last_line="Cambridge: Electrotyped and Printed by Welch, Bigelow, & Co."),
    # Credits without "Produced by": only the producers' names; a "***" between PG's title and the credits.
    "pg02600_war_and_peace.txt": BookRules(credits=("An Anonymous Volunteer, and David Widger",)),
    "fr_candide.txt": BookRules(credits=("***",)),
}

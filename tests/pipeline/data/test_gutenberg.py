"""Each rule of the Gutenberg cleaning (``pipeline.data.gutenberg``) on small raw e-books written here in
Project Gutenberg's format, with the exact bytes expected. No real e-book is read (CI has none)."""

from __future__ import annotations

import pytest

from pipeline.data.gutenberg import BOOK_RULES, BookRules, clean_ebook

HEADER = """\
The Project Gutenberg EBook of A Test Book, by A. Author

This eBook is for the use of anyone anywhere at no cost and with
almost no restrictions whatsoever.  You may copy it, give it away or
re-use it under the terms of the Project Gutenberg License included
with this eBook or online at www.gutenberg.org


Title: A Test Book

Author: A. Author

Release Date: January 1, 2000 [EBook #99999]

Language: English

Character set encoding: UTF-8

"""
START = "*** START OF THIS PROJECT GUTENBERG EBOOK A TEST BOOK ***\n"
END = "*** END OF THIS PROJECT GUTENBERG EBOOK A TEST BOOK ***\n"
FOOTER = """
***** This file should be named 99999-0.txt or 99999-0.zip *****
This and all associated files of various formats will be found in:
        http://www.gutenberg.org/9/9/9/9/99999/

*** START: FULL LICENSE ***

THE FULL PROJECT GUTENBERG LICENSE
PLEASE READ THIS BEFORE YOU DISTRIBUTE OR USE THIS WORK
"""
END_LINE = "End of the Project Gutenberg EBook of A Test Book, by A. Author\n"


def ebook(body: str, start: str = START, end: str = END, bom: bool = True) -> bytes:
    """A raw e-book as Project Gutenberg distributes it: BOM, header, markers, CRLF line ends, footer."""
    text = HEADER + start + body + end + FOOTER
    return (b"\xef\xbb\xbf" if bom else b"") + text.replace("\n", "\r\n").encode("utf-8")


def test_a_typical_ebook_comes_out_clean() -> None:
    body = (
        "\n\n\n\nProduced by A. Volunteer and B. Helper\n\n\n\n\n\n"
        "A TEST BOOK   \n\nby A. Author\n\n\n\n\n"
        "        [Illustration: The author at work]\n\n"
        "CHAPTER I. The Beginning\t\n\n"
        "It was a dark and stormy night; the rain fell in torrents.\n"
        "“Who’s there?” asked the porter.\n\n\n\n\n"
        "THE END\n\n\n\n\n" + END_LINE + "\n"
    )
    expected = (
        "A TEST BOOK\n\nby A. Author\n\n\n\n"
        "CHAPTER I. The Beginning\n\n"
        "It was a dark and stormy night; the rain fell in torrents.\n"
        "“Who’s there?” asked the porter.\n\n\n\n"
        "THE END\n"
    )
    assert clean_ebook(ebook(body)) == expected.encode("utf-8")


def test_text_between_markers_kept_with_or_without_bom_and_crlf() -> None:
    body = "\n\nFirst line.\n\nLast line.\n\n"
    assert clean_ebook(ebook(body)) == b"First line.\n\nLast line.\n"
    assert clean_ebook(ebook(body, bom=False)) == b"First line.\n\nLast line.\n"
    lf_only = (HEADER + START + body + END + FOOTER).encode("utf-8")
    assert clean_ebook(lf_only) == b"First line.\n\nLast line.\n"


@pytest.mark.parametrize(
    ("start", "end"),
    [
        ("***START OF THE PROJECT GUTENBERG EBOOK A TEST BOOK***\n",
         "***END OF THE PROJECT GUTENBERG EBOOK A TEST BOOK***\n"),
        ("*** START OF THIS PROJECT GUTENBERG EBOOK\nA TEST BOOK ***\n",
         "*** END OF THIS PROJECT GUTENBERG EBOOK\nA TEST BOOK ***\n"),
        ("*** START OF THE PROJECT GUTENBERG EBOOK A TEST BOOK ***\n",
         "        \n            *** END OF THE PROJECT GUTENBERG EBOOK A TEST BOOK ***\n"),
    ],
    ids=["no-spaces", "title-on-next-line", "indented-end"],
)
def test_marker_spellings(start: str, end: str) -> None:
    assert clean_ebook(ebook("\nText.\n\n", start=start, end=end)) == b"Text.\n"


def test_missing_markers_raise() -> None:
    with pytest.raises(ValueError, match=r"START OF"):
        clean_ebook(ebook("Text.\n", start=""))
    with pytest.raises(ValueError, match=r"END OF"):
        clean_ebook(ebook("Text.\n", end=""))
    with pytest.raises(ValueError, match=r"START OF"):
        clean_ebook("Just some text.\r\n".encode())


def test_trailing_end_of_ebook_paragraph_dropped() -> None:
    two_lines = "End of the Project Gutenberg EBook of A Test Book,\nComplete, by A. Author\n"
    assert clean_ebook(ebook("\nText.\n\n\n\n" + END_LINE + "\n")) == b"Text.\n"
    assert clean_ebook(ebook("\nText.\n\n\n\n" + two_lines + "\n")) == b"Text.\n"
    assert clean_ebook(ebook("\nText.\n\nEnd of Project Gutenberg’s A Test Book\n")) == b"Text.\n"


def test_leading_credit_paragraphs_dropped() -> None:
    body = (
        "\n\nProduced by A. Volunteer and the Online Distributed\nProofreading Team at http://www.pgdp.net\n\n"
        "Transcribed from the 1890 edition by B. Helper, email b@example.org\n\n"
        "                   [Picture: Public domain book cover]\n\n"
        "cover\n\n\n"
        "A TEST BOOK\n\nThe effect produced by the rain was striking.\n\nProduced by the author himself.\n"
    )
    expected = "A TEST BOOK\n\nThe effect produced by the rain was striking.\n\nProduced by the author himself.\n"
    assert clean_ebook(ebook(body)) == expected.encode()


def test_credits_named_in_book_rules_dropped() -> None:
    body = "\n\nA. Volunteer, and B. Helper\n\n\nA TEST BOOK\n"
    assert clean_ebook(ebook(body)) == b"A. Volunteer, and B. Helper\n\n\nA TEST BOOK\n"
    assert clean_ebook(ebook(body), BookRules(credits=("A. Volunteer, and B. Helper",))) == b"A TEST BOOK\n"


def test_notes_about_the_ebook_dropped_with_the_blank_lines_after_them() -> None:
    body = (
        "\nA TEST BOOK\n\n[1]\n\n\n\n"
        "     Original Transcriber’s Note: This etext is prepared directly\n     from an 1887 edition.\n\n"
        "     Additions to the text include the underscore for italics.\n\n"
        "     Project Gutenberg Editor’s Note: In reproofing old PG files\n     nothing was changed.\n\n"
        "     Note from the original file: This electronic book is released today.\n\n"
        "Contents\n\n\n\n"
        "Original Transcriber’s Notes:\n\n\n\n\n"
        "Thanks to the library at www://library.example that made this possible.\n\n\n\n\n"
        "CHAPTER I.\n\nA pretext was found; the text was read.\n"
    )
    expected = (
        "A TEST BOOK\n\n[1]\n\n\n\n"
        "     Additions to the text include the underscore for italics.\n\n"
        "Contents\n\n\n\n"
        "CHAPTER I.\n\nA pretext was found; the text was read.\n"
    )
    assert clean_ebook(ebook(body)) == expected.encode("utf-8")


def test_illustration_and_editor_note_tags_removed_leaving_blank_lines() -> None:
    body = (
        "\nA TEST BOOK\n\n"
        "                            [Illustration]\n\n"
        "Chapter I\n\n"
        "[Illustration: “The Prison Door”]\n"
        "Text.\n\n\n"
        "[Project Gutenberg Editor's Note: There is also another version of\nthis work scanned elsewhere]\n"
        "\nMore text.\n"
    )
    expected = "A TEST BOOK\n\n\n\nChapter I\n\n\nText.\n\n\n\nMore text.\n"
    assert clean_ebook(ebook(body)) == expected.encode("utf-8")


def test_image_ids_removed_with_the_blank_lines_around_them() -> None:
    body = (
        "\nby A. Author\n\n\n\n\n0009m \n\n\n\n0011m\n\n\n\nContents\n\n"
        "a line.\n\n0023m\n\n\n\nNext line.\n\n"
        "VOLUME TWO\n\n20009m\n\n\nPaid 1200m of rope.\n"
    )
    expected = (
        "by A. Author\n\nContents\n\n"
        "a line.\n\nNext line.\n\n"
        "VOLUME TWO\n\n20009m\n\n\nPaid 1200m of rope.\n"
    )
    assert clean_ebook(ebook(body)) == expected.encode()


def test_trailing_whitespace_stripped_indentation_kept() -> None:
    body = "\n                    DRACULA   \n\n\tA tab-indented line.\t\nWith no-break\u00a0spaces\u00a0\u00a0\n"
    expected = "                    DRACULA\n\n\tA tab-indented line.\nWith no-break\u00a0spaces\n"
    assert clean_ebook(ebook(body)) == expected.encode("utf-8")


def test_runs_of_more_than_three_blank_lines_cut_to_three() -> None:
    body = "\n\n\n\n\n\nOne\n\nTwo\n\n\nThree\n\n\n\nFour\n\n\n\n\nFive\n" + "\n" * 12 + "Six\n\n\n\n\n\n\n"
    expected = "One\n\nTwo\n\n\nThree\n\n\n\nFour\n\n\n\nFive\n\n\n\nSix\n"
    assert clean_ebook(ebook(body)) == expected.encode()


def test_end_matter_after_the_last_line_cut() -> None:
    body = (
        "\nJONATHAN HARKER.\n\n                                THE END\n\n"
        "       *       *       *       *       *\n\n_There's More to Follow!_\n\n"
        "More stories of the sort you like.\n\n" + END_LINE
    )
    expected = "JONATHAN HARKER.\n\n                                THE END\n"
    assert clean_ebook(ebook(body), BookRules(last_line="THE END")) == expected.encode()
    with pytest.raises(ValueError, match="FINIS"):
        clean_ebook(ebook(body), BookRules(last_line="FINIS"))


def test_book_rules_name_cleaned_files() -> None:
    assert BookRules() not in BOOK_RULES.values()
    assert all(name.endswith(".txt") for name in BOOK_RULES)

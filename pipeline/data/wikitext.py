"""WikiText's raw files rebuilt from the Hugging Face rows of the same split.

Why: ``wiki.test.raw`` of ``wikitext-2-raw-v1.zip`` (the file perplexity tools and papers score) has no
verbatim public copy, but the Hugging Face ``wikitext-2-raw-v1`` rows hold every line of it: each
non-empty line with its ``"\\n"``, each empty line (``" \\n"`` in the file) as ``""``. A public copy of
the test rows joined by ``"\\n\\n"`` (``Deathnetworks/rotorquant``'s ``wikitext-test.txt``, CRLF line ends)
splits back into the rows without ambiguity, because a non-empty row never starts with a newline and holds
exactly one, at its end. ``raw_from_rows`` does that and writes the rows as the original file did.
"""

from __future__ import annotations

ROW_SEPARATOR = "\n\n"


def split_rows(joined: str) -> list[str]:
    """The rows that ``ROW_SEPARATOR.join(rows)`` gave ``joined`` (LF line ends).

    Raises:
        ValueError: ``joined`` is not such a join (a row not followed by the separator), naming the place.
    """
    rows: list[str] = []
    at, end = 0, len(joined)
    while True:
        if at == end:  # the text ends with a separator: an empty last row
            rows.append("")
            return rows
        if joined[at] == "\n":
            rows.append("")
        else:
            stop = joined.find("\n", at)
            if stop < 0:
                raise ValueError(f"row {len(rows)} (character {at}) does not end with a newline")
            rows.append(joined[at:stop + 1])
            at = stop + 1
            if at == end:
                return rows
        if not joined.startswith(ROW_SEPARATOR, at):
            raise ValueError(f"row {len(rows) - 1} is not followed by a blank line (character {at})")
        at += len(ROW_SEPARATOR)


def raw_from_rows(joined: bytes) -> bytes:
    """The original raw file from the Hugging Face rows joined by blank lines (CRLF or LF).

    Args:
        joined: the rows joined with ``"\\n\\n"``, UTF-8.

    Returns:
        every row in turn, an empty row written as ``" \\n"``, UTF-8.

    Raises:
        ValueError: the text is not rows joined that way (see ``split_rows``).
    """
    rows = split_rows(joined.decode("utf-8").replace("\r\n", "\n"))
    return "".join(row or " \n" for row in rows).encode("utf-8")

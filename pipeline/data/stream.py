"""Conduit's own .txt and .jsonl reader, in bounded memory: a file is read in chunks of ``CHUNK_BYTES``.

The documents, counts and sha256 are those of reading the whole file at once (``readers``' module
docstring): the bytes are hashed and checked for NUL as they come, decoded by an incremental UTF-8
decoder (so a character split over two chunks is decoded whole, and an invalid byte is reported at
its offset in the file), a leading byte-order mark is dropped, and CRLF and lone CR become LF (a CR
at the end of a chunk waits for the next one). Documents are cut from the text as it comes (a
separator split over two chunks is found), so what is held at once is one chunk plus the document
being read, never the file. ``data.separator: null`` makes the whole file one document, which is then
held whole, as it must be.

Bad input (``data.on_bad_document``): under ``error`` a malformed line stops the read naming the file
and line, as an undecodable file (invalid UTF-8 under ``data.encoding_errors=error``, NUL bytes) stops
it naming the byte offset; under ``skip`` a malformed .jsonl line is left out and counted by reason
in ``stats["skipped"]``. Whole files are skipped by the caller (``readers.read_and_clean``), which
catches ``UndecodableFile``.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterator

from pipeline.data import DataError
from pipeline.data.fs import InputFile, filesystem_for

CHUNK_BYTES = 1 << 20
REPLACEMENT_BYTES = "\ufffd".encode("utf-8")
# Reasons a document or file is skipped under data.on_bad_document=skip, in manifest order.
LINE_REASONS = ("malformed_json", "missing_field", "not_a_string")  # one .jsonl line each
FILE_REASONS = ("invalid_utf8", "nul_bytes")  # one whole file each
SKIP_REASONS = LINE_REASONS + FILE_REASONS


class UndecodableFile(DataError):
    """A text file that cannot be decoded at all (``reason``: one of ``FILE_REASONS``)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # both arguments, so that it crosses from a Ray read task intact
        return type(self), (str(self), self.reason)


def nul_error(uri: str, offset: int) -> UndecodableFile:
    """The error for a NUL byte at ``offset`` of a text file (a binary file, most likely)."""
    return UndecodableFile(f"{uri}: contains NUL bytes (first at byte offset {offset}); is it a binary file?",
                           "nul_bytes")


def utf8_error(uri: str, offset: int) -> UndecodableFile:
    """The error for invalid UTF-8 at ``offset`` under ``data.encoding_errors=error``."""
    return UndecodableFile(
        f"{uri}: invalid UTF-8 at byte offset {offset} (set data.encoding_errors=replace to replace bad "
        "bytes with U+FFFD and count them, or data.on_bad_document=skip to skip the file and count it)",
        "invalid_utf8",
    )


def text_chunks(uri: str, encoding_errors: str, stats: dict) -> Iterator[str]:
    """The text of a file, chunk by chunk: decoded, without a byte-order mark, with LF newlines.

    Args:
        uri: the file.
        encoding_errors: ``error`` or ``replace`` (``data.encoding_errors``).
        stats: gets ``bytes``, ``sha256``, ``replaced_chars`` and ``bom_removed`` when the file is done.

    Raises:
        UndecodableFile: a NUL byte, or invalid UTF-8 under policy ``error``, with its byte offset.
    """
    fs, path = filesystem_for(uri)
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if encoding_errors == "error" else "replace")
    digest, size, literal, replaced = hashlib.sha256(), 0, 0, 0
    tail = b""  # the last 2 bytes read, so that a literal U+FFFD split over two chunks is counted
    cr = ""  # a CR that ended the previous chunk: the next chunk says whether it is a CRLF
    bom_checked = False
    with fs.open_input_stream(path) as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            nul = chunk.find(b"\x00")
            if nul >= 0:
                raise nul_error(uri, size + nul)
            digest.update(chunk)
            literal += (tail + chunk).count(REPLACEMENT_BYTES)
            tail = (tail + chunk)[-2:]
            held = len(decoder.getstate()[0])  # bytes of a character the previous chunk began
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise utf8_error(uri, size - held + e.start) from e
            size += len(chunk)
            replaced += text.count("\ufffd")
            if text and not bom_checked:
                bom_checked = True
                stats["bom_removed"] = int(text.startswith("\ufeff"))
                text = text[stats["bom_removed"]:]
            if cr:
                text, cr = cr + text, ""
            if chunk and text.endswith("\r"):
                text, cr = text[:-1], "\r"
            if "\r" in text:
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            if text:
                yield text
            if not chunk:
                break
    stats.setdefault("bom_removed", 0)
    stats.update(bytes=size, sha256=digest.hexdigest(), replaced_chars=replaced - literal)


def split_stream(chunks: Iterator[str], separator: str) -> Iterator[str]:
    """``"".join(chunks).split(separator)``, yielded piece by piece while the text comes in.

    Only the unfinished piece is kept (as a list of chunks, joined once when its end is found).
    """
    parts: list[str] = []  # chunks of the unfinished piece
    keep = len(separator) - 1  # a separator that ends in a new chunk starts at most this far back
    tail = ""
    for chunk in chunks:
        if separator not in chunk and separator not in tail + chunk[:keep]:
            parts.append(chunk)
            tail = (tail + chunk[-keep:])[-keep:] if keep else ""
            continue
        pieces = ("".join(parts) + chunk).split(separator)
        yield from pieces[:-1]
        parts, tail = [pieces[-1]], pieces[-1][-keep:] if keep else ""
    yield "".join(parts)


def json_documents(lines: Iterator[str], uri: str, text_field: str, on_bad_document: str,
                   skipped: dict) -> Iterator[str | None]:
    """The ``text_field`` of each non-blank JSON line (None where it is null).

    Raises:
        DataError: a malformed line, a line without the field or with a non-string value, naming
            the file and line, under policy ``error`` (under ``skip`` it is counted in ``skipped``).
    """
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        problem, reason = None, None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problem, reason = f"malformed JSON: {e.msg} (column {e.colno})", "malformed_json"
        else:
            if not isinstance(obj, dict) or text_field not in obj:
                problem, reason = f"no field {text_field!r} in this JSON line (set data.text_field)", "missing_field"
            elif obj[text_field] is not None and not isinstance(obj[text_field], str):
                problem = f"field {text_field!r} is {type(obj[text_field]).__name__}, not a string"
                reason = "not_a_string"
        if reason is None:
            yield obj[text_field]
        elif on_bad_document == "skip":
            skipped[reason] += 1
        else:
            raise DataError(f"{uri}:{lineno}: {problem}")


def stream_documents(src: InputFile, text_field: str, separator: str | None, encoding_errors: str,
                     on_bad_document: str, stats: dict) -> Iterator[str | None]:
    """The documents of one .txt or .jsonl file, read in bounded memory (see the module docstring).

    Args:
        src: a ``txt`` or ``jsonl`` input.
        text_field: the .jsonl field holding the text.
        separator: .txt documents are split on it; None: the file is one document.
        encoding_errors: ``error`` or ``replace``.
        on_bad_document: ``error`` or ``skip`` (malformed .jsonl lines).
        stats: filled as the file is read: ``skipped`` (by reason) at once, ``bytes``, ``sha256``,
            ``replaced_chars``, ``bom_removed`` and ``documents`` when the iterator is exhausted.

    Raises:
        UndecodableFile: NUL bytes, or invalid UTF-8 under policy ``error``.
        DataError: a bad .jsonl line under policy ``error``.
    """
    stats["skipped"] = dict.fromkeys(SKIP_REASONS, 0)
    chunks = text_chunks(src.uri, encoding_errors, stats)
    if src.kind == "txt" and separator is None:
        pieces: Iterator[str | None] = iter(["".join(chunks)])
    elif src.kind == "txt":
        pieces = split_stream(chunks, separator)
    else:
        pieces = json_documents(split_stream(chunks, "\n"), src.uri, text_field, on_bad_document, stats["skipped"])
    n = 0
    for doc in pieces:
        if stats.get("bytes") == 0:
            break  # an empty file has no documents (a split of "" would give one empty one)
        n += 1
        yield doc
    stats["documents"] = n

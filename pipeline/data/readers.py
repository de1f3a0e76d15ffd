"""Read one input (.txt, .jsonl, .parquet or a ``datasets`` folder) into documents, with its counts.

Every reader returns the raw documents (``None`` where a record has no text: a null in parquet,
JSON or a dataset) and a stats dict: ``uri``, ``kind``, ``bytes`` read, ``sha256`` of the content,
``documents`` (records, nulls included), ``replaced_chars`` (invalid UTF-8 under policy
``replace``) and ``empty_file``. Problems that make the rest of a file meaningless raise
``DataError`` naming the file and the byte offset or line number; nothing is skipped silently.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.data import DataError
from pipeline.data.clean import CleanOptions, clean_documents
from pipeline.data.fs import InputFile, filesystem_for

STRING_TYPES = (pa.string(), pa.large_string(), pa.string_view())


def _read_bytes(uri: str) -> bytes:
    fs, path = filesystem_for(uri)
    with fs.open_input_stream(path) as f:
        return f.readall()


def decode_utf8(raw: bytes, uri: str, policy: str) -> tuple[str, int]:
    """Decode ``raw`` as UTF-8.

    Returns:
        (text, replaced_chars): the count of U+FFFD that policy ``replace`` put in.

    Raises:
        DataError: invalid UTF-8 under policy ``error``, with the byte offset.
    """
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if policy == "error":
            raise DataError(
                f"{uri}: invalid UTF-8 at byte offset {e.start} (set data.encoding_errors=replace to "
                "replace bad bytes with U+FFFD and count them)"
            ) from e
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.count("\ufffd".encode("utf-8"))


def _text_documents(text: str, kind: str, uri: str, text_field: str, separator: str | None) -> list[str | None]:
    if kind == "txt":
        return [text] if separator is None else text.split(separator)
    docs: list[str | None] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{uri}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from e
        if not isinstance(obj, dict) or text_field not in obj:
            raise DataError(f"{uri}:{lineno}: no field {text_field!r} in this JSON line (set data.text_field)")
        value = obj[text_field]
        if value is not None and not isinstance(value, str):
            raise DataError(f"{uri}:{lineno}: field {text_field!r} is {type(value).__name__}, not a string")
        docs.append(value)
    return docs


def _column_documents(table: pa.Table, uri: str, text_field: str) -> list[str | None]:
    if text_field not in table.column_names:
        raise DataError(f"{uri}: no column {text_field!r} (columns: {table.column_names}; set data.text_field)")
    column = table.column(text_field)
    if column.type not in STRING_TYPES:
        raise DataError(f"{uri}: column {text_field!r} has type {column.type}, not a string")
    return column.to_pylist()


def _read_datasets(uri: str, text_field: str) -> tuple[list[str | None], dict]:
    """A ``save_to_disk`` folder: a Dataset, or a DatasetDict read split by split in name order."""
    import datasets  # heavy; only inputs of this kind need it

    fs, root = filesystem_for(uri)
    digest, size = hashlib.sha256(), 0
    files = sorted((i for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                    if i.type == pafs.FileType.File), key=lambda i: i.path)
    for info in files:
        with fs.open_input_stream(info.path) as f:
            data = f.readall()
        digest.update(info.path[len(root):].encode("utf-8") + b"\0" + data)
        size += len(data)
    loaded = datasets.load_from_disk(uri if "://" in uri else root)
    parts = [loaded] if isinstance(loaded, datasets.Dataset) else [loaded[k] for k in sorted(loaded)]
    docs: list[str | None] = []
    for part in parts:
        docs += _column_documents(part.data.table, uri, text_field)
    return docs, {"bytes": size, "sha256": digest.hexdigest()}


def read_input(src: InputFile, text_field: str, separator: str | None,
               encoding_errors: str) -> tuple[list[str | None], dict]:
    """Read one input into documents.

    Args:
        src: the input.
        text_field: the .jsonl field / .parquet or dataset column holding the text.
        separator: .txt files are split on it; None keeps a whole file as one document.
        encoding_errors: ``error`` or ``replace`` for invalid UTF-8 in .txt/.jsonl.

    Returns:
        (documents, stats) as the module docstring describes.

    Raises:
        DataError: invalid UTF-8 (policy ``error``), NUL bytes in a text file, malformed JSON, a
            missing field or column, or a non-string text value.
    """
    stats = {"uri": src.uri, "kind": src.kind, "replaced_chars": 0}
    if src.kind == "datasets":
        docs, extra = _read_datasets(src.uri, text_field)
        stats.update(extra)
    else:
        raw = _read_bytes(src.uri)
        stats.update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        if src.kind == "parquet":
            docs = _column_documents(pq.read_table(pa.BufferReader(raw)), src.uri, text_field) if raw else []
        else:
            nul = raw.find(b"\x00")
            if nul >= 0:
                raise DataError(f"{src.uri}: contains NUL bytes (first at byte offset {nul}); is it a binary file?")
            text, stats["replaced_chars"] = decode_utf8(raw, src.uri, encoding_errors)
            docs = _text_documents(text, src.kind, src.uri, text_field, separator) if raw else []
    stats["empty_file"] = stats["bytes"] == 0
    stats["documents"] = len(docs)
    return docs, stats


def read_and_clean(src: InputFile, text_field: str, separator: str | None, encoding_errors: str,
                   opts: CleanOptions) -> tuple[pa.Table, dict]:
    """Read one input and clean its documents: the unit of parallel work of the shard stage.

    Returns:
        (kept documents as a ``DOCUMENT_SCHEMA`` table, the input's stats with the cleaning counts).

    Raises:
        DataError: see ``read_input``.
    """
    docs, stats = read_input(src, text_field, separator, encoding_errors)
    table, clean_counts = clean_documents(docs, src.uri, opts)
    stats.update(clean_counts)
    return table, stats

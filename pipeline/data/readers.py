"""Read one input (.txt, .jsonl, .json, .csv, .parquet or a ``datasets`` folder) into documents, with its counts.

Every reader returns the raw documents (``None`` where a record has no text: a null in parquet,
JSON or a dataset) and a stats dict: ``uri``, ``kind``, ``builder`` (the ``datasets`` builder that
read it, or None), ``bytes`` read, ``sha256`` of the content, ``documents`` (records, nulls
included), ``replaced_chars`` (invalid UTF-8 under policy ``replace``), ``bom_removed`` (1 when the
text began with a UTF-8 byte-order mark, which is dropped), ``empty_file`` and ``skipped`` (malformed
lines and undecodable files left out under ``data.on_bad_document=skip``, by reason). Problems
that make the rest of a file meaningless raise ``DataError`` naming the file and the byte offset or
line number, unless ``data.on_bad_document=skip`` says to skip and count them; nothing is skipped
silently. Conduit's own .txt and .jsonl reader streams the file (``pipeline.data.stream``): memory
stays bounded by a chunk plus a document, whatever the file's size.

Text (.txt, .jsonl, .json, .csv) is read with universal newlines, as Python's ``open`` and the
``datasets`` builders read it: CRLF and a lone CR become LF before documents are split, so a CRLF
file splits into the same documents through either reader.

Data files read through ``datasets.load_dataset`` (``.csv`` and ``.json`` always; ``.txt``,
``.jsonl`` and ``.parquet`` with ``data.reader=datasets``): the bytes are read, hashed and checked
(NUL bytes, UTF-8) here, then the builder reads the file with a cache in a fresh temporary folder
(under ``$TMPDIR``) that is deleted afterwards, so nothing accumulates in ``~/.cache/huggingface``
and every read starts from the file. A remote file, or one whose invalid UTF-8 was replaced, is
handed to the builder as a temporary copy. Rows come in file order. Builder specifics:

- csv: every cell is read as written (no ``NA``/empty-cell to null conversion, ``007`` stays a
  string); blank lines are not rows.
- json: JSON Lines or one JSON array; a row without the field is a null (counted), where Conduit's
  own .jsonl reader stops at that line; a field of mixed types is an error.
- text: ``data.separator`` picks the unit: ``"\n"`` lines, ``"\n\n"`` paragraphs, null the whole
  file. The builder opens files with universal newlines (CRLF and CR become LF) and skips empty
  paragraphs and the empty piece after a final newline; those are counted here as the empty
  documents they are, so the counts equal the native reader's on LF files.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.base import is_uri
from pipeline.data import DataError
from pipeline.data.clean import CleanOptions, clean_documents
from pipeline.data.fs import InputFile, filesystem_for
from pipeline.data.stream import SKIP_REASONS, UndecodableFile, nul_error, stream_documents, utf8_error

STRING_TYPES = (pa.string(), pa.large_string(), pa.string_view())
# The datasets builder of each kind of data file; kinds Conduit has no reader for always use it.
DATASETS_BUILDERS = {"txt": "text", "jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}
ALWAYS_DATASETS = ("csv", "json")
TEXT_SAMPLE_BY = {"\n": "line", "\n\n": "paragraph", None: "document"}  # data.separator -> sample_by


def builder_for(kind: str, reader: str) -> str | None:
    """The ``datasets`` builder that reads an input of ``kind`` under ``data.reader`` (None: Conduit's)."""
    if kind in ALWAYS_DATASETS or (reader == "datasets" and kind in DATASETS_BUILDERS):
        return DATASETS_BUILDERS[kind]
    return None


def _read_bytes(uri: str) -> bytes:
    fs, path = filesystem_for(uri)
    with fs.open_input_stream(path) as f:
        return f.readall()


def decode_utf8(raw: bytes, uri: str, policy: str) -> tuple[str, int]:
    """Decode ``raw`` as UTF-8.

    Returns:
        (text, replaced_chars): the count of U+FFFD that policy ``replace`` put in.

    Raises:
        UndecodableFile: invalid UTF-8 under policy ``error``, with the byte offset.
    """
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if policy == "error":
            raise utf8_error(uri, e.start) from e
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.count("\ufffd".encode("utf-8"))


def normalize_text(text: str) -> tuple[str, int]:
    """Drop a leading byte-order mark and turn CRLF and CR into LF.

    Returns:
        (text, 1 if a byte-order mark was removed else 0).
    """
    bom = int(text.startswith("\ufeff"))
    return text[bom:].replace("\r\n", "\n").replace("\r", "\n"), bom


def _refuse_nul(raw: bytes, uri: str) -> None:
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise nul_error(uri, nul)


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
    loaded = datasets.load_from_disk(uri if is_uri(uri) else root)
    parts = [loaded] if isinstance(loaded, datasets.Dataset) else [loaded[k] for k in sorted(loaded)]
    docs: list[str | None] = []
    for part in parts:
        docs += _column_documents(part.data.table, uri, text_field)
    return docs, {"bytes": size, "sha256": digest.hexdigest()}


def _local_path(uri: str) -> str | None:
    if not is_uri(uri):
        return uri
    return uri[len("file://"):] if uri.startswith("file://") else None


def _builder_skipped_empty(text: str, sample_by: str) -> int:
    """How many empty documents datasets' text builder leaves out that a split on the separator keeps
    (``text`` with newlines already normalized, as the builder reads it)."""
    if not text or sample_by == "document":
        return 0
    return text.split("\n\n").count("") if sample_by == "paragraph" else int(text.endswith("\n"))


def _read_with_builder(src: InputFile, raw: bytes, builder: str, text_field: str, separator: str | None,
                       encoding_errors: str) -> tuple[list[str | None], int, int]:
    """Read a data file through ``datasets.load_dataset(builder)`` (see the module docstring).

    Returns:
        (documents, replaced_chars, bom_removed).
    """
    import datasets  # heavy; only inputs read through it need it
    from datasets.exceptions import DatasetGenerationError

    data, text, replaced, bom = raw, "", 0, 0
    if builder != "parquet":
        _refuse_nul(raw, src.uri)
        text, replaced = decode_utf8(raw, src.uri, encoding_errors)
        text, bom = normalize_text(text)
        data = text.encode("utf-8") if replaced or bom else raw  # the builders keep a BOM in the first row
    if not raw:
        return [], 0, 0  # no rows; the builders reject an empty file
    options: dict = {}
    column = text_field
    if builder == "csv":
        options = {"na_filter": False, "converters": {text_field: str}}
    elif builder == "text":
        options, column = {"sample_by": TEXT_SAMPLE_BY[separator]}, "text"
    with tempfile.TemporaryDirectory(prefix="conduit-datasets-") as tmp:
        path = _local_path(src.uri)
        if path is None or data is not raw:
            path = os.path.join(tmp, f"input.{src.kind}")
            with open(path, "wb") as f:
                f.write(data)
        bars_were_on = not datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # one bar per file is noise; the shard stage has its own
        try:
            ds = datasets.load_dataset(builder, data_files=[path], split="train",
                                       cache_dir=os.path.join(tmp, "cache"), **options)
        except (DatasetGenerationError, ValueError, OSError) as e:
            raise DataError(f"{src.uri}: datasets' {builder!r} builder cannot read it: {e.__cause__ or e}") from e
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        feature = ds.features.get(column)
        if feature is None:
            raise DataError(f"{src.uri}: no column {column!r} (columns: {ds.column_names}; set data.text_field)")
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            raise DataError(f"{src.uri}: column {column!r} is read by datasets as {feature}, not a string")
        docs: list[str | None] = ds.data.table.column(column).to_pylist()
        del ds  # its arrow file lives in ``tmp``
    if builder == "text":
        docs += [""] * _builder_skipped_empty(text, options["sample_by"])
    return docs, replaced, bom


def _first_stats(src: InputFile, builder: str | None) -> dict:
    """An input's stats before it is read (see the module docstring for the rest)."""
    return {"uri": src.uri, "kind": src.kind, "builder": builder, "replaced_chars": 0, "bom_removed": 0,
            "skipped": dict.fromkeys(SKIP_REASONS, 0)}


def iter_input(src: InputFile, text_field: str, separator: str | None, encoding_errors: str,
               reader: str = "native", on_bad_document: str = "error") -> tuple[Iterator[str | None], dict]:
    """The documents of one input, as an iterator (native .txt and .jsonl: read in bounded memory).

    Args:
        src: the input.
        text_field: the .jsonl field / .parquet or dataset column holding the text.
        separator: .txt files are split on it; None keeps a whole file as one document.
        encoding_errors: ``error`` or ``replace`` for invalid UTF-8 in .txt/.jsonl/.json/.csv.
        reader: ``native`` or ``datasets`` (``data.reader``): who reads .txt/.jsonl/.parquet.
        on_bad_document: ``error`` or ``skip``: malformed .jsonl lines (native reader) stop the read
            or are counted in ``stats["skipped"]``.

    Returns:
        (documents, stats): the stats as the module docstring describes, complete once the
        documents are exhausted.

    Raises:
        UndecodableFile: invalid UTF-8 (policy ``error``) or NUL bytes in a text file.
        DataError: malformed JSON (policy ``error``) or CSV, a missing field or column, or a
            non-string text value. Native .txt/.jsonl inputs raise while their documents are read.
    """
    builder = builder_for(src.kind, reader)
    stats = _first_stats(src, builder)
    if builder is None and src.kind in ("txt", "jsonl"):
        docs = stream_documents(src, text_field, separator, encoding_errors, on_bad_document, stats)
        return docs, stats
    if src.kind == "datasets":
        docs, extra = _read_datasets(src.uri, text_field)
        stats.update(extra)
    else:
        raw = _read_bytes(src.uri)
        stats.update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        if builder is not None:
            docs, stats["replaced_chars"], stats["bom_removed"] = _read_with_builder(
                src, raw, builder, text_field, separator, encoding_errors)
        else:
            docs = _column_documents(pq.read_table(pa.BufferReader(raw)), src.uri, text_field) if raw else []
    stats["documents"] = len(docs)
    return iter(docs), stats


def read_input(src: InputFile, text_field: str, separator: str | None, encoding_errors: str,
               reader: str = "native", on_bad_document: str = "error") -> tuple[list[str | None], dict]:
    """Read one input into a list of documents (``iter_input``, all read).

    Returns:
        (documents, stats) as the module docstring describes.

    Raises:
        DataError: see ``iter_input``.
    """
    docs, stats = iter_input(src, text_field, separator, encoding_errors, reader, on_bad_document)
    docs = list(docs)
    stats["empty_file"] = stats["bytes"] == 0
    return docs, stats


def read_and_clean(src: InputFile, text_field: str, separator: str | None, encoding_errors: str,
                   opts: CleanOptions, reader: str = "native",
                   on_bad_document: str = "error") -> tuple[pa.Table, dict]:
    """Read one input and clean its documents as they are read: the unit of parallel work of the shard stage.

    Under ``on_bad_document=skip`` an undecodable text file (``UndecodableFile``) is left out whole:
    no documents, ``skipped[reason] = 1``, its listed size as ``bytes`` and no ``sha256``.

    Returns:
        (kept documents as a ``DOCUMENT_SCHEMA`` table, the input's stats with the cleaning counts).

    Raises:
        DataError: see ``iter_input``.
    """
    try:
        docs, stats = iter_input(src, text_field, separator, encoding_errors, reader, on_bad_document)
        table, clean_counts = clean_documents(docs, src.uri, opts)
    except UndecodableFile as e:
        if on_bad_document != "skip":
            raise
        table, clean_counts = clean_documents([], src.uri, opts)
        stats = _first_stats(src, builder_for(src.kind, reader))
        stats["skipped"][e.reason] = 1
        stats.update(bytes=src.size, sha256=None, documents=0)
    stats["empty_file"] = stats["bytes"] == 0
    stats.update(clean_counts)
    return table, stats

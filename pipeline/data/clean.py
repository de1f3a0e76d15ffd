"""Per-document cleaning: Unicode normalisation, control-character stripping, length filters, ids.

Everything here depends on one document alone, so it runs where the input is read (in parallel).
Rules that need every document (exact duplicates, the split, the document cap) run afterwards in
the shard stage. Each removed document is counted under the rule that removed it.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa

# C0 and C1 controls, DEL, but not tab, newline or carriage return (those are layout, not noise).
CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
REMOVAL_RULES = ("null", "empty", "too_short", "too_long")  # per-document rules, in the order applied
BATCH_DOCUMENTS = 1024  # kept documents per arrow batch of the cleaned table
DOCUMENT_SCHEMA = pa.schema([("text", pa.string()), ("doc_id", pa.string()), ("source", pa.string())])


@dataclass(frozen=True)
class CleanOptions:
    """The ``data`` fields that change a document or decide whether it is kept."""

    normalize: str = "none"  # none | nfc | nfkc
    strip_control_chars: bool = False
    min_doc_chars: int = 1
    max_doc_chars: int | None = None


def doc_id(text: str) -> str:
    """A document's identity: the sha256 hex of its UTF-8 bytes (after cleaning)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def clean_documents(docs: Iterable[str | None], source: str, opts: CleanOptions) -> tuple[pa.Table, dict]:
    """Clean and filter one input's documents as they come.

    Kept documents go into the table ``BATCH_DOCUMENTS`` at a time, so what is held besides the
    table is one batch (and the document being read), whatever the length of ``docs``.

    Args:
        docs: raw documents in input order (``None``: a record without text); any iterable.
        source: the input's URI, stored with every kept document.
        opts: cleaning options.

    Returns:
        (table, counts): kept documents with columns text/doc_id/source in input order, and
        ``removed`` per rule, ``normalized_changed`` (documents that normalisation altered) and
        ``control_chars_removed``.
    """
    removed = dict.fromkeys(REMOVAL_RULES, 0)
    changed = stripped = 0
    texts: list[str] = []
    batches: list[pa.RecordBatch] = []
    form = {"nfc": "NFC", "nfkc": "NFKC"}.get(opts.normalize)
    min_chars = max(opts.min_doc_chars, 1)
    for doc in docs:
        if doc is None:
            removed["null"] += 1
            continue
        if form is not None:
            normal = unicodedata.normalize(form, doc)
            changed += normal != doc
            doc = normal
        if opts.strip_control_chars:
            doc, n = CONTROL_CHARS.subn("", doc)
            stripped += n
        length = len(doc.strip())
        if length == 0:
            removed["empty"] += 1
        elif length < min_chars:
            removed["too_short"] += 1
        elif opts.max_doc_chars is not None and len(doc) > opts.max_doc_chars:
            removed["too_long"] += 1
        else:
            texts.append(doc)
            if len(texts) == BATCH_DOCUMENTS:
                batches.append(_batch(texts, source))
                texts = []
    batches.append(_batch(texts, source))
    table = pa.Table.from_batches(batches, schema=DOCUMENT_SCHEMA)
    return table, {"removed": removed, "normalized_changed": changed, "control_chars_removed": stripped}


def _batch(texts: list[str], source: str) -> pa.RecordBatch:
    return pa.record_batch({"text": texts, "doc_id": [doc_id(t) for t in texts], "source": [source] * len(texts)},
                           schema=DOCUMENT_SCHEMA)

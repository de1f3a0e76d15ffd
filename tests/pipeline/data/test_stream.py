"""The streaming .txt/.jsonl reader: the documents, counts and sha256 of a whole-file read, at any
chunk size, in bounded memory; and ``data.on_bad_document``."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc

import numpy as np
import pytest

from pipeline.data import DataError, stream
from pipeline.data.clean import CleanOptions
from pipeline.data.fs import InputFile
from pipeline.data.readers import read_and_clean, read_input
from tests.pipeline.stages.test_data_stages import cfg_for, run_stages

FRAGMENTS = ["word", " ", "\n", "\n\n", "\r\n", "\r", "\r\n\r\n", "é", "日本", "😀", "\ufffd", "\t", "x" * 9]


def whole_file(raw: bytes, kind: str, separator: str | None, encoding_errors: str) -> tuple[list, dict]:
    """The rule written out: decode all, drop a BOM, CRLF and CR to LF, split (jsonl: one record a line)."""
    text = raw.decode("utf-8", errors="strict" if encoding_errors == "error" else "replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode())
    bom = int(text.startswith("\ufeff"))
    text = text[bom:].replace("\r\n", "\n").replace("\r", "\n")
    if not raw:
        docs = []
    elif kind == "jsonl":
        docs = [json.loads(line)["text"] for line in text.split("\n") if line.strip()]
    else:
        docs = [text] if separator is None else text.split(separator)
    return docs, {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(), "replaced_chars": replaced,
                  "bom_removed": bom, "documents": len(docs)}


def random_text(rng, n: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(n))


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 7, 64])
def test_any_chunk_size_gives_the_whole_file_documents_and_counts(tmp_path, monkeypatch, chunk_bytes):
    monkeypatch.setattr(stream, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(chunk_bytes)
    cases = []
    for i in range(30):
        body = random_text(rng, int(rng.integers(0, 40))).encode("utf-8")
        if i % 3 == 0:
            body = b"\xef\xbb\xbf" + body
        if i % 4 == 1:
            body = body[: len(body) // 2] + b"\xff\xc3" + body[len(body) // 2 :]  # invalid bytes: policy replace
        cases.append(body)
    cases += [b"", b"\xef\xbb\xbf", b"\r", b"a\r", b"\n\n\n"]
    for i, raw in enumerate(cases):
        path = tmp_path / f"{i}.txt"
        path.write_bytes(raw)
        for separator in ("\n\n", "\n", "ab", None):
            got, stats = read_input(InputFile(str(path), "txt", len(raw), 0), "text", separator, "replace")
            want, want_stats = whole_file(raw, "txt", separator, "replace")
            assert got == want, (raw, separator)
            assert {k: stats[k] for k in want_stats} == want_stats, (raw, separator)
            assert stats["empty_file"] == (raw == b"")
    records = [random_text(rng, int(rng.integers(0, 12))) for _ in range(40)]
    raw = b"\xef\xbb\xbf" + "\r\n".join(json.dumps({"text": r}, ensure_ascii=bool(i % 2))
                                        for i, r in enumerate(records)).encode("utf-8") + b"\r\n\r\n"
    (tmp_path / "r.jsonl").write_bytes(raw)
    got, stats = read_input(InputFile(str(tmp_path / "r.jsonl"), "jsonl", len(raw), 0), "text", "\n\n", "error")
    want, want_stats = whole_file(raw, "jsonl", None, "error")
    assert got == want == records and {k: stats[k] for k in want_stats} == want_stats


@pytest.mark.parametrize("chunk_bytes", [1, 4, 1 << 20])
def test_errors_name_the_offset_and_line_in_the_whole_file(tmp_path, monkeypatch, chunk_bytes):
    monkeypatch.setattr(stream, "CHUNK_BYTES", chunk_bytes)
    (tmp_path / "bad.txt").write_bytes("héllo wörld 日本\n\n".encode() * 3 + b"ok \xe6\x97 broken")
    bad_offset = len("héllo wörld 日本\n\n".encode()) * 3 + 3
    with pytest.raises(stream.UndecodableFile, match=rf"bad\.txt: invalid UTF-8 at byte offset {bad_offset} "):
        read_input(InputFile(str(tmp_path / "bad.txt"), "txt", 0, 0), "text", "\n\n", "error")
    (tmp_path / "nul.txt").write_bytes(b"a" * 11 + b"\x00")
    with pytest.raises(stream.UndecodableFile, match=r"nul\.txt: contains NUL bytes \(first at byte offset 11\)"):
        read_input(InputFile(str(tmp_path / "nul.txt"), "txt", 0, 0), "text", "\n\n", "error")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\r\n\n{"text": "b"}\n{"text": 7}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:4: field 'text' is int, not a string"):
        read_input(InputFile(str(tmp_path / "bad.jsonl"), "jsonl", 0, 0), "text", None, "error")


def test_a_file_is_read_in_bounded_memory(tmp_path, monkeypatch):
    """A 24 MB file is read and cleaned with a peak of Python allocations far below its size (a
    whole-file read holds the bytes, the text and the documents: about three times the file)."""
    monkeypatch.setattr(stream, "CHUNK_BYTES", 256 << 10)
    rng = np.random.default_rng(0)
    para = [" ".join(rng.choice(["alpha", "beta", "gamma", "délta", "日本"], size=60)) for _ in range(64)]
    path = tmp_path / "big.txt"
    with open(path, "w", encoding="utf-8", newline="") as f:
        written = 0
        while written < 24 << 20:
            block = "\r\n\r\n".join(para) + "\r\n\r\n"
            f.write(block)
            written += len(block.encode("utf-8"))
    size = path.stat().st_size
    src = InputFile(str(path), "txt", size, 0)
    opts = CleanOptions(max_doc_chars=10)  # every paragraph is removed, so the kept table stays empty
    tracemalloc.start()
    try:
        table, stats = read_and_clean(src, "text", "\n\n", "error", opts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats["bytes"] == size and stats["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert stats["documents"] == stats["removed"]["too_long"] + stats["removed"]["empty"] and len(table) == 0
    assert stats["removed"]["too_long"] > 20_000
    assert peak < 16 * stream.CHUNK_BYTES < size / 6, f"peak {peak / 2**20:.1f} MiB reading {size / 2**20:.0f} MiB"


def test_on_bad_document_skip_counts_lines_and_files_by_reason(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    lines = [{"text": f"good document number {i}"} for i in range(30)]
    body = "\n".join(json.dumps(x) for x in lines[:10]) + '\n{"text": oops}\n{"body": "x"}\n[1, 2]\n'
    body += "\n".join(json.dumps(x) for x in lines[10:20]) + '\n{"text": 3}\n{"text": null}\n'
    body += "\n".join(json.dumps(x) for x in lines[20:]) + "\n"
    (d / "a.jsonl").write_text(body)
    (d / "b.txt").write_bytes("one paragraph\n\n".encode() * 5 + b"then \xff junk")
    (d / "c.txt").write_bytes(b"binary\x00file")
    (d / "d.txt").write_text("\n\n".join(f"plain paragraph {i}" for i in range(20)))
    paths = "data.train_paths=[a.jsonl, b.txt, c.txt, d.txt]"
    with pytest.raises(DataError, match=r"a\.jsonl:11: malformed JSON"):
        run_stages(cfg_for(tmp_path / "e", d, paths, "data.validation_fraction=0.2"), ["shard"])
    art = run_stages(cfg_for(tmp_path / "s", d, paths, "data.validation_fraction=0.2",
                             "data.on_bad_document=skip"), ["shard"])["shard"]
    c = art.manifest["counts"]
    assert c["skipped"] == {"malformed_json": 1, "missing_field": 2, "not_a_string": 1, "invalid_utf8": 1,
                            "nul_bytes": 1}
    a, b, cc, dd = c["inputs"]
    assert a["skipped"]["missing_field"] == 2 and a["documents"] == 31  # 30 good + the null, counted as before
    assert b["skipped"]["invalid_utf8"] == 1 and b["documents"] == 0 and b["sha256"] is None
    assert cc["skipped"]["nul_bytes"] == 1 and cc["documents"] == 0
    assert dd["documents"] == 20 and not any(dd["skipped"].values())
    assert c["documents_read"] == 51 and c["removed"]["null"] == 1
    assert sum(c["documents"].values()) == 50  # 30 from a.jsonl and 20 from d.txt, nothing from b or c


def test_on_bad_document_is_checked():
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data\.on_bad_document='drop' is not allowed; choose one of \['error', 'skip'\]"):
        load_config(None, ["data.on_bad_document=drop"])


def test_undecodable_file_survives_pickling():
    """Ray sends a read task's exception to the driver pickled."""
    import pickle

    e = pickle.loads(pickle.dumps(stream.utf8_error("x.txt", 5)))
    assert isinstance(e, stream.UndecodableFile) and e.reason == "invalid_utf8"
    assert str(e).startswith("x.txt: invalid UTF-8 at byte offset 5 ")


MEMORY_LIMITED_READ = r'''
import json, os, resource, sys
import pyarrow as pa, pyarrow.parquet as pq
from pipeline.data.clean import CleanOptions
from pipeline.data.fs import InputFile
from pipeline.data.readers import read_and_clean

path, headroom = sys.argv[1], int(sys.argv[2])
pq.write_table(pa.table({"x": ["warm"]}), path + ".warm.parquet")  # arrow's one-time set-up (thread pools)
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
table, stats = read_and_clean(InputFile(path, "txt", os.path.getsize(path), 0), "text", "\n\n", "error",
                              CleanOptions(max_doc_chars=100))
kept = table.column("text").to_pylist()
try:
    whole = len(open(path, "rb").read().decode("utf-8"))  # what the reader did before: the file at once
except MemoryError:
    whole = None
print(json.dumps({"stats": stats, "kept": kept, "whole_file_read": whole}))
'''


def test_a_file_larger_than_the_read_tasks_memory_limit_is_read(tmp_path):
    """The shard stage's read task (``read_and_clean``), in a process whose address space may grow by
    64 MiB, reads and cleans a 96 MiB file; reading the file whole fails under the same limit."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    para = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"], size=60)) for _ in range(63)]
    path = tmp_path / "big.txt"
    short = 0
    with open(path, "w", encoding="utf-8", newline="") as f:
        while f.tell() < 96 << 20:
            f.write("\r\n\r\n".join(para) + f"\r\n\r\nshort document {short}\r\n\r\n")
            short += 1
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}  # jemalloc reserves address space up front
    try:
        out = subprocess.run([sys.executable, "-c", MEMORY_LIMITED_READ, str(path), str(64 << 20)],
                             env=env, capture_output=True, text=True, timeout=120)
    finally:
        path.unlink()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    stats = result["stats"]
    assert result["whole_file_read"] is None  # the limit is real: the file does not fit whole
    assert stats["sha256"] == digest and stats["bytes"] >= 96 << 20
    assert stats["documents"] == 64 * short + 1  # the last separator leaves one empty piece
    assert stats["removed"]["too_long"] == 63 * short and stats["removed"]["empty"] == 1
    assert result["kept"] == [f"short document {i}" for i in range(short)]  # CRLF gone, in order

"""Fetching corpus files (``pipeline.data.fetch``) from their public sources, played by a local HTTP server
in the sources' own formats (tests/corpus_sources.py), and from mirrors. Nothing here reaches the network.

Each kind of source is rebuilt into the shared file's exact bytes: a raw Project Gutenberg e-book, the
WikiText rows joined by blank lines, a verbatim file. A source with other bytes, a download cut short and a
missing source leave nothing under the name the pipeline reads; a rerun skips what is in place."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from pipeline.data.corpora import GITHUB_RAW_ENV
from pipeline.data.fetch import STAGING, fetch, fetch_for_run, missing_files, mirror_base, source_of, verify
from tests.corpus_sources import SourceServer, all_files, as_raw_ebook, in_source_format, url_path

FILES = all_files()
BOOK = FILES["gutenberg/train/pg00041_legend_of_sleepy_hollow.txt"]  # 70 kB
WIKI = FILES["wikitext-2/wiki.test.raw"]
SHAKESPEARE = FILES["tinyshakespeare/input.txt"]
ONE_OF_EACH = [BOOK, WIKI, SHAKESPEARE]


@pytest.fixture
def sources(data_root, monkeypatch):
    """The public sources of ONE_OF_EACH on a local server, which every source URL now points at."""
    for var in ("no_proxy", "NO_PROXY"):  # a proxy in the environment must not see 127.0.0.1
        monkeypatch.setenv(var, "127.0.0.1")
    with SourceServer() as server:
        for f in ONE_OF_EACH:
            server.serve(f, (data_root / f.path).read_bytes())
        monkeypatch.setenv(GITHUB_RAW_ENV, server.url)
        yield server


def leftovers(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_kind_of_source_is_rebuilt_byte_for_byte_and_a_rerun_downloads_nothing(tmp_path, sources):
    root = tmp_path / "root"
    outcomes = fetch(ONE_OF_EACH, root)
    assert [o.status for o in outcomes] == ["fetched"] * 3
    assert [o.source for o in outcomes] == [sources.url + url_path(f) for f in ONE_OF_EACH]
    for f in ONE_OF_EACH:
        assert digest(root / f.path) == f.sha256
    # no staging folder, no part file: exactly the three files and their folders
    assert leftovers(root) == sorted({*(f.path for f in ONE_OF_EACH), "gutenberg", "gutenberg/train",
                                      "wikitext-2", "tinyshakespeare"})
    # the sources were in their formats, not the files themselves
    assert sources.files[url_path(BOOK)].startswith("\ufeffThe Project Gutenberg eBook".encode())
    assert b"\r\n\r\n" in sources.files[url_path(WIKI)]
    asked = list(sources.requests)
    assert sorted(asked) == sorted(url_path(f) for f in ONE_OF_EACH)
    assert [o.status for o in fetch(ONE_OF_EACH, root)] == ["present"] * 3
    assert sources.requests == asked
    assert all(o.ok for o in verify(ONE_OF_EACH, root))


def test_a_source_whose_rebuild_has_other_bytes_is_refused_naming_both_checksums(tmp_path, data_root, sources):
    clean = (data_root / BOOK.path).read_bytes().replace(b"Ichabod", b"Ichabud", 1)
    sources.files[url_path(BOOK)] = as_raw_ebook(clean, "The Legend of Sleepy Hollow", 41)
    root = tmp_path / "root"
    (outcome,) = fetch([BOOK], root)
    assert outcome.status == "failed" and not outcome.ok
    found = hashlib.sha256(clean).hexdigest()
    assert outcome.detail == (
        f"{BOOK.path}: rebuilt from {sources.url}{url_path(BOOK)} (gutenberg), it has sha256 {found} "
        f"({len(clean)} bytes), expected {BOOK.sha256} ({BOOK.size} bytes); nothing was written to {root / BOOK.path}")
    assert leftovers(root) == []  # the refused source is not kept either: a rerun downloads it again


def test_a_verbatim_source_with_other_bytes_is_refused_by_its_checksum(tmp_path, data_root, sources):
    bad = (data_root / SHAKESPEARE.path).read_bytes()[:-1] + b"?"
    sources.files[url_path(SHAKESPEARE)] = bad
    root = tmp_path / "root"
    (outcome,) = fetch([SHAKESPEARE], root)
    assert outcome.status == "failed"
    assert outcome.detail.startswith(f"{SHAKESPEARE.path}: the copy from {sources.url}{url_path(SHAKESPEARE)} "
                                     "was refused: SHA256 hash of downloaded file")
    assert f"expected sha256:{SHAKESPEARE.sha256} but got {hashlib.sha256(bad).hexdigest()}" in outcome.detail
    assert outcome.detail.endswith(f"; nothing was written to {root / SHAKESPEARE.path}")
    assert leftovers(root) == []


@pytest.mark.parametrize("file", [BOOK, SHAKESPEARE], ids=["rebuilt", "verbatim"])
def test_a_download_cut_short_leaves_nothing_and_the_rerun_fetches_it(tmp_path, sources, file):
    sources.cut_once.add(url_path(file))
    root = tmp_path / "root"
    (outcome,) = fetch([file], root)
    assert outcome.status == "failed"
    assert outcome.detail.startswith(f"{file.path}: downloading {sources.url}{url_path(file)} failed: ")
    assert leftovers(root) == []
    (outcome,) = fetch([file], root)
    assert outcome.status == "fetched" and digest(root / file.path) == file.sha256
    assert leftovers(root) == sorted({file.path, *(p.as_posix() for p in Path(file.path).parents if p.name)})


def test_a_missing_source_is_named_and_leaves_nothing(tmp_path, sources):
    del sources.files[url_path(WIKI)]
    root = tmp_path / "root"
    (outcome,) = fetch([WIKI], root)
    assert outcome.status == "failed"
    assert f"{WIKI.path}: downloading {sources.url}{url_path(WIKI)} failed: 404 Client Error" in outcome.detail
    assert leftovers(root) == []


def test_an_interrupted_fetch_of_several_files_keeps_what_it_finished(tmp_path, sources):
    sources.cut_once.add(url_path(WIKI))
    root = tmp_path / "root"
    assert [o.status for o in fetch(ONE_OF_EACH, root)] == ["fetched", "failed", "fetched"]
    assert not (root / STAGING).exists()
    before = len(sources.requests)
    assert [o.status for o in fetch(ONE_OF_EACH, root)] == ["present", "fetched", "present"]
    assert sources.requests[before:] == [url_path(WIKI)]


def test_mirrors_are_copies_of_a_complete_data_folder_read_verbatim(tmp_path, data_root, sources):
    folder = tmp_path / "mirror"
    for f in ONE_OF_EACH:
        (folder / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_root / f.path, folder / f.path)
    base = mirror_base(str(folder))
    assert base.startswith("file://") and source_of(BOOK, base) == f"{base}/{BOOK.path}"
    root = tmp_path / "root"
    assert [o.status for o in fetch(ONE_OF_EACH, root, base)] == ["fetched"] * 3
    assert all(digest(root / f.path) == f.sha256 for f in ONE_OF_EACH) and sources.requests == []
    # over HTTP: the server holding the files themselves under a prefix
    for f in ONE_OF_EACH:
        sources.files[f"/data/{f.path}"] = (data_root / f.path).read_bytes()
    root = tmp_path / "root2"
    assert [o.status for o in fetch(ONE_OF_EACH, root, mirror_base(sources.url + "/data/"))] == ["fetched"] * 3
    assert sorted(sources.requests) == sorted(f"/data/{f.path}" for f in ONE_OF_EACH)


def test_a_wrong_file_in_place_is_reported_and_kept(tmp_path, sources):
    root = tmp_path / "root"
    (root / BOOK.path).parent.mkdir(parents=True)
    (root / BOOK.path).write_text("somebody's own text")
    (outcome,) = fetch([BOOK], root)
    assert outcome.status == "mismatch"
    own = hashlib.sha256("somebody's own text".encode()).hexdigest()
    assert outcome.detail.startswith(f"{root / BOOK.path} has sha256 {own} (19 bytes), expected {BOOK.sha256}")
    assert f"({BOOK.size} bytes); left as it is: remove it to fetch it again" in outcome.detail
    assert (root / BOOK.path).read_text() == "somebody's own text" and sources.requests == []
    assert [o.status for o in verify([SHAKESPEARE, BOOK], root)] == ["missing", "mismatch"]


def test_a_mirror_is_a_url_or_an_existing_folder(tmp_path):
    assert mirror_base("https://example.org/data/") == "https://example.org/data"
    assert mirror_base(str(tmp_path)) == tmp_path.resolve().as_uri()
    with pytest.raises(ValueError, match=r"--mirror 'ftp://x': expected an http\(s\):// or file:// URL"):
        mirror_base("ftp://x")
    with pytest.raises(ValueError, match="or an existing folder"):
        mirror_base(str(tmp_path / "nope"))


def test_missing_files_are_those_of_the_shipped_corpora_the_patterns_name(tmp_path, data_root):
    patterns = ["gutenberg/heldout/*.txt", "lambada", "my/own/*.txt", "/abs/file.txt", "s3://b/x.txt"]
    heldout = [f for f in FILES.values() if f.path.startswith("gutenberg/heldout/")]
    lambada = FILES["lambada/lambada_openai_test.jsonl"]
    assert missing_files(patterns, tmp_path) == [*heldout, lambada]
    assert missing_files([*patterns, "lambada/*.jsonl"], tmp_path) == [*heldout, lambada]  # each once
    assert missing_files(patterns, data_root) == []


def test_a_runs_set_up_fetches_what_is_missing_or_says_in_one_error_what_from_where_and_how(tmp_path, sources):
    root, said = tmp_path / "root", []
    patterns = [SHAKESPEARE.path, "wikitext-2/wiki.test.raw"]
    assert fetch_for_run(patterns, root, said.append) is None
    assert said == [f"data: 2 file(s) the config reads are not under the data root {root}; fetching them from "
                    "their public sources (make data)", "data: 2 file(s) fetched and checked"]
    said.clear()
    assert fetch_for_run(patterns, root, said.append) is None and said == []  # all there: silent, no request
    # Offline: nothing answers where the sources are.
    sources.httpd.shutdown()
    sources.httpd.server_close()
    root = tmp_path / "offline"
    error = fetch_for_run([BOOK.path, *patterns], root, said.append)
    host = sources.url.split("//")[1]
    assert error.startswith(f"3 file(s) the config reads are not under the data root {root} and could not be "
                            f"fetched from {host}: {BOOK.path}, {SHAKESPEARE.path}, {WIKI.path}. The first "
                            f"failure: {BOOK.path}: downloading {sources.url}{url_path(BOOK)} failed: ")
    assert error.endswith("Fetch them with `make data` once the network is reachable, or from a copy of a complete "
                          "data folder with `make data MIRROR=URL_OR_DIR`; or point data.data_root (or "
                          "$CONDUIT_DATA_ROOT) at a folder that holds them")
    assert leftovers(root) == []


def test_the_source_formats_written_here_are_those_of_the_real_sources(data_root):
    """What the server plays: a PG e-book's markers and a CRLF join of the WikiText rows (4,358 of them)."""
    raw = in_source_format(BOOK, (data_root / BOOK.path).read_bytes()).decode("utf-8")
    assert "\r\n*** START OF THE PROJECT GUTENBERG EBOOK LEGEND OF SLEEPY HOLLOW ***\r\n" in raw
    assert "\r\n*** END OF THE PROJECT GUTENBERG EBOOK LEGEND OF SLEEPY HOLLOW ***\r\n" in raw
    rows = in_source_format(WIKI, (data_root / WIKI.path).read_bytes()).decode("utf-8").replace("\r\n", "\n")
    assert rows.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is an English film")
    assert rows.count("\n\n") >= 4357

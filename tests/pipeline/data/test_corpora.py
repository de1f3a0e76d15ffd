"""The table of shipped corpora (``pipeline.data.corpora``) against what it describes: the files the
shipped configs read, the real files of the shared data folder, and the hint a missing file's error
gives."""

from __future__ import annotations

import glob
import hashlib
import re
from pathlib import Path

from pipeline.config import REPO_ROOT, load_config
from pipeline.data.corpora import CORPORA, GITHUB_RAW, corpus_for, data_root_hint, default_data_root
from pipeline.data.fetch import builder
from tests.corpus_sources import in_source_format

FILES = {f.path: f for c in CORPORA for f in c.files}


def read_by_shipped_configs(data_root: Path) -> set[str]:
    """Every file under ``data_root`` that some ``configs/*.yaml`` reads, defaults included."""
    found: set[str] = set()
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        e = cfg.eval
        for pattern in [*cfg.data.train_paths, *e.heldout_paths, e.wikitext_path, e.lambada_path]:
            if pattern is None:
                continue
            matches = glob.glob(str(data_root / pattern), recursive=True)
            assert matches, f"{path.name}: {pattern!r} matches nothing under {data_root}"
            found |= {Path(m).relative_to(data_root).as_posix() for m in matches}
    return found


def test_the_table_lists_exactly_what_the_shipped_configs_read(data_root):
    assert set(FILES) == read_by_shipped_configs(data_root)
    assert len(FILES) == sum(len(c.files) for c in CORPORA)  # no file in two corpora


def test_sizes_and_checksums_are_those_of_the_shared_files(data_root):
    for path, f in FILES.items():
        data = (data_root / path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f.size, f.sha256), path


def test_every_source_is_pinned_to_a_commit_and_says_what_it_is():
    pinned = re.compile(r"^https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/\S+$")
    for c in CORPORA:
        assert all(pinned.match(f.source.url(GITHUB_RAW)) for f in c.files), c.name
        assert c.title and c.licence and c.read_by, c.name
    assert {c.name: {f.source.build for f in c.files} for c in CORPORA} == {
        "tinyshakespeare": {"verbatim"}, "gutenberg-train": {"gutenberg"}, "gutenberg-heldout": {"gutenberg"},
        "wikitext-2": {"wikitext_rows"}, "lambada": {"verbatim"}}


def test_every_shipped_file_comes_back_from_its_source_format(data_root):
    """Each file, written in its source's format (a PG e-book around it, the WikiText rows joined), is
    rebuilt into its own bytes: the cleaning gives a clean book back unchanged, whatever book it is."""
    for path, f in FILES.items():
        clean = (data_root / path).read_bytes()
        build = builder(f)
        assert (build(in_source_format(f, clean)) if build else in_source_format(f, clean)) == clean, path


def test_patterns_find_their_corpus():
    assert corpus_for("tinyshakespeare/input.txt").name == "tinyshakespeare"
    assert corpus_for("gutenberg/train/*.txt").name == "gutenberg-train"
    assert corpus_for("gutenberg/heldout/pg00046_a_christmas_carol.txt").name == "gutenberg-heldout"
    assert corpus_for("lambada").name == "lambada"  # a folder
    assert corpus_for("my/own/*.txt") is None


def test_the_hint_says_where_the_root_is_how_to_set_it_and_how_to_fill_it(tmp_path):
    own = data_root_hint("my/own/*.txt", tmp_path)
    assert own.startswith(f"; the data root is {tmp_path} (set it with data.data_root or $CONDUIT_DATA_ROOT")
    assert "`make data` fetches the corpora the shipped configs read (README.md, \"Data\")" in own
    for shipped in ("lambada/lambada_openai_test.jsonl", "wikitext-2/wiki.test.raw", "gutenberg/train/*.txt"):
        assert "`make data` fetches it from its public source and checks its sha256" in data_root_hint(
            shipped, tmp_path)
    # An absolute path or a URI does not lie under the data root: nothing to say about it.
    assert data_root_hint(str(tmp_path / "x.txt"), tmp_path) == ""
    assert data_root_hint("s3://bucket/x/*.txt", tmp_path) == ""


def test_the_default_root_follows_the_environment_as_the_config_does(tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUIT_DATA_ROOT", str(tmp_path))
    assert default_data_root() == tmp_path.resolve() == load_config(None).data_root()
    monkeypatch.delenv("CONDUIT_DATA_ROOT")
    assert default_data_root() == load_config(None).data_root()

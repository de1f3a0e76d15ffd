"""``python -m jobs.fetch_data`` (``make data``): what it fetches, skips and reports, and its exit codes.
Its mirror is a folder here; nothing reaches the network (the files it is asked for without a mirror
have no public URL, or it only verifies)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from jobs.fetch_data import main
from pipeline.config import REPO_ROOT
from pipeline.data.corpora import CORPORA

HELDOUT = next(c for c in CORPORA if c.name == "gutenberg-heldout")  # 5 files, 1.4 MB


def test_fetches_from_a_folder_mirror_then_skips_then_verifies(tmp_path, data_root, capsys):
    mirror, root = tmp_path / "mirror", tmp_path / "root"
    for f in HELDOUT.files:
        (mirror / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_root / f.path, mirror / f.path)
    args = ["--root", str(root), "--mirror", str(mirror), "--only", "gutenberg-heldout"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out == f"data root: {root.resolve()}; mirror: {mirror.resolve().as_uri()}\ngutenberg-heldout: 5 fetched\n"
    assert main(args) == 0
    assert "gutenberg-heldout: 5 present" in capsys.readouterr().out
    assert main(["--root", str(root), "--verify", "--only", "gutenberg-heldout"]) == 0


def test_says_what_it_cannot_fetch_and_how_and_exits_1(tmp_path, capsys):
    assert main(["--root", str(tmp_path), "--only", "gutenberg-heldout", "wikitext-2"]) == 1
    out, err = capsys.readouterr()
    assert "gutenberg-heldout: 5 no source\n  no public copy: Project Gutenberg e-books cleaned" in out
    assert "wikitext-2: 1 no source\n  no public copy: no public repository holds wiki.test.raw verbatim" in out
    assert "make data MIRROR=URL_OR_DIR (python -m jobs.fetch_data --mirror URL_OR_DIR)" in out
    assert err == "error: 6 file(s) not in place with their checksum (above)\n"
    assert list(tmp_path.iterdir()) == []


def test_verify_downloads_nothing_and_names_what_is_missing(tmp_path, capsys):
    assert main(["--root", str(tmp_path), "--verify", "--only", "lambada"]) == 1
    out = capsys.readouterr().out
    assert f"lambada: 1 missing\n  missing: {tmp_path / 'lambada/lambada_openai_test.jsonl'} is missing\n" in out
    assert list(tmp_path.iterdir()) == []


def test_the_default_root_is_the_runs_and_the_shared_files_verify(data_root, monkeypatch, capsys):
    monkeypatch.setenv("CONDUIT_DATA_ROOT", str(data_root))
    assert main(["--verify", "--only", "tinyshakespeare", "lambada"]) == 0
    assert capsys.readouterr().out.startswith(f"data root: {data_root.resolve()}\ntinyshakespeare: 1 present\n")


def test_bad_arguments_exit_2(tmp_path, capsys):
    for args in (["--mirror", str(tmp_path / "nope")], ["--only", "wikitext-103"]):
        with pytest.raises(SystemExit) as e:
            main(["--root", str(tmp_path), *args])
        assert e.value.code == 2
    assert "invalid choice: 'wikitext-103'" in capsys.readouterr().err


def test_make_data_runs_it_with_the_root_and_mirror_given():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under make test
    out = subprocess.run(["make", "-n", "--no-print-directory", "data", "DATA_ROOT=/d", "MIRROR=https://m/data",
                          "ARGS=--verify"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True).stdout
    command = '/bin/python -m jobs.fetch_data --root "/d" --mirror "https://m/data" --verify'
    assert out.splitlines()[-1].endswith(command)

"""``python -m jobs.fetch_data`` (``make data``): what it fetches, skips and reports, and its exit codes.
Its mirror is a folder here, its public sources a local server (tests/corpus_sources.py); nothing reaches
the network."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from jobs.fetch_data import main
from pipeline.config import REPO_ROOT
from pipeline.data.corpora import CORPORA, GITHUB_RAW_ENV
from tests.corpus_sources import SourceServer

HELDOUT = next(c for c in CORPORA if c.name == "gutenberg-heldout")  # 5 files, 1.4 MB
LAMBADA = next(c for c in CORPORA if c.name == "lambada")


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


def test_fetches_what_a_config_reads_from_the_public_sources_and_names_each_failure(tmp_path, data_root,
                                                                                    monkeypatch, capsys):
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    lambada = next(f for f in LAMBADA.files)
    with SourceServer() as server:
        server.serve(lambada, (data_root / lambada.path).read_bytes())  # the held-out books' sources are missing
        monkeypatch.setenv(GITHUB_RAW_ENV, server.url)
        config = tmp_path / "c.yaml"
        config.write_text("eval: {wikitext_path: null}\n")  # reads tiny-shakespeare, the held-out books, LAMBADA
        assert main(["--root", str(tmp_path / "root"), "--config", str(config)]) == 1
    out, err = capsys.readouterr()
    assert "tinyshakespeare: 1 failed\n  failed: tinyshakespeare/input.txt: downloading " in out
    assert "gutenberg-heldout: 5 failed\n" in out and "lambada: 1 fetched\n" in out
    assert "wikitext-2" not in out and "gutenberg-train" not in out
    assert f"404 Client Error: Not Found for url: {server.url}/RU-ECE/ECE451-Parallel/" in out
    assert err == "error: 6 file(s) not in place with their checksum (above)\n"
    assert [p.name for p in (tmp_path / "root").rglob("*") if p.is_file()] == ["lambada_openai_test.jsonl"]


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
    for args in (["--mirror", str(tmp_path / "nope")], ["--only", "wikitext-103"],
                 ["--only", "lambada", "--config", "configs/demo.yaml"]):
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

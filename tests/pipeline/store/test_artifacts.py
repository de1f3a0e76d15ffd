from __future__ import annotations

import json
import os
import threading

import pytest

from pipeline.store.artifacts import (
    MANIFEST, Artifact, content_hash, is_complete, prepare_dir, remove_unsealed, write_json_atomic, write_manifest,
)
from pipeline.config import load_config
from pipeline.runner import make_plan, resolve


def plan_hashes(*overrides, tmp_path):
    cfg = resolve(load_config(None, [f"run.workdir={tmp_path}", *overrides]))
    return {p.stage: p.hash for p in make_plan(cfg)}


def test_hash_is_deterministic_and_input_sensitive():
    h = content_hash("train", 1, {"a": 1, "b": [1, 2]}, {"tokenize": "abc"})
    assert h == content_hash("train", 1, {"b": [1, 2], "a": 1}, {"tokenize": "abc"})  # key order is irrelevant
    assert len(h) == 16 and int(h, 16) >= 0
    assert h != content_hash("train", 2, {"a": 1, "b": [1, 2]}, {"tokenize": "abc"})  # code version
    assert h != content_hash("train", 1, {"a": 2, "b": [1, 2]}, {"tokenize": "abc"})  # config
    assert h != content_hash("train", 1, {"a": 1, "b": [1, 2]}, {"tokenize": "abd"})  # input
    assert h != content_hash("evaluate", 1, {"a": 1, "b": [1, 2]}, {"tokenize": "abc"})  # stage


def test_plan_hashes_follow_the_fields_that_matter(tmp_path):
    base = plan_hashes(tmp_path=tmp_path)
    assert base == plan_hashes(tmp_path=tmp_path)
    # A training field changes train and everything downstream, nothing upstream.
    more_steps = plan_hashes("train.steps=21", tmp_path=tmp_path)
    assert [s for s in base if base[s] != more_steps[s]] == ["train", "evaluate", "register"]
    # A tokenizer field changes the tokenizer and everything after it.
    vocab = plan_hashes("tokenizer.vocab_size=600", tmp_path=tmp_path)
    assert [s for s in base if base[s] != vocab[s]] == ["tokenizer", "tokenize", "train", "evaluate", "register"]
    # Logging-only fields change nothing.
    assert plan_hashes("train.log_every=7", "train.progress_bar=false", "tokenizer.num_threads=1",
                       tmp_path=tmp_path) == base
    # Where the run writes is not what it computes... except for the registry it writes into.
    moved = plan_hashes(f"run.workdir={tmp_path / 'other'}", f"tracking.uri=sqlite:///{tmp_path}/x.db",
                        tmp_path=tmp_path)
    assert [s for s in base if base[s] != moved[s]] == ["register"]


def test_shard_hash_follows_input_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo")
    args = (f"data.data_root={tmp_path}", "data.train_paths=[a.txt]")
    before = plan_hashes(*args, tmp_path=tmp_path)["shard"]
    (tmp_path / "a.txt").write_text("one\n\ntwo\n\nthree")
    assert plan_hashes(*args, tmp_path=tmp_path)["shard"] != before


def test_manifest_written_last_and_atomically(tmp_path):
    out = tmp_path / "stage" / "h"
    prepare_dir(out)
    assert not is_complete(out)
    (out / "data.bin").write_bytes(b"x")
    art = write_manifest(out, stage="stage", hash_="h", stage_config={"k": 1}, run_config={}, inputs={},
                         counts={"n": 1}, started_at=0.0)
    assert is_complete(out)
    assert Artifact.load(out) == art
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temp file left
    with pytest.raises(FileExistsError):
        prepare_dir(out)  # a sealed artifact is never overwritten by accident


def test_unsealed_folder_is_cleared(tmp_path):
    out = tmp_path / "s" / "h"
    out.mkdir(parents=True)
    (out / "partial.bin").write_bytes(b"half")
    prepare_dir(out)
    assert list(out.iterdir()) == []


def test_clearing_an_unsealed_folder_never_follows_a_symlink_out_of_the_root(tmp_path):
    root, outside = tmp_path / "artifacts", tmp_path / "home"
    (outside / "docs").mkdir(parents=True)
    (outside / "docs" / "thesis.txt").write_text("precious")
    out = root / "train" / "h1"
    out.mkdir(parents=True)
    (out / "partial.bin").write_bytes(b"half")
    (out / "link_dir").symlink_to(outside / "docs")  # a link inside the folder: removed as a link
    (out / "link_file").symlink_to(outside / "docs" / "thesis.txt")
    prepare_dir(out)
    assert list(out.iterdir()) == [] and (outside / "docs" / "thesis.txt").read_text() == "precious"
    (root / "tokenize").symlink_to(outside)  # the stage folder leads out of the root
    with pytest.raises(ValueError, match="refusing to clear .*docs: it is a symlink or leads out of the artifact"):
        prepare_dir(root / "tokenize" / "docs")  # shutil.rmtree alone would have deleted outside/docs
    with pytest.raises(ValueError, match=f"out of the artifact root {root}"):
        remove_unsealed(root / "tokenize" / "docs", root)  # what the runner calls with the configured root
    (root / "shard").mkdir()
    (root / "shard" / "h2").symlink_to(outside / "docs")  # the artifact folder itself is a link
    with pytest.raises(ValueError, match="h2: it is a symlink"):
        prepare_dir(root / "shard" / "h2")
    assert (outside / "docs" / "thesis.txt").read_text() == "precious"


def test_readers_never_see_a_partial_manifest(tmp_path):
    path = tmp_path / MANIFEST
    big = {"rows": list(range(20000))}
    seen_partial = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            if path.exists():
                try:
                    json.loads(path.read_text())
                except json.JSONDecodeError:
                    seen_partial.append(True)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(30):
        write_json_atomic(path, {**big, "i": i})
    stop.set()
    t.join()
    assert seen_partial == []
    assert json.loads(path.read_text())["i"] == 29
    assert sorted(os.listdir(tmp_path)) == [MANIFEST]

"""The shard and tokenize stages on a real local Ray (the session ``ray_cluster``): reading inputs in
parallel Ray tasks and tokenizing with Ray Data and an actor pool give exactly the files that the
in-process paths give."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.runner import make_plan, resolve
from pipeline.stage_io import shard_files
from pipeline.stages import STAGES, shard, tokenize
from pipeline.text import BOS_ID, EOS_ID, load_sentencepiece


class NullTracker:
    def log_metrics(self, m, step=None):
        pass


def run_stages(cfg, names, arts=None):
    cfg = resolve(cfg)
    plan = {p.stage: p for p in make_plan(cfg)}
    arts = dict(arts or {})
    for name in names:
        arts[name] = STAGES[name].execute(cfg, plan[name].hash, plan[name].path, arts, NullTracker())
    return arts


def split_files(path, split):
    return np.load(path / f"{split}.tokens.npy"), np.load(path / f"{split}.docs.npy")


@pytest.mark.slow
def test_ray_paths_write_what_local_paths_write(tmp_path, data_root, ray_cluster, monkeypatch):
    overrides = [f"data.data_root={data_root}",
                 "data.train_paths=[tinyshakespeare/input.txt, 'multilingual/udhr/[d-f]*.txt']",
                 "data.test_fraction=0.05", "data.num_shards=3", "tokenize.seq_len=64", "tokenize.add_bos=true",
                 "tokenize.batch_size=64", "tokenize.num_actors=2", "tokenizer.vocab_size=600",
                 "tokenize.engine=ray_data"]
    on_ray = run_stages(load_config(None, [f"run.workdir={tmp_path / 'ray'}", *overrides]),
                        ["shard", "tokenizer", "tokenize"])
    monkeypatch.setattr(shard, "ray_running", lambda: False)
    monkeypatch.setattr(tokenize, "ray_running", lambda: False)
    local_shard = run_stages(load_config(None, [f"run.workdir={tmp_path / 'local'}", *overrides]), ["shard"])
    # The tokenizer is shared, so any difference below comes from tokenize alone.
    local = run_stages(load_config(None, [f"run.workdir={tmp_path / 'local'}", *overrides]), ["tokenize"],
                       {**local_shard, "tokenizer": on_ray["tokenizer"]})

    # Shard: with Ray, documents go from the read tasks to a writer task per shard (the stage's own
    # process sees only ids and sizes); the files hold what the in-process path writes, shard by shard.
    for split in ("train", "validation", "test"):
        ray_files, local_files = (shard_files(a["shard"].path, split) for a in (on_ray, local_shard))
        assert [f.name for f in ray_files] == [f.name for f in local_files]
        assert len(ray_files) == (3 if split == "train" else 1)
        for a, b in zip(ray_files, local_files):
            assert pq.read_table(a).equals(pq.read_table(b)), a.name
    assert on_ray["shard"].manifest["counts"] == local_shard["shard"].manifest["counts"]
    # What the stage's own process receives per input: ids and sizes; the documents stay in the object store.
    cfg = resolve(load_config(None, [f"run.workdir={tmp_path / 'ray'}", *overrides]))
    monkeypatch.setattr(shard, "ray_running", lambda: True)
    keys, stats, table = next(shard._read_all(shard.resolve_inputs(cfg), cfg))
    assert isinstance(table, ray_cluster.ObjectRef) and set(keys) == {"doc_id", "bytes"}
    assert len(keys["doc_id"]) == stats["documents"] - sum(stats["removed"].values())
    assert on_ray["tokenize"].manifest["counts"]["engine"] == "ray_data"
    assert local["tokenize"].manifest["counts"]["engine"] == "local"
    index = json.loads((on_ray["tokenize"].path / "index.json").read_text())
    assert index == json.loads((local["tokenize"].path / "index.json").read_text())
    assert set(index["splits"]) == {"train", "validation", "test"}
    sp = load_sentencepiece(str(on_ray["tokenizer"].path / "tokenizer.model"))
    for split in index["splits"]:
        tokens, docs = split_files(on_ray["tokenize"].path, split)
        local_tokens, local_docs = split_files(local["tokenize"].path, split)
        assert np.array_equal(tokens, local_tokens) and np.array_equal(docs, local_docs)
        # The stream decodes back to the split's documents in shard order: BOS text EOS, ...
        texts = shard.read_texts(on_ray["shard"].path, split)
        stream, doc_of = tokens.reshape(-1), docs.reshape(-1)
        n_full = int(doc_of[-1])  # documents wholly inside the kept blocks: 0 .. n_full-1
        for i in range(n_full):
            piece = stream[doc_of == i].tolist()
            assert piece[0] == BOS_ID and piece[-1] == EOS_ID
            assert sp.decode(piece[1:-1]) == texts[i]
        s = index["splits"][split]
        assert s["documents"] == len(texts)
        assert s["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
        assert s["tokens"] + s["dropped_tail_tokens"] == s["tokens_in_documents"] + 2 * s["documents"]


@pytest.mark.slow
def test_bad_input_in_a_ray_read_task_names_the_file(tmp_path, ray_cluster):
    d = tmp_path / "data"
    d.mkdir()
    (d / "good.txt").write_text("\n\n".join(f"document {i}" for i in range(50)))
    (d / "bad.txt").write_bytes(b"fine\n\nstill fine \xc3\x28 broken")
    cfg = load_config(None, [f"run.workdir={tmp_path / 'work'}", f"data.data_root={d}", "data.train_paths=['*.txt']"])
    with pytest.raises(shard.DataError, match=r"^\S*bad\.txt: invalid UTF-8 at byte offset 17 "):
        run_stages(cfg, ["shard"])


def test_auto_engine_takes_ray_data_from_the_configured_size(tmp_path, ray_cluster):
    def engine(n_bytes, *overrides):
        cfg = load_config(None, [f"run.workdir={tmp_path}", *overrides])
        return tokenize.choose_engine(cfg, n_bytes)

    assert engine(10**6) == "local"  # the default threshold is 256 MB
    assert engine(256_000_000) == "ray_data"
    assert engine(999, "tokenize.ray_data_min_bytes=1000") == "local"
    assert engine(1000, "tokenize.ray_data_min_bytes=1000") == "ray_data"
    assert engine(10**12, "tokenize.engine=local") == "local"
    assert engine(1, "tokenize.engine=ray_data") == "ray_data"

"""The shard and tokenize stages on a real local Ray (the session ``ray_cluster``): reading inputs in
parallel Ray tasks and tokenizing in a Ray task per document shard give exactly the files that the
in-process paths give."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.runner import make_plan, resolve
from pipeline.data.token_blocks import TokenBlocks
from pipeline.store.contracts import shard_files, tokens_file
from pipeline.stages import STAGES, shard, tokenize
from pipeline.tokenization.spm import BOS_ID, EOS_ID, load_sentencepiece


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
    """The split's blocks and document indices, every token shard in global order."""
    return tuple(TokenBlocks.of(path, split, kind=kind).head(10**9) for kind in ("tokens", "docs"))


@pytest.mark.slow
def test_ray_paths_write_what_local_paths_write(tmp_path, data_root, ray_cluster, monkeypatch):
    overrides = [f"data.data_root={data_root}",
                 "data.train_paths=[tinyshakespeare/input.txt, 'multilingual/udhr/[d-f]*.txt']",
                 "data.test_fraction=0.05", "data.num_shards=3", "tokenize.seq_len=64", "tokenize.add_bos=true",
                 "tokenize.batch_size=64", "tokenize.num_actors=2", "tokenizer.vocab_size=600",
                 "tokenize.engine=ray"]
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
    assert on_ray["tokenize"].manifest["counts"]["engine"] == "ray"
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
        # One token shard per document shard, plus the shard of the joined tails.
        n_doc_shards = len(shard_files(on_ray["shard"].path, split))
        assert len(index["splits"][split]["shards"]) == n_doc_shards + 1
        assert sorted(p.name for p in on_ray["tokenize"].path.glob(f"{split}.tokens.*.npy")) == [
            tokens_file(split, k) for k, n in enumerate(index["splits"][split]["shards"]) if n]
        # Every document's tokens, gathered in global block order, are BOS text EOS; only the joined
        # tails' remainder is missing, and it is exactly the dropped count.
        texts = shard.read_texts(on_ray["shard"].path, split)
        stream, doc_of = tokens.reshape(-1), docs.reshape(-1)
        missing = 0
        for i, text in enumerate(texts):
            piece = stream[doc_of == i].tolist()
            whole = [BOS_ID, *sp.encode(text), EOS_ID]
            assert piece == whole[: len(piece)]
            missing += len(whole) - len(piece)
        assert missing == index["splits"][split]["dropped_tail_tokens"] < 65
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


def test_auto_engine_takes_ray_from_the_configured_size(tmp_path, ray_cluster):
    def engine(n_bytes, *overrides):
        cfg = load_config(None, [f"run.workdir={tmp_path}", *overrides])
        return tokenize.choose_engine(cfg, n_bytes)

    assert engine(10**6) == "local"  # the default threshold is 256 MB
    assert engine(256_000_000) == "ray"
    assert engine(999, "tokenize.ray_data_min_bytes=1000") == "local"
    assert engine(1000, "tokenize.ray_data_min_bytes=1000") == "ray"
    assert engine(10**12, "tokenize.engine=local") == "local"
    assert engine(1, "tokenize.engine=ray") == "ray"
    assert engine(1, "tokenize.engine=ray_data") == "ray"  # the older name

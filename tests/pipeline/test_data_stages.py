"""shard, tokenizer and tokenize stage bodies on real and hand-made inputs, without Ray."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.runner import make_plan, resolve
from pipeline.stages import execute_stage, shard, tokenize
from pipeline.text import EOS_ID, load_sentencepiece, train_sentencepiece, training_lines


class RecordingTracker:
    """Collects what a stage logs (these tests are about the stage body, not MLflow)."""

    def __init__(self):
        self.metrics = {}

    def log_metrics(self, m, step=None):
        self.metrics.update(m)

    def set_tags(self, tags):
        pass


def run_stages(cfg, names):
    cfg = resolve(cfg)
    plan = {p.stage: p for p in make_plan(cfg)}
    arts = {}
    for name in names:
        p = plan[name]
        arts[name] = execute_stage(name, cfg, p.hash, p.path, arts, RecordingTracker())
    return arts


def cfg_for(tmp_path, data_root, *overrides):
    return load_config(None, [f"run.workdir={tmp_path / 'work'}", f"data.data_root={data_root}", *overrides])


def test_shard_reads_txt_jsonl_parquet_and_counts_everything(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.txt").write_text("alpha doc\n\nbeta doc\n\n\n\nalpha doc\n\n x")
    (d / "b.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": "delta"}) + "\n")
    pq.write_table(pa.table({"text": ["epsilon", "beta doc", None]}), d / "c.parquet")
    cfg = cfg_for(tmp_path, d, "data.train_paths=[a.txt, '*.jsonl', c.parquet]", "data.min_doc_chars=2",
                  "data.validation_fraction=0.4", "data.num_shards=3")
    art = run_stages(cfg, ["shard"])["shard"]
    c = art.manifest["counts"]
    assert [i["documents"] for i in c["inputs"]] == [5, 2, 2]  # a.txt: 4 separators -> 5 pieces ("" included)
    assert c["removed"] == {"empty_or_short": 2, "duplicate": 2, "over_max_documents": 0}  # "", " x"; alpha, beta
    assert sum(c["documents"].values()) == 5  # alpha, beta, gamma, delta, epsilon
    texts = shard.read_texts(art.path, "train") + shard.read_texts(art.path, "validation")
    assert sorted(texts) == ["alpha doc", "beta doc", "delta", "epsilon", "gamma"]
    assert len(shard.shard_files(art.path, "train")) == 3
    import hashlib
    assert c["inputs"][0]["sha256"] == hashlib.sha256((d / "a.txt").read_bytes()).hexdigest()


def test_split_is_by_content_not_order(tmp_path):
    docs = [f"document number {i}" for i in range(400)]
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir(), d2.mkdir()
    (d1 / "x.txt").write_text("\n\n".join(docs))
    (d2 / "x.txt").write_text("\n\n".join(reversed(docs)))
    vals = []
    for i, d in enumerate((d1, d2)):
        art = run_stages(cfg_for(tmp_path / str(i), d, "data.train_paths=[x.txt]", "data.validation_fraction=0.1"),
                         ["shard"])["shard"]
        vals.append(sorted(shard.read_texts(art.path, "validation")))
    assert vals[0] == vals[1]
    assert 20 <= len(vals[0]) <= 60  # about 10% of 400


@pytest.mark.parametrize("name,content,pattern", [
    ("bad.txt", b"good\xff\xfebad", r"bad\.txt: invalid UTF-8 at byte offset 4"),
    ("bin.txt", b"abc\x00def", r"bin\.txt: contains NUL bytes \(first at byte offset 3\)"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": oops}\n', r"bad\.jsonl:2: malformed JSON"),
    ("miss.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', r"miss\.jsonl:2: no field 'text'"),
])
def test_bad_input_names_file_and_place(tmp_path, name, content, pattern):
    d = tmp_path / "data"
    d.mkdir()
    (d / name).write_bytes(content)
    with pytest.raises(shard.DataError, match=pattern):
        run_stages(cfg_for(tmp_path, d, f"data.train_paths=[{name}]"), ["shard"])


def test_replace_policy_counts_replacements(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    docs = "\n\n".join(f"document {i}" for i in range(40)).encode()
    (d / "bad.txt").write_bytes(docs + b" \xff\xfe end")
    art = run_stages(cfg_for(tmp_path, d, "data.train_paths=[bad.txt]", "data.encoding_errors=replace",
                             "data.validation_fraction=0.3"), ["shard"])["shard"]
    assert art.manifest["counts"]["inputs"][0]["replaced_chars"] == 2


def test_no_match_and_nothing_left_are_clear_errors(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    with pytest.raises(ConfigError, match=r"'nope/\*\.txt' matches no"):
        run_stages(cfg_for(tmp_path, d, "data.train_paths=['nope/*.txt']"), ["shard"])
    (d / "tiny.txt").write_text("a\n\nb")
    with pytest.raises(shard.DataError, match="no (train|validation) documents are left"):
        run_stages(cfg_for(tmp_path, d, "data.train_paths=[tiny.txt]", "data.min_doc_chars=5"), ["shard"])


def test_default_tokenizer_round_trips_every_multilingual_text(tmp_path, data_root):
    ml = data_root / "multilingual"
    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(ml.rglob("*.txt"))}
    with zipfile.ZipFile(next(ml.rglob("udhr2.zip"))) as z:
        for n in z.namelist():
            if n.endswith(".txt"):
                texts[n] = z.read(n).decode("utf-8")
    assert len(texts) > 300
    # A small English-only tokenizer: everything else must survive through byte fallback.
    english = (data_root / "tinyshakespeare" / "input.txt").read_text().split("\n\n")
    model = train_sentencepiece(training_lines(english, 300_000), vocab_size=400, model_type="bpe",
                                character_coverage=1.0, byte_fallback=True, normalization="identity",
                                num_threads=1)
    (tmp_path / "t.model").write_bytes(model)
    sp = load_sentencepiece(str(tmp_path / "t.model"))
    bad = [name for name, text in texts.items() if sp.decode(sp.encode(text)) != text]
    assert bad == []
    edge = "  two  spaces\n\n\n\ttab\r\n trailing  \u00a0nbsp \ufeffbom e\u0301 \U0001f600"
    assert sp.decode(sp.encode(edge)) == edge


def test_pack_puts_eos_between_documents_and_counts_the_tail():
    docs = [[10, 11, 12], [20], [30, 31, 32, 33]]
    tokens, doc_of, dropped = tokenize.pack(docs, seq_len=3, add_bos=False)
    stream = [10, 11, 12, EOS_ID, 20, EOS_ID, 30, 31, 32, 33, EOS_ID]
    assert tokens.tolist() == [stream[0:4], stream[4:8]]
    assert doc_of.tolist() == [[0, 0, 0, 0], [1, 1, 2, 2]]
    assert dropped == 3
    tokens, _, _ = tokenize.pack([[5]], seq_len=2, add_bos=True)
    assert tokens.tolist() == [[2, 5, EOS_ID]]


def test_shard_tokenizer_tokenize_on_tinyshakespeare(tmp_path, data_root):
    cfg = cfg_for(tmp_path, data_root, "data.train_paths=[tinyshakespeare/input.txt]", "tokenize.seq_len=32")
    arts = run_stages(cfg, ["shard", "tokenizer", "tokenize"])
    index = json.loads((arts["tokenize"].path / "index.json").read_text())
    assert index["dtype"] == "uint16"
    sp = load_sentencepiece(str(arts["tokenizer"].path / "tokenizer.model"))
    for split in ("train", "validation"):
        t = np.load(arts["tokenize"].path / f"{split}.tokens.npy")
        s = index["splits"][split]
        assert t.shape == (s["blocks"], 33) and t.dtype == np.uint16
        assert s["tokens"] + s["dropped_tail_tokens"] == s["tokens_in_documents"] + s["documents"]
        # Decoding the packed stream gives back the split's documents, EOS-separated.
        texts = shard.read_texts(arts["shard"].path, split)
        ids = t.reshape(-1).tolist()
        eos = [i for i, x in enumerate(ids) if x == EOS_ID]
        assert sp.decode(ids[: eos[0]]) == texts[0]
        assert sp.decode(ids[eos[0] + 1 : eos[1]]) == texts[1]

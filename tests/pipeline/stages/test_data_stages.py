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
from pipeline.data import packing
from pipeline.data.token_blocks import TokenBlocks
from pipeline.store.contracts import docs_file, tokens_file
from pipeline.stages import STAGES, shard
from pipeline.tokenization.spm import BOS_ID, EOS_ID, load_sentencepiece, train_sentencepiece, training_lines


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
        arts[name] = STAGES[name].execute(cfg, p.hash, p.path, arts, RecordingTracker())
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
    assert [i["documents"] for i in c["inputs"]] == [5, 2, 3]  # a.txt: 4 separators -> 5 pieces ("" included)
    # "" -> empty, " x" -> too_short, parquet None -> null; alpha, beta -> duplicate
    assert c["removed"] == {"null": 1, "empty": 1, "too_short": 1, "too_long": 0, "duplicate": 2,
                            "over_max_documents": 0}
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
    with pytest.raises(ConfigError, match=r"'nope/\*\.txt' matches no") as e:
        run_stages(cfg_for(tmp_path, d, "data.train_paths=['nope/*.txt']"), ["shard"])
    # Where the data root is, how to point it elsewhere and how to fill it (issue #51): for a user whose
    # checkout has no ../shared/data beside it.
    assert f"the data root is {d.resolve()} (set it with data.data_root or $CONDUIT_DATA_ROOT" in str(e.value)
    assert "`make data` fetches the corpora the shipped configs read" in str(e.value)
    with pytest.raises(ConfigError, match=r"'tinyshakespeare/input\.txt' is the shipped corpus 'tinyshakespeare'.*"
                                          r"`make data` fetches it from its public source and checks its sha256"):
        run_stages(cfg_for(tmp_path, d, "data.train_paths=[tinyshakespeare/input.txt]"), ["shard"])
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


def write_blocks(out_dir, docs, seq_len, add_bos):
    """Pack ``docs`` into ``out_dir`` as one document shard, as the tokenize stage does (``segment``,
    ``pack``, ``SplitWriter``).

    Returns:
        (tokens, doc_index, dropped_tail_tokens), read back from the written files.
    """
    out_dir.mkdir()
    dtype = np.dtype(np.uint16)
    writer = packing.SplitWriter(out_dir, "train", seq_len + 1, dtype)
    writer.add(0, packing.pack(*packing.segment(docs, add_bos, dtype), seq_len + 1, 0, dtype))
    shards, dropped = writer.finish()
    read = [np.load(out_dir / name(k)) for k, n in enumerate(shards) if n
            for name in (lambda k: tokens_file("train", k), lambda k: docs_file("train", k))]
    return np.concatenate(read[0::2]), np.concatenate(read[1::2]), dropped


def test_packing_puts_eos_between_documents_and_counts_the_tail(tmp_path):
    docs = [[10, 11, 12], [20], [30, 31, 32, 33]]
    tokens, doc_of, dropped = write_blocks(tmp_path / "a", docs, seq_len=3, add_bos=False)
    stream = [10, 11, 12, EOS_ID, 20, EOS_ID, 30, 31, 32, 33, EOS_ID]
    assert tokens.tolist() == [stream[0:4], stream[4:8]]
    assert doc_of.tolist() == [[0, 0, 0, 0], [1, 1, 2, 2]]
    assert dropped == 3
    tokens, _, _ = write_blocks(tmp_path / "b", [[5]], seq_len=2, add_bos=True)
    assert tokens.tolist() == [[2, 5, EOS_ID]]


def test_shard_tokenizer_tokenize_on_tinyshakespeare(tmp_path, data_root):
    cfg = cfg_for(tmp_path, data_root, "data.train_paths=[tinyshakespeare/input.txt]", "tokenize.seq_len=32")
    arts = run_stages(cfg, ["shard", "tokenizer", "tokenize"])
    index = json.loads((arts["tokenize"].path / "index.json").read_text())
    assert index["dtype"] == "uint16"
    sp = load_sentencepiece(str(arts["tokenizer"].path / "tokenizer.model"))
    for split in ("train", "validation"):
        t = TokenBlocks.of(arts["tokenize"].path, split).head(10**9)
        s = index["splits"][split]
        assert t.shape == (s["blocks"], 33) and t.dtype == np.uint16
        assert s["tokens"] + s["dropped_tail_tokens"] == s["tokens_in_documents"] + s["documents"]
        # Decoding the packed stream gives back the split's documents, EOS-separated.
        texts = shard.read_texts(arts["shard"].path, split)
        ids = t.reshape(-1).tolist()
        eos = [i for i, x in enumerate(ids) if x == EOS_ID]
        assert sp.decode(ids[: eos[0]]) == texts[0]
        assert sp.decode(ids[eos[0] + 1 : eos[1]]) == texts[1]


# ---- issue 4: inputs, cleaning, splits, shard sizes, tokenizer options, streaming packing ----------
def all_texts(art):
    return [t for s in shard.SPLITS for t in shard.read_texts(art.path, s)]


def fillers(n, tag="filler"):
    return [f"{tag} document number {i}" for i in range(n)]


def test_inputs_by_uri_glob_folder_and_saved_datasets(tmp_path):
    import datasets

    from pipeline.data.sources import resolve_inputs

    d = tmp_path / "data"
    (d / "sub" / "deep").mkdir(parents=True)
    (d / "a.txt").write_text("\n\n".join(fillers(30, "txt")))
    (d / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in fillers(10, "jsonl")))
    (d / "sub" / "notes.md").write_text("not an input")
    pq.write_table(pa.table({"text": fillers(5, "parquet")}), d / "sub" / "deep" / "c.parquet")
    datasets.Dataset.from_dict({"text": [*fillers(4, "ds"), None]}).save_to_disk(str(d / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": fillers(3, "ddtrain")}),
                          "extra": datasets.Dataset.from_dict({"text": fillers(2, "ddextra")})}).save_to_disk(str(d / "dd"))
    patterns = [f"file://{d}/a.txt", "**/*.parquet", "sub", "ds", "dd", "a.txt"]
    files = resolve_inputs(patterns, d)
    assert [(f.uri.replace(str(d), "D"), f.kind) for f in files] == [
        ("file://D/a.txt", "txt"), ("D/sub/deep/c.parquet", "parquet"), ("D/sub/b.jsonl", "jsonl"),
        ("D/ds", "datasets"), ("D/dd", "datasets"), ("D/a.txt", "txt"),  # a path and a URI are two inputs
    ]
    with pytest.raises(ConfigError, match=r"notes\.md .*has suffix '\.md'"):
        resolve_inputs(["sub/notes.md"], d)
    cfg = cfg_for(tmp_path, d, "data.train_paths=[" + ", ".join(f"'{p}'" for p in patterns[:5]) + "]",
                  "data.validation_fraction=0.2")
    c = run_stages(cfg, ["shard"])["shard"].manifest["counts"]
    assert [i["documents"] for i in c["inputs"]] == [30, 5, 10, 5, 5]  # dd: "extra" then "train"
    assert c["removed"]["null"] == 1 and c["documents_read"] == 55
    assert sum(c["documents"].values()) == 54
    assert all(len(i["sha256"]) == 64 and i["bytes"] > 0 for i in c["inputs"])


def test_normalisation_control_chars_length_filters_and_dedup_after_cleaning(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    docs = ["cafe\u0301 au lait", "caf\u00e9 au lait", "\ufb01ne print", "bell\x07 and \x1bescape\ttab",
            "x" * 500, "ab", *fillers(60)]
    (d / "x.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = cfg_for(tmp_path, d, "data.train_paths=[x.jsonl]", "data.normalize=nfkc", "data.strip_control_chars=true",
                  "data.min_doc_chars=3", "data.max_doc_chars=400", "data.validation_fraction=0.1")
    art = run_stages(cfg, ["shard"])["shard"]
    c = art.manifest["counts"]
    assert sorted(all_texts(art)) == sorted(["caf\u00e9 au lait", "fine print", "bell and escape\ttab", *fillers(60)])
    assert c["removed"] == {"null": 0, "empty": 0, "too_short": 1, "too_long": 1, "duplicate": 1,
                            "over_max_documents": 0}
    assert c["normalized_changed"] == 2 and c["control_chars_removed"] == 2
    # Without the options the text is kept byte for byte.
    raw = run_stages(cfg_for(tmp_path / "raw", d, "data.train_paths=[x.jsonl]", "data.validation_fraction=0.1"),
                     ["shard"])["shard"]
    assert sorted(all_texts(raw)) == sorted(docs)


def test_test_split_leaves_validation_alone_and_target_shard_bytes(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    docs = [f"document {i} " + "word " * (i % 37) for i in range(600)]
    (d / "x.txt").write_text("\n\n".join(docs))
    base = ["data.train_paths=[x.txt]", "data.validation_fraction=0.1"]
    two = run_stages(cfg_for(tmp_path / "a", d, *base), ["shard"])["shard"]
    three = run_stages(cfg_for(tmp_path / "b", d, *base, "data.test_fraction=0.1", "data.target_shard_bytes=4000"),
                       ["shard"])["shard"]
    assert shard.read_texts(three.path, "validation") == shard.read_texts(two.path, "validation")
    assert shard.shard_files(two.path, "test") == []
    assert 30 <= len(shard.read_texts(three.path, "test")) <= 90
    assert sorted(all_texts(three)) == sorted(docs)
    c = three.manifest["counts"]
    longest = max(len(t.encode()) for t in docs)
    for split in ("train", "validation", "test"):
        shards = c["shards"][split]
        assert len(shards) == -(-c["bytes"][split] // 4000) == len(shard.shard_files(three.path, split))
        assert sum(s["bytes"] for s in shards) == c["bytes"][split]
        sizes = [s["bytes"] for s in shards]
        assert max(sizes) - min(sizes) <= 2 * longest
    # Without a target: data.num_shards train shards (2), one validation shard.
    assert [s["file"] for s in two.manifest["counts"]["shards"]["validation"]] == ["validation-00000.parquet"]
    assert len(shard.shard_files(two.path, "train")) == 2


def test_shard_bounds_are_contiguous_balanced_and_never_empty():
    assert shard.shard_bounds(np.array([5, 5, 5, 5]), 2) == [(0, 2), (2, 4)]
    assert shard.shard_bounds(np.array([100, 1, 1]), 3) == [(0, 1), (1, 2), (2, 3)]
    assert shard.shard_bounds(np.array([1, 1]), 5) == [(0, 1), (1, 2)]
    assert shard.shard_bounds(np.array([3, 1, 1, 1, 1, 1]), 2) == [(0, 2), (2, 6)]  # 4 + 4 bytes


def test_empty_files_nulls_and_wrong_types_are_counted_or_named(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "empty.jsonl").write_bytes(b"")
    (d / "x.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in fillers(40)) + '{"text": null}\n')
    c = run_stages(cfg_for(tmp_path, d, "data.train_paths=['*.txt', '*.jsonl']", "data.validation_fraction=0.2"),
                   ["shard"])["shard"].manifest["counts"]
    assert c["empty_inputs"] == 2 and [i["documents"] for i in c["inputs"]] == [0, 0, 41]
    assert c["removed"]["null"] == 1
    (d / "num.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(shard.DataError, match=r"num\.jsonl:2: field 'text' is int, not a string"):
        run_stages(cfg_for(tmp_path, d, "data.train_paths=[num.jsonl]"), ["shard"])
    pq.write_table(pa.table({"text": [1, 2]}), d / "ints.parquet")
    with pytest.raises(shard.DataError, match=r"ints\.parquet: column 'text' has type int64, not a string"):
        run_stages(cfg_for(tmp_path, d, "data.train_paths=[ints.parquet]"), ["shard"])


@pytest.mark.parametrize("override,pattern", [
    ("data.test_fraction=0.96", r"validation_fraction=0\.05 \+ data\.test_fraction=0\.96 must be < 1"),
    ("data.max_doc_chars=0", r"data\.max_doc_chars=0 must be >="),
    ("data.target_shard_bytes=0", r"data\.target_shard_bytes=0 must be null or >= 1"),
    ("data.normalize=nfd", r"data\.normalize='nfd' is not allowed"),
    ("tokenize.num_actors=0", r"tokenize\.num_actors=0 must be >= 1"),
    ("tokenizer.user_defined_symbols=[a, a]", r"tokenizer\.user_defined_symbols=\['a', 'a'\] must be distinct"),
])
def test_data_config_values_are_checked(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_tokenizer_user_symbols_and_deterministic_sample(tmp_path, data_root):
    cfg = cfg_for(tmp_path, data_root, "data.train_paths=[tinyshakespeare/input.txt]",
                  "tokenizer.max_training_bytes=300000", "tokenizer.user_defined_symbols=['<sep>', 'KING']")
    arts = run_stages(cfg, ["shard", "tokenizer"])
    c = arts["tokenizer"].manifest["counts"]
    train_bytes = arts["shard"].manifest["counts"]["bytes"]["train"]
    assert c["sample_rate"] == pytest.approx(300000 / train_bytes)
    assert c["user_defined_symbols"] == {"<sep>": 5, "KING": 6}
    sp = load_sentencepiece(str(arts["tokenizer"].path / "tokenizer.model"))
    assert 5 in sp.encode("a<sep>b") and 6 in sp.encode("the KING")
    from pipeline.stages.tokenizer import sample_docs

    tally = {"documents": 0, "bytes": 0}
    sampled = list(sample_docs(arts["shard"].path, c["sample_rate"], tally))
    train = shard.read_texts(arts["shard"].path, "train")
    assert 0.7 * 300000 < tally["bytes"] < 1.3 * 300000  # about the cap, drawn from the whole split
    assert set(sampled) <= set(train) and sampled[-1] in train[len(train) // 2 :]


def test_shards_pack_alone_and_their_tails_join_in_shard_order(tmp_path):
    """Each document shard is cut into blocks by itself; the tails join, in shard order, into the last
    shard; only that stream's remainder is dropped. The order shards are added in changes nothing."""
    rng = np.random.default_rng(0)
    dtype, block = np.dtype(np.uint16), 8
    shards = [[rng.integers(5, 300, size=rng.integers(0, 20)).tolist() for _ in range(n)] for n in (13, 0, 7, 21, 2)]
    first = np.cumsum([0] + [len(d) for d in shards])[:-1]
    for order, out in ((range(5), tmp_path / "a"), ((3, 0, 4, 1, 2), tmp_path / "b")):
        out.mkdir()
        writer = packing.SplitWriter(out, "train", block, dtype)
        for k in order:
            writer.add(k, packing.pack(*packing.segment(shards[k], True, dtype), block, int(first[k]), dtype))
        counts, dropped = writer.finish()
        # The rule written out: per shard, BOS ids EOS per document, cut into blocks of 8; the rests joined.
        want_tok, want_doc, rest_tok, rest_doc = [], [], [], []
        for k, docs in enumerate(shards):
            stream = [t for d in docs for t in (BOS_ID, *d, EOS_ID)]
            doc_of = [first[k] + i for i, d in enumerate(docs) for _ in range(len(d) + 2)]
            n = len(stream) // block
            want_tok.append(stream[: n * block])
            want_doc.append(doc_of[: n * block])
            rest_tok += stream[n * block:]
            rest_doc += doc_of[n * block:]
            assert counts[k] == n
        n = len(rest_tok) // block
        want_tok.append(rest_tok[: n * block])
        want_doc.append(rest_doc[: n * block])
        assert counts[-1] == n and dropped == len(rest_tok) - n * block and len(counts) == 6
        assert writer.documents == sum(map(len, shards)) and writer.total == sum(map(len, (*want_tok, rest_tok))) - n * block
        files = sorted(p.name for p in out.iterdir())
        assert files == sorted(f(k) for k, c in enumerate(counts) if c
                               for f in (lambda k: tokens_file("train", k), lambda k: docs_file("train", k)))
        for k, c in enumerate(counts):
            if c:
                assert np.load(out / tokens_file("train", k)).tolist() == np.reshape(want_tok[k], (c, block)).tolist()
                assert np.load(out / docs_file("train", k)).tolist() == np.reshape(want_doc[k], (c, block)).tolist()
    for k in range(6):
        for f in (tokens_file("train", k), docs_file("train", k)):
            assert (tmp_path / "a" / f).exists() == (tmp_path / "b" / f).exists()
            if (tmp_path / "a" / f).exists():
                assert np.array_equal(np.load(tmp_path / "a" / f), np.load(tmp_path / "b" / f))
    with pytest.raises(ValueError, match="the validation split has 3 tokens"):
        w = packing.SplitWriter(tmp_path, "validation", block, dtype)
        w.add(0, packing.pack(*packing.segment([[9, 9]], False, dtype), block, 0, dtype))
        w.finish()


def test_split_long_line_cuts_at_whitespace_and_character_boundaries():
    from pipeline.tokenization.spm import split_long_line

    assert split_long_line("short line", 100) == ["short line"]
    line = "alpha beta gamma delta"
    pieces = split_long_line(line, 12)
    assert "".join(pieces) == line and pieces == ["alpha beta", " gamma delta"]  # 10 and 12 bytes
    wide = "é" * 10 + "\u4e2d" * 5  # 2-byte and 3-byte characters, no whitespace
    pieces = split_long_line(wide, 7)
    assert "".join(pieces) == wide and all(len(p.encode("utf-8")) <= 7 for p in pieces)
    assert all(p for p in pieces)


def test_tokenizer_splits_and_counts_lines_sentencepiece_would_skip(tmp_path):
    from pipeline.tokenization.spm import MAX_SENTENCE_BYTES

    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["river", "stone", "castle", "morning", "silver", "lantern", "harbour", "winter"]
    # 40 documents, each one line of about 3 x MAX_SENTENCE_BYTES: sentencepiece alone skips them all.
    docs = [" ".join(rng.choice(words, size=3 * MAX_SENTENCE_BYTES // 6)) for _ in range(40)]
    assert all(len(doc.encode()) > MAX_SENTENCE_BYTES for doc in docs)
    (d / "long.txt").write_text("\n\n".join(docs))
    cfg = cfg_for(tmp_path, d, "data.train_paths=[long.txt]", "data.validation_fraction=0.1",
                  "tokenizer.vocab_size=400")
    shard_art = run_stages(cfg, ["shard"])["shard"]
    p = {p.stage: p for p in make_plan(resolve(cfg))}["tokenizer"]
    tracker = RecordingTracker()
    art = STAGES["tokenizer"].execute(resolve(cfg), p.hash, p.path, {"shard": shard_art}, tracker)
    c = art.manifest["counts"]
    n_train = shard_art.manifest["counts"]["documents"]["train"]
    assert c["long_lines_split"] == n_train and c["max_sentence_bytes"] == MAX_SENTENCE_BYTES
    assert c["sentences_from_splits"] >= 3 * n_train and c["training_sentences"] == c["sentences_from_splits"]
    assert tracker.metrics["long_lines_split"] == n_train
    assert tracker.metrics["sentences_from_splits"] == c["sentences_from_splits"]
    sp = load_sentencepiece(str(art.path / "tokenizer.model"))
    assert all(len(sp.encode(w)) == 1 for w in words)  # it learned the words of the long lines

"""The exported tokenizer.json encodes every corpus as the sentencepiece model it was built from.

Small BPE and unigram tokenizers are trained here with Conduit's own trainer settings on a slice of
real text (English, French, Japanese, Chinese and some UDHR languages), so they have multi-character
pieces in several scripts and fall back to bytes on rare characters and on the scripts they never
saw. Then every corpus under the data root (each file, each member of ``udhr2.zip``, LAMBADA contexts
one by one, a CRLF copy of two of them, edge cases) is encoded by both, in slices that keep the test
quick. BPE ids must be equal everywhere; unigram ids too, except where sentencepiece's float32 sums
cannot tell two segmentations apart (see ``test_ids_equal_sentencepiece_on_every_corpus``). Decode must equal sentencepiece's. One test
loads the export with ``AutoTokenizer`` in a subprocess where ``sentencepiece`` and ``protobuf``
cannot be imported.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pipeline.tokenization.hf_fast import (TOKENIZER_JSON, UnsupportedTokenizer, build_tokenizer, read_model,
                                    write_hf_tokenizer)
from pipeline.tokenization.spm import load_sentencepiece, train_sentencepiece, training_lines

SLICE_CHARS = 12_000  # from the start and from the middle of each file
UDHR_MEMBER_CHARS = 3_000
LAMBADA_CONTEXTS = 300

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n", " leading space", "  two leading spaces", "\nleading newline",
    "trailing space ", "trailing spaces  \n", "a\n\nb", "runs   of    spaces", "\ttab\tand\t\ttabs",
    "CRLF line\r\nnext line\r\n\r\nafter a blank line", "<unk> <s></s><pad> <0x41> literally",
    "digits 1234567890 3.14", "emoji \U0001F600 and \U0001F469\u200D\U0001F4BB", "e\u0301 combining",
    "\u05e9\u05dc\u05d5\u05dd RTL \u0645\u0631\u062d\u0628\u0627", "\u4e2d\u6587\u3068\u65e5\u672c\u8a9e",
    "\u200c\u200d zero-width", "private use \ue031", "\u2581 the space symbol itself \u2581\u2581",
]


def _slices(text: str) -> list[str]:
    middle = len(text) // 2
    return [text[:SLICE_CHARS], text[middle:middle + SLICE_CHARS]]


def corpus_texts(root: Path) -> dict[str, str]:
    """Name -> text for every corpus under ``root``, in slices, with a CRLF copy of the English ones."""
    texts: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.suffix in (".txt", ".raw", ".tokens"):
            for i, part in enumerate(_slices(path.read_text(encoding="utf-8"))):
                texts[f"{name}[{i}]"] = part
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for i, line in zip(range(LAMBADA_CONTEXTS), f):
                    texts[f"{name}:{i}"] = json.loads(line)["context"]  # the context, the last word's prefix
        elif path.suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                for member in z.namelist():
                    if not member.endswith("/"):
                        texts[f"{name}/{member}"] = z.read(member).decode("utf-8")[:UDHR_MEMBER_CHARS]
    for name in ("tinyshakespeare/input.txt[0]", "wikitext-2/wiki.test.raw[0]"):
        texts[f"{name} CRLF"] = texts[name].replace("\n", "\r\n")
    for i, text in enumerate(EDGE_CASES):
        texts[f"edge case {i}"] = text
    return texts


def _training_text(root: Path) -> list[str]:
    chars = {"gutenberg/train/pg00011_alices_adventures_in_wonderland.txt": 80_000,
             "multilingual/fr_candide.txt": 30_000, "multilingual/ja_wagahaiwa_nekodearu.txt": 6_000,
             "multilingual/zh_hant_tangshi300.txt": 3_000, "multilingual/udhr/rus.txt": 10_000,
             "multilingual/udhr/hin.txt": 10_000, "multilingual/udhr/arb.txt": 10_000}
    return [(root / f).read_text(encoding="utf-8")[:n] for f, n in chars.items()]


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def trained(request, data_root, tmp_path_factory):
    """``(sentencepiece processor, tokenizer.json Tokenizer, model file)`` of a small Conduit tokenizer."""
    folder = tmp_path_factory.mktemp(f"tok_{request.param}")
    model_file = folder / "tokenizer.model"
    model_file.write_bytes(train_sentencepiece(
        training_lines(_training_text(data_root), 10**9), vocab_size=2000, model_type=request.param,
        character_coverage=0.9995, byte_fallback=True, normalization="identity", num_threads=1))
    write_hf_tokenizer(model_file, folder, model_max_length=256)
    return load_sentencepiece(str(model_file)), Tokenizer.from_file(str(folder / TOKENIZER_JSON)), folder


@pytest.fixture(scope="module")
def texts(data_root) -> dict[str, str]:
    return corpus_texts(data_root)


@pytest.fixture(scope="module")
def encoded(trained, texts) -> dict[str, tuple[list[int], list[int]]]:
    """Name -> (sentencepiece's ids, tokenizer.json's ids) of every text."""
    sp, tok, _ = trained
    names = list(texts)
    ours = tok.encode_batch_fast([texts[n] for n in names])
    return {n: (sp.encode(texts[n]), enc.ids) for n, enc in zip(names, ours)}


def test_every_corpus_under_the_data_root_is_covered(texts):
    names = set(texts)
    for expected in ("gutenberg/train/pg00145_middlemarch.txt[1]", "gutenberg/heldout/pg00016_peter_pan.txt[0]",
                     "wikitext-2/wiki.test.raw[1]", "wikitext-2/wiki.test.tokens[0]",
                     "tinystories/validation_head.txt[0]",
                     "lambada/lambada_openai_test.jsonl:299", "multilingual/udhr2.zip/udhr2/heb.txt",
                     "multilingual/zh_hant_guwenguanzhi.txt[0]", "multilingual/udhr/tam.txt[0]"):
        assert expected in names
    assert sum(n.startswith("multilingual/udhr2.zip/") for n in names) > 380


def test_ids_equal_sentencepiece_on_every_corpus(trained, encoded):
    """BPE: equal everywhere. Unigram: equal except where sentencepiece's float32 cannot tell two
    segmentations apart, and there ours is the better one.

    sentencepiece's Viterbi adds the scores of a whole input in float32 (``BestPathNode::
    best_path_score``), ``tokenizers``' port in float64, word by word. Where two paths tie exactly (the
    same pieces reordered: ``▁ ▁▁▁▁ ▁`` and ``▁ ▁ ▁▁▁▁`` in a run of spaces), or differ by less than
    float32's resolution at the running total (which grows with the text before the word: a few
    hundredths on a whole book), rounding picks sentencepiece's. Those texts, and only those, differ:
    the same text, with a total score no lower than sentencepiece's, by at most the rounding bound.
    """
    sp, tok, _ = trained
    different = {n: (theirs, mine) for n, (theirs, mine) in encoded.items() if theirs != mine}
    if type(tok.model).__name__ == "BPE":
        assert list(different) == []
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    for name, (theirs, mine) in different.items():
        total_theirs, total_mine = math.fsum(scores[i] for i in theirs), math.fsum(scores[i] for i in mine)
        assert sp.decode(theirs) == sp.decode(mine), name
        assert 0 <= total_mine - total_theirs <= 2 * len(theirs) * abs(total_theirs) * 2**-24, name
    assert len(different) <= len(encoded) // 100
    # The byte fallback, multi-line text and scripts the tokenizer never saw are all in there.
    all_ids = {i for _, mine in encoded.values() for i in mine}
    assert sp.piece_to_id("<0xE0>") in all_ids and 4 in all_ids


def test_decode_gives_the_text_back(trained, texts, encoded):
    """As sentencepiece's decode does; neither gives back a literal ``▁`` (it is how they write a space)."""
    sp, tok, _ = trained
    names = list(texts)
    decoded = tok.decode_batch([encoded[n][1] for n in names])
    assert [n for n, d in zip(names, decoded) if d != sp.decode(encoded[n][1])] == []
    assert [n for n, d in zip(names, decoded) if d != texts[n]] == [f"edge case {len(EDGE_CASES) - 1}"]


def test_blank_lines_and_leading_spaces_get_no_extra_piece(trained):
    """The Llama conversion's defects: a ``▁`` after a newline, and one leading space too few."""
    sp, tok, _ = trained
    for text in ("first\n\nsecond", "  indented", "\n\n  both"):
        assert tok.encode(text).tokens == sp.encode(text, out_type=str)
    assert sp.encode("a\n\nb", out_type=str)[2:4] == ["\n", "b"]


def test_unsupported_options_are_named(data_root, tmp_path):
    model = train_sentencepiece(training_lines(_training_text(data_root)[:1], 10**9), vocab_size=500,
                                model_type="bpe", character_coverage=1.0, byte_fallback=True,
                                normalization="nmt_nfkc", num_threads=1, user_defined_symbols=["<sep>"])
    (tmp_path / "tokenizer.model").write_bytes(model)
    with pytest.raises(UnsupportedTokenizer, match=r"normalization='nmt_nfkc'.*remove_extra_whitespaces.*'<sep>'"):
        build_tokenizer(read_model(tmp_path / "tokenizer.model"))


CLEAN_ENV_SCRIPT = """
import json, sys
for blocked in ("sentencepiece", "google.protobuf", "tiktoken"):
    sys.modules[blocked] = None  # import raises ImportError; find_spec says not installed
from transformers import AutoTokenizer
try:
    import sentencepiece
except ImportError:
    pass
else:
    raise SystemExit("sentencepiece was importable")
texts = json.loads(open(sys.argv[2], encoding="utf-8").read())
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = [tok(t)["input_ids"] for t in texts]
out = {"ids": ids, "decoded": [tok.decode(i) for i in ids], "bos": tok.bos_token_id, "eos": tok.eos_token_id,
       "pad": tok.pad_token_id,
       "modules": sorted(m for m in ("sentencepiece", "google.protobuf") if sys.modules.get(m))}
print(json.dumps(out))
"""


def test_auto_tokenizer_without_sentencepiece_or_protobuf_gives_sentencepiece_ids(trained, texts, encoded, tmp_path):
    """The ids of tokenizer.json in-process (equal to sentencepiece's but for its float32 ties, above)."""
    sp, _, folder = trained
    assert (folder / "tokenizer.model").is_file()  # beside it, as in the export, and not needed
    chosen = [n for n in texts if n.endswith("[0]") or n.startswith("edge case") or n.endswith("CRLF")]
    chosen += [f"lambada/lambada_openai_test.jsonl:{i}" for i in range(20)]
    sample = [texts[n] for n in chosen]
    (tmp_path / "texts.json").write_text(json.dumps(sample), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CLEAN_ENV_SCRIPT, str(folder), str(tmp_path / "texts.json")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["modules"] == []
    assert [name for name, ids in zip(chosen, got["ids"]) if ids != encoded[name][1]] == []
    ties = {n for n, (theirs, mine) in encoded.items() if theirs != mine}
    assert [name for name, ids in zip(chosen, got["ids"]) if name not in ties and ids != encoded[name][0]] == []
    assert [name for name, ids, back in zip(chosen, got["ids"], got["decoded"]) if back != sp.decode(ids)] == []
    assert (got["pad"], got["bos"], got["eos"]) == (0, 2, 3)


def test_register_exports_the_tokenizer_beside_the_model(trained, tmp_path):
    from models import build_model
    from models.export import save_safetensors
    from pipeline.stages.register import export_hf

    sp, _, folder = trained
    model = build_model("debug_dense", vocab_size=sp.get_piece_size(), max_seq_len=64)
    save_safetensors(model, model.cfg, tmp_path / "model.safetensors")
    out = tmp_path / "hf"
    assert export_hf(tmp_path / "model.safetensors", folder / "tokenizer.model", out) is None
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer.model", "tokenizer_config.json"]
    exported = Tokenizer.from_file(str(out / TOKENIZER_JSON))
    text = "First line.\n\n  Second, after a blank line\r\nand\ttabs."
    assert exported.encode(text).ids == sp.encode(text)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 64


def test_register_does_not_export_what_it_cannot_reproduce(data_root, tmp_path):
    from models import build_model
    from models.export import save_safetensors
    from pipeline.stages.register import export_hf

    (tmp_path / "tokenizer.model").write_bytes(train_sentencepiece(
        training_lines(_training_text(data_root)[:1], 10**9), vocab_size=500, model_type="unigram",
        character_coverage=1.0, byte_fallback=True, normalization="nfkc", num_threads=1))
    model = build_model("debug_dense", vocab_size=500, max_seq_len=64)
    save_safetensors(model, model.cfg, tmp_path / "model.safetensors")
    note = export_hf(tmp_path / "model.safetensors", tmp_path / "tokenizer.model", tmp_path / "hf")
    assert note is not None and "normalization='nfkc'" in note
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_without_byte_fallback_a_run_of_unknown_characters_is_one_unk(model_type, data_root, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(train_sentencepiece(
        training_lines([(data_root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:100_000]], 10**9),
        vocab_size=400, model_type=model_type, character_coverage=1.0, byte_fallback=False,
        normalization="identity", num_threads=1))
    sp = load_sentencepiece(str(tmp_path / "tokenizer.model"))
    tok = build_tokenizer(read_model(tmp_path / "tokenizer.model"))
    texts = [*EDGE_CASES, (data_root / "multilingual" / "udhr" / "jpn.txt").read_text(encoding="utf-8")[:3000]]
    assert [t for t in texts if tok.encode(t).ids != sp.encode(t)] == []
    assert tok.encode("ab \u4e16\u754c\u4e16 x").ids.count(1) == 1

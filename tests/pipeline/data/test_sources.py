"""shard inputs read through ``datasets.load_dataset`` (csv, json, text, parquet builders) and from S3
(a moto server), each compared with what the same files give when read locally by Conduit's readers."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import REPO_ROOT, ConfigError, load_config
from pipeline.data.sources import resolve_inputs
from pipeline.stages import shard
from tests.pipeline.stages.test_data_stages import cfg_for, run_stages

TRICKY = ['hello, "quoted" world', "multi\nline\n\nparagraph", "NA", "null", "", "007", "  leading spaces",
          "ünïcödé 日本語 — «»", "tab\tinside"]


def lambada(data_root: Path, n: int) -> list[str]:
    with open(data_root / "lambada" / "lambada_openai_test.jsonl", encoding="utf-8") as f:
        return [json.loads(next(f))["context"] for _ in range(n)]


def split_texts(art) -> dict[str, list[str]]:
    return {s: shard.read_texts(art.path, s) for s in shard.SPLITS}


def comparable(counts: dict) -> dict:
    """A manifest's counts without what names the input (its URI) or the reader."""
    inputs = [{k: v for k, v in i.items() if k not in ("uri", "builder")} for i in counts["inputs"]]
    return {**counts, "inputs": inputs}


def test_csv_through_datasets_gives_the_documents_of_the_file_in_order(tmp_path, data_root):
    docs = lambada(data_root, 300) + TRICKY
    d = tmp_path / "data"
    d.mkdir()
    with open(d / "x.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "body", "other"])
        w.writerows([i, t, "-"] for i, t in enumerate(docs))
    with open(d / "x.csv", encoding="utf-8", newline="") as f:
        assert [r["body"] for r in csv.DictReader(f)] == docs  # the file holds exactly these documents
    (d / "x.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in docs), encoding="utf-8")
    base = ["data.text_field=body", "data.validation_fraction=0.2", "data.num_shards=3"]
    via_csv = run_stages(cfg_for(tmp_path / "csv", d, "data.train_paths=[x.csv]", *base), ["shard"])["shard"]
    native = run_stages(cfg_for(tmp_path / "jsonl", d, "data.train_paths=[x.jsonl]", *base), ["shard"])["shard"]
    assert split_texts(via_csv) == split_texts(native)
    c, n = via_csv.manifest["counts"], native.manifest["counts"]
    assert c["removed"] == n["removed"] and c["removed"]["empty"] == 1
    assert c["documents"] == n["documents"] and c["shards"] == n["shards"]
    raw = (d / "x.csv").read_bytes()
    assert c["inputs"] == [{
        "uri": str(d / "x.csv"), "kind": "csv", "builder": "csv", "replaced_chars": 0, "bom_removed": 0,
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(), "empty_file": False, "documents": len(docs),
        "skipped": {"malformed_json": 0, "missing_field": 0, "not_a_string": 0, "invalid_utf8": 0, "nul_bytes": 0},
        **{k: v for k, v in n["inputs"][0].items() if k in ("removed", "normalized_changed", "control_chars_removed")},
    }]


def test_csv_cells_are_read_as_written(tmp_path):
    from pipeline.data.fs import InputFile
    from pipeline.data.readers import read_input

    numbers = ["007", "1e3", "3.10", "-0", "12"]  # pandas would read this column as floats
    words = ["NA", "", "NaN", "null", "x"]  # and these as nulls
    (tmp_path / "x.csv").write_text("n,w\n" + "".join(f"{n},{w}\n" for n, w in zip(numbers, words)))
    for column, cells in (("n", numbers), ("w", words)):
        docs, stats = read_input(InputFile(str(tmp_path / "x.csv"), "csv", 0, 0), column, None, "error")
        assert docs == cells and stats["documents"] == 5 and stats["builder"] == "csv"


@pytest.mark.parametrize("separator", [r'"\n\n"', r'"\n"', "null"])  # YAML: paragraphs, lines, whole files
def test_reader_datasets_matches_the_native_readers(tmp_path, data_root, separator):
    d = tmp_path / "data"
    d.mkdir()
    udhr = data_root / "multilingual" / "udhr"
    for name in ("eng.txt", "jpn.txt", "rus.txt"):  # no final newline
        shutil.copy(udhr / name, d / name)
    shutil.copy(data_root / "tinystories" / "validation_head.txt", d / "stories.txt")
    # empty paragraphs at the start, in the middle (\n\n\n\n) and after a final newline
    (d / "blank.txt").write_text("\n\nfirst para\n\n\n\nsecond\nline\n\n\n\n\n\nthird\n\n")
    (d / "x.jsonl").write_text("".join(json.dumps({"context": t}) + "\n" for t in lambada(data_root, 200)))
    pq.write_table(pa.table({"context": [*TRICKY, None, *lambada(data_root, 50)]}), d / "x.parquet")
    base = ["data.train_paths=['*.txt', x.jsonl, x.parquet]", "data.text_field=context",
            f"data.separator={separator}", "data.validation_fraction=0.1", "data.test_fraction=0.1"]
    arts = {r: run_stages(cfg_for(tmp_path / r, d, *base, f"data.reader={r}"), ["shard"])["shard"]
            for r in ("native", "datasets")}
    assert split_texts(arts["datasets"]) == split_texts(arts["native"])
    c, n = arts["datasets"].manifest["counts"], arts["native"].manifest["counts"]
    assert comparable(c) == comparable(n)
    assert [i["builder"] for i in c["inputs"]] == ["text"] * 5 + ["json", "parquet"]
    assert [i["builder"] for i in n["inputs"]] == [None] * 7
    assert n["removed"]["empty"] > 0  # the builder's skipped empty pieces are counted, as natively


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
def test_crlf_cr_and_a_byte_order_mark_give_the_documents_of_the_lf_file_through_either_reader(tmp_path, newline):
    from pipeline.data.fs import InputFile
    from pipeline.data.readers import read_input

    paragraphs = "first para\nstill first\n\nsecond\n\n\n\nthird, after an empty one\n"
    records = "".join(json.dumps({"text": t}) + "\n" for t in ("one", "two lines\nin JSON", "three"))
    lf, crlf = tmp_path / "lf", tmp_path / "other"
    lf.mkdir()
    crlf.mkdir()
    for name, body in (("p.txt", paragraphs), ("r.jsonl", records)):
        (lf / name).write_bytes(body.encode("utf-8"))
        (crlf / name).write_bytes(b"\xef\xbb\xbf" + body.replace("\n", newline).encode("utf-8"))
    for kind, name in (("txt", "p.txt"), ("jsonl", "r.jsonl")):
        for reader in ("native", "datasets"):
            want, want_stats = read_input(InputFile(str(lf / name), kind, 0, 0), "text", "\n\n", "error", reader)
            got, stats = read_input(InputFile(str(crlf / name), kind, 0, 0), "text", "\n\n", "error", reader)
            assert got == want, (kind, reader)
            assert stats["bom_removed"] == 1 and want_stats["bom_removed"] == 0
            assert not any("\ufeff" in d or "\r" in d for d in got if d)
    assert read_input(InputFile(str(lf / "p.txt"), "txt", 0, 0), "text", "\n\n", "error")[0] == [
        "first para\nstill first", "second", "", "third, after an empty one\n"]


def test_json_arrays_and_saved_datasets_inside_folders(tmp_path):
    import datasets

    d = tmp_path / "data"
    (d / "f").mkdir(parents=True)
    records = [{"text": f"record {i}", "n": i} for i in range(40)] + [{"n": -1}]  # the last has no text
    (d / "f" / "z.json").write_text(json.dumps(records))
    (d / "f" / "a.csv").write_text("text\n" + "".join(f"row {i}\n" for i in range(30)))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [f"saved {i}" for i in range(5)]})}) \
        .save_to_disk(str(d / "f" / "saved"))
    files = resolve_inputs(["f"], d)
    assert [(f.uri.replace(str(d), "D"), f.kind) for f in files] == [
        ("D/f/a.csv", "csv"), ("D/f/saved", "datasets"), ("D/f/z.json", "json")]  # not saved/*.json
    art = run_stages(cfg_for(tmp_path, d, "data.train_paths=[f]", "data.validation_fraction=0.2"), ["shard"])["shard"]
    c = art.manifest["counts"]
    assert [i["documents"] for i in c["inputs"]] == [30, 5, 41]
    assert c["removed"]["null"] == 1
    texts = [t for s in shard.SPLITS for t in shard.read_texts(art.path, s)]
    assert sorted(texts) == sorted([f"row {i}" for i in range(30)] + [f"saved {i}" for i in range(5)]
                                   + [f"record {i}" for i in range(40)])


@pytest.mark.parametrize("name,content,overrides,pattern", [
    ("x.csv", b"id,body\n1,a\n", [], r"x\.csv: no column 'text' \(columns: \['id', 'body'\]; set data\.text_field\)"),
    ("x.json", b'[{"text": "a"}]', ["data.text_field=body"], r"x\.json: no column 'body'"),
    ("bad.csv", b'text\n"unterminated\n', [], r"bad\.csv: datasets' 'csv' builder cannot read it: .*EOF inside string"),
    ("bad.json", b'{"text": "a"}\n{"text": oops}\n', [], r"bad\.json: datasets' 'json' builder cannot read it"),
    ("mixed.json", b'[{"text": "a"}, {"text": 5}]', [], r"mixed\.json: column 'text' is read by datasets as Json"),
    ("utf.csv", b"text\nab\xffc\n", [], r"utf\.csv: invalid UTF-8 at byte offset 7"),
    ("nul.csv", b"text\na\x00b\n", [], r"nul\.csv: contains NUL bytes \(first at byte offset 6\)"),
    ("ints.parquet", None, ["data.reader=datasets"],
     r"ints\.parquet: column 'text' is read by datasets as Value\('int64'\)"),
])
def test_datasets_read_errors_name_the_file_and_field(tmp_path, name, content, overrides, pattern):
    d = tmp_path / "data"
    d.mkdir()
    if content is None:
        pq.write_table(pa.table({"text": [1, 2]}), d / name)
    else:
        (d / name).write_bytes(content)
    with pytest.raises(shard.DataError, match=pattern):
        run_stages(cfg_for(tmp_path, d, f"data.train_paths=[{name}]", *overrides), ["shard"])


def test_replace_policy_through_datasets_counts_replacements(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "x.csv").write_bytes(b"text\n" + "".join(f"row {i}\n" for i in range(40)).encode() + b"bad \xff\xfe end\n")
    art = run_stages(cfg_for(tmp_path, d, "data.train_paths=[x.csv]", "data.encoding_errors=replace",
                             "data.validation_fraction=0.3"), ["shard"])["shard"]
    c = art.manifest["counts"]
    assert c["inputs"][0]["replaced_chars"] == 2 and c["inputs"][0]["documents"] == 41
    assert c["inputs"][0]["sha256"] == hashlib.sha256((d / "x.csv").read_bytes()).hexdigest()  # of the file
    assert "bad \ufffd\ufffd end" in [t for s in shard.SPLITS for t in shard.read_texts(art.path, s)]


def test_datasets_cache_is_temporary_and_stays_out_of_home(tmp_path):
    home, tmp, data = tmp_path / "home", tmp_path / "tmp", tmp_path / "data"
    for p in (home, tmp, data):
        p.mkdir()
    (data / "x.csv").write_text("text\na\nb\n")
    (data / "x.txt").write_text("one\n\ntwo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_"))}
    env.update(HOME=str(home), TMPDIR=str(tmp), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    code = (
        "import sys\n"
        "from pipeline.data.fs import InputFile\n"
        "from pipeline.data.readers import read_input\n"
        "for name, kind in [('x.csv', 'csv'), ('x.txt', 'txt')]:\n"
        "    src = InputFile(sys.argv[1] + '/' + name, kind, 0, 0)\n"
        "    docs, _ = read_input(src, 'text', '\\n\\n', 'error', 'datasets')\n"
        "    print(docs)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(data)], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['a', 'b']", "['one', 'two']"]
    assert [p for p in home.rglob("*")] == [] and [p for p in tmp.rglob("*")] == []


@pytest.mark.parametrize("override,pattern", [
    ("data.reader=arrow", r"data\.reader='arrow' is not allowed"),
    ("data.separator='---'", r"data\.separator='---' with data\.reader=datasets: the text builder splits"),
    ("data.train_paths=['s3://AKIAX:s3cret@bucket/x.txt']", r"data\.train_paths\[0\] has credentials in its URI"),
])
def test_reader_and_uri_config_checks(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(None, ["data.reader=datasets", override] if "separator" in override else [override])
    assert "s3cret" not in str(e.value)


# ---- S3 through pyarrow's S3FileSystem, against moto -----------------------------------------------
@pytest.fixture
def s3_corpus(moto_s3, data_root, tmp_path, monkeypatch):
    """Corpus files in bucket ``corpus`` under ``books/`` on the moto server and the same files in a local
    folder; credentials in the environment, where pyarrow reads them."""
    import boto3

    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "conduit-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "conduit-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # The reads run in this process: a Ray started earlier in the session would not see this environment.
    monkeypatch.setattr(shard, "ray_running", lambda: False)
    local = tmp_path / "local"
    local.mkdir()
    for src, name in [("multilingual/udhr/eng.txt", "eng.txt"), ("multilingual/udhr/jpn.txt", "jpn.txt"),
                      ("multilingual/fr_candide.txt", "candide.txt"),
                      ("tinystories/validation_head.txt", "stories.txt")]:
        shutil.copy(data_root / src, local / name)
    with open(local / "lambada.csv", "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([["text"], *([t] for t in lambada(data_root, 200))])
    client = boto3.client("s3", endpoint_url=f"http://{moto_s3}", region_name="us-east-1")
    client.create_bucket(Bucket="corpus")
    for p in sorted(local.iterdir()):
        client.upload_file(str(p), "corpus", f"books/{p.name}")
    client.put_object(Bucket="corpus", Key="books/deep/extra.txt", Body=b"only ** reaches this")
    client.put_object(Bucket="corpus", Key="books/notes.md", Body=b"not an input")
    return local


def test_s3_glob_shards_exactly_what_the_local_files_shard(tmp_path, moto_s3, s3_corpus):
    query = f"?endpoint_override={moto_s3}&scheme=http"
    patterns = [f"s3://corpus/books/*.txt{query}", f"s3://corpus/books/*.csv{query}"]
    base = ["data.validation_fraction=0.1", "data.test_fraction=0.05", "data.num_shards=3"]
    paths = "data.train_paths=[" + ", ".join(f"'{p}'" for p in patterns) + "]"
    remote = run_stages(cfg_for(tmp_path / "s3", s3_corpus, paths, *base), ["shard"])["shard"]
    local = run_stages(cfg_for(tmp_path / "local", s3_corpus, "data.train_paths=['*.txt', '*.csv']", *base),
                       ["shard"])["shard"]
    assert split_texts(remote) == split_texts(local)
    r, lc = remote.manifest["counts"], local.manifest["counts"]
    assert comparable(r) == comparable(lc)
    names = ["candide.txt", "eng.txt", "jpn.txt", "stories.txt", "lambada.csv"]
    assert [i["uri"] for i in r["inputs"]] == [f"s3://corpus/books/{n}{query}" for n in names]
    assert [i["sha256"] for i in r["inputs"]] == [hashlib.sha256((s3_corpus / n).read_bytes()).hexdigest()
                                                  for n in names]
    assert [i["bytes"] for i in r["inputs"]] == [(s3_corpus / n).stat().st_size for n in names]
    sources = pq.read_table(shard.shard_files(remote.path, "train")[0], columns=["source"]).column(0).to_pylist()
    assert set(sources) <= {i["uri"] for i in r["inputs"]}


def test_s3_endpoint_from_the_environment_and_recursive_globs(moto_s3, s3_corpus, monkeypatch):
    from pipeline.data.readers import read_input

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{moto_s3}")
    files = resolve_inputs(["s3://corpus/books/**/*.txt"], s3_corpus)
    assert [f.uri for f in files] == [f"s3://corpus/books/{n}" for n in
                                      ("candide.txt", "deep/extra.txt", "eng.txt", "jpn.txt", "stories.txt")]
    docs, stats = read_input(files[1], "text", None, "error")
    assert docs == ["only ** reaches this"] and stats["bytes"] == 20
    with pytest.raises(ConfigError, match=r"'s3://corpus/nope/\*\.txt' matches no"):
        resolve_inputs(["s3://corpus/nope/*.txt"], s3_corpus)

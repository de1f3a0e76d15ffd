"""Evaluate, register, promote and serve against a real MLflow server (tests/jobs/conftest.py), plus
the pure promotion gates and the served model's error mapping."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import requests
import torch
from mlflow.exceptions import MlflowException

from jobs import promote
from pipeline import tracking
from pipeline.serving import promotion, pyfunc
from pipeline.config import ConfigError, PromoteSection, load_config
from pipeline.evaluation.references import GPT2_117M
from pipeline.inference.generator import TextGenerator
from tests.jobs.conftest import MODEL_NAME, _artifact
from tests.servers import ROOT, free_port, listening_addresses, start_process, stop_tree, wait_http

ORIGINAL_KEYS = ("val_loss", "val_perplexity", "val_bits_per_byte", "unigram_val_loss", "unigram_bits_per_byte")


# ---- pure: gates, config, the served model's error mapping ----------------------------------------
def test_gates_pass_without_champion_and_check_margin_and_not_lower():
    section = PromoteSection(min_improvement=0.05, not_lower=["lambada_accuracy"])
    cand = {"heldout_bits_per_byte": 2.0, "lambada_accuracy": 0.10}
    assert all(r.passed and r.detail == "no champion yet" for r in promotion.check_gates(section, cand, None))
    good = promotion.check_gates(section, cand, {"heldout_bits_per_byte": 2.06, "lambada_accuracy": 0.10})
    assert [r.passed for r in good] == [True, True]
    within_margin = promotion.check_gates(section, cand, {"heldout_bits_per_byte": 2.04, "lambada_accuracy": 0.11})
    assert [r.passed for r in within_margin] == [False, False]
    assert within_margin[0].detail == "needs <= 1.99"


def test_missing_metrics_fail_their_gate_by_name_and_bad_margin_raises():
    section = PromoteSection()
    res = promotion.check_gates(section, {"heldout_bits_per_byte": 1.0}, {"heldout_bits_per_byte": 2.0})
    assert not res[1].passed and res[1].detail == "the candidate has no metric 'lambada_accuracy'"
    res = promotion.check_gates(section, {"heldout_bits_per_byte": 1.0, "lambada_accuracy": 0.1},
                                {"lambada_accuracy": 0.1})
    assert not res[0].passed and "champion has no metric 'heldout_bits_per_byte'" in res[0].detail
    with pytest.raises(ValueError, match="promote.min_improvement=-1.0"):
        promotion.check_gates(PromoteSection(min_improvement=-1.0), {}, None)
    with pytest.raises(ValueError, match=r"metric.val_loss='abc' is not a number"):
        promotion.metrics_from_tags({"metric.val_loss": "abc"})


def test_comparison_table_and_promotion_tags():
    section = PromoteSection(min_improvement=0.1)
    cand, champ = {"heldout_bits_per_byte": 2.0, "lambada_accuracy": 0.0, "val_bits_per_byte": 2.5}, \
        {"heldout_bits_per_byte": 2.05, "lambada_accuracy": 0.0, "val_bits_per_byte": 2.6}
    results = promotion.check_gates(section, cand, champ)
    table = promotion.comparison_table(3, 2, results, cand, champ)
    assert "candidate v3" in table and "champion v2" in table
    assert "heldout_bits_per_byte <= champion - 0.1" in table and "FAIL (needs <= 1.95)" in table
    assert "val_bits_per_byte" in table and "info" in table
    tags = promotion.promotion_tags("champion", who="ann", when="t", previous=2, forced=True, reason="r",
                                    results=results)
    assert tags["promotion.champion.previous_version"] == "2" and tags["promotion.champion.reason"] == "r"
    assert tags["promotion.champion.forced"] == "true" and "FAIL" in tags["promotion.champion.gates"]


def test_promote_section_loads_from_yaml_and_rejects_unknown_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("promote:\n  min_improvement: 0.02\n  not_lower: [lambada_accuracy, word_order_gap]\n")
    cfg = load_config(f)
    assert cfg.promote.min_improvement == 0.02 and cfg.promote.not_lower[1] == "word_order_gap"
    f.write_text("promote:\n  min_improvment: 0.02\n")
    with pytest.raises(ConfigError, match="did you mean 'min_improvement'"):
        load_config(f)


def test_served_model_turns_prompt_errors_into_invalid_parameter_value():
    from models import build_model

    lm = pyfunc.ConduitLM()
    model = build_model("debug_dense", max_seq_len=16)

    class Chars:  # a stand-in tokenizer: one token per character; it records what it was asked to encode
        encoded: list[str] = []

        def encode(self, s):
            self.encoded.append(s)
            return [5 + ord(c) % 100 for c in s]

        def decode(self, ids):
            return "x" * len(ids)

        def get_piece_size(self):
            return 105

        def id_to_piece(self, i):
            return "<ctl>" if i < 5 else "<0x00>" if i == 104 else chr(i)

        def is_control(self, i):
            return i < 5

        def is_byte(self, i):  # byte fallback: no token stands for a run of unknown characters
            return i == 104

        def is_unknown(self, i):
            return False

    lm._generator = TextGenerator(model, Chars())
    assert lm._generator.max_prompt_chars == 16  # one character per piece, 16 tokens of context
    assert lm.predict(None, pd.DataFrame({"prompt": ["hi"]}), {"max_new_tokens": 2})["text"].tolist() == ["xx"]
    for bad, params, match in [
        (pd.DataFrame({"text": ["hi"]}), None, "needs a 'prompt' column"),
        (pd.DataFrame({"prompt": [3]}), None, "prompt 0 must be a string"),
        (pd.DataFrame({"prompt": ["a" * 15]}), None, "prompt 0 is 15 tokens; the model's context is 16 tokens"),
        (pd.DataFrame({"prompt": ["hi", "a" * 10**6]}), None, "prompt 1 is 1000000 characters; the model's context "
                                                            "is 16 tokens, which hold at most 16 characters"),
        (pd.DataFrame({"prompt": ["hi"] * 65}), None, "at most 64 prompts per request; got 65"),
        (pd.DataFrame({"prompt": ["hi"]}), {"temperature": -1.0}, "temperature=-1.0 must be 0 (greedy) or in"),
        (pd.DataFrame({"prompt": ["hi"]}), {"temperature": float("nan")}, "temperature must be a finite number"),
        (pd.DataFrame({"prompt": ["hi"]}), {"temperature": 1e-300}, "temperature=1e-300 must be 0 (greedy)"),
        (pd.DataFrame({"prompt": ["hi"]}), {"top_p": float("-inf")}, "top_p must be a finite number"),
        (pd.DataFrame({"prompt": ["hi"]}), {"max_new_tokens": 2.5}, "max_new_tokens must be an integer; got 2.5"),
    ]:
        Chars.encoded.clear()
        with pytest.raises(MlflowException, match=re.escape(match)) as e:
            lm.predict(None, bad, params)
        assert e.value.error_code == "INVALID_PARAMETER_VALUE" and e.value.get_http_status_code() == 400
        assert all(len(s) <= 16 for s in Chars.encoded)  # a prompt longer than the context is never tokenized

    class NoByteFallback(Chars):
        def is_byte(self, i):
            return False

    assert TextGenerator(model, NoByteFallback()).max_prompt_chars is None  # one <unk> may be any run of text


# ---- against the server ---------------------------------------------------------------------------
def _metrics(art):
    return json.loads((art.path / "metrics.json").read_text())


@pytest.mark.slow
def test_evaluate_writes_benchmarks_references_and_pictures(tiny_run):
    data = _metrics(tiny_run.arts["evaluate"])
    m = data["metrics"]
    for k in (*ORIGINAL_KEYS, "heldout_bits_per_byte", "heldout_perplexity", "wikitext2_bits_per_byte",
              "wikitext2_word_perplexity", "lambada_accuracy", "lambada_perplexity", "word_order_gap"):
        assert math.isfinite(m[k]), (k, m.get(k))
    # Better than a uniform guess over the vocabulary on text it never saw, at the same tokens/byte.
    for prefix in ("heldout", "wikitext2"):
        uniform_bpb = math.log2(512) * m[f"{prefix}_tokens"] / m[f"{prefix}_bytes"]
        assert 0 < m[f"{prefix}_bits_per_byte"] < uniform_bpb, m
    assert 0 <= m["lambada_accuracy"] <= 1 and m["lambada_examples"] == 64 and m["lambada_perplexity"] > 1
    # A model that learned anything about order does much worse when each sequence is shuffled.
    assert m["shuffled_loss"] > m["word_order_loss"] + 0.3, m
    refs = data["references"]["gpt2_117m"]
    assert dict(zip(refs["metric"], refs["gpt2_117m"])) == GPT2_117M
    assert "GPT-2 117M" in data["references"]["text"]
    run_id = tiny_run.run_ids["evaluate/a"]
    c = tracking.client(tiny_run.uri)
    files = {f.path for f in c.list_artifacts(run_id)} | {f.path for f in c.list_artifacts(run_id, "plots")}
    assert {"metrics.json", "samples.json", "references.json", "plots/attention_heatmaps.png"} <= files
    assert c.get_run(run_id).data.metrics["heldout_bits_per_byte"] == pytest.approx(m["heldout_bits_per_byte"])


@pytest.mark.slow
def test_register_tags_description_signature_and_hf_export(tiny_run, tmp_path):
    mv = tracking.get_version(tiny_run.uri, MODEL_NAME, 1)
    m = _metrics(tiny_run.arts["evaluate"])["metrics"]
    assert mv.tags["conduit.data_hash"] == "tokenize-test" and len(mv.tags["conduit.config_hash"]) == 16
    assert mv.tags["conduit.code_version"] and mv.tags["conduit.hf_export"] == "artifacts/hf"
    assert float(mv.tags["metric.heldout_bits_per_byte"]) == m["heldout_bits_per_byte"]  # full precision
    desc = tracking.client(tiny_run.uri).get_model_version(MODEL_NAME, "1").description
    assert "held-out Gutenberg bits/byte" in desc and "LAMBADA accuracy" in desc
    local = tracking.download_model(tiny_run.uri, f"models:/{MODEL_NAME}/1", tmp_path)
    mlmodel = (local / "MLmodel").read_text()
    assert '"name": "prompt"' in mlmodel and '"name": "max_new_tokens"' in mlmodel and "top_p" in mlmodel
    assert "torch==" in (local / "requirements.txt").read_text()
    # models from code: the version is Conduit's code, loaded by name from its own copy; nothing pickled
    assert "loader_module: mlflow.pyfunc.loaders.code_model" in mlmodel and (local / "model_code.py").is_file()
    assert not [p.name for p in local.rglob("*.pkl")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    loaded = subprocess.run([sys.executable, "-c", "import sys, mlflow, pandas as pd\n"
                             f"m = mlflow.pyfunc.load_model({str(local)!r})\n"
                             "print(sys.modules['pipeline.serving.pyfunc'].__file__)\n"
                             "print(m.predict(pd.DataFrame({'prompt': ['KING:']}), params={'max_new_tokens': 3})"
                             "['text'][0] != '')"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == [str(local / "code" / "pipeline" / "serving" / "pyfunc.py"), "True"], loaded.stdout
    assert json.loads((local / "artifacts" / "metrics.json").read_text())["metrics"] == m

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(local / "artifacts" / "hf").eval()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, tiny_run.model(ids).logits, atol=1e-4, rtol=0)
    tok = AutoTokenizer.from_pretrained(local / "artifacts" / "hf")
    text = "The old man said that the king was dead.\n\n  KING:\nNot so, my lord.\n"
    assert tok(text)["input_ids"] == tiny_run.sp.encode(text) and tok.decode(tiny_run.sp.encode(text)) == text


def _register_with(tiny_run, label: str, **changes) -> int:
    """Register the same weights again with some metrics changed; returns the new version."""
    data = _metrics(tiny_run.arts["evaluate"])
    data["metrics"].update(changes)
    folder = tiny_run.work / "fake_evaluate" / label
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(data))
    art = tiny_run.stage("register", {**tiny_run.arts, "evaluate": _artifact("evaluate", folder, {})},
                         tiny_run.work / "register" / label)
    return art.manifest["counts"]["version"]


@pytest.mark.slow
def test_promotion_gates_force_and_idempotence(tiny_run, tmp_path, capsys):
    uri = tiny_run.uri
    gates = tmp_path / "gates.yaml"
    gates.write_text("promote:\n  min_improvement: 0.05\n  not_lower: [lambada_accuracy]\n")
    args = [MODEL_NAME, "--tracking-uri", uri, "--config", str(gates)]
    base = _metrics(tiny_run.arts["evaluate"])["metrics"]

    assert promote.main(args) == 0  # v1, no champion yet
    assert tracking.model_aliases(uri, MODEL_NAME)["champion"] == 1
    v1 = tracking.get_version(uri, MODEL_NAME, 1).tags
    assert v1["promotion.champion.previous_version"] == "none" and v1["promotion.champion.forced"] == "false"
    assert v1["promotion.champion.by"] and v1["promotion.champion.at"]
    capsys.readouterr()
    assert promote.main(args) == 0  # twice: nothing changes
    assert "already holds @champion; nothing changed" in capsys.readouterr().out
    assert tracking.get_version(uri, MODEL_NAME, 1).tags == v1

    v2 = _register_with(tiny_run, "better", heldout_bits_per_byte=base["heldout_bits_per_byte"] - 0.1)
    assert promote.main(args) == 0
    assert tracking.model_aliases(uri, MODEL_NAME) == {"champion": v2, "challenger": v2}
    assert tracking.get_version(uri, MODEL_NAME, v2).tags["promotion.champion.previous_version"] == "1"
    assert tracking.get_version(uri, MODEL_NAME, 1).tags["promotion.champion.replaced_by"] == str(v2)

    v3 = _register_with(tiny_run, "marginal", heldout_bits_per_byte=base["heldout_bits_per_byte"] - 0.11,
                        lambada_accuracy=base["lambada_accuracy"] - 0.01)
    capsys.readouterr()
    assert promote.main(args) == 1
    out, err = capsys.readouterr()
    assert "heldout_bits_per_byte <= champion - 0.05" in out and "lambada_accuracy >= champion" in out
    assert out.count("FAIL") == 2 and f"candidate v{v3}" in out and f"champion v{v2}" in out
    assert "refused" in err and tracking.model_aliases(uri, MODEL_NAME)["champion"] == v2
    assert not any(k.startswith("promotion.") for k in tracking.get_version(uri, MODEL_NAME, v3).tags)

    assert promote.main([*args, "--force"]) == 2  # a forced promotion needs a reason
    assert promote.main([*args, "--force", "--reason", "demo needs the newer tokenizer"]) == 0
    tags = tracking.get_version(uri, MODEL_NAME, v3).tags
    assert tags["promotion.champion.reason"] == "demo needs the newer tokenizer"
    assert tags["promotion.champion.forced"] == "true" and tags["promotion.champion.previous_version"] == str(v2)
    assert tracking.model_aliases(uri, MODEL_NAME)["champion"] == v3

    # The command line, as a user runs it: v1 is worse than the champion, so it is refused.
    cli = subprocess.run([sys.executable, "-m", "jobs.promote", MODEL_NAME, "--version", "1", "--tracking-uri", uri,
                          "--config", str(gates)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1, cli.stderr
    assert "candidate v1" in cli.stdout and "refused" in cli.stderr
    missing = subprocess.run([sys.executable, "-m", "jobs.promote", "no-such-model", "--tracking-uri", uri],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no registered model 'no-such-model'" in missing.stderr


@pytest.mark.slow
def test_serve_answers_prompts_and_rejects_bad_requests(tiny_run, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_process([sys.executable, "-m", "jobs.serve", f"{MODEL_NAME}@challenger", "--port", str(port),
                          "--tracking-uri", tiny_run.uri], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/ping", proc, log, timeout=300)
        assert listening_addresses(port) == {"127.0.0.1"}  # jobs.serve's default --host: loopback only

        def post(payload, **kw):  # json.dumps writes NaN as JSON's NaN literal (requests' json= refuses)
            return requests.post(f"{url}/invocations", timeout=60, **kw, **({} if "data" in kw else {
                "data": json.dumps(payload), "headers": {"Content-Type": "application/json"}}))

        good = {"dataframe_split": {"columns": ["prompt"], "data": [["KING:"], ["The old man said"]]},
                "params": {"max_new_tokens": 6, "temperature": 0.0}}
        r = post(good)
        assert r.status_code == 200, r.text
        texts = [row["text"] for row in r.json()["predictions"]]
        assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
        bad = [
            ({"dataframe_split": {"columns": ["text"], "data": [["hi"]]}}, "prompt"),
            ({"dataframe_split": {"columns": ["prompt"], "data": [[42]]}}, "prompt"),
            ({"dataframe_split": {"columns": ["prompt"], "data": [["to be or not " * 40]]}}, "context is 64 tokens"),
            ({**good, "params": {"temperature": -1.0}}, "temperature=-1.0 must be 0 (greedy)"),
            ({**good, "params": {"temperature": float("nan")}}, "temperature must be a finite number"),
            ({**good, "params": {"temperature": 1e-30}}, "temperature=1e-30 must be 0 (greedy)"),
            ({**good, "params": {"top_p": -0.5}}, "top_p=-0.5 must be in (0.0, 1.0]"),
            ({**good, "params": {"top_p": 1.5}}, "top_p=1.5 must be in (0.0, 1.0]"),
            ({**good, "params": {"top_p": float("nan")}}, "top_p must be a finite number"),
            ({**good, "params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
            ({"dataframe_split": {"columns": ["prompt"], "data": [["KING:"]] * 65}}, "at most 64 prompts"),
            ({"dataframe_split": {"columns": ["prompt"], "data": [["x" * 200_000]]}}, "200000 characters"),
        ]
        for payload, needle in bad:
            r = post(payload)
            assert r.status_code == 400, (payload, r.status_code, r.text)
            assert needle in r.json()["message"], r.text
        r = post(None, data="not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert post(good).status_code == 200  # still serving
        assert requests.get(f"{url}/ping", timeout=10).status_code == 200
    finally:
        stop_tree(proc)
    assert proc.poll() is not None


@pytest.mark.slow
def test_serve_refuses_an_unknown_alias(tiny_run):
    out = subprocess.run([sys.executable, "-m", "jobs.serve", f"{MODEL_NAME}@nope", "--port", str(free_port()),
                          "--tracking-uri", tiny_run.uri], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"model '{MODEL_NAME}' has no alias 'nope'" in out.stderr

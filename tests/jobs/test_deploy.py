"""jobs.deploy on real Ray Serve (the session's Ray), a real MLflow server and real HTTP: the OpenAI API
with the openai client, batching, and promotion / rollback rolling the deployment with no failed
request. One deployment is shared by the module's tests, in file order; the last takes it down."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from jobs import deploy as deploy_cli, promote
from pipeline import tracking
from pipeline.serving import deploy
from tests.jobs.client_load import steady_requests
from tests.jobs.lm_eval_check import assert_scored_as_hf_export
from tests.jobs.test_promote_serve import _register_with
from tests.servers import free_port, listening_addresses

pytestmark = pytest.mark.slow
MODEL_NAME = "conduit-test-deploy"  # this module's registered model (tests/jobs/conftest.py: tiny_run)


def _register_better(tiny_run, label: str) -> int:
    """The same weights registered again with a better held-out metric (passes the default gates)."""
    base = json.loads((tiny_run.arts["evaluate"].path / "metrics.json").read_text())["metrics"]
    return _register_with(tiny_run, label, heldout_bits_per_byte=base["heldout_bits_per_byte"] - 0.5)


@pytest.fixture(scope="module")
def served(tiny_run, ray_cluster):
    """v1 promoted to champion and deployed with jobs.deploy; yields the OpenAI base URL."""
    uri = tiny_run.uri
    assert promote.main([MODEL_NAME, "--tracking-uri", uri]) == 0
    port = free_port()
    assert deploy_cli.main([f"{MODEL_NAME}@champion", "--tracking-uri", uri, "--port", str(port),
                            "--replicas", "1", "--cpus", "1"]) == 0
    yield f"http://127.0.0.1:{port}/v1"
    from ray import serve

    deploy_cli.main([MODEL_NAME, "--down", "--tracking-uri", uri])  # if a test failed before test_down
    serve.shutdown()  # the session's Ray goes on without Serve's controller and proxy


def _complete(base: str, **body) -> requests.Response:
    return requests.post(f"{base}/completions", json={"model": MODEL_NAME, **body}, timeout=60)


def test_deploy_serves_the_champion_and_records_it_on_the_version(served, tiny_run):
    r = requests.get(f"{served}/models", timeout=30)
    assert r.status_code == 200 and r.headers["x-conduit-version"] == "1"
    assert r.json()["data"][0]["id"] == MODEL_NAME and r.json()["data"][0]["conduit_version"] == 1
    tags = tracking.get_version(tiny_run.uri, MODEL_NAME, 1).tags
    assert tags["deploy.status"] == "running" and tags["deploy.endpoint"] == served
    assert tags["deploy.alias"] == "champion" and tags["deploy.app"] == f"conduit-{MODEL_NAME}"
    assert json.loads(tags["deploy.settings"])["num_replicas"] == 1 and tags["deploy.ray_address"]
    # deploy.engine auto: on CPU replicas, Conduit's engine at this width (benchmarks/RESULTS.md, serve_vllm; the
    # choice on GPU replicas and engine vllm's refusal of head size 16: tests/jobs/test_deploy_start.py)
    assert tags["deploy.engine"] == "conduit"
    assert tags["deploy.engine_reason"] == ("auto: on CPU replicas Conduit's engine answers faster than vLLM below "
                                            "hidden size 768 (LlamaForCausalLM of hidden size 64 here): "
                                            "benchmarks/RESULTS.md, serve_vllm")
    assert deploy.app_status(MODEL_NAME) == "RUNNING"
    # deploy.host's default: Ray Serve's HTTP proxy bound to loopback only
    assert listening_addresses(int(served.split(":")[2].split("/")[0])) == {"127.0.0.1"}


def test_openai_client_completions_streaming_and_models(served):
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    out = client.completions.create(model=MODEL_NAME, prompt=["KING:", "The old man said"], max_tokens=8,
                                    temperature=0.0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text and out.choices[0].text  # greedy: n copies
    assert 0 < out.usage.completion_tokens <= 32 and out.usage.prompt_tokens > 0
    assert out.model_extra["conduit_version"] == 1
    seeded = [client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=12, temperature=1.0,
                                        top_p=0.9, seed=seed).choices[0].text for seed in (7, 7, 8, 9)]
    assert seeded[0] == seeded[1]  # a seed gives the same sample again
    greedy = client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=12, temperature=0.0).choices[0].text
    assert len(set(seeded[1:])) > 1 and set(seeded) != {greedy}, (seeded, greedy)  # temperature samples
    full = out.choices[0].text
    stop = full[2:4]
    cut = client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=8, temperature=0.0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=8, temperature=0.0, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2 and "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text == ""
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == cut.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # several choices stream interleaved, each by its index, each as it would be alone; a stop sequence
    # ends its choice with the text before it
    many = list(client.completions.create(model=MODEL_NAME, prompt=["KING:", "The old man said"], max_tokens=8,
                                          temperature=0.0, stream=True, stop=[stop]))
    texts = {i: "".join(c.choices[0].text for c in many if c.choices[0].index == i) for i in (0, 1)}
    alone = client.completions.create(model=MODEL_NAME, prompt="The old man said", max_tokens=8, temperature=0.0,
                                      stop=[stop]).choices[0]
    assert texts == {0: cut.choices[0].text, 1: alone.text}
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in many if c.choices[0].finish_reason}
    assert ends == {0: "stop", 1: alone.finish_reason} and many[-1].usage is not None
    raw = requests.post(f"{served}/completions", json={"prompt": "KING:", "max_tokens": 3, "stream": True},
                        timeout=60, stream=True)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_echo_and_logprobs_are_the_served_models_own_log_softmax(served, tiny_run):
    """What lm-evaluation-harness's local-completions sends (token ids, echo, logprobs 1, max_tokens 1,
    greedy) and a text prompt with logprobs 3: every number equals the registered weights' log-softmax
    from a forward pass here, the first echoed token has none, and the text offsets place every token."""
    import torch

    from models.export import load_safetensors
    from pipeline.store.contracts import TOKENIZER_FILE, WEIGHTS_FILE
    from pipeline.tokenization.spm import EOS_ID, load_sentencepiece

    model = load_safetensors(tiny_run.arts["train"].path / WEIGHTS_FILE).eval()
    sp = load_sentencepiece(str(tiny_run.arts["tokenizer"].path / TOKENIZER_FILE))
    ids = [EOS_ID, *sp.encode("KING: What is the matter?")]
    r = _complete(served, prompt=[ids, ids[:5]], echo=True, logprobs=1, max_tokens=1, temperature=0.0)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for choice, prompt in zip(choices, (ids, ids[:5])):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = [logp[t - 1, prompt[t]].item() for t in range(1, len(prompt))]
        assert lp["token_logprobs"][1:-1] == pytest.approx(expected, abs=1e-5)
        greedy = logp[len(prompt) - 1].max().item()  # max_tokens 1 at temperature 0: the argmax, its value
        assert lp["token_logprobs"][-1] == pytest.approx(greedy, abs=1e-5)
        assert [max(top.values()) for top in lp["top_logprobs"][1:]] == pytest.approx(
            [logp[t - 1].max().item() for t in range(1, len(prompt) + 1)], abs=1e-5)
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        assert all(choice["text"].startswith(tok, at) for tok, at in zip(lp["tokens"], lp["text_offset"]))
    text = _complete(served, prompt="KING:", logprobs=3, max_tokens=4, temperature=0.0).json()["choices"][0]
    prompt = [EOS_ID, *sp.encode("KING:")]
    assert len(text["logprobs"]["tokens"]) == 4 and "".join(text["logprobs"]["tokens"]) == text["text"]
    assert all(len(top) == 3 for top in text["logprobs"]["top_logprobs"])
    with torch.no_grad():  # the first new token, greedy: the argmax after the prompt (and its EOS)
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert text["logprobs"]["token_logprobs"][0] == pytest.approx(logp.max().item(), abs=1e-5)
    echoed = _complete(served, prompt="KING:", echo=True, max_tokens=3, temperature=0.0).json()["choices"][0]
    assert echoed["text"].startswith("KING:") and echoed["logprobs"] is None


def test_streamed_echo_and_logprobs_add_up_to_the_whole_response(served):
    """stream with echo and logprobs, through the openai client: per choice, the events' texts and their
    logprobs objects, put together, are the non-streamed response's (the same tokens, pieces, offsets and
    top tokens; the values from the logits the engine sampled from, equal to the scoring pass's), with a
    stop sequence and several sampled choices; every event carries a logprobs object."""
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0)
    full = client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=10, temperature=0.0).choices[0].text
    cases = [dict(prompt="KING:", echo=True, logprobs=2, max_tokens=10, temperature=0.0),
             dict(prompt="KING:", logprobs=3, max_tokens=10, temperature=0.0, stop=[full[3:5]]),
             dict(prompt=["The old man said", "KING:"], echo=True, logprobs=1, max_tokens=12, temperature=0.9,
                  seed=11, n=2),
             dict(prompt="KING:", logprobs=0, max_tokens=60, temperature=1.0, seed=3)]
    for case in cases:
        whole = client.completions.create(model=MODEL_NAME, **case)
        events = list(client.completions.create(model=MODEL_NAME, stream=True, **case))
        assert all(e.choices[0].logprobs is not None for e in events), case
        for choice in whole.choices:
            mine = [e.choices[0] for e in events if e.choices[0].index == choice.index]
            assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == choice.finish_reason
            lp, want = [c.logprobs for c in mine], choice.logprobs
            assert [t for x in lp for t in x.tokens] == want.tokens, case
            assert [o for x in lp for o in x.text_offset] == want.text_offset
            assert [t is None for x in lp for t in x.token_logprobs] == [t is None for t in want.token_logprobs]
            assert [t for x in lp for t in x.token_logprobs if t is not None] == pytest.approx(
                [t for t in want.token_logprobs if t is not None], abs=1e-5)
            tops = [t for x in lp for t in x.top_logprobs]
            assert [None if t is None else sorted(t) for t in tops] == \
                [None if t is None else sorted(t) for t in want.top_logprobs]
            assert [v for t in tops if t for _, v in sorted(t.items())] == pytest.approx(
                [v for t in want.top_logprobs if t for _, v in sorted(t.items())], abs=1e-5)


def test_lm_eval_scores_the_deployment_as_it_scores_the_hf_export(served, tiny_run, tmp_path):
    """lm-evaluation-harness's local-completions model against the deployment agrees with its hf model on
    the registered version's HF export, document by document (tests/jobs/lm_eval_check.py)."""
    assert_scored_as_hf_export(served, tiny_run.uri, MODEL_NAME, 1, tmp_path)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="KING:", temperature=5.0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="KING:")
    for body, param in [({"max_tokens": 0, "prompt": "x"}, "max_tokens"), ({"prompt": 3}, "prompt"),
                        ({}, "prompt"), ({"prompt": "x", "logprobs": 6}, "logprobs"),
                        ({"prompt": [5, 10**6]}, "prompt"), ({"prompt": "x", "echo": 1}, "echo"),
                        ({"prompt": "to be or not " * 40}, "prompt"), ({"prompt": "x", "max_tokens": 63}, "max_tokens"),
                        ({"prompt": "x", "n": 99}, "n"), ({"prompt": "x", "stop": ["a"] * 5}, "stop"),
                        # sampling values that reached torch.multinomial as NaN probabilities (500s) before
                        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
                        ({"prompt": "x", "temperature": float("inf")}, "temperature"),
                        ({"prompt": "x", "temperature": 1e-30}, "temperature"),
                        ({"prompt": "x", "top_p": -0.5}, "top_p"), ({"prompt": "x", "top_p": 1.5}, "top_p"),
                        ({"prompt": "x", "top_p": float("nan")}, "top_p"), ({"prompt": "x", "top_k": -1}, "top_k"),
                        ({"prompt": "x", "seed": 2**62 + 1}, "seed"),
                        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
                        ({"prompt": ["x"] * 65}, "prompt"), ({"prompt": "x" * 200_000}, "prompt")]:
        r = requests.post(f"{served}/completions", data=json.dumps({"model": MODEL_NAME, **body}), timeout=60,
                          headers={"Content-Type": "application/json"})  # json.dumps writes NaN and Infinity
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert param in r.json()["error"]["message"], r.text
    long = _complete(served, prompt="x" * 200_000).json()["error"]
    assert "200000 characters" in long["message"] and long["code"] == "context_length_exceeded"  # not tokenized
    huge = requests.post(f"{served}/completions", data=b" " * (1 << 20) + b'{"prompt": "x"}', timeout=60,
                         headers={"Content-Type": "application/json"})
    assert huge.status_code == 413 and "exceeds 1048576 bytes" in huge.json()["error"]["message"], huge.text
    # the same body sent in chunks, with no Content-Length: refused while it streams in
    streamed = requests.post(f"{served}/completions", data=(b" " * 65536 for _ in range(17)), timeout=60,
                             headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in streamed.request.headers}, streamed.request.headers
    assert streamed.status_code == 413 and "exceeds 1048576 bytes" in streamed.json()["error"]["message"], streamed.text
    r = requests.post(f"{served}/completions", data="{not json", timeout=30,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert _complete(served, prompt="KING:", max_tokens=2).status_code == 200


def test_a_failing_generation_step_answers_500_or_an_error_event_and_serving_goes_on(served):
    """The model's forward pass fails (a drill through the deployment's handle: a coming pass raises):
    a plain request gets a 500 ``server_error`` naming the failure, a streamed one, after the text it had
    been sent, the error event and [DONE]; /healthz counts both as errors; the next request is served as before."""
    from ray import serve

    handle = serve.get_deployment_handle("ConduitServer", app_name=f"conduit-{MODEL_NAME}")
    health = served.removesuffix("/v1") + "/healthz"
    body = {"prompt": "KING:", "max_tokens": 6, "temperature": 0.0}
    want = _complete(served, **body).json()["choices"][0]["text"]
    before = requests.get(health, timeout=30).json()["completions"]
    handle.inject_step_faults.remote(1).result()
    r = _complete(served, **body)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["param"] is None
    assert error["message"] == "generation failed: RuntimeError: injected fault: forward pass 1 of 1 failed"
    handle.inject_step_faults.remote(1, after=3).result()  # the prompt's pass and two tokens' go through
    with requests.post(f"{served}/completions", json={**body, "stream": True}, timeout=60, stream=True) as s:
        assert s.status_code == 200  # the stream had started: the failure comes as its last event
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]"
    last = json.loads(lines[-2].removeprefix(b"data: "))
    assert last == {"error": {"message": error["message"], "type": "server_error", "param": None, "code": None}}
    sent = [json.loads(ln.removeprefix(b"data: "))["choices"][0]["text"] for ln in lines[:-2]]
    assert sent and want.startswith("".join(sent)), (sent, want)  # what was made before the failure, as made
    again = _complete(served, **body)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == want
    after = requests.get(health, timeout=30).json()["completions"]
    assert after["errors"] - before["errors"] == 1 and after["ok"] - before["ok"] == 2  # the stream "ok": it began


def test_a_client_that_disconnects_stops_its_rows_within_a_step(served):
    """32 streamed rows (2 prompts x n=16) of 50 tokens; the client reads the first event and hangs up.
    The replica counts the rows it stopped early and the steps each took after its cancel; the batch
    made far fewer steps than the 50 the rows would have taken. This is also what shows that a stream's
    first event reaches the client before its last token is made: had the server held the events back
    until the end, every row would have finished (none stopped early) in 50 steps."""
    health = served.removesuffix("/v1") + "/healthz"
    before = requests.get(health, timeout=30).json()["batches"]
    body = {"model": MODEL_NAME, "prompt": ["KING:", "The old man said"], "n": 16, "max_tokens": 50,
            "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    with requests.post(f"{served}/completions", json=body, timeout=60, stream=True) as r:
        first = next(line for line in r.iter_lines() if line)
    first_s = time.perf_counter() - t0
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] is not None
    deadline = time.time() + 30
    while time.time() < deadline:
        after = requests.get(health, timeout=30).json()["batches"]
        if after["stopped"] - before["stopped"] >= 32:
            break
        time.sleep(0.2)
    steps = after["steps"] - before["steps"]
    assert after["stopped"] - before["stopped"] == 32, (before, after, first_s)
    assert after["steps_after_cancel_max"] <= 1 and steps < 25, (before, after, first_s)
    print(f"first event after {first_s:.3f} s; {steps} steps before the rows stopped")


def test_concurrent_requests_are_batched_and_answer_as_if_alone(served, tiny_run):
    """Six clients at once: each gets what the registered weights generate for its prompt alone through
    ``models.generate`` (an independent path: no engine, no batch), and the replica (one: --replicas 1)
    admitted them in fewer prompt forwards than rows, its batch holding several requests at once."""
    import torch

    from models.export import load_safetensors
    from models.generate import generate
    from pipeline.store.contracts import TOKENIZER_FILE, WEIGHTS_FILE
    from pipeline.tokenization.spm import EOS_ID, load_sentencepiece

    model = load_safetensors(tiny_run.arts["train"].path / WEIGHTS_FILE).eval()
    sp = load_sentencepiece(str(tiny_run.arts["tokenizer"].path / TOKENIZER_FILE))
    prompts = ["KING:", "The old man said", "O", "What light through yonder window", "First Citizen:", "Ay"]
    alone = []
    for i, p in enumerate(prompts):
        ids = [EOS_ID, *sp.encode(p)]
        new = generate(model, torch.tensor([ids]), 10 + i, temperature=0.0, eos_id=EOS_ID)[0, len(ids):].tolist()
        alone.append(sp.decode(new[:new.index(EOS_ID)] if EOS_ID in new else new))
    health = served.removesuffix("/v1") + "/healthz"
    before = requests.get(health, timeout=30).json()["batches"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda ip: _complete(served, prompt=ip[1], max_tokens=10 + ip[0],
                                                      temperature=0.0).json()["choices"][0]["text"],
                                 enumerate(prompts)))
    after = requests.get(health, timeout=30).json()["batches"]
    assert together == alone
    assert after["rows"] - before["rows"] == len(prompts), (before, after)
    assert after["joins"] - before["joins"] < len(prompts) and after["largest"] > 1, (before, after)


def test_promotion_and_rollback_roll_the_deployment_with_zero_failures(served, tiny_run, capsys):
    uri = tiny_run.uri
    v2 = _register_better(tiny_run, "deploy-v2")
    body = {"model": MODEL_NAME, "prompt": "KING:", "max_tokens": 4, "temperature": 0.0}
    with steady_requests(f"{served}/completions", body) as (seen, failures):
        time.sleep(1.0)
        assert promote.main([MODEL_NAME, "--tracking-uri", uri]) == 0  # challenger v2 beats v1: rolls over
        assert "rolled over to v2" in capsys.readouterr().out
        assert requests.get(f"{served}/models", timeout=30).json()["data"][0]["conduit_version"] == v2
        time.sleep(1.0)
        assert promote.main([MODEL_NAME, "--rollback", "--tracking-uri", uri, "--reason", "test"]) == 0
        assert "rolled over to v1" in capsys.readouterr().out
        time.sleep(1.0)
    assert failures == []
    versions = [v for _, v in sorted(seen)]
    changes = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
    assert changes[0] == 1 and v2 in changes and changes[-1] == 1, changes
    assert len(versions) > 20
    tags = {v: tracking.get_version(uri, MODEL_NAME, v).tags for v in (1, v2)}
    assert tags[1]["deploy.status"] == "running" and tags[v2]["deploy.status"] == "replaced"
    assert tags[1]["promotion.champion.rollback_from"] == str(v2)
    assert tracking.model_aliases(uri, MODEL_NAME)["champion"] == 1


def test_app_builder_resolves_the_alias_for_declarative_configs(served, tiny_run):
    from ray.serve import Application

    from pipeline.serving import app

    assert isinstance(app.app_builder({"model": f"{MODEL_NAME}@champion", "tracking_uri": tiny_run.uri,
                                             "revision": 3}), Application)
    assert isinstance(app.app_builder({"model": f"{MODEL_NAME}/1", "tracking_uri": tiny_run.uri}), Application)
    for args, error, needle in [({"model": f"{MODEL_NAME}@nope", "tracking_uri": tiny_run.uri}, LookupError, "no alias"),
                                ({"model": f"{MODEL_NAME}/99", "tracking_uri": tiny_run.uri}, LookupError, "no version 99"),
                                ({"model": MODEL_NAME, "tracking_uri": tiny_run.uri}, ValueError, "NAME@ALIAS or"),
                                ({"model": "m", "replicas": 2}, ValueError, "take only"),
                                ({"model": f"{MODEL_NAME}/1", "tracking_uri": tiny_run.uri, "batching": "dynamic"},
                                 ValueError, "'continuous' or 'static'")]:
        with pytest.raises(error, match=needle):
            app.app_builder(args)


def test_down_removes_the_application_and_tags_the_version(served, tiny_run, capsys):
    assert deploy_cli.main([MODEL_NAME, "--down", "--tracking-uri", tiny_run.uri]) == 0
    assert "removed; v1 tagged deploy.status=down" in capsys.readouterr().out
    assert deploy.app_status(MODEL_NAME) == "NOT_DEPLOYED"
    assert tracking.get_version(tiny_run.uri, MODEL_NAME, 1).tags["deploy.status"] == "down"
    assert deploy_cli.main([f"{MODEL_NAME}@nope", "--tracking-uri", tiny_run.uri]) == 2


def test_serving_here_prints_a_status_line_and_keeps_the_access_log_off_the_terminal(tiny_run, tmp_path):
    """``jobs.deploy`` with no cluster starts Ray in its own process and serves until SIGTERM: its output
    names the access log's folder, then status lines (version, completions/s, p50, answered, errors,
    largest batch) and none of Serve's per-request access lines, which are in that folder instead.
    Its Ray is its own even where the last ``ray start`` on this machine left the address of a cluster that
    is gone (a bare ``ray.init()`` attaches to it and waits forever: CI met it).
    (After test_down: this deployment's tags are v1's last.)"""
    import os
    import queue
    import re
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    from tests.servers import ROOT

    if "champion" not in tracking.model_aliases(tiny_run.uri, MODEL_NAME):  # run alone, without the module's
        assert promote.main([MODEL_NAME, "--tracking-uri", tiny_run.uri]) == 0
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CONDUIT_INFRA_ENV"] = str(tmp_path / "no-cluster-env")  # no infra cluster either: Ray starts here
    # Ray's temp folder with a stale record of a cluster that is gone (short: Ray's socket paths must fit)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    env["RAY_TMPDIR"] = str(ray_tmp)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.deploy", f"{MODEL_NAME}@champion", "--tracking-uri", tiny_run.uri,
         "--port", str(port), "--replicas", "1", "--cpus", "1", "--status-every", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()

    def wait_for(pattern: str, timeout: float, running: bool = True) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert not running or proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{''.join(seen)}")

    try:
        base = wait_for(r"^endpoint: (\S+)", 300).group(1)
        log_dir = Path(wait_for(r"^access log: (\S+)", 30).group(1))
        for i in range(4):
            assert requests.post(f"{base}/completions", json={"prompt": "KING:", "max_tokens": 3 + i},
                                 timeout=60).status_code == 200
        assert requests.post(f"{base}/completions", json={"prompt": "x", "n": 99}, timeout=60).status_code == 400
        # Lines printed while the requests ran say less; one that says all of them comes within seconds.
        m = wait_for(r"^v1: [\d.]+ completions/s, p50 [\d.]+ s, 4 answered, 1 errors, largest batch (\d+)$", 60)
        assert int(m.group(1)) >= 1
        logged = "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))
        assert re.search(r"POST /v1/completions 200", logged)  # the access log is in the folder named
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    wait_for(r"^stopped; " + MODEL_NAME + r" v1 tagged deploy.status=stopped", 30, running=False)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    output = "".join(seen)
    assert not re.search(r"(GET|POST) /\S+ \d{3}", output), output  # no access line here ("POST /v1/completions 200")

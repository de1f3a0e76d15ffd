"""jobs.deploy with vLLM: Ray Serve LLM running vLLM (the .venv-vllm that `make install` builds) on the
registered version's HF export, on the session's Ray, against the session's MLflow server, with
``deploy.engine: vllm``. One deployment is shared by the module's tests, in file order; the promotion test
rolls it to v2 and back, the last test takes it down and deploys again with a promotion sent while it starts.

Every answer is checked against Conduit's own model: greedy tokens against ``models.generate`` on the
same prompt, log-probabilities against a forward pass here."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import torch

from jobs import deploy as deploy_cli, promote
from models.export import load_safetensors
from models.generate import generate
from pipeline import tracking
from pipeline.serving import deploy, vllm_files
from pipeline.store.contracts import TOKENIZER_FILE, WEIGHTS_FILE
from pipeline.tokenization.spm import EOS_ID, load_sentencepiece
from tests.jobs.client_load import steady_requests
from tests.jobs.lm_eval_check import assert_scored_as_hf_export
from tests.jobs.test_promote_serve import _register_with
from tests.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
MODEL_NAME = "conduit-test-vllm"


@pytest.fixture(scope="module")
def on_vllm(tmp_path_factory) -> str:
    """A config that deploys on vLLM (``auto`` serves this width on Conduit's engine on CPU replicas)."""
    path = tmp_path_factory.mktemp("vllm_config") / "deploy.yaml"
    path.write_text("deploy:\n  engine: vllm\n")
    return str(path)


@pytest.fixture(scope="module")
def served(tiny_vllm_run, ray_cluster, on_vllm):
    """v1 promoted to champion and deployed by jobs.deploy with ``deploy.engine: vllm``."""
    uri = tiny_vllm_run.uri
    assert promote.main([MODEL_NAME, "--tracking-uri", uri]) == 0
    port = free_port()
    assert deploy_cli.main([f"{MODEL_NAME}@champion", "--tracking-uri", uri, "--port", str(port),
                            "--replicas", "1", "--cpus", "1", "--config", on_vllm]) == 0
    yield f"http://127.0.0.1:{port}/v1"
    from ray import serve

    deploy_cli.main([MODEL_NAME, "--down", "--tracking-uri", uri])
    serve.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_vllm_run):
    """The registered weights as Conduit's own model, and the tokenizer."""
    model = load_safetensors(tiny_vllm_run.arts["train"].path / WEIGHTS_FILE).eval()
    sp = load_sentencepiece(str(tiny_vllm_run.arts["tokenizer"].path / TOKENIZER_FILE))
    return model, sp


def _complete(base: str, **body) -> requests.Response:
    return requests.post(f"{base}/completions", json={"model": MODEL_NAME, **body}, timeout=120)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = generate(model, torch.tensor([ids]), max_new_tokens=n, temperature=0.0, eos_id=EOS_ID)
    new = out[0, len(ids):].tolist()
    return new[:new.index(EOS_ID) + 1] if EOS_ID in new else new


def _copies(uri: str) -> set[str]:
    """The versions of this registry's model that this node keeps a vLLM copy of (pipeline.serving.vllm_files:
    <model key>/<version key>/<model>-v<version>)."""
    return {p.name for p in Path(vllm_files.model_dir(uri, MODEL_NAME)).glob(f"*/{MODEL_NAME}-v*")
            if re.fullmatch(rf"{MODEL_NAME}-v\d+", p.name)}  # not a download's temporary folder


def test_engine_vllm_serves_and_records_why(served, tiny_vllm_run, capsys):
    r = requests.get(f"{served}/models", timeout=30)
    assert r.status_code == 200 and r.headers["x-conduit-version"] == "1"
    assert r.json()["data"][0]["id"] == MODEL_NAME
    tags = tracking.get_version(tiny_vllm_run.uri, MODEL_NAME, 1).tags
    assert tags["deploy.engine"] == "vllm"
    assert tags["deploy.engine_reason"] == "deploy.engine is vllm; vLLM serves LlamaForCausalLM on CPU"
    assert tags["deploy.status"] == "running" and deploy.app_status(MODEL_NAME) == "RUNNING"
    health = requests.get(served.removesuffix("/v1") + "/healthz", timeout=30).json()
    assert health["engine"] == "vllm" and health["version"] == 1


def test_greedy_tokens_are_conduits_own(served, reference):
    """Text prompts start a new document (an EOS before them) as on Conduit's engine; token-id prompts are
    taken as they are. Greedy tokens equal models.generate's on the same ids."""
    model, sp = reference
    for text in ("KING:", "First Citizen:\nBefore we proceed", "O Romeo, Romeo!"):
        ids = [EOS_ID, *sp.encode(text)]
        want = _greedy(model, ids, 12)
        by_text = _complete(served, prompt=text, max_tokens=12, temperature=0.0, return_token_ids=True).json()
        by_ids = _complete(served, prompt=ids, max_tokens=12, temperature=0.0, return_token_ids=True).json()
        for body in (by_text, by_ids):
            assert body["choices"][0]["token_ids"] == want, (text, body)
        assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]


def test_echo_and_logprobs_are_the_models_own_log_softmax(served, reference):
    """What lm-evaluation-harness sends (token ids, echo, logprobs, max_tokens 1) and a text prompt with
    echo: every number is the registered weights' log-softmax from a forward pass here (float32, 1e-4),
    the first echoed token has none, and a text prompt's echo is the text as sent."""
    model, sp = reference
    ids = [EOS_ID, *sp.encode("KING: What is the matter?")]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    lp = _complete(served, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0.0).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + 1
    expected = [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert lp["token_logprobs"][1:-1] == pytest.approx(expected, abs=1e-4)
    assert lp["token_logprobs"][-1] == pytest.approx(logp[-1].max().item(), abs=1e-4)
    text = "KING: What is the matter?"
    choice = _complete(served, prompt=text, echo=True, logprobs=2, max_tokens=3, temperature=0.0).json()["choices"][0]
    assert choice["text"].startswith(text)
    tokens = choice["logprobs"]["tokens"]
    new = _greedy(model, ids, 3)  # an EOS among them ends the completion there
    assert len(tokens) == len(ids) - 1 + len(new) and choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:len(ids) - 1] == pytest.approx(expected[1:], abs=1e-4)
    # the 2 most likely, and the chosen token's own where it is not among them (OpenAI: up to logprobs + 1)
    assert all(2 <= len(top) <= 3 and tok in top
               for tok, top in zip(tokens[1:], choice["logprobs"]["top_logprobs"][1:]))


def test_lm_eval_scores_the_vllm_deployment_as_it_scores_the_hf_export(served, tiny_vllm_run, tmp_path):
    """Evaluated as deployed, on vLLM: lm-evaluation-harness's local-completions against the deployment
    agrees with its hf model on the export, document by document, to 1e-4 per token."""
    assert_scored_as_hf_export(served, tiny_vllm_run.uri, MODEL_NAME, 1, tmp_path)


def test_stream_n_seed_and_stop_through_the_openai_client(served, reference):
    model, sp = reference
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=120)
    want = sp.decode(_greedy(model, [EOS_ID, *sp.encode("KING:")], 16))
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=16, temperature=0.0,
                                            stream=True))
    assert len(chunks) >= 2 and "".join(c.choices[0].text for c in chunks if c.choices) == want
    seeded = [client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=12, n=2, seed=7,
                                        temperature=1.0) for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert len(seeded[0].choices) == 2
    cut = want[3:6]
    stopped = client.completions.create(model=MODEL_NAME, prompt="KING:", max_tokens=16, temperature=0.0, stop=[cut])
    assert stopped.choices[0].text == want[:want.index(cut)] and stopped.choices[0].finish_reason == "stop"


def _error(response, status: int) -> dict:
    """The answer's OpenAI error (status ``status``, every field of OpenAI's error object present)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, response.text
    return error


def test_bad_requests_get_openai_errors_naming_the_field_and_the_server_keeps_serving(served):
    """vLLM's and Ray Serve LLM's refusals reach the client in OpenAI's error shape, as Conduit's engine answers
    them (pipeline.serving.vllm_ingress.openai_error): the field at fault in ``param``, the OpenAI ``code``
    where there is one; the OpenAI client reads them."""
    too_long = _error(_complete(served, prompt=list(range(5, 200)), max_tokens=4), 400)
    assert "maximum context length" in too_long["message"]
    assert (too_long["type"], too_long["param"], too_long["code"]) == (
        "invalid_request_error", "prompt", "context_length_exceeded")
    negative = _error(_complete(served, prompt="x", max_tokens=-1), 400)
    assert (negative["type"], negative["param"]) == ("invalid_request_error", "max_tokens"), negative
    nan = requests.post(f"{served}/completions", data=json.dumps({"model": MODEL_NAME, "prompt": "x", "temperature": math.nan}),
                        headers={"content-type": "application/json"}, timeout=60)
    assert _error(nan, 400)["param"] == "temperature", nan.text
    wrong_type = _error(_complete(served, prompt="x", max_tokens="many"), 400)  # refused by the body's model
    assert (wrong_type["type"], wrong_type["param"]) == ("invalid_request_error", "max_tokens"), wrong_type
    unknown = _error(_complete(served, prompt="x", model="gpt-4"), 404)
    assert "gpt-4" in unknown["message"] and (unknown["param"], unknown["code"]) == ("model", "model_not_found")
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=-1)
    assert refused.value.param == "max_tokens" and refused.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x")
    assert missing.value.code == "model_not_found"
    assert _complete(served, prompt="KING:", max_tokens=2).status_code == 200


def test_promotion_and_rollback_roll_the_vllm_deployment_with_zero_failures(served, tiny_vllm_run, capsys):
    uri = tiny_vllm_run.uri
    base = json.loads((tiny_vllm_run.arts["evaluate"].path / "metrics.json").read_text())["metrics"]
    v2 = _register_with(tiny_vllm_run, "vllm-v2", heldout_bits_per_byte=base["heldout_bits_per_byte"] - 0.5)
    body = {"model": MODEL_NAME, "prompt": "KING:", "max_tokens": 4, "temperature": 0.0}
    with steady_requests(f"{served}/completions", body) as (seen, failures):
        time.sleep(1.0)
        assert promote.main([MODEL_NAME, "--tracking-uri", uri]) == 0
        assert "rolled over to v2" in capsys.readouterr().out
        assert requests.get(f"{served}/models", timeout=30).headers["x-conduit-version"] == str(v2)
        time.sleep(1.0)
        assert promote.main([MODEL_NAME, "--rollback", "--tracking-uri", uri, "--reason", "test"]) == 0
        assert "rolled over to v1" in capsys.readouterr().out
        time.sleep(1.0)
    assert failures == []
    versions = [v for _, v in sorted(seen)]
    changes = [v for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
    assert changes[0] == 1 and v2 in changes and changes[-1] == 1 and len(versions) > 10, changes
    tags = {v: tracking.get_version(uri, MODEL_NAME, v).tags for v in (1, v2)}
    assert tags[1]["deploy.status"] == "running" and tags[1]["deploy.engine"] == "vllm"
    assert tags[v2]["deploy.status"] == "replaced" and tags[v2]["deploy.engine"] == "vllm"
    assert _copies(uri) == {f"{MODEL_NAME}-v1"}  # v2's copy went when it stopped being served


def test_a_promotion_sent_while_the_vllm_deployment_starts_rolls_it_once_it_runs(served, tiny_vllm_run, on_vllm,
                                                                                capsys):
    """As reported: jobs.deploy NAME@champion on vLLM; as soon as /v1/models answers (the ingress is up while
    LLMServer still starts, and jobs.deploy has not returned), jobs.promote --force moves @champion. The
    promotion waits for the deployment, rolls it over and says so; the deployment answers the new champion,
    and only its copy of the weights stays on the node; --down removes that one too."""
    uri = tiny_vllm_run.uri
    assert deploy_cli.main([MODEL_NAME, "--down", "--tracking-uri", uri]) == 0
    assert _copies(uri) == set()
    started = tracking.model_aliases(uri, MODEL_NAME)["champion"]
    base = json.loads((tiny_vllm_run.arts["evaluate"].path / "metrics.json").read_text())["metrics"]
    new = _register_with(tiny_vllm_run, "vllm-race", heldout_bits_per_byte=base["heldout_bits_per_byte"] - 1.0)
    port = served.split(":")[2].split("/")[0]  # Serve's HTTP proxy stays where the module started it
    result = {}

    def jobs_deploy():
        result["rc"] = deploy_cli.main([f"{MODEL_NAME}@champion", "--tracking-uri", uri, "--port", port,
                                        "--replicas", "1", "--cpus", "1", "--config", on_vllm])

    thread = threading.Thread(target=jobs_deploy)
    thread.start()
    deadline = time.monotonic() + 600
    while requests.get(f"{served}/models", timeout=30).status_code != 200:
        assert thread.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.5)
    assert promote.main([MODEL_NAME, "--version", str(new), "--force", "--reason", "promoted while it starts",
                         "--tracking-uri", uri]) == 0
    thread.join(timeout=600)
    assert result == {"rc": 0}
    out = capsys.readouterr().out
    assert f"serving {MODEL_NAME} v{started} (@champion)" in out
    assert re.search(rf"^deployment conduit-{MODEL_NAME} rolled over to v{new} \(RUNNING\) at \S+, after waiting "
                     r"\d+ s for it to start$", out, re.M), out
    assert requests.get(f"{served}/models", timeout=30).headers["x-conduit-version"] == str(new)
    tags = {v: tracking.get_version(uri, MODEL_NAME, v).tags for v in (started, new)}
    assert tags[new]["deploy.status"] == "running" and tags[started]["deploy.status"] == "replaced"
    assert _copies(uri) == {f"{MODEL_NAME}-v{new}"}
    assert deploy_cli.main([MODEL_NAME, "--down", "--tracking-uri", uri]) == 0
    assert _copies(uri) == set()

"""The OpenAI completions request checks and bodies (pure; the served API is tested in tests/jobs/test_deploy.py)."""

from __future__ import annotations

import json

import pytest

from pipeline.serving.openai_api import (ApiError, Choice, apply_stop, completion_body, logprobs_body,
                                         parse_completion_request, stream_chunk,
                                         usage_body)


def parse(**body):
    return parse_completion_request(json.dumps(body).encode())


def test_defaults_and_both_prompt_forms():
    r = parse(prompt="hi")
    assert (r.prompts, r.max_tokens, r.temperature, r.top_p, r.n, r.stop, r.seed, r.stream) == \
        (["hi"], 16, 1.0, 1.0, 1, (), None, False)
    r = parse(model="m", prompt=["a", "b"], max_tokens=3, temperature=0, top_p=0.5, n=2, stop="\n", seed=4,
              stream=True, user="u")
    assert r.prompts == ["a", "b"] and r.stop == ("\n",) and r.n == 2 and r.seed == 4 and r.stream
    assert (r.echo, r.logprobs) == (False, None)


def test_token_id_prompts_echo_and_logprobs():
    """The four prompt forms of the OpenAI API; token ids kept as tuples (lm-evaluation-harness sends them)."""
    assert parse(prompt=[5, 6, 7]).prompts == [(5, 6, 7)]
    assert parse(prompt=[[5, 6], [7]]).prompts == [(5, 6), (7,)]
    assert parse(prompt=["a", "b"]).prompts == ["a", "b"]
    r = parse(prompt=[1, 2], echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert (r.echo, r.logprobs) == (True, 1)
    assert parse(prompt="x", logprobs=0).logprobs == 0
    r = parse(prompt="x", echo=True, logprobs=2, stream=True)  # streamed too, as OpenAI clients ask
    assert (r.echo, r.logprobs, r.stream) == (True, 2, True)


@pytest.mark.parametrize("body, param, needle", [
    ({}, "prompt", "prompt is required"),
    ({"prompt": []}, "prompt", "must not be an empty list"),
    ({"prompt": [1.5]}, "prompt", "a list of token ids or a list of lists"),
    ({"prompt": [[1, 2], "a"]}, "prompt", "a list of token ids or a list of lists"),
    ({"prompt": [[1, 2], []]}, "prompt", "prompt 1 must be a non-empty list of token ids"),
    ({"prompt": [[1, -2]]}, "prompt", "prompt 0 must be a non-empty list of token ids"),
    ({"prompt": [[True, 2]]}, "prompt", "prompt 0 must be a non-empty list of token ids"),
    ({"prompt": "x", "logprobs": 6}, "logprobs", "logprobs must be null or a whole number in [0, 5]; got 6"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "logprobs must be null or a whole number"),
    ({"prompt": "x", "echo": "yes"}, "echo", "echo must be true or false"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens=0 must be in [1"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "temperature": -0.1}, "temperature", "temperature=-0.1"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p=0 must be in (0.0"),
    ({"prompt": "x", "n": True}, "n", "must be an integer"),
    ({"prompt": "x", "stop": ["a"] * 5}, "stop", "at most 4"),
    ({"prompt": "x", "seed": "1"}, "seed", "seed must be an integer"),
    ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "unsupported field(s) ['suffix']"),
    # Values that reached torch.multinomial as NaN probabilities (a 500) before.
    ({"prompt": "x", "temperature": float("nan")}, "temperature", "temperature must be a finite number; got nan"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature", "must be a finite number; got inf"),
    ({"prompt": "x", "temperature": 1e-30}, "temperature", "temperature=1e-30 must be 0 (greedy) or in [0.01"),
    ({"prompt": "x", "top_p": -0.5}, "top_p", "top_p=-0.5 must be in (0.0"),
    ({"prompt": "x", "top_p": float("nan")}, "top_p", "top_p must be a finite number"),
    ({"prompt": "x", "top_k": -1}, "top_k", "unsupported field(s) ['top_k']"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens", "max_tokens must be an integer; got 2.0"),
    ({"prompt": ["x"] * 65}, "prompt", "at most 64 prompts per request; got 65"),
    ({"prompt": "x", "seed": 2**70}, "seed", "seed=1180591620717411303424 must be in"),
])
def test_bad_fields_are_400s_that_name_the_field(body, param, needle):
    with pytest.raises(ApiError) as e:
        parse(**body)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_bodies_that_are_not_json_objects():
    for raw, needle in [(b"{nope", "not valid JSON"), (b"[1]", "must be a JSON object"),
                        (b'{"prompt": "x", "temperature": NaN}', "temperature must be a finite number"),
                        (b'{"prompt": "x", "top_p": -Infinity}', "top_p must be a finite number")]:
        with pytest.raises(ApiError, match=needle):
            parse_completion_request(raw)


def test_stop_completion_and_stream_bodies():
    assert apply_stop("abc\ndef END x", ("END", "\n")) == ("abc", True)
    assert apply_stop("abc", ("z",)) == ("abc", False)
    body = completion_body("cmpl-1", "m", 3, [Choice("ab", "length", 2), Choice("c", "stop", 1)], 5)
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["conduit_version"] == 3
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    events = [stream_chunk("cmpl-1", "m", 3, 7, 1, "a"), stream_chunk("cmpl-1", "m", 3, 7, 1, "", "length",
                                                                      usage_body(5, 3))]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert "usage" not in chunks[0] and chunks[1]["usage"] == body["usage"] and chunks[0]["created"] == 7
    assert all(e.endswith("\n\n") and c["choices"][0]["index"] == 1 for e, c in zip(events, chunks))


def test_the_logprobs_object_places_each_token_in_the_text():
    body = logprobs_body(["KING", ":", " O"], [None, -1.5, -0.25], [None, {":": -1.5}, {" O": -0.25}])
    assert body == {"tokens": ["KING", ":", " O"], "token_logprobs": [None, -1.5, -0.25],
                    "top_logprobs": [None, {":": -1.5}, {" O": -0.25}], "text_offset": [0, 4, 5]}
    choice = completion_body("cmpl-1", "m", 1, [Choice("KING: O", "length", 1, body)], 2)["choices"][0]
    assert choice["logprobs"] is body and all(choice["text"].startswith(t, o) for t, o in
                                              zip(body["tokens"], body["text_offset"]))
    # A streamed event's tokens follow those already sent: their offsets start where the text sent ends.
    assert logprobs_body([" O", "!"], [-0.25, -2.0], [{}, {}], start=5)["text_offset"] == [5, 7]

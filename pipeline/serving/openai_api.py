"""The OpenAI completions API as Conduit speaks it: request checking, response and error bodies.

No Ray and no model here: ``pipeline.serving.app`` parses a request with ``parse_completion_request``,
generates, and answers with ``completion_body`` / ``stream_chunk``; a bad request becomes an
``ApiError`` whose ``body()`` is the JSON error an OpenAI client expects
(``{"error": {"message", "type", "param", "code"}}``) and whose ``status`` is its 4xx.

Supported fields of POST /v1/completions: ``model``, ``prompt`` (a string, a list of up to
``request_limits.MAX_PROMPTS`` strings, a list of token ids, or a list of such lists), ``max_tokens``,
``temperature``, ``top_p``, ``n``, ``stop`` (a string or up to 4), ``seed``, ``stream``, ``echo`` (the
prompt's text and tokens before the completion's), ``logprobs`` (0..``MAX_LOGPROBS``: each token's
log-probability and the ``logprobs`` most likely tokens at its position, as evaluation harnesses read
them; streamed, each event carries those of the tokens whose text has been sent), and ``user``
(accepted, unused). Any other field (``top_k``, ``suffix``, ...) is a 400 that names
it, rather than being ignored. A string prompt is a new document (the model sees an EOS before it, as in
training); a token-id prompt is taken as it is. Sampling values follow
``pipeline.serving.request_limits``: NaN, infinities and temperatures just above 0 are 400s naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pipeline.serving import request_limits

VERSION_HEADER = "x-conduit-version"  # every response names the version that answered (both engines)
MAX_N = 16
MAX_STOP = 4
MAX_SEED = 2**62  # each choice seeds a generator with seed + its index
MAX_LOGPROBS = 5  # the OpenAI completions API's own maximum
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "echo", "logprobs",
          "user"}


class ApiError(Exception):
    """A request the API refuses: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    """A checked POST /v1/completions body (OpenAI's defaults for what the client left out)."""

    model: str | None
    prompts: list[str | tuple[int, ...]]  # text, or token ids taken as they are
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    echo: bool = False
    logprobs: int | None = None


def _count(body: dict, name: str, default: int, hi: int) -> int:
    """A whole number in [1, hi] (``max_tokens``, ``n``); OpenAI's default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    problem = request_limits.token_count_problem(name, value, hi)
    if problem is not None:
        raise ApiError(400, problem, name)
    return value


def _sampling(body: dict, name: str, default: float, problem_of) -> float:
    """A sampling value checked by ``problem_of`` (one of ``request_limits``'s); the default when absent."""
    value = body.get(name)
    if value is None:
        return default
    problem = problem_of(name, value)
    if problem is not None:
        raise ApiError(400, problem, name)
    return float(value)


def _strings(value: Any, name: str, max_items: int | None = None) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, f"{name} must be a string or a list of strings; got {value!r}", name)
    if max_items is not None and len(items) > max_items:
        raise ApiError(400, f"{name} takes at most {max_items} strings; got {len(items)}", name)
    return items


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompts(value: Any) -> list[str | tuple[int, ...]]:
    """``prompt`` in any of its four forms, as a list of strings and token-id tuples."""
    form = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ApiError(400, f"prompt must be {form}; got {value!r}", "prompt")
    if not value:
        raise ApiError(400, "prompt must not be an empty list", "prompt")
    if all(_is_id(v) for v in value):
        value = [value]
    elif not all(isinstance(v, str) for v in value) and not all(isinstance(v, list) for v in value):
        raise ApiError(400, f"prompt must be {form}; got {value!r}", "prompt")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(item)
            continue
        if not item or not all(_is_id(v) and v >= 0 for v in item):
            raise ApiError(400, f"prompt {i} must be a non-empty list of token ids (whole numbers >= 0); got "
                                f"{item!r}", "prompt")
        out.append(tuple(item))
    return out


def parse_completion_request(raw: bytes) -> CompletionRequest:
    """Check a POST /v1/completions body.

    Args:
        raw: the request body (JSON).

    Returns:
        The request, with OpenAI's defaults filled in.

    Raises:
        ApiError: 400 naming the field that is missing, unknown, of the wrong type or out of range.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"unsupported field(s) {unknown}; this server accepts {sorted(FIELDS)}", unknown[0])
    if "prompt" not in body:
        raise ApiError(400, "prompt is required (a string, a list of strings or token ids)", "prompt")
    prompts = _prompts(body["prompt"])
    too_many = request_limits.prompt_count_problem("prompt", len(prompts))
    if too_many is not None:
        raise ApiError(400, too_many, "prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string; got {model!r}", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false; got {stream!r}", "stream")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"seed must be an integer; got {seed!r}", "seed")
    if seed is not None and not -MAX_SEED <= seed <= MAX_SEED:  # torch's generators take 64 bits
        raise ApiError(400, f"seed={seed} must be in [-{MAX_SEED}, {MAX_SEED}]", "seed")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ApiError(400, f"echo must be true or false; got {echo!r}", "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_id(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ApiError(400, f"logprobs must be null or a whole number in [0, {MAX_LOGPROBS}]; got {logprobs!r}",
                       "logprobs")
    stop = body.get("stop")
    return CompletionRequest(
        model=model, prompts=prompts,
        max_tokens=_count(body, "max_tokens", 16, 1 << 20),
        temperature=_sampling(body, "temperature", 1.0, request_limits.temperature_problem),
        top_p=_sampling(body, "top_p", 1.0, request_limits.top_p_problem),
        n=_count(body, "n", 1, MAX_N),
        stop=() if stop is None else tuple(s for s in _strings(stop, "stop", MAX_STOP) if s),
        seed=seed, stream=stream, echo=echo, logprobs=logprobs,
    )


def apply_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """Cut ``text`` before the first stop sequence; returns ``(text, cut)``."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


@dataclass(frozen=True)
class Choice:
    """One generated completion: its text (after the prompt's, with ``echo``), why it ended (``stop`` or
    ``length``), its token count, and with ``logprobs`` the OpenAI ``logprobs`` object."""

    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: dict | None = None


def logprobs_body(pieces: list[str], token_logprobs: list[float | None], top: list[dict[str, float] | None],
                  start: int = 0) -> dict:
    """The OpenAI ``logprobs`` object of one choice: each token's text, its log-probability (None for a
    first prompt token, which has no context), the most likely tokens at its position, and where its text
    starts in the choice's text (the first at ``start``: a streamed event's tokens follow those sent)."""
    offsets, at = [], start
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion_body(cid: str, model: str, version: int, choices: list[Choice], prompt_tokens: int) -> dict:
    """The JSON of a (non-streamed) completion; ``conduit_version`` says which version answered."""
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {
        "id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"text": c.text, "index": i, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                    for i, c in enumerate(choices)],
        "usage": usage_body(prompt_tokens, completion_tokens),
        "conduit_version": version,
    }


def stream_chunk(cid: str, model: str, version: int, created: int, index: int, text: str,
                 finish_reason: str | None = None, usage: dict | None = None, logprobs: dict | None = None) -> str:
    """One server-sent event of a streamed completion: text of choice ``index`` as it is generated, or
    (with ``finish_reason``) the end of that choice; the event that ends the last choice also carries
    the request's ``usage``. With ``logprobs``, the ``logprobs`` object of the tokens this event reports
    (their ``text_offset`` in the choice's whole text). The caller sends ``DONE_EVENT`` after it."""
    data = {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}],
            "conduit_version": version}
    if usage is not None:
        data["usage"] = usage
    return f"data: {json.dumps(data)}\n\n"


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_event(message: str) -> str:
    """A streamed completion that failed after its first event: an OpenAI-style error as the last event."""
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


def models_body(model: str, version: int, created: int) -> dict:
    """GET /v1/models: the one model this deployment serves."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "conduit", "conduit_version": version}]}

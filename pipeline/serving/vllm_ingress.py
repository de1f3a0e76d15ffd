"""What Conduit adds to Ray Serve LLM's deployment of vLLM (imported only where vLLM is installed).

- ``VersionFiles``: Ray Serve LLM's model-initialisation callback that fetches the registered version's
  Hugging Face export (``artifacts/hf`` of the MLflow model) into a node-local folder before vLLM loads
  it, once per node and version (written to a temporary folder, renamed when complete).
- ``ConduitLLMServer``: Ray Serve LLM's ``LLMServer`` with text prompts that start a new document (an
  EOS token before the prompt's tokens), as in training and as Conduit's own engine serves them; echoed
  prompts and their logprobs leave that token out, as Conduit's engine does.
- ``ConduitIngress``: Ray Serve LLM's OpenAI ingress, which also answers ``/healthz`` (the version, what
  it answered, its p50 latency, the most requests in flight at once: ``jobs.deploy``'s status line) and
  marks every response with the version that made it (``x-conduit-version``).
- ``openai_error``: every error answer in OpenAI's shape, as Conduit's engine gives it
  (``{"error": {"message", "type", "param", "code"}}``: ``param`` the request field at fault, ``type``
  ``invalid_request_error`` or ``server_error``, ``code`` ``model_not_found`` or
  ``context_length_exceeded`` where those apply). vLLM names the field only inside its message ("...
  (parameter=max_tokens, value=-1)"), Ray Serve LLM's body validation puts the offending value where the
  field belongs and its class name in ``type``, and an unknown model is FastAPI's ``{"detail": ...}``.

(No ``from __future__ import annotations``: FastAPI must see the request bodies' classes, not strings,
through Serve's ingress wrapper.)
"""

import collections
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from ray.serve.llm.deployment import LLMServer
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
from starlette.responses import JSONResponse, Response

from pipeline.compat import serve_llm_ingress_app, serve_llm_request_models
from pipeline.serving.openai_api import VERSION_HEADER, ApiError

CallbackBase, ChatCompletionRequest, CompletionRequest = serve_llm_request_models()

LATENCY_WINDOW = 200  # completions whose latency /healthz's p50 covers


def fetch_version_files(tracking_uri: str, model_name: str, version: int, dst: str) -> Path:
    """The version's HF export in ``dst``, downloaded from the registry unless already there (into a
    temporary folder beside it, renamed when complete, so a half-written folder is never read).

    Raises:
        FileNotFoundError: the version has no HF export.
    """
    from pipeline import tracking

    final = Path(dst)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=final.name + ".", dir=final.parent) as tmp:
        local = tracking.download_hf_export(tracking_uri, model_name, version, tmp)
        try:
            os.rename(local, final)
        except OSError:  # another replica on this node finished first
            if not (final / "config.json").is_file():
                raise
    return final


class VersionFiles(CallbackBase):
    """Fetch the registered version's export before vLLM reads it (on every node of the replica)."""

    def on_before_download_model_files_distributed(self) -> None:
        k = self.kwargs
        fetch_version_files(k["tracking_uri"], k["model_name"], int(k["version"]), k["dst"])


class ConduitLLMServer(LLMServer):
    """``LLMServer`` whose text prompts start a new document, as Conduit's engine serves them."""

    _tokenizer = None

    def _eos_and_tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            source = Path(self._llm_config.model_loading_config.model_source)
            eos = int(json.loads((source / "config.json").read_text())["eos_token_id"])
            self._tokenizer = (eos, Tokenizer.from_file(str(source / "tokenizer.json")))
        return self._tokenizer

    def _as_documents(self, request) -> "_Echo | None":
        """Text prompts -> token ids after an EOS (token-id prompts are taken as they are).

        Returns:
            What an echoed response must be corrected by, for text prompts (else None).
        """
        prompt = request.prompt
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(p, str) for p in texts):
            return None
        eos, tok = self._eos_and_tokenizer()
        ids = [[eos, *tok.encode(p, add_special_tokens=False).ids] for p in texts]
        request.prompt = ids[0] if isinstance(prompt, str) else ids
        # vLLM echoes a prompt as the text of all its ids: the EOS's text and what follows it (a word's
        # leading space) stand before the prompt's own text.
        echoed = [tok.decode(i, skip_special_tokens=False) for i in ids]
        return _Echo(texts, echoed, request.n or 1)

    async def completions(self, request, raw_request_info=None):
        echo = self._as_documents(request)
        stream = await super().completions(request, raw_request_info)
        return stream if echo is None or not request.echo else echo.fix(stream)


class _Echo:
    """Correct an echoed response whose prompts were given as text: each choice's text starts with the
    prompt as the client sent it, and its logprobs leave out the EOS Conduit put before it (the prompt's
    first token, which then has no context of its own, gets null, as OpenAI and Conduit's engine give it)."""

    def __init__(self, texts: list[str], echoed: list[str], n: int):
        self.texts, self.echoed, self.n = texts, echoed, n

    def _choice(self, index: int, text: str, lp: dict | None) -> tuple[str, dict | None]:
        prompt, echoed = self.texts[index // self.n], self.echoed[index // self.n]
        if text.startswith(echoed):
            text = prompt + text[len(echoed):]
        if lp and lp.get("tokens"):
            shift = len(prompt) - len(echoed)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if lp.get(name):
                    del lp[name][0]
            if lp.get("text_offset"):
                lp["text_offset"] = [max(0, o + shift) for o in lp["text_offset"]]
            if lp.get("token_logprobs"):
                lp["token_logprobs"][0] = None
                lp["top_logprobs"][0] = None
        return text, lp

    async def fix(self, stream):
        first: set[int] = set()  # streamed: the choices whose echo event has been corrected
        async for item in stream:
            if isinstance(item, list):  # streamed events, "data: {json}\n\n"
                out = []
                for line in item:
                    if isinstance(line, str) and line.startswith("data: {"):
                        chunk = json.loads(line[len("data: "):])
                        for c in chunk.get("choices", []):
                            if c["index"] not in first:
                                first.add(c["index"])
                                c["text"], c["logprobs"] = self._choice(c["index"], c["text"], c.get("logprobs"))
                        line = f"data: {json.dumps(chunk)}\n\n"
                    out.append(line)
                yield out
                continue
            for c in getattr(item, "choices", None) or []:
                lp = None if c.logprobs is None else c.logprobs.model_dump()
                c.text, lp = self._choice(c.index, c.text, lp)
                if lp is not None:
                    c.logprobs = type(c.logprobs).model_validate(lp)
            yield item


class ConduitIngress(OpenAiIngress):
    """The OpenAI ingress of one registered version, with ``/healthz`` and the version header."""

    def __init__(self, llm_deployments, model_cards, *, conduit: dict, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._version = str(conduit["version"])
        self._model_name = conduit["model_name"]
        self._answered = {"ok": 0, "errors": 0}
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._in_flight = 0
        self._most_in_flight = 0

    def _mark(self, response: Response) -> Response:
        response.headers[VERSION_HEADER] = self._version
        return response

    async def _counted(self, handler, body, request: Request) -> Response:
        t0 = time.perf_counter()
        self._in_flight += 1
        self._most_in_flight = max(self._most_in_flight, self._in_flight)
        try:
            response = await handler(body, request)
        except Exception:
            self._answered["errors"] += 1
            raise
        finally:
            self._in_flight -= 1
        ok = response.status_code == 200
        self._answered["ok" if ok else "errors"] += 1
        if ok:
            self._latencies.append(time.perf_counter() - t0)
        return self._mark(response)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._counted(super().completions, body, request)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._counted(super().chat, body, request)

    async def models(self):
        return self._mark(JSONResponse((await super().models()).model_dump()))

    async def healthz(self) -> JSONResponse:
        p50 = statistics.median(self._latencies) if self._latencies else None
        return self._mark(JSONResponse({
            "status": "ok", "engine": "vllm", "model": self._model_name, "version": int(self._version),
            "completions": {**self._answered, "p50_latency_s": p50},
            "batches": {"largest": self._most_in_flight, "in_flight": self._in_flight}}))


_VLLM_PARAMETER = re.compile(r"\(parameter=(\w+)")
# The request fields an error message may name (OpenAI's completions and chat fields and vLLM's own
# sampling fields): the first one named, as a word, is the error's param when vLLM does not say it.
REQUEST_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of",
                  "stop", "seed", "logprobs", "top_logprobs", "echo", "stream", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logit_bias", "suffix", "messages", "prompt", "model")
_NAMED_FIELD = re.compile(r"\b(" + "|".join(REQUEST_FIELDS) + r")\b")


def openai_error(status: int, raw: object) -> dict:
    """An error answer's body (``raw``: its JSON, or its text) in OpenAI's shape (the module docstring)."""
    message, param, code = None, None, None
    if isinstance(raw, dict) and isinstance(raw.get("error"), dict):
        error = raw["error"]
        message = error.get("message")
        code = error.get("code") if isinstance(error.get("code"), str) else None
    elif isinstance(raw, dict) and "detail" in raw:
        message = raw["detail"]
    message = message if isinstance(message, str) else json.dumps(raw) if not isinstance(raw, str) else raw
    said = _VLLM_PARAMETER.search(message)
    if status == 404 and "model" in message.lower():
        param, code = "model", "model_not_found"
    elif "maximum context length" in message:
        param, code = "prompt", "context_length_exceeded"
    elif said:
        param = said.group(1)
    elif status < 500 and (named := _NAMED_FIELD.search(message)):
        param = named.group(1)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, param, code, kind).body()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that does not parse as the request's model: 400 naming the field (the first error's place)."""
    errors = exc.errors() or [{"msg": "invalid request", "loc": ("body",)}]
    where = [part for part in errors[0].get("loc", ()) if isinstance(part, str) and part != "body"]
    param = where[0] if where else None
    message = f"{param}: {errors[0].get('msg')}" if param else str(errors[0].get("msg"))
    return JSONResponse(ApiError(400, message, param).body(), status_code=400)


async def _openai_errors(request: Request, call_next) -> Response:
    """Every error answer (4xx, 5xx) in OpenAI's shape; the rest as they are."""
    response = await call_next(request)
    if response.status_code < 400 or "json" not in response.headers.get("content-type", ""):
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])
    try:
        raw = json.loads(body)
    except ValueError:
        raw = body.decode("utf-8", errors="replace")
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(openai_error(response.status_code, raw), status_code=response.status_code, headers=headers)


def ingress_class():
    """``ConduitIngress`` as a FastAPI ingress: Ray Serve LLM's routes plus ``/healthz``, its errors in OpenAI's
    shape (``openai_error``)."""
    default_endpoints, init = serve_llm_ingress_app()
    app = init()  # Ray Serve LLM's app, its middleware included
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.middleware("http")(_openai_errors)  # added last: the outermost, it sees every answer
    endpoints = {**default_endpoints, "healthz": lambda app: app.get("/healthz")}
    return make_fastapi_ingress(ConduitIngress, endpoint_map=endpoints, app=app)


__all__ = ["ConduitIngress", "ConduitLLMServer", "VersionFiles", "fetch_version_files", "ingress_class",
           "openai_error"]

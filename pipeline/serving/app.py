"""The Ray Serve replica: one registered model version behind an OpenAI-compatible HTTP API.

Each replica loads exactly one version (``ServeTarget``) when it starts and serves it for its whole
life; a new champion means new replicas (``pipeline.serving.deploy`` redeploys, and Serve rolls them over with
a surge: new replicas start and become ready before the old ones drain and stop). So every response
comes from one version, and says which: ``conduit_version`` in the JSON body and the
``x-conduit-version`` header.

Concurrent requests (and the ``n`` choices and several prompts of one request) are batched by
``@serve.batch`` into one left-padded call of ``pipeline.inference.batched.generate_batch``, which runs
in a worker thread so that the replica's event loop keeps accepting requests meanwhile. ``/healthz``
says what batching did on the replica that answers: batched calls, the rows they held, the largest.

Routes: POST /v1/completions, GET /v1/models, GET /healthz (also what the replica answered: completions
served and refused or failed, and their p50 latency, for ``jobs.deploy``'s status line). (No
``from __future__ import annotations``: FastAPI must see the ``Request`` annotation as the class, not a
string, through Serve's ingress wrapper.)
"""


import asyncio
import collections
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from pipeline import tracking
from pipeline.serving import openai_api, pyfunc, request_limits
from pipeline.inference.batched import GenRequest, generate_batch
from pipeline.inference.generator import PromptError
from pipeline.inference.scoring import can_score, score_tokens
from pipeline.serving.openai_api import ApiError, Choice, CompletionRequest
from pipeline.tokenization.spm import EOS_ID

VERSION_HEADER = "x-conduit-version"
LATENCY_WINDOW = 200  # completions whose latency /healthz's p50 covers


@dataclass(frozen=True)
class ServeTarget:
    """Which registered version a replica serves, and where the registry is."""

    tracking_uri: str
    model_name: str
    version: int


def load_target(target: ServeTarget):
    """Download the version from the registry and build its ``TextGenerator``.

    Raises:
        LookupError: the registry has no such version.
    """
    tracking.get_version(target.tracking_uri, target.model_name, target.version)  # a clear error first
    with tempfile.TemporaryDirectory(prefix="conduit-serve-") as tmp:
        local = tracking.download_model(target.tracking_uri, f"models:/{target.model_name}/{target.version}", tmp)
        return pyfunc.generator_from_model_dir(local)  # reads the files; nothing is kept open


def text_pieces(sp, ids: list[int]) -> list[str]:
    """The text of each new token as it extends the decoded text (sentencepiece joins pieces, so a
    token's text depends on what precedes it); concatenated they are ``sp.decode(ids)``."""
    pieces, before = [], ""
    for k in range(1, len(ids) + 1):
        text = sp.decode(ids[:k])
        pieces.append(text[len(before):])
        before = text
    return pieces


async def read_body(request: Request, limit: int = request_limits.MAX_REQUEST_BYTES) -> bytes:
    """The request body, refused as soon as it is known to exceed ``limit`` bytes (by its
    Content-Length, else while it streams in), so that no large body is held or parsed.

    Raises:
        ApiError: 413 naming the limit.
    """
    too_large = ApiError(413, f"the request body exceeds {limit} bytes", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


app = FastAPI(title="Conduit", docs_url=None, redoc_url=None)


@serve.deployment(max_surge_percent=100)
@serve.ingress(app)
class ConduitServer:
    """A replica of the deployment: the version's generator plus the batching queue."""

    def __init__(self, target: ServeTarget, max_batch_size: int, batch_wait_timeout_s: float):
        self.target = target
        self.generator = load_target(target)
        if torch.cuda.is_available():  # Ray shows a replica only the GPUs it asked for (num_gpus)
            self.generator.model.to("cuda")
        self.loaded_at = int(time.time())
        self.batches = {"calls": 0, "rows": 0, "largest": 0}  # what batching did, for /healthz
        # What this replica answered, for /healthz (jobs.deploy's status line): completions answered and
        # refused or failed, and the latency of the last LATENCY_WINDOW answered ones.
        self.answered = {"ok": 0, "errors": 0}
        self.latencies_s: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._generate.set_max_batch_size(max_batch_size)
        self._generate.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def _generate(self, requests: list[GenRequest]) -> list[list[int]]:
        b = self.batches
        b["calls"], b["rows"], b["largest"] = b["calls"] + 1, b["rows"] + len(requests), max(b["largest"], len(requests))
        return await asyncio.to_thread(generate_batch, self.generator.model, requests, EOS_ID)

    def _headers(self) -> dict[str, str]:
        return {VERSION_HEADER: str(self.target.version)}

    def _error(self, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=self._headers())

    def _prompt_ids(self, i: int, prompt: str | tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """The ids the model sees for prompt ``i``, and how many of them lead it without being its own:
        a text prompt starts a new document (after an EOS), as in training; token ids are taken as they are."""
        if isinstance(prompt, str):
            try:  # by its characters first: a prompt far too long is never tokenized
                self.generator.check_prompt_length(i, prompt)
            except PromptError as e:
                raise ApiError(400, str(e), "prompt", "context_length_exceeded") from e
            return (EOS_ID, *self.generator.sp.encode(prompt)), 1
        vocab = self.generator.model.cfg.vocab_size
        outside = [t for t in prompt if t >= vocab]
        if outside:
            raise ApiError(400, f"prompt {i} has token id {outside[0]}, outside this model's vocabulary "
                                f"[0, {vocab})", "prompt")
        return prompt, 0

    def _rows(self, req: CompletionRequest) -> tuple[list[GenRequest], list[tuple[tuple[int, ...], int]], int]:
        """One ``GenRequest`` per (prompt, choice), prompt-major as OpenAI numbers choices; each row's
        prompt ids and their leading non-prompt count; and the number of prompt tokens."""
        max_len = self.generator.max_seq_len
        if (req.echo or req.logprobs is not None) and not can_score(self.generator.model):
            raise ApiError(400, "echo and logprobs need a decoder-only model; this one is an encoder-decoder",
                           "logprobs" if req.logprobs is not None else "echo")
        rows, sources, prompt_tokens = [], [], 0
        base_seed = random.getrandbits(31) if req.seed is None else req.seed
        for i, prompt in enumerate(req.prompts):
            ids, lead = self._prompt_ids(i, prompt)
            prompt_tokens += len(ids) - lead
            if len(ids) + req.max_tokens > max_len:
                param = "max_tokens" if len(ids) < max_len else "prompt"
                raise ApiError(400, f"this model's maximum context length is {max_len} tokens; prompt {i} is "
                                    f"{len(ids) - lead} tokens (+{lead} for the start of text) and max_tokens is "
                                    f"{req.max_tokens}", param, "context_length_exceeded")
            for j in range(req.n):
                rows.append(GenRequest(ids, req.max_tokens, req.temperature, req.top_p, base_seed + i * req.n + j))
                sources.append((ids, lead))
        return rows, sources, prompt_tokens

    def _choice(self, ids: list[int], req: CompletionRequest) -> tuple[Choice, list[str]]:
        """The choice's text cut at a stop sequence, and its pieces (one per kept token, the last shortened
        to the cut; a token made entirely of the stop sequence is not kept)."""
        pieces = text_pieces(self.generator.sp, ids)
        text, cut = openai_api.apply_stop("".join(pieces), req.stop)
        if cut:  # keep the pieces up to the stop sequence, the last one shortened
            kept, length = [], 0
            for p in pieces:
                if length + len(p) >= len(text):
                    kept.append(text[length:])
                    break
                kept.append(p)
                length += len(p)
            while kept and not kept[-1]:
                kept.pop()
            pieces = kept
        reason = "stop" if cut or len(ids) < req.max_tokens else "length"
        return Choice(text, reason, len(ids)), pieces

    def _with_logprobs(self, choice: Choice, pieces: list[str], new_ids: list[int], source: tuple[tuple[int, ...], int],
                       req: CompletionRequest) -> Choice:
        """``choice`` with the prompt before it (``echo``) and the ``logprobs`` object (``logprobs``)."""
        prompt_ids, lead = source
        sp = self.generator.sp
        # A completion that ended on the end of text lists that token last (no text), as OpenAI-style
        # servers do: a harness that asks for one token and drops the last entry then drops that one.
        ended_on_eos = len(new_ids) < req.max_tokens and choice.text == "".join(text_pieces(sp, new_ids))
        pieces = [*pieces, ""] if ended_on_eos else pieces
        full = [*prompt_ids, *new_ids[:len(pieces)], *([EOS_ID] if ended_on_eos else [])]
        first = lead if req.echo else len(prompt_ids)  # the first token returned
        prompt_pieces = text_pieces(sp, list(prompt_ids[lead:])) if req.echo else []
        text = "".join(prompt_pieces) + choice.text
        if req.logprobs is None:
            return Choice(text, choice.finish_reason, choice.completion_tokens)
        scores = score_tokens(self.generator.model, full, req.logprobs) if len(full) > 1 else None
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        for t in range(first, len(full)):
            if t == first and req.echo:  # the first prompt token: no log-probability (OpenAI's null)
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(scores.logprobs[t - 1])
            top.append({sp.id_to_piece(a).replace("\u2581", " "): v for a, v in scores.top[t - 1]})
        body = openai_api.logprobs_body([*prompt_pieces, *pieces], token_logprobs, top)
        return Choice(text, choice.finish_reason, choice.completion_tokens, body)

    @app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        latency = statistics.median(self.latencies_s) if self.latencies_s else None
        return JSONResponse({"status": "ok", "model": self.target.model_name, "version": self.target.version,
                             "batches": self.batches, "completions": {**self.answered, "p50_latency_s": latency}},
                            headers=self._headers())

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        body = openai_api.models_body(self.target.model_name, self.target.version, self.loaded_at)
        return JSONResponse(body, headers=self._headers())

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        t0 = time.perf_counter()
        try:
            response = await self._complete(request)
        except Exception:
            self.answered["errors"] += 1
            raise
        if response.status_code == 200:
            self.answered["ok"] += 1
            self.latencies_s.append(time.perf_counter() - t0)  # to the response (a stream: to its start)
        else:
            self.answered["errors"] += 1
        return response

    async def _complete(self, request: Request):
        try:
            req = openai_api.parse_completion_request(await read_body(request))
            if req.model is not None and req.model != self.target.model_name:
                raise ApiError(404, f"the model {req.model!r} does not exist here; this deployment serves "
                                    f"{self.target.model_name!r}", "model", "model_not_found")
            rows, sources, prompt_tokens = self._rows(req)
        except ApiError as e:
            return self._error(e)
        outputs = await asyncio.gather(*(self._generate(r) for r in rows))
        choices = [self._choice(ids, req) for ids in outputs]
        if req.echo or req.logprobs is not None:  # one scoring pass per choice, off the event loop
            choices = [(await asyncio.to_thread(self._with_logprobs, c, pieces, ids, source, req), pieces)
                       for (c, pieces), ids, source in zip(choices, outputs, sources)]
        cid, name, version = openai_api.completion_id(), self.target.model_name, self.target.version
        if not req.stream:
            body = openai_api.completion_body(cid, name, version, [c for c, _ in choices], prompt_tokens)
            return JSONResponse(body, headers=self._headers())

        def events():
            for index, (choice, pieces) in enumerate(choices):
                yield from openai_api.stream_events(cid, name, version, index, [p for p in pieces if p],
                                                    choice.finish_reason)
            yield openai_api.DONE_EVENT

        return StreamingResponse(events(), media_type="text/event-stream", headers=self._headers())


def build(target: ServeTarget, *, num_replicas: int, num_cpus: float, num_gpus: float, max_ongoing_requests: int,
          max_batch_size: int, batch_wait_timeout_s: float):
    """The Serve application for ``target`` with the deployment's resources and batching.

    Returns:
        A bound application for ``serve.run``.
    """
    return ConduitServer.options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
    ).bind(target, max_batch_size, batch_wait_timeout_s)


def app_builder(args: dict):
    """The application for a declarative Serve config (KubeRay's ``serveConfigV2``, ``serve deploy``):
    ``import_path: pipeline.serving.app:app_builder``. Replicas and resources come from the config's
    ``deployments`` section, as Serve applies them over the code's defaults.

    Args:
        args: ``model`` (``NAME@ALIAS``, resolved now, or ``NAME/VERSION``); ``tracking_uri`` (default
            ``$MLFLOW_TRACKING_URI``); optional ``max_batch_size`` (16) and ``batch_wait_timeout_s`` (0.01);
            ``revision``, unused: a counter to bump so that KubeRay sees a new config (a new champion).

    Raises:
        ValueError: a missing or unknown argument, or no tracking URI.
        LookupError: the model, alias or version does not exist.
    """
    known = {"model", "tracking_uri", "max_batch_size", "batch_wait_timeout_s", "revision"}
    if "model" not in args or set(args) - known:
        raise ValueError(f"app_builder args need 'model' and take only {sorted(known)}; got {sorted(args)}")
    uri = args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError("app_builder needs args.tracking_uri or $MLFLOW_TRACKING_URI (the MLflow server)")
    model = str(args["model"])
    if "@" in model:
        name, alias = model.rsplit("@", 1)
        held = tracking.version_by_alias(uri, name, alias)
        if held is None:
            raise LookupError(f"model {name!r} has no alias {alias!r} (at {uri})")
        version = held.version
    else:
        name, _, number = model.rpartition("/")
        if not name or not number.isdigit():
            raise ValueError(f"app_builder args.model={model!r} must look like NAME@ALIAS or NAME/VERSION")
        version = tracking.get_version(uri, name, int(number)).version
    return ConduitServer.bind(ServeTarget(uri, name, version), int(args.get("max_batch_size", 16)),
                              float(args.get("batch_wait_timeout_s", 0.01)))


__all__ = ["app_builder", "ConduitServer", "ServeTarget", "VERSION_HEADER", "build", "load_target", "text_pieces"]

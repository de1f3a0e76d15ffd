"""The Ray Serve replica: one registered model version behind an OpenAI-compatible HTTP API.

Each replica loads exactly one version (``ServeTarget``) when it starts and serves it for its whole
life; a new champion means new replicas (``pipeline.serving.deploy`` redeploys, and Serve rolls them over with
a surge: new replicas start and become ready before the old ones drain and stop). So every response
comes from one version, and says which: ``conduit_version`` in the JSON body and the
``x-conduit-version`` header.

Generation is continuously batched (``pipeline.inference.engine.Engine``, on a thread of its own so
that the replica's event loop keeps accepting requests): a request (each of its ``n`` choices and
prompts a row) joins the running batch at its next step and leaves it when it ends, and each token goes
to its request as soon as it is made, so ``stream: true`` sends text as it is generated
(``pipeline.serving.streaming``: a character is never split, a stop sequence is never half sent). A
client that goes away stops its rows at the engine's next step. ``deploy.batching: static`` keeps the
earlier behaviour (a batch forms when the engine is idle and runs until its last row ends).
``/healthz`` says what batching did on the replica that answers.

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
from pipeline.inference.requests import GenRequest
from pipeline.inference.engine import FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, Engine
from pipeline.inference.generator import PromptError
from pipeline.inference.scoring import can_score, score_tokens
from pipeline.serving.openai_api import VERSION_HEADER, ApiError, Choice, CompletionRequest
from pipeline.serving.streaming import ChoiceText, text_pieces
from pipeline.tokenization.spm import EOS_ID

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

    def __init__(self, target: ServeTarget, max_batch_size: int, batch_wait_timeout_s: float,
                 max_batch_tokens: int | None = None, batching: str = "continuous"):
        self.target = target
        self.generator = load_target(target)
        if torch.cuda.is_available():  # Ray shows a replica only the GPUs it asked for (num_gpus)
            self.generator.model.to("cuda")
        self.loaded_at = int(time.time())
        # The engine's thread leaves (queue, item) here; one wake-up of the event loop per step delivers them.
        self._outbox: collections.deque = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self.engine = Engine(self.generator.model, EOS_ID, max_rows=max_batch_size, max_batch_tokens=max_batch_tokens,
                                 join_running=batching == "continuous", wait_s=batch_wait_timeout_s,
                                 on_step=self._after_step)
        except ValueError as e:
            raise ValueError(f"deploy.max_batch_tokens: {e}") from e
        self.engine.start()
        # What this replica answered, for /healthz (jobs.deploy's status line): completions answered and
        # refused or failed, and the latency of the last LATENCY_WINDOW answered ones.
        self.answered = {"ok": 0, "errors": 0}
        self.latencies_s: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)

    def inject_step_faults(self, count: int, after: int = 0) -> None:
        """A fault drill, through a deployment handle (never over HTTP): after ``after`` more forward
        passes, the model's next ``count`` raise, as a failing device or kernel would. The requests in those steps get the
        error (a 500 ``server_error``, or a stream's error event); the engine drops their rows and goes
        on with the next. tests/jobs/test_deploy.py drills it; docs/reliability.md lists the fault."""
        model = self.generator.model
        forward = type(model).forward.__get__(model)
        left, skip = [count], [after]

        def failing(*args, **kwargs):
            if skip[0] > 0:
                skip[0] -= 1
            elif left[0] > 0:
                left[0] -= 1
                raise RuntimeError(f"injected fault: forward pass {count - left[0]} of {count} failed")
            return forward(*args, **kwargs)

        model.forward = failing

    def _after_step(self) -> None:  # the engine's thread
        if self._outbox and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # the event loop
        while self._outbox:
            queue, item = self._outbox.popleft()
            queue.put_nowait(item)

    async def _choices(self, rows: list[GenRequest], texts: list[ChoiceText], reasons: list[str | None],
                       eos_ended: list[bool], tickets: list | None = None):
        """Run ``rows`` on the engine: yields ``(index, text)`` as each choice's text becomes final, and
        fills ``reasons`` (``stop`` or ``length``) and ``eos_ended`` as the choices end. A choice that meets
        a stop sequence is stopped; leaving early (a client gone) stops every row still running. The
        engine's tickets, one per row, go into ``tickets`` when given (their ``scores``).

        Raises:
            RuntimeError: the model failed on a row.
        """
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:  # the engine's thread; delivered after its step (_after_step)
            self._outbox.append((queue, item))

        tickets = [] if tickets is None else tickets
        try:
            for i, row in enumerate(rows):
                tickets.append(self.engine.submit(row, on_token=lambda tok, i=i: put((i, tok, None)),
                                                  on_done=lambda reason, err, i=i: put((i, None, (reason, err)))))
            while any(r is None for r in reasons):
                i, tok, done = await queue.get()
                if reasons[i] is not None:  # ended at a stop sequence: what the engine made since is dropped
                    continue
                text = texts[i]
                if tok is not None:
                    piece = text.add(tok)
                    if piece:
                        yield i, piece
                    if text.stopped:
                        tickets[i].cancel()
                        reasons[i] = "stop"
                    continue
                reason, err = done
                if reason == FINISH_ERROR:
                    raise RuntimeError(f"generation failed: {type(err).__name__}: {err}") from err
                piece = text.finish()
                if piece:
                    yield i, piece
                reasons[i] = "length" if reason == FINISH_LENGTH and not text.stopped else "stop"
                eos_ended[i] = reason == FINISH_EOS
        finally:
            for t in tickets:  # a client gone or a failure: what still runs stops at the next step
                t.cancel()

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
            for j in range(req.n):  # streamed logprobs come from the engine's own logits as it samples
                rows.append(GenRequest(ids, req.max_tokens, req.temperature, req.top_p, base_seed + i * req.n + j,
                                       logprobs=req.logprobs if req.stream else None))
                sources.append((ids, lead))
        return rows, sources, prompt_tokens

    def _choice(self, text: ChoiceText, reason: str) -> tuple[Choice, list[str]]:
        """The choice, and its pieces (one per kept token, the last shortened to a stop sequence's cut;
        a token made entirely of the stop sequence is not kept)."""
        ids = text.ids[:text.kept]
        pieces = text_pieces(self.generator.sp, ids)
        if text.stopped:  # keep the pieces up to the stop sequence, the last one shortened
            kept, length = [], 0
            for p in pieces:
                if length + len(p) >= len(text.text):
                    kept.append(text.text[length:])
                    break
                kept.append(p)
                length += len(p)
            while kept and not kept[-1]:
                kept.pop()
            pieces = kept
        return Choice(text.text, reason, len(ids)), pieces

    def _with_logprobs(self, choice: Choice, pieces: list[str], new_ids: list[int], source: tuple[tuple[int, ...], int],
                       req: CompletionRequest, ended_on_eos: bool) -> Choice:
        """``choice`` with the prompt before it (``echo``) and the ``logprobs`` object (``logprobs``).
        A completion that ended on the end of text lists that token last (no text), as OpenAI-style
        servers do: a harness that asks for one token and drops the last entry then drops that one."""
        prompt_ids, lead = source
        sp = self.generator.sp
        pieces = [*pieces, ""] if ended_on_eos else pieces
        full = [*prompt_ids, *new_ids[:len(pieces)], *([EOS_ID] if ended_on_eos else [])]
        first = lead if req.echo else len(prompt_ids)  # the first token returned
        prompt_pieces = text_pieces(sp, list(prompt_ids[lead:])) if req.echo else []
        text = "".join(prompt_pieces) + choice.text
        if req.logprobs is None:
            return Choice(text, choice.finish_reason, choice.completion_tokens)
        lps, tops = self._scored(full, first, req.logprobs, null_first=req.echo)
        body = openai_api.logprobs_body([*prompt_pieces, *pieces], lps, tops)
        return Choice(text, choice.finish_reason, choice.completion_tokens, body)

    def _scored(self, ids: list[int] | tuple[int, ...], first: int, k: int,
                null_first: bool) -> tuple[list[float | None], list[dict[str, float] | None]]:
        """Log-probabilities and top-k entries of ``ids[first:]`` from one scoring pass over ``ids``; with
        ``null_first`` the first is None (an echoed first prompt token has no context: OpenAI's null)."""
        scores = score_tokens(self.generator.model, ids, k) if len(ids) > 1 else None
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for t in range(first, len(ids)):
            null = t == first and null_first
            lps.append(None if null else scores.logprobs[t - 1])
            tops.append(None if null else self._top(scores.top[t - 1]))
        return lps, tops

    def _top(self, pairs: list[tuple[int, float]]) -> dict[str, float]:
        """The ``top_logprobs`` entry of one position: each likely token's piece (spaces as spaces)."""
        return {self.generator.sp.id_to_piece(a).replace("\u2581", " "): v for a, v in pairs}

    def _echo_events(self, req: CompletionRequest, sources: list[tuple[tuple[int, ...], int]]):
        """A streamed ``echo``: per choice, its prompt's text (with ``logprobs``, the prompt tokens' own) as
        an event, and that text's length, where the completion's text offsets start."""
        events, starts = [], []
        for i, (prompt_ids, lead) in enumerate(sources):
            pieces = text_pieces(self.generator.sp, list(prompt_ids[lead:]))
            starts.append(sum(len(p) for p in pieces))
            body = None
            if req.logprobs is not None:
                body = openai_api.logprobs_body(pieces, *self._scored(prompt_ids, lead, req.logprobs, null_first=True))
            events.append((i, "".join(pieces), body))
        return events, starts

    @app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        latency = statistics.median(self.latencies_s) if self.latencies_s else None
        return JSONResponse({"status": "ok", "model": self.target.model_name, "version": self.target.version,
                             "batches": dict(self.engine.stats), "completions": {**self.answered, "p50_latency_s": latency}},
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
        cid, name, version = openai_api.completion_id(), self.target.model_name, self.target.version
        texts = [ChoiceText(self.generator.sp, req.stop, incremental=req.stream) for _ in rows]
        reasons: list[str | None] = [None] * len(rows)
        eos_ended = [False] * len(rows)
        if req.stream:
            return StreamingResponse(self._stream(cid, rows, texts, reasons, eos_ended, prompt_tokens, req, sources),
                                     media_type="text/event-stream", headers=self._headers())
        try:
            async for _ in self._choices(rows, texts, reasons, eos_ended):
                pass
        except RuntimeError as e:
            return self._error(ApiError(500, str(e), None, None, "server_error"))
        choices = [self._choice(text, reason) for text, reason in zip(texts, reasons)]
        if req.echo or req.logprobs is not None:  # one scoring pass per choice, off the event loop
            choices = [(await asyncio.to_thread(self._with_logprobs, c, pieces, text.ids[:text.kept], source, req, eos),
                        pieces)
                       for (c, pieces), text, source, eos in zip(choices, texts, sources, eos_ended)]
        body = openai_api.completion_body(cid, name, version, [c for c, _ in choices], prompt_tokens)
        return JSONResponse(body, headers=self._headers())

    async def _stream(self, cid: str, rows: list[GenRequest], texts: list[ChoiceText], reasons: list[str | None],
                      eos_ended: list[bool], prompt_tokens: int, req: CompletionRequest,
                      sources: list[tuple[tuple[int, ...], int]]):
        """Server-sent events: with ``echo`` each choice's prompt first, then each choice's text as it is
        generated, its end (the last one with the usage), then [DONE]. With ``logprobs`` every event
        carries the logprobs object of the tokens it reports: a text event those whose text has now been
        sent in full (a token whose text is held, a character's first bytes or a possible stop sequence,
        goes with a later event), the end of a choice the rest (its last token cut at a stop sequence, an
        ending EOS as an empty token), so that together they are the non-streamed response's. A client
        that disconnects closes this generator: its rows stop."""
        name, version, created = self.target.model_name, self.target.version, int(time.time())
        ended = [False] * len(rows)
        tickets: list = []
        reported = [0] * len(rows)  # tokens whose logprobs have been sent, per choice

        def logprobs_of(i: int, final: bool) -> dict | None:
            if req.logprobs is None:
                return None
            text = texts[i]
            if final:
                _, pieces = self._choice(text, reasons[i])
                pieces = [*pieces, ""] if eos_ended[i] else pieces
            else:
                pieces, at = [], 0
                for p in text_pieces(self.generator.sp, text.ids[:text.kept]):
                    if at + len(p) > len(text.sent):
                        break
                    pieces.append(p)
                    at += len(p)
            first, scores = reported[i], tickets[i].scores
            reported[i] = max(first, len(pieces))
            new = range(first, len(pieces))
            return openai_api.logprobs_body([pieces[t] for t in new], [scores[t][0] for t in new],
                                            [self._top(scores[t][1]) for t in new],
                                            start=starts[i] + sum(len(p) for p in pieces[:first]))

        def endings():
            for i, reason in enumerate(reasons):
                if reason is not None and not ended[i]:
                    ended[i] = True
                    usage = (openai_api.usage_body(prompt_tokens, sum(t.kept for t in texts))
                             if all(ended) else None)
                    yield openai_api.stream_chunk(cid, name, version, created, i, "", reason, usage,
                                                  logprobs_of(i, final=True))

        try:
            echoed, starts = (await asyncio.to_thread(self._echo_events, req, sources) if req.echo
                              else ([], [0] * len(rows)))
            for i, text, body in echoed:
                yield openai_api.stream_chunk(cid, name, version, created, i, text, logprobs=body)
            async for i, piece in self._choices(rows, texts, reasons, eos_ended, tickets):
                yield openai_api.stream_chunk(cid, name, version, created, i, piece,
                                              logprobs=logprobs_of(i, final=False))
                for event in endings():
                    yield event
            for event in endings():
                yield event
        except RuntimeError as e:
            yield openai_api.error_event(str(e))
        yield openai_api.DONE_EVENT


def build(target: ServeTarget, *, num_replicas: int, num_cpus: float, num_gpus: float, max_ongoing_requests: int,
          max_batch_size: int, batch_wait_timeout_s: float, max_batch_tokens: int | None = None,
          batching: str = "continuous"):
    """The Serve application for ``target`` with the deployment's resources and batching.

    Returns:
        A bound application for ``serve.run``.
    """
    return ConduitServer.options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
    ).bind(target, max_batch_size, batch_wait_timeout_s, max_batch_tokens, batching)


def app_builder(args: dict):
    """The application for a declarative Serve config (KubeRay's ``serveConfigV2``, ``serve deploy``):
    ``import_path: pipeline.serving.app:app_builder``. Replicas and resources come from the config's
    ``deployments`` section, as Serve applies them over the code's defaults.

    Args:
        args: ``model`` (``NAME@ALIAS``, resolved now, or ``NAME/VERSION``); ``tracking_uri`` (default
            ``$MLFLOW_TRACKING_URI``); optional ``max_batch_size`` (16), ``max_batch_tokens`` (65536),
            ``batching`` (``continuous`` or ``static``) and ``batch_wait_timeout_s`` (0.01, static only);
            ``revision``, unused: a counter to bump so that KubeRay sees a new config (a new champion).

    Raises:
        ValueError: a missing or unknown argument, or no tracking URI.
        LookupError: the model, alias or version does not exist.
    """
    known = {"model", "tracking_uri", "max_batch_size", "batch_wait_timeout_s", "max_batch_tokens", "batching", "revision"}
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
    batching = str(args.get("batching", "continuous"))
    if batching not in ("continuous", "static"):
        raise ValueError(f"app_builder args.batching={batching!r} must be 'continuous' or 'static'")
    return ConduitServer.bind(ServeTarget(uri, name, version), int(args.get("max_batch_size", 16)),
                              float(args.get("batch_wait_timeout_s", 0.01)), int(args.get("max_batch_tokens", 65536)),
                              batching)


__all__ = ["app_builder", "ConduitServer", "ServeTarget", "VERSION_HEADER", "build", "load_target"]

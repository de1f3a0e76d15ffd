"""Continuous batching: requests join a running batch at its next step and leave it when they finish.

An ``Engine`` owns one model and a batch of row slots, each free or holding a running request with
its own prompt, budget, sampling and seed. Every ``step``:

1. rows whose client went away (``Ticket.cancel``) leave;
2. waiting requests are admitted, in arrival order, while the batch has room (``max_rows`` rows and
   ``max_batch_tokens`` KV slots, below): their prompts run as one left-padded forward, each samples
   its first token, and each takes a free row slot (``put_row``: its keys right-aligned at the
   batch's filled slots, the slots before them masked). Only when there is no free slot or no room
   is the cache rebuilt (``gather_rows``: the running rows and the joining ones, the slots no row
   uses dropped, with room to spare in rows and slots so that rebuilds stay rare);
3. every running row feeds its last token and samples the next (free slots are fed as pads); rows
   that end (EOS, budget) free their slot. A batch whose rows are mostly free, or whose filled slots
   are mostly ones no running row uses (rows that joined later start later), is rebuilt smaller.

Each row's tokens go to its ``on_token`` callback at the step that made them (streaming), and its end
to ``on_done``. A row sees only its own keys (pads, free slots and other rows' slots are masked;
positions count per row; dynamic NTK scales RoPE by each row's own length), and samples from its own
seeded generator, so it gets what it would get alone (greedy exactly; sampled too, up to floating-point
noise). A capacity-limited MoE (``moe_capacity_factor``) is served dropless (``serve_dropless``):
capacity counts every token of a forward, other rows' and pads included.

The bound: a batch of B rows whose cache holds C slots costs B * C slots of keys and values per layer.
A request is admitted only while the running rows and it, times the slots they use plus the most any
of them may still add, stay within ``max_batch_tokens`` (the head of the queue waits for room; later
requests do not overtake it); the spare rows and slots of a rebuild are cut to stay within it too.
A Mamba model's state does not grow with length; the same bound limits its rows.

``join_running=False`` is static batching (what ``@serve.batch`` did): a batch forms only when the
engine is empty (waiting up to ``wait_s`` for more requests), and later requests wait until its last
row has finished.

An encoder-decoder's requests run one at a time, each alone through ``models.families.encdec.model``; their tokens
arrive together when it finishes.

Threads: ``submit`` and ``Ticket.cancel`` may be called from any thread; ``step`` from one thread at a
time (``start`` runs it on a thread of its own). Callbacks run on the stepping thread.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.families import family
from models.generate import sample_next
from models.layers.attention import KVCache
from pipeline.inference.requests import GenRequest, check_fits, fill_spans, pad_left

FINISH_EOS, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "eos", "length", "cancelled", "error"
WASTE_SLOTS = 16  # filled slots no row uses that a KV cache may hold beyond as many as its rows use


def _ignore(*_args) -> None:
    return None


@dataclass(eq=False)
class Ticket:
    """A submitted request: its tokens so far (without the EOS), and how it ended once it has.

    Attributes:
        request: what was asked.
        tokens: the new token ids, appended as they are made.
        finish: None while running; then ``eos``, ``length``, ``cancelled`` or ``error``.
        error: the exception of an ``error`` finish.
        scores: with ``request.logprobs`` = k, per token made (the ending EOS too, after the others):
            its log-probability and the k most likely (id, log-probability) pairs at its position, most
            likely first; appended before the token's ``on_token``.
    """

    request: GenRequest
    on_token: Callable[[int], None] = _ignore
    on_done: Callable[[str, BaseException | None], None] = _ignore
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    steps_after_cancel: int = 0  # steps this row took after cancel() (what the server counts)
    scores: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    def cancel(self) -> None:
        """Stop generating for this request at the engine's next step (a client that went away)."""
        self.cancelled = True


@dataclass(eq=False)
class _Row:
    ticket: Ticket
    generator: torch.Generator
    last: int = 0  # the token to feed at the next step


def serve_dropless(model: torch.nn.Module) -> None:
    """Route every token to its experts: capacity (``moe_capacity_factor``) sizes each expert's slots
    from all the tokens of a forward, so in a batch a row's tokens would be dropped or kept depending
    on the rows beside it. Capacity is a training device; Hugging Face's and vLLM's Mixtral, which
    serve Conduit's exports, route dropless too."""
    for module in model.modules():
        if getattr(module, "capacity_factor", None) is not None:
            module.capacity_factor = None


class Engine:
    """A continuously batched generator over one model (see the module docstring).

    Args:
        model: a decoder (``models.Transformer``, ``MambaLM``) or an encoder-decoder, in eval mode.
        eos_id: the token that ends a row (not included in its tokens).
        max_rows: the most rows running at once.
        max_batch_tokens: the most KV slots of the whole batch (rows x cache slots); None: no bound.
            At least the model's ``max_seq_len``, so that any request that fits the model can run.
        join_running: False for static batching (a batch forms only when the engine is empty).
        wait_s: static batching only: how long an empty engine waits for a batch to fill.
        on_step: called (on the stepping thread) after each step that did something, after every
            callback of that step: one wake-up per step for a consumer on another thread.

    Raises:
        ValueError: ``max_rows`` below 1 or ``max_batch_tokens`` below ``max_seq_len``.
    """

    def __init__(self, model: torch.nn.Module, eos_id: int, *, max_rows: int = 16, max_batch_tokens: int | None = None,
                 join_running: bool = True, wait_s: float = 0.0, on_step: Callable[[], None] | None = None):
        cfg = model.cfg
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        if max_batch_tokens is not None and max_batch_tokens < cfg.max_seq_len:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be >= the model's max_seq_len "
                             f"({cfg.max_seq_len}), or a request that fits the model could never run")
        self.model, self.eos_id = model, eos_id
        serve_dropless(model)
        self.max_rows, self.max_batch_tokens = max_rows, max_batch_tokens
        self.join_running, self.wait_s, self.on_step = join_running, wait_s, on_step
        self.seq2seq = family(cfg).seq2seq
        self.device = model.tok_embeddings.weight.device
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._slots: list[_Row | None] = []  # the cache's rows: a running row, or free
        self._cache = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # What batching did, for /healthz: decode steps, prompt forwards that admitted rows, rows
        # admitted, the largest batch, rows stopped early by cancel() and the steps they took after it.
        self.stats = {"steps": 0, "joins": 0, "rows": 0, "largest": 0, "stopped": 0, "steps_after_cancel_max": 0,
                      "rebuilds": 0}

    # ---- from any thread ----------------------------------------------------------------------------
    def submit(self, request: GenRequest, on_token: Callable[[int], None] = _ignore,
               on_done: Callable[[str, BaseException | None], None] = _ignore) -> Ticket:
        """Queue a request; it joins the batch at the next step that has room.

        Raises:
            ValueError: a request that does not fit the model (``check_fits``).
        """
        check_fits(request, self.model.cfg.max_seq_len)
        ticket = Ticket(request, on_token, on_done)
        with self._cond:
            self._waiting.append(ticket)
            self._cond.notify_all()
        return ticket

    @property
    def busy(self) -> bool:
        """Rows running or waiting."""
        return bool(self._rows or self._waiting)

    def start(self) -> None:
        """Step on a daemon thread of its own whenever there is work (until ``stop``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="conduit-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self.busy and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                if not self.join_running and not self._rows and self.wait_s > 0:
                    # static batching: let the batch fill for up to wait_s from its first request
                    self._cond.wait_for(lambda: len(self._waiting) >= self.max_rows or self._stopping, self.wait_s)
            self.step()

    # ---- the stepping thread -------------------------------------------------------------------------
    def _remaining(self, row: _Row) -> int:
        return row.ticket.request.max_new_tokens - len(row.ticket.tokens)

    def _end(self, row: _Row, reason: str, error: BaseException | None = None) -> None:
        t = row.ticket
        t.finish, t.error = reason, error
        if reason == FINISH_CANCELLED:
            self.stats["stopped"] += 1
            self.stats["steps_after_cancel_max"] = max(self.stats["steps_after_cancel_max"], t.steps_after_cancel)
        t.on_done(reason, error)

    def _emit(self, row: _Row, token: int) -> bool:
        """Record the row's new token; True while the row goes on."""
        t = row.ticket
        if token == self.eos_id:
            self._end(row, FINISH_EOS)
            return False
        t.tokens.append(token)
        row.last = token
        t.on_token(token)
        if len(t.tokens) >= t.request.max_new_tokens:
            self._end(row, FINISH_LENGTH)
            return False
        return True

    def _sample(self, rows: list[_Row], logits_BV: torch.Tensor) -> list[bool]:
        """Each row's next token from its logits (greedy rows in one op; sampled rows one by one, each
        from its own generator); returns which rows go on."""
        logits_BV = logits_BV.float().cpu()
        greedy_B = logits_BV.argmax(dim=-1).tolist()
        going = []
        for i, row in enumerate(rows):
            r = row.ticket.request
            tok = greedy_B[i] if r.temperature == 0 else int(sample_next(
                logits_BV[i:i + 1], r.temperature, top_p=None if r.top_p >= 1.0 else r.top_p,
                generator=row.generator)[0])
            if r.logprobs is not None:
                logp_V = torch.log_softmax(logits_BV[i], dim=-1)
                top = logp_V.topk(r.logprobs) if r.logprobs else None
                row.ticket.scores.append((logp_V[tok].item(), [] if top is None else
                                          list(zip(top.indices.tolist(), top.values.tolist()))))
            going.append(self._emit(row, tok))
        return going

    def _fits(self, rows: int, filled: int, remaining: int) -> bool:
        if rows > self.max_rows:
            return False
        return self.max_batch_tokens is None or rows * (filled + remaining) <= self.max_batch_tokens

    @property
    def _rows(self) -> list[_Row]:
        """The running rows, in slot order."""
        return [r for r in self._slots if r is not None]

    def _live_index(self) -> torch.Tensor:
        return torch.tensor([i for i, r in enumerate(self._slots) if r is not None], dtype=torch.long)

    def _live_span(self) -> int:
        """Filled slots from the first that a running row uses (what a rebuilt cache would hold)."""
        return self._cache.span(self._live_index()) if self._rows else 0

    def _admissible(self) -> list[Ticket]:
        """Take the waiting requests that join now (arrival order; cancelled ones end here)."""
        with self._cond:
            running = self._rows
            if running and not self.join_running:
                return []
            taken: list[Ticket] = []
            filled = self._live_span()
            remaining = max((self._remaining(r) for r in running), default=0)
            while self._waiting:
                t = self._waiting[0]
                if t.cancelled:
                    self._waiting.popleft()
                    self._end(_Row(t, torch.Generator()), FINISH_CANCELLED)
                    continue
                r = t.request
                f, rem = max(filled, len(r.prompt_ids)), max(remaining, r.max_new_tokens)
                if self.seq2seq:
                    if taken or running:
                        break
                elif not self._fits(len(running) + len(taken) + 1, f, rem):
                    break
                taken.append(self._waiting.popleft())
                filled, remaining = f, rem
                if self.seq2seq:
                    break
            return taken

    def _rebuild(self, joining: list[_Row] = (), prompt_cache=None, prompt_rows: list[int] = ()) -> None:
        """A new cache of the running rows (and ``joining``, rows ``prompt_rows`` of ``prompt_cache``), the
        slots no row uses dropped, with room to spare so that the next joins and steps need no copy:
        twice the slots the rows may still need, and up to twice the rows (within ``max_rows`` and
        ``max_batch_tokens``)."""
        running = self._rows
        rows = running + list(joining)
        if not rows:
            self._slots, self._cache = [], None
            return
        parts = ([(self._cache, self._live_index())] if running else []) + (
            [(prompt_cache, torch.tensor(prompt_rows, dtype=torch.long))] if joining else [])
        cache_type = type(parts[0][0])
        span = max(c.span(idx) for c, idx in parts)
        need = span + max(self._remaining(r) for r in rows)
        slots, free = 2 * need, min(self.max_rows, 2 * len(rows)) - len(rows)
        if self.max_batch_tokens is not None:
            while free > 0 and (len(rows) + free) * slots > self.max_batch_tokens:
                free -= 1
            slots = max(need, min(slots, self.max_batch_tokens // (len(rows) + free)))
        self._cache = cache_type.gather_rows(parts, max_len=slots, free_rows=free)
        self._slots = rows + [None] * free
        self.stats["rebuilds"] += 1

    def _admit(self, tickets: list[Ticket]) -> None:
        """Run the joining prompts, sample their first tokens, and put their rows in free slots of the
        batch (or rebuild it when there are none, or no room)."""
        joining = [_Row(t, torch.Generator(device="cpu").manual_seed(t.request.seed)) for t in tickets]
        self.stats["joins"] += 1
        self.stats["rows"] += len(joining)
        # The running rows and the joining ones are in the batch now, also when the joining ones end at
        # their first token (lm-evaluation-harness's max_tokens 1 requests never reach a decode step).
        self.stats["largest"] = max(self.stats["largest"], len(self._rows) + len(joining))
        if self.seq2seq:  # one at a time, alone
            for row in joining:
                for tok in fill_spans(self.model, row.ticket.request, self.eos_id):
                    if not self._emit(row, tok):
                        break
                else:
                    self._end(row, FINISH_EOS)
            return
        requests = [t.request for t in tickets]
        ids_BT, mask_BT = pad_left(requests, self.device)
        prompt_cache = self.model.new_kv_cache(len(requests), max_len=ids_BT.shape[1])
        logits_BV = self.model(ids_BT, attention_mask_BT=mask_BT, kv_cache=prompt_cache).logits[:, -1, :]
        going = self._sample(joining, logits_BV)
        stay = [i for i, g in enumerate(going) if g]
        if not stay:
            return
        free = [k for k, r in enumerate(self._slots) if r is None]
        more = max(self._remaining(r) for r in self._rows + [joining[i] for i in stay])
        if self._cache is not None and len(free) >= len(stay) and all(
                self._cache.can_put(len(joining[i].ticket.request.prompt_ids), more) for i in stay):
            for k, i in zip(free, stay):
                self._cache.put_row(k, prompt_cache, i)
                self._slots[k] = joining[i]
        else:
            self._rebuild([joining[i] for i in stay], prompt_cache, stay)
        self.stats["largest"] = max(self.stats["largest"], len(self._rows))

    def _decode(self) -> None:
        """One token for every running row (free slots are fed as pads); the rows that end leave."""
        # Drop the slots no row uses when there is none left for this step, or when they have become
        # most of the cache (every step's attention reads them all: a copy costs about one such read).
        if not self._cache.can_put(0, 1) or (
                isinstance(self._cache, KVCache) and self._cache.length > 1.5 * self._live_span() + WASTE_SLOTS):
            self._rebuild()
        live = [i for i, r in enumerate(self._slots) if r is not None]
        rows = [self._slots[i] for i in live]
        for row in rows:
            if row.ticket.cancelled:
                row.ticket.steps_after_cancel += 1
        next_B1 = torch.tensor([[r.last if r is not None else 0] for r in self._slots], dtype=torch.long,
                               device=self.device)
        mask_B1 = torch.tensor([[r is not None] for r in self._slots], dtype=torch.long, device=self.device)
        logits_BV = self.model(next_B1, attention_mask_BT=mask_B1, kv_cache=self._cache).logits[:, -1, :]
        self.stats["steps"] += 1
        going = self._sample(rows, logits_BV if len(live) == len(self._slots) else logits_BV[live])
        for i, g in zip(live, going):
            if not g:
                self._slots[i] = None
        self._shrink()

    def _shrink(self) -> None:
        """Rebuild smaller when most slots are free (they cost compute every step), or empty the engine."""
        n = len(self._rows)
        if n == 0:
            self._slots, self._cache = [], None
        elif 4 * n <= len(self._slots):
            self._rebuild()

    def _drop_cancelled(self) -> None:
        for k, r in enumerate(self._slots):
            if r is not None and r.ticket.cancelled:
                self._end(r, FINISH_CANCELLED)
                self._slots[k] = None
        if self._slots:
            self._shrink()

    @torch.no_grad()
    def step(self) -> bool:
        """Admit what fits, then one token for every running row. Returns False when there was nothing
        to do. A failing forward ends every row it held with ``error`` (their ``on_done`` gets the
        exception) and leaves the engine empty and usable."""
        self._drop_cancelled()
        tickets = self._admissible()
        if not tickets and not self._rows:
            if self.on_step is not None:  # rows cancelled or ended while waiting may have said so
                self.on_step()
            return False
        try:
            if tickets:
                self._admit(tickets)
            if self._rows:
                self._decode()
        except Exception as e:  # noqa: BLE001 - every row of the failed batch hears of it
            failed = self._rows + [_Row(t, torch.Generator()) for t in tickets if t.finish is None
                                   and all(t is not r.ticket for r in self._rows)]
            self._slots, self._cache = [], None
            for row in failed:
                if row.ticket.finish is None:
                    self._end(row, FINISH_ERROR, e)
        if self.on_step is not None:
            self.on_step()
        return True

    def run_until_idle(self) -> None:
        """Step until nothing runs or waits (for callers without a thread: tests, batch generation)."""
        while self.step():
            pass


__all__ = ["Engine", "Ticket", "FINISH_CANCELLED", "FINISH_EOS", "FINISH_ERROR", "FINISH_LENGTH"]

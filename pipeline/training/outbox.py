"""Live metrics that never hold training up: rank 0 posts them here, a thread delivers them to MLflow.

Training must neither wait on nor die from tracking. A synchronous ``log_batch`` on rank 0 makes every
rank wait for it at the next all-reduce when the server is slow, and kills the worker when it is
down. The ``Outbox`` takes metrics and tags at once (they are stamped with the time they were
measured), and one background thread sends them in order, in batches. When a send fails (server
stopped, network gone, a 5xx) the batch stays at the head of the queue and is retried with backoff
until it goes through; so a server that comes back receives every step, in order. ``close`` waits a
bounded time for the rest and returns what could not be delivered (the caller still has it in
``train_metrics.json``).

With ``once_per_step`` (a metric every logged step has, ``loss``), a step reaches the run once: the
steps the run already holds when the outbox first delivers (an earlier attempt of the same training,
restarted from a checkpoint, logged them; the restart recomputes them bit-exactly) are not sent again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch


class MetricsSink(Protocol):
    """What the outbox sends to (``pipeline.stage_tracker.StageTracker``)."""

    uri: str

    def log_metric_records(self, records: list[tuple[str, float, int, int]]) -> None: ...

    def logged_steps(self, key: str) -> list[int]: ...

    def set_tags(self, tags: dict) -> None: ...


@dataclass
class _Item:
    """Metrics of one step (``records``: name, value, timestamp ms, step) or a set of tags."""

    records: list[tuple[str, float, int, int]] = field(default_factory=list)
    tags: dict | None = None


class Outbox:
    """Deliver metrics and tags to ``sink`` from a background thread, in order, retrying failures.

    Args:
        sink: where to send (``log_metric_records``, ``set_tags``).
        retry_s: the first wait after a failed send; doubled after each failure up to ``max_retry_s``.
        max_retry_s: the longest wait between two attempts.
    """

    def __init__(self, sink: MetricsSink, retry_s: float = 1.0, max_retry_s: float = 15.0,
                 once_per_step: str | None = None):
        # Its own retries, with backoff and a warning: the sink's calls should fail at once when the server is down.
        self._sink = sink.impatient() if hasattr(sink, "impatient") else sink
        self._once_key = once_per_step
        self._present: set[int] | None = None  # the steps the run held at the first delivery
        self._retry_s, self._max_retry_s = retry_s, max_retry_s
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.delivered_batches = 0
        self.failed_attempts = 0
        self.skipped_records = 0  # with once_per_step: records of steps the run already held
        self._thread = threading.Thread(target=self._run, name="conduit-metrics-outbox", daemon=True)
        self._thread.start()

    # ---- producer side: never blocks on the network -----------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue one step's metrics, stamped now."""
        now = int(time.time() * 1000)
        self._put(_Item(records=[(k, float(v), now, step) for k, v in metrics.items()]))

    def set_tags(self, tags: dict) -> None:
        """Queue tags for the run."""
        self._put(_Item(tags=dict(tags)))

    def pending(self) -> int:
        """Items not yet delivered."""
        with self._cond:
            return len(self._queue)

    def _put(self, item: _Item) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("the metrics outbox is closed")
            self._queue.append(item)
            self._cond.notify()

    # ---- consumer side -----------------------------------------------------------------------------
    def _next_batch(self) -> tuple[int, _Item] | None:
        """The head of the queue merged with the metrics items behind it (up to MLflow's batch limit),
        as (number of queue items it covers, item); None when the queue is empty."""
        if not self._queue:
            return None
        head = self._queue[0]
        if head.tags is not None:
            return 1, head
        records, n = list(head.records), 1
        for item in list(self._queue)[1:]:
            if item.tags is not None or len(records) + len(item.records) > MAX_METRICS_PER_BATCH:
                break
            records += item.records
            n += 1
        return n, _Item(records=records)

    def _send(self, item: _Item) -> None:
        if item.tags is not None:
            self._sink.set_tags(item.tags)
            return
        records = item.records
        if self._once_key is not None:
            if self._present is None:  # asked once, as part of the first send (retried with it)
                self._present = set(self._sink.logged_steps(self._once_key))
            records = [r for r in records if r[3] not in self._present]
            self.skipped_records += len(item.records) - len(records)
        if records:
            self._sink.log_metric_records(records)

    def _run(self) -> None:
        wait = self._retry_s
        outage_since: float | None = None
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                batch = self._next_batch()
                if batch is None:  # closing and drained
                    return
            n, item = batch
            try:
                self._send(item)
            except Exception as e:  # noqa: BLE001  any failure of the server or the network: retry, never die
                self.failed_attempts += 1
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("MLflow at %s did not take metrics (%s: %s); keeping them and retrying",
                                self._sink.uri, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                with self._cond:
                    self._cond.wait(timeout=wait)  # close() wakes it early to try once more
                wait = min(wait * 2, self._max_retry_s)
                continue
            if outage_since is not None:
                log.warning("MLflow at %s answers again after %.0f s; delivering %d queued items",
                            self._sink.uri, time.monotonic() - outage_since, self.pending())
                outage_since, wait = None, self._retry_s
            with self._cond:
                for _ in range(n):
                    self._queue.popleft()
                self.delivered_batches += 1
                self._cond.notify_all()

    def close(self, timeout_s: float) -> int:
        """Stop taking items and wait up to ``timeout_s`` for the queue to drain.

        Returns:
            How many items were still undelivered at the deadline (0: everything arrived).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return self.pending()

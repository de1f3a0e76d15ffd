"""Clients that keep a deployment busy while it rolls over: each answer's version, and every failure."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import requests


@contextmanager
def steady_requests(url: str, body: dict, clients: int = 2):
    """POST ``body`` to ``url`` from ``clients`` threads in a loop until the block ends.

    Yields:
        ``(seen, failures)``: ``(time, version)`` of each 200 answer (its ``x-conduit-version`` header),
        and a line for each answer that was not a 200 or did not come.
    """
    seen: list[tuple[float, int]] = []
    failures: list[str] = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                r = requests.post(url, json=body, timeout=120)
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                else:
                    seen.append((time.monotonic(), int(r.headers["x-conduit-version"])))
            except requests.RequestException as e:
                failures.append(repr(e))

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        yield seen, failures
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)

"""The metrics outbox: producers never wait, delivery is in order and complete, failures are retried.

The slow test stops the session's real MLflow server while steps keep coming, until the outbox has
failed and retried three sends, starts it again on the same store, and finds every step in MLflow."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline import tracking
from pipeline.stage_tracker import StageTracker
from pipeline.training.outbox import MAX_METRICS_PER_BATCH, Outbox


class FlakySink:
    """Records what arrives; refuses the first ``failures`` sends and can be made slow."""

    uri = "test://sink"

    def __init__(self, failures: int = 0, delay_s: float = 0.0):
        self.failures, self.delay_s = failures, delay_s
        self.records: list[tuple] = []
        self.tags: list[dict] = []
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def _maybe_fail(self):
        time.sleep(self.delay_s)
        with self.lock:
            if self.failures > 0:
                self.failures -= 1
                raise ConnectionError("server down")

    def log_metric_records(self, records):
        self._maybe_fail()
        self.records += records
        self.batches.append(len(records))

    def set_tags(self, tags):
        self._maybe_fail()
        self.tags.append(tags)


def test_producers_do_not_wait_for_a_slow_server_and_everything_arrives_in_order():
    sink = FlakySink(delay_s=0.5)
    box = Outbox(sink, retry_s=0.01)
    t0 = time.perf_counter()
    for step in range(1, 201):
        box.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step=step)
    assert time.perf_counter() - t0 < 0.5  # 200 posts against a sink that takes 0.5 s per call
    assert box.close(timeout_s=30) == 0
    assert [(r[0], r[3]) for r in sink.records] == [(n, s) for s in range(1, 201) for n in ("loss", "lr")]
    assert sink.records[-2][1] == pytest.approx(1 / 200)
    assert len(sink.batches) < 200  # queued steps went out together


def test_failed_sends_are_retried_until_they_arrive_and_tags_keep_their_place():
    sink = FlakySink(failures=5)
    box = Outbox(sink, retry_s=0.01, max_retry_s=0.05)
    box.set_tags({"a": 1})
    for step in range(1, 4):
        box.log_metrics({"loss": float(step)}, step=step)
    box.set_tags({"b": 2})
    box.log_metrics({"loss": 9.0}, step=9)
    assert box.close(timeout_s=10) == 0
    assert box.failed_attempts == 5
    assert sink.tags == [{"a": 1}, {"b": 2}]
    assert [(r[1], r[3]) for r in sink.records] == [(1.0, 1), (2.0, 2), (3.0, 3), (9.0, 9)]
    assert sink.batches == [3, 1]  # the tags split the metrics into two batches, in order


def test_batches_respect_mlflows_limit_and_measure_time_at_posting():
    sink = FlakySink(failures=1)  # hold the queue back once so that everything piles up
    box = Outbox(sink, retry_s=0.2)
    before = int(time.time() * 1000)
    for step in range(1, 700):
        box.log_metrics({"a": 1.0, "b": 2.0}, step=step)
    after = int(time.time() * 1000)
    assert box.close(timeout_s=10) == 0
    assert max(sink.batches) <= MAX_METRICS_PER_BATCH and sum(sink.batches) == 2 * 699
    assert all(before <= r[2] <= after for r in sink.records)  # stamped when measured, not when sent


def test_close_gives_up_after_its_timeout_and_says_how_much_is_left():
    sink = FlakySink(failures=10**6)
    box = Outbox(sink, retry_s=0.01, max_retry_s=0.02)
    for step in range(1, 4):
        box.log_metrics({"loss": 1.0}, step=step)
    t0 = time.perf_counter()
    assert box.close(timeout_s=0.5) == 3  # all three steps are still queued
    assert time.perf_counter() - t0 < 2
    with pytest.raises(RuntimeError, match="closed"):
        box.log_metrics({"loss": 1.0}, step=4)


@pytest.mark.slow
def test_a_stopped_mlflow_server_loses_no_metric(mlflow_server, monkeypatch):
    """The session's real MLflow server stopped while steps keep coming, for as long as the outbox
    takes to fail three sends and back off between them (MLflow's client set to fail at once, so
    that the retries are the outbox's own), then started again on the same store and address."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = mlflow_server.uri
    exp = tracking.ensure_experiment(uri, "outbox")
    run_id = tracking.start_run(uri, exp, "train")
    box = Outbox(StageTracker(uri, run_id), retry_s=0.5, max_retry_s=4.0)
    try:
        for step in range(1, 11):
            box.log_metrics({"loss": 10.0 - step / 10}, step=step)
        deadline = time.monotonic() + 60
        while box.pending() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert box.pending() == 0 and box.failed_attempts == 0, "the first steps never reached the running server"
        mlflow_server.stop()
        # The server is gone: posting stays instant, and nothing is lost while sends fail.
        t0 = time.perf_counter()
        for step in range(11, 41):
            box.log_metrics({"loss": 10.0 - step / 10}, step=step)
        assert time.perf_counter() - t0 < 0.5
        deadline = time.monotonic() + 120
        while box.failed_attempts < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert box.failed_attempts >= 3, "the sends to a stopped server did not fail"
        assert box.pending() > 0  # held back and retried, not dropped
        mlflow_server.start()  # the same store, the same address
        assert box.close(timeout_s=240) == 0
    finally:
        if not mlflow_server.running:
            mlflow_server.start()  # the session's other tests need it
    history = tracking.client(uri).get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 10.0 - s / 10) for s in range(1, 41)]


def test_a_restarted_attempt_sends_each_step_once(tmp_path):
    """A run that holds steps 1-5 from an earlier attempt (killed after step 5, its last checkpoint at 2):
    the restarted attempt's outbox posts its restored history (1-2) and the recomputed steps 3-8; the run
    then holds each of 1-8 once. A new run (a new driver's) gets the restored history it lacks."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "outbox")
    run_id = tracking.start_run(uri, exp, "train")
    first = Outbox(StageTracker(uri, run_id), once_per_step="loss")
    for step in range(1, 6):
        first.log_metrics({"loss": 10.0 - step, "lr": 0.1}, step=step)
    assert first.close(timeout_s=60) == 0
    for target in (run_id, tracking.start_run(uri, exp, "train")):
        again = Outbox(StageTracker(uri, target), once_per_step="loss")
        for step in range(1, 9):
            again.log_metrics({"loss": 10.0 - step, "lr": 0.1}, step=step)
        assert again.close(timeout_s=60) == 0
        c = tracking.client(uri)
        for key, value in (("loss", lambda s: 10.0 - s), ("lr", lambda s: 0.1)):
            assert sorted((m.step, m.value) for m in c.get_metric_history(target, key)) == \
                [(s, value(s)) for s in range(1, 9)]
        assert again.skipped_records == (10 if target == run_id else 0)


@pytest.mark.slow
def test_a_stage_call_waits_out_an_mlflow_restart(mlflow_server, monkeypatch):
    """A stage's own MLflow call (a tag, a metric: not the outbox's) while the server is down: it waits and
    lands once the server is back, rather than failing the stage; past ``$CONDUIT_MLFLOW_OUTAGE_S`` it fails.
    MLflow's own retries are off here, so the waiting is Conduit's."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = mlflow_server.uri
    exp = tracking.ensure_experiment(uri, "patient")
    tracker = StageTracker(uri, tracking.start_run(uri, exp, "shard"))
    mlflow_server.stop()
    try:
        done = threading.Event()
        errors: list[BaseException] = []

        def log():
            try:
                tracker.log_metrics({"documents": 7.0}, step=1)
                tracker.set_tags({"conduit.phase": "sharding"})
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            done.set()

        threading.Thread(target=log, daemon=True).start()
        time.sleep(4)
        assert not done.is_set(), "the call gave up while the server was down"
        mlflow_server.start()
        assert done.wait(120) and not errors, errors
        monkeypatch.setenv("CONDUIT_MLFLOW_OUTAGE_S", "2")
        mlflow_server.stop()
        t0 = time.monotonic()
        with pytest.raises(Exception, match="Connection refused|Failed to establish"):
            tracker.set_tags({"x": "y"})
        assert 2 <= time.monotonic() - t0 < 30
    finally:
        if not mlflow_server.running:
            mlflow_server.start()
    run = tracking.client(uri).get_run(tracker.run_id)
    assert run.data.metrics["documents"] == 7.0 and run.data.tags["conduit.phase"] == "sharding"

"""A lost answer is not a lost request: when the connection drops after MLflow did what it was asked, a
retried create must find what the first try made, not make it again.

The session's real MLflow server sits behind ``LosingProxy``, which forwards chosen requests, lets the server
answer them, and then resets the client's connection instead of passing the answer on: the client sees
"Connection reset by peer" for a request the server carried out. MLflow's own HTTP retries are left as they
are by default (they resend any request after a reset, POSTs included); the counts are read from the server
directly, past the proxy.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from pipeline import tracking
from pipeline.stage_tracker import StageTracker

pytestmark = pytest.mark.slow  # the session's MLflow server


class LosingProxy:
    """A TCP proxy on a free local port in front of ``127.0.0.1:port``. Each connection carries one request
    (``Connection: close`` both ways). For the first ``lose[suffix]`` requests whose path ends with
    ``suffix``, it forwards the request, reads the server's whole answer, and resets the client's connection
    (SO_LINGER 0) instead of passing the answer on; every other request goes through as it is.

    ``lost``: the paths whose answers were lost, in order; ``paths``: every path that went through it;
    ``errors``: what went wrong in the proxy itself (its threads cannot fail the test).
    """

    def __init__(self, port: int):
        self.port, self.lose = port, {}
        self.lost: list[str] = []
        self.paths: list[str] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve_or_record, args=(conn,), daemon=True).start()

    def _serve_or_record(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        except Exception as e:  # noqa: BLE001 - reported by the fixture
            self.errors.append(e)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head, body = _read_request(conn)
            if head is None:
                return
            path = head.split(b" ", 2)[1].split(b"?")[0].decode()
            with self._lock:
                self.paths.append(path)
                suffix = next((s for s, n in self.lose.items() if n > 0 and path.endswith(s)), None)
                if suffix is not None:
                    self.lose[suffix] -= 1
            with socket.create_connection(("127.0.0.1", self.port), timeout=60) as upstream:
                upstream.sendall(_closing(head) + body)
                answer = _read_to_end(upstream)
            if suffix is not None:
                with self._lock:
                    self.lost.append(path)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return  # closing now sends a reset: the answer is lost
            answer_head, _, answer_body = answer.partition(b"\r\n\r\n")
            conn.sendall(_closing(answer_head) + answer_body)


def _read_request(conn: socket.socket) -> tuple[bytes | None, bytes]:
    """A request's head (up to its blank line, excluded) and its body (``Content-Length`` bytes); ``(None, b"")``
    when the client closes without one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])}
    assert b"chunked" not in fields.get(b"transfer-encoding", b""), "LosingProxy reads Content-Length bodies only"
    length = int(fields.get(b"content-length", b"0"))
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, "the client closed the connection inside a request body"
        body += chunk
    return head, body


def _closing(head: bytes) -> bytes:
    """``head`` (a request's or an answer's, without its blank line), asking to close the connection after
    it, with the blank line."""
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture
def proxy(mlflow_server, monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)  # MLflow's own resends, as users have them
    p = LosingProxy(mlflow_server.port)
    yield p
    p.close()
    assert p.errors == []


def test_a_run_whose_answer_is_lost_is_made_once(mlflow_server, proxy):
    """``start_run`` through a connection reset after the server made the run: one run, the one returned,
    found by its token (before, MLflow's client sent the create again: two runs, the stage's and an orphan)."""
    server = MlflowClient(mlflow_server.uri)
    exp = tracking.ensure_experiment(mlflow_server.uri, "lost-run")
    proxy.lose = {"/runs/create": 1}
    run_id = tracking.start_run(proxy.uri, exp, "stage", tags={"conduit.hash": "abc"})
    assert proxy.lost == ["/api/2.0/mlflow/runs/create"]
    runs = server.search_runs([exp], run_view_type=ViewType.ALL)
    assert [r.info.run_id for r in runs] == [run_id]
    assert runs[0].data.tags["conduit.hash"] == "abc" and runs[0].info.run_name == "stage"
    assert proxy.paths.count("/api/2.0/mlflow/runs/create") == 1


def test_an_experiment_whose_answer_is_lost_is_made_once(mlflow_server, proxy):
    """``ensure_experiment`` through a connection reset after the server made the experiment: its id,
    found by its name (before, MLflow's client sent the create again and the server's
    RESOURCE_ALREADY_EXISTS failed the driver)."""
    proxy.lose = {"/experiments/create": 1}
    exp = tracking.ensure_experiment(proxy.uri, "lost-experiment")
    assert proxy.lost == ["/api/2.0/mlflow/experiments/create"]
    made = MlflowClient(mlflow_server.uri).get_experiment_by_name("lost-experiment")
    assert made.experiment_id == exp and made.tags["mlflow.experimentKind"] == "custom_model_development"
    assert proxy.paths.count("/api/2.0/mlflow/experiments/create") == 1


def test_a_model_version_whose_answer_is_lost_is_registered_once(mlflow_server, proxy):
    """Registering a logged model under a new name through resets after the server created the registered
    model and then the version: one registered model, one version, the one returned."""
    server = MlflowClient(mlflow_server.uri)
    exp = tracking.ensure_experiment(mlflow_server.uri, "lost-registration")
    run_id = tracking.start_run(mlflow_server.uri, exp, "register")
    logged = server.create_logged_model(exp, name="model", source_run_id=run_id)
    proxy.lose = {"/registered-models/create": 1, "/model-versions/create": 1}
    version = tracking.register_model(proxy.uri, f"models:/{logged.model_id}", "lost-answer-model")
    assert proxy.lost == ["/api/2.0/mlflow/registered-models/create", "/api/2.0/mlflow/model-versions/create"]
    versions = server.search_model_versions("name = 'lost-answer-model'")
    assert [(int(v.version), v.run_id) for v in versions] == [(version, run_id)] and version == 1
    assert proxy.paths.count("/api/2.0/mlflow/model-versions/create") == 1


def test_metrics_params_and_tables_whose_answers_are_lost_are_stored_once(mlflow_server, proxy, monkeypatch,
                                                                          tmp_path):
    """Repeated writes do nothing twice: a metric batch sent again (same key, value, timestamp and step) is
    one point of the history, a param sent again is one param, and a table whose tag write was retried
    holds its rows once (MlflowClient.log_table, retried whole, appended them again). MLflow's own resends
    are off here, so the repeats are Conduit's (``PatientClient``)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = MlflowClient(mlflow_server.uri)
    exp = tracking.ensure_experiment(mlflow_server.uri, "lost-writes")
    tracker = StageTracker(proxy.uri, tracking.start_run(mlflow_server.uri, exp, "train"))
    proxy.lose = {"/runs/log-batch": 1}
    tracker.log_metric_records([("loss", 2.5, 1_700_000_000_000, 1), ("loss", 2.0, 1_700_000_000_500, 2)])
    proxy.lose = {"/runs/log-batch": 1}
    tracker.log_params({"lr": 0.1})
    proxy.lose = {"/runs/set-tag": 1}
    tracker.log_table({"prompt": ["a", "b"], "continuation": ["x", "y"]}, "samples.json")
    assert proxy.lost == ["/api/2.0/mlflow/runs/log-batch"] * 2 + ["/api/2.0/mlflow/runs/set-tag"]
    history = server.get_metric_history(tracker.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 2.5), (2, 2.0)]
    assert server.get_run(tracker.run_id).data.params == {"lr": "0.1"}
    table = json.loads(Path(server.download_artifacts(tracker.run_id, "samples.json", str(tmp_path))).read_text())
    assert table == {"columns": ["prompt", "continuation"], "data": [["a", "x"], ["b", "y"]]}
    assert json.loads(server.get_run(tracker.run_id).data.tags["mlflow.loggedArtifacts"]) == \
        [{"path": "samples.json", "type": "table"}]


def test_a_create_that_is_not_looked_up_is_not_sent_again(mlflow_server, proxy):
    """A non-repeatable call Conduit has no lookup for (here ``create_registered_model`` through the client)
    raises the reset rather than risk doing it twice; the server made it once."""
    proxy.lose = {"/registered-models/create": 1}
    with pytest.raises(Exception, match="Connection reset by peer|Connection aborted"):
        tracking.client(proxy.uri).create_registered_model("made-once")
    assert MlflowClient(mlflow_server.uri).get_registered_model("made-once").name == "made-once"
    assert proxy.paths.count("/api/2.0/mlflow/registered-models/create") == 1


def test_the_drivers_and_a_sweeps_calls_wait_out_an_mlflow_restart(mlflow_server, monkeypatch):
    """The calls a pipeline driver and a sweep make (the experiment, runs and their lookup, a trial's run,
    ASHA's stop marking it KILLED, the trial restarted: its run RUNNING again), started while the server is down: they
    wait, land once it is back, and each run exists once. MLflow's own retries are off, so the waiting is
    Conduit's."""
    import time

    from pipeline.sweep.run import STOPPED, _mark_stopped, _trial_run, _trial_runs

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = mlflow_server.uri
    mlflow_server.stop()
    done = threading.Event()
    errors: list[BaseException] = []
    made: dict = {}

    def driver_and_sweep() -> None:
        try:
            exp = made["exp"] = tracking.ensure_experiment(uri, "restarting-driver")
            sweep = made["sweep"] = tracking.start_run(uri, exp, "sweep", tags={"conduit.sweep": "s"})
            stage = made["stage"] = tracking.start_run(uri, exp, "train", parent_id=sweep,
                                                       tags={"conduit.hash": "feedbeef"})
            made["found"] = tracking.search_runs(uri, exp, "tags.`conduit.hash` = 'feedbeef'")
            tracking.end_run(uri, stage)
            trial = made["trial"] = _trial_run(uri, exp, sweep, "trial_000")
            _mark_stopped(uri, exp, sweep, "trial_000", {"step": 10, "val_loss": 3.0}, by="ASHA")
            stopped = tracking.client(uri).get_run(trial)
            made["stopped"] = (stopped.info.status, stopped.data.tags["conduit.sweep_status"],
                               stopped.data.tags["conduit.sweep_stopped_at_step"])
            made["trial_again"] = _trial_run(uri, exp, sweep, "trial_000")  # a restarted trial: the same run
            assert made["trial_again"] == trial
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    try:
        threading.Thread(target=driver_and_sweep, daemon=True).start()
        time.sleep(4)
        assert not done.is_set(), (errors, made)  # nothing gave up while the server was down
        assert made == {}
        mlflow_server.start()
        assert done.wait(180) and not errors, errors
    finally:
        if not mlflow_server.running:
            mlflow_server.start()
    c = MlflowClient(uri)
    assert [r[0] for r in made["found"]] == [made["stage"]]
    runs = c.search_runs([made["exp"]], run_view_type=ViewType.ALL, max_results=100)
    assert sorted(r.info.run_name for r in runs) == ["sweep", "train", "trial_000"]  # each made once
    assert c.get_run(made["stage"]).info.status == "FINISHED"
    assert [r[0] for r in _trial_runs(uri, made["exp"], made["sweep"], "trial_000", running=False)] == [made["trial"]]
    trial = c.get_run(made["trial"])
    assert trial.data.tags["conduit.sweep_status"] == "running"  # set RUNNING again by the second _trial_run
    assert trial.data.tags["conduit.sweep_attempts"] == "2" and trial.info.status == "RUNNING"
    assert made["stopped"] == ("KILLED", STOPPED, "10")
    assert c.get_run(made["sweep"]).info.status == "RUNNING"

"""What a test session paid for, beside pytest's ``--durations``: the module- and session-scoped
fixtures' setup times (pytest charges a fixture to the first test that asks for it), and how many
expensive things the session started: Ray clusters, Ray Train worker groups, DeepSpeed worlds of
the distributed helper, whole-pipeline runs and server processes.

Counted from the outside, so that nothing in the product knows about it: a thread looks at the
machine's new processes twice a second (a Ray cluster has one ``gcs_server``; a Ray Train run one
``TrainController`` actor and a ``RayTrainWorker`` per worker; ``tests.distributed.run_world`` starts
``python -m tests...`` ranks), and in-process calls of ``pipeline.runner.run_pipeline`` on the real
stages are counted by wrapping it before the test modules import it. The same thread samples each
process's CPU time, so the table also says where the machine's CPU-seconds went. The table is printed at the end
of the session and written as JSON to ``$CONDUIT_TEST_PROFILE`` when that is set. Under pytest-xdist
the controller watches the processes and each worker sends it its fixtures and pipeline calls.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter

import psutil
import pytest

# (what is counted, how a new process's command line shows it); the first match counts.
PROCESS_KINDS = (
    ("Ray clusters started (GCS servers)", lambda cmd: "gcs_server" in cmd.split(" ", 1)[0]),
    ("Ray nodes started (raylets)", lambda cmd: "/raylet" in cmd.split(" ", 1)[0]),
    ("Ray Train runs (controllers)", lambda cmd: cmd.startswith("ray::TrainController")),
    ("Ray Train worker processes", lambda cmd: cmd.startswith("ray::RayTrainWorker")),
    ("pipeline CLI runs (python -m jobs.run)", lambda cmd: " -m jobs.run " in f"{cmd} "),
    ("Ray jobs submitted (python -m jobs.submit)", lambda cmd: " -m jobs.submit " in f"{cmd} "),
    ("MLflow servers started", lambda cmd: re.search(r"(-m |/)mlflow server ", cmd) is not None),
    ("distributed-helper ranks (tests.distributed)", lambda cmd: " -m tests." in f"{cmd} "),
)

# Where the machine's CPU time went, by the last command line each process showed (Ray workers
# rename themselves after the actor or task they run).
CPU_KINDS = (
    ("Ray GCS servers", lambda cmd: "gcs_server" in cmd.split(" ", 1)[0]),
    ("raylets", lambda cmd: "/raylet" in cmd.split(" ", 1)[0]),
    ("Ray Train workers", lambda cmd: cmd.startswith("ray::RayTrainWorker")),
    ("Ray Train controllers", lambda cmd: cmd.startswith("ray::TrainController")),
    ("Ray task workers (last seen idle)", lambda cmd: cmd.startswith("ray::IDLE") or "default_worker.py" in cmd),
    ("Ray Serve and other actors/tasks", lambda cmd: cmd.startswith("ray::") and "Dashboard" not in cmd),
    ("Ray dashboards, agents, monitors", lambda cmd: "/ray/" in cmd or cmd.startswith("ray::Dashboard")),
    ("pipeline CLIs (jobs.run)", lambda cmd: " -m jobs.run " in f"{cmd} "),
    ("other jobs CLIs", lambda cmd: " -m jobs." in cmd),
    ("MLflow servers", lambda cmd: "mlflow" in cmd or "uvicorn" in cmd or "gunicorn" in cmd),
    ("distributed-helper ranks", lambda cmd: " -m tests." in f"{cmd} "),
    ("pytest processes", lambda cmd: "pytest" in cmd or "xdist" in cmd or "execnet" in cmd),
)


class SessionProfile:
    def __init__(self) -> None:
        self.fixtures: list[tuple[float, str, str, str]] = []  # seconds, scope, name, first test
        self.counts: Counter = Counter()
        self.pipeline_calls = 0
        self._seen: dict[int, float] = {}
        self._cpu_seen: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, created): (kind, CPU-s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="conduit-test-profile", daemon=True)
        self.started = time.monotonic()
        self._cpu = psutil.cpu_times()

    def start(self) -> None:
        self._cpu_before: dict[tuple[int, float], float] = {}
        for proc in psutil.process_iter(["create_time", "cpu_times"]):  # what ran before the session is not counted
            self._seen[proc.pid] = proc.info["create_time"]
            if proc.info["cpu_times"] is not None:
                self._cpu_before[(proc.pid, proc.info["create_time"])] = sum(proc.info["cpu_times"][:2])
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        untitled: dict[int, psutil.Process] = {}  # Ray workers not yet given an actor's title
        while not self._stop.wait(0.5):
            fresh = []
            for proc in psutil.process_iter(["create_time", "cmdline", "cpu_times"]):
                self._account(proc)
                if self._seen.get(proc.pid) != proc.info["create_time"]:
                    self._seen[proc.pid] = proc.info["create_time"]
                    fresh.append(proc)
            for proc in [*fresh, *untitled.values()]:
                untitled.pop(proc.pid, None)
                try:
                    cmd = " ".join(proc.cmdline())
                except psutil.Error:
                    continue
                if "default_worker.py" in cmd or cmd.startswith("ray::IDLE"):
                    untitled[proc.pid] = proc  # a Ray worker: it takes an actor's name later, maybe
                    continue
                for kind, matches in PROCESS_KINDS:
                    if matches(cmd):
                        self.counts[kind] += 1
                        break

    def _account(self, proc: psutil.Process) -> None:
        times, cmd = proc.info["cpu_times"], " ".join(proc.info["cmdline"] or [])
        if times is None or not cmd:
            return
        kind = next((k for k, matches in CPU_KINDS if matches(cmd)), "other processes")
        self._cpu_seen[(proc.pid, proc.info["create_time"])] = (kind, times.user + times.system)

    def cpu_by_kind(self) -> dict[str, float]:
        """CPU-seconds per kind of process, as last sampled (up to half a second of each ended
        process is missed; what ran before the session is counted from its start)."""
        total: Counter = Counter()
        for key, (kind, seconds) in self._cpu_seen.items():
            total[kind] += seconds - self._cpu_before.get(key, 0.0)
        return {k: round(v, 1) for k, v in total.most_common()}

    def table(self) -> dict:
        now, then = psutil.cpu_times(), self._cpu
        busy = sum(now) - now.idle - now.iowait - (sum(then) - then.idle - then.iowait)
        wall = time.monotonic() - self.started
        return {
            "session_s": round(wall, 1),
            "machine_cpu_busy_s": round(busy, 1),  # every process on the machine, not only the tests'
            "cores": psutil.cpu_count(),
            "fixtures": [{"seconds": round(s, 1), "scope": scope, "fixture": name, "first_test": test}
                         for s, scope, name, test in sorted(self.fixtures, reverse=True)],
            "counts": {**dict(self.counts), "pipeline runs in the test process (run_pipeline)": self.pipeline_calls},
            "cpu_seconds_by_process": self.cpu_by_kind(),
        }


PROFILE = SessionProfile()


def _count_pipeline_runs() -> None:
    """Wrap ``pipeline.runner.run_pipeline`` (before any test module imports the name) to count the
    calls that run the real stages; a call with toy ``stages`` is not a pipeline run."""
    import pipeline.runner as runner

    real = runner.run_pipeline

    def counted(cfg, **kwargs):
        if kwargs.get("stages") is None:
            PROFILE.pipeline_calls += 1
        return real(cfg, **kwargs)

    counted.__wrapped__ = real
    counted.__doc__ = real.__doc__
    runner.run_pipeline = counted


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config) -> None:
    _count_pipeline_runs()
    if not _is_xdist_worker(config):  # processes are the machine's: one watcher, in the controller
        PROFILE.start()


def pytest_sessionfinish(session) -> None:
    """An xdist worker hands its fixture times and pipeline calls to the controller."""
    if _is_xdist_worker(session.config):
        worker = session.config.workerinput["workerid"]
        session.config.workeroutput["conduit_profile"] = json.dumps({
            "fixtures": [(s, scope, name, f"{test} [{worker}]") for s, scope, name, test in PROFILE.fixtures],
            "pipeline_calls": PROFILE.pipeline_calls})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    data = getattr(node, "workeroutput", {}).get("conduit_profile")
    if data:
        got = json.loads(data)
        PROFILE.fixtures += [tuple(row) for row in got["fixtures"]]
        PROFILE.pipeline_calls += got["pipeline_calls"]


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    t0 = time.monotonic()
    yield
    if fixturedef.scope in ("module", "package", "session"):
        seconds = time.monotonic() - t0
        if seconds >= 0.5:
            test = getattr(request, "_pyfuncitem", request.node)  # the test that asked first
            PROFILE.fixtures.append((seconds, fixturedef.scope, fixturedef.argname, test.nodeid))


def pytest_terminal_summary(terminalreporter) -> None:
    if _is_xdist_worker(terminalreporter.config):
        return
    PROFILE.stop()
    table = PROFILE.table()
    write = terminalreporter.write_line
    terminalreporter.section("what the session paid for (tests/profiling.py)")
    write(f"{'seconds':>8}  {'scope':<8} {'fixture':<28} first asked for by")
    for row in table["fixtures"][:20]:
        write(f"{row['seconds']:>8.1f}  {row['scope']:<8} {row['fixture']:<28} {row['first_test']}")
    for kind, n in table["counts"].items():
        write(f"{n:>8}  {kind}")
    write(f"{table['session_s']:>8.0f}  seconds of session; the machine's {table['cores']} cores were busy "
          f"{table['machine_cpu_busy_s']:.0f} CPU-seconds "
          f"({table['machine_cpu_busy_s'] / max(table['session_s'] * table['cores'], 1e-9):.0%})")
    write("CPU-seconds by kind of process:")
    for kind, seconds in table["cpu_seconds_by_process"].items():
        write(f"{seconds:>8.0f}  {kind}")
    out = os.environ.get("CONDUIT_TEST_PROFILE")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)

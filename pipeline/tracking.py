"""Everything Conduit says to MLflow goes through this module (with ``pipeline.serving.pyfunc``, the served
model itself, the only modules that import mlflow; ``pipeline.stage_tracker``'s run handle reaches MLflow
through this module).

Lineage: one parent run per pipeline run, one nested run per stage, artifact hashes as tags. Stage
bodies and training workers run in other processes, so they get a ``StageTracker``: a small,
picklable handle (tracking URI + run id) that talks to MLflow through a client, with no global state.
The model registry is written here on behalf of the register stage and ``jobs/promote.py`` only.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from urllib3.util import parse_url
from urllib3.util.retry import Retry

from pipeline.base import TrackingUnavailable  # defined there: the command lines name it without mlflow
from pipeline.base import ConfigError, beside_lock, is_uri
from pipeline import credentials
from pipeline.serving import pyfunc



@contextmanager
def _fluent_uri(uri: str):
    """Point MLflow's fluent API (log_model, load_model) at ``uri`` for one call only.

    ``mlflow.set_tracking_uri`` and ``set_registry_uri`` change process-wide state and export
    $MLFLOW_TRACKING_URI / $MLFLOW_REGISTRY_URI to the environment, where every later config in
    this process would pick them up. Both are put back as they were.
    """
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    credentials.check_uri("the MLflow tracking URI", uri)
    credentials.apply_job_login()
    _send_creates_once()
    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    saved_env = {k: os.environ.get(k) for k in names}
    saved = (tracking_utils._tracking_uri, registry_utils._registry_uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


OUTAGE_ENV = "CONDUIT_MLFLOW_OUTAGE_S"
DEFAULT_OUTAGE_S = 600.0  # how long a call waits for a server that refuses connections, then fails


def outage_s() -> float:
    """How long an MLflow call keeps trying a server that refuses connections (``$CONDUIT_MLFLOW_OUTAGE_S``)."""
    raw = os.environ.get(OUTAGE_ENV, "").strip()
    if not raw:
        return DEFAULT_OUTAGE_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0 or math.isinf(seconds):
        raise ConfigError(f"${OUTAGE_ENV}={raw!r} must be a number of seconds >= 0 (how long an MLflow call waits "
                          f"for a server that refuses connections; unset: {DEFAULT_OUTAGE_S:.0f})")
    return seconds


def _never_sent(e: BaseException) -> bool:
    """Whether ``e`` says the request never reached the server (refused, no route): a retry then cannot
    do anything twice, whatever the call."""
    text = str(e)
    return any(s in text for s in ("Connection refused", "Failed to establish a new connection", "NewConnectionError"))


def _maybe_processed(e: BaseException) -> bool:
    """Whether ``e`` says the connection failed after the request was sent (reset by peer, closed without
    an answer, no answer in time): the server may have done what was asked, and only the answer is lost."""
    text = str(e)
    return any(s in text for s in ("Connection reset by peer", "Connection aborted", "Remote end closed connection",
                                   "Read timed out"))


# The REST calls that create something: sent twice, they make it twice (a run, an experiment, a version) or fail
# on the first one's result (a registered model). MLflow's HTTP session resends any request whose connection fails
# after it was sent; these it must not (``_send_creates_once``): the client calling them looks for what the first
# attempt made before it sends again (``PatientClient``, ``register_model``).
_CREATE_ENDPOINTS = ("/mlflow/runs/create", "/mlflow/experiments/create", "/mlflow/registered-models/create",
                     "/mlflow/model-versions/create")


class _CreatesOnce:
    """Mixed into urllib3's ``Retry`` as MLflow configures it: a create (``_CREATE_ENDPOINTS``) whose connection
    failed after it was sent is not sent again; the error goes up to the caller."""

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        if (error is not None and self._is_read_error(error) and (method or "").upper() == "POST"
                and (parse_url(url or "").path or "").endswith(_CREATE_ENDPOINTS)):
            raise error.with_traceback(_stacktrace)
        return super().increment(method, url, response, error, _pool, _stacktrace)


@functools.cache
def _creates_once_class(retry_class: type) -> type:
    return type(f"CreatesOnce{retry_class.__name__}", (_CreatesOnce, retry_class), {})


def _creates_once(retry: Retry) -> Retry:
    """``retry`` with ``_CreatesOnce`` mixed in (its copies, ``Retry.new``, keep it)."""
    if isinstance(retry, _CreatesOnce):
        return retry
    copy = object.__new__(_creates_once_class(type(retry)))
    copy.__dict__.update(vars(retry))
    return copy


_creates_once_lock = threading.Lock()


def _send_creates_once() -> None:
    """Make MLflow's HTTP sessions (those it makes from now on, and its cached ones as they are handed out) use
    ``_CreatesOnce``. MLflow's policy retries every method after a reset or a read timeout, POSTs included,
    so a create whose answer was lost is made twice before any Conduit code sees an error. MLflow's private
    ``request_utils`` (``pipeline.compat``: no public API does this)."""
    from pipeline.compat import require

    require("mlflow", "sending each MLflow create once")
    from mlflow.utils import request_utils

    with _creates_once_lock:
        make = request_utils._cached_get_request_session
        if getattr(make, "conduit_creates_once", False):
            return

        def session(*args, **kwargs):
            made = make(*args, **kwargs)
            for adapter in made.adapters.values():
                adapter.max_retries = _creates_once(adapter.max_retries)
            return made

        session.conduit_creates_once = True
        request_utils._cached_get_request_session = session


# Calls that do nothing more when made twice (reads; writes that overwrite with the same value; MLflow's SQL stores
# keep one copy of a metric logged twice with the same key, value, timestamp and step, and of a dataset input), so
# they are repeated after an answer was lost. Any other call made through a PatientClient raises then.
_READS = ("get_", "search_", "list_", "download_")
_REPEATABLE_WRITES = frozenset({
    "log_batch", "log_inputs", "set_tag", "set_experiment_tag", "set_terminated", "update_run", "log_artifact",
    "log_artifacts", "log_text", "log_dict", "log_figure", "set_model_version_tag", "update_model_version",
    "set_registered_model_alias", "set_logged_model_tags",
})
CREATE_TOKEN_TAG = "conduit.create_token"  # on each run a PatientClient creates: how a retry finds it


def _patiently(uri: str, what: str, attempt, repeatable: bool, lookup=None):
    """``attempt()``, tried again while the server is down or drops the connection, with backoff up to 15 s,
    for up to ``outage_s()``; any other error is raised at once.

    A request that never reached the server is sent again, whatever it does. One that may have been done
    (the connection failed after it was sent) is sent again only when ``repeatable``; when ``lookup`` is
    given, every later try first asks it for what an earlier one made and returns that when there is one.
    Otherwise the error is raised: repeating the call could do it twice.
    """
    deadline, wait, answer_lost = None, 1.0, False
    while True:
        try:
            if answer_lost and lookup is not None:
                made = lookup()
                if made is not None:
                    print(f"warning: MLflow at {credentials.redact(uri)} had done {what} before the connection "
                          "failed; using what it made", flush=True)
                    return made
            return attempt()
        except Exception as e:  # noqa: BLE001 - classified below; anything else is raised as it was
            if _maybe_processed(e) and not _never_sent(e):
                if not repeatable and lookup is None:
                    print(f"warning: MLflow at {credentials.redact(uri)} dropped the connection during {what}, "
                          "which may have been done; not sending it again, as it could then be done twice",
                          flush=True)
                    raise
                answer_lost = True
            elif not _never_sent(e):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + outage_s()
                how = "dropped the connection" if answer_lost else "does not answer"
                print(f"warning: MLflow at {credentials.redact(uri)} {how} ({what}); "
                      f"trying again for up to {outage_s():.0f} s (${OUTAGE_ENV})", flush=True)
            if now >= deadline:
                raise
            time.sleep(min(wait, deadline - now))
            wait = min(wait * 2, 15.0)


class PatientClient:
    """An ``MlflowClient`` whose calls ride out a server that is down (restarted, redeployed) and connections
    that fail (``_patiently``): MLflow's own retries give up within about a minute, and a stage or a driver
    that dies for an MLflow restart loses its work.

    A retry never does a thing twice: a call that is not harmless to repeat (``_REPEATABLE_WRITES``) is
    not repeated after the server may have done it, except the creates Conduit makes, which look first:
    a run by the token it is tagged with (``CREATE_TOKEN_TAG``), an experiment by its name.
    """

    def __init__(self, inner: MlflowClient, uri: str):
        self._inner, self._uri = inner, uri

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        repeatable = name.startswith(_READS) or name in _REPEATABLE_WRITES
        return lambda *args, **kwargs: _patiently(self._uri, name, lambda: attr(*args, **kwargs), repeatable)

    def create_run(self, experiment_id: str, start_time: int | None = None, tags: dict[str, str] | None = None,
                   run_name: str | None = None):
        """``MlflowClient.create_run``, the run tagged with a new token; after a lost answer, a run of the
        experiment that carries the token is the one the earlier try made."""
        token = uuid.uuid4().hex
        tags = {**(tags or {}), CREATE_TOKEN_TAG: token}

        def made():
            found = self._inner.search_runs([experiment_id], filter_string=f"tags.`{CREATE_TOKEN_TAG}` = '{token}'",
                                            run_view_type=ViewType.ALL, max_results=1)
            return found[0] if found else None

        return _patiently(self._uri, "create_run",
                          lambda: self._inner.create_run(experiment_id, start_time, tags, run_name), False, made)

    def create_experiment(self, name: str, artifact_location: str | None = None,
                          tags: dict[str, Any] | None = None) -> str:
        """``MlflowClient.create_experiment``; after a lost answer, an experiment of that name is the one the
        earlier try made."""
        def made():
            exp = self._inner.get_experiment_by_name(name)
            return None if exp is None else exp.experiment_id

        return _patiently(self._uri, "create_experiment",
                          lambda: self._inner.create_experiment(name, artifact_location, tags), False, made)


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative or absolute), else None."""
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


@contextmanager
def _store_creation_lock(uri: str):
    """Held while a client opens a sqlite store: MLflow creates a new store's tables and runs its schema
    migrations when it first opens it, and two processes doing that at once fail (one of them: "duplicate
    column name", a missing attribute of the migration). An exclusive ``flock`` on a file beside the
    database serializes the openings (two runs of one fresh workdir, an MLflow UI opened as a run starts);
    where that file cannot be made (a read-only folder), nothing is locked."""
    path = _sqlite_file(uri)
    if path is None:
        yield
        return
    with beside_lock(path, make_folder=False):
        yield


def client(uri: str, patient: bool = True) -> MlflowClient:
    """A client of ``uri`` (a ``PatientClient`` unless ``patient`` is False: a caller with retries of its
    own, the metrics outbox); every call to MLflow starts here or in ``_fluent_uri``.

    Raises:
        credentials.CredentialsInUri: ``uri`` carries a password or secret (use MLflow's and the
            database's environment variables instead), before anything connects or logs it.
    """
    credentials.check_uri("the MLflow tracking URI", uri)
    credentials.apply_job_login()  # a job sent by jobs.submit with a login (credentials.job_login_package)
    _send_creates_once()
    with _store_creation_lock(uri):  # the client opens its tracking store here
        inner = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return PatientClient(inner, uri) if patient else inner



def check_reachable(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast, before any compute, when an MLflow server is down (a local store always answers).

    Raises:
        TrackingUnavailable: an ``http(s)://`` URI whose ``/health`` does not answer 200 in ``timeout_s``.
        ConfigError: ``$CONDUIT_MLFLOW_OUTAGE_S`` is not a number of seconds.
    """
    credentials.check_uri("the MLflow tracking URI", uri)
    outage_s()  # a bad $CONDUIT_MLFLOW_OUTAGE_S stops here, before any compute, not at the first outage
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        status = requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).status_code
    except requests.RequestException as e:
        raise TrackingUnavailable(
            f"the MLflow tracking server at {uri} does not answer ({type(e).__name__}); start it, or point "
            "tracking.uri / MLFLOW_TRACKING_URI at one that runs. Nothing was run.") from e
    if status != 200:
        raise TrackingUnavailable(f"the MLflow tracking server at {uri} answers /health with HTTP {status}. "
                                  "Nothing was run.")


def _rest_login(login) -> tuple[dict[str, str], tuple[str, str] | None]:
    """``(headers, auth)`` for a REST request from MLflow's login variables in ``login`` (a token, else a
    user and password), as MLflow's own client sends them."""
    if login.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {login['MLFLOW_TRACKING_TOKEN']}"}, None
    if login.get("MLFLOW_TRACKING_USERNAME") and login.get("MLFLOW_TRACKING_PASSWORD"):
        return {}, (login["MLFLOW_TRACKING_USERNAME"], login["MLFLOW_TRACKING_PASSWORD"])
    return {}, None


def check_login(uri: str, login: dict[str, str], timeout_s: float = 10.0) -> None:
    """Refuse a login that an ``http(s)://`` MLflow server turns away (HTTP 401 or 403 to one cheap
    authenticated request), before a job is sent with it. A server that does not answer from here is
    not refused: a cluster may reach a server this machine cannot.

    Raises:
        TrackingUnavailable: naming the server, the answer and the variables to set, not the secret.
    """
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    headers, auth = _rest_login(login)
    try:
        status = requests.get(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search", params={"max_results": 1},
                              headers=headers, auth=auth, timeout=timeout_s).status_code
    except requests.RequestException:
        return
    if status in (401, 403):
        who = (f"the user {login['MLFLOW_TRACKING_USERNAME']!r}" if auth else
               "the token in MLFLOW_TRACKING_TOKEN" if headers else "a caller with no login")
        raise TrackingUnavailable(
            f"the MLflow server at {uri} turns away {who} (HTTP {status}); set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in this shell (infra/local/up --mlflow-auth "
            "names the password's file as CONDUIT_MLFLOW_PASSWORD_FILE in its env file). Nothing was sent.")


def search_runs(uri: str, experiment_id: str, filter_string: str) -> list[tuple[str, dict[str, str]]]:
    """``(run id, tags)`` of every run of the experiment that matches MLflow's ``filter_string``."""
    runs = client(uri).search_runs([experiment_id], filter_string=filter_string, max_results=1000)
    return [(r.info.run_id, dict(r.data.tags)) for r in runs]


def stage_progress(uri: str, experiment: str, stage_hash: str, timeout_s: float | None = None) -> dict | None:
    """The latest metrics of the RUNNING stage run of artifact ``stage_hash`` (its ``conduit.hash``
    tag), with ``step``: the latest step of its ``loss``, when it logs one, and ``phase``: what the stage
    says it is doing (its ``conduit.phase`` tag), when it says. None before it exists.

    ``timeout_s``: for a server, each request gets that long and no retry (MLflow's client retries for
    minutes, which would freeze a status line while the server is down); it raises instead.
    """
    if timeout_s is not None and uri.startswith(("http://", "https://")):
        return _stage_progress_rest(uri, experiment, stage_hash, timeout_s)
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
                         filter_string=f"attributes.status = 'RUNNING' and tags.`conduit.hash` = '{stage_hash}'")
    if not runs:
        return None
    progress: dict = dict(runs[0].data.metrics)
    if runs[0].data.tags.get("conduit.phase"):
        progress["phase"] = runs[0].data.tags["conduit.phase"]
    if "loss" in progress:
        progress["step"] = float(max(m.step for m in c.get_metric_history(runs[0].info.run_id, "loss")))
    return progress


def _stage_progress_rest(uri: str, experiment: str, stage_hash: str, timeout_s: float) -> dict | None:
    """``stage_progress`` through MLflow's REST API, each request bounded by ``timeout_s``, never retried."""
    import requests

    credentials.apply_job_login()
    api = f"{uri.rstrip('/')}/api/2.0/mlflow"
    headers, auth = _rest_login(os.environ)
    got = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": experiment}, headers=headers,
                       auth=auth, timeout=timeout_s)
    if got.status_code == 404 or (got.ok and "experiment" not in got.json()):
        return None
    got.raise_for_status()
    found = requests.post(f"{api}/runs/search", headers=headers, auth=auth, timeout=timeout_s, json={
        "experiment_ids": [got.json()["experiment"]["experiment_id"]], "max_results": 1,
        "order_by": ["attributes.start_time DESC"],
        "filter": f"attributes.status = 'RUNNING' and tags.`conduit.hash` = '{stage_hash}'"})
    found.raise_for_status()
    runs = found.json().get("runs", [])
    if not runs:
        return None
    data = runs[0].get("data", {})
    metrics = {m["key"]: m for m in data.get("metrics", [])}
    progress: dict = {k: float(m["value"]) for k, m in metrics.items()}
    phase = next((t["value"] for t in data.get("tags", []) if t["key"] == "conduit.phase"), None)
    if phase:
        progress["phase"] = phase
    if "loss" in metrics:  # the latest value's step: the step training reached
        progress["step"] = float(metrics["loss"].get("step", 0))
    return progress


# The MLflow UI opens an experiment with this tag as a model-training experiment (runs, metrics, charts);
# without it, MLflow 3 may take Conduit's for a GenAI one and show its runs under "Evaluations".
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def start_system_metrics(run_id: str, uri: str, every_s: float, node_id: str | None = None):
    """MLflow's system metrics monitor (CPU, memory, disk, network and GPU use as ``system/...``
    metrics of run ``run_id``, one sample every ``every_s`` seconds), started; call ``finish()`` on it
    at the end. ``node_id`` goes into the names (several nodes logging to one run)."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    credentials.check_uri("the MLflow tracking URI", uri)
    credentials.apply_job_login()
    monitor = SystemMetricsMonitor(run_id, sampling_interval=every_s, tracking_uri=uri, node_id=node_id)
    monitor.start()
    return monitor


def ensure_experiment(uri: str, name: str, artifact_location: str | None = None) -> str:
    """Return the id of experiment ``name``, creating it (with local artifacts where given) if needed,
    marked as a model-training experiment (``EXPERIMENT_KIND``; an earlier one is marked too)."""
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is None:
        exp_id = c.create_experiment(name, artifact_location=artifact_location, tags=dict([EXPERIMENT_KIND]))
    else:
        exp_id = exp.experiment_id
        if exp.tags.get(EXPERIMENT_KIND[0]) is None:
            c.set_experiment_tag(exp_id, *EXPERIMENT_KIND)
    return exp_id


def start_run(uri: str, experiment_id: str, name: str, parent_id: str | None = None,
              tags: dict[str, str] | None = None) -> str:
    """Create a run (nested under ``parent_id`` when given) and return its id. Tag values are sent as
    strings (a server's REST API refuses anything else; a local store would take them)."""
    all_tags = {"mlflow.runName": name, **{k: str(v) for k, v in (tags or {}).items()}}
    if parent_id:
        all_tags["mlflow.parentRunId"] = parent_id
    run = client(uri).create_run(experiment_id, tags=all_tags, run_name=name)
    return run.info.run_id


def end_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(uri).set_terminated(run_id, status=status)


def log_input(c: MlflowClient, run_id: str, name: str, source: str, digest: str, context: str,
              profile: dict[str, Any] | None) -> None:
    """``StageTracker.log_input_dataset`` through the client ``c``: the dataset as MLflow's own file sources
    write it (source ``{"uri": ...}``, typed by the URI's scheme)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    source_type = source.split("://", 1)[0] if is_uri(source) else "local"
    entity = Dataset(name=name, digest=digest, source_type=source_type, source=json.dumps({"uri": source}),
                     profile=None if profile is None else json.dumps(profile, sort_keys=True))
    for attempt in range(DATASET_RACE_TRIES):
        try:
            c.log_inputs(run_id, datasets=[DatasetInput(entity, tags=[InputTag("mlflow.data.context", context)])])
            return
        except MlflowException as e:
            # MLflow's store looks the dataset up, then inserts it if missing: two runs logging one dataset
            # (a sweep's trials, the same token blocks) at once both insert, and the second breaks the
            # table's uniqueness. Once the first insert is in, the lookup finds it: try again.
            if attempt == DATASET_RACE_TRIES - 1 or not _lost_an_insert_race(e):
                raise
            time.sleep(0.05 * (attempt + 1))


DATASET_RACE_TRIES = 5
_UNIQUE_VIOLATIONS = ("UNIQUE constraint failed", "Duplicate entry", "duplicate key value", "IntegrityError")


def _lost_an_insert_race(e: Exception) -> bool:
    """Whether an MLflow error is a uniqueness violation (sqlite's, MySQL's, PostgreSQL's words)."""
    return any(words in str(e) for words in _UNIQUE_VIOLATIONS)


def log_and_register_model(
    tracker,  # the stage's pipeline.stage_tracker.StageTracker
    *,
    weights: Path,
    tokenizer: Path,
    model_name: str,
    alias: str,
    tags: dict[str, Any],
    description: str,
    code_paths: list[str],
    extra_artifacts: dict[str, Path] | None = None,
) -> int:
    """Log the served model (``pipeline.serving.pyfunc.ConduitLM``, as the code of ``pyfunc.MODEL_CODE``) into
    the tracker's run, register it, point ``alias`` at it.

    Args:
        extra_artifacts: more files or folders to ship inside the model (name -> local path), e.g.
            ``metrics.json`` and the Hugging Face export; they land under ``artifacts/`` in the model.

    Returns:
        The new registered model version number.
    """
    with _fluent_uri(tracker.uri), mlflow.start_run(run_id=tracker.run_id):
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(pyfunc.MODEL_CODE),  # models from code: nothing is pickled
            artifacts={"weights": str(weights), "tokenizer": str(tokenizer),
                       **{k: str(v) for k, v in (extra_artifacts or {}).items()}},
            code_paths=code_paths,
            signature=pyfunc.signature(),
            input_example=pyfunc.input_example(),
            pip_requirements=pyfunc.pinned_requirements(),
        )
    version = register_model(tracker.uri, info.model_uri, model_name)
    c = client(tracker.uri)
    for k, v in tags.items():
        c.set_model_version_tag(model_name, str(version), k, str(v))
    c.update_model_version(model_name, str(version), description=description)
    c.set_registered_model_alias(model_name, alias, str(version))
    return version


def register_model(uri: str, model_uri: str, name: str) -> int:
    """Register the logged model ``model_uri`` (``models:/<model id>``) as a new version of ``name`` (made
    when missing), as ``mlflow.register_model`` does, patiently (``_patiently``) and once: after a lost
    answer, a version of ``name`` from ``model_uri`` is the one the earlier try made.

    Returns:
        The version number.
    """
    model_id = model_uri.removeprefix("models:/") if model_uri.startswith("models:/") else None

    def made():
        found = [mv for mv in client(uri, patient=False).search_model_versions(f"name = '{name}'")
                 if mv.source == model_uri or (model_id is not None and mv.model_id == model_id)]
        return min(found, key=lambda mv: int(mv.version)) if found else None

    def register():
        with _fluent_uri(uri):
            return mlflow.register_model(model_uri, name)

    return int(_patiently(uri, f"registering {model_uri} as {name}", register, False, made).version)


# ---- the registry, for jobs/promote.py and jobs/serve.py ------------------------------------------
@dataclass(frozen=True)
class VersionInfo:
    """One registered model version as Conduit reads it."""

    name: str
    version: int
    run_id: str
    tags: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()


def _version_info(mv) -> VersionInfo:
    return VersionInfo(mv.name, int(mv.version), mv.run_id, dict(mv.tags), tuple(mv.aliases))


def model_aliases(uri: str, name: str) -> dict[str, int]:
    """Alias -> version of registered model ``name``.

    Raises:
        LookupError: when no model of that name is registered at ``uri``.
    """
    try:
        rm = client(uri).get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise LookupError(f"no registered model {name!r} in the registry at {uri}") from e
        raise
    return {alias: int(v) for alias, v in rm.aliases.items()}


def get_version(uri: str, name: str, version: int) -> VersionInfo:
    """Version ``version`` of model ``name``.

    Raises:
        LookupError: when the model or the version does not exist.
    """
    try:
        return _version_info(client(uri).get_model_version(name, str(version)))
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise LookupError(f"model {name!r} has no version {version} in the registry at {uri}") from e
        raise


def version_by_alias(uri: str, name: str, alias: str) -> VersionInfo | None:
    """The version ``alias`` points at, or None when the alias is not set.

    Raises:
        LookupError: when no model of that name is registered.
    """
    version = model_aliases(uri, name).get(alias)
    return None if version is None else get_version(uri, name, version)


def versions_with_tag(uri: str, name: str, key: str, value: str) -> list[int]:
    """The versions of model ``name`` whose tag ``key`` is ``value``, ascending."""
    found = client(uri).search_model_versions(f"name = '{name}'")
    return sorted(int(mv.version) for mv in found if mv.tags.get(key) == value)


def set_version_tags(uri: str, name: str, version: int, tags: dict[str, Any]) -> None:
    c = client(uri)
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, str(v))


def set_alias(uri: str, name: str, alias: str, version: int) -> None:
    client(uri).set_registered_model_alias(name, alias, str(version))


def download_model(uri: str, model_ref: str, dst: str | Path) -> Path:
    """Download a registered model's files (``models:/NAME/3`` or ``models:/NAME@alias``) into ``dst``."""
    with _fluent_uri(uri):
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_ref, dst_path=str(dst)))


def hf_export_config(uri: str, name: str, version: int) -> dict | None:
    """The config.json of a registered version's Hugging Face export (``artifacts/hf``), or None when the
    version has none (its ``conduit.hf_export`` tag says why)."""
    import tempfile

    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    if not str(get_version(uri, name, version).tags.get("conduit.hf_export", "")).startswith("artifacts/"):
        return None
    with _fluent_uri(uri), tempfile.TemporaryDirectory(prefix="conduit-hf-config-") as tmp:
        repo = ModelsArtifactRepository(f"models:/{name}/{version}")
        return json.loads(Path(repo.download_artifacts("artifacts/hf/config.json", dst_path=tmp)).read_text())


def download_hf_export(uri: str, name: str, version: int, dst: str | Path) -> Path:
    """Download a registered version's Hugging Face export (``artifacts/hf``) into ``dst``; returns its folder.

    Raises:
        FileNotFoundError: the version has no export.
    """
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    with _fluent_uri(uri):
        local = Path(ModelsArtifactRepository(f"models:/{name}/{version}").download_artifacts("artifacts/hf", str(dst)))
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"models:/{name}/{version} has no Hugging Face export under artifacts/hf")
    return local


def download_weights(uri: str, model_ref: str, dst: str | Path) -> Path:
    """Download a registered Conduit model into ``dst`` and return its weights file (the ``weights``
    artifact its ``MLmodel`` names).

    Raises:
        KeyError: the model has no ``weights`` artifact (not a Conduit model).
    """
    from mlflow.models import Model

    local = download_model(uri, model_ref, dst)
    artifacts = Model.load(str(local)).flavors["python_function"].get("artifacts", {})
    if "weights" not in artifacts:
        raise KeyError(f"{model_ref} has no 'weights' artifact: not a Conduit model")
    return local / artifacts["weights"]["path"]


def load_registered_model(uri: str, model_ref: str):
    """Load ``models:/NAME@alias`` (or ``models:/NAME/3``) as a pyfunc model."""
    with _fluent_uri(uri):
        return mlflow.pyfunc.load_model(model_ref)


def ui_command(uri: str) -> str:
    """The shell command that opens the MLflow UI on this tracking store."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri} in a browser"
    return f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"


def env_for_workers() -> dict[str, str]:
    """MLflow-related environment that stage processes need (telemetry off)."""
    return {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}


__all__ = [
    "TrackingUnavailable", "VersionInfo", "check_login", "check_reachable", "client", "download_hf_export", "download_model", "end_run",
    "ensure_experiment", "env_for_workers", "get_version", "hf_export_config", "load_registered_model", "log_and_register_model",
    "model_aliases", "register_model", "search_runs", "set_alias", "set_version_tags", "stage_progress", "start_run", "ui_command",
    "version_by_alias", "versions_with_tag",
]

"""Deploy a registered model version on Ray Serve, follow its alias on promotion, take it down.

``jobs.deploy`` and ``jobs.promote`` are thin doors onto this module; the replica itself is
``pipeline.serving.app``. One Serve application per registered model, named ``conduit-<model>``.

What is deployed is recorded on the served model version as ``deploy.*`` tags (through
``pipeline.tracking``): ``status`` (starting, running, replaced, failed, down, stopped), ``serve_status``
(Serve's, when deployed), ``endpoint`` (the OpenAI base URL), ``app``, ``alias`` (the alias it follows),
``ray_address`` (the cluster's GCS address), ``settings`` (the ``deploy`` config section, JSON), ``engine``,
``error`` (why it failed) and ``at``. A deployment is recorded ``starting`` before its application is
started, then ``running``; ``follow`` finds the one that follows an alias from these tags, so
``jobs.promote`` reaches it without being told where it is, waits for it while it starts, and redeploys
it with the same settings on the new version: Serve replaces the replicas with a surge (the new ones start
and become ready before the old ones drain), so no request fails during the swap.

Why ``starting`` is recorded first, and the alias read again after it: a promotion moves the alias, then
reads the tags; a deployment writes its tag, then reads the alias. Whichever comes second sees the other's
write, so a deployment that starts while the alias moves is either started on the new version or found
(and waited for, and rolled) by the promotion: never left serving the old one unseen.

Where the cluster is: ``--address`` (a GCS address ``HOST:PORT``), else ``$RAY_ADDRESS`` when it is
not an http(s) Jobs API URL, else the ``CONDUIT_RAY_GCS_ADDRESS`` of the env file written by
``infra/local/up`` (with that cluster's token); else Ray starts here, embedded, and lives as long as
this process.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pipeline import cluster, tracking
from pipeline.base import REPO_ROOT
from pipeline.config import DeploySection
from pipeline.serving import vllm_files, vllm_support
from pipeline.serving.listen import warn_if_exposed

if TYPE_CHECKING:  # a hint only: vllm_app imports Ray at import time
    from pipeline.serving.vllm_app import VllmTarget

APP_PREFIX = "conduit-"
TAG = "deploy."
STARTING, RUNNING = "starting", "running"
# How long a deployment may take to start (a vLLM replica's first start fetches the version and builds its
# engine), and so how long a promotion waits for one that is starting before it gives up naming it.
START_TIMEOUT_S = 900.0
WAIT_POLL_S = 1.0


class DeployError(RuntimeError):
    """The cluster cannot be reached, or the deployment is not where its tags say."""


@dataclass(frozen=True)
class Deployment:
    """A running deployment as ``jobs.deploy`` prints it and the tags record it."""

    app: str
    model_name: str
    version: int
    alias: str
    endpoint: str
    status: str
    ray_address: str
    engine: str = "conduit"
    engine_reason: str = ""


@dataclass(frozen=True)
class Followed:
    """What ``follow`` did to the deployment that follows an alias."""

    deployment: Deployment
    rolled: bool  # False: it was starting when the alias moved, and started on the new version itself
    waited_s: float | None  # how long it waited for the deployment to finish starting (None: it was running)


def app_name(model_name: str) -> str:
    return APP_PREFIX + model_name


def endpoint(section: DeploySection) -> str:
    """The OpenAI base URL of a deployment with these settings (``.../v1``)."""
    return f"http://{section.host}:{section.port}{section.route_prefix.rstrip('/')}/v1"


# ---- the cluster ----------------------------------------------------------------------------------
def resolve_address(address: str | None) -> str | None:
    """The GCS address to connect to: the argument, ``$RAY_ADDRESS`` unless it is an http(s) Jobs API
    URL, the env file's ``CONDUIT_RAY_GCS_ADDRESS``; None means: start Ray here."""
    env = os.environ.get("RAY_ADDRESS")
    if env and env.startswith(("http://", "https://")):
        env = None
    return address or env or cluster.read_env_file(cluster.env_file_path()).get("CONDUIT_RAY_GCS_ADDRESS")


def connect(address: str | None) -> tuple[str, bool]:
    """Connect this process to Ray, unless it already is.

    Args:
        address: a GCS address, or None for ``resolve_address``'s choice.

    Returns:
        ``(gcs_address, started_here)``: started_here is True when Ray was started in this process
        (the deployment then lives as long as the process).

    Raises:
        DeployError: this process is already connected to another cluster.
        ClusterError: the cluster cannot be reached or refuses the token (``cluster.connection_error``).
    """
    resolved = resolve_address(address)
    already = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if resolved is not None and not already:
        # Before ray is imported: Ray reads its auth settings once. Ray 2.60 clusters (ray.init's
        # embedded one included) require a token by default, and a client sends it only under
        # RAY_AUTH_MODE=token; a cluster started with auth disabled says so itself.
        cluster.apply_auth(resolved)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray
    from ray.exceptions import AuthenticationError

    if already:
        current = ray.get_runtime_context().gcs_address
        if address is not None and address not in (current, "auto"):
            raise DeployError(f"this process is connected to the Ray cluster at {current}, not {address}")
        return current, False
    if resolved is None:
        # The replicas' output (Serve's access log line per request, the artifact download's progress
        # bar) stays in Ray's log folder (``serve_log_dir``) instead of flooding this terminal.
        # address="local": a Ray of our own. A bare ray.init() attaches to whatever the last `ray start`
        # wrote to /tmp/ray/ray_current_cluster, and waits forever when that cluster is gone.
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": tracking.env_for_workers()})
        return ray.get_runtime_context().gcs_address, True
    try:
        ray.init(address=resolved, runtime_env={"env_vars": tracking.env_for_workers()})
    except (AuthenticationError, ConnectionError) as e:
        raise cluster.connection_error(resolved, e) from e
    return ray.get_runtime_context().gcs_address, False


def serve_log_dir() -> str:
    """Where this process's Ray keeps Serve's logs (the replicas' access logs among them)."""
    from pipeline.compat import ray_node_of_this_process

    node = ray_node_of_this_process()
    base = node.get_logs_dir_path() if node is not None else "/tmp/ray/session_latest/logs"
    return os.path.join(base, "serve")


# ---- the engine -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineChoice:
    """Which engine serves a version, and why (the line ``jobs.deploy`` prints and tags)."""

    engine: str  # vllm or conduit
    reason: str
    hf_config: dict | None = None  # the export's config.json (vllm)
    python: str | None = None  # the vLLM interpreter (vllm; None: the cluster's own)


def vllm_python(section: DeploySection) -> str | None:
    """The vLLM interpreter ``deploy.vllm_python`` names (relative paths: to the checkout), or None for
    the cluster's own Python."""
    if not section.vllm_python:
        return None
    path = Path(section.vllm_python)
    return str(path if path.is_absolute() else REPO_ROOT / path)


def _vllm_installed(python: str | None) -> str | None:
    """None when ``python`` can import vLLM, else why not (the cluster's own Python is taken on trust)."""
    if python is None:
        return None
    if not os.access(python, os.X_OK):
        return f"no vLLM interpreter at {python} (deploy.vllm_python): build it with `make install-vllm`"
    probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, timeout=60)
    return None if probe.returncode == 0 else (f"{python} cannot import vllm (deploy.vllm_python): "
                                               "build .venv-vllm with `make install-vllm`")


def choose_engine(section: DeploySection, uri: str, name: str, version: int) -> EngineChoice:
    """The engine ``deploy.engine`` picks for ``name`` v``version``.

    ``conduit``: Conduit's engine. ``vllm``: vLLM, or an error saying why it cannot. ``auto``: the engine
    ``benchmarks/serve_vllm.py`` measured faster on the replicas' hardware (vLLM on GPU replicas; on CPU
    replicas only where ``vllm_support.faster_on_cpu`` says it was), when vLLM is installed and can serve
    the version's HF export there; else Conduit's engine. The reason says which rule decided.

    Raises:
        DeployError: ``engine: vllm`` and vLLM cannot serve this version here (the reason).
    """
    if section.engine == "conduit":
        return EngineChoice("conduit", "deploy.engine is conduit")
    hardware = "gpu" if section.num_gpus_per_replica > 0 else "cpu"
    hf = None
    rule = "deploy.engine is vllm"
    if section.engine == "auto" and hardware == "cpu":  # decided before vLLM's interpreter is looked for
        hf = tracking.hf_export_config(uri, name, version)
        faster, why = vllm_support.faster_on_cpu(hf)
        if not faster:
            return EngineChoice("conduit", f"auto: {why}")
        rule = f"auto: {why}"
    elif section.engine == "auto":
        rule = "auto: vLLM on GPU replicas"
    python = vllm_python(section)
    problem = _vllm_installed(python)
    if problem is None:
        hf = hf if hf is not None else tracking.hf_export_config(uri, name, version)
        why_no_export = tracking.get_version(uri, name, version).tags.get("conduit.hf_export")
        problem = vllm_support.check(hf, hardware, why_no_export).reason
    if problem is None:
        arch = hf["architectures"][0]
        return EngineChoice("vllm", f"{rule}; vLLM serves {arch} on {hardware.upper()}", hf, python)
    if section.engine == "vllm":
        raise DeployError(f"deploy.engine is vllm, but vLLM cannot serve {name} v{version} here: {problem}")
    return EngineChoice("conduit", f"auto: vLLM cannot serve it: {problem}")


def _files_cache(uri: str, name: str, version: int) -> str:
    """Where each node keeps a version's files for vLLM (``pipeline.serving.vllm_files``)."""
    run_id = tracking.get_version(uri, name, version).run_id
    return os.path.join(vllm_files.model_dir(uri, name), vllm_files.version_key(uri, name, version, run_id))


def _prune_copies(uri: str, name: str, keep_version: int | None) -> None:
    """Remove, on every node, the model's vLLM copies other than ``keep_version``'s (None: all of them)."""
    keep = None if keep_version is None else os.path.basename(_files_cache(uri, name, keep_version))
    vllm_files.prune_on_every_node(vllm_files.model_dir(uri, name), keep)


def vllm_target(section: DeploySection, uri: str, name: str, version: int, choice: EngineChoice):
    """The vLLM application's settings for ``name`` v``version`` (``pipeline.serving.vllm_app``)."""
    from pipeline.serving.vllm_app import VllmTarget

    gpu = section.num_gpus_per_replica > 0
    return VllmTarget(
        tracking_uri=uri, model_name=name, version=version, app=app_name(name), route_prefix=section.route_prefix,
        num_replicas=section.num_replicas, num_cpus=section.num_cpus_per_replica, num_gpus=section.num_gpus_per_replica,
        max_num_seqs=section.max_batch_size, max_model_len=int(choice.hf_config["max_position_embeddings"]),
        dtype="bfloat16" if gpu else "float32", kv_cache_bytes=int(section.vllm_kv_cache_gib * 2**30),
        cache_dir=_files_cache(uri, name, version), max_ongoing_requests=section.max_ongoing_requests,
        python=choice.python, env=tuple(tracking.env_for_workers().items()))


# ---- deploying ------------------------------------------------------------------------------------
def _run(section: DeploySection, uri: str, name: str, version: int, choice: EngineChoice,
         start_timeout_s: float) -> None:
    from ray import serve

    from pipeline.serving.app import ServeTarget, build

    warn_if_exposed("Ray Serve's HTTP proxy (the OpenAI API)", section.host, "deploy.host")
    serve.start(http_options={"host": section.host, "port": section.port})
    if choice.engine == "vllm":
        _run_vllm(vllm_target(section, uri, name, version, choice), start_timeout_s)
        return
    app = build(ServeTarget(uri, name, version), num_replicas=section.num_replicas,
                num_cpus=section.num_cpus_per_replica, num_gpus=section.num_gpus_per_replica,
                max_ongoing_requests=section.max_ongoing_requests, max_batch_size=section.max_batch_size,
                batch_wait_timeout_s=section.batch_wait_timeout_s, max_batch_tokens=section.max_batch_tokens,
                batching=section.batching)
    serve.run(app, name=app_name(name), route_prefix=section.route_prefix)


def _run_vllm(target: VllmTarget, start_timeout_s: float) -> None:
    """Start the vLLM application; when it fails, nothing of a new application is left to start later.

    Raises:
        DeployError: it did not start (what failed); a new application was removed, an existing one (a
            roll-over) is left to Serve, which keeps its old replicas until new ones are ready.
    """
    from ray import serve

    from pipeline.serving import vllm_app

    existed = app_status(target.model_name) != "NOT_DEPLOYED"
    try:
        vllm_app.launch(target, start_timeout_s)
    except vllm_app.LaunchError as e:
        if existed:  # a roll-over: with the surge, the old replicas serve until new ones are ready
            raise DeployError(f"{e}; {target.app} was already serving: Serve keeps its old replicas until new ones "
                              "are ready") from e
        if app_status(target.model_name) != "NOT_DEPLOYED":
            serve.delete(target.app)
        raise DeployError(f"{e}; {target.app} removed") from e


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _record(uri: str, d: Deployment, section: DeploySection) -> None:
    tracking.set_version_tags(uri, d.model_name, d.version, {
        TAG + "status": RUNNING, TAG + "serve_status": d.status, TAG + "endpoint": d.endpoint, TAG + "app": d.app, TAG + "alias": d.alias,
        TAG + "ray_address": d.ray_address, TAG + "settings": json.dumps(dataclasses.asdict(section)),
        TAG + "engine": d.engine, TAG + "engine_reason": d.engine_reason,
        TAG + "at": _now(),
    })


def _claim(uri: str, name: str, alias: str, section: DeploySection, ray_address: str) -> int:
    """Record the deployment as starting on the version behind ``alias``, then read the alias again: a
    promotion that moved it before the record could be read is followed here (the module docstring).

    Returns:
        The version to deploy, recorded ``deploy.status=starting``.

    Raises:
        LookupError: the model or the alias does not exist.
    """
    target = tracking.version_by_alias(uri, name, alias)
    while True:
        if target is None:
            raise LookupError(f"model {name!r} has no alias {alias!r} (at {uri})")
        tracking.set_version_tags(uri, name, target.version, {
            TAG + "status": STARTING, TAG + "endpoint": endpoint(section), TAG + "app": app_name(name),
            TAG + "alias": alias, TAG + "ray_address": ray_address,
            TAG + "settings": json.dumps(dataclasses.asdict(section)), TAG + "at": _now()})
        now = tracking.version_by_alias(uri, name, alias)
        if now is not None and now.version == target.version:
            return target.version
        before = target.tags.get(TAG + "status")  # what it was before this record (running: a redeploy)
        undo = ({TAG + "status": before} if before else
                {TAG + "status": "replaced", TAG + "replaced_by": str(now and now.version)})
        tracking.set_version_tags(uri, name, target.version, {**undo, TAG + "at": _now()})
        target = now


def deploy(section: DeploySection, uri: str, name: str, alias: str, ray_address: str,
           start_timeout_s: float | None = None) -> Deployment:
    """Serve the version behind ``name@alias`` on the connected cluster (``connect`` first).

    Redeploying an application that serves another version rolls it over to this one. The version is
    tagged ``deploy.status=starting`` before the application starts (``follow`` waits for it), ``running``
    once it serves, ``failed`` (with ``deploy.error``) when it did not start. Once it serves vLLM, or a
    vLLM deployment goes, the model's vLLM copies of other versions are removed from every node.

    Args:
        section: replicas, resources, HTTP host/port/prefix and batching.
        uri: the MLflow tracking/registry URI (the replicas download the model from it).
        ray_address: the connected cluster's GCS address, recorded for ``follow``.
        start_timeout_s: how long vLLM's application may take to start (default ``START_TIMEOUT_S``).

    Returns:
        The running deployment (also recorded as ``deploy.*`` tags on the version).

    Raises:
        LookupError: the model or the alias does not exist.
        DeployError: ``deploy.engine: vllm`` cannot serve it, or vLLM's application did not start.
    """
    before = served_version(uri, name)
    before_vllm = before is not None and tracking.get_version(uri, name, before).tags.get(TAG + "engine") == "vllm"
    version = _claim(uri, name, alias, section, ray_address)
    choice = None
    try:
        choice = choose_engine(section, uri, name, version)
        _run(section, uri, name, version, choice, START_TIMEOUT_S if start_timeout_s is None else start_timeout_s)
    except BaseException as e:  # Ctrl-C included: the starting record must not outlive this call
        tracking.set_version_tags(uri, name, version, {
            TAG + "status": "failed", TAG + "error": f"{type(e).__name__}: {e}"[:4000], TAG + "at": _now()})
        if isinstance(e, Exception) and before is None and choice is not None and choice.engine == "vllm":
            _prune_copies(uri, name, None)  # a new deployment: what its replicas fetched is of no use
        raise
    d = Deployment(app_name(name), name, version, alias, endpoint(section), app_status(name), ray_address,
                   choice.engine, choice.reason)
    _record(uri, d, section)
    if before is not None and before != version:
        tracking.set_version_tags(uri, name, before, {TAG + "status": "replaced",
                                                      TAG + "replaced_by": str(version), TAG + "at": _now()})
    if choice.engine == "vllm" or before_vllm:
        _prune_copies(uri, name, version if choice.engine == "vllm" else None)
    return d


def app_status(name: str) -> str:
    """Serve's status of the model's application (RUNNING, DEPLOYING, ...), or NOT_DEPLOYED."""
    from ray import serve

    app = serve.status().applications.get(app_name(name))
    return "NOT_DEPLOYED" if app is None else app.status.value


def down(uri: str, name: str) -> bool:
    """Delete the model's application from the connected cluster, tag the version it served (per the
    registry's ``deploy.status=running``) ``down`` and, for vLLM, remove the model's copies from every node.

    Returns:
        Whether an application was deleted (False: none is deployed on this cluster; no tag changes).
    """
    from ray import serve

    if app_status(name) == "NOT_DEPLOYED":
        return False
    served = served_version(uri, name)
    serve.delete(app_name(name))
    if served is not None:
        tracking.set_version_tags(uri, name, served, {TAG + "status": "down", TAG + "at": _now()})
        if tracking.get_version(uri, name, served).tags.get(TAG + "engine") == "vllm":
            _prune_copies(uri, name, None)
    return True


def _recorded(uri: str, name: str, statuses: tuple[str, ...]) -> dict[int, dict[str, str]]:
    """The versions whose ``deploy.status`` is one of ``statuses``, with their tags."""
    found = sorted({v for status in statuses for v in tracking.versions_with_tag(uri, name, TAG + "status", status)})
    return {v: tracking.get_version(uri, name, v).tags for v in found}


def recorded_address(uri: str, name: str) -> str | None:
    """The GCS address of the cluster that the registry says serves the model (its running or starting
    version's ``deploy.ray_address``), or None when no version is tagged so."""
    recorded = _recorded(uri, name, (RUNNING, STARTING))
    return next((tags[TAG + "ray_address"] for tags in recorded.values()), None)


def served_version(uri: str, name: str) -> int | None:
    """The version whose tags say it is running (the registry's record, not the cluster's).

    Raises:
        DeployError: more than one version is tagged running (the record is inconsistent).
    """
    running = tracking.versions_with_tag(uri, name, TAG + "status", RUNNING)
    if len(running) > 1:
        raise DeployError(f"versions {running} of {name!r} are all tagged {TAG}status=running; one deployment "
                          "per model serves one version (fix the tags, or redeploy with jobs.deploy)")
    return running[0] if running else None


def mark_stopped(uri: str, name: str, version: int) -> None:
    """Tag a version whose deployment ended with its process (the embedded Ray of ``jobs.deploy``), and
    remove its vLLM copy (that Ray's only node is this machine)."""
    tracking.set_version_tags(uri, name, version, {TAG + "status": "stopped", TAG + "at": _now()})
    if tracking.get_version(uri, name, version).tags.get(TAG + "engine") == "vllm":
        vllm_files.prune(vllm_files.model_dir(uri, name), None)


def _wait_started(uri: str, name: str, address: str, timeout_s: float) -> float:
    """Wait until no version of the model is tagged starting.

    Returns:
        The seconds waited.

    Raises:
        DeployError: one is still starting after ``timeout_s`` (naming the application and the version).
    """
    t0 = time.monotonic()
    while starting := tracking.versions_with_tag(uri, name, TAG + "status", STARTING):
        if time.monotonic() - t0 > timeout_s:
            since = tracking.get_version(uri, name, starting[0]).tags.get(TAG + "at", "?")
            raise DeployError(
                f"{app_name(name)!r} on the Ray cluster at {address} is still starting v{starting[0]} (deploy.status="
                f"starting since {since}) after {timeout_s:.0f} s; if its jobs.deploy is gone, deploy again or take it "
                f"down with: python -m jobs.deploy {name} --down --address {address}")
        time.sleep(WAIT_POLL_S)
    return time.monotonic() - t0


def _deployment(name: str, version: int, tags: dict[str, str]) -> Deployment:
    return Deployment(tags[TAG + "app"], name, version, tags[TAG + "alias"], tags[TAG + "endpoint"],
                      tags.get(TAG + "serve_status", ""), tags[TAG + "ray_address"],
                      tags.get(TAG + "engine", "conduit"), tags.get(TAG + "engine_reason", ""))


def follow(uri: str, name: str, alias: str, new: int,
           notify: Callable[[str], None] | None = None) -> Followed | None:
    """After ``alias`` moved to ``new``: bring the deployment that follows the alias (tagged running or
    starting under it) to ``new``, with the settings recorded on the version it serves. One that is
    starting is waited for (``START_TIMEOUT_S``; ``notify`` is told), then rolled over unless it started on
    ``new`` itself.

    Returns:
        What was done, or None when no deployment follows ``alias``.

    Raises:
        DeployError: the recorded cluster no longer runs the application, the deployment that was starting
            did not start, or is still starting after ``START_TIMEOUT_S`` (naming the application).
        ClusterError: the recorded cluster cannot be reached.
    """
    recorded = {v: tags for v, tags in _recorded(uri, name, (RUNNING, STARTING)).items()
                if tags.get(TAG + "alias") == alias}
    if not recorded:
        return None
    address = next(iter(recorded.values()))[TAG + "ray_address"]
    gcs, _ = connect(address)
    waited = None
    starting = [v for v, tags in recorded.items() if tags[TAG + "status"] == STARTING]
    if starting:
        if notify is not None:
            notify(f"{app_name(name)} on the Ray cluster at {address} is starting v{starting[0]}: waiting for it "
                   f"(at most {START_TIMEOUT_S:.0f} s) to roll it to v{new}")
        waited = _wait_started(uri, name, address, START_TIMEOUT_S)
    served = served_version(uri, name)
    if served is None:
        tags = tracking.get_version(uri, name, starting[0]).tags if starting else {}
        status, error = tags.get(TAG + "status"), tags.get(TAG + "error", "")
        raise DeployError(f"{app_name(name)!r} was starting v{starting[0] if starting else '?'} when @{alias} moved, "
                          f"but it did not start (deploy.status={status}: {error}); nothing serves @{alias}")
    tags = tracking.get_version(uri, name, served).tags
    if tags.get(TAG + "alias") != alias:
        return None
    if app_status(name) == "NOT_DEPLOYED":
        raise DeployError(f"v{served} is tagged as served by {app_name(name)!r} on the Ray cluster at {address}, "
                          "but that cluster runs no such application (stopped without --down?)")
    if served == new:
        return Followed(_deployment(name, served, tags), rolled=False, waited_s=waited)
    d = deploy(DeploySection(**json.loads(tags[TAG + "settings"])), uri, name, alias, gcs)
    if d.version != new:
        raise DeployError(f"@{alias} points at v{d.version}, not v{new}: it moved again meanwhile")
    return Followed(d, rolled=True, waited_s=waited)

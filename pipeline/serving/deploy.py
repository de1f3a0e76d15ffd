"""Deploy a registered model version on Ray Serve, follow its alias on promotion, take it down.

``jobs.deploy`` and ``jobs.promote`` are thin doors onto this module; the replica itself is
``pipeline.serving.app``. One Serve application per registered model, named ``conduit-<model>``.

What is deployed is recorded on the served model version as ``deploy.*`` tags (through
``pipeline.tracking``): ``status`` (running, replaced, down, stopped), ``serve_status`` (Serve's, when
deployed), ``endpoint`` (the OpenAI base URL),
``app``, ``alias`` (the alias it follows), ``ray_address`` (the cluster's GCS address), ``settings`` (the
``deploy`` config section, JSON) and ``at``. ``follow`` reads them from the version that held the alias
before a promotion, so ``jobs.promote`` finds the deployment without being told where it is, and
redeploys it with the same settings on the new version: Serve replaces the replicas with a surge (the
new ones start and become ready before the old ones drain), so no request fails during the swap.

Where the cluster is: ``--address`` (a GCS address ``HOST:PORT``), else ``$RAY_ADDRESS`` when it is
not an http(s) Jobs API URL, else the ``CONDUIT_RAY_GCS_ADDRESS`` of the env file written by
``infra/local/up`` (with that cluster's token); else Ray starts here, embedded, and lives as long as
this process.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline import cluster, tracking
from pipeline.base import REPO_ROOT
from pipeline.config import DeploySection
from pipeline.serving import vllm_support
from pipeline.serving.listen import warn_if_exposed

APP_PREFIX = "conduit-"
TAG = "deploy."


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
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # no public accessor in Ray 2.60
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
        return f"no vLLM interpreter at {python} (deploy.vllm_python; `make install` builds .venv-vllm)"
    probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, timeout=60)
    return None if probe.returncode == 0 else f"{python} cannot import vllm (deploy.vllm_python)"


def choose_engine(section: DeploySection, uri: str, name: str, version: int) -> EngineChoice:
    """The engine ``deploy.engine`` picks for ``name`` v``version``.

    ``conduit``: Conduit's engine. ``vllm``: vLLM, or an error saying why it cannot. ``auto``: vLLM when it
    is installed and can serve the version's HF export on the replicas' hardware, else Conduit's engine.

    Raises:
        DeployError: ``engine: vllm`` and vLLM cannot serve this version here (the reason).
    """
    if section.engine == "conduit":
        return EngineChoice("conduit", "deploy.engine is conduit")
    hardware = "gpu" if section.num_gpus_per_replica > 0 else "cpu"
    python = vllm_python(section)
    problem = _vllm_installed(python)
    hf = None
    if problem is None:
        hf = tracking.hf_export_config(uri, name, version)
        why_no_export = tracking.get_version(uri, name, version).tags.get("conduit.hf_export")
        verdict = vllm_support.check(hf, hardware, why_no_export)
        problem = verdict.reason
    if problem is None:
        arch = hf["architectures"][0]
        return EngineChoice("vllm", f"vLLM serves {arch} on {hardware.upper()}", hf, python)
    if section.engine == "vllm":
        raise DeployError(f"deploy.engine is vllm, but vLLM cannot serve {name} v{version} here: {problem}")
    return EngineChoice("conduit", f"vLLM cannot serve it: {problem}")


def _files_cache(uri: str, name: str, version: int) -> str:
    """Where each node keeps a version's files for vLLM: one folder per registry, model and version (and
    the run that made it, so that a new registry reusing the name and number never meets old files)."""
    run_id = tracking.get_version(uri, name, version).run_id
    key = hashlib.sha256(f"{uri}|{name}|{version}|{run_id}".encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "conduit-vllm", key)


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
def _run(section: DeploySection, uri: str, name: str, version: int, choice: EngineChoice) -> None:
    from ray import serve

    from pipeline.serving.app import ServeTarget, build

    warn_if_exposed("Ray Serve's HTTP proxy (the OpenAI API)", section.host, "deploy.host")
    serve.start(http_options={"host": section.host, "port": section.port})
    if choice.engine == "vllm":
        from pipeline.serving import vllm_app

        try:
            vllm_app.launch(vllm_target(section, uri, name, version, choice))
        except RuntimeError as e:
            raise DeployError(str(e)) from e
        return
    app = build(ServeTarget(uri, name, version), num_replicas=section.num_replicas,
                num_cpus=section.num_cpus_per_replica, num_gpus=section.num_gpus_per_replica,
                max_ongoing_requests=section.max_ongoing_requests, max_batch_size=section.max_batch_size,
                batch_wait_timeout_s=section.batch_wait_timeout_s, max_batch_tokens=section.max_batch_tokens,
                batching=section.batching)
    serve.run(app, name=app_name(name), route_prefix=section.route_prefix)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _record(uri: str, d: Deployment, section: DeploySection) -> None:
    tracking.set_version_tags(uri, d.model_name, d.version, {
        TAG + "status": "running", TAG + "serve_status": d.status, TAG + "endpoint": d.endpoint, TAG + "app": d.app, TAG + "alias": d.alias,
        TAG + "ray_address": d.ray_address, TAG + "settings": json.dumps(dataclasses.asdict(section)),
        TAG + "engine": d.engine, TAG + "engine_reason": d.engine_reason,
        TAG + "at": _now(),
    })


def deploy(section: DeploySection, uri: str, name: str, alias: str, ray_address: str) -> Deployment:
    """Serve the version behind ``name@alias`` on the connected cluster (``connect`` first).

    Redeploying an application that serves another version rolls it over to this one.

    Args:
        section: replicas, resources, HTTP host/port/prefix and batching.
        uri: the MLflow tracking/registry URI (the replicas download the model from it).
        ray_address: the connected cluster's GCS address, recorded for ``follow``.

    Returns:
        The running deployment (also recorded as ``deploy.*`` tags on the version).

    Raises:
        LookupError: the model or the alias does not exist.
        DeployError: ``deploy.engine: vllm`` cannot serve it, or vLLM's application did not start.
    """
    target = tracking.version_by_alias(uri, name, alias)
    if target is None:
        raise LookupError(f"model {name!r} has no alias {alias!r} (at {uri})")
    before = served_version(uri, name)
    choice = choose_engine(section, uri, name, target.version)
    _run(section, uri, name, target.version, choice)
    d = Deployment(app_name(name), name, target.version, alias, endpoint(section), app_status(name), ray_address,
                   choice.engine, choice.reason)
    _record(uri, d, section)
    if before is not None and before != target.version:
        tracking.set_version_tags(uri, name, before, {TAG + "status": "replaced",
                                                      TAG + "replaced_by": str(target.version), TAG + "at": _now()})
    return d


def app_status(name: str) -> str:
    """Serve's status of the model's application (RUNNING, DEPLOYING, ...), or NOT_DEPLOYED."""
    from ray import serve

    app = serve.status().applications.get(app_name(name))
    return "NOT_DEPLOYED" if app is None else app.status.value


def down(uri: str, name: str) -> bool:
    """Delete the model's application from the connected cluster and tag the version it served
    (per the registry's ``deploy.status=running``) ``down``.

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
    return True


def recorded_address(uri: str, name: str) -> str | None:
    """The GCS address of the cluster that the registry says serves the model (its running version's
    ``deploy.ray_address``), or None when no version is tagged running."""
    served = served_version(uri, name)
    return None if served is None else tracking.get_version(uri, name, served).tags[TAG + "ray_address"]


def served_version(uri: str, name: str) -> int | None:
    """The version whose tags say it is running (the registry's record, not the cluster's).

    Raises:
        DeployError: more than one version is tagged running (the record is inconsistent).
    """
    running = tracking.versions_with_tag(uri, name, TAG + "status", "running")
    if len(running) > 1:
        raise DeployError(f"versions {running} of {name!r} are all tagged {TAG}status=running; one deployment "
                          "per model serves one version (fix the tags, or redeploy with jobs.deploy)")
    return running[0] if running else None


def mark_stopped(uri: str, name: str, version: int) -> None:
    """Tag a version whose deployment ended with its process (the embedded Ray of ``jobs.deploy``)."""
    tracking.set_version_tags(uri, name, version, {TAG + "status": "stopped", TAG + "at": _now()})


def follow(uri: str, name: str, alias: str, previous: int, new: int) -> Deployment | None:
    """After ``alias`` moved from ``previous`` to ``new``: roll a deployment that follows the alias
    over to ``new``, with the settings recorded on ``previous``.

    Returns:
        The new deployment, or None when ``previous`` was not being served under ``alias``.

    Raises:
        DeployError: the recorded cluster cannot be reached, or no longer runs the application.
    """
    tags = tracking.get_version(uri, name, previous).tags
    if tags.get(TAG + "status") != "running" or tags.get(TAG + "alias") != alias:
        return None
    address = tags[TAG + "ray_address"]
    section = DeploySection(**json.loads(tags[TAG + "settings"]))
    gcs, _ = connect(address)
    if app_status(name) == "NOT_DEPLOYED":
        raise DeployError(f"v{previous} is tagged as served by {app_name(name)!r} on the Ray cluster at {address}, "
                          "but that cluster runs no such application (stopped without --down?)")
    d = deploy(section, uri, name, alias, gcs)
    if d.version != new:
        raise DeployError(f"@{alias} points at v{d.version}, not v{new}: it moved again meanwhile")
    return d

"""The stage DAG runner: the one module that knows Ray tasks.

It resolves the config, computes every stage's artifact hash up front (hashes depend on config and
input hashes only, so a dry run needs no data), then walks the stages in dependency order. A stage
whose manifest exists is skipped ("tokenize: cached (3f9a1c...)"); the others run as Ray tasks,
each under a nested MLflow run of the pipeline's parent run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline import cluster, tracking
from pipeline.stage_tracker import StageTracker
from pipeline.store import locks
from pipeline.store.artifacts import Artifact
from pipeline.config import ConfigError, RunConfig, config_from_dict, flatten
from pipeline.serving.listen import warn_if_exposed
from pipeline.preflight import DiskError, check_cluster_resources, check_disk, unwritable
from pipeline.base import StageFailed, interruptible  # noqa: F401 - offered here too
from pipeline.errors import EXPECTED_ERRORS, main_exit_code  # noqa: F401 - offered here too
from pipeline.stage_plan import PlanItem, downstream, format_plan, make_plan, resolve  # noqa: F401 - offered here too
from pipeline.stages import ORDER, STAGES, Stage  # ORDER offered here too (the sweep reads it; jobs read STAGE_ORDER)
from pipeline.store.backends import Transfer, is_uri, join, release_held, store_for


@dataclass
class PipelineResult:
    run_id: str | None
    tracking_uri: str
    plan: list[PlanItem]
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    transfers: dict[str, Transfer] = field(default_factory=dict)  # stages that ran: bytes to/from the store


def worker_env() -> dict[str, str]:
    """Environment every stage task and training worker gets, here or on a cluster."""
    env = {
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # Ray Train starts a preemption watcher (an actor: a process, 1.5-2.5 CPU-seconds) with every worker
        # group; it logs node drains and marks the workers, which nothing of ours reads (a drained node's
        # workers fail and restart from the last checkpoint either way). The stage task's value reaches the
        # controller (Ray Train propagates it from the process that calls fit).
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
        # DeepSpeed compiles its ops once per machine; a pinned folder keeps Ray workers from rebuilding.
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "conduit" / "torch_extensions")
        ),
        **tracking.env_for_workers(),
    }
    return env


def ray_runtime_env() -> dict:
    """The runtime_env of the driver's ``ray.init``: ``worker_env()`` and the hook that quiets Ray's
    own noise in each worker process (``pipeline.compat.quiet_ray_worker``)."""
    return {"env_vars": worker_env(), "worker_process_setup_hook": "pipeline.compat.quiet_ray_worker"}


def connect_ray(cfg: RunConfig) -> bool:
    """Connect to ``cluster.address`` / $RAY_ADDRESS, or start a local Ray in-process.

    Returns:
        True when this call started or connected Ray (and so should shut it down).

    Raises:
        ClusterError: the cluster at the address does not answer or refuses this client's token.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.update(worker_env())  # a local cluster's workers inherit the driver's environment
    # Ray's core worker replaces the process's SIGTERM handler with a crash logger that aborts; a
    # caller's own handler (jobs.run turns SIGTERM into Ctrl-C, so runs end KILLED) is put back after.
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        _init_ray(cfg)
    finally:
        if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    return True


def _init_ray(cfg: RunConfig) -> None:
    import ray
    from ray.exceptions import AuthenticationError

    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, runtime_env=ray_runtime_env(), log_to_driver=True)
        except (AuthenticationError, ConnectionError) as e:
            raise cluster.connection_error(address, e) from e
    else:
        ray.init(**local_ray_options(cfg))


def local_ray_options(cfg: RunConfig) -> dict:
    """``ray.init`` arguments of the embedded local Ray; warns when its dashboard (which also serves the
    Jobs API) will listen beyond this machine (``cluster.dashboard_host``)."""
    if cfg.cluster.include_dashboard:
        warn_if_exposed("the embedded Ray's dashboard and Jobs API", cfg.cluster.dashboard_host,
                        "cluster.dashboard_host")
    return {
        "address": "local",  # our own: never attach to whatever /tmp/ray/ray_current_cluster names
        "num_cpus": cfg.cluster.num_cpus or os.cpu_count(),
        "include_dashboard": cfg.cluster.include_dashboard,
        "dashboard_host": cfg.cluster.dashboard_host,
        "runtime_env": ray_runtime_env(),
    }


def check_shared_storage(cfg: RunConfig, num_nodes: int) -> None:
    """Refuse a multi-node cluster whose stages would write where other nodes cannot read.

    Raises:
        ConfigError: more than one node, a local ``artifact_root`` or checkpoint path, or a sqlite
            MLflow store (a file on this machine that stage tasks elsewhere log to), and no
            ``cluster.shared_storage`` assertion.
    """
    if num_nodes <= 1 or cfg.cluster.shared_storage:
        return
    local = [f"{name}={path}" for name, path in (
        ("run.artifact_root", cfg.artifact_root()), ("checkpoint.storage", cfg.checkpoint.storage),
    ) if path and not is_uri(path)]
    if local:
        raise ConfigError(
            f"the Ray cluster has {num_nodes} nodes but {', '.join(local)} is a local path: stages and "
            "training workers on other nodes would not see each other's files. Use shared storage "
            "(an s3:// or gs:// URI, or a shared-filesystem mount) and set cluster.shared_storage=true"
        )
    if cfg.tracking_uri().startswith("sqlite:"):
        raise ConfigError(
            f"the Ray cluster has {num_nodes} nodes but tracking.uri={cfg.tracking_uri()} is a file on this "
            "machine: stage tasks and training workers on other nodes log to it. Use an MLflow server "
            "(infra/local/up, infra/k8s/mlflow.yaml; tracking.uri or $MLFLOW_TRACKING_URI), or set "
            "cluster.shared_storage=true if the file is on a mount every node shares"
        )


def ray_job_submission_id() -> str | None:
    """The Ray job submission id when this driver runs as a Ray job, else None.

    Ray puts it in the job config it hands the driver (``RAY_JOB_CONFIG_JSON_ENV_VAR``, under
    ``metadata.job_submission_id``); ``jobs.submit`` also sets ``RAY_JOB_SUBMISSION_ID``.
    """
    if os.environ.get("RAY_JOB_SUBMISSION_ID"):
        return os.environ["RAY_JOB_SUBMISSION_ID"]
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    return json.loads(raw).get("metadata", {}).get("job_submission_id")


STAGE_RESOURCE_SHARE = 0.001  # of each cluster.stage_resources name, per stage task: a label, not a limit


def _stage_task(stage: Stage, cfg_dict: dict, hash_: str, inputs: dict[str, Artifact], tracker) -> Transfer:
    """A stage's Ray task: its inputs on this node, its body into a node-local folder, sealed and
    published to the artifact store (``pipeline.store.backends``; in place for a local root)."""
    interruptible()
    cfg = config_from_dict(cfg_dict, source="<resolved>")
    store = store_for(cfg.artifact_root())
    try:
        local_inputs = {k: a if k in stage.read_in_place else store.fetch(a) for k, a in inputs.items()}
        store.publish(stage.execute(cfg, hash_, store.prepare_build(stage.name, hash_), local_inputs, tracker))
    finally:
        release_held()  # this worker process may run other tasks: the node's cache may drop these copies now
    if is_uri(store.root):
        tracker.set_tags(store.transfer.as_tags())
    return store.transfer


def run_pipeline(cfg: RunConfig, *, only: str | None = None, until: str | None = None,
                 force: tuple[str, ...] = (), dry_run: bool = False, echo: Callable[[str], None] = print,
                 stages: dict[str, Stage] = STAGES, nest: Nesting | None = None) -> PipelineResult:
    """Run (or, with ``dry_run``, just plan) the pipeline for ``cfg``.

    Args:
        stages: the stage table in dependency order; the pipeline's six by default.
        nest: the pipeline as part of something larger (a sweep's trial): its MLflow run nested under
            another, with more tags and params, and the train stage's extra Ray Train callbacks.

    Raises:
        ConfigError: bad stage names or missing inputs for ``only``.
        StageFailed: a stage raised; its MLflow run and the pipeline's are FAILED and its folder has no
            manifest (the next run redoes it); earlier stages' artifacts stay, so a rerun resumes there.
    """
    import ray

    cfg = resolve(cfg)
    plan = make_plan(cfg, only=only, force=force, stages=stages, until=until)
    uri = cfg.tracking_uri()
    if dry_run:
        echo(format_plan(plan))
        return PipelineResult(run_id=None, tracking_uri=uri, plan=plan)

    tracking.check_reachable(uri)  # a server that is down fails the run here, before any compute
    started_ray = connect_ray(cfg)
    try:
        alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        check_shared_storage(cfg, len(alive))
        check_cluster_resources(cfg, ray.cluster_resources(), [p.stage for p in plan if p.run],
                                [r.get("CPU", 0.0) for r in alive], [r.get("GPU", 0.0) for r in alive])
        return _run_stages(cfg, plan, uri, echo, stages, nest or Nesting())
    finally:
        if started_ray:
            ray.shutdown()


@dataclass(frozen=True)
class Nesting:
    """What a pipeline run that is part of something larger (a sweep's trial) adds to a plain one.

    Attributes:
        run_id: an MLflow run, already started, to be the pipeline's run (None: start one).
        parent_run_id: the MLflow run the pipeline's run is nested under (None: top level).
        tags, params: more tags and params for the pipeline's MLflow run.
        train_callbacks: Ray Train callbacks the train stage hands its trainer (a sweep's report to Tune).
    """

    run_id: str | None = None
    parent_run_id: str | None = None
    tags: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    train_callbacks: tuple = ()


def _run_stages(cfg: RunConfig, plan: list[PlanItem], uri: str, echo: Callable[[str], None],
                stages: dict[str, Stage], nest: Nesting) -> PipelineResult:
    cfg.workdir().mkdir(parents=True, exist_ok=True)
    local_store = uri.startswith("sqlite:")
    exp_id = tracking.ensure_experiment(
        uri, cfg.tracking.experiment,
        artifact_location=str(cfg.workdir() / "mlartifacts") if local_store else None,
    )
    for line in fail_runs_of_dead_drivers(uri, exp_id, cfg):
        echo(line)
    # Inside `ray job submit` the parent run is named after the job, so the two find each other.
    job_id = ray_job_submission_id()
    tags = {"conduit.ray_job_id": job_id or "local", "conduit.config_name": cfg.run.name,
            "conduit.workdir": str(cfg.workdir()), DRIVER_TAG: json.dumps(driver_identity()), **nest.tags}
    if nest.run_id:
        parent = nest.run_id
        StageTracker(uri, parent).set_tags(tags)
    else:
        parent = tracking.start_run(uri, exp_id, job_id or cfg.run.name, parent_id=nest.parent_run_id, tags=tags)
    result = PipelineResult(run_id=parent, tracking_uri=uri, plan=plan)
    store = store_for(cfg.artifact_root())
    try:
        StageTracker(uri, parent).log_params({**flatten(cfg.to_dict()), **nest.params})
        for item in plan:
            stage = stages[item.stage]
            if not item.run and item.cached:
                if _use_cached(store, item, result, echo):
                    continue
            elif not item.run:
                continue
            lock = _lock_stage(cfg, item, parent, echo)
            try:
                if lock.took_over:
                    echo(f"{item.stage}: took over the lock left by {locks.describe(lock.took_over)}, "
                         "which is no longer running")
                if not item.forced and store.is_complete(item.stage, item.hash) and \
                        _use_cached(store, item, result, echo):
                    continue  # the driver this one waited for finished it
                _run_one(cfg, store, item, stage, result, uri, exp_id, parent, echo, nest.train_callbacks)
            finally:
                lock.release()
        StageTracker(uri, parent).set_tags(
            {f"conduit.artifact.{k}": a.hash for k, a in result.artifacts.items()}
        )
        tracking.end_run(uri, parent)
    except BaseException as e:
        tracking.end_run(uri, parent, end_status(e))
        raise
    return result


def _lock_stage(cfg: RunConfig, item: PlanItem, run_id: str, echo: Callable[[str], None]) -> locks.Acquired:
    """Take the stage's lock, held from clearing its folder until it is sealed or has failed: another
    driver of this config waits (``run.lock_wait_s``) or stops, naming this one.

    Raises:
        StageLocked: another live driver holds it.
        DiskError: the lock file cannot be made: the stage's folder in the artifact root is not writable
            (its lock is the first thing a stage writes there, before ``check_disk``'s probes).
    """
    try:
        return locks.acquire(cfg.artifact_root(), item.stage, item.hash, wait_s=cfg.run.lock_wait_s,
                             run_id=run_id, on_wait=lambda line: echo(f"{item.stage}: {line}"))
    except OSError as e:
        raise unwritable(item.stage, join(cfg.artifact_root(), item.stage), e) from e


def _use_cached(store, item: PlanItem, result: PipelineResult, echo: Callable[[str], None]) -> bool:
    """Take a sealed artifact as this run's, after checking its files; False when it is damaged."""
    cached = store.load(item.stage, item.hash)
    damage = store.check(cached)
    if damage is None:
        result.artifacts[item.stage] = cached
        echo(f"{item.stage}: cached ({item.hash})")
        return True
    echo(f"{item.stage}: the cached artifact is damaged ({damage}); rebuilding it")
    return False


def _run_one(cfg: RunConfig, store, item: PlanItem, stage: Stage, result: PipelineResult, uri: str, exp_id: str,
             parent: str, echo: Callable[[str], None], train_callbacks: tuple = ()) -> None:
    """Run one stage as a Ray task under its own nested MLflow run (the caller holds its lock)."""
    import ray

    inputs = {i: result.artifacts[i] for i in stage.inputs}
    check_disk(cfg, item, stage, inputs)
    child = tracking.start_run(uri, exp_id, item.stage, parent_id=parent, tags={
        "conduit.stage": item.stage, "conduit.hash": item.hash,
        **{f"conduit.input.{k}": a.hash for k, a in inputs.items()},
    })
    tracker = StageTracker(uri, child, train_callbacks if item.stage == "train" else ())
    store.clear(item.stage, item.hash)  # forced, damaged, or left unsealed by an earlier attempt
    if item.forced and stage.discard_state is not None:
        stage.discard_state(cfg, item.hash)  # an unforced rerun resumes from it instead
    if _CANCELLING.is_set():  # this process's pipeline is being stopped (cancel_stage_tasks): start nothing more
        tracking.end_run(uri, child, "KILLED")
        raise ray.exceptions.TaskCancelledError()
    echo(f"{item.stage}: running ({item.hash})")
    res = stage.task_resources(cfg, inputs)
    ref = ray.remote(_stage_task).options(
        num_cpus=res.cpus, num_gpus=res.gpus, name=f"conduit.{item.stage}",
        # never inside a caller's placement group (a sweep trial's, which holds no CPU for its stages)
        scheduling_strategy="DEFAULT",
        resources={r: STAGE_RESOURCE_SHARE for r in cfg.cluster.stage_resources},
    ).remote(stage, cfg.to_dict(), item.hash, inputs, tracker)
    _IN_FLIGHT[ref.hex()] = ref
    if _CANCELLING.is_set():  # cancel_stage_tasks came between the check above and the submit
        ray.cancel(ref, force=False)
    try:
        transfer = ray.get(ref)
    except ray.exceptions.TaskCancelledError:  # cancel_stage_tasks (Ray raises it as the task's error too)
        tracking.end_run(uri, child, "KILLED")
        raise
    except ray.exceptions.RayTaskError as e:
        record_failure(tracker, e.cause, str(e))
        tracking.end_run(uri, child, "FAILED")
        raise StageFailed(f"stage {item.stage} failed: {e.cause!r}") from e.cause
    except BaseException as e:  # Ctrl-C / SIGTERM (KeyboardInterrupt), a cancel, or the driver's own error
        tracking.end_run(uri, child, end_status(e))
        raise
    finally:
        _IN_FLIGHT.pop(ref.hex(), None)
    art = store.load(item.stage, item.hash)
    result.artifacts[item.stage] = art
    result.transfers[item.stage] = transfer
    tracker.set_tags({"conduit.seconds": art.manifest["seconds"]})
    tracking.end_run(uri, child)
    moved = ""
    if is_uri(store.root):
        moved = (f"; fetched {transfer.fetched_bytes / 1e6:.1f} MB in {transfer.fetch_seconds:.1f}s, "
                 f"uploaded {transfer.uploaded_bytes / 1e6:.1f} MB in {transfer.upload_seconds:.1f}s")
    echo(f"{item.stage}: done in {art.manifest['seconds']:.1f}s ({item.hash}{moved})")


_IN_FLIGHT: dict = {}  # this process's stage tasks being waited for, by object id (cancel_stage_tasks)
_CANCELLING = threading.Event()  # set by cancel_stage_tasks until allow_stage_tasks


def cancel_stage_tasks(wait_s: float) -> int:
    """End this process's running stage tasks as Ctrl-C would (a KeyboardInterrupt in each task, Ray's
    non-force cancel) and wait up to ``wait_s`` for them to end; a pipeline of this process between two
    stages starts no more, until ``allow_stage_tasks``. The tasks' Ray worker processes live on, with what
    they imported, for the next task, where killing the caller's process would take them along (Ray ends
    the tasks a dead process owned with their workers). Each stage's MLflow run ends KILLED; the caller's
    ``run_pipeline`` raises ``ray.exceptions.TaskCancelledError``.

    Returns:
        How many tasks were cancelled.
    """
    import ray

    _CANCELLING.set()
    refs = list(_IN_FLIGHT.values())
    for ref in refs:
        ray.cancel(ref, force=False)
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    return len(refs)


def allow_stage_tasks() -> None:
    """Let this process's pipelines start stage tasks again after ``cancel_stage_tasks``."""
    _CANCELLING.clear()


DRIVER_TAG = "conduit.driver"  # JSON: host, pid and process start time of the driver that owns the run
driver_identity = locks.process_identity  # what the tag holds
driver_is_dead = locks.is_gone  # None: the driver ran on another host


def fail_runs_of_dead_drivers(uri: str, exp_id: str, cfg: RunConfig) -> list[str]:
    """Mark FAILED the runs that an earlier attempt of this config (same name and workdir) left
    RUNNING when its driver died (SIGKILL, a lost node): the parent run and its RUNNING stage runs.

    Returns:
        One line per parent run handled, for the console.
    """
    lines = []
    # The name and workdir are compared here, not in the filter: MLflow's filter strings have no escape
    # for a quote, and either may hold one (a run name "Bob's", a folder "it's").
    mine = {"conduit.config_name": cfg.run.name, "conduit.workdir": str(cfg.workdir())}
    for run_id, tags in tracking.search_runs(uri, exp_id, "attributes.status = 'RUNNING' and "
                                                          "tags.`conduit.config_name` != ''"):
        if any(tags.get(k) != v for k, v in mine.items()):
            continue
        identity = json.loads(tags.get(DRIVER_TAG, "{}"))
        dead = driver_is_dead(identity) if identity else None
        if dead is None:
            lines.append(f"note: MLflow run {run_id} of this config is RUNNING under a driver on "
                         f"{identity.get('host', 'an unknown host')}; left as it is")
            continue
        if not dead:
            continue  # a live driver: another run of this config, going on now
        children = tracking.search_runs(uri, exp_id, f"attributes.status = 'RUNNING' and "
                                                     f"tags.`mlflow.parentRunId` = '{run_id}'")
        for child, _ in children:
            StageTracker(uri, child).set_tags({"conduit.error": "the driver died during this stage"})
            tracking.end_run(uri, child, "FAILED")
        StageTracker(uri, run_id).set_tags({"conduit.error": "the driver died (no longer running)"})
        tracking.end_run(uri, run_id, "FAILED")
        lines.append(f"marked MLflow run {run_id} (and {len(children)} stage runs) FAILED: its driver, pid "
                     f"{identity['pid']} on {identity['host']}, is gone")
    return lines


def end_status(exc: BaseException) -> str:
    """MLflow's end state for a run that ``exc`` ended: KILLED for Ctrl-C / SIGTERM or a cancelled stage
    task (``cancel_stage_tasks``), else FAILED."""
    from ray.exceptions import TaskCancelledError

    return "KILLED" if isinstance(exc, (KeyboardInterrupt, TaskCancelledError)) else "FAILED"


def record_failure(tracker: StageTracker, cause: BaseException, remote_traceback: str) -> None:
    """Put a failed stage's error on its MLflow run: the message as a tag, the traceback (the frames of
    the stage's Ray task, as Ray reports them, without colour codes) as ``error.txt``."""
    tracker.set_tags({"conduit.error": f"{type(cause).__name__}: {cause}"[:5000]})
    tracker.log_text(re.sub(r"\x1b\[[0-9;]*m", "", remote_traceback), "error.txt")


# Failures a user can act on from a one-paragraph message (jobs.run prints no traceback for them).

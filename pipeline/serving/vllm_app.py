"""The champion on vLLM through Ray Serve LLM: the application, built where vLLM is installed.

``pipeline.serving.deploy`` decides the engine (``deploy.engine``) and, for vLLM, hands a plain
``VllmTarget`` to ``launch``: a Ray task that runs in the vLLM interpreter (``deploy.vllm_python``,
the ``.venv-vllm`` that ``make install`` builds here) and calls ``serve.run`` there, so the process that
deploys never imports vLLM (its training environment cannot: vLLM pins another transformers).

The application is Ray Serve LLM's own (``ray.serve.llm``): an ``LLMServer`` deployment running vLLM's
engine on each replica, behind an OpenAI ingress. Conduit adds three things, in
``pipeline.serving.vllm_ingress``: the registered version's files fetched from MLflow on each replica's
node before vLLM loads them (``VersionFiles``), an ingress that says which version answered (the
``x-conduit-version`` header, ``/healthz``) and refuses what Conduit's engine refuses, and text
prompts that start a new document as in training (an EOS before them), as Conduit's engine does.

This module imports only Ray at import time; ``build_app`` imports vLLM's side.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import ray


@dataclass(frozen=True)
class VllmTarget:
    """Everything the vLLM application needs: which version, where its files go, and how to serve it."""

    tracking_uri: str
    model_name: str
    version: int
    app: str  # the Serve application's name
    route_prefix: str
    num_replicas: int
    num_cpus: float
    num_gpus: float
    max_num_seqs: int  # vLLM's batch: the most sequences a step runs
    max_model_len: int
    dtype: str  # float32 on CPU (Conduit's own numerics), bfloat16 on GPU
    kv_cache_bytes: int
    cache_dir: str  # where each node keeps the version's files (a folder per model and version)
    max_ongoing_requests: int
    python: str | None = None  # the vLLM interpreter on the cluster's nodes (None: their own Python)
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the replicas (an MLflow login)

    def files_dir(self) -> str:
        return os.path.join(self.cache_dir, f"{self.model_name}-v{self.version}")


def _replica_env(t: VllmTarget) -> dict[str, str]:
    threads = str(max(1, int(t.num_cpus)))
    env = {"OMP_NUM_THREADS": threads, "MLFLOW_TRACKING_URI": t.tracking_uri, "VLLM_NO_USAGE_STATS": "1",
           "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if t.num_gpus == 0:
        # The replica's own cores, unpinned: vLLM's default binds its threads to the NUMA node's cores,
        # which on a small machine are the ones Ray's other processes run on.
        env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": str(max(1, t.kv_cache_bytes >> 30))})
    return {**env, **dict(t.env)}


def _runtime_env(t: VllmTarget) -> dict:
    """The runtime environment of every process of the application: the vLLM interpreter and its settings."""
    return {"env_vars": _replica_env(t), **({"py_executable": t.python} if t.python else {})}


def llm_config(t: VllmTarget):
    """Ray Serve LLM's ``LLMConfig`` for ``t``."""
    from ray.serve.llm import LLMConfig

    from pipeline.serving.vllm_ingress import ConduitLLMServer, VersionFiles

    cpu = t.num_gpus == 0
    engine_kwargs = {"dtype": t.dtype, "max_model_len": t.max_model_len, "max_num_seqs": t.max_num_seqs,
                     "kv_cache_memory_bytes": t.kv_cache_bytes, "tokenizer_mode": "auto",
                     "max_logprobs": 5, "seed": 0}
    if cpu:
        engine_kwargs["enforce_eager"] = True  # no graphs to capture on a CPU
    return LLMConfig(
        model_loading_config={"model_id": t.model_name, "model_source": t.files_dir()},
        engine_kwargs=engine_kwargs,
        accelerator_config={"kind": "cpu"} if cpu else None,
        placement_group_config=({"bundles": [{"CPU": t.num_cpus}]} if cpu else None),
        # max_surge_percent: a new version's replicas start and become ready before the old ones drain,
        # so that a promotion loses no request (Serve's default stops the old replicas first).
        # The replica actor takes no CPU of its own: Ray Serve LLM adds the actor's CPUs to the engine's
        # first bundle, and deploy.num_cpus_per_replica is the replica's whole share (2 on a 2-CPU node
        # would otherwise ask for 3 and never be placed).
        deployment_config={"num_replicas": t.num_replicas, "max_ongoing_requests": t.max_ongoing_requests,
                           "max_surge_percent": 100, "ray_actor_options": {"num_cpus": 0}},
        runtime_env=_runtime_env(t),
        server_cls=ConduitLLMServer,
        callback_config={"callback_class": VersionFiles,
                         "callback_kwargs": {"tracking_uri": t.tracking_uri, "model_name": t.model_name,
                                             "version": t.version, "dst": t.files_dir()}},
        log_engine_metrics=False,
    )


def build_app(t: VllmTarget):
    """The Serve application: Ray Serve LLM's LLMServer deployment behind Conduit's OpenAI ingress."""
    from ray import serve
    from ray.serve.llm import build_llm_deployment

    from pipeline.compat import serve_llm_model_metadata

    from pipeline.serving.vllm_ingress import ingress_class

    config = llm_config(t)
    server = build_llm_deployment(config, name_prefix=f"{t.app}-")
    ingress = serve.deployment(ingress_class(), name="ConduitIngress", max_surge_percent=100,
                               max_ongoing_requests=t.max_ongoing_requests * max(1, t.num_replicas),
                               ray_actor_options={"num_cpus": 0, "runtime_env": _runtime_env(t)})
    return ingress.bind(llm_deployments={t.model_name: server},
                        model_cards={t.model_name: serve_llm_model_metadata()(t.model_name, config)},
                        conduit=asdict(t))


def run_here(t: VllmTarget) -> str:
    """Deploy ``t`` on the cluster this process is attached to, and wait until it serves.

    Returns:
        Serve's status of the application.
    """
    from ray import serve

    serve.run(build_app(t), name=t.app, route_prefix=t.route_prefix)
    return serve.status().applications[t.app].status.value


def _one_line(e: Exception) -> str:
    """Ray's error in one line: a task's own exception (not its remote traceback), else the first line."""
    cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else None
    lines = str(e if cause is None else cause).strip().splitlines() or [""]
    return f"{type(e).__name__}: " + ("" if cause is None else f"{type(cause).__name__}: ") + lines[0]


class LaunchError(RuntimeError):
    """vLLM's application did not start; ``task`` is the Ray task that was starting it (ended: cancelled
    unless it had failed)."""

    def __init__(self, message: str, task: ray.ObjectRef):
        super().__init__(message)
        self.task = task


def launch(t: VllmTarget, timeout_s: float) -> str:
    """Deploy ``t`` from a Ray task running in the vLLM interpreter ``t.python`` (None: the cluster's own).

    Whatever ends the wait (the task's error, its runtime environment that cannot be set up, its worker
    that cannot start or dies, ``timeout_s`` passing, Ctrl-C) cancels the task, so that it does not go on
    to deploy after this call has given up.

    Raises:
        LaunchError: the application did not start: what failed, the interpreter, and Ray's error.
    """
    task = ray.remote(num_cpus=0, max_retries=0)(run_here).options(runtime_env=_runtime_env(t))
    ref = task.remote(t)
    where = f"(the Ray task that runs serve.run in {t.python or 'the Python of the nodes'})"
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        ray.cancel(ref)
        raise LaunchError(f"vLLM deployment of {t.model_name} v{t.version} did not start within {timeout_s:.0f} s "
                          f"{where}: {type(e).__name__}; the task was cancelled", ref) from e
    except ray.exceptions.RayError as e:  # the task's own error, its runtime env, its worker, its node
        ray.cancel(ref)
        raise LaunchError(f"vLLM deployment of {t.model_name} v{t.version} failed {where}: {_one_line(e)}", ref) from e
    except KeyboardInterrupt:
        ray.cancel(ref)
        raise

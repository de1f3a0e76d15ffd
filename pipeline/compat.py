"""Every use of a library's private API in Conduit, each behind a check of the installed version; and the
hook that quiets a private logger of Ray Train in every Ray worker (``quiet_ray_worker``).

A private name (``ray._private``, ``ray.train.v2._internal``, ``ray.llm._internal``, Tune's ``__mixins__``
hook, MLflow's ``request_utils`` internals) may move or change meaning in any release, and an upgrade
would break what uses it silently or in a confusing place. So no other module reaches one: each is
reached here, through a function that first checks that the installed library is a version these
were read and tested against (``TESTED``), and otherwise raises ``UntestedVersion`` naming the library,
both versions and what needed it. Each is here because no public API does the job (said at each).

Upgrading Ray or MLflow: read each use below against the new release, then add its version to ``TESTED``.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

# The releases each private use below was read against and is tested with (pyproject.toml's pins).
TESTED: dict[str, tuple[str, ...]] = {"ray": ("2.60.0",), "mlflow": ("3.17.2",), "mlflow-skinny": ("3.17.2",)}


class UntestedVersion(RuntimeError):
    """The installed library is not a version whose private API Conduit's use of it was checked against."""


def require(distribution: str, what: str) -> None:
    """Raise ``UntestedVersion`` unless ``distribution`` is installed at a version in ``TESTED``.

    Args:
        distribution: the package's name on PyPI (``ray``, ``mlflow``; ``mlflow`` is also satisfied by
            ``mlflow-skinny``, which vLLM's environment installs instead).
        what: what Conduit uses of it, for the message.
    """
    if distribution == "mlflow" and _version("mlflow") is None:
        distribution = "mlflow-skinny"
    installed = _version(distribution)
    if installed not in TESTED[distribution]:
        raise UntestedVersion(
            f"{what} uses a private API of {distribution}, checked against {distribution} "
            f"{' / '.join(TESTED[distribution])}; {distribution} {installed} is installed. Install "
            f"{distribution}=={TESTED[distribution][-1]} (pyproject.toml), or check this use against {installed} "
            "in pipeline/compat.py and add the version to its TESTED")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- Ray Train ------------------------------------------------------------------------------------------
def ray_train_helper_callbacks() -> tuple[type, type]:
    """The classes of the two callbacks Ray Train adds to every run that start its ``PlacementGroupCleaner``
    and ``DatasetManager`` actors (``pipeline.training.ray_train.trainer_class`` leaves them out). Public API:
    none; a trainer's default callbacks are built by ``DataParallelTrainer._create_default_callbacks``."""
    require("ray", "leaving Ray Train's placement-group cleaner and dataset manager out of a run")
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    return PlacementGroupCleanerCallback, DatasetsCallback


PLACEMENT_GROUP_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
# Ray Train's PlacementGroupCleaner asks the State API (served by the dashboard) once a second whether
# the training controller lives; with the dashboard off, as the embedded Ray runs by default, each ask
# fails and logs this warning: a line per second of training in the run's log, and nothing to act on.
# Its other messages (a dead controller, a placement group it removed) still come through.
STATE_API_NOISE = "Failed to query Ray Train Controller actor state"


class DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` (``runner.ray_runtime_env``): runs once in each Ray worker process
    before its first task or actor, so this module imports nothing heavy. A logger's name needs no version
    check: a renamed logger is only a noisier log."""
    logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER).addFilter(DropMessages(STATE_API_NOISE))


# ---- Ray core -------------------------------------------------------------------------------------------
def placement_groups_of_dead_actors(job_id: str) -> list[tuple[Any, str]]:
    """This job's live (pending, created, rescheduling), non-detached placement groups whose creating actor is
    dead, each as ``(PlacementGroup, the actor's class name)``. Public API: ``ray.util.placement_group_table``
    lists groups without their creator; GCS's table, read through ``ray._private.state``, has it."""
    require("ray", "finding the placement groups of dead actors")
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup

    live = (gcs_pb2.PlacementGroupTableData.PENDING, gcs_pb2.PlacementGroupTableData.CREATED,
            gcs_pb2.PlacementGroupTableData.RESCHEDULING)
    found = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if (pg.state not in live or pg.is_detached or pg.creator_job_id.hex() != job_id or not pg.creator_actor_dead
                or not pg.creator_actor_id or ray.ActorID(pg.creator_actor_id).is_nil()):
            continue
        creator = state.actor_table(pg.creator_actor_id.hex()) or {}
        if creator.get("State") != "DEAD":
            continue
        found.append((PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)), creator.get("ActorClassName", "")))
    return found


def free_resources_by_node() -> dict[str, dict[str, float]]:
    """Each node's free resources. Public API: ``ray.available_resources()`` sums them over the cluster;
    ``ray._private.state.available_resources_per_node`` keeps them apart."""
    require("ray", "reading each node's free CPUs")
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def ray_node_of_this_process() -> Any:
    """The ``ray._private.node.Node`` that a Ray started in this process runs (its session folder, its GCS
    address), or None. Public API: none for a driver's own node."""
    require("ray", "reading the address of the Ray this process started")
    import ray

    return getattr(ray._private.worker, "_global_node", None)


# ---- Ray Serve LLM (in vLLM's environment) -----------------------------------------------------------
def serve_llm_request_models() -> tuple[type, type, type]:
    """``(CallbackBase, ChatCompletionRequest, CompletionRequest)`` of Ray Serve LLM, which Conduit's OpenAI
    ingress (``pipeline.serving.vllm_ingress``) extends and validates with. Public API: ``ray.serve.llm``
    exposes the deployments, not these."""
    require("ray", "Conduit's ingress in front of Ray Serve LLM")
    from ray.llm._internal.common.callbacks.base import CallbackBase
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

    return CallbackBase, ChatCompletionRequest, CompletionRequest


def serve_llm_ingress_app() -> tuple[dict, Any]:
    """``(DEFAULT_ENDPOINTS, init)``: Ray Serve LLM's routes and the function that makes its FastAPI app,
    which Conduit's ingress extends with ``/healthz`` and its error handlers. Public API:
    ``ray.serve.llm.ingress.make_fastapi_ingress`` takes them but does not expose them."""
    require("ray", "Conduit's ingress in front of Ray Serve LLM")
    from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, init

    return DEFAULT_ENDPOINTS, init


def serve_llm_model_metadata() -> Any:
    """Ray Serve LLM's ``to_model_metadata(model_id, llm_config)``: the model card the ingress answers
    ``/v1/models`` with. Public API: none."""
    require("ray", "the model card of a Ray Serve LLM deployment")
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata

    return to_model_metadata


# ---- Ray Tune -------------------------------------------------------------------------------------------
def mix_into_function_trainable(trainable: Any, *mixins: type) -> Any:
    """Give a function trainable's Tune class these base classes (Tune's ``__mixins__`` hook, read by
    ``tune.trainable.function_trainable.wrap_function``; there is no public one). Returns ``trainable``."""
    require("ray", "mixing a class into a Tune function trainable")
    trainable.__mixins__ = mixins
    return trainable


# ---- MLflow ---------------------------------------------------------------------------------------------
# pipeline.tracking wraps ``mlflow.utils.request_utils._cached_get_request_session`` (no public API sets the
# retry policy of MLflow's HTTP sessions per method, and MLflow's retries every method, POSTs included, after
# a lost answer). It imports MLflow itself (MLflow is imported in the tracking and serving modules only) and
# calls ``require("mlflow", ...)`` first.

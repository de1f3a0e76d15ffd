"""pipeline.serving.vllm_app without vLLM: a start that cannot begin ends in the module's error, naming
what failed, and its Ray task is cancelled (it would otherwise go on to deploy later). The vLLM
deployment itself: tests/jobs/test_deploy_vllm.py."""

from __future__ import annotations

import pytest

from pipeline.serving import vllm_app


def _target(python: str) -> vllm_app.VllmTarget:
    return vllm_app.VllmTarget(
        tracking_uri="sqlite:///unused.db", model_name="m", version=1, app="conduit-m", route_prefix="/",
        num_replicas=1, num_cpus=1, num_gpus=0, max_num_seqs=1, max_model_len=64, dtype="float32",
        kv_cache_bytes=2**30, cache_dir="/nonexistent/conduit-vllm/m/1", max_ongoing_requests=1, python=python)


def test_a_start_whose_interpreter_cannot_run_times_out_named_and_its_task_is_cancelled(ray_cluster):
    """The interpreter does not exist on the node (a missing .venv-vllm): Ray starts no worker for the task
    and keeps it pending; ray.get's timeout is the error."""
    import ray

    python = "/nonexistent/venv-vllm/bin/python"
    with pytest.raises(RuntimeError) as e:  # vllm_app.LaunchError, the module's error (Ray's: its cause)
        vllm_app.launch(_target(python), timeout_s=5)
    assert str(e.value) == (f"vLLM deployment of m v1 did not start within 5 s (the Ray task that runs serve.run "
                            f"in {python}): GetTimeoutError; the task was cancelled")
    assert isinstance(e.value.__cause__, ray.exceptions.GetTimeoutError)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(e.value.task, timeout=30)


def test_a_start_that_raises_names_the_interpreter_and_the_tasks_error(ray_cluster):
    """An interpreter without vLLM (this one): the task raises importing Ray Serve LLM; the error says so
    in one line."""
    import sys

    import ray

    with pytest.raises(vllm_app.LaunchError) as e:
        vllm_app.launch(_target(sys.executable), timeout_s=120)
    # one line: the task's own exception (Ray 2.60's words), not its remote traceback
    assert str(e.value).startswith(f"vLLM deployment of m v1 failed (the Ray task that runs serve.run in "
                                   f"{sys.executable}): RayTaskError(ImportError): ImportError: Neither vLLM nor "
                                   "SGLang is installed.")
    assert "\n" not in str(e.value) and isinstance(e.value.__cause__, ray.exceptions.RayTaskError)

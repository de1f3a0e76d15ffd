"""Importing Conduit's modules prints nothing: every stage task, Ray Train worker and server process
imports them, so a warning at import time is repeated once per process in a run's output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_stages_and_the_served_model_prints_no_warning():
    # pipeline.stages imports every stage and through register the served model (an MLflow
    # PythonModel, which MLflow checks for type hints when the class is defined).
    out = subprocess.run([sys.executable, "-c", "import pipeline.stages, pipeline.serving.pyfunc, jobs.run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", out.stderr


def test_the_ray_worker_hook_drops_only_the_state_api_noise():
    import logging

    from pipeline import compat

    logger = logging.getLogger(compat.PLACEMENT_GROUP_CLEANER_LOGGER)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    before = list(logger.filters)
    try:
        compat.quiet_ray_worker()
        logger.warning("Failed to query Ray Train Controller actor state. State API may be temporarily "
                       "unavailable. Continuing to monitor.")
        logger.warning("Detected that the Ray Train controller actor (abc) is dead. Cleaning up placement group")
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = before
    assert seen == ["Detected that the Ray Train controller actor (abc) is dead. Cleaning up placement group"]
    # Ray imports the hook by this name in each worker.
    from pipeline.runner import ray_runtime_env

    assert ray_runtime_env()["worker_process_setup_hook"] == "pipeline.compat.quiet_ray_worker"

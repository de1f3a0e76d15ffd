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
    out = subprocess.run([sys.executable, "-c", "import pipeline.stages, pipeline.serving, jobs.run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", out.stderr

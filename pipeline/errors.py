"""The errors a run ends on with a sentence rather than a traceback, and the exit status of each.

Apart from the runner so that the command lines (``jobs.run``, ``jobs.sweep``) read them without importing
the runner's libraries (MLflow, Ray): a dry run or a bad flag answers at once.
"""

from __future__ import annotations

import sys

from pipeline.base import ConfigError, StageFailed, TrackingUnavailable
from pipeline.cluster import ClusterError
from pipeline.preflight import DiskError
from pipeline.store.backends import StorageError
from pipeline.store.locks import StageLocked

EXPECTED_ERRORS = (ConfigError, ClusterError, StageFailed, TrackingUnavailable, StageLocked, DiskError, StorageError)


def main_exit_code(exc: BaseException) -> int:
    """Exit status for a failed run, printed for people rather than as a traceback: 2 for what the user can
    fix (the config, the cluster, the tracking server, a held stage lock, the disk, the store), else 1."""
    print(f"error: {exc}", file=sys.stderr)
    expected = (ConfigError, ClusterError, TrackingUnavailable, StageLocked, DiskError, StorageError)
    return 2 if isinstance(exc, expected) else 1

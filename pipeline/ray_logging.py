"""Quiet Ray's own noise in every Ray worker process (``worker_process_setup_hook``).

Kept free of heavy imports: Ray runs it at the start of each worker process, of every task and actor.
"""

from __future__ import annotations

import logging

# Ray Train's PlacementGroupCleaner asks the State API (served by the dashboard) once a second whether
# the training controller lives; with the dashboard off, as the embedded Ray runs by default, each ask
# fails and logs this warning: a line per second of training in the run's log, and nothing to act on.
# Its other messages (a dead controller, a placement group it removed) still come through.
STATE_API_NOISE = "Failed to query Ray Train Controller actor state"
PLACEMENT_GROUP_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


class DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def setup() -> None:
    """The hook: runs once in each Ray worker process before its first task or actor."""
    logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER).addFilter(DropMessages(STATE_API_NOISE))

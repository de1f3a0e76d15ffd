"""Which checkpoint a (re)started training resumes from.

The newest recorded checkpoint (``record``), unless it does not verify (a file truncated by a node that
died while uploading, a disk error, a file planted there): reloading it on every restart would fail the
run for good, so ``usable_checkpoint`` skips it for the newest earlier recorded checkpoint that verifies
(``checkpoint.keep`` of them are kept), with a warning, and the fault costs the steps since that one.
Every rank runs the same check over the same storage, so all ranks pick the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class NoUsableCheckpoint(RuntimeError):
    """No kept checkpoint of the run verifies."""


def usable_checkpoint(candidates: Sequence[Any], verify: Callable[[str], None],
                      warn: Callable[[str], None] = print) -> Any:
    """The first of ``candidates`` (newest first) that verifies.

    Args:
        candidates: ``ray.train.Checkpoint`` values (a folder and its filesystem), newest first.
        verify: raises (any Exception) for a checkpoint folder that must not be loaded.
        warn: where the warning about a skipped checkpoint goes.

    Raises:
        NoUsableCheckpoint: none verifies; the message names each one and why.
    """
    refused: list[str] = []
    for ckpt in candidates:
        try:
            with ckpt.as_directory() as folder:
                verify(folder)
        except Exception as e:  # noqa: BLE001 - any reason not to load it: try the one before
            refused.append(f"{ckpt.path}: {e}")
            continue
        if refused:
            warn(f"warning: skipping checkpoints that do not verify ({'; '.join(refused)}); resuming from "
                 f"{ckpt.path}, the newest one that does")
        return ckpt
    raise NoUsableCheckpoint("no kept checkpoint of this training verifies: " + "; ".join(refused)
                             + ". Rerun with --force train to start over")

"""Which checkpoint a restarted worker group resumes from.

Ray Train hands a restarted group its latest reported checkpoint. When that one does not verify (a
file truncated by a node that died while uploading, a disk error, a file planted there), reloading it
on every restart would fail the run for good. ``usable_checkpoint`` skips it for the newest earlier
checkpoint of the same Ray Train run that verifies (``checkpoint.keep`` of them are kept), with
a warning, so the fault costs the steps since that one. Every rank runs the same check over the same
storage, so all ranks pick the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.store.contracts import CHECKPOINT_PREFIX  # Ray Train's folder names, in time order


class NoUsableCheckpoint(RuntimeError):
    """No kept checkpoint of the run verifies."""


def usable_checkpoint(latest: Any, verify: Callable[[str], None], warn: Callable[[str], None] = print) -> Any:
    """``latest`` if it verifies, else the newest earlier checkpoint beside it that does.

    Args:
        latest: the ``ray.train.Checkpoint`` Ray Train restored.
        verify: raises (any Exception) for a checkpoint folder that must not be loaded.
        warn: where the warning about a skipped checkpoint goes.

    Returns:
        A ``ray.train.Checkpoint``: ``latest``, or the one that replaces it.

    Raises:
        NoUsableCheckpoint: none verifies; the message names each one and why.
    """
    import pyarrow.fs as pafs
    import ray.train

    refused: list[str] = []
    candidates = [latest]
    parent, _, latest_name = latest.path.rstrip("/").rpartition("/")
    siblings = latest.filesystem.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
    earlier = sorted((i.path for i in siblings if i.type == pafs.FileType.Directory
                      and i.base_name.startswith(CHECKPOINT_PREFIX) and i.base_name < latest_name), reverse=True)
    candidates += [ray.train.Checkpoint(path, filesystem=latest.filesystem) for path in earlier]
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

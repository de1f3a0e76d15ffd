"""What Conduit keeps about the machine it runs on, across runs: small JSON files under
``$XDG_CACHE_HOME/conduit`` (else ``~/.cache/conduit``), keyed by the machine (its CPU model and cores,
or its GPU).

The CPU's matmul speed (``pipeline.plan.hardware``), and the precision and compile choices with the step
times behind them (``pipeline.training.precision_choice``, ``compile_choice``). Each file is read whole and
rewritten whole; an update holds an exclusive lock on a file beside it while it reads, changes and writes,
so that two runs starting at once on one machine (two workers, a sweep's trials) both keep what they
measured. No torch here: a dry run reads the CPU's speed without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.base import beside_lock


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/conduit``, else ``~/.cache/conduit`` (created by the first update)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "conduit"


def read(path: Path) -> dict:
    """The JSON object in ``path``; an empty one when there is none or it cannot be read."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update(path: Path, keys: tuple[str, ...], value: Any) -> None:
    """Sets ``keys[0] -> keys[1] -> ... -> value`` in the JSON object in ``path``, keeping its other entries
    (an unreadable file starts over), under the file's lock, written atomically (a rename).

    Raises:
        OSError: the folder cannot be made or written (a read-only home).
    """
    from pipeline.store.artifacts import write_json_atomic

    with beside_lock(path):
        data = read(path)
        node = data
        for key in keys[:-1]:
            child = node.get(key)
            node[key] = child = child if isinstance(child, dict) else {}
            node = child
        node[keys[-1]] = value
        write_json_atomic(path, data)

"""Only checkpoints Conduit wrote are loaded: every file's sha256, recorded when written, checked before.

What a checkpoint holds and how each part is read back:
- ``rng_rank*.pt`` and ``canonical.pt`` are tensors, numbers, strings, lists and dicts, read with
  ``torch.load(..., weights_only=True)``: a file carrying any other pickled object is refused by torch
  before anything in it runs.
- ``layout.json`` and ``run_log.json`` are JSON.
- DeepSpeed's own files (``<tag>/mp_rank_*_model_states.pt``, ``*_optim_states.pt``, ``latest``) are
  read by ``engine.load_checkpoint``, which unpickles them (``torch.load(weights_only=False)``: they hold
  DeepSpeed's optimizer state objects). That is why the whole folder is checked first.

Each rank writes its part of a checkpoint into a folder of its own, then ``write_checksums`` records
the size and sha256 of every file there in ``checksums_rank<r>.json``; Ray Train merges the ranks'
folders into one checkpoint. ``verify_checkpoint`` runs before anything of a checkpoint is read (a
restart, or ``checkpoint.resume_from``): a file that no rank recorded (planted), or whose bytes changed, or
a recorded file that is missing, refuses the whole checkpoint, naming the file. This keeps files that
Conduit did not write from being unpickled; it does not stand against someone who can also rewrite the
checksum files, so the checkpoint storage must be writable only by the runs themselves.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHECKSUMS_GLOB = "checksums_rank*.json"
RAY_METADATA = ".metadata.json"  # Ray Train's own checkpoint metadata (JSON); Conduit never reads it


class CheckpointRefused(ValueError):
    """A checkpoint that Conduit did not write, or that changed since: nothing of it is loaded."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.rglob("*")
                  if p.is_file() and not p.match(CHECKSUMS_GLOB) and p.relative_to(ckpt_dir).as_posix() != RAY_METADATA)


def write_checksums(ckpt_dir: str | Path, rank: int) -> Path:
    """Record every file under ``ckpt_dir`` (this rank's part of a checkpoint); returns the record's path."""
    ckpt_dir = Path(ckpt_dir)
    records = {p.relative_to(ckpt_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
               for p in _files(ckpt_dir)}
    out = ckpt_dir / f"checksums_rank{rank:05d}.json"
    out.write_text(json.dumps(records, indent=1, sort_keys=True))
    return out


def verify_checkpoint(ckpt_dir: str | Path) -> None:
    """Check every file of a checkpoint against the checksums its ranks recorded.

    Raises:
        CheckpointRefused: no checksums (not written by this Conduit), a file no rank recorded, a file
            whose size or sha256 differs, or a recorded file that is missing; the message names it.
    """
    ckpt_dir = Path(ckpt_dir)
    records: dict[str, dict] = {}
    for path in sorted(ckpt_dir.glob(CHECKSUMS_GLOB)):
        records.update(json.loads(path.read_text()))
    if not records:
        raise CheckpointRefused(f"{ckpt_dir} has no {CHECKSUMS_GLOB} files: it was not written by this version "
                                "of Conduit, and its DeepSpeed files would be unpickled unchecked; not loading it")
    for path in _files(ckpt_dir):
        name = path.relative_to(ckpt_dir).as_posix()
        if name not in records:
            raise CheckpointRefused(f"{ckpt_dir}: {name} is not a file Conduit wrote into this checkpoint; "
                                    "not loading it")
        want = records.pop(name)
        if path.stat().st_size != want["bytes"] or _sha256(path) != want["sha256"]:
            raise CheckpointRefused(f"{ckpt_dir}: {name} changed since Conduit wrote it ({path.stat().st_size} "
                                    f"bytes, {want['bytes']} written, or another sha256); not loading it")
    if records:
        raise CheckpointRefused(f"{ckpt_dir}: {sorted(records)[:5]} recorded but missing; not loading it")

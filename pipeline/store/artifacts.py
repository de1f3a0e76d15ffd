"""Content-addressed stage artifacts.

An artifact lives at ``<artifact_root>/<stage>/<hash>/``. The hash covers the stage name, the stage's
code version, the config fields that change its output and the hashes of its inputs, so equal hashes
mean equal content and a finished artifact can be reused by any later run. ``manifest.json`` is
written last, atomically (temp file + rename): no manifest means the stage did not finish, and the
folder is cleared and the stage redone.

Before the manifest is written every file of the folder is flushed to disk (fsync), and the manifest
lists each one with its size and sha256 (``files``). ``verify`` checks a sealed folder against that
list, so a truncated or altered file in a cached artifact is found and the stage rebuilt rather than
trusted forever.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.base import REPO_ROOT, is_uri

MANIFEST = "manifest.json"


def content_hash(stage: str, version: int, config: Any, input_hashes: dict[str, str]) -> str:
    """The artifact hash: sha256 over a canonical JSON of everything that determines the output.

    Args:
        stage: stage name.
        version: the stage's code version; bumped when its output format or logic changes.
        config: the JSON-able config view that changes the output (no logging-only fields).
        input_hashes: upstream stage name -> that artifact's hash.

    Returns:
        A 16-hex-digit hash (64 bits: collisions are not a concern at pipeline scale).
    """
    payload = json.dumps(
        {"stage": stage, "version": version, "config": config, "inputs": input_hashes},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class Artifact:
    """A finished stage output: its folder and its manifest.

    ``uri`` is where an artifact in an object store lives (``pipeline.store.backends``); its ``path`` is then
    the node-local copy (which a process on another node fetches into its own cache). None: ``path``
    is the artifact itself.
    """

    stage: str
    hash: str
    path: Path
    manifest: dict
    uri: str | None = None

    @classmethod
    def load(cls, path: str | Path) -> "Artifact":
        path = Path(path)
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        return cls(stage=manifest["stage"], hash=manifest["hash"], path=path, manifest=manifest)


def artifact_dir(root: str | Path, stage: str, hash_: str) -> Path:
    if is_uri(root):
        # URI roots (s3://, gs://) are folders of an object store, not paths: pipeline.store.backends handles them.
        raise ValueError(f"run.artifact_root={root!r} is a URI: use pipeline.store.backends.store_for(root)")
    return Path(root) / stage / hash_


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def remove_unsealed(path: Path, root: str | Path | None = None) -> None:
    """Delete the artifact folder ``path`` without ever deleting outside ``root`` (default: the
    artifact root two levels up, ``<root>/<stage>/<hash>``).

    A symlink on the way (the folder itself, or its stage folder) could point anywhere; the folder's
    real location must lie under the root's real location. Inside the folder, ``shutil.rmtree``
    removes symlinks as links and never descends into what they point at.

    Raises:
        ValueError: ``path`` is a symlink or resolves outside the artifact root; nothing is removed.
    """
    path = Path(path)
    root = Path(root) if root is not None else path.parents[1]
    real, real_root = path.resolve(), root.resolve()
    if path.is_symlink() or not real.is_relative_to(real_root) or real == real_root:
        raise ValueError(f"refusing to clear {path}: it is a symlink or leads out of the artifact root {root} "
                         f"(to {real}); remove it by hand if it is yours")
    if path.exists():
        shutil.rmtree(path)


def prepare_dir(path: Path) -> None:
    """Make an empty folder for a stage to fill; clears what an unfinished attempt left behind."""
    if path.exists() or path.is_symlink():
        if is_complete(path):
            raise FileExistsError(f"{path} already holds a finished artifact")
        remove_unsealed(path)
    path.mkdir(parents=True)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so that readers see either nothing or the whole file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(
    path: Path,
    *,
    stage: str,
    hash_: str,
    stage_config: Any,
    run_config: dict,
    inputs: dict[str, str],
    counts: dict[str, Any],
    started_at: float,
    extra: dict[str, Any] | None = None,
) -> Artifact:
    """Seal an artifact: flush its files to disk, record their sizes and sha256, then write its
    manifest last, atomically, and return it."""
    files = file_records(path)
    manifest = {
        "stage": stage,
        "hash": hash_,
        "inputs": inputs,
        "stage_config": stage_config,
        "run_config": run_config,
        "code_version": code_version(),
        "counts": counts,
        "started_at": started_at,
        "finished_at": time.time(),
        "seconds": round(time.time() - started_at, 3),
        "files": files,
        **(extra or {}),
    }
    write_json_atomic(path / MANIFEST, manifest)
    return Artifact(stage=stage, hash=hash_, path=path, manifest=manifest)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(path: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``path`` but the manifest, fsynced, as ``relative path -> {bytes, sha256}``."""
    records = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())  # the data is on disk before the manifest says it is done
        records[f.relative_to(path).as_posix()] = {"bytes": f.stat().st_size, "sha256": _sha256_of(f)}
    return records


def verify(artifact: Artifact) -> str | None:
    """Check a sealed artifact's files against its manifest.

    Returns:
        None when every listed file is there with its size and sha256 (or the manifest predates file
        lists); else what is wrong, naming the first bad file.
    """
    listed = artifact.manifest.get("files")
    if listed is None:
        return None  # sealed before manifests listed their files: nothing to check against
    for rel, want in listed.items():
        f = artifact.path / rel
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{f} has {size} bytes, the manifest says {want['bytes']}"
        if _sha256_of(f) != want["sha256"]:
            return f"{f} does not match its sha256 in the manifest"
    return None


_CODE_VERSION: str | None = None


def code_version() -> str:
    """The git commit of the checkout (with ``+dirty`` when it has changes), or ``unknown``."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        try:
            out = subprocess.run(
                ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty=+dirty", "--abbrev=12"],
                capture_output=True, text=True, timeout=10, check=False,
            )
            _CODE_VERSION = out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
        except (OSError, subprocess.TimeoutExpired):
            _CODE_VERSION = "unknown"  # no git binary or no checkout (e.g. a Ray working_dir copy)
    return _CODE_VERSION

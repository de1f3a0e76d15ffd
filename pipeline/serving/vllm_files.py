"""The node-local copies of registered versions that vLLM loads, and their removal once not served.

vLLM reads a version's Hugging Face export from a folder on the replica's node, which
``pipeline.serving.vllm_ingress.VersionFiles`` fills from the registry before vLLM starts. The folders:

    $TMPDIR/conduit-vllm/<model key>/<version key>/<model>-v<version>/

``<model key>`` stands for one registry and model, ``<version key>`` for one version of it and the run
that made it (so that a new registry reusing a name and number never meets old files). A version's copy
is as large as its weights; ``prune`` keeps, of one registry's model, only the version in service, and
``prune_on_every_node`` runs it on each node of the connected Ray cluster: ``pipeline.serving.deploy``
calls it when a deployment rolls over, fails to start or goes down.

This module imports only Ray (and that only inside ``prune_on_every_node``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile

ROOT_NAME = "conduit-vllm"
PRUNE_TIMEOUT_S = 120.0


def root() -> str:
    """Where every node keeps the copies (this process's temporary folder, the same path on each node)."""
    return os.path.join(tempfile.gettempdir(), ROOT_NAME)


def model_dir(uri: str, name: str) -> str:
    """The folder of one registry's model: every version's copy is a folder in it."""
    return os.path.join(root(), hashlib.sha256(f"{uri}|{name}".encode()).hexdigest()[:12])


def version_key(uri: str, name: str, version: int, run_id: str) -> str:
    """The name of one version's folder in ``model_dir``."""
    return hashlib.sha256(f"{uri}|{name}|{version}|{run_id}".encode()).hexdigest()[:12]


def prune(folder: str, keep: str | None) -> list[str]:
    """Remove every version's copy in ``folder`` (a ``model_dir``) except ``keep`` (a ``version_key``;
    None: keep none, and remove the folder).

    Returns:
        The paths removed, sorted.
    """
    if not os.path.isdir(folder):
        return []
    removed = sorted(os.path.join(folder, entry) for entry in os.listdir(folder) if entry != keep)
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if keep is None:
        os.rmdir(folder)
        removed.append(folder)
    return removed


def prune_on_every_node(folder: str, keep: str | None) -> dict[str, list[str]]:
    """``prune(folder, keep)`` on every alive node of the connected Ray cluster (a task pinned to each).

    A node that cannot be pruned (it died meanwhile, the task failed) is named in a warning on stderr:
    the deployment it follows has already changed, and its copies are left for the next prune.

    Returns:
        Node id -> the paths removed there (nodes that failed left out).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(prune)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(folder, keep) for node in nodes}
    removed, failed = {}, []
    for node, ref in refs.items():
        try:
            removed[node] = ray.get(ref, timeout=PRUNE_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            ray.cancel(ref)
            failed.append(f"{node}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if failed:
        print(f"warning: could not remove the vLLM copies no longer served from {folder} on "
              f"{len(failed)} node(s): {'; '.join(failed)}", file=sys.stderr, flush=True)
    return removed

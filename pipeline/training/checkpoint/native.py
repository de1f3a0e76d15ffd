"""DeepSpeed's own checkpoint of a rank, plus what an exact resume needs beside it: the step, the
loader's position and every rank's RNG states. It loads bit-exactly onto the same layout (world size,
ZeRO stage, ep_size) only; ``canonical`` covers the others.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

CHECKPOINT_TAG = "conduit"


def rng_state() -> dict:
    """This process's torch, numpy and Python RNG states as tensors and numbers (``weights_only`` loads them)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                       "gauss_next": gauss_next}}


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["internal"].tolist()), p["gauss_next"]))


def save_state(engine, ckpt_dir: str | Path, *, step: int, loader_state: dict) -> None:
    """DeepSpeed's checkpoint plus what exact resume needs: step, loader position, every rank's RNG."""
    engine.save_checkpoint(str(ckpt_dir), tag=CHECKPOINT_TAG, client_state={"step": step, "loader": loader_state})
    torch.save(rng_state(), Path(ckpt_dir) / f"rng_rank{dist.get_rank():05d}.pt")


def load_rng(ckpt_dir: str | Path, rank: int) -> dict:
    """This rank's saved RNG states, read as tensors only (``weights_only``: no pickled object runs).

    Raises:
        pickle.UnpicklingError: the file holds anything but tensors, numbers, strings, lists and dicts.
    """
    return torch.load(Path(ckpt_dir) / f"rng_rank{rank:05d}.pt", weights_only=True)


def load_state(engine, ckpt_dir: str | Path) -> tuple[int, dict]:
    """Restore what ``save_state`` wrote. Returns (step, loader_state).

    DeepSpeed's ``load_checkpoint`` unpickles its own files; the caller runs
    ``pipeline.training.checkpoint.checksums.verify_checkpoint`` on a checkpoint before this.
    """
    rng = load_rng(ckpt_dir, dist.get_rank())  # first: it cannot run anything, DeepSpeed's files could
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=CHECKPOINT_TAG)
    if path is None:
        raise FileNotFoundError(f"{ckpt_dir}: no DeepSpeed checkpoint with tag {CHECKPOINT_TAG!r}")
    set_rng_state(rng)
    return client_state["step"], client_state["loader"]

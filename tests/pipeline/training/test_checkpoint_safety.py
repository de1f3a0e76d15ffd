"""Nothing a run reads back from a checkpoint is unpickled unless Conduit wrote it: the RNG states and
canonical.pt load with ``weights_only=True``, and every file is checked against the checksums recorded
when it was written before DeepSpeed's loader (which unpickles) sees it."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from pipeline.training.checkpoint.canonical import CANONICAL_FILE, load_canonical
from pipeline.training.checkpoint.checksums import CheckpointRefused, verify_checkpoint, write_checksums
from pipeline.training.checkpoint.native import CHECKPOINT_TAG, load_rng, rng_state, set_rng_state


class Payload:
    """Unpickling this creates ``marker``: proof that the file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)], \
        np.random.randn(), random.gauss(0, 1)


def test_rng_states_round_trip_as_tensors(tmp_path):
    np.random.randn()  # numpy now holds a cached Gaussian; Python's gauss_next too
    random.gauss(0, 1)
    torch.save(rng_state(), tmp_path / "rng_rank00003.pt")
    expected = draws()
    set_rng_state(load_rng(tmp_path, 3))  # weights_only=True
    assert draws() == expected


def conduit_checkpoint(path):
    """A checkpoint folder laid out as two ranks write it, with their checksum records."""
    for rank in (0, 1):
        part = path / f"rank{rank}"
        (part / CHECKPOINT_TAG).mkdir(parents=True)
        torch.save({"module": {"w": torch.ones(2)}}, part / CHECKPOINT_TAG / f"zero_pp_rank_{rank}_optim_states.pt")
        torch.save(rng_state(), part / f"rng_rank{rank:05d}.pt")
        if rank == 0:
            torch.save({"params": {"w": {"weight": torch.ones(2)}}, "step": 2}, part / CANONICAL_FILE)
            (part / "layout.json").write_text('{"world_size": 2}')
        write_checksums(part, rank)
    merged = path / "ckpt"  # what Ray Train makes of the ranks' folders
    merged.mkdir()
    for rank in (0, 1):
        for f in (path / f"rank{rank}").rglob("*"):
            if f.is_file():
                (merged / f.relative_to(path / f"rank{rank}")).parent.mkdir(parents=True, exist_ok=True)
                (merged / f.relative_to(path / f"rank{rank}")).write_bytes(f.read_bytes())
    return merged


def test_a_planted_pickle_payload_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload-ran"
    payload = pickle.dumps(Payload(marker), protocol=2)  # torch.load's own protocol: refused for what it holds
    ckpt = conduit_checkpoint(tmp_path)
    verify_checkpoint(ckpt)  # as written: accepted

    planted = ckpt / CHECKPOINT_TAG / "mp_rank_00_model_states.pt"  # what DeepSpeed's loader would unpickle
    planted.write_bytes(payload)
    with pytest.raises(CheckpointRefused, match=f"{CHECKPOINT_TAG}/mp_rank_00_model_states.pt is not a file Conduit wrote"):
        verify_checkpoint(ckpt)
    planted.unlink()

    original = (ckpt / "rng_rank00001.pt").read_bytes()
    (ckpt / "rng_rank00001.pt").write_bytes(payload)  # a file Conduit wrote, replaced
    with pytest.raises(CheckpointRefused, match="rng_rank00001.pt changed since Conduit wrote it"):
        verify_checkpoint(ckpt)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_rng(ckpt, 1)  # and even unchecked, torch refuses to run it
    (ckpt / "rng_rank00001.pt").write_bytes(original)

    (ckpt / CANONICAL_FILE).write_bytes(payload)
    with pytest.raises(CheckpointRefused, match=f"{CANONICAL_FILE} changed since"):
        verify_checkpoint(ckpt)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_canonical(None, ckpt, scheduler=None)  # refused before the engine is touched

    (ckpt / CANONICAL_FILE).unlink()
    with pytest.raises(CheckpointRefused, match=rf"\['{CANONICAL_FILE}'\] recorded but missing"):
        verify_checkpoint(ckpt)
    for record in ckpt.glob("checksums_rank*.json"):
        record.unlink()
    with pytest.raises(CheckpointRefused, match="has no checksums_rank"):
        verify_checkpoint(ckpt)
    assert not marker.exists()
    pickle.loads(payload)  # the payload is real: unpickled, it runs
    assert marker.exists()

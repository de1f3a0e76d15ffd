"""``CheckpointManager``: what the training loop asks of checkpoints (torchtitan's ``CheckpointManager``
is the model).

A checkpoint is one folder per checkpoint step (``record``: where they live and which count), merged from
every rank's part:

    conduit/ and rng_rank<r>.pt   DeepSpeed's own files and each rank's RNG (``native``)
    canonical.pt                  the layout-independent form (``canonical``, rank 0)
    layout.json                   the layout the native part loads onto (rank 0)
    train_precision.json          the precision and compile trained with, and how ``auto`` chose them (rank 0)
    run_log.json                  rank 0's metric history and the steps training started at
    checksums_rank<r>.json        every file's size and sha256, written last (``checksums``)

Restoring: the newest recorded checkpoint that verifies (``choice``), else ``checkpoint.resume_from``; the
native part when the layout is the same, else the canonical one. The history and the start steps travel
in the checkpoint, so after a restart the metric history is whole and the starts say where each start
began. The checkpoint to resume from is chosen before the engine is built (``resume_checkpoint``), so that a
resumed run keeps the precision it trained in (``precision_record``) on any layout, instead of choosing
``auto`` again.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from pipeline.training.checkpoint.canonical import load_canonical, save_canonical
from pipeline.training.checkpoint.checksums import verify_checkpoint, write_checksums
from pipeline.training.checkpoint.choice import usable_checkpoint
from pipeline.training.checkpoint.native import load_state, save_state
from pipeline.training.checkpoint.record import CheckpointRecord

LAYOUT_FILE = "layout.json"
RUN_LOG_FILE = "run_log.json"  # rank 0's metric history and the steps training started at
PRECISION_FILE = "train_precision.json"  # rank 0's: what the run trained in (``autotune.Decided.record``)


def resume_checkpoint(record: CheckpointRecord, resume_from: str | None, warn: Callable[[str], None] = print):
    """The checkpoint this training (re)starts from, as a ``ray.train.Checkpoint``, or None for a fresh start:
    the newest recorded one that verifies, else ``checkpoint.resume_from`` (another training's).

    Raises:
        NoUsableCheckpoint: checkpoints are recorded and none of them verifies.
    """
    import ray.train

    recorded = [ray.train.Checkpoint(record.path_of(e), filesystem=record.fs) for e in record.newest_first()]
    if recorded:
        return usable_checkpoint(recorded, verify_checkpoint, warn=warn)
    return ray.train.Checkpoint(resume_from) if resume_from else None  # continue another run


def precision_record(checkpoint) -> dict | None:
    """The precision record a checkpoint holds (one small file read, not the checkpoint's download), or
    None for none to resume from, or a checkpoint written before the record was kept in it."""
    if checkpoint is None:
        return None
    path = f"{checkpoint.path.rstrip('/')}/{PRECISION_FILE}"
    try:
        with checkpoint.filesystem.open_input_stream(path) as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None


@dataclass
class Restored:
    """Where training (re)starts: the step, the loader position, the history and starts so far."""

    step: int = 0
    loader_state: dict | None = None
    history: list[dict] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)


class CheckpointManager:
    """Saves and restores one rank's training state in the training's checkpoints (``record``).

    Args:
        engine: the rank's DeepSpeed engine.
        scheduler: its LR scheduler (its state goes into the canonical form).
        layout: {"world_size", "ep_size", "zero_stage"} of this run: a checkpoint of the same layout
            loads natively, any other through ``canonical.pt``.
        record: the training's checkpoint record (``CheckpointRecord``).
        resume: the checkpoint to start from (``resume_checkpoint``), or None.
        precision: what the run trains in (``autotune.Decided.record()``), saved in every checkpoint.
    """

    def __init__(self, engine, scheduler, layout: dict, record: CheckpointRecord, resume,
                 precision: dict | None = None) -> None:
        self.engine, self.scheduler, self.layout = engine, scheduler, layout
        self.record, self.resume, self.precision = record, resume, precision

    def restore(self, on_load: Callable[[str], None] | None = None) -> Restored:
        """The state to start from: a fresh start at step 0, or what the chosen checkpoint holds
        (``on_load`` is told which, before it is read).

        Raises:
            CheckpointRefused: ``checkpoint.resume_from`` names a checkpoint that does not verify.
        """
        resume = self.resume
        if resume is None:
            return Restored(starts=[0])
        if on_load is not None:
            on_load(resume.path)
        with resume.as_directory() as ckpt_dir:
            restored = self._load(Path(ckpt_dir))
        restored.starts.append(restored.step)
        return restored

    def _load(self, ckpt_dir: Path) -> Restored:
        verify_checkpoint(ckpt_dir)  # before anything of it is read: DeepSpeed's loader unpickles
        saved = json.loads((ckpt_dir / LAYOUT_FILE).read_text())
        if saved == self.layout:  # DeepSpeed's own checkpoint: bit-exact
            step, loader_state = load_state(self.engine, ckpt_dir)
        else:  # another world size, ZeRO stage or ep_size: the layout-independent one
            step, loader_state = load_canonical(self.engine, ckpt_dir, scheduler=self.scheduler)
        restored = Restored(step=step, loader_state=loader_state)
        run_log = ckpt_dir / RUN_LOG_FILE
        if run_log.is_file():  # absent in checkpoints written before it existed
            saved_log = json.loads(run_log.read_text())
            restored.history = [h for h in saved_log["history"] if h["step"] <= step]
            restored.starts = saved_log["starts"]
        return restored

    def save(self, step: int, loader_state: dict, history: list[dict], starts: list[int]) -> None:
        """Every rank writes its part, and the parts meet in the step's folder; then rank 0 records the
        checkpoint (``CheckpointRecord``: whole before it is named). Collective: every rank calls it at the
        same step."""
        rank = dist.get_rank()
        with tempfile.TemporaryDirectory() as tmp:
            save_state(self.engine, tmp, step=step, loader_state=loader_state)
            save_canonical(self.engine, tmp, step=step, scheduler=self.scheduler, loader_state=loader_state)
            if rank == 0:
                (Path(tmp) / LAYOUT_FILE).write_text(json.dumps(self.layout))
                (Path(tmp) / RUN_LOG_FILE).write_text(json.dumps({"history": history, "starts": starts}))
                if self.precision is not None:
                    (Path(tmp) / PRECISION_FILE).write_text(json.dumps(self.precision))
            write_checksums(tmp, rank)  # last: what verify_checkpoint checks before a resume loads it
            if rank == 0:
                self.record.clear_folder(step)
            dist.barrier()  # the folder is empty before any part goes in
            self.record.upload(tmp, step)
        dist.barrier()  # every part is in
        if rank == 0:
            self.record.register(step)

"""``CheckpointRecord``: where a training's checkpoints are, and which ones count.

A training's checkpoints live at ``<checkpoint.storage>/train-<artifact hash>/`` (a local folder or an
object store), outside the artifact folder, so that a rerun after a killed driver, a restarted worker
group and ``checkpoint.resume_from`` all find them:

    checkpoint_000000030/    one folder per checkpoint, named by its step; every rank's part merged in it
    checkpoints.json         the record: the checkpoints that are whole, oldest first, written last

Saving is collective (every rank at the same step, ``save``): rank 0 clears the step's folder of what a
failed attempt may have left there, every rank uploads its part, and once all have (a barrier) rank 0
appends the checkpoint to the record, writes it whole (a rename on a local disk; an object store's put is
whole already), and only then deletes the checkpoints beyond ``checkpoint.keep``. A crash at any point
leaves the record naming whole checkpoints only: a folder it does not name is never resumed from, and is
overwritten when its step is saved again.

Conduit keeps this record itself rather than Ray Train's checkpoint manager, so that every launch (Ray
Train's workers, Ray Train's local mode in the stage's task) writes, keeps and finds checkpoints the same
way, through public APIs only.
"""

from __future__ import annotations

import json
import os
import pyarrow.fs as pafs

from pipeline.data.fs import filesystem_for
from pipeline.store.backends import join
from pipeline.store.contracts import CHECKPOINT_PREFIX
from pipeline.training.loop_config import CheckpointPlace

RECORD_FILE = "checkpoints.json"
CHECKPOINTS_DIR = "checkpoints"  # under the artifact root, beside the stage folders: checkpoint.storage's default


def place_for(storage: str | None, artifact_root: str, artifact_hash: str, keep: int) -> CheckpointPlace:
    """Where the train artifact ``artifact_hash``'s checkpoints go: ``checkpoint.storage`` (default
    ``<artifact_root>/checkpoints``), in a folder named after the artifact, so two configs sharing a storage
    never see each other's checkpoints and a rerun of the same config finds its own."""
    root = storage or join(artifact_root, CHECKPOINTS_DIR)
    return CheckpointPlace(storage=root, name=f"train-{artifact_hash}", keep=keep)


def discard_checkpoints(place: CheckpointPlace) -> None:
    """Every checkpoint of the training at ``place`` removed (``--force train``: start from step 0)."""
    fs, base = filesystem_for(place.storage)
    folder = f"{base.rstrip('/')}/{place.name}"
    if fs.get_file_info(folder).type != pafs.FileType.NotFound:
        fs.delete_dir(folder)


def folder_name(step: int) -> str:
    """A checkpoint's folder: its step, zero-padded, so that names sort as steps do."""
    return f"{CHECKPOINT_PREFIX}{step:09d}"


class CheckpointRecord:
    """The record of one training's checkpoints (the module docstring), read when made."""

    def __init__(self, place: CheckpointPlace) -> None:
        self.place = place
        self.fs, base = filesystem_for(place.storage)
        self.dir = f"{base.rstrip('/')}/{place.name}"
        self.entries: list[dict] = []  # {"folder", "step"}, oldest first
        self.read()

    def read(self) -> None:
        """The record as storage holds it now (none yet: empty)."""
        try:
            with self.fs.open_input_stream(f"{self.dir}/{RECORD_FILE}") as f:
                self.entries = json.loads(f.read().decode("utf-8"))["checkpoints"]
        except FileNotFoundError:
            self.entries = []

    @property
    def uri(self) -> str:
        """The training's folder as a URI (or a local path), pyarrow's options kept at the end."""
        return join(self.place.storage, self.place.name)

    def uri_of(self, entry: dict) -> str:
        return join(self.place.storage, self.place.name, entry["folder"])

    def path_of(self, entry: dict) -> str:
        """The entry's folder on ``self.fs`` (no scheme)."""
        return f"{self.dir}/{entry['folder']}"

    def newest_first(self) -> list[dict]:
        return list(reversed(self.entries))

    def clear_folder(self, step: int) -> str:
        """Rank 0, before the ranks upload step ``step``'s parts: its folder emptied of what an earlier attempt
        left there (parts of a checkpoint never recorded, or one being written again). Returns the folder."""
        path = f"{self.dir}/{folder_name(step)}"
        if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
            self.fs.delete_dir(path)
        self.fs.create_dir(path, recursive=True)
        return path

    def upload(self, local_dir: str, step: int) -> None:
        """A rank's part of step ``step``'s checkpoint: the files of ``local_dir`` copied into its folder."""
        pafs.copy_files(local_dir, f"{self.dir}/{folder_name(step)}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)

    def register(self, step: int) -> None:
        """Rank 0, once every rank's part of step ``step`` is in storage: the checkpoint recorded, the record
        written whole, then the checkpoints beyond ``keep`` deleted (a crash between leaves an extra folder,
        never a record naming a missing one)."""
        self.entries = [e for e in self.entries if e["step"] != step] + [{"folder": folder_name(step), "step": step}]
        dropped = self.entries[:-self.place.keep] if self.place.keep else []
        self.entries = self.entries[len(dropped):]
        self._write()
        for entry in dropped:
            self.fs.delete_dir(self.path_of(entry))

    def keep_only_newest(self) -> None:
        """After the train artifact is sealed: every checkpoint folder but the newest recorded one deleted
        (``checkpoint.resume_from`` can continue from it), and the record naming it alone."""
        if not self.entries:
            return
        newest = self.entries[-1]
        self.entries = [newest]
        self._write()
        for info in self.fs.get_file_info(pafs.FileSelector(self.dir)):
            if (info.type == pafs.FileType.Directory and info.base_name.startswith(CHECKPOINT_PREFIX)
                    and info.base_name != newest["folder"]):
                self.fs.delete_dir(info.path)

    def _write(self) -> None:
        data = json.dumps({"checkpoints": self.entries}, indent=1).encode("utf-8")
        path = f"{self.dir}/{RECORD_FILE}"
        self.fs.create_dir(self.dir, recursive=True)
        if isinstance(self.fs, pafs.LocalFileSystem):  # whole or not at all: written aside, then renamed
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:  # an object store's put is whole already
            with self.fs.open_output_stream(path) as f:
                f.write(data)

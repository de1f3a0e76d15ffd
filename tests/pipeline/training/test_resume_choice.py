"""A (re)started training resumes from the newest recorded checkpoint that verifies: a damaged or missing
newest one gives way to the one before, with a warning; none that verifies is refused, naming each."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.training.checkpoint.checksums import CheckpointRefused, verify_checkpoint, write_checksums
from pipeline.training.checkpoint.choice import NoUsableCheckpoint
from pipeline.training.checkpoint.manager import resume_checkpoint
from pipeline.training.checkpoint.record import CheckpointRecord, folder_name
from pipeline.training.loop_config import CheckpointPlace


def recorded(tmp_path: Path, *steps: int) -> CheckpointRecord:
    """A training's record of checkpoints at ``steps``, each folder with checksums as the loop writes them."""
    record = CheckpointRecord(CheckpointPlace(str(tmp_path), "train-x", keep=len(steps)))
    for step in steps:
        local = tmp_path / f"local-{step}"
        local.mkdir()
        (local / "layout.json").write_text('{"world_size": 1}')
        (local / "canonical.pt").write_bytes(bytes([step % 251]) * 4096)
        write_checksums(local, 0)
        record.clear_folder(step)
        record.upload(str(local), step)
        record.register(step)
    return record


def test_a_damaged_or_missing_newest_checkpoint_gives_way_to_the_newest_that_verifies(tmp_path):
    record = recorded(tmp_path, 20, 40, 60)
    run = tmp_path / "train-x"
    with open(run / folder_name(60) / "canonical.pt", "r+b") as f:
        f.truncate(100)  # a node died while writing it
    warnings: list[str] = []
    chosen = resume_checkpoint(record, None, warnings.append)
    assert Path(chosen.path) == run / folder_name(40)
    assert len(warnings) == 1 and folder_name(60) in warnings[0] and "canonical.pt changed" in warnings[0]
    assert f"resuming from {run / folder_name(40)}, the newest one that does" in warnings[0]

    # A good newest one is taken as it is, without a word; checkpoint.resume_from is another training's and
    # counts only where this one recorded none.
    warnings.clear()
    shutil.rmtree(run / folder_name(60))
    record.entries = record.entries[:-1]
    assert Path(resume_checkpoint(record, "/elsewhere", warnings.append).path) == run / folder_name(40)
    assert warnings == []
    assert resume_checkpoint(CheckpointRecord(CheckpointPlace(str(tmp_path), "train-y", 1)), "/elsewhere").path == \
        "/elsewhere"

    # None verifies: refused, naming each, rather than silently training from step 0.
    (run / folder_name(40) / "planted.pt").write_bytes(b"x")
    (run / folder_name(20) / "layout.json").write_text("{}")
    with pytest.raises(NoUsableCheckpoint, match=r"planted\.pt is not a file Conduit wrote.*layout\.json changed"):
        resume_checkpoint(record, None, warnings.append)
    with pytest.raises(CheckpointRefused):
        verify_checkpoint(run / folder_name(20))


def test_a_missing_folder_is_refused_like_a_damaged_one(tmp_path):
    record = recorded(tmp_path, 10, 20)
    shutil.rmtree(tmp_path / "train-x" / folder_name(20))
    warnings: list[str] = []
    assert Path(resume_checkpoint(record, None, warnings.append).path) == tmp_path / "train-x" / folder_name(10)
    assert len(warnings) == 1 and folder_name(20) in warnings[0]


def test_a_record_on_an_object_store_resumes_from_its_newest_checkpoint(tmp_path, moto_s3):
    """Checkpoints and their record in S3 (a moto server): a new record reads them, and the checkpoint it
    resumes from is read through the store's filesystem (the launch that resumed a recovered checkpoint as a
    bare URI, which pyarrow refused, is gone)."""
    import pyarrow.fs as pafs

    query = f"endpoint_override={moto_s3}&scheme=http"
    pafs.S3FileSystem(endpoint_override=moto_s3, scheme="http", allow_bucket_creation=True).create_dir("records")
    place = CheckpointPlace(f"s3://records/runs?{query}", "train-x", keep=2)
    record = CheckpointRecord(place)
    for step in (10, 20, 30):
        local = tmp_path / f"local-{step}"
        local.mkdir()
        (local / "canonical.pt").write_bytes(bytes([step]) * 1000)
        write_checksums(local, 0)
        record.clear_folder(step)
        record.upload(str(local), step)
        record.register(step)
    again = CheckpointRecord(place)
    assert [e["step"] for e in again.entries] == [20, 30]
    assert again.uri_of(again.entries[-1]) == f"s3://records/runs/train-x/{folder_name(30)}?{query}"
    chosen = resume_checkpoint(again, None)
    with chosen.as_directory() as folder:
        assert (Path(folder) / "canonical.pt").read_bytes() == bytes([30]) * 1000
    assert [i.base_name for i in again.fs.get_file_info(pafs.FileSelector("records/runs/train-x"))
            if i.type == pafs.FileType.Directory] == [folder_name(20), folder_name(30)]

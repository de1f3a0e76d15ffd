"""A restarted group skips a latest checkpoint that does not verify for the newest earlier one that does."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.training.checkpoint.checksums import CheckpointRefused, verify_checkpoint, write_checksums
from pipeline.training.checkpoint.choice import NoUsableCheckpoint, usable_checkpoint


def kept(run_dir: Path, stamp: str, step: int) -> Path:
    """A checkpoint folder as Ray Train names them, with checksums as the loop writes them."""
    folder = run_dir / f"checkpoint_2026-12-01_{stamp}"
    folder.mkdir(parents=True)
    (folder / "layout.json").write_text('{"world_size": 1}')
    (folder / "canonical.pt").write_bytes(bytes([step % 251]) * 4096)
    write_checksums(folder, 0)
    return folder


def test_a_damaged_latest_checkpoint_is_skipped_for_the_newest_earlier_one_that_verifies(tmp_path):
    import ray.train

    oldest, middle, latest = (kept(tmp_path, s, n) for s, n in (("10-00-00.000001", 20), ("10-05-00.000001", 40),
                                                                 ("10-10-00.000001", 60)))
    with open(latest / "canonical.pt", "r+b") as f:
        f.truncate(100)  # a node died while writing it
    warnings: list[str] = []
    chosen = usable_checkpoint(ray.train.Checkpoint(str(latest)), verify_checkpoint, warnings.append)
    assert Path(chosen.path) == middle
    assert len(warnings) == 1 and str(latest) in warnings[0] and "canonical.pt changed" in warnings[0]
    assert f"resuming from {middle}" in warnings[0]

    # A good latest one is taken as it is, without a word.
    warnings.clear()
    assert Path(usable_checkpoint(ray.train.Checkpoint(str(middle)), verify_checkpoint, warnings.append).path) == middle
    assert warnings == []

    # None verifies: refused, naming each, rather than silently training from step 0.
    (middle / "planted.pt").write_bytes(b"x")
    (oldest / "layout.json").write_text("{}")
    with pytest.raises(NoUsableCheckpoint, match=r"planted\.pt is not a file Conduit wrote.*layout\.json changed"):
        usable_checkpoint(ray.train.Checkpoint(str(latest)), verify_checkpoint, warnings.append)
    with pytest.raises(CheckpointRefused):
        verify_checkpoint(oldest)

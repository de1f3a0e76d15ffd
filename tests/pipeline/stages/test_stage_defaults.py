"""A changed default bumps its stage's version: the rule that keeps cached artifacts honest.

Artifact hashes leave out every field at its default (``hash_view``), so that adding a field keeps every
cached artifact valid. The price: a default changed in place changes what a stage produces while its hash
stays the same, and a run would reuse a stale artifact (or resume a checkpoint made under the old
default). ``stage_defaults.json`` records, for each stage and version, every field its hash covers with
its default. A stage whose defaults differ from its version's record fails here until its version is
bumped and the new version recorded:

    python -m tests.pipeline.stages.test_stage_defaults   # records the versions not yet recorded

What this cannot see: a default whose value stays and whose meaning changes (``train.precision: auto``
choosing bf16 where it chose fp32): that too needs a bump, by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.config import load_config, schema
from pipeline.stages import STAGES

RECORD = Path(__file__).with_name("stage_defaults.json")
# What a stage hashes that is not a default but where this machine is: the input files' paths and times,
# the tracking store's address.
OF_THE_MACHINE = {"shard": {"files"}, "register": {"tracking_uri"}}


def stage_defaults(monkeypatch_setattr) -> dict[str, dict]:
    """Each stage's hashed view of the default config with nothing left out for being at its default."""
    monkeypatch_setattr(schema, "_at_default", lambda field, value: False)
    cfg = load_config(None)
    views = {name: {k: v for k, v in stage.hash_config(cfg).items() if k not in OF_THE_MACHINE.get(name, ())}
             for name, stage in STAGES.items()}
    return json.loads(json.dumps(views, sort_keys=True, default=str))


def test_every_stage_records_the_defaults_of_its_version(monkeypatch):
    recorded = json.loads(RECORD.read_text())
    for name, now in stage_defaults(monkeypatch.setattr).items():
        version = str(STAGES[name].version)
        assert version in recorded.get(name, {}), (
            f"stage {name!r} version {version} has no record of its defaults: run "
            "`python -m tests.pipeline.stages.test_stage_defaults` and commit stage_defaults.json")
        assert now == recorded[name][version], (
            f"a default that stage {name!r} hashes changed while the stage stayed at version {version}: cached "
            f"artifacts would be reused as if nothing had changed. Bump {name}'s version (pipeline/stages/{name}.py) "
            "and record it (`python -m tests.pipeline.stages.test_stage_defaults`)")


def test_the_record_keeps_each_version_that_changed_a_default():
    """The train stage's version 2 is the change of ``train.compile``'s default to ``auto`` (and of what
    ``train.precision: auto`` chooses on CPUs); version 1's record keeps the old default."""
    recorded = json.loads(RECORD.read_text())
    assert recorded["train"]["1"]["train"]["compile"] is False
    assert recorded["train"]["2"]["train"]["compile"] == "auto"


def record() -> None:
    """Add the current version of each stage whose version is not recorded yet; a recorded version is
    never rewritten (its record is what the test holds the code to)."""
    from _pytest.monkeypatch import MonkeyPatch

    patch = MonkeyPatch()
    try:
        now = stage_defaults(patch.setattr)
    finally:
        patch.undo()
    recorded = json.loads(RECORD.read_text())
    for name, view in now.items():
        version = str(STAGES[name].version)
        if version not in recorded.setdefault(name, {}):
            recorded[name][version] = view
            print(f"recorded {name} version {version}")
    RECORD.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(record())

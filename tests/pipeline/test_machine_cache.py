"""The machine's JSON caches (`pipeline.machine_cache`): nested updates keep what else the file holds, an
unreadable file starts over, and updates from processes running at once all land."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline import machine_cache

ROOT = Path(__file__).resolve().parents[2]


def test_an_update_sets_its_keys_and_keeps_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = machine_cache.cache_dir() / "choices.json"
    assert path == tmp_path / "xdg" / "conduit" / "choices.json"
    assert machine_cache.read(path) == {}  # none yet
    machine_cache.update(path, ("cpu a", "shape 1"), {"precision": "fp32"})
    machine_cache.update(path, ("cpu a", "shape 2"), {"precision": "amp_bf16"})
    machine_cache.update(path, ("cpu b",), 2.5e11)
    assert json.loads(path.read_text()) == {"cpu a": {"shape 1": {"precision": "fp32"},
                                                      "shape 2": {"precision": "amp_bf16"}}, "cpu b": 2.5e11}
    machine_cache.update(path, ("cpu b", "shape 1"), 1)  # a value where a level should be: replaced by one
    assert machine_cache.read(path)["cpu b"] == {"shape 1": 1}
    path.write_text('{"cpu a": {"sha')  # cut short
    assert machine_cache.read(path) == {}
    machine_cache.update(path, ("cpu a", "shape 3"), 3)
    assert json.loads(path.read_text()) == {"cpu a": {"shape 3": 3}}
    path.write_text("[1, 2]")  # JSON, but not an object
    assert machine_cache.read(path) == {}


WRITER = """
import sys
from pathlib import Path
from pipeline import machine_cache
for i in range(40):
    machine_cache.update(Path(sys.argv[1]), ("machine", sys.argv[2] + "-" + str(i)), i)
"""


def test_processes_updating_at_once_lose_nothing(tmp_path):
    """Six processes each add 40 entries to one file at once: without the lock, one's read-change-write
    overwrites what another wrote between its read and its write."""
    path = tmp_path / "shared.json"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"w{n}"], cwd=ROOT) for n in range(6)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 6
    assert json.loads(path.read_text())["machine"] == {f"w{n}-{i}": i for n in range(6) for i in range(40)}

"""Every test that docs/reliability.md names exists: a row cannot point at a test that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def named_tests() -> list[tuple[str, str | None]]:
    """``(file under tests/, test name or None)`` for each backticked reference; a bare ``::name``
    belongs to the file named before it in the same cell."""
    found = []
    for line in (ROOT / "docs" / "reliability.md").read_text().splitlines():
        if not line.startswith("|"):
            continue
        current = None
        for ref in re.findall(r"`([\w/.]*\.py(?:::\w+)?|::\w+)`", line.split("|")[-2]):
            path, _, name = ref.partition("::")
            if path:
                current = path.removeprefix("tests/")
            found.append((current, name or None))
    return found


def test_every_test_named_in_reliability_md_exists():
    refs = named_tests()
    assert len(refs) >= 20
    missing = []
    for path, name in refs:
        file = ROOT / "tests" / path
        if not file.is_file() or (name and not re.search(rf"^def {name}\(", file.read_text(), re.M)):
            missing.append(f"{path}::{name}")
    assert missing == []

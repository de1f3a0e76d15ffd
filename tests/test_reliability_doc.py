"""docs/reliability.md is held to its tests: every row of its tables names at least one test function
(``file::test``), and every test it names exists, so a row can neither point at a test that is gone
nor claim a behaviour that no test shows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEPARATOR = re.compile(r"\|(\s*:?-+:?\s*\|)+")


def table_rows() -> list[str]:
    """The body rows of every table in docs/reliability.md (header and separator rows left out)."""
    lines = (ROOT / "docs" / "reliability.md").read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.startswith("|") or SEPARATOR.fullmatch(line):
            continue
        if i + 1 < len(lines) and SEPARATOR.fullmatch(lines[i + 1]):
            continue  # a header row
        rows.append(line)
    return rows


def named_tests(row: str) -> list[tuple[str, str | None]]:
    """``(file under tests/, test name or None)`` for each backticked reference in the row's last cell;
    a bare ``::name`` belongs to the file named before it in the same cell."""
    found = []
    current = None
    for ref in re.findall(r"`([\w/.]*\.py(?:::\w+)?|::\w+)`", row.split("|")[-2]):
        path, _, name = ref.partition("::")
        if path:
            current = path.removeprefix("tests/")
        found.append((current, name or None))
    return found


def defines(path: str, name: str) -> bool:
    file = ROOT / "tests" / path
    return file.is_file() and re.search(rf"^(async )?def {name}\(", file.read_text(), re.M) is not None


def test_every_test_named_in_reliability_md_exists():
    refs = [ref for row in table_rows() for ref in named_tests(row)]
    assert len(refs) >= 20
    missing = [f"{path}::{name}" for path, name in refs
               if not (ROOT / "tests" / path).is_file() or (name and not defines(path, name))]
    assert missing == []
    whole_files = [path for path, name in refs if name is None]  # a file proves nothing in particular
    assert whole_files == []


def test_every_row_of_reliability_md_names_a_test_function():
    rows = table_rows()
    assert len(rows) >= 30
    untested = [row.split("|")[1].strip() for row in rows
                if not any(name and defines(path, name) for path, name in named_tests(row))]
    assert untested == []

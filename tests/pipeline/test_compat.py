"""Private APIs of Ray and MLflow: reached only through ``pipeline.compat``, and only on the versions its
uses were checked against; on any other, one error that names the library, both versions and the use."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

from pipeline import compat

ROOT = Path(__file__).resolve().parents[2]
PRIVATE = ("._private", "._internal", "__mixins__")


def private_uses(path: Path) -> list[str]:
    """The private names a source file imports or reaches as an attribute (``ray._private.worker``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and any(p in f".{node.module}" for p in PRIVATE):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}" for a in node.names
                      if any(p in f".{a.name}" for p in PRIVATE)]
        elif isinstance(node, ast.Attribute) and node.attr in ("_private", "_internal", "__mixins__"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_no_module_but_compat_reaches_a_private_api():
    sources = [p for pkg in ("pipeline", "jobs", "models") for p in sorted((ROOT / pkg).rglob("*.py"))]
    offenders = [u for p in sources if p != ROOT / "pipeline" / "compat.py" for u in private_uses(p)]
    assert offenders == []


def test_the_installed_versions_are_those_the_uses_were_checked_against():
    for distribution in ("ray", "mlflow"):
        compat.require(distribution, "a test")  # no UntestedVersion here: pyproject.toml pins these
    assert importlib.metadata.version("ray") in compat.TESTED["ray"]


def test_another_version_is_refused_naming_the_library_both_versions_and_the_use(monkeypatch):
    monkeypatch.setattr(compat, "_version", lambda distribution: "9.9.9")
    with pytest.raises(compat.UntestedVersion) as e:
        compat.free_resources_by_node()
    assert str(e.value) == (
        "reading each node's free CPUs uses a private API of ray, checked against ray 2.60.0; ray 9.9.9 is "
        "installed. Install ray==2.60.0 (pyproject.toml), or check this use against 9.9.9 in "
        "pipeline/compat.py and add the version to its TESTED")


def test_mlflow_skinny_stands_in_for_mlflow_where_only_it_is_installed(monkeypatch):
    """vLLM's environment has mlflow-skinny, not mlflow: the check reads that one."""
    versions = {"mlflow-skinny": compat.TESTED["mlflow-skinny"][0]}
    monkeypatch.setattr(compat, "_version", versions.get)
    compat.require("mlflow", "a test")
    versions["mlflow-skinny"] = "1.0"
    with pytest.raises(compat.UntestedVersion, match="private API of mlflow-skinny, checked against "):
        compat.require("mlflow", "a test")

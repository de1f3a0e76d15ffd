"""The layer rules of ARCHITECTURE.md section 3, read from the imports of every source file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def files(pkg: str) -> list[Path]:
    return sorted((ROOT / pkg).rglob("*.py"))


def hits(pkg: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}: {name}"
        for p in files(pkg)
        for name in sorted(imports_of(p))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_models_is_pure_torch():
    forbidden = ("torch.distributed", "deepspeed", "ray", "mlflow", "datasets", "pyarrow", "sentencepiece",
                 "pipeline", "jobs", "transformers")
    assert files("models"), "models/ has no files"
    assert hits("models", forbidden) == []


def test_training_does_not_import_orchestration():
    assert hits("pipeline/training", ("pipeline.runner", "pipeline.stages", "jobs")) == []


def test_mlflow_only_in_tracking_and_serving():
    offenders = [h for pkg in ("pipeline", "jobs", "models") for h in hits(pkg, ("mlflow",))
                 if not h.startswith(("pipeline/tracking.py:", "pipeline/serving.py:"))]
    assert offenders == []


def test_nothing_imports_jobs_tests_or_benchmarks():
    assert hits("pipeline", ("jobs", "tests", "benchmarks", "infra")) == []
    assert hits("models", ("jobs", "tests", "benchmarks", "infra")) == []


def test_the_checker_sees_imports(tmp_path):
    # The rules above are only as good as imports_of: prove it catches both import forms.
    f = tmp_path / "x.py"
    f.write_text("import ray.train\nfrom mlflow.entities import Metric\nfrom . import sibling\n")
    assert imports_of(f) == {"ray.train", "mlflow.entities"}

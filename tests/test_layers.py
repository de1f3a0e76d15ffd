"""The layer rules of docs/design.md ("The floors"), read from the imports of every source file."""

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
                 if not h.startswith(("pipeline/tracking.py:", "pipeline/serving/pyfunc.py:"))]
    assert offenders == []


def test_nothing_imports_jobs_tests_or_benchmarks():
    assert hits("pipeline", ("jobs", "tests", "benchmarks", "infra")) == []
    assert hits("models", ("jobs", "tests", "benchmarks", "infra")) == []


def test_the_checker_sees_imports(tmp_path):
    # The rules above are only as good as imports_of: prove it catches both import forms.
    f = tmp_path / "x.py"
    f.write_text("import ray.train\nfrom mlflow.entities import Metric\nfrom . import sibling\n")
    assert imports_of(f) == {"ray.train", "mlflow.entities"}


CONDUIT = ("pipeline", "models", "jobs", "tests", "benchmarks", "infra")


def test_no_arrow_runs_up():
    """The ground floor (repo root, ConfigError, redaction) imports nothing of Conduit; the configuration
    reads no data, store, stage or serving code; the data readers, the artifact store, the tokenizer and
    inference take their error type and paths from the ground floor, not from the configuration."""
    assert sorted(n for n in imports_of(ROOT / "pipeline" / "base.py") if n.split(".")[0] in CONDUIT) == []
    assert hits("pipeline/config", ("pipeline.data", "pipeline.store", "pipeline.stages", "pipeline.training",
                                    "pipeline.serving", "pipeline.inference", "pipeline.evaluation",
                                    "pipeline.runner", "pipeline.tracking")) == []
    for pkg in ("pipeline/data", "pipeline/store", "pipeline/tokenization", "pipeline/inference"):
        assert hits(pkg, ("pipeline.config", "pipeline.stages", "pipeline.runner")) == [], pkg


def test_pipeline_top_level_holds_at_most_twelve_modules():
    modules = sorted(p.name for p in (ROOT / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 12, modules
    for package in ("config", "store", "serving", "inference", "tokenization"):
        doc = ast.get_docstring(ast.parse((ROOT / "pipeline" / package / "__init__.py").read_text()))
        assert doc, f"pipeline/{package}/__init__.py does not say what it offers"


def test_only_the_family_tables_compare_family_names():
    """A model family is asked for through ``models.families``; no other code compares arch or attention
    strings (the grep of issue #32)."""
    import re

    pattern = re.compile(r'arch ==|arch !=|arch in \(|attention == "mla"|attention != "mla"')
    found = [f"{p.relative_to(ROOT)}:{i}" for pkg in ("models", "pipeline", "jobs") for p in files(pkg)
             if not p.is_relative_to(ROOT / "models" / "families")
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], found


def test_no_training_function_is_longer_than_sixty_lines():
    """``loop.main`` once held setup, resume, MFU tags, the step loop, validation, checkpoints and the
    export in 140 lines; each is a named step now."""
    long = [f"{p.relative_to(ROOT)}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for p in files("pipeline/training")
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 60]
    assert long == []

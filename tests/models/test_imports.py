"""models/ imports only torch and the standard library (safetensors and json only in models/export.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "models"
STDLIB = set(sys.stdlib_module_names)
EXPORT_ONLY = {"safetensors", "json"}


def top_level_imports(path: Path) -> set[str]:
    """Top-level package names of every absolute import in the file (relative imports are internal)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def violations(path: Path) -> list[str]:
    bad = []
    for name in top_level_imports(path):
        top = name.split(".")[0]
        if name == "torch.distributed" or name.startswith("torch.distributed."):
            bad.append(name)
        elif top in ("torch", "models"):
            continue
        elif top in EXPORT_ONLY:
            if path.name != "export.py":
                bad.append(name)
        elif top not in STDLIB:
            bad.append(name)
    return sorted(bad)


def test_models_imports_only_torch_and_stdlib():
    files = sorted(MODELS.rglob("*.py"))
    assert len(files) >= 10
    offenders = {str(p.relative_to(MODELS)): violations(p) for p in files if violations(p)}
    assert offenders == {}


def test_the_checker_catches_forbidden_imports(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(
        "import transformers\nfrom torch.distributed import all_reduce\nimport deepspeed.moe\n"
        "import json\nfrom ray import train\nimport math\nfrom . import sibling\nimport torch.nn\n"
    )
    assert violations(f) == ["deepspeed.moe", "json", "ray", "torch.distributed", "transformers"]
    export = tmp_path / "export.py"
    export.write_text("import json\nfrom safetensors.torch import save_file\nimport mlflow\n")
    assert violations(export) == ["mlflow"]


def test_each_family_names_its_model_class_which_names_the_family_back():
    """The table holds each family's nn.Module as a dotted path (imported on first use, so the table
    loads without torch): the path resolves, and the class's ARCH is the family's arch."""
    from models.families import FAMILIES

    for arch, fam in FAMILIES.items():
        assert fam.arch == arch
        assert fam.model_class.ARCH == fam.arch, fam.model

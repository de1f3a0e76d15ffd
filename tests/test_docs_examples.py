"""Every pipeline command that README.md, docs/*.md, infra/README.md and the Kubernetes manifests show a user
loads and validates: the config file and the exact overrides they pass to ``jobs.run`` /
``jobs.submit`` / ``make run`` / ``make submit``. A documented example that Conduit itself would
refuse (a batch that does not divide over the workers, a misspelt key) fails here, not for a user."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.sweep.spec import is_sweep_file

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "infra" / "README.md"]
OVERRIDE = re.compile(r"^[a-z_]+\.[a-z_]+=")


def _shell_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced ``bash`` blocks."""
    return re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)


def _commands(block: str) -> list[list[str]]:
    """Each command line of a shell block as words (continuations joined, comments dropped,
    ``A && B`` and ``A & B`` split)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for w in words:
            if w in ("&&", "&", ";", "||"):
                out.append(current)
                current = []
            else:
                current.append(w)
        out.append(current)
    return [c for c in out if c]


def pipeline_invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """``(config, overrides)`` when ``words`` runs a pipeline, else None."""
    if "jobs.run" in words or "jobs.submit" in words:
        rest = words[words.index("jobs.run" if "jobs.run" in words else "jobs.submit") + 1:]
        configs = [w for w in rest if w.endswith(".yaml") and not is_sweep_file(ROOT / w)]  # sweeps: below
        return (configs[0], [w for w in rest if OVERRIDE.match(w)]) if configs else None
    if words[:2] in (["make", "run"], ["make", "submit"]):
        named = dict(w.split("=", 1) for w in words[2:] if "=" in w and w.split("=", 1)[0].isupper())
        args = shlex.split(named.get("ARGS", ""))
        return named.get("CONFIG", "configs/demo.yaml"), [a for a in args if OVERRIDE.match(a)]
    return None


def documented_examples() -> list[tuple[str, str, list[str]]]:
    """``(where, config, overrides)`` for every pipeline command in the docs and the RayJob manifest."""
    found = []
    for doc in DOCS:
        for block in _shell_blocks(doc.read_text(encoding="utf-8")):
            for words in _commands(block):
                hit = pipeline_invocation(words)
                if hit:
                    found.append((f"{doc.relative_to(ROOT)}: {shlex.join(words)[:90]}", *hit))
    for doc in yaml.safe_load_all((ROOT / "infra" / "k8s" / "rayjob.yaml").read_text()):
        words = shlex.split(doc["spec"]["entrypoint"])
        found.append(("infra/k8s/rayjob.yaml", *pipeline_invocation(words)))
    return found


EXAMPLES = documented_examples()


def test_the_docs_show_the_examples_this_test_is_about():
    """The parser finds what a reader sees (so that the next test cannot pass by finding nothing)."""
    where = [w for w, _, _ in EXAMPLES]
    assert sum(w.startswith("README.md") for w in where) >= 5, where
    assert sum(w.startswith(("README.md", "docs/")) for w in where) >= 10, where
    assert sum(w.startswith("infra/README.md") for w in where) >= 3, where
    assert "infra/k8s/rayjob.yaml" in where
    assert any("parallel.num_workers=16" in o for _, _, ov in EXAMPLES for o in ov), "the 16-GPU example"


@pytest.mark.parametrize("where,config,overrides", EXAMPLES, ids=[w for w, _, _ in EXAMPLES])
def test_every_documented_pipeline_command_validates(where, config, overrides):
    cfg = load_config(ROOT / config, overrides)
    for item in overrides:  # every override took effect (none was swallowed by the parser above)
        section, rest = item.split(".", 1)
        field = rest.split("=", 1)[0]
        assert hasattr(getattr(cfg, section), field), (where, item)


def documented_sweeps() -> list[tuple[str, str, list[str]]]:
    """``(where, sweep file, overrides)`` for every ``jobs.sweep`` command in the docs."""
    found = []
    for doc in DOCS:
        for block in _shell_blocks(doc.read_text(encoding="utf-8")):
            for words in _commands(block):
                module = next((m for m in ("jobs.sweep", "jobs.submit") if m in words), None)
                rest = words[words.index(module) + 1:] if module else []
                files = [w for w in rest if w.endswith(".yaml") and is_sweep_file(ROOT / w)]
                if files:
                    found.append((f"{doc.relative_to(ROOT)}: {shlex.join(words)[:90]}", files[0],
                                  [w for w in rest if OVERRIDE.match(w)]))
    return found


SWEEPS = documented_sweeps()


def test_the_docs_show_sweep_commands():
    assert sum(w.startswith("README.md") for w, _, _ in SWEEPS) >= 1 and len(SWEEPS) >= 3, SWEEPS


@pytest.mark.parametrize("where,path,overrides", SWEEPS, ids=[w for w, _, _ in SWEEPS])
def test_every_documented_sweep_command_loads(where, path, overrides):
    from pipeline.sweep.spec import load_sweep

    spec = load_sweep(ROOT / path, overrides)
    assert spec.trials, where

"""No import circle in models/ or pipeline/ (docs/design.md, "Floors"): the module graph, read from
the source, has no cycle, and a cycle found is named module by module.

What counts as an arrow from module M to module N:
- every ``import`` and ``from ... import`` statement anywhere in M's file: at the top, inside functions
  and methods (a deferred import still ties the two modules together, it only hides the circle from
  Python's loader), and under ``if TYPE_CHECKING:``; relative imports are resolved against M's package;
- ``from a.b import c`` names ``a.b.c`` when that is a module of the tree, else ``a.b``;
- importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``: those packages count as arrows too,
  except the packages M itself lives in (Python has already started them before M runs, and a package's
  ``__init__`` that imports its own modules to say what it offers is not a circle).
Only modules of models/ and pipeline/ are nodes; imports of anything else (torch, the stdlib, jobs) are
not arrows here (tests/test_layers.py keeps those out).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "pipeline")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def named_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` (at `path`) imports, as the module docstring counts them."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in known else module)
    arrows: set[str] = set()
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} | ({name} if is_package else set())
    for target in targets:
        while target and target not in known:  # `import a.b.c` of a name inside a module: the module
            target = target.rpartition(".")[0]
        if not target:
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            step = ".".join(parts[:i])
            if step in known and step not in own and step != name:
                arrows.add(step)
    return arrows


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    known = set(mods)
    return {name: named_imports(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (or a module importing
    itself), each as the path a -> b -> ... -> a (Tarjan's algorithm, then a shortest circle inside)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # iterative, so a deep graph cannot overflow the recursion limit
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for comp in components:
        members = set(comp)
        start = comp[0]
        if len(comp) == 1 and start not in graph[start]:
            continue
        # Breadth-first from start back to start, inside the component: the shortest circle through it.
        prev: dict[str, str] = {}
        frontier = [start]
        done = False
        while frontier and not done:
            nxt = []
            for u in frontier:
                for w in sorted(graph[u] & members):
                    if w == start:
                        path = [u]
                        while path[-1] != start:
                            path.append(prev[path[-1]])
                        found.append([start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start])
                        done = True
                        break
                    if w not in prev:
                        prev[w] = u
                        nxt.append(w)
                if done:
                    break
            frontier = nxt
    return found


def test_models_and_pipeline_have_no_import_cycle():
    graph = import_graph()
    assert "models.layers.attention" in graph and "pipeline.inference.engine" in graph
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_layer_imports_the_table_or_a_family():
    graph = import_graph()
    layers = [m for m in graph if m.startswith("models.layers.") and m != "models.layers.kinds"]
    assert len(layers) >= 10
    bad = {m: sorted(t for t in graph[m] if t.startswith("models.families") or t == "models.layers.kinds"
                     or t in ("models.presets", "models.export", "models.accounting", "models.generate"))
           for m in layers}
    assert {m: t for m, t in bad.items() if t} == {}
    config = graph["models.config"]
    assert sorted(t for t in config if t.startswith(("models.families", "models.presets", "models.export"))) == []


def test_the_cycle_finder_sees_deferred_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "pipeline"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pipeline.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pipeline import c\n")
    (pkg / "c.py").write_text("from .sub import b\n")  # c -> sub.b -> c: a circle through a deferred import
    (pkg / "d.py").write_text("import pipeline.sub.b\n")
    graph = import_graph(tmp_path, ("pipeline",))
    assert graph["pipeline.sub"] == {"pipeline.sub.b"}
    assert graph["pipeline.sub.b"] == {"pipeline.c"}  # its own package (pipeline.sub) is no arrow back
    assert graph["pipeline.c"] == {"pipeline.sub", "pipeline.sub.b"}  # runs pipeline/sub/__init__ too
    assert graph["pipeline.d"] == {"pipeline.sub", "pipeline.sub.b"}
    assert cycles(graph) == [["pipeline.c", "pipeline.sub.b", "pipeline.c"]]  # the shortest circle of the three

"""The package is layered: no import cycle among gdngen's modules, counting imports made inside
functions and the backend modules the registry imports by name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gdngen"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """gdngen module -> the gdngen modules it imports anywhere in its body (module level or
    inside functions); ``from pkg import name`` counts as importing ``pkg.name`` when that is a
    module. The registry's by-name imports (`gdngen.registry.BACKENDS`) are edges too."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    from gdngen import registry

    graph["gdngen.registry"] |= set(registry.BACKENDS.values())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_checker_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_gdngen_modules():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_entry_points_sit_above_dispatch_and_the_backends_below_it():
    graph = import_graph()
    assert "gdngen.entry" in graph["gdngen.jax"] and "gdngen.entry" in graph["gdngen.mlx"]
    assert "gdngen.dispatch" in graph["gdngen.entry"]
    for name in ("gdngen.dispatch", "gdngen.registry"):
        assert not {"gdngen.jax", "gdngen.mlx", "gdngen.entry", "gdngen.validate",
                    "gdngen.tools.timing", "gdngen.tune", "gdngen.tools.build",
                    "gdngen.tools.cli"} & graph[name], name
    assert "gdngen.backends.metal" not in graph["gdngen.backends.metal.sim"]


def test_the_algebra_is_math():
    """`gdngen.algebra` is framework-neutral math: it imports only itself and the array checks
    of `gdngen.shape` (the float64 reference checks its inputs), never a call, backend,
    registry or dispatch module."""
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("gdngen.algebra."):
            outside = {t for t in targets if not t.startswith("gdngen.algebra")}
            assert outside <= {"gdngen.shape"}, (name, sorted(outside))

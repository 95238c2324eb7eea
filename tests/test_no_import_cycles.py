"""No forge module imports itself back, at module level or inside a function.

The graph is read from the source with `ast`: every `import` and `from ... import` statement
counts, wherever it is (a function-level import only delays a cycle). Only edges between forge
modules count. `from forge.x import name` is an edge to `forge.x` and, when `name` is a
submodule of the package `forge.x`, to that submodule as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def forge_modules() -> dict[str, Path]:
    """Module name -> file, for every module under src/forge (a package by its __init__.py)."""
    modules = {}
    for path in sorted((SRC / "forge").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from` import names, with a relative one resolved against `module`."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The forge modules that `module` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, is_package)
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = forge_modules()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that reach each other (a strongly connected component of
    more than one module, Tarjan's algorithm), as a path that starts and ends at one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_within(graph, component) for component in components]


def _cycle_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(component)} is no cycle")


def test_the_cycle_finder_names_a_cycle_and_accepts_a_tree():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_relative_and_package_imports_are_edges(tmp_path):
    package = tmp_path / "forge" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .sub import thing\n")
    (package / "sub.py").write_text("def f():\n    from forge.pkg import other\n")
    (package / "other.py").write_text("")
    modules = {
        "forge.pkg": package / "__init__.py",
        "forge.pkg.sub": package / "sub.py",
        "forge.pkg.other": package / "other.py",
    }
    assert imports_of("forge.pkg", modules["forge.pkg"], modules) == {"forge.pkg.sub"}
    assert imports_of("forge.pkg.sub", modules["forge.pkg.sub"], modules) == {"forge.pkg", "forge.pkg.other"}


def test_forge_has_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)

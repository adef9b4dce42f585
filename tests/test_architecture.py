"""The house holds: imports form no cycle, and every layer imports only the layers below it.

Layers, bottom to top (docs/design.md): the core (``fedlora/`` except ``fedlora/app/`` and the
package facade ``fedlora/__init__.py``), the protocol (``strategies/``, ``clients/``), the engines
(``simulations/``), the application (``fedlora/app/``), and the facade on top. Every import counts,
including those inside functions and under ``TYPE_CHECKING``: a cycle through a lazy import is
still a cycle for the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedlora", "strategies", "clients", "simulations")


def layer(module: str) -> int:
    if module == "fedlora":
        return 4  # the facade
    if module.startswith("fedlora.app"):
        return 3
    if module.startswith("simulations"):
        return 2
    if module.startswith(("strategies", "clients")):
        return 1
    return 0  # the core


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in ``path`` (``from X import Y``: X.Y when it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # import a.b.c of a non-module name: its module
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_the_import_graph_has_no_cycle() -> None:
    # Prepare
    graph = import_graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target] if target in path else [node, target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    # Execute
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # Assert
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_layer_imports_only_the_layers_below_it() -> None:
    # Execute
    upward = [f"{source} -> {target}" for source, targets in import_graph().items() for target in targets
              if layer(target) > layer(source) or (layer(source) == 1 and source.split(".")[0] != target.split(".")[0]
                                                   and layer(target) == 1)]
    # Assert: the core imports nothing above it; strategies and clients never import each other
    assert not upward, "imports that go up (or across the protocol layer): " + ", ".join(sorted(upward))


@pytest.mark.parametrize("module", ["fedlora.config", "fedlora.lora", "fedlora.methods", "fedlora.models", "fedlora.training"])
def test_core_modules_import_nothing_above_the_core(module: str) -> None:
    graph = import_graph()
    reachable, todo = set(), [module]
    while todo:
        current = todo.pop()
        for target in graph[current]:
            if target not in reachable:
                reachable.add(target)
                todo.append(target)
    assert all(layer(m) == 0 for m in reachable), sorted(m for m in reachable if layer(m) > 0)


def test_no_file_refers_to_a_document_outside_the_repository() -> None:
    """The repository stands alone: no tracked text names a briefing folder next to it, a
    session's scratch folders or a home directory."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    import re

    outside = re.compile(r"\.\./shared|~/shared|(?:^|[\s\"'`(=])(?:/work|/home|/tmp/deploy)/")
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".json", ".ipynb", ".txt", ".cfg", ".sh", ""} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if name != "tests/test_architecture.py":
            found += [f"{name}: {m.group(0).strip()}" for m in outside.finditer(text)]
    assert found == []

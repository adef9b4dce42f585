"""The house holds: imports form no cycle, and every layer imports only the layers below it.

Layers, bottom to top (docs/design.md): the core (``fedlora/`` except ``fedlora/app/`` and the
package facade ``fedlora/__init__.py``), the protocol (``strategies/``, ``clients/``: installed as
``fedlora.strategies``, ``fedlora.clients``), the engines (``simulations/``), the application (``fedlora/app/``), and the facade on top. Every import counts,
including those inside functions and under ``TYPE_CHECKING``: a cycle through a lazy import is
still a cycle for the reader. And Flower's code is used through its public API, or at a place
docs/design.md's table of Flower internals names, with the reason.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from sources import ROOT, SOURCE_FOLDERS, build_wheel, module_name, source_files


def layer(module: str) -> int:
    if module == "fedlora":
        return 4  # the facade
    if module.startswith("fedlora.app"):
        return 3
    if module.startswith("fedlora.simulations"):
        return 2
    if module.startswith(("fedlora.strategies", "fedlora.clients")):
        return 1
    return 0  # the core


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for p in source_files()}


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


@functools.cache  # read by several tests, never changed: parsed once per process
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
              if layer(target) > layer(source) or (layer(source) == 1 and source.split(".")[:2] != target.split(".")[:2]
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


# ------------------------------------------------------------------ Flower's internals (docs/design.md)
FLOWER_SCANNED = (*SOURCE_FOLDERS, "examples", "benchmarks")
FLOWER_PUBLIC = ("flwr", "flwr.app", "flwr.serverapp", "flwr.serverapp.strategy", "flwr.clientapp",
                 "flwr.clientapp.mod", "flwr.simulation")  # their __all__ is Flower's API reference
FLOWER_TABLE = "## Flower's internals: every use, and why"
FLOWER_MODULE = re.compile(r"(flwr(?:\.[A-Za-z_]\w*)+)(?::\w+)?")  # a whole string naming a module (prose is not)


def flower_all(module: str) -> set[str]:
    """The names ``module`` (a package of the installed Flower) lists in ``__all__``, read from its
    source without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("flwr")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations)), *module.split(".")[1:], "__init__.py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def flower_uses_in(node: ast.AST, where: str, function: str | None = None) -> set[tuple[str, str]]:
    """(Flower name, place) for every import of Flower's code in ``node`` and every string that
    names one of its modules (for a subprocess or importlib); place = ``where`` at module level,
    else ``where:function`` (the innermost function around it)."""
    place = f"{where}:{function}" if function else where
    uses = set()
    if isinstance(node, ast.Import):
        uses = {(alias.name, place) for alias in node.names if alias.name.split(".")[0] == "flwr"}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "flwr":
        uses = {(f"{node.module}.{alias.name}", place) for alias in node.names}
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
            match := FLOWER_MODULE.fullmatch(node.value.strip())):
        uses = {(match.group(1), place)}
    for child in ast.iter_child_nodes(node):
        inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        uses |= flower_uses_in(child, where, inner)
    return uses


def flower_uses() -> set[tuple[str, str]]:
    """Every use of Flower's code in the scanned folders (:func:`flower_uses_in`)."""
    return {use for package in FLOWER_SCANNED for path in sorted((ROOT / package).rglob("*.py"))
            for use in flower_uses_in(ast.parse(path.read_text()), str(path.relative_to(ROOT)))}


def is_public(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return name in FLOWER_PUBLIC or (module in FLOWER_PUBLIC and attr in flower_all(module))


def documented_flower_internals() -> list[tuple[set[str], set[str]]]:
    """The rows of docs/design.md's table: (Flower names, places), each cell's `code` items."""
    lines = (ROOT / "docs/design.md").read_text().splitlines()
    start = lines.index(FLOWER_TABLE)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|") or line.startswith(("|---", "| Flower name")):
            continue
        names, places = line.split("|")[1:3]
        rows.append((set(re.findall(r"`([^`]+)`", names)), set(re.findall(r"`([^`]+)`", places))))
    assert rows, f"no table under {FLOWER_TABLE!r} in docs/design.md"
    return rows


def test_every_use_of_a_flower_internal_is_documented_and_every_documented_one_is_used() -> None:
    # Prepare
    internal = {(name, place) for name, place in flower_uses() if not is_public(name)}
    rows = documented_flower_internals()
    # Execute
    undocumented = sorted(f"{name} in {place}" for name, place in internal
                          if not any(name in names and place in places for names, places in rows))
    stale = sorted(f"{name} in {place}" for names, places in rows for name in names for place in places
                   if not any((name, p) in internal for p in places) or not any((n, place) in internal for n in names))
    # Assert
    assert not undocumented, ("Flower internals used but not in docs/design.md's table (use the public API, or add "
                              "a row: where, why, what breaks): " + "; ".join(undocumented))
    assert not stale, "rows of docs/design.md's Flower table that the code no longer uses: " + "; ".join(sorted(set(stale)))


# ------------------------------------------------------------------ one top-level package
def test_pyproject_installs_every_package_folder_of_the_repository() -> None:
    """pyproject lists the packages by hand (a mapped layout has no discovery): the list names every
    folder of ``fedlora/``, ``strategies/``, ``clients/`` and ``simulations/`` that holds an ``__init__.py``."""
    import tomllib

    # Execute
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {module_name(path) for path in source_files() if path.name == "__init__.py"}
    # Assert
    assert sorted(listed) == sorted(folders)


def test_no_file_imports_a_mapped_folder_by_its_folder_name() -> None:
    """``strategies``, ``clients`` and ``simulations`` are importable by their folder names only where the
    repository root is on the path (pytest's rootdir, a notebook started there): a file importing
    ``strategies.replies`` loads a second copy of ``fedlora.strategies.replies``, with its own module state
    and classes that fail ``isinstance`` against the installed ones."""
    mapped = {folder for folder in SOURCE_FOLDERS if folder != "fedlora"}
    files = [path for folder in ("fedlora", *mapped, "tests", "benchmarks", "examples")
             for path in sorted((ROOT / folder).rglob("*.py"))]
    # Execute
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in mapped]
    # Assert
    assert found == [], "import these as fedlora.<folder>: " + "; ".join(found)


@pytest.mark.slow
def test_the_wheel_holds_only_fedlora_and_strategies_is_not_importable_outside_the_repository(tmp_path: Path) -> None:
    """A wheel built from the repository puts nothing but ``fedlora`` at the top of site-packages (a
    ``strategies``, ``clients`` or ``simulations`` there would collide with a user's own modules):
    the three top-level folders of the repository install as ``fedlora.strategies`` etc."""
    import subprocess
    import sys
    import zipfile

    probe = ("import importlib.util as u, fedlora.strategies.registry as r, fedlora.clients.app as a; "
             "print([n for n in ('strategies', 'clients', 'simulations') if u.find_spec(n)], "
             "len(r.strategy_names()), a.app is not None)")
    # Execute: Flower-free build of the wheel; the installed package probed from a folder outside the repository
    names = zipfile.ZipFile(build_wheel(tmp_path)).namelist()
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=False,
                          env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"})
    # Assert
    assert {name.split("/")[0] for name in names} == {"fedlora", "fedlora-0.1.0.dist-info"}
    assert {"fedlora/strategies/base.py", "fedlora/clients/trainers/fedhera.py", "fedlora/simulations/inprocess.py",
            "fedlora/app/server.py"} <= set(names)
    assert len([n for n in names if n.endswith(".py")]) == len(source_files())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[]", "13", "True"], proc.stdout


# ------------------------------------------------------------------ checkpoint state, declared
def assigned_attributes(cls_node: ast.ClassDef) -> set[str]:
    """Every ``self.<name>`` a class's methods assign (plain, annotated or augmented)."""
    found = set()
    for node in ast.walk(cls_node):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
                    found.add(item.attr)
    return found


def test_every_attribute_a_strategy_assigns_is_declared_checkpoint_state_or_rebuilt() -> None:
    """A checkpoint saves what ``STATE`` declares (not ``vars(self)``): an attribute a strategy
    assigns but declares nowhere would be lost on resume, a declared one it never assigns is stale."""
    from fedlora.strategies.base import LoRAStrategy
    from fedlora.strategies.registry import strategy_class, strategy_names

    # Prepare: the classes as the code writes them
    problems = []
    base_assigned: set[str] = set()
    for base in LoRAStrategy.__mro__:  # LoRAStrategy and its own bases (checkpointed.py, round_steps.py, ...)
        if base.__module__.startswith("fedlora.strategies."):
            path = ROOT / "strategies" / f"{base.__module__.rsplit('.', 1)[-1]}.py"
            base_assigned |= assigned_attributes(next(n for n in ast.walk(ast.parse(path.read_text()))
                                                      if isinstance(n, ast.ClassDef) and n.name == base.__name__))
    for name in strategy_names():
        cls = strategy_class(name)
        path = ROOT / "strategies" / f"{cls.__module__.rsplit('.', 1)[-1]}.py"
        node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        # Execute
        assigned = assigned_attributes(node) - {"options", "experiment", "_experiment_json"}  # set_rounds: rebuilt
        undeclared = assigned - set(cls.STATE) - cls.NOT_STATE
        stale = set(cls.STATE) - assigned - set(LoRAStrategy.STATE)
        problems += [f"{name}: assigns {sorted(undeclared)} but declares them nowhere"] * bool(undeclared)
        problems += [f"{name}: STATE names {sorted(stale)}, which it never assigns"] * bool(stale)
        problems += [f"{name}: STATE drops the base's"] * (not set(LoRAStrategy.STATE) <= set(cls.STATE))
        problems += [f"{name}: {sorted(set(cls.STATE) & cls.NOT_STATE)} both saved and rebuilt"] * bool(
            set(cls.STATE) & cls.NOT_STATE)
    base_undeclared = base_assigned - set(LoRAStrategy.STATE) - LoRAStrategy.NOT_STATE - {"options", "experiment"}
    # Assert
    assert not problems, problems
    assert not base_undeclared, f"LoRAStrategy assigns {sorted(base_undeclared)} but declares them nowhere"
    assert set(LoRAStrategy.STATE) <= base_assigned


def test_no_strategy_module_is_large_and_the_base_is_not_the_largest_module() -> None:
    """One class per algorithm, small pure helpers beside it: no module of ``strategies/`` above
    about 350 lines, the base (the Flower hooks) at most 400, and the strategies' base module not
    the largest of the package."""
    sizes = {module_name(path): len(path.read_text().splitlines()) for path in source_files()}
    methods = {name: size for name, size in sizes.items() if name.startswith("fedlora.strategies.")
               and name != "fedlora.strategies.base"}
    assert max(methods.values()) <= 350, sorted(methods.items(), key=lambda item: -item[1])[:3]
    assert sizes["fedlora.strategies.base"] <= 400, sizes["fedlora.strategies.base"]
    assert max(sizes, key=lambda name: sizes[name]) != "fedlora.strategies.base", sorted(
        sizes.items(), key=lambda item: -item[1])[:3]


def test_no_code_outside_a_strategy_class_reaches_a_private_member_of_a_strategy() -> None:
    """The reply pipeline and the secure round change a strategy through its public calls only
    (strategies/pipeline.py, strategies/secure_round.py): no ``strategy._x`` anywhere in the code."""
    # Prepare: every source file and the scripts beside it
    reached = []
    for path in [*source_files(), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        # Execute: an attribute whose name starts with '_' read from or written to a name 'strategy'
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "strategy"
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                reached.append(f"{path.relative_to(ROOT)}:{node.lineno} strategy.{node.attr}")
    # Assert
    assert not reached, reached

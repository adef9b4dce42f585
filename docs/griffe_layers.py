"""A griffe extension for the API reference (mkdocs.yml): the layers pyproject maps into fedlora.

The repository keeps ``strategies/``, ``clients/`` and ``simulations/`` at its top, and pyproject's
``[tool.setuptools.package-dir]`` installs them as ``fedlora.strategies``, ``fedlora.clients`` and
``fedlora.simulations``. mkdocstrings reads the code statically from the repository (griffe,
``paths: [.]``) and finds ``fedlora/`` there, not the mapped folders. Once griffe has loaded the
``fedlora`` package, this extension reads that mapping and loads each folder (with its subpackages)
as the submodule it names, so the reference documents ``fedlora.strategies.fedhera`` as installed
and the imports between the layers resolve. Nothing is imported and nothing is written.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import griffe


def package_dir(root: Path) -> dict[str, Path]:
    """pyproject's ``[tool.setuptools.package-dir]``: installed package -> its folder (``root``-based)."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    mapping = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("tool", {}).get("setuptools", {})
    return {name: root / folder for name, folder in mapping.get("package-dir", {}).items() if name}


class PackageDirLayers(griffe.Extension):
    """Attach the folders pyproject maps under a package to that package, when griffe loads it."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if not isinstance(pkg.filepath, Path) or pkg.filepath.name != "__init__.py":
            return
        root = pkg.filepath.parent.parent  # the repository: <root>/fedlora/__init__.py
        # sorted: a package before the packages mapped into it (fedlora.a before fedlora.a.b)
        for name, folder in sorted(package_dir(root).items()):
            parent_name, _, leaf = name.rpartition(".")
            if parent_name.split(".")[0] != pkg.name:
                continue
            if not (folder / "__init__.py").is_file():
                raise griffe.LoadingError(f"pyproject maps {name} to {folder}, which has no __init__.py")
            layer = self._load_folder(loader, leaf, folder, loader.modules_collection.get_member(parent_name))
            loader.expand_exports(layer)
            loader.expand_wildcards(layer, external=False)

    def _load_folder(self, loader: griffe.GriffeLoader, name: str, folder: Path, parent: griffe.Module) -> griffe.Module:
        package = self._visit(loader, name, folder / "__init__.py", parent)
        for path in sorted(folder.iterdir()):
            if path.is_dir() and (path / "__init__.py").is_file():
                self._load_folder(loader, path.name, path, package)
            elif path.suffix == ".py" and path.name != "__init__.py":
                self._visit(loader, path.stem, path, package)
        return package

    @staticmethod
    def _visit(loader: griffe.GriffeLoader, name: str, path: Path, parent: griffe.Module) -> griffe.Module:
        """Read one module statically, as griffe's loader does, and make it a member of ``parent``."""
        code = path.read_text(encoding="utf-8-sig")
        if loader.store_source:
            loader.lines_collection[path] = code.splitlines(keepends=False)
        module = griffe.visit(
            name,
            filepath=path,
            code=code,
            extensions=loader.extensions,
            parent=parent,
            docstring_parser=loader.docstring_parser,
            docstring_options=loader.docstring_options,
            lines_collection=loader.lines_collection,
            modules_collection=loader.modules_collection,
        )
        parent.set_member(name, module)
        return module

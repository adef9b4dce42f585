"""Option documentation generated from the options models: one source per fact.

A method's options are described once, in the ``Field(description=...)`` of its options model
(``fedlora/methods/<name>.py``). Two renderings are generated from those fields and kept in the
repository, so a reader of the docs or of the source sees them without running anything:

- the option table of the method in the docs: a marked region of any markdown file under ``docs/``
  (``<!-- options:fedhera -->`` ... ``<!-- /options -->``; docs/algorithms.md has one per method
  with options, a results page may repeat it), from :func:`markdown_table`;
- the ``Parameters`` section of the method's strategy docstring (``strategies/<name>.py``, the
  strategy's keyword options, numpydoc), from :func:`parameters_section`;
- the ``[tool.flwr.app.config.strategy]`` table of ``pyproject.toml``: every built-in method's
  option as a run-config key of ``flwr run .`` (Flower refuses an undeclared key), from
  :func:`flwr_strategy_table`.

``python -m fedlora.methods.docs`` lists what is out of step (exit 1 if anything is);
``python -m fedlora.methods.docs --write`` rewrites it. tests/test_docs_options.py fails while
anything is out of step. Only the files are read and written: nothing outside ``fedlora.methods``
is imported (the strategies' source is read as text).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo

from fedlora.methods.base import Method, MethodOptions

ROOT = Path(__file__).resolve().parents[2]  # the repository (docs/, strategies/)
REGION = re.compile(r"(<!-- options:(\w+) -->\n)(.*?)(<!-- /options -->)", re.DOTALL)
NO_OPTIONS = "(none beyond the experiment config)"
DOCSTRING_WIDTH = 106  # a docstring line, indentation included (ruff's limit is 110)
# A strategy module's class (LoRAStrategy or a subclass); a built-in method's declaration names it by reference
STRATEGY_CLASS = re.compile(r"^class \w+\(\w*Strategy\[[\w.]+\]\):\n", re.MULTILINE)
BUILT_IN_STRATEGY = re.compile(r"fedlora\.strategies\.(\w+):\w+")  # the reference -> strategies/<module>.py
PARAMETERS = re.compile(r"^(?P<indent> *)Parameters\n(?P=indent)-{10}\n(?P<body>.*?)(?=\n *\n)", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class OptionDoc:
    """One option as the docs show it."""

    name: str
    values: tuple[str, ...]  # a Literal's values; () for a number or a bool
    kind: str  # "str", "bool", "int", "float"
    bounds: str  # "", ">= 0", "in (0, 1]"
    optional: bool  # None is allowed (documented as unset)
    default: Any
    description: str


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounds(info: FieldInfo) -> str:
    """The field's numeric constraints: ``>= 0``, ``> 0``, ``in (0, 1]``, or ''."""
    low = high = ""
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            low = f"[{_number(item.ge)}"
        elif isinstance(item, annotated_types.Gt):
            low = f"({_number(item.gt)}"
        elif isinstance(item, annotated_types.Le):
            high = f"{_number(item.le)}]"
        elif isinstance(item, annotated_types.Lt):
            high = f"{_number(item.lt)})"
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
    if high:
        return f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    return ""


def option_docs(options: type[MethodOptions]) -> list[OptionDoc]:
    """Every field of ``options`` in declaration order; ValueError for a field without a
    description or with a type the docs cannot say (a Literal, bool, int, float, str, or one of
    them or None)."""
    docs = []
    for name, info in options.model_fields.items():
        if not (info.description or "").strip():
            raise ValueError(f"{options.__name__}.{name} has no description")
        annotation: Any = info.annotation
        optional = False
        if get_origin(annotation) in (Union, types.UnionType):
            inner = [a for a in get_args(annotation) if a is not type(None)]
            if len(inner) != 1:
                raise ValueError(f"{options.__name__}.{name}: cannot document the type {annotation}")
            annotation, optional = inner[0], True
        values: tuple[str, ...] = ()
        if get_origin(annotation) is Literal:
            values = tuple(str(v) for v in get_args(annotation))
            kind = "str"
        elif annotation in (bool, int, float, str):
            kind = annotation.__name__
        else:
            raise ValueError(f"{options.__name__}.{name}: cannot document the type {annotation}")
        docs.append(OptionDoc(name, values, kind, _bounds(info), optional, info.default,
                              " ".join(str(info.description).split())))
    return docs


# ------------------------------------------------------------------------------------- markdown
def _md_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _md_values(option: OptionDoc) -> str:
    if option.values:
        text = ", ".join(f"`{v}`" for v in option.values)
    else:
        text = " ".join(part for part in (option.kind, option.bounds) if part)
    return f"{text} or unset" if option.optional else text


def markdown_table(method: Method[Any]) -> str:
    """The option table of ``method`` (markdown; empty for a method without options)."""
    rows = [
        f"| `strategy.{o.name}` | {_md_values(o)} | {_md_value(o.default)} | {o.description.replace('|', chr(92) + '|')} |"
        for o in option_docs(method.options)
    ]
    if not rows:
        return ""
    return "\n".join(["| option | values | default | meaning |", "|---|---|---|---|", *rows]) + "\n"


def sync_markdown(text: str, tables: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with every options region rewritten from ``tables`` (method name -> table), and
    the names of the regions that changed; KeyError for a region naming an unknown method."""
    changed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in tables:
            raise KeyError(f"<!-- options:{name} -->: no method '{name}' with options")
        if match.group(3) != tables[name]:
            changed.append(name)
        return f"{match.group(1)}{tables[name]}{match.group(4)}"

    return REGION.sub(replace, text), changed


def regions(text: str) -> list[str]:
    """The method names of the options regions in ``text``, in order."""
    return [match.group(2) for match in REGION.finditer(text)]


# ------------------------------------------------------------------------------------ docstring
def _py_kind(option: OptionDoc) -> str:
    if option.values:
        text = "{" + ", ".join(repr(v) for v in option.values) + "}"
    else:
        text = " ".join(part for part in (option.kind, option.bounds) if part)
    return f"{text} or None" if option.optional else text


def parameters_section(method: Method[Any], indent: str = "") -> str:
    """The numpydoc ``Parameters`` section of ``method``'s strategy (its keyword options), each
    line starting with ``indent``; a method without options says so."""
    lines = [f"{indent}Parameters", f"{indent}----------"]
    options = option_docs(method.options)
    if not options:
        lines.append(f"{indent}{NO_OPTIONS}")
    wrap = textwrap.TextWrapper(width=DOCSTRING_WIDTH, initial_indent=indent + "    ",
                                subsequent_indent=indent + "    ", break_on_hyphens=False)
    for option in options:
        lines.append(f"{indent}{option.name} : {_py_kind(option)}, default {option.default!r}")
        lines.extend(wrap.wrap(option.description))
    return "\n".join(lines)


def sync_strategy_source(text: str, method: Method[Any]) -> str:
    """A strategy module's source with its class docstring's ``Parameters`` section (up to the
    first blank line) generated from ``method``; ValueError if the class or section is missing."""
    found = STRATEGY_CLASS.search(text)
    if found is None:
        raise ValueError(f"no `class ...(LoRAStrategy[...])` (or a subclass) for method '{method.name}'")
    section = PARAMETERS.search(text, found.end())
    if section is None:
        raise ValueError(f"the strategy of '{method.name}' has no 'Parameters' section in its docstring")
    generated = parameters_section(method, section.group("indent"))
    return text[: section.start()] + generated + text[section.end():]


# ----------------------------------------------------------------------------------- the files
# ------------------------------------------------------------------------------------- pyproject
FLWR_STRATEGY = re.compile(r"^\[tool\.flwr\.app\.config\.strategy\]\n(?:[^\n\[]+\n)*", re.MULTILINE)


def flwr_strategy_table(declared: list[Method[Any]]) -> str:
    """pyproject's ``[tool.flwr.app.config.strategy]``: ``name`` and every option of ``declared``, each
    "" (= the config's own value), sorted."""
    keys = sorted({option.name for method in declared for option in option_docs(method.options)})
    return "[tool.flwr.app.config.strategy]\n" + "".join(f'{key} = ""\n' for key in ["name", *keys])


def _methods() -> dict[str, Method[Any]]:
    from fedlora.methods import method, method_names

    return {name: method(name) for name in method_names()}


def _built_in_names() -> list[str]:
    from fedlora.methods import built_in_names

    return built_in_names()


def _sync_pyproject(root: Path, declared: list[Method[Any]], write: bool) -> list[str]:
    """pyproject.toml's Flower table of the options (:func:`flwr_strategy_table`), if out of step."""
    path = root / "pyproject.toml"
    if not path.is_file():
        return []  # a partial copy of the repository (``--root``)
    text = path.read_text()
    found = FLWR_STRATEGY.search(text)
    fresh = flwr_strategy_table(declared)
    if found is None:
        return ["pyproject.toml: no [tool.flwr.app.config.strategy] table"]
    if found.group(0) == fresh:
        return []
    if write:
        path.write_text(text[: found.start()] + fresh + text[found.end():])
    return ["pyproject.toml: [tool.flwr.app.config.strategy], the methods' options as flwr run-config keys"]


def drift(root: Path = ROOT, write: bool = False) -> list[str]:
    """What is out of step with the options models under ``root`` (one line each): an options
    region in ``docs/**/*.md``, a strategy's ``Parameters`` section, or a method with options whose
    table is not in docs/algorithms.md. ``write``: rewrite the regions and sections."""
    methods = _methods()
    tables = {name: markdown_table(m) for name, m in methods.items() if m.options.model_fields}
    problems = []
    for path in sorted((root / "docs").rglob("*.md")):
        text = path.read_text()
        new, changed = sync_markdown(text, tables)
        problems += [f"{path.relative_to(root)}: the options table of '{name}'" for name in changed]
        if write and new != text:
            path.write_text(new)
    listed = regions((root / "docs" / "algorithms.md").read_text())
    problems += [f"docs/algorithms.md: no <!-- options:{name} --> region" for name in tables if name not in listed]
    problems += _sync_pyproject(root, [methods[name] for name in _built_in_names()], write)
    for declared in methods.values():
        found = BUILT_IN_STRATEGY.fullmatch(declared.strategy) if isinstance(declared.strategy, str) else None
        if found is None:
            continue  # a method declared outside fedlora: its strategy's source is not this repository's
        path = root / "strategies" / f"{found.group(1)}.py"
        if not path.is_file():
            continue  # a partial copy of the repository (``--root``)
        text = path.read_text()
        new = sync_strategy_source(text, declared)
        if new != text:
            problems.append(f"{path.relative_to(root)}: the Parameters section of its docstring")
            if write:
                path.write_text(new)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedlora.methods.docs", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the option tables and Parameters sections")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this checkout)")
    args = parser.parse_args(argv)
    problems = drift(args.root, write=args.write)
    for line in problems:
        print(f"{'rewritten' if args.write else 'out of step'}: {line}")
    missing = [line for line in problems if "no <!-- options:" in line]
    return 1 if (missing if args.write else problems) else 0


if __name__ == "__main__":
    sys.exit(main())

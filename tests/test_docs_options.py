"""The option tables of the per-method result pages match the methods' options models.

Each page names its method (``strategy.name = "<name>"``) and documents its options in markdown
rows ``| `strategy.a`, `b` | `1.0`, `false` | meaning |``: the first cell lists option names (the
``strategy.`` prefix on the first), the second as many defaults in the same order. A default may
carry a parenthetical explanation (``unset (r // 2)``); an option whose code default is ``None``
is documented as ``unset``. Every documented default must equal the ``Field`` default of the
method's options class, and every field of that class must be in the table, once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fedlora.methods import method

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
PAGES = ["fedhera.md", "fedpissa.md", "feddr_lora.md", "fedtreelora.md"]
NAME_LINE = re.compile(r'`strategy\.name = "(\w+)"`')


def split_top_level(cell: str) -> list[str]:
    """``cell`` split at the commas outside backticks and parentheses, each part stripped."""
    parts, current, depth, in_code = [], "", 0, False
    for char in cell:
        if char == "`":
            in_code = not in_code
        elif not in_code and char == "(":
            depth += 1
        elif not in_code and char == ")":
            depth -= 1
        if char == "," and depth == 0 and not in_code:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return parts


def option_rows(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(option name, documented default) of every table row whose first cell names ``strategy.<x>``,
    and the rows whose number of defaults differs from their number of names."""
    rows, malformed = [], []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`strategy."):
            continue
        names = [n.strip("` ").removeprefix("strategy.") for n in split_top_level(cells[0])]
        defaults = split_top_level(cells[1])
        if len(names) != len(defaults):
            malformed.append(line)
        rows.extend(zip(names, defaults))
    return rows, malformed


def normalise_doc(value: str) -> Any:
    """A documented default as a comparable value: float for numbers, lower-case words otherwise."""
    value = re.sub(r"\s*\(.*\)\s*$", "", value).strip().strip("`").strip().strip("'\"")
    try:
        return float(value)
    except ValueError:
        return value.lower() if value.lower() in ("true", "false", "unset") else value


def normalise_code(value: Any) -> Any:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return float(value)
    return str(value)


def page_method(page: str) -> tuple[str, dict[str, Any]]:
    text = (RESULTS / page).read_text()
    found = NAME_LINE.search(text)
    assert found, f"{page} does not name its strategy (`strategy.name = \"...\"`)"
    options = method(found.group(1)).options
    return text, {name: info.default for name, info in options.model_fields.items()}


@pytest.mark.parametrize("page", PAGES)
def test_documented_defaults_match_the_code(page: str) -> None:
    text, defaults = page_method(page)
    rows, malformed = option_rows(text)
    problems = [f"defaults do not pair with the options: {line}" for line in malformed]
    problems += [f"unknown option '{name}'" for name, _ in rows if name not in defaults]
    problems += [
        f"'{name}': documented {documented}, code default {defaults[name]!r}"
        for name, documented in rows
        if name in defaults and normalise_doc(documented) != normalise_code(defaults[name])
    ]
    assert not problems, f"{page}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_every_option_is_documented_once(page: str) -> None:
    text, defaults = page_method(page)
    names = [name for name, _ in option_rows(text)[0]]
    missing = sorted(set(defaults) - set(names))
    assert not missing, f"{page}: options missing from the option table: {missing}"
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"{page}: options documented more than once: {repeated}"


def test_option_rows_parse_lists_and_explanations() -> None:
    table = "| `strategy.atw`, `atw_horizon` | `true`, `2.0` | x |\n| `strategy.d` | unset (r // 2) | y |"
    rows, malformed = option_rows(table)
    assert not malformed and rows == [("atw", "`true`"), ("atw_horizon", "`2.0`"), ("d", "unset (r // 2)")]
    assert [normalise_doc(d) for _, d in rows] == ["true", 2.0, "unset"]
    assert normalise_code(True) == "true" and normalise_code(2) == 2.0 and normalise_code(None) == "unset"
    assert normalise_doc("`push`") == normalise_code("push")
    assert option_rows("| `strategy.a`, `b` | `1.0` | z |")[1], "two names with one default must be flagged"

"""Options are described once, in their pydantic fields; the docs' option tables and the strategies'
``Parameters`` sections are generated from them (``python -m fedlora.methods.docs --write``) and
must stay in step: a changed description, default, bound or option fails here until regenerated."""

from __future__ import annotations

import inspect
import shutil
import textwrap
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from fedlora.methods import Capabilities, Method, MethodOptions, method, method_names
from fedlora.methods.docs import drift, main, markdown_table, option_docs, parameters_section, regions
from fedlora.strategies.registry import strategy_class, strategy_names

ROOT = Path(__file__).resolve().parents[1]


class HandOptions(MethodOptions):
    mode: Literal["a", "b"] = Field("a", description="Which | way.")
    rate: float = Field(0.5, gt=0.0, le=1.0, description="A rate,   with  spaces.")
    cut: int | None = Field(None, ge=1, description="A cut; unset = none.")
    on: bool = Field(False, description="A switch.")


HAND = Method(name="hand", options=HandOptions, capabilities=Capabilities(personalized=False, uploads="", downloads=""),
              strategy="fedlora.strategies.fedit:FedIT")


def test_the_table_and_the_parameters_of_a_hand_made_options_model() -> None:
    # Execute
    table, parameters = markdown_table(HAND), parameters_section(HAND, "    ")
    # Assert: by hand (a '|' in a description is escaped, whitespace folded, bounds and unset said)
    assert table == (
        "| option | values | default | meaning |\n"
        "|---|---|---|---|\n"
        "| `strategy.mode` | `a`, `b` | `a` | Which \\| way. |\n"
        "| `strategy.rate` | float in (0, 1] | `0.5` | A rate, with spaces. |\n"
        "| `strategy.cut` | int >= 1 or unset | unset | A cut; unset = none. |\n"
        "| `strategy.on` | bool | `false` | A switch. |\n"
    )
    assert parameters == (
        "    Parameters\n"
        "    ----------\n"
        "    mode : {'a', 'b'}, default 'a'\n"
        "        Which | way.\n"
        "    rate : float in (0, 1], default 0.5\n"
        "        A rate, with spaces.\n"
        "    cut : int >= 1 or None, default None\n"
        "        A cut; unset = none.\n"
        "    on : bool, default False\n"
        "        A switch."
    )


def test_an_option_without_a_description_is_refused() -> None:
    class Bare(MethodOptions):
        knob: int = 1

    with pytest.raises(ValueError, match="Bare.knob has no description"):
        option_docs(Bare)


def test_every_registered_strategy_docstring_carries_its_generated_parameters() -> None:
    # Every strategy of the registry (not only those the generator's file scan finds)
    for name in strategy_names():
        cls = strategy_class(name)
        generated = textwrap.dedent(parameters_section(cls.method, "    "))  # as wrapped in a class docstring
        assert f"\n{generated}\n\n" in inspect.getdoc(cls), name


def test_every_method_with_options_has_its_table_in_algorithms_md() -> None:
    listed = regions((ROOT / "docs" / "algorithms.md").read_text())
    with_options = [name for name in method_names() if method(name).options.model_fields]
    assert sorted(listed) == sorted(with_options)  # each once, none for a method without options


def test_docs_and_docstrings_are_in_step_with_the_options_models() -> None:
    assert drift(ROOT) == [], "run `python -m fedlora.methods.docs --write`"


def test_a_drifted_table_or_docstring_is_found_and_rewritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a copy of the docs and strategies with a hand-edited fedhera row and docstring
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png", "*.csv", "img"))
    (tmp_path / "strategies").mkdir(parents=True)
    shutil.copy(ROOT / "strategies" / "fedhera.py", tmp_path / "strategies" / "fedhera.py")
    page, source = tmp_path / "docs" / "results" / "fedhera.md", tmp_path / "strategies" / "fedhera.py"
    page.write_text(page.read_text().replace("| `strategy.coupled` | bool | `false` |", "| `strategy.coupled` | bool | `true` |"))
    source.write_text(source.read_text().replace("coupled : bool, default False", "coupled : bool, default True"))
    # Execute / Assert: reported (exit 1), then rewritten to the repository's text
    assert main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "docs/results/fedhera.md: the options table of 'fedhera'" in out
    assert "strategies/fedhera.py: the Parameters section" in out
    assert main(["--root", str(tmp_path), "--write"]) == 0
    assert page.read_text() == (ROOT / "docs" / "results" / "fedhera.md").read_text()
    assert source.read_text() == (ROOT / "strategies" / "fedhera.py").read_text()
    assert drift(tmp_path) == []


def test_pyprojects_flower_strategy_keys_are_generated_from_the_methods_options(tmp_path: Path) -> None:
    # Prepare: a copy of the docs and pyproject.toml with one method option missing from Flower's table
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png", "*.csv", "img"))
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text((ROOT / "pyproject.toml").read_text().replace('warmup_rounds = ""\n', ""))
    # Execute / Assert: found, then rewritten to the repository's file, which has every option once
    assert drift(tmp_path) == [("pyproject.toml: [tool.flwr.app.config.strategy], the methods' options as flwr "
                               "run-config keys")]
    assert drift(tmp_path, write=True) and drift(tmp_path) == []
    assert pyproject.read_text() == (ROOT / "pyproject.toml").read_text()
    table = (ROOT / "pyproject.toml").read_text().split("[tool.flwr.app.config.strategy]\n")[1].split("\n\n")[0]
    keys = [line.split(" = ")[0] for line in table.splitlines()]
    assert keys[0] == "name" and keys[1:] == sorted({key for name in method_names()
                                                     for key in method(name).options.model_fields})

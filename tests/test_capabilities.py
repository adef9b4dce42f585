"""The README's capability matrix is generated from the strategies' declarations and current."""

from __future__ import annotations

from pathlib import Path

from fedlora.app.capabilities import readme_block, render_matrix
from strategies.registry import strategy_names

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_capability_matrix_is_current() -> None:
    block = readme_block(README.read_text())
    assert block is not None, "README.md lacks the capability matrix markers"
    assert block == render_matrix(), "README capability matrix is stale: run `fedlora capabilities --write`"


def test_matrix_lists_every_registered_strategy() -> None:
    matrix = render_matrix()
    for name in strategy_names():
        assert f"| `{name}` |" in matrix

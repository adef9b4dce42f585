"""The README's capability matrix is generated from the strategies' declarations and current."""

from __future__ import annotations

from pathlib import Path

from fedlora.app.capabilities import (
    FL_OPTIMISERS_END,
    FL_OPTIMISERS_START,
    FLOWER_DP_END,
    FLOWER_DP_START,
    SECURE_END,
    SECURE_START,
    deployment_tested,
    readme_block,
    render_fl_optimisers,
    render_flower_dp,
    render_matrix,
    render_secure,
)
from fedlora.strategies.registry import strategy_names

README = Path(__file__).resolve().parents[1] / "README.md"
FLOWER_DOC = README.parent / "docs" / "flower.md"
SECURE_DOC = README.parent / "docs" / "secure-aggregation.md"
STRATEGIES_DOC = README.parent / "docs" / "strategies.md"


def test_readme_capability_matrix_is_current() -> None:
    block = readme_block(README.read_text())
    assert block is not None, "README.md lacks the capability matrix markers"
    assert block == render_matrix(), "README capability matrix is stale: run `fedlora capabilities --write`"


def test_flower_docs_flower_dp_table_is_current() -> None:
    block = readme_block(FLOWER_DOC.read_text(), FLOWER_DP_START, FLOWER_DP_END)
    assert block is not None, "docs/flower.md lacks the Flower DP table markers"
    assert block == render_flower_dp(), "docs/flower.md's Flower DP table is stale: run `fedlora capabilities --write`"


def test_secure_aggregation_docs_table_is_current() -> None:
    block = readme_block(SECURE_DOC.read_text(), SECURE_START, SECURE_END)
    assert block is not None, "docs/secure-aggregation.md lacks the table markers"
    assert block == render_secure(), "docs/secure-aggregation.md's table is stale: run `fedlora capabilities --write`"


def test_strategies_docs_server_optimiser_and_fedprox_table_is_current() -> None:
    block = readme_block(STRATEGIES_DOC.read_text(), FL_OPTIMISERS_START, FL_OPTIMISERS_END)
    assert block is not None, "docs/strategies.md lacks the server optimiser / FedProx table markers"
    assert block == render_fl_optimisers(), "docs/strategies.md's table is stale: run `fedlora capabilities --write`"


def test_a_method_that_refuses_a_server_optimiser_or_fedprox_says_why() -> None:
    from fedlora.methods import method

    for name in strategy_names():
        caps = method(name).capabilities
        assert caps.server_optimizer or caps.not_server_optimizer, name
        assert caps.proximal or caps.not_proximal, name


def test_matrix_lists_every_registered_strategy() -> None:
    matrix = render_matrix()
    for name in strategy_names():
        assert f"| `{name}` |" in matrix


def test_deployment_column_claims_the_built_in_strategies_and_not_a_method_registered_elsewhere() -> None:
    from fedlora import methods
    from fedlora.strategies.fedit import FedIT

    # Prepare: a method declared outside fedlora (registered in this process)
    class Elsewhere(FedIT):
        pass

    methods.register(methods.Method(name="elsewhere", options=methods.NoOptions, strategy=Elsewhere,
                                    capabilities=methods.Capabilities(personalized=False, uploads="", downloads="")))
    try:
        # Execute
        tested, names, matrix = deployment_tested(), strategy_names(), render_matrix()
    finally:
        methods.forget()
    # Assert: every module of fedlora/methods is claimed (tests/test_deploy_strategies.py runs each), the other not
    homes = sorted(p.stem for p in (README.parent / "fedlora" / "methods").glob("*.py")) 
    assert tested == [name for name in homes if name not in ("__init__", "base", "docs")]
    assert "elsewhere" in names and "elsewhere" not in tested
    row = next(line for line in matrix.splitlines() if line.startswith("| `elsewhere` |")).split(" | ")
    assert row[-2] == "no" and all(
        line.split(" | ")[-2] == "yes" for line in matrix.splitlines() if line.startswith("| `fedit` |"))

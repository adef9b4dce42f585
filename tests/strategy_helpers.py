"""The strategies a test runs, from the registry, and the options a short test run needs.

A test that covers "every strategy" takes the names from the registry
(:func:`strategies.registry.strategy_names`), so a new method is tested without editing a list.
A method whose defaults need more rounds than a test runs gets its options from
:data:`SHORT_RUN_OPTIONS`, the one place they are written; tests/test_method_configs.py checks that
every registered method validates a :data:`SHORT_RUN_ROUNDS`-round smoke run with them, and that
none of them is superfluous.
"""

from __future__ import annotations

from typing import Any

# FedTreeLoRA builds its tree after `warmup_rounds` (default 3), which must end before the last round.
SHORT_RUN_OPTIONS: dict[str, dict[str, Any]] = {"fedtreelora": {"warmup_rounds": 1}}
SHORT_RUN_ROUNDS = 2  # the fewest rounds these options are checked for (configs/smoke.toml runs 2)


def short_run_options(name: str) -> dict[str, Any]:
    """``name``'s short-run options as keywords (a strategy built from keywords)."""
    return dict(SHORT_RUN_OPTIONS.get(name, {}))


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def short_run_overrides(name: str) -> list[str]:
    """``name``'s short-run options as ``strategy.<key>=<value>`` overrides."""
    return [f"strategy.{key}={_literal(value)}" for key, value in SHORT_RUN_OPTIONS.get(name, {}).items()]


def short_run_override_map() -> dict[str, list[str]]:
    """Strategy name -> its short-run overrides, for the methods that need any
    (``compare(strategy_overrides=...)``, the notebook's ``STRATEGY_OPTIONS``)."""
    return {name: short_run_overrides(name) for name in sorted(SHORT_RUN_OPTIONS)}

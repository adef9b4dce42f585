"""The strategies a test runs, from the registry, and the options a short test run needs.

A test that covers "every strategy" takes the names from the registry
(:func:`fedlora.strategies.registry.strategy_names`), so a new method is tested without editing a list.
A method whose defaults need more rounds than a test runs gets its options from
:data:`SHORT_RUN_OPTIONS`, the one place they are written; tests/test_method_configs.py checks that
every registered method validates a :data:`SHORT_RUN_ROUNDS`-round smoke run with them, and that
none of them is superfluous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

SMOKE = Path(__file__).resolve().parents[1] / "configs/smoke.toml"
# configs/smoke.toml as keywords (its output.dir aside), for strategies built from keywords
SMOKE_SETTINGS: dict[str, Any] = {
    "model": {"path": "tiny-bert", "lora_rank": 4, "lora_alpha": 8},
    "data": {"source": "wordnet", "task": "noun8", "max_examples": 600, "num_clients": 3, "partition": "dirichlet",
             "dirichlet_alpha": 0.5, "global_test_size": 100},
    "train": {"rounds": 2, "local_epochs": 1, "max_steps": 5, "batch_size": 16, "lr": 1e-3, "max_length": 32},
    "federation": {"min_clients": 1},
    "clients": {"ranks": [2, 4, 8]},
}

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


def small_strategy(cls: type, ranks: Sequence[int], overrides: Sequence[str] = (),
                   initial_A: Callable[[int], np.ndarray] = lambda rank: np.full((rank, 5), 0.5, np.float32)) -> Any:
    """``cls`` on configs/smoke.toml (plus ``overrides``) over one hand-made module m (d_out 6, d_in 5)
    and a 2 x 6 head, its clients' profiles set to ``ranks``: the initial adapter at rank r is
    ``initial_A(r)``, B = 0 and a zero head."""
    from fedlora.config import load_config

    config = load_config(SMOKE, [f"strategy.name={cls.name}", *overrides])

    def initial(rank: int) -> dict[str, np.ndarray]:
        return {"m::A": initial_A(rank), "m::B": np.zeros((6, rank), np.float32),
                "head::classifier.weight": np.zeros((2, 6), np.float32)}

    strategy = cls(config, initial, {"m": (6, 5)})
    strategy.roster.profiles = {k: SimpleNamespace(partition_id=k, rank=r, num_train_examples=0) for k, r in enumerate(ranks)}
    strategy.roster.node_of = {k: 100 + k for k in strategy.roster.profiles}
    strategy.setup()
    return strategy


def renumber_nodes(grid: Any, id_offset: int) -> Any:
    """``grid`` with its nodes' contexts re-keyed from ``id_offset`` (fresh states): a restarted
    federation's SuperNodes come back under new node ids."""
    from flwr.app import Context, RecordDict

    grid.contexts = {id_offset + i: Context(run_id=1, node_id=id_offset + i, node_config=dict(c.node_config),
                                            state=RecordDict(), run_config={})
                     for i, c in enumerate(grid.contexts.values())}
    return grid

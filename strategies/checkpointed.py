"""What a strategy's checkpoint saves and a resumed run restores: the state tuples of
:class:`~fedlora.strategies.base.LoRAStrategy` and the two calls that read and write them.

A method adds its own (``STATE = (*LoRAStrategy.STATE, "global_adapter")``); tests/test_architecture.py
checks that every attribute a strategy assigns is declared in ``STATE`` or ``NOT_STATE``. Per-client
entries are keyed by partition id, so a resumed run's new node ids do not matter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class Checkpointed:
    """The declared state of a strategy (a base of :class:`~fedlora.strategies.base.LoRAStrategy`)."""

    # What the strategy has learned and counted so far: the round records and their clocks, the
    # privacy ledger, the client sampler, the failure count, the rank a same-rank method settled, the
    # update-ratio reference, the anomaly rule's history, the clients a secure round left out and
    # the masked vectors it summed, the server optimiser's moments.
    STATE: ClassVar[tuple[str, ...]] = ("records", "started", "ledger", "rng", "failed_rounds", "common_rank",
                                        "norm_reference", "update_history", "excluded", "masked_digests",
                                        "server_moments")
    # Attributes an older fedlora checkpointed for the method and this one no longer keeps (what a
    # download's context now carries): a resume drops them (fedlora.checkpoint.check_strategy_state).
    RETIRED_STATE: ClassVar[frozenset[str]] = frozenset()
    # Attributes rebuilt on every run (from the config, the models and the query), never checkpointed;
    # ``cpu_started`` holds this process's CPU clock at each round's start, which means nothing in another.
    NOT_STATE: ClassVar[frozenset[str]] = frozenset({
        "experiment", "options", "initial_adapter", "module_shapes", "roster", "paths", "_experiment_json",
        "_sent", "_initial_norm", "min_evaluate_nodes", "min_available_nodes", "secure_round", "cpu_started",
    })

    def state_dict(self) -> dict[str, Any]:
        """What the strategy learned: the attributes :attr:`STATE` declares, those set so far."""
        return {key: getattr(self, key) for key in self.STATE if hasattr(self, key)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` after this run's query."""
        for key, value in state.items():
            setattr(self, key, value)

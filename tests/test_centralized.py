"""The centralised reference: one trainer on the pooled data, evaluated on every client's split."""

from __future__ import annotations

from pathlib import Path

import pytest
from result_checks import assert_accuracies_add_up

from fedlora.app.runner import run_inprocess
from fedlora.config import load_config

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]


def test_centralized_trains_one_node_with_the_federation_step_budget(tmp_path: Path) -> None:
    # Prepare: 3 clients, each would take 5 steps per round -> the reference takes 15
    # with federation.min_clients = 2, which counts federated clients, not the one reference trainer
    config = load_config(ROOT / "configs/smoke.toml", ["strategy.name=centralized", "federation.min_clients=2"])
    # Execute
    writer = run_inprocess(config, tmp_path)
    # Assert: one trainer per round, 15 x 16 examples, every client evaluated the model
    for record in writer.rounds:
        assert record.clients == 1
        assert record.train_examples == 3 * 5 * 16
        assert len(record.per_client) == 3
    # the trained model's scores: counts over the 100 global and each client's local test examples
    results = writer.to_dict()
    assert results["final"]["round"] == 2
    for record in results["rounds"]:
        assert_accuracies_add_up(record, config.data.global_test_size)

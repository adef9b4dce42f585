"""Poisoning within the norm bounds is seen, every round (strategies/anomaly.py; issue 40 item 3).

Three fedit clients of rank 4 on the tiny random BERT of configs/smoke.toml, without training: an
in-process grid answers the profile query, the training replies are made here. An honest client's
update is a round's common direction plus its own noise, small beside the adapter itself, so the
attacks below all pass the norm bounds (``faults.max_update_ratio``, ``norm_outlier_factor``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from test_hostile_clients import connected, partition, reply

from fedlora.simulations.inprocess import InProcessGrid
from fedlora.strategies.anomaly import UPDATE_COSINE, UPDATE_DUPLICATE_OF, UPDATE_NORM
from fedlora.strategies.base import LoRAStrategy

ROOT = Path(__file__).resolve().parents[1]
Payload = dict[str, np.ndarray]
OFF = ("faults.anomaly_norm_factor=0", "faults.anomaly_min_cosine=-1", "faults.duplicate_rounds=0")


def three_clients(overrides: tuple[str, ...] = ()) -> tuple[LoRAStrategy, InProcessGrid]:
    nodes = [{"partition-id": k, "rank": 4} for k in range(3)]
    return connected("fedit", ("clients.ranks=[4, 4, 4]", *overrides), nodes)


def _benchmark() -> Any:
    """benchmarks/poisoning.py as a module (by path: it is not a package)."""
    import importlib.util
    import sys

    if "fedlora_benchmark_poisoning" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "fedlora_benchmark_poisoning", Path(__file__).resolve().parents[1] / "benchmarks" / "poisoning.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["fedlora_benchmark_poisoning"]


def honest_change(download: Payload, k: int, server_round: int) -> Payload:
    """The round's common direction (every client agrees on it) plus the client's own noise: the
    benchmark's honest client, so the tests and the robustness table measure the same clients."""
    change: Payload = _benchmark().honest_change(download, k, server_round)
    return change


def poisoned_round(strategy: LoRAStrategy, grid: InProcessGrid, server_round: int,
                   attack: dict[int, Any] | None = None, earlier: dict[int, Payload] | None = None) -> dict[int, Payload]:
    """One training round; client k's upload is ``attack[k]``: a number (its change scaled by it),
    'replay' (its upload of the ``earlier`` round) or 'copy' (client 0's upload of this round)."""
    attack, earlier = attack or {}, earlier or {}
    messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
    uploads: dict[int, Payload] = {}
    for msg in sorted(messages, key=partition):
        k = partition(msg)
        download = {key: array.numpy() for key, array in msg.content.array_records["arrays"].items()}
        scale = attack.get(k, 1.0) if not isinstance(attack.get(k), str) else 1.0
        change = honest_change(download, k, server_round)
        uploads[k] = {key: (value + scale * change[key]).astype(np.float32) for key, value in download.items()}
        if attack.get(k) == "replay":
            uploads[k] = earlier[k]
        if attack.get(k) == "copy":
            uploads[k] = uploads[0]
    replies = [reply(msg, uploads[partition(msg)], {"num-examples": 100, "partition-id": partition(msg),
                                                    "train-loss": 1.0}) for msg in messages]
    strategy.aggregate_train(server_round, replies)
    return uploads


def flagged(strategy: LoRAStrategy, server_round: int) -> list[str]:
    return strategy.record(server_round).anomalies


def test_an_update_replayed_from_the_previous_round_is_flagged() -> None:
    # Prepare
    strategy, grid = three_clients()
    first = poisoned_round(strategy, grid, 1)
    # Execute: round 2, client 1 sends its round-1 upload again
    poisoned_round(strategy, grid, 2, {1: "replay"}, first)
    # Assert: flagged (one line naming client 1), aggregated (the default only logs), the others not flagged
    assert flagged(strategy, 1) == []
    (line,) = flagged(strategy, 2)
    assert line.startswith("client 1 (node 1001): ") and "identical to its own update of round 1" in line
    record = strategy.record(2)
    assert record.per_client_train["1"][UPDATE_DUPLICATE_OF] == "client 1 round 1"
    assert record.per_client_train["0"][UPDATE_DUPLICATE_OF] == "" and record.rejected == 0 and record.clients == 3


def test_an_update_copied_from_another_client_is_flagged() -> None:
    # Prepare
    strategy, grid = three_clients()
    # Execute: client 2 uploads client 0's upload of the same round
    poisoned_round(strategy, grid, 1, {2: "copy"})
    # Assert
    (line,) = flagged(strategy, 1)
    assert line.startswith("client 2 (node 1002): ") and "identical to client 0's update of this round" in line
    assert strategy.record(1).per_client_train["2"][UPDATE_DUPLICATE_OF] == "client 0 round 1"


def test_an_update_copied_from_another_clients_earlier_round_is_flagged() -> None:
    strategy, grid = three_clients()
    first = poisoned_round(strategy, grid, 1)
    poisoned_round(strategy, grid, 2, {2: "replay"}, {2: first[0]})  # client 2 sends client 0's round-1 upload
    (line,) = flagged(strategy, 2)
    assert "identical to client 0's update of round 1" in line


def test_a_client_scaling_its_update_by_5_is_flagged_and_the_model_is_the_same_as_without_detection() -> None:
    # Prepare: a twin with every anomaly rule off
    strategy, grid = three_clients()
    twin, twin_grid = three_clients(OFF)
    # Execute
    poisoned_round(strategy, grid, 1, {1: 5.0})
    poisoned_round(twin, twin_grid, 1, {1: 5.0})
    # Assert: the bounds let it through; the rule flags it; detection (log) moves nothing
    (line,) = flagged(strategy, 1)
    assert line.startswith("client 1 (node 1001): ") and "faults.anomaly_norm_factor" in line
    record = strategy.record(1)
    assert record.rejected == 0 and record.clients == 3 and twin.record(1).anomalies == []
    assert record.per_client_train["1"][UPDATE_NORM] > 4 * record.per_client_train["0"][UPDATE_NORM]
    for key, value in strategy.global_payload().items():
        np.testing.assert_array_equal(value, twin.global_payload()[key])


def test_with_anomaly_action_reject_a_client_scaling_its_update_by_5_is_refused() -> None:
    # Prepare
    strategy, grid = three_clients(("faults.anomaly_action=reject",))
    # Execute
    uploads = poisoned_round(strategy, grid, 1, {1: 5.0})
    # Assert: refused like a malformed update, the aggregate is the two honest clients' mean
    record = strategy.record(1)
    assert record.rejected == 1 and record.failures == 1 and record.clients == 2
    assert "client 1 (node 1001)" in record.rejections[0] and "anomalous update" in record.rejections[0]
    for key, value in strategy.global_payload().items():
        expected = (uploads[0][key].astype(np.float64) + uploads[2][key]) / 2
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)


def test_a_sign_flip_shows_a_negative_cosine_and_is_flagged() -> None:
    # Prepare
    strategy, grid = three_clients()
    # Execute
    poisoned_round(strategy, grid, 1, {2: -1.0})
    # Assert
    entries = strategy.record(1).per_client_train
    assert entries["2"][UPDATE_COSINE] < 0 < min(entries["0"][UPDATE_COSINE], entries["1"][UPDATE_COSINE])
    (line,) = flagged(strategy, 1)
    assert line.startswith("client 2 (node 1002): ") and "faults.anomaly_min_cosine" in line


def test_honest_clients_are_measured_and_never_flagged() -> None:
    strategy, grid = three_clients()
    for server_round in (1, 2, 3):
        poisoned_round(strategy, grid, server_round)
        record = strategy.record(server_round)
        assert record.anomalies == []
        assert all(record.per_client_train[str(k)][UPDATE_COSINE] > 0.5 for k in range(3))
    assert len(strategy.update_history) == 9  # faults.duplicate_rounds = 3 rounds of 3 uploads


@pytest.mark.e2e
def test_the_anomaly_rule_does_not_fire_on_a_clean_two_round_smoke_run(tmp_path: Path) -> None:
    # Prepare: configs/smoke.toml (tiny BERT, 3 clients of mixed ranks, real local training), in process
    import fedlora

    # Execute
    fedlora.run(ROOT / "configs/smoke.toml", ["output.save_adapters=false", "output.tensorboard=false"],
                out_dir=tmp_path / "run", engine="inprocess")
    # Assert: every upload measured, none flagged
    rounds = json.loads((tmp_path / "run" / "results.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for record in rounds:
        assert record["anomalies"] == [] and record["rejected"] == 0
        assert record["per_client_train"] and all(entry[UPDATE_NORM] > 0 for entry in record["per_client_train"].values())


@pytest.mark.parametrize("option", ["faults.anomaly_action=drop", "faults.anomaly_min_cosine=2",
                                    "faults.duplicate_rounds=-1", "faults.anomaly_norm_factor=-1"])
def test_bad_anomaly_options_are_config_errors(option: str) -> None:
    from fedlora.config import ConfigError, load_config

    with pytest.raises(ConfigError):
        load_config(ROOT / "configs/smoke.toml", [option])


def test_the_median_update_is_the_coordinate_wise_median_key_by_key() -> None:
    """median_change: the keys every client uploaded at one shape (one median over their
    concatenation) and a key of mixed ranks (zero-padded) give each key's own coordinate-wise median."""
    from fedlora.strategies.anomaly import median_change

    rng = np.random.default_rng(3)
    changes = [{"a": rng.standard_normal((2, 3)), "b": rng.standard_normal(4), "c": rng.standard_normal((r, 5))}
               for r in (2, 3, 2)]
    changes[2]["d"] = rng.standard_normal(2)  # a key one client uploaded alone
    median = median_change(changes)
    assert sorted(median) == ["a", "b", "c", "d"]
    for key in ("a", "b"):
        np.testing.assert_array_equal(median[key], np.median(np.stack([c[key] for c in changes]), axis=0))
        assert median[key].shape == changes[0][key].shape
    padded = np.stack([np.pad(c["c"], [(0, 3 - c["c"].shape[0]), (0, 0)]) for c in changes])
    np.testing.assert_array_equal(median["c"], np.median(padded, axis=0))
    np.testing.assert_array_equal(median["d"], changes[2]["d"])

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


# ------------------------------------------------------------- the standard attacks' crafting
def test_the_standard_attacks_craft_what_their_papers_say() -> None:
    """benchmarks/poisoning.py's craft() on 6 honest changes of 50 coordinates, by hand."""
    from scipy.stats import norm

    bench = _benchmark()
    rng = np.random.default_rng(0)
    honest = rng.standard_normal((6, 50)) + 0.5  # (h, d), a common direction
    own = rng.standard_normal((1, 50))
    mean, std = honest.mean(axis=0), honest.std(axis=0)
    # ALIE, 1 of 7: s = floor(7 / 2 + 1) - 1 = 3, z = Phi^-1(4 / 7)
    np.testing.assert_allclose(bench.craft("alie", honest, own, rng)[0], mean - norm.ppf(4 / 7) * std)
    # IPM: -epsilon x the honest mean
    np.testing.assert_allclose(bench.craft("ipm-100", honest, own, rng)[0], -100 * mean)
    # min-max: the largest gamma whose farthest honest change is as far as the two farthest honest ones
    gaps = np.linalg.norm(honest[:, None] - honest[None], axis=2)
    bad = bench.craft("min-max", honest, own, rng)[0]
    gamma = float(np.mean((mean - bad) / std))
    assert np.linalg.norm(honest - bad, axis=1).max() <= gaps.max() + 1e-9
    assert np.linalg.norm(honest - (mean - 1.01 * gamma * std), axis=1).max() > gaps.max()
    # min-sum: the same with the sum of squared distances
    bad = bench.craft("min-sum", honest, own, rng)[0]
    gamma = float(np.mean((mean - bad) / std))
    assert np.sum(np.linalg.norm(honest - bad, axis=1) ** 2) <= (gaps ** 2).sum(axis=1).max() + 1e-9
    assert np.sum(np.linalg.norm(honest - (mean - 1.01 * gamma * std), axis=1) ** 2) > (gaps ** 2).sum(axis=1).max()
    # Fang's trimmed-mean attack: beyond the honest extreme, against the mean's direction, within b = 2
    bad = bench.craft("fang-trimmed-mean", honest, np.zeros((3, 50)), rng)
    up = mean > 0
    assert np.all(bad[:, up] <= honest.min(axis=0)[up] + 1e-12) and np.all(bad[:, ~up] >= honest.max(axis=0)[~up] - 1e-12)
    # Fang's Krum attack: -lambda sign(mean), and Krum (f = 1) keeps it
    bad = bench.craft("fang-krum", honest, np.zeros((1, 50)), rng)[0]
    assert np.allclose(bad / np.abs(bad[0]), -np.sign(mean)) and bench.krum_picks_attacker(honest, bad[None], 1)
    # sign flip, label flip, Gaussian noise of the honest median norm
    np.testing.assert_array_equal(bench.craft("sign-flip", honest, own, rng), -own)
    np.testing.assert_array_equal(bench.craft("label-flip", honest, own, rng), own)
    noise = bench.craft("gaussian", honest, np.zeros((200, 50)), rng)
    assert np.mean(np.linalg.norm(noise, axis=1)) == pytest.approx(np.median(np.linalg.norm(honest, axis=1)), rel=0.05)
    # colluders: one vector each, 1 % of its norm apart, never duplicates
    three = bench.craft("alie", honest, np.zeros((3, 50)), rng)
    assert 0.005 < np.linalg.norm(three[0] - three[1]) / np.linalg.norm(three[0]) < 0.03


def test_the_honest_configs_benchmark_runs_every_shipped_config() -> None:
    bench = _benchmark()
    assert sorted(bench.SHIPPED) == sorted((ROOT / "configs").glob("*.toml"))


def test_the_default_anomaly_rule_flags_no_honest_client_of_a_recorded_shipped_run() -> None:
    """Every honest run on record, replayed through the server's own verdict at the default
    thresholds: the fidelity benchmark's runs of configs/scenarios/ (docs/results/records) and the
    shipped configs' own runs (benchmarks/results/poisoning-honest, ``poisoning.py --honest-configs``)."""
    from fedlora.schema import FaultsConfig

    bench = _benchmark()
    rounds = bench.honest_rounds()
    scenarios, configs = rounds["configs/scenarios/ (fidelity records)"], rounds["configs/*.toml"]
    assert sum(len(r["measures"]) for r in scenarios) > 50_000  # the records are there
    flagged = [(i, flags) for i, r in enumerate(scenarios + configs)
               if (flags := bench.flags_under(r["measures"], r["flagged"], FaultsConfig()))]
    assert flagged == []
    # the rule the defaults replace (3 x the lower median, cosine 0) flagged an honest client there
    old = FaultsConfig(anomaly_norm_factor=3.0, anomaly_min_cosine=0.0)
    assert any(bench.flags_under(r["measures"], r["flagged"], old) for r in scenarios)


def test_the_norm_rule_needs_three_updates_of_two_neither_is_the_reference() -> None:
    from fedlora.schema import FaultsConfig
    from fedlora.strategies.anomaly import lower_median, verdict

    faults = FaultsConfig()  # norm factor 2.5
    # two honest updates of different ranks, 3.35 x apart (fedhera_llm, resized, seed 0)
    two = [0.5027, 1.6832]
    # three updates, one of them 3.35 x the lower median
    three = [0.5027, 0.6, 1.6832]
    # Execute
    of_two = [verdict(n, lower_median(two), 0.9, 2, faults) for n in two]
    of_three = [verdict(n, lower_median(three), 0.9, 3, faults) for n in three]
    # Assert
    assert of_two == [[], []]
    assert of_three[:2] == [[], []] and "faults.anomaly_norm_factor" in of_three[2][0]

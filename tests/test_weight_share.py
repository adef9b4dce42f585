"""The weight-share rule (fedlora/shares.py): one bound for whatever a method weighs by, set so that
honest clients never reach it; evaluation counts bounded too; operator settings that would turn a
defence off are refused in one line.

Strategies are built on configs/smoke.toml's tiny random BERT without training (the helpers of
tests/test_hostile_clients.py: an in-process grid answers the profile query, replies are made here).
"""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from test_hostile_clients import DECLARED, connected, partition, reply

from fedlora.config import ConfigError, load_config
from fedlora.data.federated import build_federated_data
from fedlora.lora import split_payload
from fedlora.schema import FaultsConfig, sample_size
from fedlora.shares import capped_weights, client_weights, entitled_sizes, share_bound, split_ceiling
from fedlora.strategies.evaluation import CountBounds
from fedlora.strategies.replies import ClientUpload
from fedlora.strategies.screening import weigh

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(ROOT.glob("configs/*.toml")) + sorted(ROOT.glob("configs/scenarios/*.toml"))
DEFAULT_SHARE = FaultsConfig().max_client_share
SAMPLES = 3000  # rounds checked per partition when there are more ways to sample than that


# ------------------------------------------------------------------------------ the rule itself
def test_entitlements_cut_a_declared_size_at_the_ratio_times_the_lower_median() -> None:
    # lower median of (100, 110, 10**9) is 110: the 10**9 is entitled to 8 x 110
    assert entitled_sizes([100, 110, 10**9], 8.0).tolist() == [100, 110, 880]
    # two clients: the lower median is the smaller one, so neither can raise it
    assert entitled_sizes([100, 10**6], 8.0).tolist() == [100, 800]
    assert entitled_sizes([100, 10**6], 0.0).tolist() == [100, 10**6]  # 0 = off
    # a client that declared nothing is entitled to the cut, or to any count without one
    assert entitled_sizes([100, 0, 300], 3.0).tolist() == [100, 300, 300]  # lower median 100
    assert entitled_sizes([0, 0], 8.0).tolist() == [math.inf, math.inf]


def test_the_share_bound_is_the_floor_or_the_largest_entitled_share() -> None:
    assert share_bound([100, 110, 120], 0.6) == 0.6  # 120 / 330 = 0.36 < 0.6
    assert share_bound([1300, 4200, 13007], 0.6) == pytest.approx(13007 / 18507)  # the demo's worst round: 0.70
    assert share_bound([100, math.inf], 0.6) == 0.6  # an unknown entitlement: the floor alone
    assert share_bound([100, 100], 1.0) == 1.0


def test_client_weights_cut_a_count_to_its_entitlement_then_to_the_share() -> None:
    # Prepare: client 2 reports 10**6 examples, entitled to 880; the share bound is 880 / 1090 = 0.81
    counts, entitled = [100, 110, 10**6], [100, 110, 880]
    # Execute
    weights = client_weights(counts, entitled, 0.6)
    # Assert: the entitlement cut alone (its share 0.807 is within the bound), the honest counts untouched
    assert weights.tolist() == [100, 110, 880]
    # the share bound on weights that are not counts: 30 x the others -> cut to share 0.6 exactly
    norms = capped_weights([1.0, 1.0, 30.0], 0.6)
    np.testing.assert_allclose(norms, [1.0, 1.0, 3.0])
    assert norms[2] / norms.sum() == pytest.approx(0.6)


@pytest.mark.parametrize(("fraction", "other"), [(0.2, 0.1), (0.02, 0.02), (0.1, 0.05), (0.3, 0.0), (0.45, 0.1)])
def test_a_split_never_holds_more_than_its_ceiling(fraction: float, other: float) -> None:
    # every partition size a client can hold, split as fedlora.data.federated.split_sizes splits it
    from fedlora.data.federated import split_sizes
    from fedlora.schema import DataConfig

    data = DataConfig(test_fraction=fraction, val_fraction=other)
    train_fraction = 1.0 - fraction - other
    worst = 0.0
    for n in range(1, 3000):
        test, val = split_sizes(n, data)
        train = n - test - val
        if train <= 0:
            continue
        assert test <= split_ceiling(train, fraction, train_fraction), (n, test, train)
        if other:
            assert val <= split_ceiling(train, other, train_fraction), (n, val, train)
        worst = max(worst, split_ceiling(train, fraction, train_fraction) - test)
    assert worst <= 2  # and the ceiling is tight: at most two examples above the split


# ------------------------------------------------------------------------ HetLoRA's norm weights
def product_norm_dense(A: np.ndarray, B: np.ndarray) -> float:
    return float(np.linalg.norm(B.astype(np.float64) @ A.astype(np.float64)))


def hetlora_round(overrides: tuple[str, ...], scale_B: float) -> tuple[dict, list[dict], float]:
    """One HetLoRA round on the smoke clients (ranks 2, 4, 8): honest updates, client 2's B x
    ``scale_B``; the global payload, the uploads and the round's share bound."""
    strategy, grid = connected("hetlora", overrides)
    sent = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    uploads, replies = [], []
    for msg in sent:
        k = partition(msg)
        rng = np.random.default_rng([k, 63])
        download = {key: a.numpy() for key, a in msg.content.array_records["arrays"].items()}
        upload = {key: (value + 0.01 * rng.standard_normal(value.shape)).astype(np.float32)
                  for key, value in download.items()}
        if k == 2:
            upload = {key: (value * scale_B if key.endswith("::B") else value).astype(np.float32)
                      for key, value in upload.items()}
        uploads.append(upload)
        replies.append(reply(msg, upload, {"num-examples": DECLARED[k], "partition-id": k, "train-loss": 1.0}))
    strategy.aggregate_train(1, replies)
    assert strategy.record(1).clients == 3 and strategy.record(1).rejected == 0  # the scaled B passed every bound
    bound = share_bound(DECLARED[:3], strategy.experiment.faults.max_client_share)
    return strategy.global_payload(), uploads, bound


def hand_average(uploads: list[dict], weights: np.ndarray, module: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A and B of ``module`` averaged here: zero-padded to ``rank``, weights normalised."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    A = sum(wk * np.pad(u[module + "::A"].astype(np.float64), ((0, rank - u[module + "::A"].shape[0]), (0, 0)))
            for wk, u in zip(w, uploads))
    B = sum(wk * np.pad(u[module + "::B"].astype(np.float64), ((0, 0), (0, rank - u[module + "::B"].shape[1])))
            for wk, u in zip(w, uploads))
    return A, B


def test_hetlora_a_client_scaling_B_by_30_weighs_at_most_the_share_bound() -> None:
    # Prepare / Execute: client 2 of 3 uploads its honest update with B x 30 (HetLoRA weighs by ||B A||)
    payload, uploads, bound = hetlora_round((), 30.0)
    factors, _ = split_payload(payload)
    # Assert: per module, client 2 weighs exactly the bound (0.6), where its norm alone would give it > 0.9;
    # the aggregate is the hand-made zero-padded average with those weights
    assert bound == DEFAULT_SHARE
    for module, global_factors in factors.items():
        norms = np.array([product_norm_dense(u[module + "::A"], u[module + "::B"]) for u in uploads])
        assert norms[2] / norms.sum() > 0.9  # what the plain norm weights would give it
        weights = np.array([norms[0], norms[1], bound / (1 - bound) * (norms[0] + norms[1])])
        assert weights[2] / weights.sum() == pytest.approx(bound)
        A, B = hand_average(uploads, weights, module, global_factors.A.shape[0])
        np.testing.assert_allclose(global_factors.A, A, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(global_factors.B, B, rtol=1e-5, atol=1e-7)


def test_hetlora_honest_norm_weights_are_left_as_they_are() -> None:
    # Prepare / Execute: the same round without the scaled B
    payload, uploads, bound = hetlora_round((), 1.0)
    # Assert: every module's aggregate is the plain norm-weighted average (no share reaches 0.6)
    for module, global_factors in split_payload(payload)[0].items():
        norms = np.array([product_norm_dense(u[module + "::A"], u[module + "::B"]) for u in uploads])
        assert norms.max() / norms.sum() < bound
        A, B = hand_average(uploads, norms, module, global_factors.A.shape[0])
        np.testing.assert_allclose(global_factors.A, A, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(global_factors.B, B, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------- every shipped config, honest
def rounds_of(clients: int, sampled: int, seed: int) -> list[tuple[int, ...]]:
    """Every sample of ``sampled`` of ``clients`` (or :data:`SAMPLES` random ones and each client with
    the smallest others, the largest shares a round can give)."""
    if math.comb(clients, sampled) <= SAMPLES:
        return list(itertools.combinations(range(clients), sampled))
    rng = np.random.default_rng(seed)
    return [tuple(rng.choice(clients, sampled, replace=False)) for _ in range(SAMPLES)]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_the_share_rule_never_changes_an_honest_weight_of_a_shipped_config(path: Path) -> None:
    """Seeds 0-4 (fresh partitions, as the benchmarks take them), every round a config can sample,
    at the default bound (configs/scenarios/fedhera_llm.toml turns it off; here it is on): the
    server's own rule gives every client its example count, and every client's test and validation
    counts are within the bounds of its evaluation weight."""
    base = load_config(path)
    for seed in range(5):
        # Prepare: the partition of this seed; each client declares its training examples when it joins
        config = load_config(path, [f"data.seed={base.data.seed + seed}", f"faults.max_client_share={DEFAULT_SHARE}"])
        clients = build_federated_data(config.data).clients
        declared = [len(client.train) for client in clients]
        sampled = sample_size(len(declared), config.federation.fraction_train, config.federation.min_clients)
        # Execute
        entitled = entitled_sizes(declared, config.faults.max_size_ratio)
        bounds = CountBounds.of(dict(enumerate(entitled.tolist())), config.data, config.train.max_length)
        # Assert: nobody is cut when it joins, no round's weights change, no evaluation count is cut
        assert entitled.tolist() == declared
        for chosen in rounds_of(len(declared), sampled, seed):
            counts = [declared[k] for k in chosen]
            assert client_weights(counts, [entitled[k] for k in chosen], config.faults.max_client_share).tolist() == counts
        for k, client in enumerate(clients):
            assert len(client.test) <= bounds.test[k] and len(client.val) <= bounds.val[k]


def test_the_demo_prints_no_reweighing_line(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: configs/demo.toml's worst round (seed 0): its largest partition beside its two smallest
    config = load_config(ROOT / "configs/demo.toml")
    declared = [len(client.train) for client in build_federated_data(config.data).clients]
    worst = [int(np.argmax(declared)), *np.argsort(declared)[:2].tolist()]
    uploads = [ClientUpload(k, {}, declared[k], {}) for k in worst]
    entitled = dict(enumerate(entitled_sizes(declared, config.faults.max_size_ratio).tolist()))
    assert max(declared) / sum(declared[k] for k in worst) > config.faults.max_client_share  # 0.77 > 0.6
    # Execute
    with caplog.at_level(logging.WARNING, logger="flwr"):
        weigh(uploads, entitled, config.faults.max_client_share)
    # Assert
    assert [u.weight for u in uploads] == [declared[k] for k in worst]
    assert "weighs" not in caplog.text


# --------------------------------------------------------------------------------- evaluation
def test_a_client_declaring_a_million_test_examples_weighs_its_split_and_the_mean_and_worst_are_reported() -> None:
    # Prepare: three FedIT clients; client 2 reports a perfect score over 10**6 test examples
    strategy, grid = connected("fedit")
    strategy.connect(grid)
    asked = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))
    scores = {0: (0.2, 20.0), 1: (0.3, 22.0), 2: (1.0, 1e6)}  # accuracy, test examples
    # Execute
    strategy.aggregate_evaluate(1, [Message(RecordDict({"metrics": MetricRecord({
        "accuracy": scores[partition(m)][0], "num-examples": scores[partition(m)][1],
        "partition-id": float(partition(m))})}), reply_to=m) for m in asked])
    # Assert: client 2 weighs the test split of its 120 declared examples (smoke: test 0.2, validation
    # 0.1 -> floor(0.2 x 121 / 0.7 + 0.5) = 35), not 10**6; the unweighted mean and the worst beside it
    ceiling = split_ceiling(DECLARED[2], 0.2, 0.7)
    assert ceiling == 35
    record = strategy.record(1)
    expected = (0.2 * 20 + 0.3 * 22 + 1.0 * ceiling) / (20 + 22 + ceiling)
    assert record.personalized_accuracy == pytest.approx(expected)
    assert record.personalized_accuracy_unweighted == pytest.approx(0.5)
    assert record.personalized_accuracy_worst == pytest.approx(0.2)
    from fedlora.app.driver import progress_line

    assert f"personalised {expected:.3f} (mean 0.500, worst 0.200)" in progress_line(record, 2)


# ----------------------------------------------------------------------------- operator input
@pytest.mark.parametrize(("overrides", "problem"), [
    (("faults.max_client_share='0.5'",), "faults.max_client_share': must be a number, not text"),
    (("faults.max_client_share=true",), "faults.max_client_share': must be a number, not a boolean"),
    (("faults.num_malicious='1'",), "faults.num_malicious': must be a number, not text"),
    (("faults.max_update_ratio=yes",), "faults.max_update_ratio': must be a number, not text"),
    (("train.lr='1e-3'",), "train.lr': must be a number, not text"),
    (("strategy.name=hetlora", "strategy.prune_decay=true"), "must be a number, not a boolean"),
    (("faults.max_client_share=1e-9",), "faults.max_client_share = 1e-09 is below 1 / 3"),
    (("faults.max_size_ratio=0.5",), "faults.max_size_ratio = 0.5 would cut every client above the lower median"),
    (("data.num_clients=7", "clients.ranks=[4, 4, 4, 4, 4, 4, 4]", "faults.aggregation=multikrum",
      "faults.multikrum_select=9"), "faults.multikrum_select = 9 keeps every one of the 7 uploads"),
    (("faults.aggregation=trimmed_mean",), "cuts int(0.2 x 3) = 0 values at each end of the 3 uploads"),
    (("faults.aggregation=median", "federation.fraction_train=0.5"), "over the 2 uploads a round samples is their mean"),
])
def test_a_setting_that_turns_a_defence_off_or_a_number_as_text_is_refused_in_one_line(
        overrides: tuple[str, ...], problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(ROOT / "configs/smoke.toml", list(overrides))
    assert problem in str(refused.value) and "\n" not in str(refused.value)


def test_the_settings_next_to_the_refused_ones_load() -> None:
    for overrides in (["faults.max_client_share=0.34"], ["faults.max_client_share=1"], ["faults.max_size_ratio=0"],
                      ["faults.max_size_ratio=1"], ["faults.aggregation=trimmed_mean", "faults.trim_fraction=0.34"],
                      ["faults.aggregation=median"], ["train.lr=1"],
                      ["data.num_clients=7", "clients.ranks=[4, 4, 4, 4, 4, 4, 4]", "faults.aggregation=multikrum",
                       "faults.multikrum_select=6"]):
        assert load_config(ROOT / "configs/smoke.toml", overrides)


def test_a_refused_setting_is_one_line_and_exit_2_on_the_command_line(tmp_path: Path) -> None:
    from cli_helpers import fedlora_run

    done = fedlora_run(tmp_path / "run", "faults.multikrum_select=5", "faults.aggregation=multikrum")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "faults.multikrum_select = 5" in done.stderr
    assert not (tmp_path / "run").exists()


def test_an_equal_share_asked_for_makes_every_client_weigh_the_same() -> None:
    # faults.max_client_share = 1 / the sample (docs/flower.md, Flower's DP wrapper): uniform weights
    assert share_bound([100, 110, 120], 1 / 3) == pytest.approx(1 / 3)
    np.testing.assert_allclose(client_weights([100, 110, 120], [100, 110, 120], 1 / 3), [1.0, 1.0, 1.0])
    # a round with fewer uploads than the sample: still every one the same
    np.testing.assert_allclose(client_weights([100, 120], [100, 120], 1 / 3), [1.0, 1.0])


def test_a_client_that_declared_no_size_is_bounded_by_the_others_or_not_at_all() -> None:
    # no declared size anywhere: no entitlement cuts anything, evaluation counts included
    entitled = entitled_sizes([0, 0, 0], 8.0)
    assert client_weights([5, 7, 9], entitled, 0.6).tolist() == [5, 7, 9]
    assert split_ceiling(math.inf, 0.2, 0.7) == math.inf

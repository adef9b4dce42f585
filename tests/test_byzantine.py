"""Byzantine-robust aggregation: Flower's Krum, MultiKrum and Bulyan on LoRA uploads
(strategies/robust.py, fedlora.lora.Combine's 'bulyan'; issue 40 item 3).

The rules are checked against their formulas computed here (Krum's score: the sum of squared
distances to the n - f - 2 nearest uploads; Bulyan: the mean of the n - 4f values nearest the
coordinate's median), then end to end through the strategy with seven fedit clients of the tiny
random BERT, one of them poisoned within the norm bounds.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_hostile_clients import connected
from test_poisoning import poisoned_round

from fedlora.config import ConfigError, load_config
from fedlora.lora import Combine
from fedlora.strategies.robust import select_uploads

SMOKE = "configs/smoke.toml"
SEVEN = ("data.num_clients=7", "clients.ranks=[4, 4, 4, 4, 4, 4, 4]", "federation.min_clients=2")


def krum_scores(vectors: list[np.ndarray], malicious: int) -> np.ndarray:
    """Krum's score of each vector, from its definition (Blanchard et al., 2017)."""
    n = len(vectors)
    scores = []
    for i in range(n):
        distances = sorted(float(np.sum((vectors[i] - vectors[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(distances[: max(1, n - malicious - 2)]))
    return np.array(scores)


def uploads_of_mixed_ranks(seed: int) -> list[dict[str, np.ndarray]]:
    """Seven uploads of one module (A: r x 6, B: 5 x r) and a head, ranks 2 and 4; client 3 x 8."""
    rng = np.random.default_rng(seed)
    uploads = []
    for k, rank in enumerate([2, 4, 4, 2, 4, 2, 4]):
        scale = 8.0 if k == 3 else 1.0
        uploads.append({"m::A": scale * (1 + 0.1 * rng.standard_normal((rank, 6))),
                        "m::B": scale * (1 + 0.1 * rng.standard_normal((5, rank))),
                        "head::w": scale * (1 + 0.1 * rng.standard_normal(3))})
    return uploads


def flat_padded(upload: dict[str, np.ndarray]) -> np.ndarray:
    """The upload as one vector, A padded to 4 rows and B to 4 columns by hand."""
    A = np.zeros((4, 6))
    A[: upload["m::A"].shape[0]] = upload["m::A"]
    B = np.zeros((5, 4))
    B[:, : upload["m::B"].shape[1]] = upload["m::B"]
    return np.concatenate([upload["head::w"], A.ravel(), B.ravel()])  # keys in sorted order: head, A, B


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("rule", "malicious", "select", "kept"), [
    ("krum", 1, 0, 1), ("multikrum", 1, 0, 6), ("multikrum", 2, 3, 3), ("bulyan", 1, 0, 5)])
def test_the_selection_is_krums_score_over_zero_padded_uploads(seed: int, rule: str, malicious: int, select: int,
                                                                kept: int) -> None:
    # Prepare
    uploads = uploads_of_mixed_ranks(seed)
    scores = krum_scores([flat_padded(u) for u in uploads], malicious)
    # Execute
    chosen = select_uploads(uploads, rule, malicious, select)  # type: ignore[arg-type]
    # Assert: the `kept` lowest scores, the scaled client never among them
    assert chosen == sorted(np.argsort(scores)[:kept].tolist())
    assert 3 not in chosen


def test_a_rule_that_selects_nothing_keeps_every_upload() -> None:
    uploads = uploads_of_mixed_ranks(0)
    assert select_uploads(uploads, "median", 1) == list(range(7))
    assert select_uploads(uploads[:1], "krum", 1) == [0]


def test_bulyan_combines_each_coordinate_as_the_mean_of_the_values_nearest_its_median() -> None:
    # Prepare: five uploads of two coordinates; f = 1 -> beta = 5 - 2 = 3 values per coordinate
    arrays = [np.array([1.0, 10.0]), np.array([2.0, 11.0]), np.array([3.0, 9.0]),
              np.array([100.0, 10.5]), np.array([-50.0, -80.0])]
    # Execute
    combined = Combine("bulyan", malicious=1)(arrays, [1.0] * 5)
    # Assert: coordinate 0: median 2, nearest 3 are 1, 2, 3 -> 2; coordinate 1: median 10, nearest 10, 10.5, 9 or 11
    # (|11 - 10| = |9 - 10|: either; both give a mean within [9.83, 10.5])
    assert combined[0] == pytest.approx(2.0)
    assert combined[1] in (pytest.approx((10 + 10.5 + 9) / 3), pytest.approx((10 + 10.5 + 11) / 3))


@pytest.mark.parametrize("rule", ["krum", "multikrum", "bulyan"])
def test_a_client_scaling_its_update_by_5_is_left_out_and_the_aggregate_stays_near_the_honest_one(rule: str) -> None:
    # Prepare: seven fedit clients, f = 1; the same rounds without the attack under the same rule
    nodes = [{"partition-id": k, "rank": 4, "declared": 100} for k in range(7)]
    strategy, grid = connected("fedit", (*SEVEN, f"faults.aggregation={rule}"), nodes)
    honest, honest_grid = connected("fedit", (*SEVEN, f"faults.aggregation={rule}"), nodes)
    mean, mean_grid = connected("fedit", (*SEVEN, "faults.aggregation=mean"), nodes)
    for s, g in ((strategy, grid), (honest, honest_grid), (mean, mean_grid)):
        poisoned_round(s, g, 1)
    before = {k: v.copy() for k, v in honest.global_payload().items()}
    # Execute: round 2, client 1 scales its change by 5
    sent = poisoned_round(strategy, grid, 2, {1: 5.0})
    poisoned_round(honest, honest_grid, 2)
    poisoned_round(mean, mean_grid, 2, {1: 5.0})
    # Assert: client 1 not aggregated (marked), the rest of the round counted as usual
    record = strategy.record(2)
    assert record.per_client_train["1"]["byzantine_kept"] is False
    assert sum(entry["byzantine_kept"] for entry in record.per_client_train.values()) == {"krum": 1, "multikrum": 6,
                                                                                          "bulyan": 5}[rule]
    assert record.clients == 7 and record.rejected == 0

    # Assert: the mean moved by the attack (the change of one client in seven x 5: about 4/7 of an honest
    # round); Krum's aggregate is one honest client's upload, MultiKrum's and Bulyan's moved less than a third
    # as far as the mean's (from the same round without the attack under the same rule)
    def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
        return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))

    step = distance(honest.global_payload(), before)
    moved, moved_by_mean = (distance(s.global_payload(), honest.global_payload()) / step for s in (strategy, mean))
    print(f"{rule}: moved {moved:.3f} of an honest round, the mean {moved_by_mean:.3f}")
    assert moved_by_mean > 0.5
    if rule == "krum":
        (chosen,) = [k for k, entry in record.per_client_train.items() if entry["byzantine_kept"]]
        assert chosen != "1" and all(np.array_equal(strategy.global_payload()[key], value)
                                     for key, value in sent[int(chosen)].items())
    else:
        assert moved < moved_by_mean / 3


@pytest.mark.parametrize(("overrides", "needed"), [
    (("faults.aggregation=bulyan",), "needs 7 uploads a round, but a round samples 3"),
    (("faults.aggregation=krum",), "needs 5 uploads a round, but a round samples 3"),
    (("faults.aggregation=multikrum", "faults.num_malicious=3", *SEVEN), "needs 9 uploads a round, but a round samples 7"),
])
def test_a_selection_whose_rounds_sample_too_few_clients_is_refused_in_one_line(overrides: tuple[str, ...],
                                                                                needed: str) -> None:
    with pytest.raises(ConfigError, match=needed) as refused:
        load_config(SMOKE, list(overrides))
    assert "\n" not in str(refused.value)


def test_krum_with_enough_clients_and_f_0_loads() -> None:
    assert load_config(SMOKE, ["faults.aggregation=krum", "faults.num_malicious=0"]).faults.num_malicious == 0

"""FedHera: budgets, water-filling allocation, spectral push, aggregation, prefix gating, end to end."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from result_checks import assert_accuracies_add_up

from fedlora.config import ConfigError, load_config
from fedlora.lora import Factors, LowRankSVD, factor_svd
from fedlora.methods.fedhera import (
    aggregate_original,
    aggregate_unbiased,
    alignment_score,
    allocate_download,
    allocate_training,
    push_round_of,
    round_summary,
    scale_tail,
    scored_round_of,
    spectral_push,
    tail_lambda,
    tier_label,
)
from fedlora.profile import resolve_profile

ROOT = Path(__file__).resolve().parents[1]

# tiny-bert (configs/smoke.toml): 4 modules of 32 x 32, a column costs (32 + 32) * 4 = 256 bytes;
# the head (8 labels x 32 + 8) is 1056 bytes, a trained column 64 parameters. Budgets: (r_main, r_tot)
# = (1, 2), (2, 3), (3, 4) per module on average.
SMOKE_TIERS = (
    "clients.budget_tiers=["
    "{share = 0.34, name = 'low', download = 3200, time = 300, memory = 260},"
    "{share = 0.33, name = 'medium', download = 4200, time = 520, memory = 600},"
    "{share = 0.33, name = 'high', download = 5200, time = 800, memory = 800}]"
)
# The e2e runs: a low tier that affords 2 downloaded columns (1056 + 2 x 256 = 1568 bytes) and 1
# trained column (64 time / memory units) over 4 modules, so at least 2 modules are not adapted
# and 3 frozen on those clients
TIGHT_TIERS = (
    "clients.budget_tiers=["
    "{share = 0.34, name = 'low', download = 1568, time = 64, memory = 64},"
    "{share = 0.33, name = 'medium', download = 4200, time = 520, memory = 600},"
    "{share = 0.33, name = 'high', download = 5200, time = 800, memory = 800}]"
)


def captured_energy(spectra: dict[str, np.ndarray], ranks: dict[str, int]) -> float:
    return float(sum(np.sum(spectra[m][: ranks[m]] ** 2) for m in spectra))


# ------------------------------------------------------------------------- allocation


def official_r_tot(layers: dict[str, dict[str, np.ndarray]], B_down_bytes: float, bytes_per_col: dict[str, float]) -> dict[str, int]:
    """Literal transcription of the official ``allocate_r_tot_for_client`` (github.com/shock-xiaoke/
    FedHera f2389f8, ``fed_utils/rank_allocator.py`` l.5-47), without the returned cost."""
    r_tot = {L: 0 for L in layers}
    cost_used = 0.0
    layer_energy = {}
    for L, meta in layers.items():
        sigma = meta.get("sigma", np.array([]))
        layer_energy[L] = sigma.astype(float) ** 2
    while True:
        best_gain = -1.0
        best_L = None
        found_candidate = False
        for L, energy_array in layer_energy.items():
            r = r_tot[L]
            if r >= len(energy_array):
                continue
            cost_increase = bytes_per_col.get(L, 1.0)
            if cost_used + cost_increase > B_down_bytes:
                continue
            current_energy = energy_array[r]
            gain = current_energy / max(cost_increase, 1e-9)
            if gain > best_gain:
                best_gain = gain
                best_L = L
                found_candidate = True
        if not found_candidate:
            break
        assert best_L is not None
        r_tot[best_L] += 1
        cost_used += bytes_per_col.get(best_L, 1.0)
    return r_tot


def official_r_main(layers: dict[str, dict[str, np.ndarray]], r_tot: dict[str, int], M_bytes: float, T_ms: float,
                    c_mem_per_col: dict[str, float], c_time_per_col: dict[str, float]) -> dict[str, int]:
    """Literal transcription of the official ``allocate_r_main_for_client`` (same file, l.49-105;
    alpha = beta = None, the call in model_aggregation.py), without the returned costs."""
    r_main = {L: 0 for L in layers}
    M_left, T_left = float(M_bytes), float(T_ms)
    layer_energy_map = {L: meta.get("sigma", np.array([])).astype(float) ** 2 for L, meta in layers.items()}
    while True:
        current_T_ratio = max(T_left, 1e-9) / max(T_ms, 1e-9)
        current_M_ratio = max(M_left, 1e-9) / max(M_bytes, 1e-9)
        invT = 1.0 / current_T_ratio
        invM = 1.0 / current_M_ratio
        sum_inv = invT + invM
        a = invT / sum_inv
        b = invM / sum_inv
        best = None
        for L, sigma_sq in layer_energy_map.items():
            r = r_main[L]
            limit = min(r_tot.get(L, 0), len(sigma_sq))
            if r >= limit:
                continue
            cost_t = c_time_per_col.get(L, 1.0)
            cost_m = c_mem_per_col.get(L, 1.0)
            if (M_left < cost_m) or (T_left < cost_t):
                continue
            unit_cost = a * cost_t + b * cost_m
            gain = sigma_sq[r] / max(unit_cost, 1e-12)
            if (best is None) or (gain > best[0]):
                best = (gain, L, cost_m, cost_t)
        if best is None:
            break
        _, Lbest, cost_m, cost_t = best
        r_main[Lbest] += 1
        M_left -= cost_m
        T_left -= cost_t
    return r_main


def test_allocation_equals_the_official_allocator_on_a_hand_example_with_a_tie_and_a_frozen_module() -> None:
    # Prepare: three modules in model order q0, v0, q1; every column costs 100 bytes, 10 time and
    # 1 memory units; download budget 400 bytes, T = 20, M = 1e6 (never binds)
    spectra = {"q0": np.array([3.0, 2.0, 1.0]), "v0": np.array([2.0, 2.0]), "q1": np.array([1.0, 0.5])}
    column_bytes = {m: 100 for m in spectra}
    time_cost, memory_cost = {m: 10.0 for m in spectra}, {m: 1.0 for m in spectra}
    max_rank = {m: len(s) for m, s in spectra.items()}  # official: r < len(sigma)
    # By hand, r_tot (gain sigma^2 / 100, every module from 0, strict '>' in module order):
    #   1. q0 9/100, v0 4/100, q1 1/100                -> q0 (spent 100)
    #   2. q0 4/100, v0 4/100 (tie), q1 1/100          -> q0, the first in order (spent 200)
    #   3. q0 1/100, v0 4/100, q1 1/100                -> v0 (300)
    #   4. q0 1/100, v0 4/100 (its second 2), q1 1/100 -> v0 (400); nothing fits any more
    #   r_tot = q0 2, v0 2, q1 0 (q1 is not adapted on this client)
    # r_main (cost a*10 + b*1, a = pT / (pT + pM), pT = T / T_left, pM = M / M_left):
    #   1. T_left 20: pT = 1, pM = 1, cost 5.5; q0 9/5.5, v0 4/5.5 (q1: r_tot 0) -> q0 (T_left 10)
    #   2. pT = 2, pM = 1e6 / 999999; the same cost c for both; q0 4/c, v0 4/c (tie) -> q0 (T_left 0)
    #   3. q0 is at r_tot; v0's column needs 10 time units, 0 left -> stop
    #   r_main = q0 2, v0 0 (frozen: downloaded, not trained), q1 0
    # (the earlier rule, ties to the smaller rank, gave v0 in step 2 of both passes)
    layers = {m: {"sigma": s} for m, s in spectra.items()}
    # Execute
    r_tot = allocate_download(spectra, column_bytes, 400, 0, max_rank)
    r_main = allocate_training(spectra, r_tot, time_cost, memory_cost, 20.0, 1e6, 0)
    # Assert: the hand values, and the official loops on the same inputs
    assert r_tot == {"q0": 2, "v0": 2, "q1": 0}
    assert r_main == {"q0": 2, "v0": 0, "q1": 0}
    assert official_r_tot(layers, 400, {m: float(c) for m, c in column_bytes.items()}) == r_tot
    assert official_r_main(layers, r_tot, 1e6, 20.0, memory_cost, time_cost) == r_main


@pytest.mark.parametrize("seed", range(12))
def test_allocation_equals_the_official_loops_with_ties_zeros_and_unequal_costs(seed: int) -> None:
    # Prepare: 5 modules, spectra of small integers (many exact ties), some shorter than the
    # module's maximal rank (fedlora trims G's spectrum; the official dense SVD pads it with ~0:
    # here exact zeros), column costs from a small set, budgets that bind; time-heavy and
    # memory-heavy modules, so the pressure weights a, b change the choice (seeds 4 and 8 differ
    # from a = b = 1/2)
    rng = np.random.default_rng(seed)
    modules = [f"m{i}" for i in range(5)]
    max_rank = {m: 6 for m in modules}
    spectra = {m: np.sort(rng.integers(1, 4, int(rng.integers(1, 7))).astype(float))[::-1] for m in modules}
    padded = {m: np.concatenate([s, np.zeros(max_rank[m] - len(s))]) for m, s in spectra.items()}
    column_bytes = {m: int(rng.choice([64, 128])) for m in modules}
    heavy = {m: int(rng.integers(2)) for m in modules}  # 0: time-light, memory-heavy; 1: the reverse
    time_cost = {m: (8.0, 20.0)[heavy[m]] for m in modules}
    memory_cost = {m: (20.0, 8.0)[heavy[m]] for m in modules}
    budget, T, M = float(rng.integers(600, 2000)), float(rng.integers(60, 200)), float(rng.integers(60, 300))
    layers = {m: {"sigma": padded[m]} for m in modules}
    # Execute
    r_tot = allocate_download(spectra, column_bytes, budget, 0, max_rank)
    r_main = allocate_training(spectra, r_tot, time_cost, memory_cost, T, M, 0)
    # Assert
    assert r_tot == official_r_tot(layers, budget, {m: float(c) for m, c in column_bytes.items()})
    assert r_main == official_r_main(layers, r_tot, M, T, memory_cost, time_cost)


def test_the_legacy_floor_of_one_stays_selectable() -> None:
    # Prepare: equal column costs, room for 6 columns; min_rank = 1: rank 1 everywhere first
    # (10, 8, 2), then the three largest remaining sigma are 7 (b), 6 (b), 5 (a); with the official
    # floor 0 the same six columns are the six largest sigma overall except c's 2: 10, 8, 7, 6, 5, 2
    spectra = {"a": np.array([10.0, 5.0, 1.0]), "b": np.array([8.0, 7.0, 6.0]), "c": np.array([0.5, 0.1])}
    cost = {m: 100 for m in spectra}
    # Execute
    floored = allocate_download(spectra, cost, budget=600, min_rank=1, max_rank={m: 3 for m in spectra})
    official = allocate_download(spectra, cost, budget=600, min_rank=0, max_rank={m: 3 for m in spectra})
    # Assert: the floor spends a column on c, whose sigma (0.5) is below a's third (1.0)
    assert floored == {"a": 2, "b": 3, "c": 1}
    assert official == {"a": 3, "b": 3, "c": 0}


@pytest.mark.parametrize("min_rank", [0, 1])
@pytest.mark.parametrize("budget", [300, 450, 600, 700, 900])
def test_greedy_download_allocation_is_optimal_with_equal_costs(budget: int, min_rank: int) -> None:
    # Prepare: brute force over every allocation that fits the budget
    spectra = {"a": np.array([9.0, 4.0, 3.0, 0.5]), "b": np.array([6.0, 5.5, 1.0]), "c": np.array([7.0, 2.0])}
    cost = {m: 100 for m in spectra}
    max_rank = {"a": 4, "b": 4, "c": 4}
    feasible = [
        dict(zip(spectra, r))
        for r in itertools.product(range(min_rank, 5), repeat=3)
        if 100 * sum(r) <= budget
    ]
    best = max(captured_energy(spectra, r) for r in feasible)
    # Execute
    ranks = allocate_download(spectra, cost, budget, min_rank, max_rank)
    # Assert: within budget, as much energy as the best feasible allocation
    assert sum(ranks[m] * cost[m] for m in ranks) <= budget
    assert captured_energy(spectra, ranks) == pytest.approx(best)


@pytest.mark.parametrize("min_rank", [0, 1])
@pytest.mark.parametrize("policy", ["greedy", "uniform", "random"])
@pytest.mark.parametrize(
    "costs, budget",
    [
        ({"a": 256, "b": 256, "c": 256}, 2100),
        ({"a": 100, "b": 260, "c": 700}, 2100),  # heterogeneous module shapes
        ({"a": 100, "b": 260, "c": 700}, 1061),  # one byte above rank 1 everywhere
    ],
)
def test_download_allocation_respects_the_budget_and_is_maximal(policy, costs, budget, min_rank) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    spectra = {m: np.sort(rng.uniform(0, 5, 6))[::-1] for m in costs}
    max_rank = {m: 8 for m in costs}
    # Execute
    ranks = allocate_download(spectra, costs, budget, min_rank, max_rank, policy, np.random.default_rng(1))
    # Assert: within budget, at least the floor, and maximal: no further column would have fitted
    # (official 'uniform': no common rank one higher would have fitted)
    spent = sum(ranks[m] * costs[m] for m in costs)
    assert spent <= budget and min(ranks.values()) >= min_rank
    if policy == "uniform":
        assert len(set(ranks.values())) == 1 and spent + sum(costs.values()) > budget
    else:
        assert all(ranks[m] == max_rank[m] or costs[m] > budget - spent for m in costs)


@pytest.mark.parametrize("min_rank", [0, 1])
@pytest.mark.parametrize("policy", ["greedy", "uniform", "random"])
@pytest.mark.parametrize(
    "time_budget, memory_budget",
    [
        (1000.0, 1000.0),
        (1000.0, 300.0),  # memory binds
        (250.0, math.inf),  # time binds, memory undeclared
        (math.inf, math.inf),  # nothing binds: r_main = r_tot
    ],
)
def test_training_allocation_respects_time_memory_and_r_tot(policy, time_budget, memory_budget, min_rank) -> None:
    # Prepare
    spectra = {"a": np.array([5.0, 4.0, 3.0, 2.0]), "b": np.array([6.0, 1.0, 0.5])}
    r_tot = {"a": 4, "b": 3}
    time_cost, memory_cost = {"a": 50.0, "b": 40.0}, {"a": 30.0, "b": 60.0}
    # Execute
    r_main = allocate_training(spectra, r_tot, time_cost, memory_cost, time_budget, memory_budget, min_rank, policy)
    # Assert
    assert all(min_rank <= r_main[m] <= r_tot[m] for m in r_tot)
    assert sum(r_main[m] * time_cost[m] for m in r_main) <= time_budget
    assert sum(r_main[m] * memory_cost[m] for m in r_main) <= memory_budget
    if math.isinf(time_budget) and math.isinf(memory_budget):
        assert r_main == r_tot


@pytest.mark.parametrize("min_rank", [0, 1])
def test_greedy_training_allocation_follows_the_spectrum(min_rank: int) -> None:
    # Prepare: equal costs, room for 4 columns: 6 (b), 5 (a), 4 (a), 3 (a) (with the floor of one:
    # rank 1 each (5, 6), then 4 (a) and 3 (a))
    spectra = {"a": np.array([5.0, 4.0, 3.0, 2.0]), "b": np.array([6.0, 1.0, 0.5])}
    cost = {"a": 10.0, "b": 10.0}
    # Execute
    r_main = allocate_training(spectra, {"a": 4, "b": 3}, cost, cost, 40.0, 40.0, min_rank)
    # Assert
    assert r_main == {"a": 3, "b": 1}


def test_official_uniform_ablation_takes_the_largest_common_rank() -> None:
    # Prepare: columns of 100, 200 and 300 bytes: a common rank costs 600; budget 1900 -> rank 3
    # (1800), 100 bytes left unspent; training caps: T // (10 + 10 + 10) = 2, M // 3 = 5
    spectra = {m: np.array([3.0, 2.0, 1.0, 0.5]) for m in ("a", "b", "c")}
    column_bytes = {"a": 100, "b": 200, "c": 300}
    # Execute
    r_tot = allocate_download(spectra, column_bytes, 1900, 0, {m: 4 for m in spectra}, "uniform")
    r_main = allocate_training(spectra, r_tot, {m: 10.0 for m in spectra}, {m: 1.0 for m in spectra}, 65.0, 15.0, 0, "uniform")
    # Assert
    assert r_tot == {"a": 3, "b": 3, "c": 3} and r_main == {"a": 2, "b": 2, "c": 2}


def test_round_summary_per_tier_on_a_hand_example() -> None:
    # Prepare: tier low has two clients over modules (x, y): r_tot (4, 0) and (2, 2), r_main (1, 0)
    # and (0, 2); tier high one client, r_tot (6, 6), r_main (3, 3)
    tiers = {
        "low": [({"x": 4, "y": 0}, {"x": 1, "y": 0}), ({"x": 2, "y": 2}, {"x": 0, "y": 2})],
        "high": [({"x": 6, "y": 6}, {"x": 3, "y": 3})],
    }
    # Execute
    summary = round_summary(tiers, [0.5, 0.25, 1.0])
    # Assert: mean over clients of the per-module mean: low r_tot (2 + 2) / 2 = 2, r_main (0.5 + 1) / 2;
    # frozen modules (r_main 0): 1 and 1 -> 1; not adapted (r_tot 0): 1 and 0 -> 0.5
    assert summary == {
        "fedhera_r_tot_low": 2.0, "fedhera_r_main_low": 0.75, "fedhera_frozen_low": 1.0, "fedhera_unadapted_low": 0.5,
        "fedhera_r_tot_high": 6.0, "fedhera_r_main_high": 3.0, "fedhera_frozen_high": 0.0, "fedhera_unadapted_high": 0.0,
        "fedhera_lambda_mean": pytest.approx(1.75 / 3), "fedhera_lambda_min": 0.25, "fedhera_lambda_max": 1.0,
    }
    assert "fedhera_lambda_mean" not in round_summary(tiers, None)
    assert tier_label("Very Low!", 0) == "very_low" and tier_label("", 2) == "tier2"


# ------------------------------------------------------------------------- push and aggregation


@pytest.mark.parametrize("rank, fresh", [(3, False), (5, False), (9, True), (9, False)])
def test_push_reproduces_the_truncated_svd(rank: int, fresh: bool) -> None:
    # Prepare: G of rank 6
    rng = np.random.default_rng(0)
    G = factor_svd([rng.standard_normal((20, 6))], [rng.standard_normal((6, 30))], [1.0])
    scale = 16.0 / rank
    fresh_A = rng.uniform(-0.1, 0.1, (rank, 30)) if fresh else None
    # Execute
    push = spectral_push(G, rank, scale, fresh_A)
    # Assert: s B A = U_r S_r V_r^T, the extra columns (past rank 6) add nothing
    r = min(rank, 6)
    expected = (G.U[:, :r] * G.S[:r]) @ G.Vt[:r]
    assert push.A.shape == (rank, 30) and push.B.shape == (20, rank)
    assert np.allclose(scale * push.B.astype(np.float64) @ push.A, expected, atol=1e-4)
    assert np.allclose(np.linalg.norm(push.B, axis=0)[:r] ** 2, G.S[:r] / scale, rtol=1e-4)  # even split
    if rank > 6:
        assert np.any(push.A[6:] != 0) == fresh


def dense(svd: LowRankSVD) -> np.ndarray:
    return (svd.U * svd.S) @ svd.Vt


def test_aggregations_original_and_unbiased() -> None:
    # Prepare: two clients (ranks 2 and 3), scales already folded into B, a previous G
    rng = np.random.default_rng(2)

    def client(r: int) -> dict[str, Factors]:
        return {"m": Factors(rng.standard_normal((r, 12)), rng.standard_normal((10, r)))}

    updates, starts, w = [client(2), client(3)], [client(2), client(3)], [0.25, 0.75]
    previous = {"m": factor_svd([rng.standard_normal((10, 4))], [rng.standard_normal((4, 12))], [1.0])}
    product = [u["m"].B @ u["m"].A for u in updates]
    start_product = [s["m"].B @ s["m"].A for s in starts]
    # Execute
    original = aggregate_original(updates, w, {"m": (10, 12)})
    unbiased = aggregate_unbiased(previous, updates, starts, w)
    # Assert
    assert np.allclose(dense(original["m"]), w[0] * product[0] + w[1] * product[1])
    expected = dense(previous["m"]) + sum(wi * (p - p0) for wi, p, p0 in zip(w, product, start_product))
    assert np.allclose(dense(unbiased["m"]), expected)


def test_a_module_a_client_did_not_adapt_is_a_zero_term_with_its_weight() -> None:
    # Prepare: module x uploaded by both clients, module y only by the first (the second had
    # r_tot = 0 there), z by nobody; weights 0.25 / 0.75 over both uploads
    rng = np.random.default_rng(6)

    def factors(r: int) -> Factors:
        return Factors(rng.standard_normal((r, 5)), rng.standard_normal((4, r)))

    updates = [{"x": factors(2), "y": factors(3)}, {"x": factors(1)}]
    starts = [{"x": factors(2), "y": factors(3)}, {"x": factors(1)}]
    shapes = {"x": (4, 5), "y": (4, 5), "z": (4, 5)}
    previous = {m: factor_svd([rng.standard_normal((4, 2))], [rng.standard_normal((2, 5))], [1.0]) for m in shapes}
    w = [0.25, 0.75]

    def product(f: Factors) -> np.ndarray:
        return f.B @ f.A

    # Execute
    original = aggregate_original(updates, w, shapes)
    unbiased = aggregate_unbiased(previous, updates, starts, w)
    # Assert: 'original': y = 0.25 P_y (not renormalised to weight 1), z = 0 with no components;
    # 'unbiased': y moves by the first client's change only, z stays G_prev
    assert np.allclose(dense(original["x"]), 0.25 * product(updates[0]["x"]) + 0.75 * product(updates[1]["x"]))
    assert np.allclose(dense(original["y"]), 0.25 * product(updates[0]["y"]))
    assert original["z"].S.shape == (0,) and dense(original["z"]).shape == (4, 5) and not dense(original["z"]).any()
    assert np.allclose(dense(unbiased["y"]), dense(previous["y"]) + 0.25 * (product(updates[0]["y"]) - product(starts[0]["y"])))
    assert np.allclose(dense(unbiased["z"]), dense(previous["z"]))


def test_alignment_score_counts_every_module_of_g_in_its_norm() -> None:
    # Prepare: the client uploaded only module x (r_tot = 0 on y); G has x = P_x and y = 2 P_x
    rng = np.random.default_rng(7)
    f = Factors(rng.standard_normal((2, 8)), rng.standard_normal((6, 2)))
    G = {"x": factor_svd([f.B], [f.A], [1.0]), "y": factor_svd([f.B], [f.A], [2.0])}
    # Execute
    score = alignment_score({"x": f}, G)
    # Assert: official: <P, G> = |P_x|^2, |P| = |P_x|, |G| = sqrt(1 + 4) |P_x|: 1 / sqrt(5)
    assert score == pytest.approx(1 / math.sqrt(5))


def official_alignment_score(uploads: dict[str, tuple[np.ndarray, np.ndarray]], aggregated: dict[str, np.ndarray],
                             lora_alpha: float) -> float:
    """Transliteration of the official ``fed_utils/model_aggregation.py`` l.247-305 (dense G)."""
    global_sq_norm = sum(float(np.linalg.norm(g)) ** 2 for g in aggregated.values())
    global_norm = math.sqrt(global_sq_norm)
    dot_product, client_sq_norm = 0.0, 0.0
    for key, g_mat in aggregated.items():
        a_mat, b_mat = uploads[key]
        merge_rate = float(lora_alpha) / float(max(b_mat.shape[1], 1))
        dot_product += float(np.sum(a_mat * (b_mat.T @ g_mat))) * merge_rate
        client_sq_norm += float(np.sum((b_mat.T @ b_mat) * (a_mat @ a_mat.T))) * merge_rate**2
    client_norm = math.sqrt(client_sq_norm)
    return dot_product / (global_norm * client_norm) if global_norm > 1e-6 and client_norm > 1e-6 else 0.0


def test_alignment_score_matches_the_official_single_cosine() -> None:
    # Prepare: two clients, two modules of different shapes and per-client ranks, alpha 16
    rng = np.random.default_rng(3)
    alpha, weights = 16.0, [0.25, 0.75]
    shapes, ranks = {"q": (6, 8), "v": (5, 7)}, [2, 3]
    uploads = [
        {m: (rng.standard_normal((r, d_in)), rng.standard_normal((d_out, r))) for m, (d_out, d_in) in shapes.items()}
        for r in ranks
    ]
    dense_G = {m: sum(w * (alpha / r) * u[m][1] @ u[m][0] for w, r, u in zip(weights, ranks, uploads)) for m in shapes}
    scaled = [{m: Factors(A, (alpha / r) * B) for m, (A, B) in u.items()} for r, u in zip(ranks, uploads)]
    G = aggregate_original(scaled, weights, shapes)
    # Execute
    ours = [alignment_score(update, G) for update in scaled]
    official = [official_alignment_score(u, dense_G, alpha) for u in uploads]
    # Assert: the same number, and a cosine (in [-1, 1]) even with two modules
    assert ours == pytest.approx(official, rel=1e-9)
    assert all(-1.0 <= s <= 1.0 for s in ours)


def test_alignment_score_is_one_cosine_not_a_sum_of_module_cosines() -> None:
    # Prepare: module x aligned with G, module y opposite to it and twice as large in G
    rng = np.random.default_rng(3)
    f = Factors(rng.standard_normal((2, 8)), rng.standard_normal((6, 2)))
    G = {"x": factor_svd([f.B], [f.A], [1.0]), "y": factor_svd([f.B], [f.A], [-2.0])}
    # Execute
    score = alignment_score({"x": f, "y": f}, G)
    # Assert: <P, G> = |P_x|^2 - 2 |P_x|^2, |P| = sqrt(2) |P_x|, |G| = sqrt(5) |P_x|: -1 / sqrt(10);
    # a sum of per-module cosines would give 1 - 1 = 0
    assert score == pytest.approx(-1 / math.sqrt(10))
    assert alignment_score({"x": f}, {"x": G["x"]}) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "score, score_round, server_round, expected",
    [
        # official λ = clip(1 - exp(-(1 + s 0.9^(e - t)) (e + 1) / 2), 0, 1), e = 0-based push round
        (0.0, -1, 2, 0.3934693),  # never scored, first push (e = 0): the official table's first value
        (0.0, -1, 3, 0.6321206),  # e = 1
        (0.0, -1, 4, 0.7768698),  # e = 2
        (1.0, 0, 2, 0.6321206),  # scored in round 1 (t = 0), fully aligned, first push: 1 - exp(-1)
        (1.0, 0, 4, 1 - math.exp(-(1 + 0.81) * 3 / 2)),  # stale by two rounds: 0.9^2
        (-1.0, 0, 2, 0.0),  # opposed to G, fresh: no tail
    ],
)
def test_tail_lambda_follows_the_official_schedule(score: float, score_round: int, server_round: int,
                                                   expected: float) -> None:
    # Execute: fedlora's 1-based training round -> the official 0-based push round e = R - 2
    lam = tail_lambda(score, score_round, push_round_of(server_round), horizon=2.0, decay=0.9)
    # Assert
    assert lam == pytest.approx(expected, abs=1e-7)


def test_scores_are_stamped_with_the_official_round() -> None:
    # a client that trains in fedlora round 1 is scored at the official round t = 0, and the push it
    # trains on in round 2 was made at e = 0: no decay
    assert scored_round_of(1) == 0 and push_round_of(2) == 0


def test_scale_tail_scales_only_the_tail_product() -> None:
    # Prepare
    rng = np.random.default_rng(4)
    f = Factors(rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32))
    # Execute
    out = scale_tail({"m": f}, {"m": 1}, 0.25)["m"]
    # Assert: prefix untouched, tail product times lambda
    assert np.array_equal(out.A[:1], f.A[:1]) and np.array_equal(out.B[:, :1], f.B[:, :1])
    assert np.allclose(out.B[:, 1:] @ out.A[1:], 0.25 * f.B[:, 1:] @ f.A[1:], atol=1e-5)


# ------------------------------------------------------------------------- client: prefix gating


@pytest.fixture(scope="module")
def tiny_model_factory():
    from fedlora.config import ModelConfig
    from fedlora.models import adapter_payload, build_model, load_payload

    def make(r_tot: int):
        model = build_model(ModelConfig(path="tiny-bert", lora_alpha=8), 4, r_tot, seed=0)
        rng = np.random.default_rng(5)
        payload = {k: rng.standard_normal(v.shape).astype(np.float32) * 0.5 for k, v in adapter_payload(model).items()}
        load_payload(model, payload)  # every factor non-zero, tail included
        return model

    return make


def tiny_batch():
    import torch

    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 2088, 102, 0, 0]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([1, 3])}


def test_gradients_outside_the_prefix_are_zero_and_the_tail_never_moves(tiny_model_factory) -> None:
    import torch

    from fedlora.clients.trainers.fedhera import gate_prefix, prefix_parameters
    from fedlora.training import cross_entropy_loss

    # Prepare: r_tot 4 everywhere, r_main 2, except the first module: r_main 0 (frozen)
    model = tiny_model_factory(4)
    model.eval()  # no dropout: deterministic
    params = prefix_parameters(model)
    frozen = next(iter(params))
    r_main = {m: 0 if m == frozen else 2 for m in params}
    before = {m: (A.detach().clone(), B.detach().clone()) for m, (A, B) in params.items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    # Execute
    cross_entropy_loss(model, tiny_batch()).backward()
    gate_prefix(params, r_main)
    grads = {m: (A.grad.clone(), B.grad.clone()) for m, (A, B) in params.items()}
    optimizer.step()
    # Assert: exact zeros outside A[:r_main], B[:, :r_main]; the prefix does get gradient; the tail
    # is unchanged; the frozen module does not move at all
    assert len(params) == 4
    for m, (gA, gB) in grads.items():
        r = r_main[m]
        A, B = params[m]
        assert torch.count_nonzero(gA[r:]) == 0 and torch.count_nonzero(gB[:, r:]) == 0
        assert torch.equal(A[r:], before[m][0][r:]) and torch.equal(B[:, r:], before[m][1][:, r:])
        if r:
            assert torch.count_nonzero(gA[:r]) > 0 and torch.count_nonzero(gB[:, :r]) > 0
            assert not torch.equal(A[:r], before[m][0][:r])
    assert torch.equal(params[frozen][0], before[frozen][0]) and torch.equal(params[frozen][1], before[frozen][1])


def test_the_frozen_tail_still_changes_the_forward_output(tiny_model_factory) -> None:
    import torch

    from fedlora.clients.trainers.fedhera import prefix_parameters
    from fedlora.training import model_inputs

    # Prepare
    model = tiny_model_factory(4)
    model.eval()
    inputs = model_inputs(tiny_batch(), torch.device("cpu"))
    with torch.no_grad():
        with_tail = model(**inputs).logits.clone()
        # Execute: remove the tail (rows 2: of A)
        for A, _ in prefix_parameters(model).values():
            A[2:] = 0.0
        without_tail = model(**inputs).logits
    # Assert
    assert not torch.allclose(with_tail, without_tail, atol=1e-6)


# ------------------------------------------------------------------------- config and profiles


def test_budget_tiers_are_assigned_by_share_and_node_config_overrides() -> None:
    # Prepare
    config = load_config(ROOT / "configs/smoke.toml", [SMOKE_TIERS])
    # Execute
    budgets = [resolve_profile(config, {"partition-id": i}).budgets for i in range(3)]
    override = resolve_profile(config, {"partition-id": 0, "budget-download": "5000"}).budgets
    # Assert
    assert [b["download"] for b in budgets] == [3200, 4200, 5200]
    assert budgets[0] == {"download": 3200.0, "time": 300.0, "memory": 260.0}
    assert override == {"download": 5000.0, "time": 300.0, "memory": 260.0}


@pytest.mark.parametrize(
    "override, message",
    [
        ("clients.budget_tiers=[{share = 0.5, download = 1000}]", "budget tier shares must sum to 1"),
        ("clients.budget_tiers=[{share = 1.0, download = -3}]", "budget_tiers.0.download"),
        ("clients.budget_tiers=[{share = 1.0, bandwidth = 3}]", "unknown config key"),
        ("model.init='pissa'", "cannot use model.init = 'pissa'"),
        ("train.weight_decay=0.01", "set train.weight_decay = 0"),
        ("strategy.allocation='best'", "strategy.allocation"),
    ],
)
def test_bad_fedhera_config_is_a_one_line_error(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(ROOT / "configs/smoke.toml", ["strategy.name=fedhera", override])


# size keys configs/fedhera.toml may cut; every other key must be the scenario's
SIZE_KEYS = {
    "data": {"max_examples", "num_clients", "global_test_size"},
    # precision: the scenario pins fp32 for its records, the config runs the machine's best;
    # lr_decay_rounds: the same share of the rounds (checked below)
    "train": {"rounds", "precision", "lr_decay_rounds"},
    "federation": {"evaluate_every"},
}


def test_the_fedhera_config_is_the_fidelity_scenario_at_a_smaller_size() -> None:
    # Prepare
    small = load_config(ROOT / "configs/fedhera.toml").model_dump(mode="json")
    scenario = load_config(ROOT / "configs/scenarios/fedhera.toml").model_dump(mode="json")
    # Execute: every section a run's behaviour depends on, minus the size keys and the output folder
    differences = {
        f"{section}.{key}": (small[section].get(key), value)
        for section, keys in scenario.items() if section != "output"
        for key, value in keys.items()
        if key not in SIZE_KEYS.get(section, set()) and small[section].get(key) != value
    }
    # Assert: the same method choices (tiers, budgets, head, partition, local training, options);
    # smaller, and still tiered: each tier holds at least one client
    assert differences == {}
    assert small["data"]["num_clients"] < scenario["data"]["num_clients"]
    assert small["train"]["rounds"] < scenario["train"]["rounds"]
    # the rate is halved once, after the same share of the rounds (60 %: round 61 of 100, 10 of 15)
    (decay,), (small_decay,) = scenario["train"]["lr_decay_rounds"], small["train"]["lr_decay_rounds"]
    assert (decay - 1) / scenario["train"]["rounds"] == (small_decay - 1) / small["train"]["rounds"] == 0.6
    config = load_config(ROOT / "configs/fedhera.toml")
    budgets = {resolve_profile(config, {"partition-id": i}).budgets["download"] for i in range(config.data.num_clients)}
    assert len(budgets) == 3


# ------------------------------------------------------------------------- end to end


def run_smoke(tmp_path: Path, extra: list[str]) -> dict:
    from fedlora.app.runner import run_inprocess

    config = load_config(
        ROOT / "configs/smoke.toml",
        ["strategy.name=fedhera", "clients.ranks=[2, 4, 8]", "train.rounds=3", TIGHT_TIERS, *extra],
    )
    run_inprocess(config, tmp_path)
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.e2e
def test_inprocess_fedhera_never_exceeds_a_download_budget(tmp_path: Path) -> None:
    # Execute: with the adaptive tail warm-up (off by default, as in the official code)
    results = run_smoke(tmp_path, ["strategy.atw=true"])
    # Assert: round 1 trains every client at model.lora_rank (4) whatever its budget (official round 0);
    # from round 2 on every download fits its budget; no failures; ranks and tails as declared
    assert [r["failures"] for r in results["rounds"]] == [0, 0, 0]
    first = results["rounds"][0]["extra"]["fedhera"]["clients"]
    assert {row["r_tot"] for row in first.values()} == {4 * 4} and not any(row["budget_applies"] for row in first.values())
    head_bytes = (8 * 32 + 8) * 4
    for record in results["rounds"]:
        fedhera = record["extra"]["fedhera"]
        assert fedhera["budget_violations"] == 0
        assert set(fedhera["clients"]) == {"0", "1", "2"}
        for row in fedhera["clients"].values():
            assert not row["budget_applies"] or row["download_bytes"] <= row["download_budget"]
            assert row["download_bytes"] == head_bytes + 256 * row["r_tot"]  # a column: (32 + 32) x 4 bytes
        assert record["bytes_down"] == sum(row["download_bytes"] for row in fedhera["clients"].values())
        # every client uploads exactly the columns it received (frozen ones too, unadapted ones not)
        assert record["bytes_up"] == record["bytes_down"]
    later = results["rounds"][-1]["extra"]["fedhera"]["clients"]
    assert all(row["budget_applies"] for row in later.values())
    assert later["2"]["r_tot"] > later["1"]["r_tot"] > later["0"]["r_tot"] == 2  # the higher tier downloads more
    assert later["0"]["r_main"] == 1 < later["0"]["r_tot"]  # the low tier trains a prefix, with a tail
    # round 3 trains on the push of the official round e = 1, the score stamped at t = 1: lambda <= 1 - exp(-2)
    assert 0.0 <= later["0"]["lambda"] <= 1 - math.exp(-2.0) + 1e-9
    for record in results["rounds"]:
        assert_accuracies_add_up(record, results["config"]["data"]["global_test_size"])
    # seen acting: per tier the mean rank per module; the low tier's 2 columns leave >= 2 of its 4
    # modules unadapted (not sent, not uploaded: the uploads passed the shape check) and its one
    # trained column leaves 3 frozen; lambda over the sampled clients
    extra = results["rounds"][-1]["extra"]
    assert extra["fedhera_r_tot_low"] == 0.5 and extra["fedhera_r_main_low"] == 0.25
    assert extra["fedhera_unadapted_low"] >= 2 and extra["fedhera_frozen_low"] == 3
    assert extra["fedhera_r_tot_high"] == later["2"]["r_tot"] / 4 and extra["fedhera_frozen_high"] == 0
    lambdas = [row["lambda"] for row in later.values()]
    assert extra["fedhera_lambda_min"] == min(lambdas) and extra["fedhera_lambda_max"] == max(lambdas)
    assert results["rounds"][0]["extra"]["fedhera_r_tot_low"] == 4.0  # round 1: model.lora_rank everywhere


@pytest.mark.slow
def test_inprocess_fedhera_ablations_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fedlora.methods.fedhera as method_module

    # Prepare: watch which of the method's functions (its home, which the strategy calls them from)
    # the strategy calls, and with what (the real functions still run): each ablation must reach
    # the math it names
    calls: dict[str, list[str]] = {"aggregate_original": [], "aggregate_unbiased": [], "tail_lambda": [],
                                   "allocate_download": [], "allocate_training": []}

    def spy(name: str, policy_at: int | None = None):
        real = getattr(method_module, name)

        def wrapper(*args, **kwargs):
            calls[name].append(args[policy_at] if policy_at is not None else "")
            return real(*args, **kwargs)
        monkeypatch.setattr(method_module, name, wrapper)

    for name in ("aggregate_original", "aggregate_unbiased", "tail_lambda"):
        spy(name)
    spy("allocate_download", policy_at=5)  # (spectra, column_bytes, budget, min_rank, max_rank, policy, rng)
    spy("allocate_training", policy_at=7)  # (spectra, r_tot, time_cost, memory_cost, T, M, min_rank, policy)
    # Execute: coupled ranks, random allocation, unbiased aggregation, no tail warm-up
    results = run_smoke(
        tmp_path,
        ["strategy.coupled=true", "strategy.allocation='random'", "strategy.aggregation='unbiased'", "strategy.atw=false"],
    )
    # Assert: coupled (r_main = r_tot), no ATW (lambda 1, the schedule never evaluated), every
    # aggregation the unbiased one, every allocation after round 1 the random one
    for record in results["rounds"]:
        assert record["failures"] == 0
        for row in record["extra"]["fedhera"]["clients"].values():
            assert not row["budget_applies"] or row["download_bytes"] <= row["download_budget"]
            assert row["r_main"] == row["r_tot"] and row["lambda"] == 1.0
    assert len(calls["aggregate_unbiased"]) == 3 and calls["aggregate_original"] == [] and calls["tail_lambda"] == []
    assert calls["allocate_download"] and set(calls["allocate_download"]) == set(calls["allocate_training"]) == {"random"}


# ------------------------------------------------------------------------- causal LM: the received metric


class EchoLM:
    """A stand-in causal LM over a vocabulary of 5: at every position it gives the current input
    token logit log 4 and every other token 0, so it predicts "the next token repeats this one"
    with p = 4 / 8 = 1/2 (a wrong token: 1/8)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def to(self, device):
        return self

    def eval(self):
        return self

    def __call__(self, input_ids, attention_mask, logits_to_keep):
        from types import SimpleNamespace

        logits = self.torch.nn.functional.one_hot(input_ids, 5).float() * math.log(4.0)  # (batch, seq, 5)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


def test_teacher_forced_token_accuracy_and_loss_on_a_hand_example() -> None:
    import torch

    from fedlora.causal_lm import IGNORE_INDEX, teacher_forced

    # Prepare: two batches; position t predicts token t + 1, only labelled tokens count
    #   batch 1: inputs 1 2 2 3 3, labels - - 2 3 3: predictions 2 2 3 (from positions 1-3) against
    #            2 3 3: 2 hits of 3, NLL 2 log 2 + log 8 = 5 log 2
    #   batch 2: inputs 4 4 0, labels - 4 - (padding): prediction 4 against 4: 1 hit, NLL log 2
    ignore = IGNORE_INDEX
    loader = [
        {"input_ids": torch.tensor([[1, 2, 2, 3, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long),
         "labels": torch.tensor([[ignore, ignore, 2, 3, 3]])},
        {"input_ids": torch.tensor([[4, 4, 0]]), "attention_mask": torch.tensor([[1, 1, 0]]),
         "labels": torch.tensor([[ignore, 4, ignore]])},
    ]
    # Execute
    scored = teacher_forced(EchoLM(), loader, torch.device("cpu"))
    # Assert: 3 hits of 4 response tokens, loss 6 log 2 / 4 per token
    assert scored.tokens == 4
    assert scored.accuracy == pytest.approx(3 / 4)
    assert scored.loss == pytest.approx(6 * math.log(2.0) / 4)


@pytest.mark.e2e
def test_causal_lm_fedhera_reports_the_received_model_teacher_forced(tmp_path: Path) -> None:
    from fedlora.app.runner import run_inprocess

    # Prepare: the tiny random Llama (configs/llm_smoke.toml, 3 clients, every one trains and is
    # evaluated every round), cut to one local step and one scored generation
    config = load_config(ROOT / "configs/llm_smoke.toml", [
        "strategy.name=fedhera", "data.max_examples=120", "train.max_steps=1", "train.rouge_examples=1",
        "train.max_new_tokens=1", "output.sample_generations=0",
    ])
    # Execute
    rounds = run_inprocess(config, tmp_path).to_dict()["rounds"]
    # Assert: round 2's received model is the push each client was evaluated with after round 1
    # (ATW off: lambda = 1), on the same local test split: the same loss per response token
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[2]["received_loss"] == pytest.approx(rounds[1]["personalized_loss"], abs=1e-9)
    for record in rounds[1:]:
        assert record["received_loss"] > 0 and 0.0 <= record["received_token_accuracy"] <= 1.0
        assert record["received_accuracy"] is None  # classification accuracy: not a causal LM's

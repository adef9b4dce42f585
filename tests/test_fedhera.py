"""FedHera: budgets, water-filling allocation, spectral push, aggregation, prefix gating, end to end."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import ConfigError, load_config
from fedlora.lora import Factors, LowRankSVD, factor_svd
from fedlora.methods.fedhera import (
    aggregate_original,
    aggregate_unbiased,
    alignment_score,
    allocate_download,
    allocate_training,
    push_round_of,
    scale_tail,
    scored_round_of,
    spectral_push,
    tail_lambda,
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


def captured_energy(spectra: dict[str, np.ndarray], ranks: dict[str, int]) -> float:
    return float(sum(np.sum(spectra[m][: ranks[m]] ** 2) for m in spectra))


# ------------------------------------------------------------------------- allocation


def test_greedy_download_allocation_on_a_hand_made_spectrum() -> None:
    # Prepare: equal column costs, room for 6 columns; rank 1 everywhere first (10, 8, 2), then
    # the three largest remaining sigma are 7 (b), 6 (b), 5 (a)
    spectra = {"a": np.array([10.0, 5.0, 1.0]), "b": np.array([8.0, 7.0, 6.0]), "c": np.array([2.0, 1.0])}
    cost = {m: 100 for m in spectra}
    # Execute
    ranks = allocate_download(spectra, cost, budget=600, min_rank=1, max_rank={m: 3 for m in spectra})
    # Assert
    assert ranks == {"a": 2, "b": 3, "c": 1}


@pytest.mark.parametrize("budget", [300, 450, 600, 700, 900])
def test_greedy_download_allocation_is_optimal_with_equal_costs(budget: int) -> None:
    # Prepare: brute force over every allocation that fits the budget
    spectra = {"a": np.array([9.0, 4.0, 3.0, 0.5]), "b": np.array([6.0, 5.5, 1.0]), "c": np.array([7.0, 2.0])}
    cost = {m: 100 for m in spectra}
    max_rank = {"a": 4, "b": 4, "c": 4}
    feasible = [
        dict(zip(spectra, r))
        for r in itertools.product(range(1, 5), repeat=3)
        if 100 * sum(r) <= budget
    ]
    best = max(captured_energy(spectra, r) for r in feasible)
    # Execute
    ranks = allocate_download(spectra, cost, budget, 1, max_rank)
    # Assert: within budget, as much energy as the best feasible allocation
    assert sum(ranks[m] * cost[m] for m in ranks) <= budget
    assert captured_energy(spectra, ranks) == pytest.approx(best)


@pytest.mark.parametrize("policy", ["greedy", "uniform", "random"])
@pytest.mark.parametrize(
    "costs, budget",
    [
        ({"a": 256, "b": 256, "c": 256}, 2100),
        ({"a": 100, "b": 260, "c": 700}, 2100),  # heterogeneous module shapes
        ({"a": 100, "b": 260, "c": 700}, 1061),  # one byte above the minimum
    ],
)
def test_download_allocation_respects_the_budget_and_is_maximal(policy, costs, budget) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    spectra = {m: np.sort(rng.uniform(0, 5, 6))[::-1] for m in costs}
    max_rank = {m: 8 for m in costs}
    # Execute
    ranks = allocate_download(spectra, costs, budget, 1, max_rank, policy, np.random.default_rng(1))
    # Assert: within budget, and no further column would have fitted
    spent = sum(ranks[m] * costs[m] for m in costs)
    assert spent <= budget
    assert all(ranks[m] == max_rank[m] or costs[m] > budget - spent for m in costs)


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
def test_training_allocation_respects_time_memory_and_r_tot(policy, time_budget, memory_budget) -> None:
    # Prepare
    spectra = {"a": np.array([5.0, 4.0, 3.0, 2.0]), "b": np.array([6.0, 1.0, 0.5])}
    r_tot = {"a": 4, "b": 3}
    time_cost, memory_cost = {"a": 50.0, "b": 40.0}, {"a": 30.0, "b": 60.0}
    # Execute
    r_main = allocate_training(spectra, r_tot, time_cost, memory_cost, time_budget, memory_budget, 1, policy)
    # Assert
    assert all(1 <= r_main[m] <= r_tot[m] for m in r_tot)
    assert sum(r_main[m] * time_cost[m] for m in r_main) <= time_budget
    assert sum(r_main[m] * memory_cost[m] for m in r_main) <= memory_budget
    if math.isinf(time_budget) and math.isinf(memory_budget):
        assert r_main == r_tot


def test_greedy_training_allocation_follows_the_spectrum() -> None:
    # Prepare: equal costs, room for 4 columns: rank 1 each (5, 6), then 4 (a) and 3 (a)
    spectra = {"a": np.array([5.0, 4.0, 3.0, 2.0]), "b": np.array([6.0, 1.0, 0.5])}
    cost = {"a": 10.0, "b": 10.0}
    # Execute
    r_main = allocate_training(spectra, {"a": 4, "b": 3}, cost, cost, 40.0, 40.0, 1)
    # Assert
    assert r_main == {"a": 3, "b": 1}


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
    original = aggregate_original(updates, w)
    unbiased = aggregate_unbiased(previous, updates, starts, w)
    # Assert
    assert np.allclose(dense(original["m"]), w[0] * product[0] + w[1] * product[1])
    expected = dense(previous["m"]) + sum(wi * (p - p0) for wi, p, p0 in zip(w, product, start_product))
    assert np.allclose(dense(unbiased["m"]), expected)


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
    G = aggregate_original(scaled, weights)
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

    from clients.trainers.fedhera import gate_prefix, prefix_parameters
    from fedlora.training import cross_entropy_loss

    # Prepare: r_tot 4, r_main 2 everywhere
    model = tiny_model_factory(4)
    model.eval()  # no dropout: deterministic
    params = prefix_parameters(model)
    r_main = {m: 2 for m in params}
    before = {m: (A.detach().clone(), B.detach().clone()) for m, (A, B) in params.items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    # Execute
    cross_entropy_loss(model, tiny_batch()).backward()
    gate_prefix(params, r_main)
    grads = {m: (A.grad.clone(), B.grad.clone()) for m, (A, B) in params.items()}
    optimizer.step()
    # Assert: exact zeros outside A[:2], B[:, :2]; the prefix does get gradient; the tail is unchanged
    assert len(params) == 4
    for m, (gA, gB) in grads.items():
        assert torch.count_nonzero(gA[2:]) == 0 and torch.count_nonzero(gB[:, 2:]) == 0
        assert torch.count_nonzero(gA[:2]) > 0 and torch.count_nonzero(gB[:, :2]) > 0
        A, B = params[m]
        assert torch.equal(A[2:], before[m][0][2:]) and torch.equal(B[:, 2:], before[m][1][:, 2:])
        assert not torch.equal(A[:2], before[m][0][:2])


def test_the_frozen_tail_still_changes_the_forward_output(tiny_model_factory) -> None:
    import torch

    from clients.trainers.fedhera import prefix_parameters
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


# ------------------------------------------------------------------------- end to end


def run_smoke(tmp_path: Path, extra: list[str]) -> dict:
    from fedlora.app.runner import run_inprocess

    config = load_config(
        ROOT / "configs/smoke.toml",
        ["strategy.name=fedhera", "clients.ranks=[2, 4, 8]", "train.rounds=3", SMOKE_TIERS, *extra],
    )
    run_inprocess(config, tmp_path)
    return json.loads((tmp_path / "results.json").read_text())


def test_inprocess_fedhera_never_exceeds_a_download_budget(tmp_path: Path) -> None:
    # Execute: with the adaptive tail warm-up (off by default, as in the official code)
    results = run_smoke(tmp_path, ["strategy.atw=true"])
    # Assert: round 1 trains every client at model.lora_rank (4) whatever its budget (official round 0);
    # from round 2 on every download fits its budget; no failures; ranks and tails as declared
    assert [r["failures"] for r in results["rounds"]] == [0, 0, 0]
    first = results["rounds"][0]["extra"]["fedhera"]["clients"]
    assert {row["r_tot"] for row in first.values()} == {4 * 4} and not any(row["budget_applies"] for row in first.values())
    for record in results["rounds"]:
        fedhera = record["extra"]["fedhera"]
        assert fedhera["budget_violations"] == 0
        assert set(fedhera["clients"]) == {"0", "1", "2"}
        for row in fedhera["clients"].values():
            assert not row["budget_applies"] or row["download_bytes"] <= row["download_budget"]
        assert record["bytes_down"] == sum(row["download_bytes"] for row in fedhera["clients"].values())
    later = results["rounds"][-1]["extra"]["fedhera"]["clients"]
    assert all(row["budget_applies"] for row in later.values())
    assert later["2"]["r_tot"] > later["0"]["r_tot"]  # the high tier downloads more of the spectrum
    assert later["0"]["r_main"] < later["0"]["r_tot"]  # the low tier trains a prefix, with a tail
    # round 3 trains on the push of the official round e = 1, the score stamped at t = 1: lambda <= 1 - exp(-2)
    assert 0.0 <= later["0"]["lambda"] <= 1 - math.exp(-2.0) + 1e-9
    assert results["final"]["global_accuracy"] is not None


@pytest.mark.slow
def test_inprocess_fedhera_ablations_run(tmp_path: Path) -> None:
    # Execute: coupled ranks, random allocation, unbiased aggregation, no tail warm-up
    results = run_smoke(
        tmp_path,
        ["strategy.coupled=true", "strategy.allocation='random'", "strategy.aggregation='unbiased'", "strategy.atw=false"],
    )
    # Assert
    for record in results["rounds"]:
        assert record["failures"] == 0
        for row in record["extra"]["fedhera"]["clients"].values():
            assert not row["budget_applies"] or row["download_bytes"] <= row["download_budget"]
            assert row["r_main"] == row["r_tot"] and row["lambda"] == 1.0

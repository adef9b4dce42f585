"""Heterogeneous-rank baselines: FlexLoRA, HetLoRA, FLoRA (known answers on hand-made factors),
mixed-rank rounds end to end, the byte ledger, rank refusal and the mixed-rank policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strategy_helpers
from result_checks import assert_accuracies_add_up

from fedlora.config import ConfigError, load_config
from fedlora.lora import (
    Factors,
    batched_factor_svd,
    concat_stacks,
    dense_svd,
    from_array_record,
    payload_bytes,
    product_norm,
    read_stacks,
    split_payload,
    stack_factors,
)
from fedlora.lora import leading_factors as flexlora_factors
from fedlora.lora import stack as flora_stack
from fedlora.methods.flexlora import flexlora_aggregate
from fedlora.methods.hetlora import hetlora_aggregate, pruned_rank
from fedlora.profile import ClientProfile
from fedlora.simulations.inprocess import InProcessGrid, node_configs
from fedlora.strategies.base import ClientUpload
from fedlora.strategies.flexlora import FlexLoRA
from fedlora.strategies.flora import FLoRA
from fedlora.strategies.hetlora import HetLoRA
from fedlora.strategies.validation import check_upload
from fedlora.version import __version__

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
SMOKE_RANKS = [2, 4, 8]  # configs/smoke.toml
TINY_MODULES = 4  # tiny-bert: 2 layers x (query, value), 32 x 32 each
TINY_DIM = 32


def random_factors(rng: np.random.Generator, d_out: int, d_in: int, r: int) -> Factors:
    return Factors(rng.standard_normal((r, d_in)).astype(np.float32), rng.standard_normal((d_out, r)).astype(np.float32))


# ------------------------------------------------------------------------------ FLoRA
@pytest.mark.parametrize(
    "ranks, weights, alpha",
    [
        ([2, 4, 8], [0.2, 0.3, 0.5], 16.0),
        ([1, 1], [0.5, 0.5], 1.0),
        ([8, 3, 5, 2], [0.1, 0.4, 0.25, 0.25], 8.0),
    ],
)
def test_flora_stacked_product_equals_weighted_sum(ranks: list[int], weights: list[float], alpha: float) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    clients = [{"m": random_factors(rng, 12, 9, r)} for r in ranks]
    scales = [alpha / r for r in ranks]
    # Execute
    stack = flora_stack(clients, weights, scales)["m"]
    # Assert: B A = sum_k p_k s_k B_k A_k, stacked rank = sum r_k
    expected = sum(p * s * (c["m"].B.astype(np.float64) @ c["m"].A) for c, p, s in zip(clients, weights, scales))
    assert stack.A.shape == (sum(ranks), 9) and stack.B.shape == (12, sum(ranks))
    assert np.allclose(stack.B.astype(np.float64) @ stack.A, expected, atol=1e-5)


def test_flora_rounds_concatenate_and_compress_exactly() -> None:
    # Prepare: three rounds of stacked rank 6 on a 10 x 7 module: 18 >= 7 forces the compression
    rng = np.random.default_rng(1)
    stacks = [{"m": random_factors(rng, 10, 7, 6)} for _ in range(3)]
    # Execute
    total = concat_stacks(stacks)["m"]
    # Assert
    expected = sum(s["m"].B.astype(np.float64) @ s["m"].A for s in stacks)
    assert total.rank == 7
    assert np.allclose(total.B.astype(np.float64) @ total.A, expected, atol=1e-4)


def small_strategy(cls: type, ranks: list[int], options: list[str] | None = None, alpha: float = 8.0) -> Any:
    """strategy_helpers.small_strategy with LoRA alpha ``alpha`` and a seeded random initial A."""
    rng = np.random.default_rng(0)
    return strategy_helpers.small_strategy(cls, ranks, [f"model.lora_alpha={alpha}", *(options or [])],
                                           lambda rank: rng.standard_normal((rank, 5)).astype(np.float32))


def fake_upload(rng: np.random.Generator, k: int, rank: int, n: int) -> ClientUpload:
    f = random_factors(rng, 6, 5, rank)
    payload = {"m::A": f.A, "m::B": f.B, "head::classifier.weight": np.full((2, 6), float(k), np.float32)}
    return ClientUpload(partition_id=k, payload=payload, num_examples=n, metrics={})


def test_flora_global_model_is_base_plus_every_merged_product() -> None:
    # Prepare: ranks 1, 2 (scales 8, 4), alpha 8; client 1 misses round 2
    strategy = small_strategy(FLoRA, [1, 2])
    rng = np.random.default_rng(2)
    round1 = [fake_upload(rng, 0, 1, 10), fake_upload(rng, 1, 2, 30)]
    round2 = [fake_upload(rng, 0, 1, 10)]
    # Execute
    for server_round, uploads in ((1, round1), (2, round2)):
        for upload in uploads:  # what the base attaches to a reply it reads: the download it answers
            upload.download = strategy.download(upload.partition_id, server_round, "train")
        strategy.aggregate(server_round, uploads)
    payload = strategy.global_payload()
    catch_up = read_stacks(strategy.download(1, 3, "train").payload)
    # Assert: s_R B A with R = 3 + 1 = 4 is the sum of both rounds' p_k s_k B_k A_k
    def product(u: ClientUpload) -> np.ndarray:
        return u.payload["m::B"].astype(np.float64) @ u.payload["m::A"]
    expected = 0.25 * 8.0 * product(round1[0]) + 0.75 * 4.0 * product(round1[1]) + 1.0 * 8.0 * product(round2[0])
    R = payload["m::A"].shape[0]
    assert R == 4
    assert np.allclose((8.0 / R) * payload["m::B"].astype(np.float64) @ payload["m::A"], expected, atol=1e-5)
    assert sorted(catch_up) == [1, 2]  # client 1 never confirmed round 1's stack either (no reply since)
    assert np.allclose(payload["head::classifier.weight"], 0.0)  # round 2: only client 0 (head 0)


# ------------------------------------------------------------------------------ FlexLoRA
@pytest.mark.parametrize(
    "d_out, d_in, ranks",
    [
        (40, 30, [2, 4, 8]),  # stacked rank 14 < 30: the QR path
        (12, 10, [4, 4, 8]),  # 16 >= 10: the dense fallback
    ],
)
def test_flexlora_factor_space_equals_dense_svd(d_out: int, d_in: int, ranks: list[int]) -> None:
    # Prepare
    rng = np.random.default_rng(3)
    clients = [{"m": random_factors(rng, d_out, d_in, r)} for r in ranks]
    weights, alpha = [0.5, 0.3, 0.2], 16.0
    scales = [alpha / r for r in ranks]
    # Execute
    svd = flexlora_aggregate(clients, weights, scales)["m"]
    pushed = {r: flexlora_factors(svd, r, alpha / r) for r in ranks}
    # Assert: same spectrum as the dense SVD; s_k B_k A_k is the dense rank-r_k truncation
    ref = dense_svd([c["m"].B for c in clients], [c["m"].A for c in clients], [p * s for p, s in zip(weights, scales)])
    k = min(len(svd.S), len(ref.S))
    assert np.allclose(svd.S[:k], ref.S[:k], rtol=1e-5, atol=1e-8 * ref.S[0])
    for r, f in pushed.items():
        assert f.A.shape == (r, d_in) and f.B.shape == (d_out, r)
        truncated = (ref.U[:, :r] * ref.S[:r]) @ ref.Vt[:r]
        assert np.allclose((alpha / r) * f.B.astype(np.float64) @ f.A, truncated, atol=1e-4 * ref.S[0])


@pytest.mark.parametrize(
    "dtype, shared_A, rtol",
    [
        (np.float64, False, 1e-9),
        (np.float64, True, 1e-9),  # clients with one A: a rank-deficient stack
        (np.float32, False, 1e-4),
    ],
)
def test_batched_factor_svd_equals_dense_svd(dtype: type, shared_A: bool, rtol: float) -> None:
    # Prepare: 3 modules of 50 x 40, ranks 2, 4, 4 (R = 10)
    rng = np.random.default_rng(8)
    Bs = [rng.standard_normal((3, 50, r)).astype(dtype) for r in (2, 4, 4)]
    As = [rng.standard_normal((3, r, 40)).astype(dtype) for r in (2, 4, 4)]
    if shared_A:
        As[2] = As[1].copy()
    weights = [0.2, 0.5, 0.3]
    # Execute
    B, A = stack_factors(Bs, As, weights)
    svd = batched_factor_svd(B, A)
    top = batched_factor_svd(B, A, rank=3)
    # Assert: per module, the same spectrum and the same rank-3 truncation as the dense SVD
    for m in range(3):
        ref = dense_svd([b[m] for b in Bs], [a[m] for a in As], weights)
        assert np.allclose(svd.S[m], ref.S[:10], rtol=rtol, atol=rtol * ref.S[0])
        rebuilt = (top.U[m] * top.S[m]) @ top.Vt[m]
        assert np.allclose(rebuilt, (ref.U[:, :3] * ref.S[:3]) @ ref.Vt[:3], atol=10 * rtol * ref.S[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batched_factor_svd_of_zero_and_rank_one_stacks_is_finite_and_exact(dtype: type) -> None:
    # Prepare: module 0 has all-zero B (round one of LoRA), module 1 is rank one (R = 6)
    rng = np.random.default_rng(9)
    B = np.zeros((2, 30, 6), dtype)
    A = rng.standard_normal((2, 6, 20)).astype(dtype)
    u, v = rng.standard_normal(30), rng.standard_normal(6)
    B[1] = np.outer(u, v).astype(dtype)
    # Execute: the 3 leading components (partial eigendecomposition)
    svd = batched_factor_svd(B, A, rank=3)
    # Assert: no NaN; zero module -> zero spectrum; rank-one module -> one component, exact
    assert all(np.isfinite(x).all() for x in svd)
    assert np.all(svd.S[0] == 0) and np.allclose(svd.S[1, 1:], 0)
    dense = B[1].astype(np.float64) @ A[1]
    assert np.isclose(svd.S[1, 0], np.linalg.norm(dense), rtol=1e-4)
    assert np.allclose((svd.U[1] * svd.S[1]) @ svd.Vt[1], dense, atol=1e-4 * np.linalg.norm(dense))


def test_flexlora_pads_when_the_aggregate_has_fewer_components_than_the_rank() -> None:
    # Prepare: only a rank-2 client took part; a rank-8 client must still get rank 8
    rng = np.random.default_rng(4)
    svd = flexlora_aggregate([{"m": random_factors(rng, 20, 16, 2)}], [1.0], [4.0])["m"]
    # Execute
    f = flexlora_factors(svd, 8, 2.0)
    # Assert
    assert f.A.shape == (8, 16) and f.B.shape == (20, 8)
    assert np.allclose(2.0 * f.B.astype(np.float64) @ f.A, (svd.U * svd.S) @ svd.Vt, atol=1e-4)


def test_flexlora_global_model_is_the_aggregate_itself() -> None:
    # Prepare: ranks 1, 2, alpha 8
    strategy = small_strategy(FlexLoRA, [1, 2])
    rng = np.random.default_rng(5)
    uploads = [fake_upload(rng, 0, 1, 10), fake_upload(rng, 1, 2, 30)]
    # Execute
    strategy.aggregate(1, uploads)
    payload = strategy.global_payload()
    # Assert: s_R B A = 0.25 * 8 * B_0 A_0 + 0.75 * 4 * B_1 A_1 with R = 3
    expected = sum(p * s * (u.payload["m::B"].astype(np.float64) @ u.payload["m::A"])
                   for p, s, u in zip([0.25, 0.75], [8.0, 4.0], uploads))
    R = payload["m::A"].shape[0]
    assert R == 3
    assert np.allclose((8.0 / R) * payload["m::B"].astype(np.float64) @ payload["m::A"], expected, atol=1e-4)
    assert np.allclose(payload["head::classifier.weight"], 0.75)


# ------------------------------------------------------------------------------ HetLoRA
def test_product_norm_equals_dense_frobenius_norm() -> None:
    rng = np.random.default_rng(6)
    f = random_factors(rng, 30, 20, 5)
    assert product_norm(f) == pytest.approx(np.linalg.norm(f.B.astype(np.float64) @ f.A), rel=1e-6)


def test_hetlora_pad_weight_truncate_by_hand() -> None:
    # Prepare: client 0 rank 1 with B A = [[2, 0], [0, 0]] (norm 2); client 1 rank 2 with
    # B = 2 I, A = I (norm 2 sqrt 2)
    c0 = {"m": Factors(np.array([[1.0, 0.0]], np.float32), np.array([[2.0], [0.0]], np.float32))}
    c1 = {"m": Factors(np.eye(2, dtype=np.float32), 2 * np.eye(2, dtype=np.float32))}
    w0, w1 = 2 / (2 + 2 * np.sqrt(2)), 2 * np.sqrt(2) / (2 + 2 * np.sqrt(2))
    # Execute
    agg = hetlora_aggregate([c0, c1], rank=2, examples=[1, 1])["m"]
    by_examples = hetlora_aggregate([c0, c1], rank=2, examples=[3, 1], weighting="examples")["m"]
    # Assert: padded rows / columns are zero, so client 0 only adds to component 0
    assert np.allclose(agg.A, [[w0 + w1, 0.0], [0.0, w1]])
    assert np.allclose(agg.B, [[2 * w0 + 2 * w1, 0.0], [0.0, 2 * w1]])
    assert np.allclose(by_examples.A, [[1.0, 0.0], [0.0, 0.25]])
    assert np.allclose(by_examples.B, [[2.0, 0.0], [0.0, 0.5]])


def test_hetlora_truncates_the_global_factors_to_each_rank() -> None:
    # Prepare
    strategy = small_strategy(HetLoRA, [1, 3])
    rng = np.random.default_rng(7)
    uploads = [fake_upload(rng, 0, 1, 10), fake_upload(rng, 1, 3, 10)]
    # Execute
    strategy.aggregate(1, uploads)
    downloads = {k: strategy.download(k, 2, "train").payload for k in (0, 1)}
    # Assert
    glob = strategy.global_factors["m"]
    assert glob.rank == 3
    assert np.array_equal(downloads[0]["m::A"], glob.A[:1]) and np.array_equal(downloads[0]["m::B"], glob.B[:, :1])
    assert np.array_equal(downloads[1]["m::A"], glob.A) and np.array_equal(downloads[1]["m::B"], glob.B)


def test_hetlora_rejects_an_unknown_weighting() -> None:
    with pytest.raises(ConfigError, match="strategy.weighting"):
        load_config(SMOKE, ["strategy.name=hetlora", "strategy.weighting=median"])


@pytest.mark.parametrize("rank, decay, kept", [(8, 0.75, 6), (4, 0.75, 3), (2, 0.75, 1), (1, 0.75, 1), (8, 0.5, 4)])
def test_pruned_rank_is_floor_of_decay_times_rank_and_at_least_one(rank: int, decay: float, kept: int) -> None:
    assert pruned_rank(rank, decay) == kept


def test_hetlora_self_pruning_accepts_the_reported_pruned_rank_and_cuts_later_downloads() -> None:
    # Prepare: ranks 4 and 4 with self-pruning (gamma 0.75: 4 -> 3)
    strategy = small_strategy(HetLoRA, [4, 4], ["strategy.self_prune=true"])
    rng = np.random.default_rng(3)
    # Execute: client 0 reports and uploads rank 3, client 1 stays at 4
    expected = {k: strategy.download(k, 1, "train").expected({"upload-rank": rank})["m::A"] for k, rank in ((0, 3.0), (1, 4.0))}
    strategy.aggregate(1, [fake_upload(rng, 0, 3, 10), fake_upload(rng, 1, 4, 10)])
    # Assert: shapes checked at the reported rank; the pruned client stays at rank 3 from now on
    assert expected == {0: (3, 5), 1: (4, 5)}
    assert strategy.ranks == {0: 3, 1: 4}
    assert strategy.download(0, 2, "train").payload["m::A"].shape == (3, 5) and strategy.download(1, 2, "train").payload["m::B"].shape == (6, 4)
    assert strategy.rank_of(0) == 3  # every later message says lora-rank = 3
    assert strategy.round_extra(1) == {"ranks": {"0": 3, "1": 4}}
    assert strategy.global_factors["m"].rank == 4  # padded to r_max as before


@pytest.mark.parametrize("reported", [2.0, 5.0, 0.0])
def test_hetlora_self_pruning_refuses_a_rank_other_than_current_or_pruned(reported: float) -> None:
    # Prepare: rank 4 (may report 4 or 3 only)
    strategy = small_strategy(HetLoRA, [4], ["strategy.self_prune=true"])
    # Execute
    expected = strategy.download(0, 2, "train").expected({"upload-rank": reported})
    # Assert: the upload is checked against the current rank, so a rank-2 upload is malformed
    assert expected["m::A"] == (4, 5)
    f = random_factors(np.random.default_rng(0), 6, 5, int(reported) or 1)
    assert check_upload({"m::A": f.A, "m::B": f.B, "head::classifier.weight": np.zeros((2, 6), np.float32)}, expected)


def test_hetlora_without_self_pruning_ignores_a_reported_rank() -> None:
    strategy = small_strategy(HetLoRA, [4])
    assert strategy.download(0, 2, "train").expected({"upload-rank": 3.0})["m::A"] == (4, 5)
    assert strategy.download(0, 1, "train").config == {}


def test_lora_tail_norm_is_the_sum_of_tail_factor_norm_products() -> None:
    # Prepare: tiny-bert at rank 4 with random B (peft starts B at zero)
    import torch

    from fedlora.clients.trainers.hetlora import lora_tail_norm, prune_payload
    from fedlora.models import adapter_payload, build_model

    config = load_config(SMOKE)
    model = build_model(config.model, 3, 4, seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_()
    payload = adapter_payload(model)
    factors, head = split_payload(payload)
    # Execute
    with torch.no_grad():
        tail = float(lora_tail_norm(model, 3))
    pruned = prune_payload(payload, 3)
    # Assert
    expected = sum(np.linalg.norm(f.B[:, 3:]) * np.linalg.norm(f.A[3:]) for f in factors.values())
    assert np.isclose(tail, expected, rtol=1e-5) and tail > 0
    cut, cut_head = split_payload(pruned)
    assert all(np.array_equal(cut[m].A, f.A[:3]) and np.array_equal(cut[m].B, f.B[:, :3]) for m, f in factors.items())
    assert cut_head.keys() == head.keys()


# ------------------------------------------------------------------------------ end to end
class RecordingGrid(InProcessGrid):
    """InProcessGrid that keeps every message and reply (type, node, round, arrays)."""

    def __init__(self, client_app: Any, configs: list[dict[str, Any]]) -> None:
        super().__init__(client_app, configs)
        self.log: list[dict[str, Any]] = []

    def _deliver(self, message):  # type: ignore[no-untyped-def]
        reply = super()._deliver(message)
        content = message.content
        self.log.append({
            "type": message.metadata.message_type,
            "node": message.metadata.dst_node_id,
            "round": int(content["config"].get("server-round", 0)) if "config" in content else 0,
            "down": from_array_record(content["arrays"]) if "arrays" in content else {},
            "up": {} if reply.has_error() or "arrays" not in reply.content else from_array_record(reply.content["arrays"]),
        })
        return reply


def run_recorded(tmp_path: Path, overrides: list[str], configs: list[dict[str, Any]] | None = None):
    from fedlora.app.server import run_server
    from fedlora.clients.app import app as client_app

    config = load_config(SMOKE, ["output.save_adapters=false", *overrides])
    grid = RecordingGrid(client_app, configs or node_configs(config.data.num_clients))
    writer = run_server(grid, config, tmp_path)
    return writer, grid


def lora_bytes(rank: int) -> int:
    return TINY_MODULES * 2 * rank * TINY_DIM * 4  # A (r x 32) + B (32 x r), float32


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flexlora", "hetlora", "flora"])
def test_mixed_rank_round_every_client_gets_its_own_rank(tmp_path: Path, name: str) -> None:
    # Execute: smoke (ranks 2, 4, 8), 2 rounds, every client every round
    writer, grid = run_recorded(tmp_path, [f"strategy.name={name}"])
    results = writer.to_dict()
    # Assert: uploads at the client's own rank; the ledger equals what crossed the grid
    node_rank = {1000 + k: r for k, r in enumerate(SMOKE_RANKS)}
    train = [e for e in grid.log if e["type"] == "train"]
    assert len(train) == 6
    head = payload_bytes({k: v for k, v in train[0]["up"].items() if k.startswith("head::")})
    for entry in train:
        rank = node_rank[entry["node"]]
        factors, _ = split_payload(entry["up"])
        assert {f.A.shape for f in factors.values()} == {(rank, TINY_DIM)}
        assert {f.B.shape for f in factors.values()} == {(TINY_DIM, rank)}
        if name == "flora":  # down: the stacks of the rounds not merged yet (rank 2 + 4 + 8 each)
            stacks = read_stacks(entry["down"])
            assert sorted(stacks) == list(range(1, entry["round"]))
            assert all(f.rank == sum(SMOKE_RANKS) for s in stacks.values() for f in s.values())
        else:  # down: the client's own rank
            factors, _ = split_payload(entry["down"])
            assert {f.A.shape for f in factors.values()} == {(rank, TINY_DIM)}
    for record in writer.rounds:
        entries = [e for e in train if e["round"] == record.round]
        assert record.failures == 0 and record.clients == 3
        assert record.bytes_up == sum(payload_bytes(e["up"]) for e in entries)
        assert record.bytes_down == sum(payload_bytes(e["down"]) for e in entries)
        assert record.bytes_up == sum(lora_bytes(r) for r in SMOKE_RANKS) + 3 * head
    expected_down_2 = 3 * lora_bytes(sum(SMOKE_RANKS)) if name == "flora" else sum(lora_bytes(r) for r in SMOKE_RANKS)
    assert writer.rounds[1].bytes_down == expected_down_2 + 3 * head
    for record in results["rounds"]:  # the clients' evaluation replies add up to the round's accuracies
        assert_accuracies_add_up(record, results["config"]["data"]["global_test_size"])


@pytest.mark.slow
def test_hetlora_self_pruning_end_to_end_shrinks_ranks_and_the_ledger(tmp_path: Path) -> None:
    # Execute: smoke (ranks 2, 4, 8), 4 rounds, a strong tail regulariser so that tails shrink
    writer, grid = run_recorded(tmp_path, ["strategy.name=hetlora", "strategy.self_prune=true",
                                           "strategy.prune_lambda=1.0", "train.rounds=4"])
    # Assert: ranks only ever step down to floor(0.75 r); every upload at the rank the server then
    # records, every later download at that rank; the ledger is what crossed the grid
    ranks = [{int(k): v for k, v in r.extra["ranks"].items()} for r in writer.rounds]
    previous = dict(enumerate(SMOKE_RANKS))
    for record, after in zip(writer.rounds, ranks):
        assert record.failures == 0
        assert all(after[k] in (previous[k], pruned_rank(previous[k], 0.75)) for k in after)
        train = [e for e in grid.log if e["type"] == "train" and e["round"] == record.round]
        for entry in train:
            k = entry["node"] - 1000
            up, _ = split_payload(entry["up"])
            down, _ = split_payload(entry["down"])
            assert {f.rank for f in up.values()} == {after[k]}
            assert {f.rank for f in down.values()} == {previous[k]}
        assert record.bytes_up == sum(payload_bytes(e["up"]) for e in train)
        assert record.bytes_down == sum(payload_bytes(e["down"]) for e in train)
        previous = after
    assert ranks[-1] != dict(enumerate(SMOKE_RANKS)), "no client pruned in 4 rounds"
    assert writer.rounds[-1].bytes_up < writer.rounds[0].bytes_up


@pytest.mark.slow
def test_flora_clients_catch_up_and_share_one_merged_base(tmp_path: Path) -> None:
    # Execute: one client of three per round, three rounds
    writer, grid = run_recorded(tmp_path, ["strategy.name=flora", "federation.fraction_train=0.34", "train.rounds=3",
                                           "federation.fraction_evaluate=0"])
    # Assert: a client's merged base is the sum of the stacks of every round before its training
    stacks: dict[int, dict[str, Factors]] = {}
    for entry in grid.log:
        stacks |= read_stacks(entry["down"])
    train = [e for e in grid.log if e["type"] == "train"]
    assert [e["round"] for e in train] == [1, 2, 3]
    for entry in train:
        assert sorted(read_stacks(entry["down"])) == sorted(set(range(1, entry["round"])) - {
            t for e in train if e["node"] == entry["node"] and e["round"] < entry["round"] for t in range(1, e["round"])})
    from flwr.app import RecordDict

    from fedlora.checkpoint import CLIENTS_DIR, checkpoint_dir, restore_client_state

    trained = sorted({e["node"] - 1000 for e in train})
    assert trained
    for partition in trained:  # simulation: a client's kept state is in its checkpoint file only
        kept = RecordDict()
        assert restore_client_state(checkpoint_dir(tmp_path) / CLIENTS_DIR, partition, 10**6, kept) > 0
        state = from_array_record(kept["fedlora.local"])
        merged_rounds = [int(t) for t in state["merged-rounds"]]
        for module, delta in ((k.removeprefix("merged::"), v) for k, v in state.items() if k.startswith("merged::")):
            expected = sum(stacks[t][module].B.astype(np.float64) @ stacks[t][module].A for t in merged_rounds)
            assert np.allclose(delta, expected, atol=1e-6)
    assert all(r.failures == 0 for r in writer.rounds)


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [0, -3, 100000])
def test_unsupported_rank_is_refused_and_the_round_continues(tmp_path: Path, bad_rank: int) -> None:
    # Prepare: client 1 declares an impossible rank in its own node config (tiny-bert layers are 32 wide)
    configs = node_configs(3)
    configs[1]["rank"] = bad_rank
    # Execute
    writer, grid = run_recorded(tmp_path, ["strategy.name=flexlora", "train.rounds=1"], configs)
    results = writer.to_dict()
    # Assert: refused with the reason, never sent a training message; the others trained
    assert any(f"unsupported rank {bad_rank}" in reason for reason in results["strategy_info"]["refused"])
    assert writer.rounds[0].refused == [1]
    assert writer.rounds[0].clients == 2 and writer.rounds[0].failures == 0
    assert 1001 not in {e["node"] for e in grid.log if e["type"] == "train"}


# ------------------------------------------------------------------------------ mixed-rank policy
def test_refuse_policy_gives_a_one_line_config_error_for_one_rank_strategies() -> None:
    # Execute / Assert: a same-rank method (fedpissa) with the smoke's ranks [2, 4, 8] is refused at
    # load time; a mixed-rank method (flexlora) with the same clients is accepted
    with pytest.raises(ConfigError, match=r"strategy 'fedpissa' needs one LoRA rank .* ranks \[2, 4, 8\]"):
        load_config(SMOKE, ["clients.mixed_rank_policy=refuse", "strategy.name=fedpissa"])
    load_config(SMOKE, ["clients.mixed_rank_policy=refuse", "strategy.name=flexlora"])


@pytest.mark.parametrize("refuse", [False, True])
def test_one_rank_roster_trains_every_client_at_the_smallest_rank(refuse: bool) -> None:
    from fedlora.strategies.roster import ClientRoster, MixedRanksError

    # Prepare: three clients of ranks 4, 2, 8
    roster = ClientRoster()
    roster.profiles = {k: ClientProfile(partition_id=k, rank=r, fedlora_version=__version__) for k, r in enumerate([4, 2, 8])}
    # Execute / Assert
    if refuse:
        with pytest.raises(MixedRanksError, match="needs one LoRA rank"):
            roster.settle_common_rank(True, "one_rank")
        return
    assert roster.settle_common_rank(False, "one_rank") == 2
    assert {p.rank for p in roster.profiles.values()} == {2}

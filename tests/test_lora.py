"""LoRA factor algebra: round trips, padding, averaging and the factor-space SVD."""

from __future__ import annotations

import numpy as np
import pytest

from fedlora.lora import (
    Factors,
    dense_svd,
    factor_svd,
    from_array_record,
    join_payload,
    pad_rank,
    padded_average,
    payload_bytes,
    split_payload,
    split_spectrum,
    to_array_record,
    truncate_payload,
    truncate_rank,
    weighted_average,
)


def random_factors(rng: np.random.Generator, d_out: int, d_in: int, r: int) -> Factors:
    return Factors(rng.standard_normal((r, d_in)).astype(np.float32), rng.standard_normal((d_out, r)).astype(np.float32))


@pytest.mark.parametrize(
    "d_out, d_in, ranks",
    [
        (64, 48, [2, 4, 8]),  # stacked rank 14 < 48: the QR path
        (128, 128, [16, 16, 16, 16]),  # 64 < 128
        (20, 30, [8, 8, 8]),  # stacked rank 24 >= 20: the dense fallback
    ],
)
def test_factor_svd_equals_dense_svd(d_out: int, d_in: int, ranks: list[int]) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    factors = [random_factors(rng, d_out, d_in, r) for r in ranks]
    weights = rng.uniform(0.1, 1.0, len(ranks))
    Bs, As = [f.B for f in factors], [f.A for f in factors]
    # Execute
    fast = factor_svd(Bs, As, weights)
    ref = dense_svd(Bs, As, weights)
    # Assert: same singular values and same reconstruction (singular vectors are unique up to sign)
    k = min(len(fast.S), len(ref.S))
    assert np.allclose(fast.S[:k], ref.S[:k], rtol=1e-4, atol=1e-6 * ref.S[0])
    G = sum(w * (B.astype(np.float64) @ A) for w, B, A in zip(weights, Bs, As))
    rebuilt = (fast.U * fast.S) @ fast.Vt
    assert np.linalg.norm(rebuilt - G) / np.linalg.norm(G) < 1e-4


def test_factor_svd_accepts_negative_weights() -> None:
    rng = np.random.default_rng(1)
    f, g = random_factors(rng, 40, 50, 3), random_factors(rng, 40, 50, 3)
    svd = factor_svd([f.B, g.B], [f.A, g.A], [1.0, -0.5])
    expected = f.B.astype(np.float64) @ f.A - 0.5 * g.B.astype(np.float64) @ g.A
    assert np.allclose((svd.U * svd.S) @ svd.Vt, expected, atol=1e-4)


def test_split_spectrum_reproduces_truncated_svd() -> None:
    rng = np.random.default_rng(2)
    f = random_factors(rng, 30, 40, 6)
    svd = factor_svd([f.B], [f.A], [1.0])
    scale = 2.0
    # Execute
    pushed = split_spectrum(svd, rank=4, scale=scale)
    # Assert: s * B A == U_4 S_4 V_4^T
    target = (svd.U[:, :4] * svd.S[:4]) @ svd.Vt[:4]
    assert np.allclose(pushed.delta(scale), target, atol=1e-4)


@pytest.mark.parametrize("rank, target", [(2, 5), (4, 4), (3, 8)])
def test_pad_is_exact_and_truncate_inverts_it(rank: int, target: int) -> None:
    rng = np.random.default_rng(3)
    f = random_factors(rng, 12, 10, rank)
    padded = pad_rank(f, target)
    assert padded.rank == target
    assert np.array_equal(padded.delta(1.0), f.delta(1.0))  # zero rows/columns add nothing
    back = truncate_rank(padded, rank)
    assert np.array_equal(back.A, f.A) and np.array_equal(back.B, f.B)


def test_pad_rank_refuses_to_shrink() -> None:
    with pytest.raises(ValueError, match="cannot pad"):
        pad_rank(random_factors(np.random.default_rng(0), 4, 4, 3), 2)


def test_payload_array_record_round_trip_is_exact_and_bytes_counted() -> None:
    # Prepare
    rng = np.random.default_rng(4)
    factors = {"layer.0.query": random_factors(rng, 8, 6, 2), "layer.1.value": random_factors(rng, 8, 6, 2)}
    head = {"head::classifier.weight": rng.standard_normal((3, 8)).astype(np.float32)}
    payload = join_payload(factors, head)
    # Execute
    back = from_array_record(to_array_record(payload))
    # Assert
    assert set(back) == set(payload)
    for key in payload:
        assert back[key].dtype == payload[key].dtype and np.array_equal(back[key], payload[key])
    assert payload_bytes(payload) == 4 * (2 * (2 * 6 + 8 * 2) + 3 * 8)
    split, extras = split_payload(back)
    assert set(split) == set(factors) and set(extras) == set(head)


def test_b_only_payload_keeps_b_only() -> None:
    rng = np.random.default_rng(5)
    payload = join_payload({"m": random_factors(rng, 5, 4, 2)}, send_A=False)
    assert list(payload) == ["m::B"]
    assert list(truncate_payload(payload, 1)) == ["m::B"]


def test_weighted_average_known_answer() -> None:
    a = {"x": np.array([1.0, 2.0], dtype=np.float32)}
    b = {"x": np.array([3.0, 6.0], dtype=np.float32)}
    out = weighted_average([a, b], [1, 3])
    assert np.allclose(out["x"], [2.5, 5.0]) and out["x"].dtype == np.float32


def test_fedit_mean_of_factors_is_not_mean_of_products() -> None:
    """FedIT averages A and B separately: mean(B) mean(A) != mean(B A) (STYLE.md, tests)."""
    # Prepare: two rank-1 clients with orthogonal factors
    f1 = Factors(np.array([[1.0, 0.0]]), np.array([[1.0], [0.0]]))
    f2 = Factors(np.array([[0.0, 1.0]]), np.array([[0.0], [1.0]]))
    # Execute
    avg = weighted_average([join_payload({"m": f1}), join_payload({"m": f2})], [1, 1])
    fedit_product = avg["m::B"] @ avg["m::A"]
    true_mean = 0.5 * (f1.delta(1) + f2.delta(1))
    # Assert: the true mean is diag(0.5, 0.5); FedIT gives all entries 0.25
    assert np.allclose(true_mean, np.diag([0.5, 0.5]))
    assert np.allclose(fedit_product, np.full((2, 2), 0.25))
    assert np.linalg.norm(fedit_product - true_mean) == pytest.approx(0.5)


def test_padded_average_mixed_ranks_gives_each_client_its_rank() -> None:
    rng = np.random.default_rng(6)
    payloads = [join_payload({"m": random_factors(rng, 6, 5, r)}) for r in (2, 4)]
    avg = padded_average(payloads, [1, 1], rank=4)
    assert avg["m::A"].shape == (4, 5)
    # the extra rows come only from the rank-4 client, halved by the average
    assert np.allclose(avg["m::A"][2:], 0.5 * payloads[1]["m::A"][2:])
    assert truncate_payload(avg, 2)["m::B"].shape == (6, 2)

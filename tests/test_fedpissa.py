"""FedPissa: the decorrelation projectors, Eq. 4, the one-rank protocol, PiSSA's shared residual,
and the byte ledger (upload A + B + head, download B + head) end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cli_helpers import fedlora_run
from result_checks import assert_accuracies_add_up
from safetensors.numpy import load_file

from fedlora.config import ConfigError, load_config
from fedlora.methods.fedpissa import aggregate_B, decorrelation_projectors
from fedlora.strategies.base import ClientUpload
from fedlora.strategies.fedpissa import FedPissa

ROOT = Path(__file__).resolve().parents[1]
SMOKE_ONE_RANK = ["strategy.name=fedpissa", "clients.ranks=[4, 4, 4]"]  # smoke.toml mixes ranks


def orthonormal_split(rng: np.random.Generator, r: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """A random orthonormal basis of R^r cut into Q (r, s) and its complement Q_perp (r, r - s)."""
    basis, _ = np.linalg.qr(rng.standard_normal((r, r)))
    return basis[:, :s], basis[:, s:]


def spanned_A(rng: np.random.Generator, Q: np.ndarray, d_in: int) -> np.ndarray:
    """A (r, d_in) whose columns all lie in span(Q), i.e. A A^T has range span(Q)."""
    return Q @ rng.standard_normal((Q.shape[1], d_in))


# ------------------------------------------------------------------------------ projectors
@pytest.mark.parametrize(
    "r, s, clients, d_ins",
    [
        (4, 2, 3, [16]),  # other clients use 2 of 4 directions: the tail is the other 2
        (8, 3, 4, [16, 24]),  # two modules with different d_in, stacked and eigendecomposed together
        (6, 5, 2, [10]),  # delta = 1
        (8, 1, 5, [12, 12, 20]),  # delta = 7 = r - 1
    ],
)
def test_projector_is_the_complement_of_the_other_clients_subspace(
    r: int, s: int, clients: int, d_ins: list[int]
) -> None:
    # Prepare: every client's A has columns in span(Q) (a different Q per module), so
    # C_k = sum_{j != k} A_j A_j^T has range span(Q) and null space span(Q_perp), dim r - s
    rng = np.random.default_rng(r * 100 + s)
    bases = {f"m{i}": orthonormal_split(rng, r, s) for i in range(len(d_ins))}
    A_by_client = {
        k: {m: spanned_A(rng, bases[m][0], d) for m, d in zip(bases, d_ins)} for k in range(clients)
    }
    # Execute
    P = decorrelation_projectors(A_by_client, delta=r - s)
    # Assert: P_k = Q_perp Q_perp^T = I - Q Q^T for every client and module
    for k in range(clients):
        for module, (Q, Q_perp) in bases.items():
            assert P[k][module].shape == (r, r)
            assert np.allclose(P[k][module], Q_perp @ Q_perp.T, atol=1e-8)
            assert np.allclose(P[k][module], np.eye(r) - Q @ Q.T, atol=1e-8)


def test_projector_ignores_the_clients_own_A() -> None:
    # Prepare: client 0's A lives in span(Q_perp), the others' in span(Q)
    rng = np.random.default_rng(3)
    r, s = 6, 3
    Q, Q_perp = orthonormal_split(rng, r, s)
    A_by_client = {
        0: {"m": spanned_A(rng, Q_perp, 20)},
        1: {"m": spanned_A(rng, Q, 20)},
        2: {"m": spanned_A(rng, Q, 20)},
    }
    # Execute
    P = decorrelation_projectors(A_by_client, delta=r - s)
    # Assert: P_0 is built from fedlora.clients 1 and 2 only, so it projects onto Q_perp (where A_0 lives)
    assert np.allclose(P[0]["m"], Q_perp @ Q_perp.T, atol=1e-8)


@pytest.mark.parametrize("r, delta, clients", [(4, 2, 3), (8, 4, 5), (8, 1, 2), (8, 7, 4)])
def test_interference_equals_the_tail_eigenvalues(r: int, delta: int, clients: int) -> None:
    # Prepare: random A (what the method's "why" rests on): sum_{j != k} ||P_k A_j||_F^2 = tr(P_k C_k)
    rng = np.random.default_rng(delta)
    A_by_client = {k: {"m": rng.standard_normal((r, 30))} for k in range(clients)}
    # Execute
    P = decorrelation_projectors(A_by_client, delta)
    # Assert: the interference with the other clients is the sum of the delta smallest eigenvalues
    for k in range(clients):
        C_k = sum(A_by_client[j]["m"] @ A_by_client[j]["m"].T for j in range(clients) if j != k)
        tail = np.linalg.eigvalsh(C_k)[:delta].sum()
        interference = sum(
            np.linalg.norm(P[k]["m"] @ A_by_client[j]["m"]) ** 2 for j in range(clients) if j != k
        )
        assert np.isclose(interference, tail, rtol=1e-8, atol=1e-8)
        assert np.allclose(P[k]["m"] @ P[k]["m"], P[k]["m"], atol=1e-10)  # a projector
        assert np.isclose(np.trace(P[k]["m"]), delta)


# ------------------------------------------------------------------------------ Eq. 4
@pytest.mark.parametrize(
    "lam, weights",
    [
        (1.0, [0.5, 0.3, 0.2]),
        (0.5, [0.5, 0.3, 0.2]),
        (2.0, [1 / 3, 1 / 3, 1 / 3]),
        (0.0, [0.6, 0.3, 0.1]),
    ],
)
def test_B_agg_equals_eq4_on_a_known_projector(lam: float, weights: list[float]) -> None:
    # Prepare: A_j spanning a known Q, so P_k = I - Q Q^T, and random B_k
    rng = np.random.default_rng(int(lam * 10))
    r, s, d_out = 4, 2, 12
    Q, Q_perp = orthonormal_split(rng, r, s)
    A_by_client = {k: {"m": spanned_A(rng, Q, 16)} for k in range(3)}
    B_by_client = {k: {"m": rng.standard_normal((d_out, r))} for k in range(3)}
    p = dict(enumerate(weights))
    # Execute
    P = decorrelation_projectors(A_by_client, delta=r - s)
    B_agg = aggregate_B(B_by_client, P, p, lam, correction="literal")
    # Assert: the literal formula written out with the known projector
    B_avg = sum(p[k] * B_by_client[k]["m"] for k in range(3))
    expected = B_avg + lam * sum((B_by_client[k]["m"] - B_avg) @ (Q_perp @ Q_perp.T) for k in range(3))
    assert B_agg["m"].dtype == np.float32 and B_agg["m"].shape == (d_out, r)
    assert np.allclose(B_agg["m"], expected, atol=1e-5)
    # Assert: the correction only moves B inside the tail span Q_perp (columns of B Q are untouched)
    assert np.allclose(B_agg["m"] @ Q, B_avg @ Q, atol=1e-5)


def diagonal_A(gram_diagonal: list[float]) -> dict[str, np.ndarray]:
    """A (r, r) with A A^T = diag(gram_diagonal)."""
    return {"m": np.diag(np.sqrt(np.asarray(gram_diagonal, dtype=np.float64)))}


# Three clients whose projectors differ: C_0 = diag(1, 5, 6), C_1 = diag(6, 1, 5), C_2 = diag(5, 6, 1),
# so with delta = 1 the tail of client k is the basis vector e_k and P_k = e_k e_k^T.
DISTINCT_A = {0: diagonal_A([5, 1, 0]), 1: diagonal_A([0, 5, 1]), 2: diagonal_A([1, 0, 5])}
DISTINCT_B = {
    0: {"m": np.array([[4.0, 0.0, 8.0], [0.0, 4.0, 0.0]])},
    1: {"m": np.array([[0.0, 8.0, 0.0], [4.0, 0.0, 4.0]])},
    2: {"m": np.array([[8.0, 4.0, 0.0], [0.0, 0.0, 12.0]])},
}
DISTINCT_P = {0: 0.5, 1: 0.25, 2: 0.25}  # B_avg = [[4, 3, 4], [1, 2, 4]]


@pytest.mark.parametrize(
    "correction, lam, expected",
    [
        # literal: column k = B_avg[:, k] + (B_k[:, k] - B_avg[:, k]) = B_k[:, k]
        ("literal", 1.0, [[4.0, 8.0, 0.0], [0.0, 0.0, 12.0]]),
        # bounded: column k = B_avg[:, k] + p_k (B_k[:, k] - B_avg[:, k])
        ("bounded", 1.0, [[4.0, 4.25, 3.0], [0.5, 1.5, 6.0]]),
        ("bounded", 0.5, [[4.0, 3.625, 3.5], [0.75, 1.75, 5.0]]),
    ],
)
def test_B_agg_with_distinct_projectors_by_hand(correction: str, lam: float, expected: list[list[float]]) -> None:
    # Execute
    P = decorrelation_projectors(DISTINCT_A, delta=1)
    B_agg = aggregate_B(DISTINCT_B, P, DISTINCT_P, lam, correction=correction)  # type: ignore[arg-type]
    # Assert: the projectors are the distinct e_k e_k^T, and B_agg is the hand-computed matrix
    for k in range(3):
        assert np.allclose(P[k]["m"], np.outer(np.eye(3)[k], np.eye(3)[k]), atol=1e-12)
    assert np.allclose(B_agg["m"], expected, atol=1e-6)


def test_bounded_correction_with_identical_projectors_is_exactly_B_avg() -> None:
    # Prepare: one projector shared by every client, skewed sample weights (one client holds 43 %)
    rng = np.random.default_rng(11)
    P_shared = {"m": np.diag([1.0, 1.0, 0.0, 0.0])}
    B_by_client = {k: {"m": rng.standard_normal((5, 4))} for k in range(10)}
    p = dict(enumerate([0.43] + [0.57 / 9] * 9))
    B_avg = sum(p[k] * B_by_client[k]["m"] for k in range(10))
    # Execute
    bounded = aggregate_B(B_by_client, {k: P_shared for k in range(10)}, p, 1.0, correction="bounded")
    literal = aggregate_B(B_by_client, {k: P_shared for k in range(10)}, p, 1.0, correction="literal")
    # Assert: sum_k p_k (B_k - B_avg) = 0, so bounded leaves B_avg; the literal sum extrapolates,
    # B_avg + sum_k (B_k - B_avg) P = B_avg + K (mean_k B_k - B_avg) P, on the projected columns
    assert np.allclose(bounded["m"], B_avg, atol=1e-6)
    mean_B = sum(B_by_client[k]["m"] for k in range(10)) / 10
    assert np.allclose(literal["m"], B_avg + 10 * (mean_B - B_avg) @ P_shared["m"], atol=1e-5)
    assert not np.allclose(literal["m"], B_avg, atol=1e-2)


@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]])
def test_lam_zero_is_plain_weighted_averaging_of_B(weights: list[float]) -> None:
    # Prepare: arbitrary A and B
    rng = np.random.default_rng(7)
    A_by_client = {
        k: {"q": rng.standard_normal((8, 20)), "v": rng.standard_normal((8, 20))} for k in range(3)
    }
    B_by_client = {k: {"q": rng.standard_normal((10, 8)), "v": rng.standard_normal((6, 8))} for k in range(3)}
    p = dict(enumerate(weights))
    # Execute
    B_agg = aggregate_B(B_by_client, decorrelation_projectors(A_by_client, 4), p, lam=0.0, correction="literal")
    # Assert
    for module in ("q", "v"):
        assert np.allclose(B_agg[module], sum(p[k] * B_by_client[k][module] for k in range(3)), atol=1e-6)


# ------------------------------------------------------------------------------ the protocol
def small_strategy(
    options: list[str], num_clients: int = 3, rank: int = 4, shapes: dict[str, tuple[int, int]] | None = None
) -> FedPissa:
    """A FedPissa on hand-made shapes (default: module m with d_out 6, d_in 5; a 2 x 6 head) with
    profiles set."""
    shapes = shapes or {"m": (6, 5)}
    config = load_config(
        ROOT / "configs/smoke.toml", [*SMOKE_ONE_RANK, f"clients.ranks={[rank] * num_clients}", *options]
    )
    rng = np.random.default_rng(0)
    initial = {"head::classifier.weight": np.zeros((2, 6), np.float32)}
    for module, (d_out, d_in) in shapes.items():
        initial[f"{module}::A"] = rng.standard_normal((rank, d_in)).astype(np.float32)
        initial[f"{module}::B"] = rng.standard_normal((d_out, rank)).astype(np.float32)
    strategy = FedPissa(config, lambda r: initial, shapes)
    strategy.roster.profiles = {k: SimpleNamespace(partition_id=k, rank=rank, num_train_examples=0) for k in range(num_clients)}  # type: ignore[misc]
    strategy.roster.node_of = {k: 100 + k for k in strategy.roster.profiles}
    strategy.setup()
    return strategy


def fake_upload(rng: np.random.Generator, k: int, n: int, rank: int = 4) -> ClientUpload:
    payload = {
        "m::A": rng.standard_normal((rank, 5)).astype(np.float32),
        "m::B": rng.standard_normal((6, rank)).astype(np.float32),
        "head::classifier.weight": np.full((2, 6), float(k), np.float32),
    }
    return ClientUpload(partition_id=k, payload=payload, num_examples=n, metrics={})


@pytest.mark.parametrize(
    "options, p",
    [
        ([], [10 / 40, 10 / 40, 20 / 40]),  # samples
        (["strategy.weights=uniform"], [1 / 3, 1 / 3, 1 / 3]),
    ],
)
def test_server_downloads_B_agg_and_head_only(options: list[str], p: list[float]) -> None:
    # Prepare
    strategy = small_strategy(["strategy.lam=0.7", *options])
    rng = np.random.default_rng(1)
    uploads = [fake_upload(rng, k, n) for k, n in enumerate([10, 10, 20])]
    # Execute
    strategy.aggregate(1, uploads)
    download = strategy.download(0, 2, "train").payload
    # Assert: only B and the head go down; B is Eq. 4 with delta = r // 2; the head is averaged
    assert set(download) == {"m::B", "head::classifier.weight"}
    A = {u.partition_id: {"m": u.payload["m::A"]} for u in uploads}
    B = {u.partition_id: {"m": u.payload["m::B"]} for u in uploads}
    expected = aggregate_B(B, decorrelation_projectors(A, 2), dict(enumerate(p)), 0.7, strategy.options.correction)
    assert np.allclose(download["m::B"], expected["m"])
    assert np.allclose(download["head::classifier.weight"], sum(pk * k for k, pk in enumerate(p)))
    assert strategy.round_extra(1)["delta"] == 2
    assert strategy.global_payload() is None  # default global_model = clients


def test_mean_A_global_model_is_example_weighted() -> None:
    # Prepare
    strategy = small_strategy(["strategy.global_model=mean_A"])
    rng = np.random.default_rng(2)
    uploads = [fake_upload(rng, k, n) for k, n in enumerate([1, 1, 2])]
    # Execute
    strategy.aggregate(1, uploads)
    payload = strategy.global_payload()
    # Assert
    assert payload is not None
    expected_A = (
        0.25 * uploads[0].payload["m::A"]
        + 0.25 * uploads[1].payload["m::A"]
        + 0.5 * uploads[2].payload["m::A"]
    )
    assert np.allclose(payload["m::A"], expected_A, atol=1e-6)
    assert np.array_equal(payload["m::B"], strategy.B_agg["m"])


# ------------------------------------------------------------------------------ the round's record
def distinct_uploads() -> list[ClientUpload]:
    """DISTINCT_A / DISTINCT_B as uploads of module m (d_out 2, d_in 3, rank 3), p = 1/2, 1/4, 1/4."""
    return [
        ClientUpload(k, {"m::A": DISTINCT_A[k]["m"].astype(np.float32), "m::B": DISTINCT_B[k]["m"].astype(np.float32)},
                     num_examples=n, metrics={})
        for k, n in zip(range(3), [2, 1, 1])
    ]


def test_recorded_correction_and_overlap_by_hand_with_distinct_projectors() -> None:
    # Prepare: the hand case above: P_k = e_k e_k^T, B_avg = [[4, 3, 4], [1, 2, 4]] and the bounded
    # B_agg = [[4, 4.25, 3], [0.5, 1.5, 6]], so B_agg - B_avg = [[0, 1.25, -1], [-0.5, -0.5, 2]]
    strategy = small_strategy(["model.head=local", "strategy.correction=bounded"], rank=3, shapes={"m": (2, 3)})
    # Execute
    strategy.aggregate(1, distinct_uploads())
    extra = strategy.round_extra(1)
    # Assert: ||B_agg - B_avg||_F^2 = 1.5625 + 1 + 0.25 + 0.25 + 4 = 7.0625, ||B_avg||_F^2 = 62;
    # the tail spaces e_0, e_1, e_2 are mutually orthogonal: overlap 0
    assert extra["relative_correction"] == pytest.approx(np.sqrt(7.0625 / 62), rel=1e-6)
    assert extra["projector_overlap"] == pytest.approx(0.0, abs=1e-12)
    assert extra["delta"] == 1 and extra["lam"] == 1.0


@pytest.mark.parametrize("correction, lam", [("bounded", 1.0), ("literal", 1.0), ("bounded", 3.0)])
def test_recorded_correction_equals_a_numpy_hand_computation(correction: str, lam: float) -> None:
    # Prepare: 4 clients with distinct random A_k (rank 4, delta 2), random B_k, skewed n_k
    rng = np.random.default_rng(5)
    strategy = small_strategy(
        [f"strategy.lam={lam}", f"strategy.correction={correction}", "data.num_clients=4"], num_clients=4
    )
    uploads = [fake_upload(rng, k, n) for k, n in enumerate([5, 10, 20, 45])]
    # Execute
    strategy.aggregate(1, uploads)
    extra = strategy.round_extra(1)
    # Assert: Eq. 4 written out with numpy only
    A = [u.payload["m::A"].astype(np.float64) for u in uploads]
    B = [u.payload["m::B"].astype(np.float64) for u in uploads]
    p = np.array([5, 10, 20, 45]) / 80
    P = []
    for k in range(4):
        C_k = sum(A[j] @ A[j].T for j in range(4) if j != k)
        _, vectors = np.linalg.eigh(C_k)  # ascending: the first 2 columns are the tail
        P.append(vectors[:, :2] @ vectors[:, :2].T)
    B_avg = sum(p[k] * B[k] for k in range(4))
    c = p if correction == "bounded" else np.ones(4)
    B_agg = B_avg + lam * sum(c[k] * (B[k] - B_avg) @ P[k] for k in range(4))
    overlap = np.mean([np.linalg.norm(P[k] @ P[j]) ** 2 / 2 for k in range(4) for j in range(4) if j != k])
    assert extra["relative_correction"] == pytest.approx(np.linalg.norm(B_agg - B_avg) / np.linalg.norm(B_avg), rel=1e-4)
    assert extra["projector_overlap"] == pytest.approx(overlap, rel=1e-6)
    assert 0.0 < overlap < 1.0 and extra["relative_correction"] > 0.01


def test_projector_overlap_by_hand() -> None:
    from fedlora.methods.fedpissa import projector_overlap

    # Prepare: rank-1 tails at 60 degrees (cos^2 = 1/4) and identical rank-2 tails
    u, v = np.array([1.0, 0.0]), np.array([0.5, np.sqrt(3) / 2])
    tilted = {0: {"m": np.outer(u, u)}, 1: {"m": np.outer(v, v)}}
    same = {k: {"m": np.diag([1.0, 1.0, 0.0]), "n": np.diag([0.0, 1.0, 1.0])} for k in range(3)}
    # Execute / Assert
    assert projector_overlap(tilted) == pytest.approx(0.25)
    assert projector_overlap(same) == pytest.approx(1.0)


# ------------------------------------------------------------------------------ selection = dynamics
def test_update_consensus_by_hand() -> None:
    from fedlora.methods.fedpissa import update_consensus

    # Prepare: start 0; module a: equal updates, b: opposite, c: one client moves, d: nobody moves
    e = np.array([[1.0, 2.0], [0.0, -2.0]])
    start = {0: dict.fromkeys("abcd", np.zeros((2, 2))), 1: dict.fromkeys("abcd", np.zeros((2, 2)))}
    end = {0: {"a": e, "b": e, "c": e, "d": np.zeros((2, 2))}, 1: {"a": e, "b": -e, "c": 0 * e, "d": np.zeros((2, 2))}}
    # Execute
    kappa = update_consensus(start, end, {0: 0.5, 1: 0.5})
    # Assert: ||mean||^2 / mean ||.||^2 = 1, 0, (0.25 |e|^2) / (0.5 |e|^2) = 0.5, 0
    assert kappa == pytest.approx({"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.0})


def dynamics_uploads(strategy: FedPissa, rng: np.random.Generator, agree: dict[str, str], start: dict,
                     server_round: int) -> list[ClientUpload]:
    """3 uploads of ``server_round``, each answering its client's download: per module, the factor
    named in ``agree`` moves by one common step from the client's start (plus a little noise), the
    other factor by independent random steps."""
    uploads = []
    common = {(m, f): rng.standard_normal(start[0][m][f].shape) for m in agree for f in "AB"}
    for k, n in enumerate([1, 1, 2]):
        payload = {}
        for m, factor in agree.items():
            for f in "AB":
                step = common[(m, f)] + 0.05 * rng.standard_normal(common[(m, f)].shape) if f == factor else (
                    rng.standard_normal(common[(m, f)].shape))
                payload[f"{m}::{f}"] = (start[k][m][f] + step).astype(np.float32)
        payload["head::classifier.weight"] = np.zeros((2, 6), np.float32)
        uploads.append(ClientUpload(k, payload, num_examples=n, metrics={},
                                    download=strategy.download(k, server_round, "train")))
    return uploads


def test_dynamics_aggregates_the_factor_whose_updates_agree_and_keeps_the_other_local() -> None:
    from fedlora.lora import payload_bytes

    # Prepare: modules m (clients agree on A) and n (clients agree on B), d_out 6 != d_in 5
    shapes = {"m": (6, 5), "n": (6, 5)}
    strategy = small_strategy(["strategy.selection=dynamics", "strategy.lam=0.5", "strategy.correction=bounded"],
                              shapes=shapes)
    rng = np.random.default_rng(3)
    init = {k: {m: {"A": strategy.initial_A[m], "B": strategy.initial_B[m]} for m in shapes} for k in range(3)}
    first = strategy.download(0, 1, "train").payload
    uploads = dynamics_uploads(strategy, rng, {"m": "A", "n": "B"}, init, 1)
    # Execute
    strategy.aggregate(1, uploads)
    download = strategy.download(0, 2, "train").payload
    extra = strategy.round_extra(1)
    # Assert: round 1 sent B (the figure's choice); now m sends A_agg and n sends B_agg, nothing else
    assert set(first) == {"m::B", "n::B", "head::classifier.weight"}
    assert set(download) == {"m::A", "n::B", "head::classifier.weight"}
    assert extra["aggregated_A_fraction"] == 0.5 and extra["consensus_A"] > 0.3 and extra["consensus_B"] > 0.3
    # Assert: the bytes that travel follow the selection: A (4 x 5) for m, B (6 x 4) for n, head
    assert payload_bytes(download) == 4 * (4 * 5 + 6 * 4 + 2 * 6)
    # Assert: A_agg is the mirror of Eq. 4 (bounded), written out: Q_k = tail of sum_{j != k} B_j^T B_j
    A = [u.payload["m::A"].astype(np.float64) for u in uploads]
    Bm = [u.payload["m::B"].astype(np.float64) for u in uploads]
    p = np.array([0.25, 0.25, 0.5])
    A_avg = sum(p[k] * A[k] for k in range(3))
    Q = []
    for k in range(3):
        _, vectors = np.linalg.eigh(sum(Bm[j].T @ Bm[j] for j in range(3) if j != k))
        Q.append(vectors[:, :2] @ vectors[:, :2].T)
    expected = A_avg + 0.5 * sum(p[k] * Q[k] @ (A[k] - A_avg) for k in range(3))
    assert np.allclose(download["m::A"], expected, atol=1e-5)


def test_dynamics_measures_updates_from_what_each_client_started_with() -> None:
    # Prepare: round 1 selects A for m (clients agree on A), B for n
    shapes = {"m": (6, 5), "n": (6, 5)}
    strategy = small_strategy(["strategy.selection=dynamics"], shapes=shapes)
    rng = np.random.default_rng(4)
    init = {k: {m: {"A": strategy.initial_A[m], "B": strategy.initial_B[m]} for m in shapes} for k in range(3)}
    first = dynamics_uploads(strategy, rng, {"m": "A", "n": "B"}, init, 1)
    strategy.aggregate(1, first)
    # Execute: round 2: every client starts from the A_agg / B_agg it received and its own kept
    # factor; now the clients agree on m's B and n's A, measured from those starts
    sent = {k: strategy.download(k, 2, "train").payload for k in range(3)}
    starts = {k: {m: {f: sent[k].get(f"{m}::{f}", first[k].payload[f"{m}::{f}"]) for f in "AB"} for m in shapes}
              for k in range(3)}
    second = dynamics_uploads(strategy, rng, {"m": "B", "n": "A"}, starts, 2)
    A, B = strategy.starting_factors(second[0])  # from the download it answers, not its own last upload
    assert np.array_equal(A["m"], sent[0]["m::A"]) and np.array_equal(B["n"], sent[0]["n::B"])
    assert not np.array_equal(A["m"], first[0].payload["m::A"])
    strategy.aggregate(2, second)
    # Assert: the selection flipped in both modules
    assert strategy.selected == {"m": "B", "n": "A"}
    assert set(strategy.download(0, 3, "train").payload) == {"m::B", "n::A", "head::classifier.weight"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.delta=0"], "strategy.delta must be in [1, rank), got 0"),
        (["strategy.delta=4"], "strategy.delta must be in [1, rank), got 4"),
        (
            ["clients.ranks=[2, 4, 8]", "clients.mixed_rank_policy=refuse"],
            "needs one LoRA rank for every client",
        ),
        (
            [
                "clients.ranks=[]",
                "clients.rank_tiers={'2' = 0.5, '4' = 0.5}",
                "clients.mixed_rank_policy=refuse",
            ],
            "needs one LoRA rank",
        ),
        (
            ["clients.ranks=[2, 4, 8]", "strategy.delta=2"],
            "strategy.delta must be in [1, rank), got 2 (rank = 2)",
        ),
        (["clients.ranks=[1, 1, 1]"], "needs LoRA rank >= 2"),
        (["model.init=gaussian"], "conflicts with strategy.init"),
        (["strategy.weights=median"], "strategy.weights"),
        (["strategy.lam=-1"], "strategy.lam"),
        (["strategy.selection=adaptive"], "strategy.selection"),
    ],
)
def test_bad_options_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs/smoke.toml", [*SMOKE_ONE_RANK, *overrides])
    assert message in str(error.value)


def test_strategy_init_leaves_model_init_to_other_strategies() -> None:
    # Prepare: a fedpissa config (PiSSA) from which a comparison derives its other strategies
    config = load_config(ROOT / "configs/smoke.toml", SMOKE_ONE_RANK)
    strategy = FedPissa(config, lambda r: {}, {"m": (6, 5)})
    # Assert: the override lives in the strategy (server evaluator + client trainer), not the config
    assert config.model.init == "kaiming" and strategy.model_init() == "pissa"
    kaiming = load_config(ROOT / "configs/smoke.toml", [*SMOKE_ONE_RANK, "strategy.init=kaiming"])
    assert FedPissa(kaiming, lambda r: {}, {"m": (6, 5)}).model_init() == "kaiming"


def test_pissa_residual_base_is_identical_on_server_and_clients() -> None:
    # Prepare: the server's GlobalEvaluator (label names are all it reads from the data here)
    from fedlora.evaluation import GlobalEvaluator
    from fedlora.models import build_model

    config = load_config(ROOT / "configs/smoke.toml", SMOKE_ONE_RANK)
    init = FedPissa(config, lambda rank: {}, {"m": (6, 5)}).model_init()  # as run_server
    evaluator = GlobalEvaluator(config.model, config.train, SimpleNamespace(label_names=list(range(8))),  # type: ignore[arg-type]
                                init=init)
    # Execute
    server = evaluator.build(4).state_dict()
    client = build_model(config.model, 8, 4, seed=config.train.seed, init="pissa").state_dict()
    plain = build_model(config.model, 8, 4, seed=config.train.seed, init="kaiming").state_dict()
    # Assert: same residual W0 - s B A, same A and B, and residual + s B A recovers W0
    scale = config.model.lora_alpha / 4
    bases = [k for k in server if k.endswith("base_layer.weight")]
    assert len(bases) == 4
    for key in bases:
        A_key, B_key = (key.replace("base_layer.weight", f"lora_{f}.default.weight") for f in "AB")
        for name in (key, A_key, B_key):
            assert np.array_equal(server[name].numpy(), client[name].numpy())
        assert not np.allclose(server[key].numpy(), plain[key].numpy())  # the base really changed
        rebuilt = server[key] + scale * server[B_key] @ server[A_key]
        assert np.allclose(rebuilt.numpy(), plain[key].numpy(), atol=1e-5)


# ------------------------------------------------------------------------------ end to end
@pytest.mark.e2e
def test_inprocess_bytes_and_personal_adapters(tmp_path: Path) -> None:
    # Prepare: tiny-bert, 2 layers x (query, value), d = 32, rank 4, 8 labels, 3 clients
    config = load_config(ROOT / "configs/smoke.toml", SMOKE_ONE_RANK)
    from fedlora.app.runner import run_inprocess

    # Execute
    writer = run_inprocess(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    # Assert: upload = A + B + head, download = B + head, exactly (float32)
    A_bytes = B_bytes = 2 * 2 * (4 * 32) * 4
    head = (8 * 32 + 8) * 4
    for record in results["rounds"]:
        assert record["bytes_up"] == 3 * (A_bytes + B_bytes + head)
        assert record["bytes_down"] == 3 * (B_bytes + head)
        assert record["bytes_eval_down"] == 3 * (B_bytes + head)
        assert_accuracies_add_up(record, config.data.global_test_size)
        assert record["extra"]["delta"] == 2
    assert results["strategy_info"]["downloads"].startswith("B, head")
    assert all(0.0 <= r["extra"]["projector_overlap"] <= 1.0 + 1e-9 for r in results["rounds"])
    assert len(writer.rounds) == config.train.rounds
    # Assert: personalised adapters: every client holds the same B_agg and its own A_k
    adapters = [load_file(tmp_path / f"adapters/client_{k}/adapter_model.safetensors") for k in range(3)]
    A_keys = [k for k in adapters[0] if "lora_A" in k]
    B_keys = [k for k in adapters[0] if "lora_B" in k]
    assert len(A_keys) == len(B_keys) == 4
    for key in B_keys:
        assert all(np.array_equal(adapters[0][key], a[key]) for a in adapters[1:])
    for key in A_keys:
        assert not np.allclose(adapters[0][key], adapters[1][key])


@pytest.mark.e2e
def test_mixed_declared_ranks_train_at_the_smallest(tmp_path: Path) -> None:
    # Prepare: smoke.toml's clients declare ranks 2, 4, 8 (clients.mixed_rank_policy = smallest)
    config = load_config(ROOT / "configs/smoke.toml", ["strategy.name=fedpissa", "clients.ranks=[2, 4, 8]"])
    from fedlora.app.runner import run_inprocess

    # Execute
    run_inprocess(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    # Assert: everyone at rank 2 (delta = 1): the same ledger as a rank-2 federation
    A_bytes = B_bytes = 2 * 2 * (2 * 32) * 4
    head = (8 * 32 + 8) * 4
    assert [r["bytes_up"] for r in results["rounds"]] == [3 * (A_bytes + B_bytes + head)] * 2
    assert [r["bytes_down"] for r in results["rounds"]] == [3 * (B_bytes + head)] * 2
    assert results["rounds"][0]["extra"]["delta"] == 1


@pytest.mark.e2e
def test_inprocess_dynamics_selection_runs_and_clients_share_the_aggregated_factor(tmp_path: Path) -> None:
    # Prepare
    config = load_config(ROOT / "configs/smoke.toml", [*SMOKE_ONE_RANK, "strategy.selection=dynamics"])
    from fedlora.app.runner import run_inprocess

    # Execute
    run_inprocess(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    # Assert: the dynamics are recorded every round
    for record in results["rounds"]:
        assert 0.0 <= record["extra"]["consensus_A"] <= 1.0 and 0.0 <= record["extra"]["consensus_B"] <= 1.0
    # Assert: in every module the clients' final models share the factor that was aggregated
    # (the evaluation download overlays it) and differ in the kept one; the last round's
    # aggregated_A_fraction is the share of modules whose A the clients share
    adapters = [load_file(tmp_path / f"adapters/client_{k}/adapter_model.safetensors") for k in range(3)]
    A_keys = [k for k in adapters[0] if "lora_A" in k]
    shared_A = 0
    for key in A_keys:
        pair = [key, key.replace("lora_A", "lora_B")]
        shared = [all(np.array_equal(adapters[0][x], a[x]) for a in adapters[1:]) for x in pair]
        assert sorted(shared) == [False, True], key
        shared_A += shared[0]
    assert results["rounds"][-1]["extra"]["aggregated_A_fraction"] == shared_A / len(A_keys)


@pytest.mark.slow
def test_cli_smoke_run(tmp_path: Path) -> None:
    # Execute: the CLI, in process (Ray: tests/test_run.py, tests/test_ray_cluster.py; gRPC: tests/test_deploy_strategies.py)
    proc = fedlora_run(tmp_path, "strategy.name=fedpissa", "clients.ranks=[4, 4, 4]", args=("--engine", "inprocess"))
    # Assert
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["strategy"] == "fedpissa" and len(results["rounds"]) == 2
    assert all(r["bytes_down"] * 1.0 < r["bytes_up"] for r in results["rounds"])
    assert all((tmp_path / f"adapters/client_{k}/adapter_config.json").is_file() for k in range(3))


@pytest.mark.e2e
def test_cli_bad_delta_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = fedlora_run(tmp_path, "strategy.name=fedpissa", "clients.ranks=[4, 4, 4]", "strategy.delta=0", timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1
    assert "strategy.delta must be in [1, rank), got 0" in lines[0]


# ------------------------------------------------------------------------------ the per-method config
SIZE_KEYS = {"data.max_examples", "data.global_test_size", "train.rounds", "federation.evaluate_every", "output.dir",
             "train.precision"}  # the scenario pins fp32 for its records; the user's config runs the machine's best


def flat(config: object) -> dict[str, object]:
    """``section.key -> value`` of a validated config (defaults included)."""
    return {f"{section}.{key}": value for section, values in config.model_dump().items() for key, value in values.items()}


def test_method_config_is_its_scenario_at_a_smaller_size() -> None:
    # Prepare: the config a user reaches for first, and the fidelity scenario
    config = flat(load_config(ROOT / "configs/fedpissa.toml"))
    scenario = flat(load_config(ROOT / "configs/scenarios/fedpissa.toml"))
    # Assert: every key equals the scenario's (label skew, head, strategy options, training) but the size
    differing = sorted(k for k in scenario if config[k] != scenario[k])
    assert set(differing) <= SIZE_KEYS, differing
    assert config["data.max_examples"] < scenario["data.max_examples"] and config["train.rounds"] < scenario["train.rounds"]

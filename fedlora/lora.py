"""LoRA factor algebra, shared by the server (strategies) and the clients.

A LoRA-adapted linear layer ("module") has frozen W0 (d_out, d_in), A (r, d_in), B (d_out, r)
and scale s = alpha / r, so dW = s * B @ A (ALGORITHMS.md, notation). On the wire an adapter is a
flat ``dict[str, np.ndarray]`` ("payload") with keys ``<module>::A``, ``<module>::B`` and
``head::<param>`` for trainable non-LoRA parameters (the classification head). A payload maps
one-to-one onto a Flower ``ArrayRecord``; its byte count is the sum of the arrays' ``nbytes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

Payload = dict[str, np.ndarray]

A_SUFFIX = "::A"
B_SUFFIX = "::B"
HEAD_PREFIX = "head::"


class Factors(NamedTuple):
    """One module's LoRA factors: ``A`` (r, d_in) and ``B`` (d_out, r)."""

    A: np.ndarray
    B: np.ndarray

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    def delta(self, scale: float) -> np.ndarray:
        """The dense update s * B @ A (d_out, d_in): for tests and small layers only."""
        return scale * (self.B @ self.A)


# --------------------------------------------------------------------------------------------
# payload <-> factors <-> ArrayRecord
# --------------------------------------------------------------------------------------------


def split_payload(payload: Mapping[str, np.ndarray]) -> tuple[dict[str, Factors], Payload]:
    """Split a payload into per-module factors and the remaining (head) arrays.

    A module may carry only A or only B (e.g. FFA-LoRA uploads B alone); the missing factor is
    then an empty (0, 0) array, so callers must know what their method sends.
    """
    modules: dict[str, dict[str, np.ndarray]] = {}
    extras: Payload = {}
    for key, value in payload.items():
        if key.endswith(A_SUFFIX):
            modules.setdefault(key[: -len(A_SUFFIX)], {})["A"] = value
        elif key.endswith(B_SUFFIX):
            modules.setdefault(key[: -len(B_SUFFIX)], {})["B"] = value
        else:
            extras[key] = value
    empty = np.zeros((0, 0), dtype=np.float32)
    factors = {m: Factors(ab.get("A", empty), ab.get("B", empty)) for m, ab in modules.items()}
    return factors, extras


def join_payload(
    factors: Mapping[str, Factors] | None = None,
    extras: Mapping[str, np.ndarray] | None = None,
    send_A: bool = True,
    send_B: bool = True,
) -> Payload:
    """Inverse of :func:`split_payload`; ``send_A`` / ``send_B`` select what travels."""
    payload: Payload = {}
    for module, f in (factors or {}).items():
        if send_A:
            payload[module + A_SUFFIX] = f.A
        if send_B:
            payload[module + B_SUFFIX] = f.B
    payload.update(extras or {})
    return payload


def head_only(payload: Mapping[str, np.ndarray]) -> Payload:
    """The non-LoRA (head) arrays of a payload."""
    return {k: v for k, v in payload.items() if k.startswith(HEAD_PREFIX)}


def payload_bytes(payload: Mapping[str, np.ndarray]) -> int:
    """Exact size of the arrays in a payload, as they cross the wire."""
    return int(sum(np.asarray(v).nbytes for v in payload.values()))


def to_array_record(payload: Mapping[str, np.ndarray]):  # -> flwr.app.ArrayRecord
    """Payload -> Flower ArrayRecord (keys kept, arrays copied to contiguous float32 / int)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in payload.items()})


def from_array_record(record) -> Payload:  # record: flwr.app.ArrayRecord
    """Flower ArrayRecord -> payload (exact inverse of :func:`to_array_record`)."""
    return {key: array.numpy() for key, array in record.items()}


# --------------------------------------------------------------------------------------------
# rank changes and averaging
# --------------------------------------------------------------------------------------------


def pad_rank(f: Factors, rank: int) -> Factors:
    """Zero-pad to ``rank``: B A is unchanged (the new rows of A / columns of B are zero)."""
    if rank < f.rank:
        raise ValueError(f"cannot pad rank {f.rank} down to {rank}")
    extra = rank - f.rank
    A = np.pad(f.A, ((0, extra), (0, 0)))  # (rank, d_in)
    B = np.pad(f.B, ((0, 0), (0, extra)))  # (d_out, rank)
    return Factors(A, B)


def pruned_rank(rank: int, decay: float) -> int:
    """The rank HetLoRA's self-pruning keeps: floor(decay * rank), at least 1."""
    return max(1, math.floor(decay * rank))


def truncate_rank(f: Factors, rank: int) -> Factors:
    """Keep the first ``rank`` components (rows of A, columns of B)."""
    if rank > f.rank:
        raise ValueError(f"cannot truncate rank {f.rank} up to {rank}")
    return Factors(f.A[:rank].copy(), f.B[:, :rank].copy())


def normalise(weights: Sequence[float]) -> np.ndarray:
    """Weights summing to one (uniform if they sum to zero)."""
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum()
    return np.full(len(w), 1.0 / len(w)) if total <= 0 else w / total


def weighted_average(payloads: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> Payload:
    """Key-wise weighted mean of payloads with identical keys and shapes (FedAvg)."""
    if not payloads:
        raise ValueError("weighted_average needs at least one payload")
    w = normalise(weights)
    keys = payloads[0].keys()
    out: Payload = {}
    for key in keys:
        stacked = np.stack([np.asarray(p[key], dtype=np.float64) for p in payloads])
        out[key] = np.tensordot(w, stacked, axes=1).astype(payloads[0][key].dtype)
    return out


def pad_payload(payload: Mapping[str, np.ndarray], rank: int) -> Payload:
    """Zero-pad every module of a payload to ``rank`` (head arrays unchanged)."""
    factors, extras = split_payload(payload)
    padded = {m: pad_rank(f, rank) for m, f in factors.items()}
    return join_payload(padded, extras, send_A=_has(payload, A_SUFFIX), send_B=_has(payload, B_SUFFIX))


def truncate_payload(payload: Mapping[str, np.ndarray], rank: int) -> Payload:
    """Keep the first ``rank`` components of every module (head arrays unchanged)."""
    factors, extras = split_payload(payload)
    cut = {m: Factors(f.A[:rank].copy(), f.B[:, :rank].copy()) for m, f in factors.items()}
    return join_payload(cut, extras, send_A=_has(payload, A_SUFFIX), send_B=_has(payload, B_SUFFIX))


def _has(payload: Mapping[str, np.ndarray], suffix: str) -> bool:
    return any(key.endswith(suffix) for key in payload)


def padded_average(payloads: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rank: int) -> Payload:
    """Weighted average after zero-padding every payload to ``rank``: how a same-rank method
    (FedIT, FFA-LoRA, FedSA-LoRA) runs over mixed client ranks, as in FLoRA's heterogeneous-rank
    comparison. Each client then takes the first r_k components (:func:`truncate_payload`)."""
    return weighted_average([pad_payload(p, rank) for p in payloads], weights)


# --------------------------------------------------------------------------------------------
# SVD of a weighted sum of low-rank products, in factor space
# --------------------------------------------------------------------------------------------


class LowRankSVD(NamedTuple):
    """Thin SVD G = U diag(S) Vt with U (d_out, R), S (R,), Vt (R, d_in)."""

    U: np.ndarray
    S: np.ndarray
    Vt: np.ndarray


def factor_svd(
    Bs: Sequence[np.ndarray], As: Sequence[np.ndarray], weights: Sequence[float]
) -> LowRankSVD:
    """Exact thin SVD of G = sum_k w_k B_k A_k without forming G when the stacked rank is small.

    Stack Bs = [w_k B_k] (d_out, R) and As = [A_k] (R, d_in), R = sum r_k; then G = Bs As.
    With Bs = Q_b R_b and As^T = Q_a R_a, G = Q_b (R_b R_a^T) Q_a^T: the SVD of the small
    core R_b R_a^T (R x R) rotated back gives the SVD of G in O(d R^2) (ALGORITHMS.md).
    Weights may be negative (e.g. an "unbiased" update subtracting the previous push).
    """
    w = np.asarray(weights, dtype=np.float64)
    B_stack = np.concatenate([wk * np.asarray(B, np.float64) for wk, B in zip(w, Bs)], axis=1)
    A_stack = np.concatenate([np.asarray(A, np.float64) for A in As], axis=0)
    d_out, R = B_stack.shape
    d_in = A_stack.shape[1]
    if R >= min(d_out, d_in):  # stacking buys nothing: the dense SVD is no bigger
        U, S, Vt = np.linalg.svd(B_stack @ A_stack, full_matrices=False)
        return LowRankSVD(U, S, Vt)
    Q_b, R_b = np.linalg.qr(B_stack)  # (d_out, R), (R, R)
    Q_a, R_a = np.linalg.qr(A_stack.T)  # (d_in, R), (R, R)
    U_core, S, Vt_core = np.linalg.svd(R_b @ R_a.T)  # (R, R) each
    return LowRankSVD(Q_b @ U_core, S, Vt_core @ Q_a.T)


def dense_svd(Bs: Sequence[np.ndarray], As: Sequence[np.ndarray], weights: Sequence[float]) -> LowRankSVD:
    """Reference: SVD of the dense d_out x d_in sum (what reference implementations do)."""
    G = sum(wk * (np.asarray(B, np.float64) @ np.asarray(A, np.float64)) for wk, B, A in zip(weights, Bs, As))
    U, S, Vt = np.linalg.svd(G, full_matrices=False)
    return LowRankSVD(U, S, Vt)


def split_spectrum(svd: LowRankSVD, rank: int, scale: float) -> Factors:
    """Rank-``rank`` factors with scale * B A = U_r S_r V_r^T, the spectrum split evenly:
    B = U_r diag(sqrt(S_r / s)), A = diag(sqrt(S_r / s)) V_r^T (FedHera push; FlexLoRA too)."""
    rank = min(rank, len(svd.S))
    root = np.sqrt(np.maximum(svd.S[:rank], 0.0) / scale)  # (rank,)
    B = (svd.U[:, :rank] * root).astype(np.float32)  # (d_out, rank)
    A = (root[:, None] * svd.Vt[:rank]).astype(np.float32)  # (rank, d_in)
    return Factors(A, B)


def scale_tail(factors: Mapping[str, Factors], r_main: Mapping[str, int], lam: float) -> dict[str, Factors]:
    """FedHera's tail warm-up: rows r_main: of A and columns r_main: of B times sqrt(lam), so the
    frozen tail's product B_tail A_tail is scaled by lam (unchanged when lam >= 0.999)."""
    if lam >= 0.999:
        return dict(factors)
    root = np.float32(np.sqrt(max(lam, 0.0)))
    out = {}
    for module, f in factors.items():
        A, B = np.array(f.A, copy=True), np.array(f.B, copy=True)
        A[r_main[module]:] *= root  # (r_tot - r_main, d_in)
        B[:, r_main[module]:] *= root  # (d_out, r_tot - r_main)
        out[module] = Factors(A, B)
    return out

"""LoRA factors and payloads: the algebra every method shares (written once, here).

A LoRA-adapted linear layer ("module") has frozen W0 (d_out, d_in), A (r, d_in), B (d_out, r) and
scale s = alpha / r (:func:`lora_scale`), so dW = s * B @ A. On the wire an adapter is a flat
``dict[str, np.ndarray]`` ("payload") with keys ``<module>::A``, ``<module>::B`` and
``head::<param>`` for trainable non-LoRA parameters (the classification head). A payload maps
one-to-one onto a Flower ``ArrayRecord``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fedlora import state

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

    from fedlora.schema import AggregationRule

Payload = dict[str, np.ndarray]
Weights = Sequence[float] | np.ndarray  # per-client aggregation weights (normalised where used)

# The dtype of every adapter array the server holds, aggregates and sends: the models' trainable
# parameters are float32 (fedlora.models.adapter_payload). An aggregate never takes a client's dtype.
ADAPTER_DTYPE = np.float32

A_SUFFIX = "::A"
B_SUFFIX = "::B"
HEAD_PREFIX = "head::"


@state.register
class Factors(NamedTuple):
    """One module's LoRA factors: ``A`` (r, d_in) and ``B`` (d_out, r)."""

    A: np.ndarray
    B: np.ndarray

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    def delta(self, scale: float) -> np.ndarray:
        """The dense update s * B @ A (d_out, d_in): for tests and small layers only."""
        return np.asarray(scale * (self.B @ self.A))


def lora_scale(alpha: float, rank: int) -> float:
    """s = alpha / r: the scale peft applies to a rank-``rank`` adapter (dW = s B A)."""
    return float(alpha) / float(rank)


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


def without_head(payload: Mapping[str, np.ndarray]) -> Payload:
    """The payload without its head arrays."""
    return {k: v for k, v in payload.items() if not k.startswith(HEAD_PREFIX)}


def adapter_shapes(module_shapes: Mapping[str, tuple[int, int]], rank: int | Mapping[str, int],
                   send_A: bool = True, send_B: bool = True) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a LoRA adapter's factors: A (r, d_in) and / or B (d_out, r) of every module
    (d_out, d_in), at one ``rank`` or a rank per module; a module at rank 0 is not adapted (no key)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for module, (d_out, d_in) in module_shapes.items():
        r = rank if isinstance(rank, int) else rank[module]
        if r > 0 and send_A:
            shapes[module + A_SUFFIX] = (r, d_in)
        if r > 0 and send_B:
            shapes[module + B_SUFFIX] = (d_out, r)
    return shapes


def payload_bytes(payload: Mapping[str, np.ndarray]) -> int:
    """Size of the arrays in a payload (their ``nbytes``, without any wire framing)."""
    return int(sum(np.asarray(v).nbytes for v in payload.values()))


def to_array_record(payload: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Payload -> Flower ArrayRecord (keys kept, arrays copied to contiguous float32 / int)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in payload.items()})


def from_array_record(record: ArrayRecord) -> Payload:
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


def truncate_rank(f: Factors, rank: int) -> Factors:
    """Keep the first ``rank`` components (rows of A, columns of B)."""
    if rank > f.rank:
        raise ValueError(f"cannot truncate rank {f.rank} up to {rank}")
    return Factors(f.A[:rank].copy(), f.B[:, :rank].copy())


def fit_rank(f: Factors, rank: int) -> Factors:
    """Zero-pad or truncate to ``rank`` (a client takes the first r_k components)."""
    return truncate_rank(pad_rank(f, max(rank, f.rank)), rank)


def normalise(weights: Weights) -> np.ndarray:
    """Weights summing to one (uniform if they sum to zero)."""
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum()
    return np.full(len(w), 1.0 / len(w)) if total <= 0 else w / total


@dataclass(frozen=True)
class Combine:
    """How the clients' arrays of one key are combined: the weighted mean (FedAvg), or one of
    Flower's robust rules, coordinate by coordinate and unweighted as Flower's own strategies
    are: the median (``FedMedian``), the mean after cutting the ``trim`` fraction of the values
    at each end (``FedTrimmedAvg``, beta = ``trim``: scipy's ``trim_mean``, which Flower's own
    ``trim_mean`` copies line for line), or Bulyan's second step (``Bulyan``: per coordinate the
    mean of the K - 2 ``malicious`` values nearest the median, Flower's
    ``aggregate_n_closest_weights``; its first step, selecting uploads by Krum score, happens
    before, in ``strategies/robust.py``). With two clients the median and the trimmed mean
    equal the mean (nothing is cut from two values); they need three or more to resist one.
    'krum' and 'multikrum' only select uploads: their arrays are then combined by the mean."""

    rule: AggregationRule = "mean"
    trim: float = 0.2  # trimmed_mean: fraction cut at each end, in [0, 0.5)
    malicious: int = 1  # bulyan: f (the K - 2f values nearest the median are averaged)

    @property
    def robust(self) -> bool:
        """Whether the arrays are combined by a coordinate-wise rule instead of the weighted mean."""
        return self.rule in ("median", "trimmed_mean", "bulyan")

    def __call__(self, arrays: Sequence[np.ndarray], weights: Weights) -> np.ndarray:
        """(K arrays of one shape) -> the combined array (float64); ``weights`` count for the mean only."""
        stacked = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])  # (K, ...)
        if self.rule == "median":
            return np.asarray(np.median(stacked, axis=0))
        if self.rule == "trimmed_mean":
            from scipy.stats import trim_mean

            return np.asarray(trim_mean(stacked, self.trim, axis=0))
        if self.rule == "bulyan":
            from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights

            beta = max(1, len(arrays) - 2 * self.malicious)
            median = np.median(stacked, axis=0)
            return np.asarray(aggregate_n_closest_weights([median], [[a] for a in stacked], beta)[0])
        return np.asarray(np.tensordot(normalise(weights), stacked, axes=1))


MEAN = Combine()


def weighted_average(
    payloads: Sequence[Mapping[str, np.ndarray]], weights: Weights, combine: Combine | None = None
) -> Payload:
    """Key-wise weighted mean of payloads with identical keys and shapes: plain FedAvg, through
    Flower's own ``strategy_utils.aggregate_arrayrecords`` (or ``combine``'s robust rule). The
    result has the adapters' dtype (:data:`ADAPTER_DTYPE`), whatever the uploads' dtypes."""
    from flwr.app import MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    if not payloads:
        raise ValueError("weighted_average needs at least one payload")
    if combine is not None and combine.robust:
        return {key: combine([p[key] for p in payloads], weights).astype(ADAPTER_DTYPE) for key in payloads[0]}
    w = normalise(weights)
    records = [RecordDict({"arrays": to_array_record(p), "metrics": MetricRecord({"weight": float(wk)})})
               for p, wk in zip(payloads, w)]
    averaged = from_array_record(aggregate_arrayrecords(records, "weight"))
    return {key: averaged[key].astype(ADAPTER_DTYPE) for key in payloads[0]}


def average_factors(
    factors: Sequence[Factors], weights: Weights, rank: int | None = None, combine: Combine | None = None
) -> Factors:
    """FedAvg of one module's factors: zero-pad every client to ``rank`` (default: the largest),
    then A = sum_k w_k A_k and B = sum_k w_k B_k *separately* (weights normalised here), or
    ``combine``'s coordinate-wise robust rule over the padded factors.

    The one pad-then-average of the platform: FedIT over mixed ranks, HetLoRA's norm-weighted
    mean, FedTreeLoRA's experts. Note that mean(B) mean(A) != mean(B A) in general.
    """
    rank = rank if rank is not None else max(f.rank for f in factors)
    padded = [pad_rank(f, rank) for f in factors]
    if combine is not None and combine.robust:
        A_robust = combine([f.A for f in padded], weights)  # (rank, d_in)
        B_robust = combine([f.B for f in padded], weights)  # (d_out, rank)
        return Factors(A_robust.astype(ADAPTER_DTYPE), B_robust.astype(ADAPTER_DTYPE))
    w = normalise(weights)
    A = np.tensordot(w, np.stack([f.A.astype(np.float64) for f in padded]), axes=1)  # (rank, d_in)
    B = np.tensordot(w, np.stack([f.B.astype(np.float64) for f in padded]), axes=1)  # (d_out, rank)
    return Factors(A.astype(ADAPTER_DTYPE), B.astype(ADAPTER_DTYPE))


def truncate_payload(payload: Mapping[str, np.ndarray], rank: int) -> Payload:
    """Keep the first ``rank`` components of every module (head arrays unchanged)."""
    factors, extras = split_payload(payload)
    cut = {m: Factors(f.A[:rank].copy(), f.B[:, :rank].copy()) for m, f in factors.items()}
    return join_payload(cut, extras, send_A=_has(payload, A_SUFFIX), send_B=_has(payload, B_SUFFIX))


def _has(payload: Mapping[str, np.ndarray], suffix: str) -> bool:
    return any(key.endswith(suffix) for key in payload)


def padded_average(
    payloads: Sequence[Mapping[str, np.ndarray]], weights: Weights, rank: int, combine: Combine | None = None
) -> Payload:
    """FedIT's aggregate over mixed ranks: every module's factors zero-padded to ``rank`` and
    averaged with :func:`average_factors`, the head arrays with :func:`weighted_average` (the
    zero-padding extension FLoRA uses to compare FedIT under heterogeneous ranks). Each client
    then takes the first r_k components (:func:`truncate_payload`). ``combine``: a robust rule
    instead of the weighted means."""
    split = [split_payload(p) for p in payloads]
    factors = {m: average_factors([f[m] for f, _ in split], weights, rank, combine) for m in split[0][0]}
    heads = [head for _, head in split]
    return join_payload(factors, weighted_average(heads, weights, combine) if heads[0] else {})


# --------------------------------------------------------------------------------------------
# products in factor space (never the dense d_out x d_in matrix)
# --------------------------------------------------------------------------------------------


def product_inner(B1: np.ndarray, A1: np.ndarray, B2: np.ndarray, A2: np.ndarray) -> float:
    """<B1 A1, B2 A2>_F = sum((B1^T B2) * (A1 A2^T)): r1 x r2 Gram products only."""
    gram_B = np.asarray(B1, np.float64).T @ np.asarray(B2, np.float64)  # (r1, r2)
    gram_A = np.asarray(A1, np.float64) @ np.asarray(A2, np.float64).T  # (r1, r2)
    return float(np.sum(gram_B * gram_A))


def product_norm(f: Factors) -> float:
    """||B A||_F from :func:`product_inner` (no dense product)."""
    return float(np.sqrt(max(product_inner(f.B, f.A, f.B, f.A), 0.0)))


def scaled(factors: Mapping[str, Factors], scales: Mapping[str, float]) -> dict[str, Factors]:
    """Fold each module's scale s into B, so that B A is the update dW itself (float64)."""
    return {m: Factors(f.A, scales[m] * np.asarray(f.B, np.float64)) for m, f in factors.items()}

"""The server's defence against bad updates: malformed uploads and absurd norms are refused.

An upload is checked against the shapes the method expects (keys, shapes, NaN / Inf) and its norm
against a reference the round's clients cannot move (``faults.max_update_ratio`` x the lower
median of the norms accepted in the last aggregated round), then the round's valid uploads
against each other (``faults.norm_outlier_factor`` x the median norm, with >= 3 updates) and an
absolute bound (``faults.max_update_norm``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedlora.lora import Payload
from fedlora.schema import FaultsConfig


def update_norm(payload: Mapping[str, np.ndarray]) -> float:
    """L2 norm of all arrays of an upload together."""
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in payload.values()))


def check_upload(payload: Payload, expected: Mapping[str, tuple[int, ...]]) -> str:
    """Why an upload is malformed ('' if it is not): keys, shapes, NaN / Inf."""
    missing = sorted(set(expected) - set(payload))
    unexpected = sorted(set(payload) - set(expected))
    if missing or unexpected:
        return f"missing keys {missing[:3]} / unexpected keys {unexpected[:3]}"
    for key, shape in expected.items():
        if tuple(payload[key].shape) != tuple(shape):
            return f"{key} has shape {tuple(payload[key].shape)}, expected {tuple(shape)}"
        if not np.all(np.isfinite(payload[key])):
            return f"{key} contains NaN or Inf"
    return ""


def norm_outliers(payloads: Sequence[Payload], faults: FaultsConfig) -> dict[int, str]:
    """Index -> reason for every payload whose norm is absurd: above ``faults.max_update_norm``,
    or above ``faults.norm_outlier_factor`` x the round's median norm (with >= 3 updates)."""
    norms = [update_norm(p) for p in payloads]
    limit = faults.max_update_norm or math.inf
    if faults.norm_outlier_factor and len(payloads) >= 3:
        limit = min(limit, faults.norm_outlier_factor * float(np.median(norms)))
    return {i: f"update norm {n:.3g} above the bound {limit:.3g}" for i, n in enumerate(norms) if n > limit}


def ratio_bound(norm: float, reference: float, ratio: float) -> str:
    """Why an update of L2 norm ``norm`` is too large for ``faults.max_update_ratio = ratio`` x
    the ``reference`` norm ('' if it is not, or if either is 0: no bound)."""
    if ratio and reference > 0 and not norm <= ratio * reference:
        return f"update norm {norm:.3g} above faults.max_update_ratio x the reference norm ({ratio:g} x {reference:.3g})"
    return ""


def reference_norm(norms: Sequence[float], previous: float) -> float:
    """The next round's reference norm: the lower median of this round's accepted, non-zero update
    norms (with two clients the smaller one, so no single client can raise it), or ``previous``
    when there is none (a round of empty uploads, e.g. a warm-up)."""
    positive = sorted(n for n in norms if n > 0)
    return positive[(len(positive) - 1) // 2] if positive else previous


def replacement_problem(payload: Payload, expected: Payload) -> str:
    """Why ``payload`` cannot replace ``expected`` ('' if it can): keys, shapes, finite values."""
    if payload.keys() != expected.keys():
        missing, unexpected = sorted(expected.keys() - payload.keys()), sorted(payload.keys() - expected.keys())
        return (f"expected the keys of its global arrays ({len(expected)}), missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}")
    for key, value in payload.items():
        if value.shape != expected[key].shape:
            return f"{key!r} has shape {value.shape}, expected {expected[key].shape}"
        if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
            return f"{key!r} is not finite numbers"
    return ""

"""Synthetic label noise for client training labels.

Exactly ``round(rate * n)`` examples are flipped, chosen uniformly without replacement, so every
example is flipped with probability ``rate`` and the realised rate equals the requested one up to
rounding (a per-example coin would miss it by ~2 points at n = 500).

- ``symmetric``: a flipped label becomes a uniformly random *different* class.
- ``pairflip``: a flipped label ``y`` becomes ``(y + 1) % C``.
"""

from __future__ import annotations

import numpy as np

from fedlora.data.sources import DataError

NOISE_KINDS = ("none", "symmetric", "pairflip")


def apply_label_noise(
    labels: np.ndarray, kind: str, rate: float, num_classes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Return (noisy labels, boolean mask of flipped examples); ``labels`` is not modified."""
    labels = np.asarray(labels, dtype=np.int64)
    flipped = np.zeros(len(labels), dtype=bool)
    if kind not in NOISE_KINDS:
        raise DataError(f"data.label_noise must be one of {', '.join(NOISE_KINDS)}, got {kind!r}")
    if not 0.0 <= rate < 1.0:
        raise DataError(f"data.noise_rate must be in [0, 1), got {rate}")
    if kind == "none" or rate == 0.0 or len(labels) == 0:
        return labels.copy(), flipped
    if num_classes < 2:
        raise DataError(f"label noise needs at least 2 classes, got {num_classes}")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(labels), size=round(rate * len(labels)), replace=False)
    flipped[chosen] = True
    noisy = labels.copy()
    if kind == "pairflip":
        noisy[chosen] = (labels[chosen] + 1) % num_classes
    else:  # symmetric: a shift in 1..C-1 is uniform over the other C-1 classes
        shift = rng.integers(1, num_classes, size=len(chosen))
        noisy[chosen] = (labels[chosen] + shift) % num_classes
    return noisy, flipped

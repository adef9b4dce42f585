"""The weight-share rule: how much of a round one client can weigh, whatever a method weighs by.

One rule for every method, in three pure steps. The server weighs uploads with it
(``strategies/screening.py``, ``strategies/evaluation.py``, HetLoRA's norms, FedPiSSA's weights);
under secure aggregation the server weighs the round's clients by the sizes they declared when they
joined, and each client checks the weight the server sends it against the same rule on the table
the server sent (``clients/secure.py``, through :func:`fedlora.secagg.weight_ratio`, which calls
:func:`declared_weights`): secure and plain rounds weigh a client alike.

1. **Entitlement, fixed when the clients join.** Client k declared a training partition of D_k
   examples when it joined (its profile's ``num_train_examples``); it is entitled to
   e_k = min(D_k, ``faults.max_size_ratio`` x the lower median of the declared sizes)
   (:func:`entitled_sizes`). The lower median is the federation's, not a round's, and no single
   client can raise it (with two clients it is the smaller one). Honest partitions of every shipped
   config and scenario reach at most 4.5 x their lower median (seeds 0-4; the default ratio is 8),
   so an honest client is entitled to its whole partition.
2. **Counts cut to the entitlement.** An example count weighs at most e_k (:func:`client_weights`;
   the server refuses a count above D_k before this); an evaluation count at most the test or
   validation split that e_k implies under the run's split fractions (:func:`split_ceiling`).
3. **A share bound per round, for any weights.** In a round whose weighed clients are S, no
   client's share of the weights exceeds
   b(S) = max(``faults.max_client_share``, max_{k in S} e_k / sum_{j in S} e_j) (:func:`share_bound`):
   the larger of the operator's floor and the share the largest entitlement of the round gives its
   client (``max_client_share`` = 1 / the sample: every client weighs the same, on purpose). The weights (example counts, HetLoRA's update norms, uniform weights) are cut by
   water-filling to it (:func:`capped_weights`). Honest example weights sit at the plain counts
   (n_k = e_k, so n_k / sum n <= max e / sum e <= b(S)); weights a method derives from the uploads
   (norms) are bounded by b(S) whatever a client uploads.

What it still allows: a client that declares a partition up to ``max_size_ratio`` x the lower median
weighs that much (no example is checked: the server sees counts, not data), and under norm-derived
weights a client takes up to b(S) of a round by scaling its update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Numbers = Sequence[float] | np.ndarray  # (K,): one per client
SHARE_TOLERANCE = 1e-9  # relative slack of the share test (a bound computed as max / sum, compared with it)


def size_cut(declared: Numbers, max_ratio: float) -> float:
    """The most examples any client is entitled to: ``max_ratio`` x the lower median of the positive
    declared training sizes (``max_ratio`` 0, or no positive size: no cut, inf)."""
    sizes = np.asarray(declared, dtype=np.float64)
    positive = np.sort(sizes[sizes > 0])
    return max_ratio * float(positive[(positive.size - 1) // 2]) if max_ratio and positive.size else math.inf


def entitlements(declared: Numbers, cut: float) -> np.ndarray:
    """Declared training sizes (K,) -> entitlements (K,): each cut to ``cut`` (:func:`size_cut`);
    a client that declared no size (0) is entitled to the cut (any count, inf, with no cut)."""
    sizes = np.asarray(declared, dtype=np.float64)
    return np.where(sizes > 0, np.minimum(sizes, cut), cut)


def entitled_sizes(declared: Numbers, max_ratio: float) -> np.ndarray:
    """Declared training sizes (K,) -> entitlements (K,): each cut to ``max_ratio`` x the lower
    median of the positive declared sizes (``max_ratio`` 0: no cut; :func:`size_cut`,
    :func:`entitlements`)."""
    return entitlements(declared, size_cut(declared, max_ratio))


def share_bound(entitled: Numbers, max_share: float) -> float:
    """The largest share of a round one client may weigh, for a round whose weighed clients are
    entitled to ``entitled``: the larger of ``max_share`` (``faults.max_client_share``) and the
    largest entitlement's share of the round, at most 1 (``max_share`` alone when an entitlement
    is unknown, inf, and when it is an equal share of the round or less: the operator asked for
    every client to weigh the same, as under Flower's DP wrapper)."""
    e = np.asarray(entitled, dtype=np.float64)
    if max_share * e.size <= 1.0 + SHARE_TOLERANCE:
        return max_share  # an equal share asked for (1 / the sample): every client weighs the same
    total = float(e.sum())
    declared = float(e.max()) / total if 0 < total < math.inf else 0.0
    return min(1.0, max(max_share, declared))


def capped_weights(weights: Numbers, max_share: float) -> np.ndarray:
    """Weights (K,) -> weights (K,) in the same units, no share above ``max_share``.

    The weights above a level T are cut to T, with T the largest level at which the cut weights
    satisfy max_k w_k / sum w <= max_share (water-filling: the smallest change that bounds every
    share); weights that already satisfy it are returned unchanged (the same floats), and so are
    those of a round with one positive weight. With fewer than 1 / max_share positive weights no
    such level exists and the positive weights weigh the same.
    """
    n = np.asarray(weights, dtype=np.float64)  # (K,)
    positive = int(np.count_nonzero(n > 0))
    if max_share >= 1.0 or positive <= 1 or n.max() <= max_share * n.sum() * (1 + SHARE_TOLERANCE):
        return n  # a lone client weighs everything, whatever the bound
    if positive * max_share <= 1.0:
        return (n > 0).astype(np.float64)  # every positive weight weighs the same (share 1 / positive)
    ordered = np.sort(n)[::-1]  # largest first
    for cut in range(1, positive):  # cut the `cut` largest weights to the level T
        rest = ordered[cut:].sum()
        level = max_share * rest / (1.0 - cut * max_share)  # T / (cut T + rest) = max_share
        if ordered[cut] <= level <= ordered[cut - 1] and cut * max_share < 1.0:
            return np.asarray(np.minimum(n, level), dtype=np.float64)
    return (n > 0).astype(np.float64)


def client_weights(counts: Numbers, entitled: Numbers, max_share: float) -> np.ndarray:
    """A round's example counts (K,) -> aggregation weights (K,): each count cut to its client's
    entitlement, then no share above :func:`share_bound` (``entitled``, ``max_share``)."""
    cut = np.minimum(np.asarray(counts, dtype=np.float64), np.asarray(entitled, dtype=np.float64))
    return capped_weights(cut, share_bound(entitled, max_share))


def declared_weights(declared: Numbers, cut: float, max_share: float) -> np.ndarray:
    """The weights of a round whose clients are weighed by the training sizes they declared when
    they joined (``declared``, (K,); secure aggregation, where no count arrives before the sum):
    :func:`client_weights` of those sizes under the entitlements ``cut`` gives
    (:func:`entitlements`). The server's weights and each secure client's check of its own."""
    return client_weights(declared, entitlements(declared, cut), max_share)


def split_ceiling(entitled: float, fraction: float, train_fraction: float) -> float:
    """The most examples an honest client entitled to ``entitled`` training examples holds in a
    split of ``fraction`` of its data when ``train_fraction`` (1 - test - validation) of it trains:
    its N examples give round(fraction x N) to the split (``fedlora.data.federated.split_sizes``)
    and at least train_fraction x N - 1 to training, so the split holds at most
    floor(fraction x (entitled + 1) / train_fraction + 0.5)."""
    if fraction <= 0:
        return 0.0
    if train_fraction <= 0 or not math.isfinite(entitled):
        return math.inf
    return float(math.floor(fraction * (entitled + 1) / train_fraction + 0.5))

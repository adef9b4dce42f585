"""The weight-share rule, once, in the core: example counts -> aggregation weights, no client
above ``faults.max_client_share``.

The server weighs uploads with it (``strategies/screening.py``, ``strategies/evaluation.py``,
re-exported as ``fedlora.strategies.replies.capped_weights``) and a secure-aggregation client checks
the weight the server sends it against it (``clients/secure.py``, through
:func:`fedlora.secagg.weight_ratio`): both sides call this one function.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def capped_weights(counts: Any, max_share: float) -> np.ndarray:
    """Example counts (K,) -> aggregation weights (K,) in the same units, no share above ``max_share``.

    The counts above a level T are cut to T, with T the largest level at which the cut counts
    satisfy max_k w_k / sum w <= max_share (water-filling: the smallest change that bounds every
    share); counts that already satisfy it are returned unchanged (the same floats), and so are
    those of a round with one positive count. With fewer than 1 / max_share positive counts no
    such level exists and the positive counts weigh the same.
    """
    n = np.asarray(counts, dtype=np.float64)  # (K,)
    positive = int(np.count_nonzero(n > 0))
    if max_share >= 1.0 or positive <= 1 or n.max() <= max_share * n.sum():
        return n  # a lone client weighs everything, whatever the bound
    if positive * max_share <= 1.0:
        return (n > 0).astype(np.float64)  # every positive count weighs the same (share 1 / positive)
    ordered = np.sort(n)[::-1]  # largest first
    for cut in range(1, positive):  # cut the `cut` largest counts to the level T
        rest = ordered[cut:].sum()
        level = max_share * rest / (1.0 - cut * max_share)  # T / (cut T + rest) = max_share
        if ordered[cut] <= level <= ordered[cut - 1] and cut * max_share < 1.0:
            return np.asarray(np.minimum(n, level), dtype=np.float64)
    return (n > 0).astype(np.float64)

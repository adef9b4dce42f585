"""Byzantine-robust selection of uploads: Flower's Krum, MultiKrum and Bulyan rules on LoRA factors.

``faults.aggregation = 'krum' | 'multikrum' | 'bulyan'`` (for the methods whose aggregate is a
mean of arrays: the capability matrix's "robust aggregation"). Each round, after validation and
the anomaly rule, :func:`select_uploads` scores every valid upload with Flower's own
``select_multikrum`` (``flwr.serverapp.strategy.multikrum``): the sum of squared L2 distances to
its n - f - 2 nearest uploads (f = ``faults.num_malicious``), lowest first, and keeps

- ``krum``: the one best upload (Flower's ``Krum``): the method then aggregates it alone;
- ``multikrum``: the ``faults.multikrum_select`` best (0: n - f), aggregated by the method's
  weighted mean (Flower's ``MultiKrum`` averages them weighted by examples too);
- ``bulyan``: the n - 2f best (Flower's ``Bulyan`` selection, theta = n - 2f), which the method
  then combines coordinate by coordinate with :class:`fedlora.lora.Combine`'s ``bulyan`` rule (per
  coordinate the mean of the n - 4f values nearest their median, beta = theta - 2f).

**On the factors, not the products.** The distances are between the uploaded arrays (LoRA factors
and head), every key zero-padded to the largest shape any upload has for it (mixed ranks), as the
methods aggregate them: the products s B A would cost d_out x d_in per module and client, and a
method whose aggregate is a mean of factors is poisoned through the factors. Two uploads whose
products agree but whose factors differ by an invertible r x r mix would look far apart; among
clients that all start a round from the same download (every method here) their factors stay
aligned.

**What it needs.** Krum's guarantee holds for n >= 2f + 3 uploads, Bulyan's for n >= 4f + 3
(:func:`fedlora.schema.minimum_uploads`): a config whose rounds sample fewer is refused before the run
(``fedlora.methods``), and a round that gets fewer valid uploads (failures, rejections) leaves the
state unchanged and counts towards ``faults.max_failed_rounds``, as Flower's Bulyan skips such a
round. The uploads not kept are not refused: they arrived valid, are counted in the round's bytes
and clients, and are marked ``byzantine_kept = false`` in their ``per_client_train`` entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedlora import protocol
from fedlora.schema import AggregationRule, minimum_uploads

SELECTING: tuple[AggregationRule, ...] = ("krum", "multikrum", "bulyan")
__all__ = ["SELECTING", "kept_count", "minimum_uploads", "padded", "select_uploads"]


def kept_count(rule: AggregationRule, n: int, malicious: int, select: int) -> int:
    """How many of ``n`` uploads ``rule`` keeps: Krum 1, MultiKrum ``select`` (0: n - f), Bulyan n - 2f."""
    if rule == "krum":
        return 1
    if rule == "multikrum":
        return min(n, select) if select > 0 else max(1, n - malicious)
    if rule == "bulyan":
        return max(1, n - 2 * malicious)
    return n


def padded(payloads: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Every upload with every key zero-padded to the largest shape of that key over the uploads
    (a rank-r A (r, d_in) or B (d_out, r) gains zero rows or columns); keys in sorted order."""
    keys = sorted(payloads[0])
    shapes = {key: tuple(np.max([np.shape(p[key]) for p in payloads], axis=0)) for key in keys}
    out = []
    for payload in payloads:
        one = {}
        for key in keys:
            array = np.asarray(payload[key], dtype=np.float64)
            one[key] = np.pad(array, [(0, full - have) for full, have in zip(shapes[key], array.shape)])
        out.append(one)
    return out


def select_uploads(payloads: Sequence[Mapping[str, np.ndarray]], rule: AggregationRule, malicious: int,
                   select: int = 0) -> list[int]:
    """The indices (ascending) of the uploads ``rule`` keeps, by Flower's ``select_multikrum``; all
    of them for a rule that selects nothing (mean, median, trimmed_mean)."""
    if rule not in SELECTING or len(payloads) <= 1:
        return list(range(len(payloads)))
    from flwr.app import Array, ArrayRecord, RecordDict
    from flwr.serverapp.strategy.multikrum import select_multikrum

    contents = [RecordDict({protocol.ARRAYS_RECORD: ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in payload.items()})})
                for payload in padded(payloads)]
    position = {id(content): index for index, content in enumerate(contents)}
    chosen = select_multikrum(contents, malicious, kept_count(rule, len(payloads), malicious, select))
    return sorted(position[id(content)] for content in chosen)

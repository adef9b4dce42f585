"""Poisoning within the bounds: every accepted update measured, every round (issue 40, item 3).

The norm bounds (``validation.py``) refuse absurd updates; an update scaled by 5, a sign flip, a
replay or a copy passes them. This module measures each update that passed validation and flags
the anomalous ones (the ``faults.anomaly_*`` and ``faults.duplicate_*`` options, ``schema.py``):

- **the update** of a client is the change of its uploaded LoRA factors (and head): each uploaded
  array minus the array of the same key and shape the client downloaded this round; an array it
  did not download (a factor it keeps, e.g. FedSA-LoRA's B) counts from zero. The factors, not the
  product s B A: they are what every method aggregates (a poisoned factor is what moves the
  model), the product would cost d_out x d_in per module and client, and a replay or a copy is
  identical in the factors anyway;
- its **norm** (L2, all arrays together) and its **cosine similarity** to the round's
  coordinate-wise median update (Flower's FedMedian rule; arrays of mixed ranks zero-padded to the
  largest, as the robust aggregation does), which a minority of clients cannot move;
- a **duplicate** flag: an upload identical, within ``faults.duplicate_tolerance``, to an upload of
  another client of the same round or of any client in the last ``faults.duplicate_rounds``
  rounds (a replay of its own earlier update, a copy of another's). Memory stays bounded: the
  server keeps one :data:`SKETCH_SIZE`-number count sketch per upload of those rounds
  (:class:`Fingerprint`, checkpointed), never the uploads; the sketch is linear, so the distance
  of two sketches is about the distance of the uploads (equal for identical ones);
- the **rule**: a change norm above ``faults.anomaly_norm_factor`` x the round's lower median
  change norm or a cosine below ``faults.anomaly_min_cosine`` (both in a round of >= 3 updates:
  of two, neither is a reference for the other), or a duplicate. ``faults.anomaly_action = 'log'`` (the default) only logs and counts it: detection
  changes no model and no metric; ``'reject'`` refuses the update.

What it cannot see: a majority colluding (the median is theirs), a poisoned update whose norm and
direction look like the honest ones, a replay with noise above the tolerance added.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from fedlora import state
from fedlora.schema import FaultsConfig

SKETCH_SIZE: Final = 256  # numbers kept per upload for the duplicate check (a count sketch)

# the keys this module adds to a client's entry of the round (results.json rounds[].per_client_train[<partition>])
UPDATE_NORM: Final = "update_norm"  # L2 norm of the change of the uploaded factors
UPDATE_COSINE: Final = "update_cosine"  # cosine to the round's coordinate-wise median change (NaN: none)
UPDATE_DUPLICATE_OF: Final = "update_duplicate_of"  # "client <k> round <r>" it duplicates, "" if none
UPDATE_ANOMALY: Final = "update_anomaly"  # why the rule flagged it, "" if it did not


@state.register
@dataclass
class Fingerprint:
    """What the server keeps of an upload for ``faults.duplicate_rounds`` rounds."""

    round: int
    partition: int
    sketch: np.ndarray  # count sketch of the uploaded arrays, SKETCH_SIZE float64
    change: float  # the update's norm (the scale the tolerance is a fraction of)


@dataclass
class UpdateCheck:
    """One update's measures and the rule's verdict."""

    partition: int
    norm: float
    cosine: float = math.nan
    duplicate_of: str = ""
    reasons: list[str] = field(default_factory=list)

    def entry(self) -> dict[str, Any]:
        """The measures as a per-client entry of the round (:data:`UPDATE_NORM`, ...)."""
        return {UPDATE_NORM: self.norm, UPDATE_COSINE: self.cosine, UPDATE_DUPLICATE_OF: self.duplicate_of,
                UPDATE_ANOMALY: "; ".join(self.reasons)}


def update_change(upload: Mapping[str, np.ndarray], download: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each uploaded array minus the downloaded array of the same key and shape (from zero without one)."""
    change: dict[str, np.ndarray] = {}
    for key, value in upload.items():
        base = download.get(key)
        value = np.asarray(value, dtype=np.float64)
        change[key] = value - base if base is not None and base.shape == value.shape else value
    return change


def sketch(payload: Mapping[str, np.ndarray]) -> np.ndarray:
    """A count sketch of ``payload``: every entry added, with a random sign, to one of
    :data:`SKETCH_SIZE` buckets (seeded by its key and size, so the same for every client and round)."""
    out = np.zeros(SKETCH_SIZE)
    for key in sorted(payload):
        values = np.asarray(payload[key], dtype=np.float64).ravel()
        buckets, signs = _sketch_hashes(key, values.size)
        out += np.bincount(buckets, weights=signs * values, minlength=SKETCH_SIZE)
    return out


@functools.lru_cache(maxsize=4096)
def _sketch_hashes(key: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The buckets and signs of an array ``key`` of ``size`` entries (drawn once per process:
    2 bytes an entry, for every client and round)."""
    rng = np.random.default_rng([zlib.crc32(key.encode()), size])
    buckets = rng.integers(0, SKETCH_SIZE, size).astype(np.uint8)
    signs = (rng.integers(0, 2, size) * 2 - 1).astype(np.int8)
    buckets.flags.writeable = signs.flags.writeable = False
    return buckets, signs


def _norm(arrays: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v))) for v in arrays.values()))


def _padded(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.pad(array, [(0, s - n) for s, n in zip(shape, array.shape)])


def median_change(changes: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The coordinate-wise median of the changes, key by key over the clients that uploaded the
    key; arrays of the same rank (ndim) but other sizes (mixed LoRA ranks) zero-padded to the largest.
    The keys every client uploaded at one shape (the usual case) take one median over their
    concatenation: the same numbers, one call instead of one per key."""
    median: dict[str, np.ndarray] = {}
    keys = sorted({k for change in changes for k in change})
    alike = [k for k in keys if all(k in change for change in changes)
             and len({change[k].shape for change in changes}) == 1]
    if alike:
        flat = np.median(np.stack([np.concatenate([change[k].ravel() for k in alike]) for change in changes]), axis=0)
        ends = np.cumsum([changes[0][k].size for k in alike])[:-1]
        for key, part in zip(alike, np.split(flat, ends), strict=True):
            median[key] = part.reshape(changes[0][key].shape)
    for key in sorted(set(keys) - set(alike)):
        arrays = [change[key] for change in changes if key in change]
        if len({a.ndim for a in arrays}) != 1:
            continue
        shape = tuple(max(sizes) for sizes in zip(*(a.shape for a in arrays)))
        median[key] = np.median(np.stack([_padded(a, shape) for a in arrays]), axis=0)
    return median


def cosine(change: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """Cosine similarity of ``change`` and ``reference`` over their common keys (NaN: a zero vector)."""
    dot = mine = theirs = 0.0
    for key, value in change.items():
        if key not in reference or reference[key].ndim != value.ndim:
            continue
        padded = _padded(value, reference[key].shape) if value.shape != reference[key].shape else value
        dot += float(np.sum(padded * reference[key]))
        mine += float(np.sum(np.square(value)))
        theirs += float(np.sum(np.square(reference[key])))
    if mine <= 0 or theirs <= 0:
        return math.nan
    return max(-1.0, min(1.0, dot / math.sqrt(mine * theirs)))


def lower_median(norms: Sequence[float]) -> float:
    """The lower median of the positive change norms of a round (0 with fewer than two: no reference)."""
    positive = sorted(n for n in norms if n > 0)
    return positive[(len(positive) - 1) // 2] if len(positive) >= 2 else 0.0


def verdict(norm: float, middle: float, cosine_to_median: float, updates: int, faults: FaultsConfig) -> list[str]:
    """Why the rule flags an update (duplicates aside; [] if it does not): its change norm ``norm``
    above ``faults.anomaly_norm_factor`` x the round's lower median change norm ``middle``
    (:func:`lower_median`), or its cosine to the round's median change below
    ``faults.anomaly_min_cosine``, both in a round of ``updates`` >= 3 measured updates: with two,
    the lower median is the other client's norm, and the rule would call the larger of two honest
    updates of different ranks an outlier (fedhera_llm's tiers: 2.8 to 3.4 x). A pure
    function of the measures each round's record keeps (``update_norm``, ``update_cosine``), so a
    rule can be judged on recorded runs (benchmarks/poisoning.py)."""
    reasons = []
    if faults.anomaly_norm_factor and updates >= 3 and middle > 0 and norm > faults.anomaly_norm_factor * middle:
        reasons.append(f"update norm {norm:.3g} above faults.anomaly_norm_factor x the round's "
                       f"median ({faults.anomaly_norm_factor:g} x {middle:.3g})")
    if updates >= 3 and cosine_to_median < faults.anomaly_min_cosine:  # NaN (a zero update) is never below
        reasons.append(f"cosine {cosine_to_median:.3g} to the round's median update below "
                       f"faults.anomaly_min_cosine ({faults.anomaly_min_cosine:g})")
    return reasons


def check_updates(uploads: Sequence[tuple[int, Mapping[str, np.ndarray], Mapping[str, np.ndarray]]],
                  history: Sequence[Fingerprint], server_round: int, faults: FaultsConfig
                  ) -> tuple[list[UpdateCheck], list[Fingerprint]]:
    """Measure the round's accepted updates, ``(partition, upload, download)`` in partition order,
    against each other and ``history``; return their checks and the history to keep (the last
    ``faults.duplicate_rounds`` rounds, this one included)."""
    changes = [update_change(upload, download) for _, upload, download in uploads]
    norms = [_norm(change) for change in changes]
    checks = [UpdateCheck(partition, norm) for (partition, _, _), norm in zip(uploads, norms)]
    if len(changes) >= 2:
        reference = median_change(changes)
        for check, change in zip(checks, changes):
            check.cosine = cosine(change, reference)
    middle = lower_median(norms)
    for check in checks:
        check.reasons.extend(verdict(check.norm, middle, check.cosine, len(changes), faults))
    if not faults.duplicate_rounds:
        return checks, []
    kept = [f for f in history if isinstance(f, Fingerprint) and isinstance(f.sketch, np.ndarray)
            and f.sketch.shape == (SKETCH_SIZE,) and server_round - faults.duplicate_rounds <= f.round < server_round]
    earlier = list(kept)
    for check, (partition, upload, _) in zip(checks, uploads):
        if check.norm <= 0:  # no change: nothing to replay, nothing that moves the model
            continue
        mine = Fingerprint(server_round, partition, sketch(upload), check.norm)
        for other in earlier:
            if other.partition == partition and other.round == server_round:
                continue
            distance = float(np.linalg.norm(mine.sketch - other.sketch))
            if distance <= faults.duplicate_tolerance * max(mine.change, other.change):
                check.duplicate_of = f"client {other.partition} round {other.round}"
                whose = "its own" if other.partition == partition else f"client {other.partition}'s"
                when = "this round" if other.round == server_round else f"round {other.round}"
                check.reasons.append(f"identical to {whose} update of {when} (faults.duplicate_tolerance "
                                     f"{faults.duplicate_tolerance:g})")
                break
        earlier.append(mine)
    return checks, earlier

"""A client's reply, read by the server in steps a reader can follow.

The reply pipeline (``pipeline.py``, ``ReplyPipeline``) runs them in this order, one reply at a
time, then over the round:

1. **parse**: the records a reply must carry (``arrays``, ``metrics``), every metric a plain
   number, declared, within its range, with the keys it needs beside it, the record within its
   size budget (:func:`parse_metrics`; the contract is ``fedlora/protocol.py``'s
   :data:`~fedlora.protocol.TRAIN_RULES`, :data:`~fedlora.protocol.EVALUATE_RULES`,
   :data:`~fedlora.protocol.TRAIN_PATTERNS`);
2. **validate**: the partition the reply speaks for (it must be its sender's), the example count
   against what the client declared when it joined (and ``faults.max_examples``), the arrays'
   keys, shapes and dtypes against the expected upload (float only, cast to the adapters' dtype),
   finiteness, and the update's norm against the reference norm (``faults.max_update_ratio``)
   (:func:`parse_train_reply`);
3. **screen** the round's valid uploads (norm outliers, the anomaly rule: ``screening.py``), then
   **weigh**: the example counts as aggregation weights by the weight-share rule
   (:mod:`fedlora.shares`: each count cut to its client's entitlement, no share above the round's
   bound; :func:`fedlora.strategies.screening.weigh`);
4. **account** (the round's record), **select** (a Byzantine-robust rule) and the method's
   **aggregate** (``pipeline.py``).

A reply that fails a step is a :class:`Rejection` with its reason; nothing here raises on what a
client sent. Evaluation replies go through the same parse and validate steps
(:func:`parse_evaluate_reply`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message

from fedlora import protocol
from fedlora.lora import ADAPTER_DTYPE, Payload
from fedlora.schema import ModelKind
from fedlora.shares import capped_weights, client_weights
from fedlora.strategies.download import Download
from fedlora.strategies.validation import check_upload, ratio_bound, update_norm

MAX_WORKER_TEXT = 200  # characters kept of each entry of a reply's worker record (where it ran)


@dataclass
class ClientUpload:
    """One valid training reply: the arrays (cast to the adapters' dtype) and the checked metrics.

    ``weight`` is what the aggregation weighs the upload by: its example count, cut down by the
    weight-share rule (:func:`fedlora.shares.client_weights`) where it would outweigh its bound.
    """

    partition_id: int
    payload: Payload
    num_examples: int
    metrics: dict[str, float]
    weight: float = -1.0  # < 0: the example count (set in __post_init__)
    worker: dict[str, str] = field(default_factory=dict)  # where the message ran (host, Ray node)
    download: Download | None = None  # what the client was sent this round (set once the reply is read)

    def __post_init__(self) -> None:
        if self.weight < 0:
            self.weight = float(self.num_examples)


@dataclass(frozen=True)
class Rejection:
    """Why a reply is refused. ``metrics``: its metrics when they were valid and spoke for the
    sender's partition (a client's DP epsilon is spent even when its update is refused)."""

    reason: str
    metrics: dict[str, float] | None = None


@dataclass(frozen=True)
class Expectation:
    """What the server knows about a training reply before reading it."""

    partition: int  # the sender's partition (the roster's, never the reply's)
    declared_examples: int = 0  # training examples the client declared when it joined (0: none)
    max_examples: int = 0  # faults.max_examples (0: no cap)
    reference_norm: float = 0.0  # the norm an update is compared with (0: no bound yet)
    max_update_ratio: float = 0.0  # faults.max_update_ratio (0: off)


# ---------------------------------------------------------------------------------------- parse
def parse_metrics(message: Message, rules: Mapping[str, protocol.MetricRule], required: Sequence[str],
                  patterns: Sequence[protocol.MetricPattern] = ()) -> dict[str, float] | str:
    """The reply's ``metrics`` record as floats, or why it breaks the contract (``fedlora/protocol.py``):
    at most :data:`~fedlora.protocol.MAX_METRIC_KEYS` keys, each text of at most
    :data:`~fedlora.protocol.MAX_METRIC_KEY_LENGTH` characters, :data:`~fedlora.protocol.MAX_METRIC_BYTES`
    in all; every key declared (in ``rules``, or matching one of ``patterns``), its value a number
    within its rule, its ``needs`` beside it and at most its ``at_most``; the ``required`` keys there.
    A client's text in the reason is cut short: the reason is logged and kept in the round's record."""
    record = message.content.metric_records.get(protocol.METRICS_RECORD)
    if record is None:
        return f"no {protocol.METRICS_RECORD!r} record"
    if len(record) > protocol.MAX_METRIC_KEYS:
        return f"{len(record)} metrics (at most {protocol.MAX_METRIC_KEYS})"
    size = 0
    for key in record:
        if not isinstance(key, str):
            return f"a metric key is not text ({type(key).__name__})"
        if len(key) > protocol.MAX_METRIC_KEY_LENGTH:
            return f"a metric key of {len(key)} characters ({_cut(key)}; at most {protocol.MAX_METRIC_KEY_LENGTH})"
        size += len(key.encode("utf-8", "replace")) + 8
    if size > protocol.MAX_METRIC_BYTES:
        return f"metrics of {size} bytes (at most {protocol.MAX_METRIC_BYTES})"
    metrics: dict[str, float] = {}
    found: dict[str, protocol.MetricRule] = {}
    for key, value in record.items():
        rule = rules.get(key) or next((p.rule for p in patterns if p.pattern.fullmatch(key)), None)
        if rule is None:
            return f"metric {_cut(key)} is not declared (fedlora/protocol.py)"
        number = _as_number(value)
        if number is None:
            return f"metric {_cut(key)} is not a number ({type(value).__name__})"
        problem = rule.problem(number)
        if problem:
            return f"metric {_cut(key)} = {number:g} {problem}"
        metrics[key], found[key] = number, rule
    missing = [key for key in required if key not in metrics]
    if missing:
        return f"metrics lack {missing}"
    for key, rule in found.items():
        absent = [other for other in rule.needs if other not in metrics]
        if absent:
            return f"metric {key!r} comes without {absent}"
        for bound in rule.at_most:
            if bound in metrics and not metrics[key] <= metrics[bound] * (1 + 1e-9):
                return f"metric {key!r} = {metrics[key]:g} is above {bound!r} = {metrics[bound]:g}"
    return metrics


def _cut(text: str, limit: int = 40) -> str:
    """A client's text for a reason line: at most ``limit`` characters, quoted."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def _as_number(value: Any) -> float | None:
    """A metric value as a float (an int too large for a float, a bool, a list, text: None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def parse_arrays(message: Message, expected: Mapping[str, tuple[int, ...]]) -> Payload | str:
    """The reply's ``arrays`` record as the expected upload, cast to :data:`ADAPTER_DTYPE`, or why
    not: keys, declared shapes (checked before anything is deserialised), float dtypes, the
    deserialised arrays' own shapes and dtypes, NaN / Inf (after the cast: 1e300 in float64 is
    Inf in float32)."""
    record = message.content.array_records.get(protocol.ARRAYS_RECORD)
    if record is None:
        return f"no {protocol.ARRAYS_RECORD!r} record"
    missing = sorted(set(expected) - set(record))
    unexpected = sorted(set(record) - set(expected))
    if missing or unexpected:
        return f"missing keys {missing[:3]} / unexpected keys {[str(k)[:40] for k in unexpected[:3]]}"
    payload: Payload = {}
    for key, shape in expected.items():
        array = record[key]
        try:
            declared_shape, declared_dtype = tuple(int(d) for d in array.shape), np.dtype(array.dtype)
            if declared_shape != tuple(shape):
                return f"{key} has shape {declared_shape[:4]}, expected {tuple(shape)}"
            if declared_dtype.kind != "f":
                return f"{key} has dtype {declared_dtype}, expected a float dtype"
            values = array.numpy()
        except Exception as error:  # noqa: BLE001 - whatever a client's bytes make numpy raise is a rejection
            return f"{key} cannot be read as an array ({type(error).__name__})"
        if values.dtype.kind != "f":
            return f"{key} holds dtype {values.dtype} (declared {declared_dtype}), expected a float dtype"
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow becomes Inf, refused below
            payload[key] = values.astype(ADAPTER_DTYPE)
    return check_upload(payload, expected) or payload


# ------------------------------------------------------------------------------------- validate
def parse_train_reply(
    message: Message,
    expect: Expectation,
    download: Download,
) -> ClientUpload | Rejection:
    """A training reply as a :class:`ClientUpload` (carrying the ``download`` it answers), or the
    :class:`Rejection` of its first problem.

    ``download.expected(metrics)`` gives the shapes the sender must upload once its metrics are
    known (HetLoRA's self-pruned rank is one of them).
    """
    metrics = parse_metrics(message, protocol.TRAIN_RULES, protocol.TRAIN_REQUIRED, protocol.TRAIN_PATTERNS)
    if isinstance(metrics, str):
        return Rejection(metrics)
    claimed = int(metrics[protocol.PARTITION_ID])
    if claimed != expect.partition:
        return Rejection(f"the reply claims partition {claimed}, its sender holds partition {expect.partition}")
    examples = int(metrics[protocol.NUM_EXAMPLES])
    if expect.declared_examples and examples > expect.declared_examples:
        return Rejection(f"{examples} training examples, above the {expect.declared_examples} it declared "
                         "when it joined", metrics)
    if expect.max_examples and examples > expect.max_examples:
        return Rejection(f"{examples} training examples, above faults.max_examples = {expect.max_examples}", metrics)
    payload = parse_arrays(message, download.expected(metrics))
    if isinstance(payload, str):
        return Rejection(payload, metrics)
    problem = ratio_bound(update_norm(payload), expect.reference_norm, expect.max_update_ratio)
    if problem:
        return Rejection(problem, metrics)
    return ClientUpload(expect.partition, payload, examples, metrics, worker=_worker(message), download=download)


def parse_evaluate_reply(message: Message, partition: int, kind: ModelKind) -> dict[str, float] | Rejection:
    """An evaluation reply's metrics (ranges checked, speaking for the sender's ``partition``)."""
    metrics = parse_metrics(message, protocol.EVALUATE_RULES, protocol.EVALUATE_REQUIRED[kind])
    if isinstance(metrics, str):
        return Rejection(metrics)
    claimed = int(metrics[protocol.PARTITION_ID])
    if claimed != partition:
        return Rejection(f"the reply claims partition {claimed}, its sender holds partition {partition}")
    return metrics


def _worker(message: Message) -> dict[str, str]:
    """Where the message ran (the reply's ``worker`` config record), as short texts."""
    record = message.content.config_records.get(protocol.WORKER_RECORD)
    if record is None:
        return {}
    return {str(k)[:40]: str(v)[:MAX_WORKER_TEXT] for k, v in list(record.items())[:8]}


# ---------------------------------------------------------------------------------------- weigh
# The weight-share rule lives in the core (fedlora/shares.py: clients under secure aggregation
# compute their own weight with it); the server's weigh step is strategies/screening.py's weigh.
__all__ = ["ClientUpload", "Expectation", "Rejection", "capped_weights", "client_weights", "parse_arrays",
           "parse_evaluate_reply", "parse_metrics", "parse_train_reply"]

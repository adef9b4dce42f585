"""A round's record of what arrived: refused replies, clients that did not reply, each client's
entry, the uploads' bytes, loss and time, and the received accuracy (results.json's ``rounds``).

Plain functions over a :class:`~fedlora.results.RoundRecord`; the reply pipeline
(:class:`~fedlora.strategies.pipeline.ReplyPipeline`) calls them while it reads a round's replies
(the personalised evaluation's aggregates are in ``evaluation.py``).
"""

from __future__ import annotations

import math
from logging import INFO, WARNING, getLogger
from typing import Any

import numpy as np
from flwr.app import Message

from fedlora import protocol
from fedlora.lora import payload_bytes
from fedlora.protocol import wire_size
from fedlora.results import RoundRecord
from fedlora.strategies.evaluation import CountBounds
from fedlora.strategies.replies import ClientUpload

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


class RoundFailedError(RuntimeError):
    """Too many consecutive rounds without enough valid updates (faults.max_failed_rounds)."""


def failed_rounds(server_round: int, valid: int, needed: int, needed_text: str, failed: int, max_failed: int) -> int:
    """The failure policy: the count of failed rounds in a row after ``server_round`` (0: it had
    ``needed`` valid uploads). A failed round leaves the state as it is and the next retries (one
    warning); the ``max_failed``-th in a row ends the run (:class:`RoundFailedError`)."""
    if valid >= needed:
        return 0
    message = f"round {server_round}: {valid} valid updates < {needed_text}"
    if failed + 1 >= max_failed:
        raise RoundFailedError(f"{message}, {failed + 1} rounds in a row (faults.max_failed_rounds); stopping the run")
    log(WARNING, "aggregate_train: %s: state unchanged, the next round retries", message)
    return failed + 1


def reject(record: RoundRecord, partition: int | None, node: int | None, reason: str,
           hook: str = "aggregate_train", failure: bool = True) -> None:
    """Count and log a refused reply, with the client's partition and node id. ``failure``: it
    was a sampled client's reply of this round (not a stray, duplicate or evaluation reply)."""
    if failure:
        record.failures += 1
    record.rejected += 1
    who = f"client {partition}" if partition is not None else "unknown client"
    phase = "" if hook == "aggregate_train" else "evaluation: "
    record.rejections.append(f"{phase}{who} (node {node}): {reason}")
    log(WARNING, "%s: rejecting the reply of %s (node %s): %s", hook, who, node, reason)


def client_train_entry(upload: ClientUpload) -> dict[str, Any]:
    """An upload's per-client entry of the round (results.json ``per_client_train``)."""
    metrics = upload.metrics
    return {"train_loss": metrics.get(protocol.TRAIN_LOSS), "train_seconds": metrics.get(protocol.TRAIN_SECONDS),
            "examples": metrics.get(protocol.TRAIN_EXAMPLES), **upload.worker,
            **{key: metrics[key] for key in sorted(protocol.STARTUP_METRICS) if key in metrics}}


def count_missing(record: RoundRecord, replied: int) -> None:
    """Count the sampled clients that did not reply before ``federation.round_timeout`` as failures."""
    missing = max(record.sampled - replied, 0)
    if missing:
        record.failures += missing
        log(WARNING, "aggregate_train: %d of %d sampled clients did not reply within federation.round_timeout",
            missing, record.sampled)


def short(text: object, limit: int = 300) -> str:
    """A client-supplied text for a log line: one line, at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def reply_wire_size(message: Message) -> int:
    """:func:`fedlora.protocol.wire_size`, 0 for a reply Flower cannot serialise (it is refused anyway)."""
    try:
        return wire_size(message)
    except Exception:  # noqa: BLE001 - a reply's size must not end the run
        return 0


def account_train(uploads: list[ClientUpload], record: RoundRecord, weights: np.ndarray, bounds: CountBounds) -> None:
    """The round's record of what arrived: clients, upload bytes, the received accuracy
    (:func:`note_received`, its counts within ``bounds``), the train loss weighted by ``weights``
    (the aggregation's), the clients' training time and examples."""
    record.clients = len(uploads)
    record.bytes_up = sum(payload_bytes(u.payload) for u in uploads)
    if uploads:
        note_received(uploads, record, bounds)
        record.train_loss = float(np.average([u.metrics.get(protocol.TRAIN_LOSS, math.nan) for u in uploads],
                                             weights=weights))
        record.client_train_seconds = float(sum(u.metrics.get(protocol.TRAIN_SECONDS, 0.0) for u in uploads))
        record.train_examples = int(sum(u.metrics.get(protocol.TRAIN_EXAMPLES, 0.0) for u in uploads))
    log(INFO, "aggregate_train: %d replies, %d failures", len(uploads), record.failures)


def note_received(uploads: list[ClientUpload], record: RoundRecord, bounds: CountBounds) -> None:
    """Received accuracy: each sampled client's model as it received it (the download overlaid on
    its kept state; FedHera's tail scaled by lambda), on its local test split, before local
    training (FedHera's official metric; evaluation rounds only). A causal LM's is teacher-forced:
    token accuracy and loss per response token, token-weighted over the clients."""
    scored = [{**u.metrics, protocol.PARTITION_ID: u.partition_id} for u in uploads
              if protocol.RECEIVED_TOKEN_ACCURACY in u.metrics]
    if scored:  # RECEIVED_TOKENS >= 1 each (protocol.TRAIN_RULES)
        tokens = bounds.weights(scored, protocol.RECEIVED_TOKENS, tokens=True)
        record.received_token_accuracy = float(np.average([r[protocol.RECEIVED_TOKEN_ACCURACY] for r in scored], weights=tokens))
        record.received_loss = float(np.average([r[protocol.RECEIVED_LOSS] for r in scored], weights=tokens))
    # an evaluation of no examples counts in neither (received-examples comes with it: protocol.TRAIN_RULES)
    rows = [{**u.metrics, protocol.PARTITION_ID: u.partition_id} for u in uploads
            if u.metrics.get(protocol.RECEIVED_EXAMPLES, 0.0) > 0 and protocol.RECEIVED_ACCURACY in u.metrics]
    if not rows:
        return
    accuracy = np.array([r[protocol.RECEIVED_ACCURACY] for r in rows])
    examples = bounds.weights(rows, protocol.RECEIVED_EXAMPLES)
    record.received_accuracy = float(np.average(accuracy, weights=examples))
    record.received_accuracy_unweighted = float(accuracy.mean())

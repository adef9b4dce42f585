"""Reading a round's replies: who sent each, and what of it is valid (the parse and validate steps
of ``replies.py``, applied to every reply of a round, with the refusals counted in its record).

A reply is attributed by the roster's map of its sender's node id, never by what it claims, and
only when its sender was sent a message of that phase this round and has not replied yet. Nothing
here raises on what a client sent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from logging import WARNING, getLogger

from flwr.app import Message

from fedlora import protocol
from fedlora.protocol import Phase
from fedlora.results import RoundRecord
from fedlora.schema import ModelKind
from fedlora.strategies.accounting import client_train_entry, count_missing, reject, short
from fedlora.strategies.download import Download
from fedlora.strategies.ledger import PrivacyLedger
from fedlora.strategies.replies import (
    ClientUpload,
    Expectation,
    Rejection,
    parse_evaluate_reply,
    parse_train_reply,
)
from fedlora.strategies.roster import ClientRoster

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show

def sender(roster: ClientRoster, awaiting: Mapping[Phase, Collection[int]], msg: Message, phase: Phase,
           seen: set[int]) -> int | Rejection:
    """The partition of the reply's sender (the roster's map, never what the reply claims), if it
    was sent a message of ``phase`` this round (``awaiting``; no entry: any accepted client) and
    has not replied yet (then added to ``seen``)."""
    try:
        partition = roster.partition_of(msg.metadata.src_node_id)
    except KeyError:
        return Rejection(f"node {msg.metadata.src_node_id} is not an accepted client")
    if partition in seen:
        return Rejection(f"a second reply from client {partition} this round")
    if partition not in awaiting.get(phase, {partition}):
        return Rejection(f"client {partition} was sent no {phase} message this round")
    seen.add(partition)
    return partition


def known(roster: ClientRoster, node: int) -> int | None:
    """The partition of ``node``, None for a node the roster does not know."""
    try:
        return roster.partition_of(node)
    except KeyError:
        return None


def read_train_reply(msg: Message, roster: ClientRoster, sent: Mapping[Phase, Mapping[int, Download]], seen: set[int],
                     expectation: Callable[[int], Expectation],
                     record: RoundRecord) -> tuple[int, ClientUpload | Rejection] | None:
    """Parse and validate one training reply: the sender's partition and its upload or the
    :class:`Rejection` of the reply's first problem (:func:`fedlora.strategies.replies.parse_train_reply`,
    against ``expectation(partition)`` and the download it was sent, ``sent['train'][partition]``).
    None for a reply there is nothing to read in: an error reply (a sampled client's is a
    failure of the round, a stray one is only logged) or one from a sender that was not
    waited for (:func:`sender`: counted as rejected, not as a failure)."""
    node = msg.metadata.src_node_id
    partition = sender(roster, sent, msg, "train", seen)
    if msg.has_error():
        log(WARNING, "aggregate_train: node %d failed: %s", node, short(msg.error.reason))
        record.failures += not isinstance(partition, Rejection)
        return None
    if isinstance(partition, Rejection):
        reject(record, known(roster, node), node, partition.reason, failure=False)
        return None
    return partition, parse_train_reply(msg, expectation(partition), sent["train"][partition])


def read_train_replies(replies: list[Message], roster: ClientRoster, sent: Mapping[Phase, Mapping[int, Download]],
                       expectation: Callable[[int], Expectation],
                       ledger: PrivacyLedger, record: RoundRecord) -> list[ClientUpload]:
    """Parse and validate every training reply (:func:`read_train_reply`); count the rejections and
    the sampled clients that did not reply; note in the privacy ledger the DP epsilon each client
    reported (spent even when its update is refused). Returns the valid uploads by partition (the
    result does not depend on the replies' arrival order)."""
    uploads: list[ClientUpload] = []
    seen: set[int] = set()  # sampled partitions that replied (an error reply too)
    spent: dict[int, float] = {}
    for msg in replies:
        read = read_train_reply(msg, roster, sent, seen, expectation, record)
        if read is None:
            continue
        partition, parsed = read
        if parsed.metrics is not None and protocol.DP_EPSILON in parsed.metrics:
            spent[partition] = parsed.metrics[protocol.DP_EPSILON]
        if isinstance(parsed, Rejection):
            reject(record, partition, msg.metadata.src_node_id, parsed.reason)
            continue
        uploads.append(parsed)
        record.per_client_train[str(partition)] = client_train_entry(parsed)
    count_missing(record, replied=len(seen))
    ledger.note(spent, record)
    return sorted(uploads, key=lambda u: u.partition_id)


def read_evaluate_replies(replies: list[Message], roster: ClientRoster, awaiting: Mapping[Phase, Collection[int]],
                          kind: ModelKind, record: RoundRecord) -> list[dict[str, float]]:
    """Parse and validate every evaluation reply (:func:`fedlora.strategies.replies.parse_evaluate_reply`,
    from a client sent an evaluation message this round, once: :func:`sender`); a failed or
    refused evaluation is no failure of the round. Returns the valid metrics by partition (each
    also the round's per-client entry)."""
    rows: list[dict[str, float]] = []
    seen: set[int] = set()
    for msg in replies:
        node = msg.metadata.src_node_id
        partition = sender(roster, awaiting, msg, "evaluate", seen)
        if msg.has_error():  # the client's evaluation failed: nothing to count (or a stray error)
            log(WARNING, "aggregate_evaluate: node %d failed: %s", node, short(msg.error.reason))
            continue
        if isinstance(partition, Rejection):
            reject(record, known(roster, node), node, partition.reason, "aggregate_evaluate", failure=False)
            continue
        parsed = parse_evaluate_reply(msg, partition, kind)
        if isinstance(parsed, Rejection):
            reject(record, partition, node, parsed.reason, "aggregate_evaluate", failure=False)
            continue
        rows.append(parsed)
        record.per_client[str(partition)] = dict(parsed)
    return sorted(rows, key=lambda r: r[protocol.PARTITION_ID])  # independent of the arrival order

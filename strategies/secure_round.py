"""Secure aggregation in a :class:`~fedlora.strategies.base.LoRAStrategy` round
(``secure_aggregation.enabled``, docs/secure-aggregation.md). The strategy is typed ``Any`` here:
``base.py`` imports this module, and no import cycle is allowed, ``TYPE_CHECKING`` ones included.

``configure_train`` calls :func:`start_secure_round` once the round's downloads and messages are
built: the server chooses every sampled client's aggregation weight (the strategy's own weighing
of the example counts the clients declared when they joined), the round's parameters
(:func:`fedlora.secagg.choose_params`), runs the setup and share-keys stages
(:class:`~fedlora.strategies.secure.SecureRound`) and returns the training messages of the clients
still in the protocol, each with Flower's record of the masking stage and fedlora's ``secagg-*``
entries. ``aggregate_train`` calls :func:`aggregate_secure_round`: every reply is read as usual
(sender, metrics, example count; its arrays are empty), the masked vectors of the valid ones are
summed, the unmask stage removes the masks, and the weighted mean of the updates plus the weighted
mean of the survivors' downloads is handed to the method's :meth:`aggregate` as one upload of
weight 1: for a method whose aggregate is the weighted mean of its uploads (zero-padded to the
largest rank), that is the aggregate of the round.

What the server does not check in a secure round, since it never sees an upload: the norm outlier
rule, the anomaly rule and the update-ratio bound (the clients enforce the clipping range
instead); NaN and shape checks run on the client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from logging import INFO, getLogger
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.serverapp import Grid

from fedlora import protocol
from fedlora.errors import ConfigError
from fedlora.lora import ADAPTER_DTYPE, to_array_record
from fedlora.protocol import Phase
from fedlora.secagg import canonical_shapes, choose_params, error_bound, factor_rank, flatten, unflatten
from fedlora.strategies.accounting import reject, reply_wire_size
from fedlora.strategies.download import Download
from fedlora.strategies.reading import read_train_replies
from fedlora.strategies.replies import ClientUpload
from fedlora.strategies.secure import SecureRound

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


def secure_problem(strategy: Any) -> str:
    """Why ``strategy`` cannot aggregate this run securely ('' if it can): the method's
    ``capabilities.not_secure``, a robust ``faults.aggregation``, or mixed ranks where the method's
    mean is not over zero-padded uploads (``capabilities.secure_one_rank``)."""
    caps = strategy.capabilities
    if not caps.secure_aggregation:
        return caps.not_secure or "its capabilities do not declare secure_aggregation"
    if strategy.aggregation_rule != "mean":
        return f"faults.aggregation = '{strategy.aggregation_rule}' needs the uploads, which the server never sees"
    ranks = sorted({strategy.rank_of(p) for p in strategy.roster.partitions})
    if len(ranks) > 1 and caps.secure_one_rank:
        return f"clients train ranks {ranks}: {caps.secure_one_rank}"
    return ""


def start_secure_round(strategy: Any, grid: Grid, server_round: int,
                       messages: list[Message]) -> tuple[SecureRound, list[Message]]:
    """The setup and share-keys stages of ``server_round``, then the training messages of the
    clients still in the protocol, carrying the masking stage (module docstring). No message
    when a stage halts the round (too few clients left: the round fails, counted as such)."""
    problem = secure_problem(strategy)
    if problem:
        raise ConfigError(f"strategy '{strategy.name}' cannot run with secure_aggregation.enabled = true: {problem}")
    sent, node_of = strategy.sent_this_round("train"), strategy.roster.node_of
    partitions = sorted(sent)
    pad_rank = max((factor_rank(k, s) for p in partitions for k, s in sent[p].upload.items()), default=0)
    shapes = canonical_shapes(sent[partitions[0]].upload, pad_rank)
    for p in partitions:
        download = sent[p]
        if canonical_shapes(download.upload, pad_rank) != shapes or {
                k: tuple(np.shape(v)) for k, v in download.payload.items()} != {k: tuple(s) for k, s in download.upload.items()}:
            raise ConfigError(f"strategy '{strategy.name}' cannot run with secure_aggregation.enabled = true: client "
                              f"{p}'s reply would not upload the arrays it downloads (a client masks upload - download)")
    placeholders = [ClientUpload(p, {}, strategy.roster.declared_examples(p), {}) for p in partitions]
    strategy._weigh(placeholders)  # the strategy's own weighing (faults.max_client_share), before any reply
    weights = [float(w) for w in strategy.weights(placeholders)]
    secure = strategy.experiment.secure_aggregation
    params = choose_params(weights, secure.num_shares, secure.reconstruction_threshold, secure.clip_norm,
                           secure.clipping_range, secure.quantization_range, secure.modulus_range)
    size = sum(int(np.prod(s)) for s in shapes.values())
    round_ = SecureRound(params, grid, server_round, {node_of[p]: w for p, w in zip(partitions, weights)}, size,
                         strategy.experiment.federation.round_timeout)
    round_.report.update(clipping_range=params.clipping_range, quantization_range=params.quantization_range,
                         modulus_range=params.modulus_range, max_weight=params.max_weight, pad_rank=pad_rank)
    if not (round_.setup() and round_.share_keys()):
        return round_, []
    entries = {protocol.SECAGG_CLIP: float(secure.clip_norm), protocol.SECAGG_RANGE: float(params.clipping_range),
               protocol.SECAGG_PAD_RANK: pad_rank}
    weight_of = {node_of[p]: w for p, w in zip(partitions, weights)}
    masking = []
    for message in messages:
        node = message.metadata.dst_node_id
        record = round_.masking_record(node)
        if record is None:
            continue
        message.content.config_records[RECORD_KEY_CONFIGS] = record
        config = message.content.config_records[protocol.CONFIG_RECORD]
        config.update({**entries, protocol.SECAGG_WEIGHT: weight_of[node]})
        masking.append(message)
    log(INFO, "secure aggregation, round %d: %d of %d clients masking (threshold %d, T = %d, c = %g)",
        server_round, len(masking), len(partitions), params.threshold, params.quantization_range, params.clipping_range)
    return round_, masking


def aggregate_secure_round(strategy: Any, round_: SecureRound, server_round: int,
                           replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """``aggregate_train`` of a secure round: read every reply (its arrays are empty), sum the
    masked vectors of the valid ones, unmask, and hand the method the weighted mean (module
    docstring). (None, None) when the round failed (too few valid replies, a halted stage)."""
    record = strategy.record(server_round)
    replies = list(replies)
    record.wire_bytes_up += sum(reply_wire_size(reply) for reply in replies)
    sent = strategy.sent_this_round("train")
    masked: dict[Phase, dict[int, Download]] = {
        "train": {p: dataclasses.replace(d, upload={}, alternatives={}) for p, d in sent.items()}}
    uploads = read_train_replies(replies, strategy.roster, masked, strategy._expectation, strategy.ledger, record)
    node_of = strategy.roster.node_of
    by_node = {reply.metadata.src_node_id: reply for reply in replies}
    left_out = round_.collect({node_of[u.partition_id]: by_node[node_of[u.partition_id]] for u in uploads})
    for upload in uploads:
        node = node_of[upload.partition_id]
        if node in left_out:
            reject(record, upload.partition_id, node, f"secure aggregation: {left_out[node]}")
    uploads = [u for u in uploads if node_of[u.partition_id] in round_.summed]
    unmasked = round_.unmask()
    if unmasked is None:
        record.failures += len(uploads)
        uploads = []
    strategy._weigh(uploads)
    strategy._account_train(uploads, record)
    record.bytes_up = len(uploads) * (round_.size + 1) * 8  # the masked int64 vectors
    record.extra["secure_aggregation"] = round_.report
    record.wire_bytes_down += sum(b["down"] for b in round_.report["wire_bytes"].values())  # stages 0, 1, 3
    record.wire_bytes_up += sum(b["up"] for b in round_.report["wire_bytes"].values())
    if strategy._too_few_uploads(uploads, server_round) or unmasked is None:
        return None, None
    update, total_weight = unmasked
    shapes = canonical_shapes(sent[uploads[0].partition_id].upload, round_.report["pad_rank"])
    weights = np.array([round_.weights[node_of[u.partition_id]] for u in uploads])
    downloads = np.stack([flatten(sent[u.partition_id].payload, shapes) for u in uploads])  # (|S|, size)
    mean = unflatten(update + weights @ downloads / weights.sum(), shapes)
    payload = {key: value.astype(ADAPTER_DTYPE) for key, value in mean.items()}
    bound = error_bound(round_.params.clipping_range, len(uploads), round_.params.quantization_range, total_weight)
    largest = max((float(np.max(np.abs(v))) for v in payload.values() if v.size), default=0.0)
    round_.report.update(masked=len(uploads), total_weight=total_weight, error_bound=bound,
                         error_bound_relative=bound / largest if largest else float("nan"))
    mean_upload = ClientUpload(-1, payload, int(sum(u.num_examples for u in uploads)), {}, weight=1.0)
    strategy._aggregate_round(server_round, [mean_upload], record)
    metrics = MetricRecord({protocol.TRAIN_LOSS: record.train_loss, protocol.CLIENTS: len(uploads)})
    return to_array_record(strategy.global_arrays()), metrics

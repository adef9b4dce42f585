"""The round's checks after each reply is read, before the method aggregates: norm outliers among
the round's uploads, the anomaly rule for poisoning within the bounds, the aggregation weights,
and a Byzantine-robust selection where one is configured.

Plain functions over the round's valid uploads (``reading.py``), the screen, weigh and select
steps of the reply pipeline (``pipeline.py``); each refusal is counted in the round's record
(``accounting.py``). What they measure lives in ``validation.py`` (norms),
``anomaly.py`` (the anomaly rule) and ``robust.py`` (Krum's score).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING, getLogger

from fedlora.results import RoundRecord
from fedlora.schema import AggregationRule, FaultsConfig
from fedlora.shares import client_weights
from fedlora.strategies.accounting import reject
from fedlora.strategies.anomaly import Fingerprint, check_updates
from fedlora.strategies.replies import ClientUpload
from fedlora.strategies.robust import SELECTING, select_uploads
from fedlora.strategies.validation import norm_outliers

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


def drop_outliers(uploads: list[ClientUpload], faults: FaultsConfig, node_of: Mapping[int, int],
                  record: RoundRecord) -> list[ClientUpload]:
    """Reject the uploads whose norm is an outlier among this round's
    (:func:`fedlora.strategies.validation.norm_outliers`, ``faults``); the others, in order."""
    outliers = norm_outliers([u.payload for u in uploads], faults)
    for index, reason in outliers.items():
        partition = uploads[index].partition_id
        reject(record, partition, node_of.get(partition), reason)
    return [u for i, u in enumerate(uploads) if i not in outliers]


def watch_updates(server_round: int, uploads: list[ClientUpload], history: list[Fingerprint],
                  faults: FaultsConfig, node_of: Mapping[int, int],
                  record: RoundRecord) -> tuple[list[ClientUpload], list[Fingerprint]]:
    """Measure every valid update against what its client downloaded this round (its ``download``),
    the round's median update and the recent uploads (``history``;
    :func:`fedlora.strategies.anomaly.check_updates`): the measures go into the client's
    ``per_client_train`` entry; a flagged update is counted in the round's ``anomalies`` and
    logged in one line (``faults.anomaly_action = 'log'``, still aggregated) or refused
    (``'reject'``). Returns the uploads to aggregate, in order, and the new history."""
    sent = [u.download.payload if u.download is not None else {} for u in uploads]
    checks, history = check_updates([(u.partition_id, u.payload, down) for u, down in zip(uploads, sent)],
                                    history, server_round, faults)
    kept = []
    for upload, check in zip(uploads, checks):
        partition = upload.partition_id
        record.per_client_train.setdefault(str(partition), {}).update(check.entry())
        if not check.reasons:
            kept.append(upload)
            continue
        node, reason = node_of.get(partition), "; ".join(check.reasons)
        record.anomalies.append(f"client {partition} (node {node}): {reason}")
        if faults.anomaly_action == "reject":
            reject(record, partition, node, f"anomalous update: {reason}")
            continue
        log(WARNING, "aggregate_train: anomalous update of client %d (node %s), aggregated "
            "(faults.anomaly_action = 'log'): %s", partition, node, reason)
        kept.append(upload)
    return kept, history


def weigh(uploads: list[ClientUpload], entitled: Mapping[int, float], max_share: float) -> None:
    """Each upload's aggregation weight by the weight-share rule (:func:`fedlora.shares.client_weights`):
    its example count, cut to its client's entitlement (``entitled``, fixed when the clients joined)
    and so that no client weighs more than the round's share bound (``faults.max_client_share``, or
    the largest entitlement's share of the round). A cut is one warning line: honest counts are
    never cut."""
    counts = [u.num_examples for u in uploads]
    weights = client_weights(counts, [entitled[u.partition_id] for u in uploads], max_share)
    for upload, weight in zip(uploads, weights):
        if weight != upload.num_examples:
            log(WARNING, "aggregate_train: client %d weighs %.4g instead of its %d examples (the weight-share "
                "rule: faults.max_size_ratio, faults.max_client_share)", upload.partition_id, weight,
                upload.num_examples)
        upload.weight = float(weight)


def select_byzantine(uploads: list[ClientUpload], rule: AggregationRule, faults: FaultsConfig,
                     record: RoundRecord) -> list[ClientUpload]:
    """The uploads a Byzantine-robust selection keeps (``faults.aggregation = 'krum' |
    'multikrum' | 'bulyan'``, :func:`fedlora.strategies.robust.select_uploads`, Flower's Krum
    score), in order; every upload's ``per_client_train`` entry says ``byzantine_kept``. All of
    them under any other rule. The caller weighs the kept ones again among themselves
    (:meth:`fedlora.strategies.pipeline.ReplyPipeline.select`)."""
    if rule not in SELECTING:
        return uploads
    kept = set(select_uploads([u.payload for u in uploads], rule, faults.num_malicious, faults.multikrum_select))
    for index, upload in enumerate(uploads):
        record.per_client_train.setdefault(str(upload.partition_id), {})["byzantine_kept"] = index in kept
    left = [u.partition_id for i, u in enumerate(uploads) if i not in kept]
    log(INFO, "aggregate_train: %s (f = %d) kept %d of %d uploads; not aggregated: clients %s",
        rule, faults.num_malicious, len(kept), len(uploads), left)
    return [u for i, u in enumerate(uploads) if i in kept]

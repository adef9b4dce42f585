"""A round's training replies, taken from the wire to what the method aggregates, in one object.

:class:`ReplyPipeline` runs the steps in this order (:meth:`ReplyPipeline.run`), each a method of
its own, each a call into the room that does it:

1. **parse** and 2. **validate** every reply (:meth:`~ReplyPipeline.read`:
   :func:`fedlora.strategies.reading.read_train_replies`, the checks of ``replies.py``): its sender,
   records, metrics and arrays against the download its sender was sent; failures and rejections
   counted in the round's record, the DP epsilon each client reported noted in the privacy ledger;
3. **screen** the valid uploads over the round (:meth:`~ReplyPipeline.screen`, ``screening.py``):
   the norm outliers, then the anomaly rule (logged, or refused with ``faults.anomaly_action =
   'reject'``);
4. **weigh** what is left (:meth:`~ReplyPipeline.weigh`): each upload's weight by the weight-share
   rule, then the method's weights of them (its :meth:`weights`);
5. **account** what arrived (:meth:`~ReplyPipeline.account`, ``accounting.py``): clients, bytes,
   the train loss weighted as the aggregation weighs, the received accuracy; then the failure
   policy (the strategy's :meth:`enough_uploads`): a round with too few valid uploads stops here;
6. **select** what the method aggregates (:meth:`~ReplyPipeline.select`): all of them, or the ones
   a Byzantine-robust rule keeps (Krum / MultiKrum / Bulyan), weighed again among themselves.

The record accounts for every valid upload before a Byzantine selection chooses among them: it
says what arrived, and each client's entry says whether the selection kept it.

The result, a :class:`RoundReplies`, is what the strategy's aggregation step receives
(``LoRAStrategy.aggregate_round``: the method's ``aggregate`` of :attr:`RoundReplies.selected`,
timed). The secure path (``secure_round.py``) runs the steps a server can run on masked replies
(read, weigh, account) through the same object. What the pipeline changes on the strategy goes
through its public calls: the privacy ledger (``ledger.note``), the anomaly rule's history
(``remember_updates``), the failure count (``enough_uploads``). Nothing here raises on what a
client sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from flwr.app import Message

from fedlora.results import RoundRecord
from fedlora.schema import AggregationRule, ExperimentConfig
from fedlora.strategies.accounting import account_train, reply_wire_size
from fedlora.strategies.anomaly import Fingerprint
from fedlora.strategies.download import Download
from fedlora.strategies.evaluation import CountBounds
from fedlora.strategies.ledger import PrivacyLedger
from fedlora.strategies.reading import read_train_replies
from fedlora.strategies.replies import ClientUpload, Expectation
from fedlora.strategies.robust import SELECTING
from fedlora.strategies.roster import ClientRoster
from fedlora.strategies.screening import drop_outliers, select_byzantine, watch_updates, weigh


class RoundStrategy(Protocol):
    """What the pipeline reads from a strategy and the calls by which it changes it
    (:class:`~fedlora.strategies.base.LoRAStrategy` has them all)."""

    experiment: ExperimentConfig
    roster: ClientRoster
    ledger: PrivacyLedger
    update_history: list[Fingerprint]

    @property
    def aggregation_rule(self) -> AggregationRule: ...

    def record(self, server_round: int) -> RoundRecord: ...

    def train_downloads(self, server_round: int) -> Mapping[int, Download]: ...

    def update_reference(self) -> float: ...

    def entitled(self) -> dict[int, float]: ...

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray: ...

    def count_bounds(self) -> CountBounds: ...

    def remember_updates(self, history: list[Fingerprint]) -> None: ...

    def enough_uploads(self, server_round: int, valid: int) -> bool: ...


@dataclass
class RoundReplies:
    """What a round's training replies gave: what the method's aggregation receives."""

    server_round: int
    record: RoundRecord  # the round's record, with every step's entries
    uploads: list[ClientUpload]  # the valid uploads, weighed (what the record accounts for)
    weights: np.ndarray  # the method's weights of ``uploads`` (they sum to 1; empty without uploads)
    enough: bool  # False: too few valid uploads (the failure policy): nothing is aggregated
    selected: list[ClientUpload]  # what the method aggregates: ``uploads``, or a Byzantine selection of them
    clients: int  # how many clients' updates the aggregate holds (a secure round's mean stands for all)


class ReplyPipeline:
    """The training replies of ``server_round`` through parse, validate, screen, weigh, account and
    select (the module docstring), for ``strategy``."""

    def __init__(self, strategy: RoundStrategy, server_round: int) -> None:
        self.strategy = strategy
        self.server_round = server_round
        self.record = strategy.record(server_round)
        self.faults = strategy.experiment.faults

    def run(self, replies: Iterable[Message]) -> RoundReplies:
        """Every step in order; the round's :class:`RoundReplies`."""
        uploads = self.read(replies, self.strategy.train_downloads(self.server_round))  # 1. parse, 2. validate
        uploads = self.screen(uploads)  # 3. screen
        weights = self.weigh(uploads)  # 4. weigh
        self.account(uploads, weights)  # 5. account,
        enough = self.enough(uploads)  # and the failure policy
        selected = self.select(uploads) if enough else []  # 6. select
        return RoundReplies(self.server_round, self.record, uploads, weights, enough, selected, len(selected))

    def read(self, replies: Iterable[Message], downloads: Mapping[int, Download]) -> list[ClientUpload]:
        """Parse and validate every reply against the download its sender was sent (``downloads``,
        by partition; :func:`~fedlora.strategies.reading.read_train_replies`); the valid uploads by
        partition. Counts the replies' bytes on the wire."""
        replies = list(replies)
        self.record.wire_bytes_up += sum(reply_wire_size(reply) for reply in replies)
        strategy = self.strategy
        faults = self.faults

        def expectation(partition: int) -> Expectation:
            return Expectation(partition, strategy.roster.declared_examples(partition), faults.max_examples,
                               strategy.update_reference(), faults.max_update_ratio)

        return read_train_replies(replies, strategy.roster, {"train": downloads}, expectation, strategy.ledger,
                                  self.record)

    def screen(self, uploads: list[ClientUpload]) -> list[ClientUpload]:
        """Drop the norm outliers among the round's uploads, then measure every update by the anomaly
        rule (``screening.py``); the strategy remembers the rule's new history."""
        node_of = self.strategy.roster.node_of
        uploads = drop_outliers(uploads, self.faults, node_of, self.record)
        uploads, history = watch_updates(self.server_round, uploads, self.strategy.update_history, self.faults,
                                         node_of, self.record)
        self.strategy.remember_updates(history)
        return uploads

    def weigh(self, uploads: list[ClientUpload]) -> np.ndarray:
        """Set each upload's weight by the weight-share rule (:func:`fedlora.strategies.screening.weigh`);
        the method's weights of them (empty without uploads)."""
        weigh(uploads, self.strategy.entitled(), self.faults.max_client_share)
        return self.strategy.weights(uploads) if uploads else np.ones(0)

    def account(self, uploads: list[ClientUpload], weights: np.ndarray) -> None:
        """The round's record of what arrived (:func:`fedlora.strategies.accounting.account_train`),
        the train loss weighted by ``weights``."""
        account_train(uploads, self.record, weights, self.strategy.count_bounds())

    def enough(self, uploads: list[ClientUpload]) -> bool:
        """The failure policy (the strategy's ``enough_uploads``): whether the round has enough
        valid uploads to aggregate; too many failed rounds in a row end the run."""
        return self.strategy.enough_uploads(self.server_round, len(uploads))

    def select(self, uploads: list[ClientUpload]) -> list[ClientUpload]:
        """What the method aggregates: ``uploads``, or under a Byzantine-robust ``faults.aggregation``
        the ones it keeps (:func:`fedlora.strategies.screening.select_byzantine`), copies weighed
        again among themselves (``uploads`` keep the weights the record accounted)."""
        rule = self.strategy.aggregation_rule
        if rule not in SELECTING:
            return uploads
        kept = [dataclasses.replace(u) for u in select_byzantine(uploads, rule, self.faults, self.record)]
        weigh(kept, self.strategy.entitled(), self.faults.max_client_share)
        return kept

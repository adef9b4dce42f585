"""The named steps :class:`~fedlora.strategies.base.LoRAStrategy`'s Flower hooks and the reply
pipeline (``pipeline.py``) call on a strategy: the round's record and clock, the Flower-DP check,
the round's downloads, and every change a round makes to the strategy's state (the anomaly rule's
history, the failure count, the clients a secure round leaves out, the masked vectors it summed,
the server optimiser's step). A base of ``LoRAStrategy``; each is one public call, so what a round
changes is found by name.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar

from flwr.app import ConfigRecord
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedlora.errors import ConfigError
from fedlora.lora import Payload
from fedlora.protocol import Phase
from fedlora.results import RoundRecord
from fedlora.strategies.accounting import failed_rounds
from fedlora.strategies.anomaly import Fingerprint
from fedlora.strategies.download import Download
from fedlora.strategies.ledger import PrivacyLedger
from fedlora.strategies.method_api import MethodAPI
from fedlora.strategies.sampling import evaluation_round
from fedlora.strategies.server_optimizer import Moments, server_step
from fedlora.strategies.validation import update_norm


class RoundSteps(MethodAPI):
    """The steps of a round, by name (module docstring)."""

    name: ClassVar[str]
    records: dict[int, RoundRecord]
    started: dict[int, float]
    cpu_started: dict[int, float]
    ledger: PrivacyLedger
    failed_rounds: int
    norm_reference: float
    update_history: list[Fingerprint]
    masked_digests: list[str]
    server_moments: Moments
    _sent: dict[Phase, dict[int, Download]]
    _initial_norm: float

    def record(self, server_round: int) -> RoundRecord:
        """The round's record (created, and its clock started, on first use)."""
        if server_round not in self.records:
            self.records[server_round] = RoundRecord(round=server_round)
            self.started[server_round] = time.perf_counter()
            self.cpu_started[server_round] = time.process_time()
        return self.records[server_round]

    def finish_round(self, server_round: int) -> RoundRecord:
        """The round's record, with its wall and CPU time; called by the ServerApp after evaluation."""
        record = self.record(server_round)
        record.seconds = time.perf_counter() - self.started[server_round]
        record.cpu_seconds = time.process_time() - self.cpu_started[server_round]
        return record

    def privacy_report(self) -> dict[str, Any] | None:
        return self.ledger.report(self.experiment.privacy)

    def check_flower_dp(self, config: ConfigRecord) -> None:
        """Refuse to run under Flower's client-side fixed-clipping DP wrapper, which writes its
        clipping norm into the train ``config``, when :meth:`flower_dp_problem` says why (ConfigError)."""
        problem = self.flower_dp_problem() if KEY_CLIPPING_NORM in config else ""
        if problem:
            raise ConfigError(f"strategy '{self.name}' cannot run under Flower's "
                              f"DifferentialPrivacyClientSideFixedClipping: {problem}")

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round`` is an evaluation round (:func:`~fedlora.strategies.sampling.evaluation_round`)."""
        return evaluation_round(self.experiment, server_round)

    def sent_this_round(self, phase: Phase) -> Mapping[int, Download]:
        """Partition -> the download of ``phase`` sent this round (e.g. FedHera's report of the round)."""
        return self._sent.get(phase, {})

    def train_downloads(self, server_round: int) -> Mapping[int, Download]:
        """The downloads this round's training replies answer: the ones ``configure_train`` sent; for
        replies to no ``configure_train`` of this strategy, every accepted client's of the round."""
        if not self._sent.get("train"):
            self._sent["train"] = {p: self.download(p, server_round, "train") for p in self.roster.partitions}
        return self._sent["train"]

    def update_reference(self) -> float:
        """The norm ``faults.max_update_ratio`` bounds an update by: the lower median of the norms
        aggregated last round, before the first aggregation the initial adapter's."""
        if not self.norm_reference and not self._initial_norm:
            self._initial_norm = update_norm(self.initial_adapter(self.experiment.model.lora_rank))
        return self.norm_reference or self._initial_norm

    def remember_updates(self, history: list[Fingerprint]) -> None:
        """Keep the anomaly rule's sketches of the recent uploads (the reply pipeline's screen step)."""
        self.update_history = history

    def enough_uploads(self, server_round: int, valid: int) -> bool:
        """The failure policy: fewer valid uploads than :meth:`min_uploads` leave the state as it
        is (the next round retries); ``faults.max_failed_rounds`` such rounds in a row end the run
        (:class:`~fedlora.strategies.accounting.RoundFailedError`)."""
        needed = (f"federation.min_clients={self.min_train_nodes}" if self.min_uploads() == self.min_train_nodes else
                  f"{self.min_uploads()}, what faults.aggregation = '{self.aggregation_rule}' needs for "
                  f"faults.num_malicious = {self.experiment.faults.num_malicious}")
        self.failed_rounds = failed_rounds(server_round, valid, self.min_uploads(), needed, self.failed_rounds,
                                           self.experiment.faults.max_failed_rounds)
        return self.failed_rounds == 0

    def exclude(self, partition: int, why: str) -> None:
        """Leave client ``partition`` out of the rest of the run (a secure round named it): never sampled again."""
        self.excluded[partition] = why

    def remember_masked(self, digests: list[str]) -> None:
        """Add a secure round's masked vectors (their SHA-256) to those summed so far: a replay is named."""
        self.masked_digests = [*self.masked_digests, *digests]

    def server_optimizer_step(self, server_round: int, before: Payload) -> None:
        """``[server_optimizer]``: the method's aggregate (its new :meth:`global_arrays`) is the mean
        y; the optimiser steps from ``before`` (x) along y - x (:func:`~fedlora.strategies.server_optimizer.server_step`)
        and the strategy continues from the result (:meth:`load_arrays`). Only methods whose
        capabilities declare ``server_optimizer`` get here (the config check refuses the others)."""
        new, self.server_moments = server_step(self.experiment.server_optimizer, server_round, before,
                                               self.global_arrays(), self.server_moments)
        self.load_arrays(new)

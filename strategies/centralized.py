"""Centralised reference: one trainer holding every client's training data (``fedlora/methods/centralized.py``)."""

from __future__ import annotations

from fedlora import protocol
from fedlora.lora import Payload
from fedlora.methods.base import NoOptions
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download


class Centralized(LoRAStrategy[NoOptions]):
    """Centralised training on the pooled training data of all clients (a reference run).

    Paper: none (the standard centralised upper reference of federated learning papers).

    Parameters
    ----------
    (none beyond the experiment config)

    Upload: the node of partition 0 trains on the union of every client's training split (the
    data never leaves a process in simulation; this reference is not meant for deployment) and
    returns A, B and the head. Per round it takes as many optimiser steps as the federation would
    take in total: ``train.max_steps`` x the number of clients sampled per round (or, without a
    step cap, ``train.local_epochs`` x fraction_train of the pooled data).

    Aggregation: the single update becomes the model.

    Download: the model, to the trainer and, for evaluation, to every client, which tests it on
    its own local split, so personalised accuracy is measured on exactly the same examples as
    for the federated methods. The bytes reported are those of this one trainer.

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns the model (A, B and head);
    ``configure_*`` continue from the arrays given (the same keys and shapes) as the model.
    """

    STATE = (*LoRAStrategy.STATE, "model_adapter", "model_rank")  # checkpointed

    def setup(self) -> None:
        self.model_rank = min(p.rank for p in self.roster.profiles.values())
        self.model_adapter: Payload = self.initial_adapter(self.model_rank)

    def rank_of(self, partition: int) -> int:
        return self.model_rank

    def min_uploads(self) -> int:
        """One trainer: its update is the round's (federation.min_clients counts federated clients)."""
        return 1

    def sample_train(self, server_round: int) -> list[int]:
        return [self.roster.partitions[0]]

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        clients = len(self.roster.partitions)
        config = {protocol.CENTRALIZED_CLIENTS: min(clients, max(self.min_train_nodes, round(self.fraction_train * clients)))}
        return self.lora_download(partition, for_round, phase, self.model_adapter, config=config)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        self.model_adapter = uploads[0].payload

    def load_arrays(self, payload: Payload) -> None:
        self.model_adapter = dict(payload)

    def global_payload(self) -> Payload:
        return self.model_adapter

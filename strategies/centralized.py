"""Centralised reference: one trainer holding every client's training data.

Not a federated method: the upper reference a comparison table puts next to the federated rows
(issue "fair evaluation protocol"), with the same model, the same LoRA rank and the same total
number of local optimiser steps per round as the federation it is compared with.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fedlora.lora import Payload
from strategies.base import Capabilities, ClientUpload, LoRAStrategy


class Centralized(LoRAStrategy):
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
    """

    name = "centralized"
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=False,
        uploads="A, B, head (one trainer)",
        downloads="A, B, head",
        mixed_ranks=False,
        partial_participation=False,
        dp_compatible=False,  # one trainer on pooled data, its own fit: no per-client DP-SGD
        paper="reference: centralised training on the pooled client data",
    )

    def setup(self) -> None:
        self.model_rank = min(p.rank for p in self.profiles.values())
        for profile in self.profiles.values():
            profile.rank = self.model_rank
        self.model_adapter: Payload = self.initial_adapter(self.model_rank)

    def min_uploads(self) -> int:
        """One trainer: its update is the round's (federation.min_clients counts federated clients)."""
        return 1

    def sample_train(self, server_round: int) -> list[int]:
        return [min(self.profiles, key=self.partition_of)]

    def client_config(self, node_id: int, server_round: int) -> dict[str, Any]:
        fed = self.experiment.federation
        sampled = min(len(self.profiles), max(fed.min_clients, round(fed.fraction_train * len(self.profiles))))
        return {"centralized-rank": self.model_rank, "centralized-clients": sampled}

    def download(self, node_id: int, server_round: int) -> Payload:
        return self.model_adapter

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        self.model_adapter = uploads[0].payload

    def global_payload(self) -> Payload:
        return self.model_adapter

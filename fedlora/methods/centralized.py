"""Centralised reference: one trainer holding every client's training data (not a federated method).

The upper reference a comparison puts next to the federated rows, with the same model, the same
LoRA rank and the same total number of optimiser steps per round as the federation it is compared
with. Wire key (``protocol.CENTRALIZED_CLIENTS``): the trainer is told how many clients a federated
round samples (its step budget).
"""

from __future__ import annotations

from fedlora.compatibility import Capabilities
from fedlora.methods.base import Method, NoOptions

METHOD = Method(
    name="centralized",
    options=NoOptions,
    capabilities=Capabilities(
        personalized=False,
        uploads="A, B, head (one trainer)",
        downloads="A, B, head",
        mixed_ranks=False,
        partial_participation=False,
        dp_compatible=False,  # one trainer on pooled data, its own fit: no per-client DP-SGD
        paper="reference: centralised training on the pooled client data",
        not_robust="one trainer: there is no second upload to combine",
        not_flower_dp="one trainer on the pooled data of every client: there are no per-client updates to clip",
        not_secure="one trainer on the pooled data of every client: there is no sum of client updates",
        not_server_optimizer="one trainer: its upload is the model itself, there is no mean of client updates to step on",
        not_proximal="one trainer on the pooled data: no client drifts from a global model",
    ),
    strategy="fedlora.strategies.centralized:Centralized",
    trainer="fedlora.clients.trainers.centralized:CentralizedTrainer",
)

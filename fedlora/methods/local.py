"""Local training only: every client trains its own adapter and nothing crosses the wire.

The lower bound every personalised federated method must beat (what a client gets without
federation; the "Local" rows of FedSA-LoRA, ICLR 2025, and FedDPA, NeurIPS 2024).
"""

from __future__ import annotations

from fedlora.compatibility import Capabilities
from fedlora.methods.base import Method, NoOptions

METHOD = Method(
    name="local",
    options=NoOptions,
    capabilities=Capabilities(
        personalized=True,
        uploads="nothing",
        downloads="nothing",
        mixed_ranks=True,
        paper="no-federation baseline (lower bound)",
        not_robust="nothing is aggregated",
        not_flower_dp="nothing is uploaded or aggregated: no update to clip, no aggregate to noise",
        not_secure="nothing is uploaded or aggregated",
        not_server_optimizer="nothing is uploaded or aggregated",
        not_proximal="nothing is downloaded: there is no global model to keep a client near",
    ),
    strategy="fedlora.strategies.local:LocalOnly",
    trainer="fedlora.clients.trainers.local:LocalOnlyTrainer",
)

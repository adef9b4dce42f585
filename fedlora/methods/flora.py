"""FLoRA: stacking-based heterogeneous-rank aggregation, merged into the base every round.

Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations", NeurIPS 2024 (arXiv:2409.05976). The math is :mod:`fedlora.lora.stacking` (the
stack A = [p_k s_k A_k], B = [B_k] is exactly sum p_k s_k B_k A_k; its wire format).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlora.compatibility import Capabilities
from fedlora.errors import ConfigError
from fedlora.methods.base import Method, NoOptions

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig


def check(experiment: ExperimentConfig, options: NoOptions) -> None:
    if experiment.model.init == "pissa":
        raise ConfigError(
            "model.init 'pissa' cannot be used with strategy 'flora' (FLoRA merges into the base "
            "that PiSSA rewrites); use model.init=kaiming or gaussian"
        )


METHOD = Method(
    name="flora",
    options=NoOptions,
    capabilities=Capabilities(
        personalized=False,
        uploads="A_k, B_k (own rank), head",
        downloads="unmerged stacks [p_k s_k A_k], [B_k] of past rounds, head",
        mixed_ranks=True,
        paper="Wang et al., NeurIPS 2024 (arXiv:2409.05976)",
        not_robust=(
            "stacking: the clients' factors are concatenated, not averaged, so no coordinate has several "
            "values to take a median of"
        ),
        not_flower_dp=(
            "stacking: clients merge every stack into their bases and upload a fresh LoRA, not the download "
            "plus an update, and the strategy cannot continue from noised arrays"
        ),
        not_secure="stacking: every client's factors are broadcast to every client, so there is nothing to hide",
        not_server_optimizer=("stacking: a round's update is the clients' stacked factors, which every client merges, "
                              "not a mean of the uploads"),
        proximal=True,
    ),
    strategy="fedlora.strategies.flora:FLoRA",
    trainer="fedlora.clients.trainers.flora:FLoRATrainer",
    check=check,
)

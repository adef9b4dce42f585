"""FedIT (FedAvg-LoRA): every client trains A and B; the server averages each separately.

FedAvg on the LoRA factors (and the head) is what FedIT does, so ``strategy.name = "fedavg"`` names this
method (an alias: the run, its config and its results are FedIT's). With ``[server_optimizer]`` it
is FedAvgM / FedAdam / FedYogi on LoRA, with ``train.proximal_mu`` FedProx (docs/strategies.md).

Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning", ICASSP 2024
(arXiv:2305.05644). The math is :func:`fedlora.lora.padded_average` (zero-pad mixed ranks to the
largest, average A and B separately, each client takes its first r_k components).
"""

from __future__ import annotations

from fedlora.compatibility import Capabilities
from fedlora.methods.base import Method, NoOptions

METHOD = Method(
    name="fedit",
    options=NoOptions,
    capabilities=Capabilities(
        personalized=False,
        uploads="A, B, head",
        downloads="A, B, head",
        mixed_ranks=True,  # zero-padded to r_max, truncated to r_k
        paper="Zhang et al., ICASSP 2024 (arXiv:2305.05644)",
        robust_aggregation=True,
        flower_dp=True,  # the weighted means of A and B (zero-padded to r_max)
        secure_aggregation=True,  # the same means: each client masks its update zero-padded to the round's r_max
        server_optimizer=True,  # the means of A and B (at r_max) and the head
        proximal=True,
    ),
    strategy="fedlora.strategies.fedit:FedIT",
    aliases=("fedavg",),  # FedAvg over the LoRA factors: FedIT's common name
)

"""FedIT: federated instruction tuning with FedAvg over LoRA factors.

Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning", ICASSP 2024.
ALGORITHMS.md, Baselines table, row ``fedit``.
"""

from __future__ import annotations

from typing import ClassVar

from fedlora.lora import Payload, weighted_average
from strategies.base import Capabilities, ClientUpload, LoRAStrategy


class FedIT(LoRAStrategy):
    """FedIT (FedAvg-LoRA): every client trains A and B; the server averages each separately.

    Paper: Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning",
    ICASSP 2024.

    Parameters
    ----------
    (none beyond the experiment config) Clients must share one rank.

    Upload: A_k, B_k (and the head when ``model.head = global``).

    Aggregation: A = sum_k p_k A_k and B = sum_k p_k B_k, *separately*, p_k = n_k / sum n. Note
    that mean(B) mean(A) != mean(B A): the aggregate is not the average of the clients' updates
    (the inexactness FLoRA and FlexLoRA address).

    Download: the global A and B (and head) to every sampled client.
    """

    name = "fedit"
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=False,
        uploads="A, B, head",
        downloads="A, B, head",
        paper="Zhang et al., ICASSP 2024 (arXiv:2305.05644)",
    )

    def setup(self) -> None:
        ranks = {p.rank for p in self.profiles.values()}
        if len(ranks) > 1:
            raise RuntimeError(
                f"fedit needs one LoRA rank for every client, got ranks {sorted(ranks)}; "
                "use hetlora, flexlora, flora or fedhera for mixed ranks"
            )
        self.global_adapter: Payload = self.initial_adapter(ranks.pop())

    def download(self, node_id: int, server_round: int) -> Payload:
        return self.global_adapter

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        self.global_adapter = weighted_average([u.payload for u in uploads], self.weights(uploads))

    def global_payload(self) -> Payload:
        return self.global_adapter

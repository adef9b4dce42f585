"""FedIT: federated instruction tuning with FedAvg over LoRA factors (``fedlora/methods/fedit.py``)."""

from __future__ import annotations

from fedlora.lora import Payload, padded_average, truncate_payload
from fedlora.methods.base import NoOptions
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download


class FedIT(LoRAStrategy[NoOptions]):
    """FedIT (FedAvg-LoRA): every client trains A and B; the server averages each separately.

    Paper: Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning",
    ICASSP 2024 (arXiv:2305.05644).

    Parameters
    ----------
    (none beyond the experiment config)

    Mixed ranks: FedIT assumes one rank. When clients declare different ranks, every upload is
    zero-padded to the largest rank r_max before averaging and each client receives the first
    r_k components (the zero-padding extension FLoRA uses to compare FedIT under heterogeneous
    ranks). With one rank this is exactly FedIT.

    Upload: A_k, B_k (and the head when ``model.head = global``).

    Aggregation: A = sum_k p_k A_k and B = sum_k p_k B_k, *separately*, p_k = n_k / sum n. Note
    that mean(B) mean(A) != mean(B A): the aggregate is not the average of the clients' updates
    (the inexactness FLoRA and FlexLoRA address).

    Download: the global A and B (and head) to every sampled client.

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns the global adapter (A, B at
    r_max, and the head); ``configure_*`` continue from the arrays given (the same keys and
    shapes): they become the global adapter the downloads are cut from.
    """

    STATE = (*LoRAStrategy.STATE, "global_adapter", "max_rank")  # checkpointed

    def setup(self) -> None:
        self.max_rank = max(p.rank for p in self.roster.profiles.values())
        self.global_adapter: Payload = self.initial_adapter(self.max_rank)  # (r_max) factors

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        return self.lora_download(partition, for_round, phase, truncate_payload(self.global_adapter, self.rank_of(partition)))

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        self.global_adapter = padded_average([u.payload for u in uploads], self.weights(uploads), self.max_rank,
                                             self.combine)

    def load_arrays(self, payload: Payload) -> None:
        self.global_adapter = dict(payload)

    def global_payload(self) -> Payload:
        return self.global_adapter

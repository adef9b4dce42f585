"""FFA-LoRA: A frozen at a shared seeded init, only B trained and sent (``fedlora/methods/ffa_lora.py``)."""

from __future__ import annotations

import numpy as np

from fedlora.lora import B_SUFFIX, Payload, head_only, nested_A_payload
from fedlora.methods import ffa_lora
from fedlora.methods.ffa_lora import aggregate_B, download_B
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download
from fedlora.strategies.one_factor import OneFactorStrategy


class FFALoRA(OneFactorStrategy[ffa_lora.FFALoRAOptions]):
    """FFA-LoRA: clients train only B; A stays frozen at a seeded init every party draws itself.

    Paper: Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning",
    ICLR 2024 (arXiv:2403.12313).

    Parameters
    ----------
    mixed_ranks : {'pad', 'refuse'}, default 'pad'
        Clients with different ranks: 'pad' [RECON, the paper has one rank]: A is drawn rank-nested
        (fedlora.lora.nested_A), so a rank-r_k client's A is the first r_k rows of the rank-R_max A; the
        server averages s_k B_k zero-padded to R_max (the exact average of the updates dW_k), and client k
        gets the first r_k columns rescaled by s_R / s_k; a column no client of the round holds is zero
        (the global update is the average of this round's updates). 'refuse': stop at setup unless every
        client has the same rank.

    Upload: B_k of every module (d_out x r_k), and the head when ``model.head = global``. A never
    travels: every client and the server draw the same A from ``train.seed``.

    Aggregation: B = sum_k p_k B_k (p_k = n_k / sum n), head by FedAvg. Because A is identical
    on every client this is the exact average of s B_k A, unlike FedIT's separate averages.

    Download: the global B (truncated to the client's rank) and the head. The global model is
    the shared A at R_max with the global B and head.

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns what the federation learns, the
    global B at R_max and the head; ``configure_*`` continue from the arrays given (the same keys
    and shapes) as B and head. A is no array: it is the constant every party draws from
    ``train.seed``, so an array-level wrapper (Flower's DP noise) never touches it; the whole global
    model (A, B, head) is :meth:`global_payload`.

    Flower's client-side fixed-clipping DP (``capabilities.flower_dp``): with one rank the aggregate
    is the weighted mean of the B_k; mixed ranks are refused (B_k enters as (R / r_k) B_k).
    """

    STATE = (*LoRAStrategy.STATE, "B", "head", "rank_max", "shared_A")  # checkpointed
    MIXED_RANKS_DP = ("a rank-r_k client's B_k enters the average as (R / r_k) B_k, so its clipped update moves the "
                      "aggregate by more than the noise assumes")

    def setup(self) -> None:
        self.rank_max = self.declared_ranks(self.options.mixed_ranks == "refuse", otherwise="pad")[-1]
        self.B = {m: np.zeros((d_out, self.rank_max), np.float32) for m, (d_out, _) in self.module_shapes.items()}
        self.head: Payload = self.initial_head()
        self.shared_A = nested_A_payload(self.module_shapes, self.rank_max, self.experiment.train.seed)

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        rank = self.rank_of(partition)
        payload = {m + B_SUFFIX: download_B(B, rank) for m, B in self.B.items()} | self.head
        return self.lora_download(partition, for_round, phase, payload, send_A=False)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        weights = self.weights(uploads)
        self.B = aggregate_B(self.uploaded(uploads, "B"), weights, self.rank_max, self.combine)
        self.head = self.averaged_head(uploads, weights, self.head)

    def global_arrays(self) -> Payload:
        """The global B (R_max columns per module) and the head; A is the seeded constant."""
        return {m + B_SUFFIX: value for m, value in self.B.items()} | self.head

    def load_arrays(self, payload: Payload) -> None:
        self.B = {m: payload[m + B_SUFFIX] for m in self.B}
        self.head = head_only(payload)

    def global_payload(self) -> Payload:
        return self.shared_A | self.global_arrays()

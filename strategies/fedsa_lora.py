"""FedSA-LoRA: A shared (averaged), B stays on the client (``fedlora/methods/fedsa_lora.py``)."""

from __future__ import annotations

from fedlora.lora import A_SUFFIX, Payload, head_only, nested_A_payload
from fedlora.methods import fedsa_lora
from fedlora.methods.fedsa_lora import aggregate_A
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download
from fedlora.strategies.one_factor import OneFactorStrategy


class FedSALoRA(OneFactorStrategy[fedsa_lora.FedSALoRAOptions]):
    """FedSA-LoRA: A learns what clients share and is averaged; B learns client-specific
    knowledge and never leaves the client.

    Paper: Guo, Zeng, Wang, Fan, Wang, Qu, "Selective Aggregation for Low-Rank Adaptation in
    Federated Learning", ICLR 2025 (arXiv:2410.01463).

    Parameters
    ----------
    mixed_ranks : {'nested', 'refuse'}, default 'nested'
        Clients with different ranks: 'nested' [RECON, the paper has one rank]: the initial A is drawn
        rank-nested (fedlora.lora.nested_A), so row j means the same on every client; row j of the global
        A is the example-weighted mean over the clients holding it (rank > j), and client k receives the
        first r_k rows. 'refuse': stop at setup unless every client has the same rank.

    Upload: A_k of every module (r_k x d_in), and the head when ``model.head = global``.

    Aggregation: A = sum_k p_k A_k (p_k = n_k / sum n), head by FedAvg. B is never aggregated.

    Download: the global A (its first r_k rows) and the head; the client overlays them on its
    own state, keeping its B_k. Personalised: each client's model is (global A, own B_k).
    There is no single global model (B is never uploaded), so the global-test accuracy reported
    is the example-weighted mean of the clients' own models on the global test set.

    Arrays (Flower's ``start`` loop): no single global model, so ``aggregate_train`` returns
    what every client downloads alike: the global A (R_max rows per module) and the head;
    ``configure_*`` continue from the arrays given (the same keys and shapes) as the global A and
    head. Each client's B stays on the client; no arrays hold it.

    Flower's client-side fixed-clipping DP (``capabilities.flower_dp``): with one rank the aggregate
    is the weighted mean of the A_k; mixed ranks are refused (rows averaged over their holders).
    """

    STATE = (*LoRAStrategy.STATE, "A", "head")  # checkpointed
    MIXED_RANKS_DP = ("row j of A is averaged over the clients holding it only, so a client weighs more in the rows "
                      "few clients hold than the noise assumes")

    def setup(self) -> None:
        ranks = self.declared_ranks(self.options.mixed_ranks == "refuse", otherwise="nested")
        initial = nested_A_payload(self.module_shapes, ranks[-1], self.experiment.train.seed)
        self.A = {key[: -len(A_SUFFIX)]: value for key, value in initial.items()}  # (R, d_in) each
        self.head: Payload = self.initial_head()

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        rank = self.rank_of(partition)
        payload = {m + A_SUFFIX: A[:rank].copy() for m, A in self.A.items()} | self.head
        return self.lora_download(partition, for_round, phase, payload, send_B=False)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        weights = self.weights(uploads)
        self.A = aggregate_A(self.uploaded(uploads, "A"), weights, self.A, self.combine)
        self.head = self.averaged_head(uploads, weights, self.head)

    def global_arrays(self) -> Payload:
        """The global A (R_max rows per module) and the head."""
        return {m + A_SUFFIX: A for m, A in self.A.items()} | self.head

    def load_arrays(self, payload: Payload) -> None:
        self.A = {m: payload[m + A_SUFFIX] for m in self.A}
        self.head = head_only(payload)

    def global_payload(self) -> None:
        """None: B never leaves the clients, so there is no global model to evaluate."""

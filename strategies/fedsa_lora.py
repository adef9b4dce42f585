"""FedSA-LoRA: selective aggregation, A is shared (averaged), B stays on the client.

Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR 2025.
ALGORITHMS.md, Baselines table, row ``fedsa_lora``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedlora.config import ConfigError, ExperimentConfig
from fedlora.lora import A_SUFFIX, Payload, head_only, split_payload, weighted_average
from fedlora.nested import nested_A_payload
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions


def rowwise_average(As: Sequence[np.ndarray], weights: Sequence[float], previous: np.ndarray) -> np.ndarray:
    """Row j of the result = sum_{k: r_k > j} p_k A_k[j] / sum_{k: r_k > j} p_k.

    ``As`` are the clients' A (r_k, d_in), ``previous`` the current global A (R, d_in): a row
    no client of this round holds keeps its previous value. With equal ranks this is FedSA-LoRA's
    A = sum_k p_k A_k.
    """
    p = np.asarray(weights, dtype=np.float64)
    total = np.zeros(previous.shape)  # (R, d_in)
    mass = np.zeros(previous.shape[0])  # (R,) weight of the clients holding each row
    for p_k, A_k in zip(p, As):
        r_k = A_k.shape[0]
        total[:r_k] += p_k * np.asarray(A_k, dtype=np.float64)
        mass[:r_k] += p_k
    held = mass > 0
    out = np.array(previous, dtype=np.float64)
    out[held] = total[held] / mass[held, None]
    return out.astype(np.float32)


def aggregate_A(client_A: Sequence[dict[str, np.ndarray]], weights: Sequence[float], previous: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`rowwise_average` for every module."""
    return {m: rowwise_average([A[m] for A in client_A], weights, previous[m]) for m in previous}


class FedSALoRA(LoRAStrategy):
    """FedSA-LoRA: A learns what clients share and is averaged; B learns client-specific
    knowledge and never leaves the client.

    Paper: Guo, Zeng, Wang, Fan, Wang, Qu, "Selective Aggregation for Low-Rank Adaptation in
    Federated Learning", ICLR 2025 (arXiv:2410.01463).

    Parameters
    ----------
    mixed_ranks : {"nested", "refuse"}, default "nested"
        Clients with different ranks. ``nested`` [RECON, the paper has one rank]: the initial A
        is drawn rank-nested (:func:`fedlora.nested.nested_A`), so row j means the same on every
        client; row j of the global A is the example-weighted mean over the clients holding
        it (rank > j), and client k receives the first r_k rows. ``refuse``: stop at setup
        unless every client has the same rank.

    Upload: A_k of every module (r_k x d_in), and the head when ``model.head = global``.

    Aggregation: A = sum_k p_k A_k (p_k = n_k / sum n), head by FedAvg. B is never aggregated.

    Download: the global A (its first r_k rows) and the head; the client overlays them on its
    own state, keeping its B_k. Personalised: each client's model is (global A, own B_k).
    There is no single global model (B is never uploaded), so the global-test accuracy reported
    is the example-weighted mean of the clients' own models on the global test set.
    """

    name = "fedsa_lora"
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=True,
        uploads="A, head",
        downloads="A, head",
        mixed_ranks=True,
        paper="Guo et al., ICLR 2025 (arXiv:2410.01463)",
    )

    class Options(StrategyOptions):
        mixed_ranks: Literal["nested", "refuse"] = Field(
            "nested",
            description="Mixed client ranks: 'nested' (rank-nested initial A, row-wise average "
            "over the clients holding each row, truncate back) or 'refuse' (one rank for all).",
        )

    @classmethod
    def check_config(cls, experiment: ExperimentConfig) -> None:
        if experiment.model.init != "kaiming":
            raise ConfigError(
                f"fedsa_lora starts every client from one rank-nested A (kaiming-uniform, B = 0); "
                f"model.init must be 'kaiming', got {experiment.model.init!r}"
            )

    def setup(self) -> None:
        ranks = sorted({p.rank for p in self.profiles.values()})
        if len(ranks) > 1 and self.options.mixed_ranks == "refuse":
            raise RuntimeError(
                f"fedsa_lora with strategy.mixed_ranks='refuse' needs one rank for every client, "
                f"got ranks {ranks}; set strategy.mixed_ranks='nested'"
            )
        initial = nested_A_payload(self.module_shapes, ranks[-1], self.experiment.train.seed)
        self.A = {key[: -len(A_SUFFIX)]: value for key, value in initial.items()}  # (R, d_in) each
        self.head: Payload = dict(self.head_initial) if self.sends_head else {}

    def download(self, node_id: int, server_round: int) -> Payload:
        rank = self.profiles[node_id].rank
        return {m + A_SUFFIX: A[:rank].copy() for m, A in self.A.items()} | self.head

    def expected_upload(self, node_id: int) -> dict[str, tuple[int, ...]]:
        return self.lora_shapes(self.profiles[node_id].rank, send_A=True, send_B=False)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        weights = self.weights(uploads)
        client_A = [{m: f.A for m, f in split_payload(u.payload)[0].items()} for u in uploads]
        self.A = aggregate_A(client_A, weights, self.A)
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], weights)

    def global_payload(self) -> None:
        """None: B never leaves the clients, so there is no global model to evaluate."""

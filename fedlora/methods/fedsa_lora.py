"""FedSA-LoRA: selective aggregation, A is shared (averaged), B stays on the client.

Guo, Zeng, Wang, Fan, Wang, Qu, "Selective Aggregation for Low-Rank Adaptation in Federated
Learning", ICLR 2025 (arXiv:2410.01463). A starts rank-nested (:func:`fedlora.lora.nested_A`) so
row j means the same on every client; row j of the global A is averaged over the clients holding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from fedlora.compatibility import Capabilities
from fedlora.lora import Combine, Weights
from fedlora.methods.base import Method, MethodOptions, require_kaiming_init

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig


class FedSALoRAOptions(MethodOptions):
    mixed_ranks: Literal["nested", "refuse"] = Field(
        "nested",
        description="Clients with different ranks: 'nested' [RECON, the paper has one rank]: the initial "
        "A is drawn rank-nested (fedlora.lora.nested_A), so row j means the same on every client; row j "
        "of the global A is the example-weighted mean over the clients holding it (rank > j), and client "
        "k receives the first r_k rows. 'refuse': stop at setup unless every client has the same rank.",
    )


def rowwise_average(
    As: Sequence[np.ndarray], weights: Weights, previous: np.ndarray, combine: Combine | None = None
) -> np.ndarray:
    """Row j of the result = sum_{k: r_k > j} p_k A_k[j] / sum_{k: r_k > j} p_k.

    ``As`` are the clients' A (r_k, d_in), ``previous`` the current global A (R, d_in): a row
    no client of this round holds keeps its previous value. With equal ranks this is FedSA-LoRA's
    A = sum_k p_k A_k. ``combine`` (``faults.aggregation``): row j is instead the robust rule
    over the rows j of the clients holding it.
    """
    p = np.asarray(weights, dtype=np.float64)
    if combine is not None and combine.robust:
        robust = np.array(previous, dtype=np.float64)  # (R, d_in)
        for j in range(previous.shape[0]):
            holders = [(p_k, A_k[j]) for p_k, A_k in zip(p, As) if A_k.shape[0] > j]
            if holders:
                robust[j] = combine([row for _, row in holders], [p_k for p_k, _ in holders])
        return robust.astype(np.float32)
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


def aggregate_A(
    client_A: Sequence[dict[str, np.ndarray]], weights: Weights, previous: dict[str, np.ndarray],
    combine: Combine | None = None,
) -> dict[str, np.ndarray]:
    """:func:`rowwise_average` for every module."""
    return {m: rowwise_average([A[m] for A in client_A], weights, previous[m], combine) for m in previous}


def check(experiment: ExperimentConfig, options: FedSALoRAOptions) -> None:
    require_kaiming_init(experiment, "fedsa_lora starts every client from one rank-nested A")


METHOD = Method(
    name="fedsa_lora",
    options=FedSALoRAOptions,
    capabilities=Capabilities(
        personalized=True,
        uploads="A, head",
        downloads="A, head",
        mixed_ranks=True,
        robust_aggregation=True,  # A's rows by coordinate-wise median / trimmed mean over their holders
        paper="Guo et al., ICLR 2025 (arXiv:2410.01463)",
        flower_dp=True,  # the weighted mean of A with one rank (mixed ranks average rows over their holders: refused)
        secure_aggregation=True,
        server_optimizer=True,  # the mean of A (each row over its holders) and the head
        proximal=True,
        secure_one_rank=("with mixed ranks row j of A is averaged over the clients holding it, a normaliser per row, "
                         "not the one total weight of a masked sum"),
    ),
    strategy="fedlora.strategies.fedsa_lora:FedSALoRA",
    trainer="fedlora.clients.trainers.fedsa_lora:FedSALoRATrainer",
    check=check,
)

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

from fedlora.errors import ConfigError
from fedlora.lora import Weights
from fedlora.methods.base import Capabilities, Method, MethodOptions

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig


class FedSALoRAOptions(MethodOptions):
    mixed_ranks: Literal["nested", "refuse"] = Field(
        "nested",
        description="Mixed client ranks: 'nested' [RECON, the paper has one rank] (rank-nested initial A, "
        "row-wise average over the clients holding each row, truncate back) or 'refuse' (one rank for all).",
    )


def rowwise_average(As: Sequence[np.ndarray], weights: Weights, previous: np.ndarray) -> np.ndarray:
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


def aggregate_A(client_A: Sequence[dict[str, np.ndarray]], weights: Weights, previous: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`rowwise_average` for every module."""
    return {m: rowwise_average([A[m] for A in client_A], weights, previous[m]) for m in previous}


def check(experiment: ExperimentConfig, options: FedSALoRAOptions) -> None:
    if experiment.model.init != "kaiming":
        raise ConfigError(
            f"fedsa_lora starts every client from one rank-nested A (kaiming-uniform, B = 0); "
            f"model.init must be 'kaiming', got {experiment.model.init!r}"
        )


METHOD = Method(
    name="fedsa_lora",
    options=FedSALoRAOptions,
    capabilities=Capabilities(
        personalized=True,
        uploads="A, head",
        downloads="A, head",
        mixed_ranks=True,
        paper="Guo et al., ICLR 2025 (arXiv:2410.01463)",
    ),
    check=check,
)

"""FFA-LoRA: A frozen at a shared seeded init every party draws itself; only B is trained and sent.

Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024
(arXiv:2403.12313). A is :func:`fedlora.lora.nested_A` (rank-nested, so mixed ranks share their
first components); the server averages s_k B_k zero-padded to the largest rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from fedlora.compatibility import Capabilities
from fedlora.lora import Combine, Weights
from fedlora.methods.base import Method, MethodOptions, require_kaiming_init

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig


class FFALoRAOptions(MethodOptions):
    mixed_ranks: Literal["pad", "refuse"] = Field(
        "pad",
        description="Clients with different ranks: 'pad' [RECON, the paper has one rank]: A is drawn "
        "rank-nested (fedlora.lora.nested_A), so a rank-r_k client's A is the first r_k rows of the "
        "rank-R_max A; the server averages s_k B_k zero-padded to R_max (the exact average of the "
        "updates dW_k), and client k gets the first r_k columns rescaled by s_R / s_k; a column no "
        "client of the round holds is zero (the global update is the average of this round's updates). "
        "'refuse': stop at setup unless every client has the same rank.",
    )


def aggregate_B(
    client_B: Sequence[Mapping[str, np.ndarray]], weights: Weights, rank: int, combine: Combine | None = None
) -> dict[str, np.ndarray]:
    """B (d_out, rank) per module with s_R B A_R = sum_k p_k s_k B_k A_R[:r_k].

    With A shared and rank-nested (A_k = A_R[:r_k]) and s = alpha / r, this is the exact average
    of the clients' updates dW_k = s_k B_k A_k: B = sum_k p_k (R / r_k) pad(B_k, R). With equal
    ranks it is FFA-LoRA's plain B = sum_k p_k B_k. ``weights`` are normalised here. ``combine``
    (``faults.aggregation``): a robust rule over the padded, rescaled (R / r_k) pad(B_k, R) instead.
    """
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    out: dict[str, np.ndarray] = {}
    for module in client_B[0]:
        d_out = client_B[0][module].shape[0]
        if combine is not None and combine.robust:
            padded = []
            for B_by_module in client_B:
                B_k = np.asarray(B_by_module[module], dtype=np.float64)  # (d_out, r_k)
                padded.append(np.pad((rank / B_k.shape[1]) * B_k, ((0, 0), (0, rank - B_k.shape[1]))))  # (d_out, R)
            out[module] = combine(padded, p).astype(np.float32)
            continue
        total = np.zeros((d_out, rank))  # (d_out, R)
        for p_k, B_by_module in zip(p, client_B):
            B_k = np.asarray(B_by_module[module], dtype=np.float64)  # (d_out, r_k)
            r_k = B_k.shape[1]
            total[:, :r_k] += p_k * (rank / r_k) * B_k
        out[module] = total.astype(np.float32)
    return out


def download_B(B: np.ndarray, rank: int) -> np.ndarray:
    """Client view of the global B (d_out, R) at ``rank`` r_k: (r_k / R) B[:, :r_k], so that
    s_k B_k A_k is the rank-r_k truncation of s_R B A_R (exact when r_k = R)."""
    R = B.shape[1]
    return np.asarray((rank / R) * B[:, :rank], dtype=np.float32)  # (d_out, r_k)


def check(experiment: ExperimentConfig, options: FFALoRAOptions) -> None:
    require_kaiming_init(experiment, "ffa_lora draws its frozen A itself")


METHOD = Method(
    name="ffa_lora",
    options=FFALoRAOptions,
    capabilities=Capabilities(
        personalized=False,
        uploads="B, head",
        downloads="B, head",
        mixed_ranks=True,
        robust_aggregation=True,  # B's coordinate-wise median / trimmed mean (A is shared, not aggregated)
        paper="Sun et al., ICLR 2024 (arXiv:2403.12313)",
        flower_dp=True,  # the weighted mean of B with one rank (mixed ranks rescale B_k by R / r_k: refused)
        secure_aggregation=True,
        server_optimizer=True,  # the mean of B and the head
        proximal=True,
        secure_one_rank="mixed ranks enter the average as (R / r_k) B_k, not the zero-padded B_k a client masks",
    ),
    strategy="fedlora.strategies.ffa_lora:FFALoRA",
    trainer="fedlora.clients.trainers.ffa_lora:FFALoRATrainer",
    check=check,
)

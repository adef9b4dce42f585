"""HetLoRA: heterogeneous ranks by zero-padding, norm-weighted averaging and truncation.

Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models",
EMNLP 2024 (arXiv:2401.06432). ALGORITHMS.md, Baselines table, row ``hetlora``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedlora.lora import (
    Factors,
    Payload,
    head_only,
    join_payload,
    normalise,
    pad_rank,
    split_payload,
    truncate_rank,
    weighted_average,
)
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions


def product_norm(f: Factors) -> float:
    """‖B A‖_F without forming B A: ‖B A‖_F^2 = trace((B^T B)(A A^T)), both r x r."""
    gram_B = f.B.astype(np.float64).T @ f.B  # (r, r)
    gram_A = f.A.astype(np.float64) @ f.A.T  # (r, r)
    return float(np.sqrt(max(np.sum(gram_B * gram_A), 0.0)))  # trace(X Y) = sum(X * Y^T), Y symmetric


def hetlora_aggregate(
    clients: Sequence[Mapping[str, Factors]], rank: int, examples: Sequence[float], weighting: str = "norm"
) -> dict[str, Factors]:
    """Per module: zero-pad every client's factors to ``rank``, then average A and B separately.

    ``weighting = norm``: w_k = ‖B_k A_k‖_F / sum_j ‖B_j A_j‖_F (HetLoRA's sparsity-weighted
    aggregation; uniform when every norm is zero); ``examples``: w_k = n_k / sum n.
    """
    out: dict[str, Factors] = {}
    for module in clients[0]:
        padded = [pad_rank(c[module], rank) for c in clients]  # each (rank, d_in), (d_out, rank)
        if weighting == "norm":
            w = normalise([product_norm(c[module]) for c in clients])
        else:
            w = normalise(examples)
        A = np.tensordot(w, np.stack([f.A.astype(np.float64) for f in padded]), axes=1)  # (rank, d_in)
        B = np.tensordot(w, np.stack([f.B.astype(np.float64) for f in padded]), axes=1)  # (d_out, rank)
        out[module] = Factors(A.astype(np.float32), B.astype(np.float32))
    return out


class HetLoRAOptions(StrategyOptions):
    weighting: Literal["norm", "examples"] = Field(
        "norm",
        description="Aggregation weights: 'norm' = w_k proportional to ||B_k A_k||_F per module "
        "(HetLoRA's sparsity-weighted aggregation, Cho et al. 2024, Sec. 3); 'examples' = "
        "n_k / sum n (plain zero-padding FedAvg, an ablation).",
    )


class HetLoRA(LoRAStrategy):
    """HetLoRA: clients train LoRA at their own rank; the server zero-pads to the largest rank,
    averages with weights proportional to each client's update norm, and truncates back.

    Paper: Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
    Models", EMNLP 2024.

    Parameters
    ----------
    weighting : {"norm", "examples"}, default "norm"
        'norm': w_k = ‖B_k A_k‖_F / sum_j ‖B_j A_j‖_F per module, the norm computed in factor
        space (trace((B^T B)(A A^T))); 'examples': w_k = n_k / sum n.

    Upload: A_k (r_k, d_in), B_k (d_out, r_k) of every module (and the head when
    ``model.head = global``).

    Aggregation: every client's factors are zero-padded to r_max (the largest accepted client
    rank; the padding leaves B_k A_k unchanged), then A and B are averaged *separately* with w_k.
    The head is averaged with p_k = n_k / sum n. Factors are averaged as they are: each model
    applies its own scale alpha / r (the global model, rank r_max, alpha / r_max). The paper's
    optional rank self-pruning is not implemented.

    Download: client k gets the first r_k components (rows of A, columns of B) of the global
    rank-r_max factors, and the head.
    """

    name = "hetlora"
    Options: ClassVar[type[StrategyOptions]] = HetLoRAOptions
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=False,
        uploads="A_k, B_k (own rank), head",
        downloads="global factors truncated to r_k, head",
        mixed_ranks=True,
        paper="Cho et al., EMNLP 2024 (arXiv:2401.06432)",
    )

    def setup(self) -> None:
        self.max_rank = max(p.rank for p in self.profiles.values())
        factors, _ = split_payload(self.initial_adapter(self.max_rank))
        self.global_factors: dict[str, Factors] = factors  # module -> rank r_max factors
        self.head: Payload = dict(self.head_initial) if self.sends_head else {}
        self.aggregated = False

    def download(self, node_id: int, server_round: int) -> Payload:
        rank = self.profiles[node_id].rank
        if not self.aggregated:  # the common seeded init at the client's own rank
            factors, _ = split_payload(self.initial_adapter(rank))
        else:
            factors = {m: truncate_rank(f, rank) for m, f in self.global_factors.items()}
        return join_payload(factors, self.head)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        clients = [split_payload(u.payload)[0] for u in uploads]
        examples = [u.num_examples for u in uploads]
        self.global_factors = hetlora_aggregate(clients, self.max_rank, examples, self.options.weighting)
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], self.weights(uploads))
        self.aggregated = True

    def global_payload(self) -> Payload:
        return join_payload(self.global_factors, self.head)

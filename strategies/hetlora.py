"""HetLoRA: heterogeneous ranks by zero-padding, norm-weighted averaging and truncation.

Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models",
EMNLP 2024 (arXiv:2401.06432). ALGORITHMS.md, Baselines table, row ``hetlora``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from fedlora.lora import (
    Factors,
    Payload,
    head_only,
    join_payload,
    normalise,
    pad_rank,
    pruned_rank,
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
    self_prune: bool = Field(
        False,
        description="Local rank self-pruning (Cho et al. 2024, Sec. 3): each client adds "
        "prune_lambda * sum_modules ||B_tail||_F ||A_tail||_F (the components beyond "
        "floor(prune_decay * r_k)) to its loss and drops them, shrinking its rank for good, when "
        "that tail norm is smaller than in its previous round.",
    )
    prune_decay: float = Field(
        0.75, gt=0.0, lt=1.0, description="gamma: a pruning client keeps floor(gamma * r_k) components (at least 1)."
    )
    prune_lambda: float = Field(
        0.01, ge=0.0, description="lambda: weight of the tail-norm regulariser in the local loss."
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
    self_prune : bool, default False
        Local rank self-pruning (client side, ``clients/trainers/hetero.py``): the local loss adds
        lambda * sum_modules ‖B_k[:, t:]‖_F ‖A_k[t:, :]‖_F with t = floor(gamma r_k); after
        training, when that tail norm is below the client's previous round's, the client drops
        the tail, uploads rank t and keeps rank t from then on. The reconstruction of the
        paper's rule compares with the previous round at the same rank (a fresh rank needs two
        rounds of evidence).
    prune_decay : float, default 0.75
        gamma in (0, 1): the rank a pruning client keeps, floor(gamma r_k), at least 1.
    prune_lambda : float, default 0.01
        lambda >= 0: weight of the tail-norm regulariser.

    Upload: A_k (r_k, d_in), B_k (d_out, r_k) of every module (and the head when
    ``model.head = global``).

    Aggregation: every client's factors are zero-padded to r_max (the largest accepted client
    rank; the padding leaves B_k A_k unchanged), then A and B are averaged *separately* with w_k.
    The head is averaged with p_k = n_k / sum n. Factors are averaged as they are: each model
    applies its own scale alpha / r (the global model, rank r_max, alpha / r_max). With
    ``self_prune`` a client's rank r_k is the rank of its last accepted upload: the client reports
    it (``lora-rank`` metric, checked against its current rank before the upload's shapes are)
    and every later download is cut to it; results.json's ``extra.ranks`` tracks them per round.

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
        self.ranks = {node: p.rank for node, p in self.profiles.items()}  # current r_k (self-pruning)
        self.upload_rank: dict[int, int] = {}  # the rank each client reported with this round's upload
        factors, _ = split_payload(self.initial_adapter(self.max_rank))
        self.global_factors: dict[str, Factors] = factors  # module -> rank r_max factors
        self.head: Payload = dict(self.head_initial) if self.sends_head else {}
        self.aggregated = False

    def download(self, node_id: int, server_round: int) -> Payload:
        rank = self.ranks[node_id]
        if not self.aggregated:  # the common seeded init at the client's own rank
            factors, _ = split_payload(self.initial_adapter(rank))
        else:
            factors = {m: truncate_rank(f, rank) for m, f in self.global_factors.items()}
        return join_payload(factors, self.head)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        clients = [split_payload(u.payload)[0] for u in uploads]
        examples = [u.num_examples for u in uploads]
        self.global_factors = hetlora_aggregate(clients, self.max_rank, examples, self.options.weighting)
        for upload, factors in zip(uploads, clients):
            self.ranks[upload.node_id] = next(iter(factors.values())).rank  # pruned clients stay pruned
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], self.weights(uploads))
        self.aggregated = True

    def observe_reply(self, node_id: int, metrics: Mapping[str, float]) -> None:
        """A self-pruning client reports the rank of its upload: its current rank or the pruned one."""
        reported = int(metrics.get("lora-rank", self.ranks[node_id]))
        allowed = {self.ranks[node_id], pruned_rank(self.ranks[node_id], self.options.prune_decay)}
        # anything else keeps the current rank, so the upload's shapes are refused as malformed
        self.upload_rank[node_id] = reported if self.options.self_prune and reported in allowed else self.ranks[node_id]

    def expected_upload(self, node_id: int) -> dict[str, tuple[int, ...]]:
        rank = self.upload_rank.get(node_id, self.ranks[node_id])
        return self.lora_shapes(rank, send_A=True, send_B=True)

    def client_config(self, node_id: int, server_round: int) -> dict[str, Any]:
        return {"lora-rank": self.ranks[node_id]} if self.options.self_prune else {}

    def round_extra(self, server_round: int) -> dict[str, Any]:
        if not self.options.self_prune:
            return {}
        return {"ranks": {str(self.partition_of(node)): rank for node, rank in sorted(self.ranks.items())}}

    def global_payload(self) -> Payload:
        return join_payload(self.global_factors, self.head)

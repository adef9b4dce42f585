"""FlexLoRA: an SVD of the averaged full-size update, each client its best rank-r_k part
(``fedlora/methods/flexlora.py``)."""

from __future__ import annotations

import numpy as np

from fedlora.lora import (
    A_SUFFIX,
    B_SUFFIX,
    Factors,
    LowRankSVD,
    Payload,
    concat_stacks,
    join_payload,
    leading_factors,
    lora_scale,
    split_payload,
    stack,
)
from fedlora.methods import flexlora
from fedlora.methods.flexlora import flexlora_aggregate
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download


class FlexLoRA(LoRAStrategy[flexlora.FlexLoRAOptions]):
    """FlexLoRA: each client trains its own rank; the server averages the full-size updates and
    hands every client the best rank-r_k approximation of the average.

    Paper: Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks
    and Client Resources", NeurIPS 2024 (arXiv:2402.11505).

    Parameters
    ----------
    svd_dtype : {'float64', 'float32'}, default 'float64'
        Precision of the server's factor-space SVD: 'float64' (default) or 'float32' (about half the time
        on 7B-sized adapters, see benchmarks/aggregation.py).

    Each client's rank r_k comes from its own profile (``[clients] ranks`` / ``rank_tiers`` in
    simulation, ``rank=`` in a node config); its scale is s_k = model.lora_alpha / r_k.

    Upload: A_k (r_k, d_in) and B_k (d_out, r_k) of every module (and the head when
    ``model.head = global``).

    Aggregation: per module G = sum_k p_k s_k B_k A_k, p_k = n_k / sum n over the round's
    uploads, and its SVD G = U S V^T, computed in factor space (R x R Gram matrices of the
    stacked factors, R = sum r_k, see fedlora/lora/svd.py), exact; only the leading r_max singular
    triplets are rotated back. The head is averaged with p_k (FedAvg). The global model is G
    itself, held at rank R as the stacked factors [p_k s_k B_k], [A_k] / s_R, s_R = alpha / R
    (compressed exactly by SVD if R reaches the layer width).

    Download: client k gets B_k = U[:, :r_k] S[:r_k] / s_k and A_k = V[:, :r_k]^T, so
    s_k B_k A_k is the best rank-r_k approximation of G (and the averaged head). Before the first
    aggregation every client gets the common seeded initial adapter at its rank.

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns the global model (G as rank-R
    factors, A divided by s_R, and the head); ``configure_*`` continue from the arrays given (the
    same keys and shapes): G = s_R B A and its SVD are taken from them, the downloads cut from it.
    """

    STATE = (*LoRAStrategy.STATE, "aggregate_stack", "head", "spectrum")  # checkpointed

    def setup(self) -> None:
        self.spectrum: dict[str, LowRankSVD] = {}  # module -> leading r_max SVD of the last G
        self.aggregate_stack: dict[str, Factors] = {}  # module -> G as unit-scale stacked factors
        self.head: Payload = self.initial_head()

    def scale(self, rank: int) -> float:
        return lora_scale(self.experiment.model.lora_alpha, rank)

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        rank = self.rank_of(partition)
        if not self.spectrum:
            factors, _ = split_payload(self.initial_adapter(rank))
        else:
            factors = {m: leading_factors(svd, rank, self.scale(rank)) for m, svd in self.spectrum.items()}
        return self.lora_download(partition, for_round, phase, join_payload(factors, self.head))

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        clients = [split_payload(u.payload)[0] for u in uploads]
        scales = [self.scale(self.rank_of(u.partition_id)) for u in uploads]
        dtype = np.float32 if self.options.svd_dtype == "float32" else np.float64
        max_rank = max(p.rank for p in self.roster.profiles.values())
        self.spectrum = flexlora_aggregate(clients, self.weights(uploads), scales, dtype, rank=max_rank)
        self.aggregate_stack = concat_stacks([stack(clients, self.weights(uploads), scales)])
        self.head = self.averaged_head(uploads, self.weights(uploads), self.head)

    def load_arrays(self, payload: Payload) -> None:
        factors, self.head = split_payload(payload)
        unit = {m: Factors((self.scale(f.rank) * f.A).astype(np.float32), f.B) for m, f in factors.items()}  # B (s_R A) = G
        dtype = np.float32 if self.options.svd_dtype == "float32" else np.float64
        max_rank = max(p.rank for p in self.roster.profiles.values())
        self.spectrum = flexlora_aggregate([unit], [1.0], [1.0], dtype, rank=max_rank)
        self.aggregate_stack = concat_stacks([unit])

    def global_payload(self) -> Payload:
        if not self.spectrum:
            rank = max(p.rank for p in self.roster.profiles.values())
            factors, _ = split_payload(self.initial_adapter(rank))
            return join_payload(factors, self.head)
        payload: Payload = {}
        for module, f in self.aggregate_stack.items():  # s_R B A = G exactly
            payload[module + A_SUFFIX] = (f.A / self.scale(f.rank)).astype(np.float32)
            payload[module + B_SUFFIX] = f.B
        return payload | self.head

    def round_extra(self, server_round: int) -> dict[str, float]:
        ranks = [f.rank for f in self.aggregate_stack.values()]
        return {"aggregate_rank": float(max(ranks)) if ranks else 0.0}

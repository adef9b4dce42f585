"""FlexLoRA: heterogeneous-rank aggregation through an SVD of the averaged full-size update.

Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and Client
Resources", NeurIPS 2024 (arXiv:2402.11505). ALGORITHMS.md, Baselines table, row ``flexlora``.
The SVD is taken in factor space (:func:`fedlora.lora.factor_svd`), never on the dense
d_out x d_in sum when the stacked rank is smaller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedlora.lora import (
    A_SUFFIX,
    B_SUFFIX,
    Factors,
    LowRankSVD,
    Payload,
    factor_svd,
    head_only,
    join_payload,
    pad_rank,
    split_payload,
    weighted_average,
)
from fedlora.lowrank import batched_factor_svd
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions
from strategies.flora import concat_stacks, flora_stack


def flexlora_aggregate(
    clients: Sequence[Mapping[str, Factors]],
    weights: Sequence[float],
    scales: Sequence[float],
    dtype: type[np.floating] = np.float64,
    rank: int | None = None,
) -> dict[str, LowRankSVD]:
    """Per module, the thin SVD of G = sum_k p_k s_k B_k A_k, computed from the stacked factors.

    ``clients[k]`` maps module -> client k's factors (any rank, the same for all its modules),
    ``weights`` are p_k (summing to one), ``scales`` are s_k = alpha / r_k; ``rank`` keeps only
    the leading components (all R = sum r_k by default). Modules of one shape are done together
    (:func:`fedlora.lowrank.batched_factor_svd`); when R is not below min(d_out, d_in),
    :func:`fedlora.lora.factor_svd` takes the dense SVD.
    """
    coefficients = [float(p) * float(s) for p, s in zip(weights, scales)]  # p_k s_k
    groups: dict[tuple[int, int], list[str]] = {}
    for module, f in clients[0].items():
        groups.setdefault((f.B.shape[0], f.A.shape[1]), []).append(module)
    out: dict[str, LowRankSVD] = {}
    for (d_out, d_in), modules in groups.items():
        ranks = [c[modules[0]].rank for c in clients]
        R = sum(ranks)
        B = np.empty((len(modules), d_out, R), dtype)  # [p_k s_k B_k] per module
        A = np.empty((len(modules), R, d_in), dtype)  # [A_k] per module
        start = 0
        for c, w, r in zip(clients, coefficients, ranks):
            for i, m in enumerate(modules):
                np.multiply(c[m].B, w, out=B[i, :, start : start + r], casting="unsafe")
                A[i, start : start + r] = c[m].A
            start += r
        if R >= min(d_out, d_in):
            for i, m in enumerate(modules):
                svd = factor_svd([B[i]], [A[i]], [1.0])
                out[m] = LowRankSVD(svd.U[:, :rank], svd.S[:rank], svd.Vt[:rank])
            continue
        svd = batched_factor_svd(B, A, rank)  # G = U S V^T per module
        out |= {m: LowRankSVD(svd.U[i], svd.S[i], svd.Vt[i]) for i, m in enumerate(modules)}
    return out


def flexlora_factors(svd: LowRankSVD, rank: int, scale: float) -> Factors:
    """Client factors of rank ``rank`` with scale s: B = U_r S_r / s, A = V_r^T, so s B A = U_r S_r V_r^T.

    When G has fewer than ``rank`` components (few, low-rank clients in the round) the factors
    are zero-padded, which leaves s B A unchanged.
    """
    r = min(rank, len(svd.S))
    B = (svd.U[:, :r] * (svd.S[:r] / scale)).astype(np.float32)  # (d_out, r)
    A = svd.Vt[:r].astype(np.float32)  # (r, d_in)
    return pad_rank(Factors(A, B), rank)


class FlexLoRAOptions(StrategyOptions):
    svd_dtype: Literal["float64", "float32"] = Field(
        "float64",
        description="Precision of the server's factor-space SVD: 'float64' (default) or 'float32' "
        "(about half the time on 7B-sized adapters, see benchmarks/aggregation.py).",
    )


class FlexLoRA(LoRAStrategy):
    """FlexLoRA: each client trains its own rank; the server averages the full-size updates and
    hands every client the best rank-r_k approximation of the average.

    Paper: Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks
    and Client Resources", NeurIPS 2024.

    Parameters
    ----------
    svd_dtype : {"float64", "float32"}, default "float64"
        Precision of the server's factor-space SVD.

    Each client's rank r_k comes from its own profile (``[clients] ranks`` / ``rank_tiers`` in
    simulation, ``rank=`` in a node config); its scale is s_k = model.lora_alpha / r_k.

    Upload: A_k (r_k, d_in) and B_k (d_out, r_k) of every module (and the head when
    ``model.head = global``).

    Aggregation: per module G = sum_k p_k s_k B_k A_k, p_k = n_k / sum n over the round's
    uploads, and its SVD G = U S V^T, computed in factor space (R x R Gram matrices of the
    stacked factors, R = sum r_k, see fedlora/lowrank.py), exact; only the leading r_max singular
    triplets are rotated back. The head is averaged with p_k (FedAvg). The global model is G
    itself, held at rank R as the stacked factors [p_k s_k B_k], [A_k] / s_R, s_R = alpha / R
    (compressed exactly by SVD if R reaches the layer width).

    Download: client k gets B_k = U[:, :r_k] S[:r_k] / s_k and A_k = V[:, :r_k]^T, so
    s_k B_k A_k is the best rank-r_k approximation of G (and the averaged head). Before the first
    aggregation every client gets the common seeded initial adapter at its rank.
    """

    name = "flexlora"
    Options: ClassVar[type[StrategyOptions]] = FlexLoRAOptions
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=False,
        uploads="A_k, B_k (own rank), head",
        downloads="rank-r_k SVD truncation of sum p_k s_k B_k A_k, head",
        mixed_ranks=True,
        paper="Bai et al., NeurIPS 2024 (arXiv:2402.11505)",
    )

    def setup(self) -> None:
        self.spectrum: dict[str, LowRankSVD] = {}  # module -> leading r_max SVD of the last G
        self.aggregate_stack: dict[str, Factors] = {}  # module -> G as unit-scale stacked factors
        self.head: Payload = dict(self.head_initial) if self.sends_head else {}

    def scale(self, rank: int) -> float:
        return self.experiment.model.lora_alpha / rank

    def download(self, node_id: int, server_round: int) -> Payload:
        rank = self.profiles[node_id].rank
        if not self.spectrum:
            factors, _ = split_payload(self.initial_adapter(rank))
        else:
            factors = {m: flexlora_factors(svd, rank, self.scale(rank)) for m, svd in self.spectrum.items()}
        return join_payload(factors, self.head)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        clients = [split_payload(u.payload)[0] for u in uploads]
        scales = [self.scale(self.profiles[u.node_id].rank) for u in uploads]
        dtype = np.float32 if self.options.svd_dtype == "float32" else np.float64
        max_rank = max(p.rank for p in self.profiles.values())
        self.spectrum = flexlora_aggregate(clients, self.weights(uploads), scales, dtype, rank=max_rank)
        self.aggregate_stack = concat_stacks([flora_stack(clients, self.weights(uploads), scales)])
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], self.weights(uploads))

    def global_payload(self) -> Payload:
        if not self.spectrum:
            rank = max(p.rank for p in self.profiles.values())
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

"""FlexLoRA: heterogeneous-rank aggregation through an SVD of the averaged full-size update.

Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and Client
Resources", NeurIPS 2024 (arXiv:2402.11505). The SVD is taken in factor space
(:func:`fedlora.lora.batched_factor_svd`), never on the dense d_out x d_in sum when the stacked
rank is smaller; client k gets :func:`fedlora.lora.leading_factors` of it at its rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedlora.compatibility import Capabilities
from fedlora.lora import Factors, LowRankSVD, Weights, batched_factor_svd, factor_svd
from fedlora.methods.base import Method, MethodOptions


class FlexLoRAOptions(MethodOptions):
    svd_dtype: Literal["float64", "float32"] = Field(
        "float64",
        description="Precision of the server's factor-space SVD: 'float64' (default) or 'float32' "
        "(about half the time on 7B-sized adapters, see benchmarks/aggregation.py).",
    )


def flexlora_aggregate(
    clients: Sequence[Mapping[str, Factors]],
    weights: Weights,
    scales: Sequence[float],
    dtype: type[np.floating] = np.float64,
    rank: int | None = None,
) -> dict[str, LowRankSVD]:
    """Per module, the thin SVD of G = sum_k p_k s_k B_k A_k, computed from the stacked factors.

    ``clients[k]`` maps module -> client k's factors (any rank, the same for all its modules),
    ``weights`` are p_k (summing to one), ``scales`` are s_k = alpha / r_k; ``rank`` keeps only
    the leading components (all R = sum r_k by default). Modules of one shape are done together
    (:func:`fedlora.lora.batched_factor_svd`); when R is not below min(d_out, d_in) the dense SVD
    is taken (:func:`fedlora.lora.factor_svd`).
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
                out[m] = factor_svd([B[i]], [A[i]], [1.0], rank)
            continue
        svd = batched_factor_svd(B, A, rank)  # G = U S V^T per module
        out |= {m: LowRankSVD(svd.U[i], svd.S[i], svd.Vt[i]) for i, m in enumerate(modules)}
    return out


METHOD = Method(
    name="flexlora",
    options=FlexLoRAOptions,
    capabilities=Capabilities(
        personalized=False,
        uploads="A_k, B_k (own rank), head",
        downloads="rank-r_k SVD truncation of sum p_k s_k B_k A_k, head",
        mixed_ranks=True,
        paper="Bai et al., NeurIPS 2024 (arXiv:2402.11505)",
        not_robust=(
            "SVD-based: its aggregate is the truncated SVD of sum_k p_k s_k B_k A_k, a product of "
            "factors, not a mean of arrays"
        ),
        not_flower_dp=(
            "SVD-based: its arrays are factors of G = sum_k p_k s_k B_k A_k, a mean of factor products, so a "
            "clipped factor update does not bound a client's change of G and noise on them is not noise on a mean"
        ),
        not_secure=("SVD-based: it needs sum_k p_k s_k B_k A_k, a sum of factor products, which masked factors "
                    "do not give (only the dense products could be masked, d_out x d_in per module)"),
        not_server_optimizer=("SVD-based: its global factors are a truncated SVD of sum_k p_k s_k B_k A_k, not a mean "
                              "of the uploads"),
        proximal=True,
    ),
    strategy="fedlora.strategies.flexlora:FlexLoRA",
)

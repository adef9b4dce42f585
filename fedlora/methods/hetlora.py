"""HetLoRA: heterogeneous ranks by zero-padding, norm-weighted averaging and truncation, with
optional rank self-pruning on the client.

Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models",
EMNLP 2024 (arXiv:2401.06432). Wire key: a self-pruning client reports the rank of its upload
(``upload-rank`` train metric); the server tells every client its current rank in the message
(``lora-rank``, as for every method).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import Field

from fedlora.compatibility import Capabilities
from fedlora.lora import Factors, average_factors, normalise, product_norm
from fedlora.methods.base import Method, MethodOptions
from fedlora.shares import capped_weights


class HetLoRAOptions(MethodOptions):
    weighting: Literal["norm", "examples"] = Field(
        "norm",
        description="Aggregation weights: 'norm' = w_k proportional to ||B_k A_k||_F per module "
        "(HetLoRA's sparsity-weighted aggregation, Cho et al. 2024, Sec. 3), the norm computed in "
        "factor space (trace((B^T B)(A A^T))); 'examples' = "
        "n_k / sum n (plain zero-padding FedAvg, an ablation). Either way no client weighs more than the "
        "round's share bound (the weight-share rule, fedlora/shares.py): a client scaling its B cannot take the round.",
    )
    self_prune: bool = Field(
        False,
        description="Local rank self-pruning (Cho et al. 2024, Sec. 3; client side, "
        "clients/trainers/hetlora.py): each client adds prune_lambda * sum_modules ||B_tail||_F "
        "||A_tail||_F (the components beyond floor(prune_decay * r_k)) to its loss and, when that "
        "tail norm is smaller than in its previous round at the same rank, drops them: it uploads "
        "rank floor(prune_decay * r_k) and keeps it from then on [RECON: the comparison rule; a "
        "fresh rank needs two rounds of evidence].",
    )
    prune_decay: float = Field(
        0.75, gt=0.0, lt=1.0, description="gamma: a pruning client keeps floor(gamma * r_k) components (at least 1)."
    )
    prune_lambda: float = Field(
        0.01, ge=0.0, description="lambda: weight of the tail-norm regulariser in the local loss."
    )


def pruned_rank(rank: int, decay: float) -> int:
    """The rank HetLoRA's self-pruning keeps: floor(decay * rank), at least 1."""
    return max(1, math.floor(decay * rank))


def hetlora_aggregate(
    clients: Sequence[Mapping[str, Factors]], rank: int, examples: Sequence[float], weighting: str = "norm",
    max_share: float = 1.0,
) -> dict[str, Factors]:
    """Per module: zero-pad every client's factors to ``rank``, then average A and B separately.

    ``weighting = norm``: w_k = ||B_k A_k||_F / sum_j ||B_j A_j||_F (HetLoRA's sparsity-weighted
    aggregation; uniform when every norm is zero), cut so that no client's share of a module
    exceeds ``max_share`` (the weight-share rule, :func:`fedlora.shares.capped_weights`: a client
    scaling its B by 30 would otherwise take the round); ``examples``: w_k = n_k / sum n (the
    counts as the server weighs them, already within the rule).
    """
    out: dict[str, Factors] = {}
    for module in clients[0]:
        factors = [c[module] for c in clients]
        if weighting == "norm":
            w = normalise(capped_weights([product_norm(f) for f in factors], max_share))
        else:
            w = normalise(examples)
        out[module] = average_factors(factors, w, rank)
    return out


METHOD = Method(
    name="hetlora",
    options=HetLoRAOptions,
    capabilities=Capabilities(
        personalized=False,
        uploads="A_k, B_k (own rank), head",
        downloads="global factors truncated to r_k, head",
        mixed_ranks=True,
        paper="Cho et al., EMNLP 2024 (arXiv:2401.06432)",
        not_robust=(
            "its aggregate is defined by its norm-based weights (||B_k A_k||_F), which an unweighted "
            "median or trimmed mean drops"
        ),
        not_flower_dp=(
            "weighting = 'norm' weighs each upload by the Frobenius norm of its own B_k A_k, so a client's weight "
            "depends on its data and the noise is not calibrated to the clipped updates"
        ),
        not_secure=("it weighs each upload by ||B_k A_k||_F and reads each client's self-pruned rank, both from the "
                    "client's own arrays"),
        not_server_optimizer=("until its first aggregation each client starts from the seeded init at its own rank, not "
                              "a cut of the global factors, and weighting = 'norm' weighs each upload by its own "
                              "||B_k A_k||_F: the aggregate minus the global arrays is not a mean update"),
        proximal=True,
    ),
    strategy="fedlora.strategies.hetlora:HetLoRA",
    trainer="fedlora.clients.trainers.hetlora:HetLoRATrainer",
)

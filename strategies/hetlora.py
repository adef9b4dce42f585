"""HetLoRA: zero-padding, norm-weighted averaging and truncation, optional rank self-pruning
(``fedlora/methods/hetlora.py``)."""

from __future__ import annotations

from typing import Any

from fedlora import protocol
from fedlora.lora import (
    Factors,
    Payload,
    join_payload,
    split_payload,
    truncate_rank,
)
from fedlora.methods import hetlora
from fedlora.methods.hetlora import hetlora_aggregate, pruned_rank
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download


class HetLoRA(LoRAStrategy[hetlora.HetLoRAOptions]):
    """HetLoRA: clients train LoRA at their own rank; the server zero-pads to the largest rank,
    averages with weights proportional to each client's update norm, and truncates back.

    Paper: Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
    Models", EMNLP 2024 (arXiv:2401.06432).

    Parameters
    ----------
    weighting : {'norm', 'examples'}, default 'norm'
        Aggregation weights: 'norm' = w_k proportional to ||B_k A_k||_F per module (HetLoRA's
        sparsity-weighted aggregation, Cho et al. 2024, Sec. 3), the norm computed in factor space
        (trace((B^T B)(A A^T))); 'examples' = n_k / sum n (plain zero-padding FedAvg, an ablation). Either
        way no client weighs more than the round's share bound (the weight-share rule, fedlora/shares.py):
        a client scaling its B cannot take the round.
    self_prune : bool, default False
        Local rank self-pruning (Cho et al. 2024, Sec. 3; client side, clients/trainers/hetlora.py): each
        client adds prune_lambda * sum_modules ||B_tail||_F ||A_tail||_F (the components beyond
        floor(prune_decay * r_k)) to its loss and, when that tail norm is smaller than in its previous
        round at the same rank, drops them: it uploads rank floor(prune_decay * r_k) and keeps it from
        then on [RECON: the comparison rule; a fresh rank needs two rounds of evidence].
    prune_decay : float in (0, 1), default 0.75
        gamma: a pruning client keeps floor(gamma * r_k) components (at least 1).
    prune_lambda : float >= 0, default 0.01
        lambda: weight of the tail-norm regulariser in the local loss.

    Upload: A_k (r_k, d_in), B_k (d_out, r_k) of every module (and the head when
    ``model.head = global``).

    Aggregation: every client's factors are zero-padded to r_max (the largest accepted client
    rank; the padding leaves B_k A_k unchanged), then A and B are averaged *separately* with w_k.
    The head is averaged with p_k = n_k / sum n. Factors are averaged as they are: each model
    applies its own scale alpha / r (the global model, rank r_max, alpha / r_max). With
    ``self_prune`` a client's rank r_k is the rank of its last accepted upload: the client reports
    it (``upload-rank`` metric, checked against its current rank before the upload's shapes are)
    and every later download is cut to it; results.json's ``extra.ranks`` tracks them per round.

    Download: client k gets the first r_k components (rows of A, columns of B) of the global
    rank-r_max factors, and the head.

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns the global rank-r_max factors
    and the head; ``configure_*`` continue from the arrays given (the same keys and shapes): the
    downloads are cut from them (before the first aggregation, arrays equal to the seeded
    rank-r_max adapter keep the common seeded init at each client's own rank).
    """

    STATE = (*LoRAStrategy.STATE, "aggregated", "global_factors", "head", "max_rank", "ranks")  # checkpointed

    def setup(self) -> None:
        self.max_rank = max(p.rank for p in self.roster.profiles.values())
        self.ranks = {p: profile.rank for p, profile in self.roster.profiles.items()}  # current r_k
        factors, _ = split_payload(self.initial_adapter(self.max_rank))
        self.global_factors: dict[str, Factors] = factors  # module -> rank r_max factors
        self.head: Payload = self.initial_head()
        self.aggregated = False

    def rank_of(self, partition: int) -> int:
        return self.ranks[partition]

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        """The global factors cut to the client's rank. A self-pruning client uploads at the rank it
        reports (``upload-rank``): its current rank or the pruned one; any other report (NaN, 2.5,
        another rank) means the current rank, so the upload's shapes are refused. The aggregation
        reads each upload's rank from its shapes."""
        rank = self.ranks[partition]
        if not self.aggregated:  # the common seeded init at the client's own rank
            factors, _ = split_payload(self.initial_adapter(rank))
        else:
            factors = {m: truncate_rank(f, rank) for m, f in self.global_factors.items()}
        allowed = {rank, pruned_rank(rank, self.options.prune_decay)} if self.options.self_prune else set()
        return self.lora_download(partition, for_round, phase, join_payload(factors, self.head),
                                  choice=protocol.HETLORA_UPLOAD_RANK,
                                  alternatives={float(r): self.lora_shapes(r, send_A=True, send_B=True) for r in allowed})

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        clients = [split_payload(u.payload)[0] for u in uploads]
        examples = [u.weight for u in uploads]
        self.global_factors = hetlora_aggregate(clients, self.max_rank, examples, self.options.weighting,
                                                self.round_share_bound(uploads))
        for upload, factors in zip(uploads, clients):
            self.ranks[upload.partition_id] = next(iter(factors.values())).rank  # pruned clients stay pruned
        self.head = self.averaged_head(uploads, self.weights(uploads), self.head)
        self.aggregated = True

    def round_extra(self, server_round: int) -> dict[str, Any]:
        if not self.options.self_prune:
            return {}
        return {"ranks": {str(p): rank for p, rank in sorted(self.ranks.items())}}

    def load_arrays(self, payload: Payload) -> None:
        self.global_factors, self.head = split_payload(payload)
        self.aggregated = True

    def global_payload(self) -> Payload:
        return join_payload(self.global_factors, self.head)

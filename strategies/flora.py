"""FLoRA: stacking-based heterogeneous-rank aggregation, merged into the base every round.

Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations", NeurIPS 2024 (arXiv:2409.05976). ALGORITHMS.md, Baselines table, row ``flora``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from fedlora.config import ConfigError, ExperimentConfig
from fedlora.lora import (
    A_SUFFIX,
    B_SUFFIX,
    Factors,
    Payload,
    factor_svd,
    head_only,
    join_payload,
    split_payload,
    weighted_average,
)
from fedlora.stacking import stack_payload
from strategies.base import Capabilities, ClientUpload, LoRAStrategy


def flora_stack(
    clients: Sequence[Mapping[str, Factors]], weights: Sequence[float], scales: Sequence[float]
) -> dict[str, Factors]:
    """Per module A = [p_1 s_1 A_1; ...; p_K s_K A_K], B = [B_1 ... B_K], so that
    B A = sum_k p_k s_k B_k A_k exactly (the scales folded into A: the stack has unit scale)."""
    out: dict[str, Factors] = {}
    for module in clients[0]:
        A = np.concatenate([p * s * c[module].A for c, p, s in zip(clients, weights, scales)], axis=0)  # (R, d_in)
        B = np.concatenate([c[module].B for c in clients], axis=1)  # (d_out, R)
        out[module] = Factors(A.astype(np.float32), B.astype(np.float32))
    return out


def concat_stacks(stacks: Sequence[Mapping[str, Factors]]) -> dict[str, Factors]:
    """Stacks of several rounds as one unit-scale stack per module: B A = sum of their products.

    When the total rank reaches min(d_out, d_in) the stack is compressed to that rank with the
    exact factor-space SVD (B = U S, A = V^T), which leaves B A unchanged.
    """
    out: dict[str, Factors] = {}
    for module in stacks[0]:
        A = np.concatenate([s[module].A for s in stacks], axis=0)  # (R_total, d_in)
        B = np.concatenate([s[module].B for s in stacks], axis=1)  # (d_out, R_total)
        if A.shape[0] >= min(B.shape[0], A.shape[1]):
            svd = factor_svd([B], [A], [1.0])
            A, B = svd.Vt, svd.U * svd.S
        out[module] = Factors(A.astype(np.float32), B.astype(np.float32))
    return out


class FLoRA(LoRAStrategy):
    """FLoRA: stack the clients' LoRA factors so the aggregate is exactly the average update;
    every client merges it into its frozen base and restarts a fresh LoRA.

    Paper: Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
    Low-Rank Adaptations", NeurIPS 2024.

    Parameters
    ----------
    (none beyond the experiment config) Each client trains at its own rank r_k (profile), scale
    s_k = model.lora_alpha / r_k. ``model.init = pissa`` is refused (it rewrites the base that
    FLoRA merges into).

    Upload: A_k (r_k, d_in), B_k (d_out, r_k) of every module (and the head when
    ``model.head = global``).

    Aggregation: per module the stack A = [p_1 s_1 A_1; ...; p_K s_K A_K] (R x d_in),
    B = [B_1 ... B_K] (d_out x R), R = sum r_k, so B A = sum_k p_k s_k B_k A_k exactly (no
    cross terms, unlike averaging A and B separately). The head is averaged with p_k. The server
    keeps every round's stack; the global model is W0 plus all of them (held as one rank-R_total
    adapter with A divided by its scale alpha / R_total).

    Download: every stack the client has not merged yet (the server records what each client
    confirmed by a successful training reply, so a client that skipped rounds, or whose reply
    failed, catches up; the bytes are counted), and the head. The client adds each stack's B A to
    its frozen base weights (and keeps the merged sum locally), then re-initialises its rank-r_k
    LoRA with a fresh init seeded by (train.seed, round). Every client merges the same stacks,
    so the merged bases agree.
    """

    name = "flora"
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=False,
        uploads="A_k, B_k (own rank), head",
        downloads="unmerged stacks [p_k s_k A_k], [B_k] of past rounds, head",
        mixed_ranks=True,
        paper="Wang et al., NeurIPS 2024 (arXiv:2409.05976)",
    )

    @classmethod
    def check_config(cls, experiment: ExperimentConfig) -> None:
        if experiment.model.init == "pissa":
            raise ConfigError(
                "model.init 'pissa' cannot be used with strategy 'flora' (FLoRA merges into the base "
                "that PiSSA rewrites); use model.init=kaiming or gaussian"
            )

    def setup(self) -> None:
        self.stacks: dict[int, dict[str, Factors]] = {}  # round -> module -> unit-scale stack
        self.merged: dict[int, set[int]] = {node: set() for node in self.profiles}  # confirmed
        self.sent: dict[int, set[int]] = {node: set() for node in self.profiles}  # last download
        self.head: Payload = dict(self.head_initial) if self.sends_head else {}

    def scale(self, rank: int) -> float:
        return self.experiment.model.lora_alpha / rank

    def download(self, node_id: int, server_round: int) -> Payload:
        missing = sorted(set(self.stacks) - self.merged[node_id])
        self.sent[node_id] = set(missing)
        payload: Payload = {}
        for t in missing:
            payload.update(stack_payload(t, self.stacks[t]))
        payload.update(self.head)
        return payload

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        for u in uploads:  # a successful reply means the client merged what it was sent
            self.merged[u.node_id] |= self.sent[u.node_id]
        clients = [split_payload(u.payload)[0] for u in uploads]
        scales = [self.scale(self.profiles[u.node_id].rank) for u in uploads]
        self.stacks[server_round] = flora_stack(clients, self.weights(uploads), scales)
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], self.weights(uploads))

    def global_payload(self) -> Payload:
        if not self.stacks:
            factors, _ = split_payload(self.initial_adapter(max(p.rank for p in self.profiles.values())))
            return join_payload(factors, self.head)
        total = concat_stacks([self.stacks[t] for t in sorted(self.stacks)])
        payload: Payload = {}
        for module, f in total.items():
            rank = f.rank
            payload[module + A_SUFFIX] = (f.A / self.scale(rank)).astype(np.float32)  # s_R B A = sum
            payload[module + B_SUFFIX] = f.B
        payload.update(self.head)
        return payload

    def round_extra(self, server_round: int) -> dict[str, float]:
        stack = self.stacks.get(server_round, {})
        return {"stacked_rank": float(max((f.rank for f in stack.values()), default=0))}

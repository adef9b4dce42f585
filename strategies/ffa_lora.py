"""FFA-LoRA: federated LoRA with A frozen at a shared random init; only B is trained and sent.

Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024.
ALGORITHMS.md, Baselines table, row ``ffa_lora``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedlora.config import ConfigError, ExperimentConfig
from fedlora.lora import B_SUFFIX, Payload, head_only, split_payload, weighted_average
from fedlora.nested import nested_A_payload
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions


def aggregate_B(client_B: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rank: int) -> dict[str, np.ndarray]:
    """B (d_out, rank) per module with s_R B A_R = sum_k p_k s_k B_k A_R[:r_k].

    With A shared and rank-nested (A_k = A_R[:r_k]) and s = alpha / r, this is the exact average
    of the clients' updates dW_k = s_k B_k A_k: B = sum_k p_k (R / r_k) pad(B_k, R). With equal
    ranks it is FFA-LoRA's plain B = sum_k p_k B_k. ``weights`` are normalised here.
    """
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    out: dict[str, np.ndarray] = {}
    for module in client_B[0]:
        d_out = client_B[0][module].shape[0]
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
    return ((rank / R) * B[:, :rank]).astype(np.float32)  # (d_out, r_k)


class FFALoRA(LoRAStrategy):
    """FFA-LoRA: clients train only B; A stays frozen at a seeded init every party draws itself.

    Paper: Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning",
    ICLR 2024 (arXiv:2403.12313).

    Parameters
    ----------
    mixed_ranks : {"pad", "refuse"}, default "pad"
        Clients with different ranks. ``pad`` [RECON, the paper has one rank]: A is drawn
        rank-nested (:func:`fedlora.nested.nested_A`), so a rank-r_k client's A is the first
        r_k rows of the rank-R_max A; the server averages s_k B_k zero-padded to R_max (the exact
        average of the updates dW_k), and client k gets the first r_k columns rescaled by
        s_R / s_k; a column no client of the round holds is zero (the global update is the
        average of this round's updates). ``refuse``: stop at setup unless every client has the
        same rank.

    Upload: B_k of every module (d_out x r_k), and the head when ``model.head = global``. A never
    travels: every client and the server draw the same A from ``train.seed``.

    Aggregation: B = sum_k p_k B_k (p_k = n_k / sum n), head by FedAvg. Because A is identical
    on every client this is the exact average of s B_k A, unlike FedIT's separate averages.

    Download: the global B (truncated to the client's rank) and the head. The global model is
    the shared A at R_max with the global B and head.
    """

    name = "ffa_lora"
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=False,
        uploads="B, head",
        downloads="B, head",
        mixed_ranks=True,
        paper="Sun et al., ICLR 2024 (arXiv:2403.12313)",
    )

    class Options(StrategyOptions):
        mixed_ranks: Literal["pad", "refuse"] = Field(
            "pad",
            description="Mixed client ranks: 'pad' (rank-nested shared A, scale-aware zero-padded "
            "average of B, truncate back) or 'refuse' (one rank for every client).",
        )

    @classmethod
    def check_config(cls, experiment: ExperimentConfig) -> None:
        if experiment.model.init != "kaiming":
            raise ConfigError(
                f"ffa_lora draws its frozen A itself (kaiming-uniform, B = 0); model.init must be "
                f"'kaiming', got {experiment.model.init!r}"
            )

    def setup(self) -> None:
        ranks = sorted({p.rank for p in self.profiles.values()})
        if len(ranks) > 1 and self.options.mixed_ranks == "refuse":
            raise RuntimeError(
                f"ffa_lora with strategy.mixed_ranks='refuse' needs one rank for every client, got "
                f"ranks {ranks}; set strategy.mixed_ranks='pad'"
            )
        self.rank_max = ranks[-1]
        self.B = {m: np.zeros((d_out, self.rank_max), np.float32) for m, (d_out, _) in self.module_shapes.items()}
        self.head: Payload = dict(self.head_initial) if self.sends_head else {}
        self.shared_A = nested_A_payload(self.module_shapes, self.rank_max, self.experiment.train.seed)

    def download(self, node_id: int, server_round: int) -> Payload:
        rank = self.profiles[node_id].rank
        payload = {m + B_SUFFIX: download_B(B, rank) for m, B in self.B.items()}
        return payload | self.head

    def expected_upload(self, node_id: int) -> dict[str, tuple[int, ...]]:
        return self.lora_shapes(self.profiles[node_id].rank, send_A=False, send_B=True)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        weights = self.weights(uploads)
        client_B = [{m: f.B for m, f in split_payload(u.payload)[0].items()} for u in uploads]
        self.B = aggregate_B(client_B, weights, self.rank_max)
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], weights)

    def global_payload(self) -> Payload:
        B = {m + B_SUFFIX: value for m, value in self.B.items()}
        return self.shared_A | B | self.head

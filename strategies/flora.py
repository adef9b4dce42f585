"""FLoRA: stacking-based heterogeneous-rank aggregation, merged into the base every round
(``fedlora/methods/flora.py``)."""

from __future__ import annotations

import numpy as np

from fedlora.lora import (
    A_SUFFIX,
    B_SUFFIX,
    Factors,
    Payload,
    concat_stacks,
    join_payload,
    lora_scale,
    split_payload,
    stack,
    stack_payload,
)
from fedlora.methods.base import NoOptions
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download


class FLoRA(LoRAStrategy[NoOptions]):
    """FLoRA: stack the clients' LoRA factors so the aggregate is exactly the average update;
    every client merges it into its frozen base and restarts a fresh LoRA.

    Paper: Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
    Low-Rank Adaptations", NeurIPS 2024 (arXiv:2409.05976).

    Parameters
    ----------
    (none beyond the experiment config)

    Each client trains at its own rank r_k (profile), scale s_k = model.lora_alpha / r_k.
    ``model.init = pissa`` is refused (it rewrites the base that FLoRA merges into).

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

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns the global model (every stack
    so far as one rank-R_total adapter, A divided by alpha / R_total, and the head);
    ``configure_*`` accept those arrays back (or an empty record) and refuse others: the clients
    have merged every stack into their frozen bases, so the server cannot replace the sum.
    """

    RETIRED_STATE = frozenset({"sent"})  # checkpoints before the Download value: the stacks each client was sent
    STATE = (*LoRAStrategy.STATE, "head", "merged", "stacks")  # checkpointed

    def setup(self) -> None:
        self.stacks: dict[int, dict[str, Factors]] = {}  # round -> module -> unit-scale stack
        # per client, only once it took part (an idle client costs nothing here)
        self.merged: dict[int, set[int]] = {}  # confirmed rounds
        self.head: Payload = self.initial_head()

    def scale(self, rank: int) -> float:
        return lora_scale(self.experiment.model.lora_alpha, rank)

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        """The stacks the client has not merged yet (their rounds are the download's ``context``) and the head."""
        missing = sorted(set(self.stacks) - self.merged.get(partition, set()))
        payload: Payload = {}
        for t in missing:
            payload.update(stack_payload(t, self.stacks[t]))
        payload.update(self.head)
        return self.lora_download(partition, for_round, phase, payload, context=frozenset(missing))

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        for u in uploads:  # a successful reply means the client merged what it was sent
            self.merged.setdefault(u.partition_id, set()).update(u.download.context if u.download else ())
        clients = [split_payload(u.payload)[0] for u in uploads]
        scales = [self.scale(self.rank_of(u.partition_id)) for u in uploads]
        self.stacks[server_round] = stack(clients, self.weights(uploads), scales)
        self.head = self.averaged_head(uploads, self.weights(uploads), self.head)

    def global_payload(self) -> Payload:
        if not self.stacks:
            factors, _ = split_payload(self.initial_adapter(max(p.rank for p in self.roster.profiles.values())))
            return join_payload(factors, self.head)
        total = concat_stacks([self.stacks[t] for t in sorted(self.stacks)])
        payload: Payload = {}
        for module, f in total.items():
            payload[module + A_SUFFIX] = (f.A / self.scale(f.rank)).astype(np.float32)  # s_R B A = sum
            payload[module + B_SUFFIX] = f.B
        payload.update(self.head)
        return payload

    def round_extra(self, server_round: int) -> dict[str, float]:
        stacked = self.stacks.get(server_round, {})
        return {"stacked_rank": float(max((f.rank for f in stacked.values()), default=0))}

"""HetLoRA's client: the default client at its own rank, plus the optional rank self-pruning.

The model is built at the rank the server decided (the message's ``lora-rank``), the download
(already cut to that rank) overlays the local state, A, B and the head are trained and uploaded.
The optional rank self-pruning (``strategy.self_prune``, Cho et al. 2024, Sec. 3) adds a
tail-norm regulariser to the loss and, when the tail shrank since the previous round, drops it
for good.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fedlora import protocol
from fedlora.clients.trainers.base import ClientJob, LocalTrainer
from fedlora.lora import Payload, join_payload, split_payload, truncate_rank
from fedlora.methods.hetlora import HetLoRAOptions, pruned_rank
from fedlora.models import adapter_payload
from fedlora.protocol import number

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

PRUNE_STATE_KEY = "fedlora.hetlora.prune"  # context.state: the last tail norm and the rank it was taken at


def lora_tail_norm(model: PeftModel, keep: int) -> torch.Tensor:
    """sum over adapted modules of ‖B[:, keep:]‖_F ‖A[keep:, :]‖_F (HetLoRA's pruning regulariser)."""
    import torch

    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        for side in ("lora_A", "lora_B"):
            if f".{side}." in name:
                factors.setdefault(name.split(f".{side}.")[0], {})[side] = param
    total = torch.zeros(())
    for f in factors.values():
        A, B = f["lora_A"], f["lora_B"]  # (r, d_in), (d_out, r)
        total = total + torch.linalg.norm(B[:, keep:].float()).cpu() * torch.linalg.norm(A[keep:].float()).cpu()
    return total


def prune_payload(payload: Payload, rank: int) -> Payload:
    """The adapter with only its first ``rank`` components (the head unchanged)."""
    factors, head = split_payload(payload)
    return join_payload({m: truncate_rank(f, rank) for m, f in factors.items()}, head)


class HetLoRATrainer(LocalTrainer):
    """HetLoRA's client: the default trainer at the client's own rank r_k, optionally self-pruning."""

    reuse_model = False  # not shown safe to reuse (it changes more than parameter values): built fresh

    options: HetLoRAOptions

    def __init__(self, job: ClientJob) -> None:
        super().__init__(job)
        self.upload_rank = job.profile.rank  # the rank of this round's upload (pruned or not)
        self.tail_norm: float | None = None  # this round's tail norm, once measured

    @property
    def self_prune(self) -> bool:
        return self.options.self_prune and self.keep_rank < self.job.profile.rank

    @property
    def keep_rank(self) -> int:
        """floor(gamma r_k): the components a pruning step keeps."""
        return pruned_rank(self.job.profile.rank, self.options.prune_decay)

    def loss(self, model: PeftModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = super().loss(model, batch)
        if self.self_prune and self.options.prune_lambda > 0:
            loss = loss + self.options.prune_lambda * lora_tail_norm(model, self.keep_rank).to(loss.device)
        return loss

    def upload(self, model: PeftModel) -> Payload:
        """The adapter, cut to floor(gamma r_k) when this round's tail norm fell below the last one."""
        payload = super().upload(model)
        if not self.self_prune:
            return payload
        import torch

        with torch.no_grad():
            tail = float(lora_tail_norm(model, self.keep_rank))
        previous = self.job.state.get(PRUNE_STATE_KEY)
        shrank = (previous is not None and int(number(previous["rank"])) == self.upload_rank
                  and tail < number(previous["tail"]))
        if shrank:
            self.upload_rank = self.keep_rank
        self.tail_norm = tail
        self._remember(self.upload_rank, math.nan if shrank else tail)
        return prune_payload(payload, self.upload_rank) if shrank else payload

    def keep(self, model: PeftModel) -> Payload:
        payload = adapter_payload(model)
        return prune_payload(payload, self.upload_rank) if self.upload_rank < self.job.profile.rank else payload

    def train_metrics(self) -> dict[str, float]:
        """``upload-rank``: the rank of this round's upload (the server checks the upload against it)."""
        if not self.options.self_prune:
            return {}
        metrics = {protocol.HETLORA_UPLOAD_RANK: float(self.upload_rank)}
        if self.tail_norm is not None:
            metrics[protocol.HETLORA_TAIL_NORM] = self.tail_norm
        return metrics

    def _remember(self, rank: int, tail: float) -> None:
        from flwr.app import ConfigRecord

        self.job.state[PRUNE_STATE_KEY] = ConfigRecord({"rank": rank, "tail": tail})

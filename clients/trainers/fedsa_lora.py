"""FedSA-LoRA's client: keep B, take the global A; train both; upload A (+head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import B_SUFFIX, Payload

if TYPE_CHECKING:
    from peft import PeftModel


class FedSALoRATrainer(LocalTrainer):
    """The default overlay (local A, B, head <- global A, head) keeps B_k; only A goes up."""


    def upload(self, model: PeftModel) -> Payload:
        """A of every module (and the head when it is global); B_k never leaves."""
        return {k: v for k, v in super().upload(model).items() if not k.endswith(B_SUFFIX)}

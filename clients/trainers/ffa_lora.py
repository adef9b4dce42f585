"""FFA-LoRA's client: A is the shared rank-nested seeded init, frozen; train and upload B (+head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import A_SUFFIX, Payload, nested_A_payload
from fedlora.models import load_payload, module_shapes

if TYPE_CHECKING:
    from peft import PeftModel


class FFALoRATrainer(LocalTrainer):
    """Local state overlaid with the download (B, head); A reset to the shared init and frozen."""


    def prepare(self, download: Payload) -> PeftModel:
        model = super().prepare(download)
        rank = self.job.profile.rank
        load_payload(model, nested_A_payload(module_shapes(model), rank, self.config.train.seed))
        for name, parameter in model.named_parameters():
            if ".lora_A." in name:
                parameter.requires_grad_(False)  # FFA-LoRA: A is never trained
        return model

    def upload(self, model: PeftModel) -> Payload:
        """B of every module (and the head when it is global); never A."""
        return {k: v for k, v in super().upload(model).items() if not k.endswith(A_SUFFIX)}

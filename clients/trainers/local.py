"""The ``local`` baseline's client: train its own adapter (and head) from its own state; send nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import Payload

if TYPE_CHECKING:
    from peft import PeftModel


class LocalOnlyTrainer(LocalTrainer):
    """The default local-state overlay with an empty download; the upload is empty too."""


    def upload(self, model: PeftModel) -> Payload:
        """Nothing leaves the client."""
        return {}

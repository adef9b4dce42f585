"""Client side of the centralised reference: train on every client's training data pooled."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fedlora import protocol
from fedlora.clients.trainers.base import LocalTrainer
from fedlora.training import TrainStats, train

if TYPE_CHECKING:
    from peft import PeftModel


class CentralizedTrainer(LocalTrainer):
    """Trains on the union of all clients' training splits with the federation's step budget."""


    def fit(self, model: PeftModel) -> TrainStats:
        import datasets

        cfg = self.config.train
        pooled = datasets.concatenate_datasets([client.train for client in self.job.federated.clients])
        clients = int(self.job.message_config.get(protocol.CENTRALIZED_CLIENTS, 1))
        if cfg.max_steps:
            steps, epochs = cfg.max_steps * clients, math.ceil(cfg.max_steps * clients * cfg.batch_size / len(pooled))
        else:
            fraction = clients / len(self.job.federated.clients)
            steps, epochs = math.ceil(cfg.local_epochs * fraction * len(pooled) / cfg.batch_size), cfg.local_epochs
        loader = self.loader(pooled, "pooled-train", shuffle=True)
        return train(model, loader, epochs=max(epochs, 1), lr=self.lr, device=self.device, max_steps=steps,
                     weight_decay=cfg.weight_decay, loss_fn=self.loss, after_backward=self.after_backward,
                     precision=self.precision, options=self.step_options())

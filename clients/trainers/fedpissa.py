"""FedPissa's client: PiSSA-initialised LoRA; keeps A_k, takes B_agg, trains A and B.

docs/algorithms.md, "FedPissa". The overlay rule of :class:`~fedlora.clients.trainers.base.LocalTrainer`
(local state, then the download on top) already gives the method's client: the download carries
only B_agg (and the head), so A_k is never overwritten, and the kept state is the whole adapter.
What differs is the init: the model is built with ``strategy.init`` (PiSSA by default), whose
exact SVD makes the frozen residual W0 - s B A identical on every client and on the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlora.clients.trainers.base import LocalTrainer
from fedlora.models import build_model

if TYPE_CHECKING:
    from peft import PeftModel


class FedPissaTrainer(LocalTrainer):
    """Train A_k and B_k from (A_k kept locally, B_agg received); upload A_k, B_k and the head."""


    def build(self) -> PeftModel:
        init = self.options.init
        return build_model(
            self.config.model,
            len(self.job.federated.label_names),
            self.model_rank(),
            seed=self.config.train.seed,
            init=init,
            device=self.config.train.device,
        )

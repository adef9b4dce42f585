"""Client of the heterogeneous-rank methods whose clients train a plain LoRA at their own rank.

FlexLoRA and HetLoRA need nothing beyond the default client: the model is built at the client's
own rank (its profile), the download (already cut to that rank by the server) overlays the local
state, A, B and the head are trained and uploaded.
"""

from __future__ import annotations

from typing import ClassVar

from clients.trainers.base import LocalTrainer


class HeteroRankTrainer(LocalTrainer):
    """FlexLoRA's and HetLoRA's client: the default trainer at the client's own rank r_k."""

    strategy_names: ClassVar[tuple[str, ...]] = ("flexlora", "hetlora")

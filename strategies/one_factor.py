"""What FedSA-LoRA and FFA-LoRA share: the federation learns one LoRA factor and the head.

FedSA-LoRA averages A (each B stays on its client), FFA-LoRA averages B (A is the seeded rank-nested
constant every party draws). Both take ``strategy.mixed_ranks``, whose 'refuse' stops at setup when
the clients declare different ranks, read one factor of every upload, and let Flower's client-side DP
wrap them with one rank only (with mixed ranks an upload does not enter the mean with its own weight).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np

from fedlora.lora import split_payload
from fedlora.methods import OptionsT
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.roster import MixedRanksError


class OneFactorStrategy(LoRAStrategy[OptionsT]):
    """Base of :class:`~fedlora.strategies.fedsa_lora.FedSALoRA` and
    :class:`~fedlora.strategies.ffa_lora.FFALoRA`; each keeps its own state, setup and arithmetic."""

    # how a mixed-rank client's upload enters the aggregate, which Flower's DP noise does not assume
    MIXED_RANKS_DP: ClassVar[str] = ""

    def declared_ranks(self, refuse: bool, otherwise: str) -> list[int]:
        """The clients' ranks, ascending, each once; :class:`MixedRanksError` when they differ and
        ``refuse`` (``strategy.mixed_ranks = 'refuse'``; ``otherwise`` names the value that takes them)."""
        ranks = sorted({p.rank for p in self.roster.profiles.values()})
        if len(ranks) > 1 and refuse:
            raise MixedRanksError(
                f"{self.method.name} with strategy.mixed_ranks='refuse' needs one rank for every client, "
                f"got ranks {ranks}; set strategy.mixed_ranks='{otherwise}'"
            )
        return ranks

    @staticmethod
    def uploaded(uploads: list[ClientUpload], factor: Literal["A", "B"]) -> list[dict[str, np.ndarray]]:
        """Every upload's ``factor`` per module, in the uploads' order."""
        return [{m: getattr(f, factor) for m, f in split_payload(u.payload)[0].items()} for u in uploads]

    def flower_dp_problem(self) -> str:
        ranks = sorted({self.rank_of(p) for p in self.roster.partitions})
        if len(ranks) > 1:
            return f"clients train ranks {ranks}: {self.MIXED_RANKS_DP}; give every client one rank"
        return super().flower_dp_problem()

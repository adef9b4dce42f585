"""The privacy ledger: each client's DP epsilon as its training replies report it (``protocol.DP_EPSILON``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedlora import state
from fedlora.results import RoundRecord
from fedlora.schema import PrivacyConfig

NOISE_SEED_SECRET = "fresh operating-system entropy on each client, every round; never sent or stored"
NOISE_SEED_REPRODUCIBLE = ("train.seed, round and partition (privacy.reproducible_noise): NO privacy against the "
                           "server, which can regenerate the noise")


@state.register
@dataclass
class PrivacyLedger:
    """Partition id -> the epsilon its accountant reported last (it spent it even if its update
    was then rejected). Part of the strategy's checkpointed state."""

    epsilon: dict[int, float] = field(default_factory=dict)

    def note(self, spent: Mapping[int, float], record: RoundRecord) -> None:
        """Remember the epsilon each client reported this round (partition -> epsilon; the partition
        is the sender's, checked by the server, never what a reply claims)."""
        if spent:
            self.epsilon.update(spent)
            record.extra["dp_epsilon"] = {str(k): v for k, v in sorted(spent.items())}

    def report(self, privacy: PrivacyConfig) -> dict[str, Any] | None:
        """``{"epsilon": max over clients, "delta", "per_client", ...}`` when privacy.dp is on."""
        if not privacy.dp:
            return None
        return {"epsilon": max(self.epsilon.values(), default=0.0), "delta": privacy.delta,
                "per_client": {str(k): v for k, v in sorted(self.epsilon.items())},
                "noise_multiplier": privacy.noise_multiplier, "target_epsilon": privacy.target_epsilon,
                "max_grad_norm": privacy.max_grad_norm, "reproducible_noise": privacy.reproducible_noise,
                "noise_seed": NOISE_SEED_REPRODUCIBLE if privacy.reproducible_noise else NOISE_SEED_SECRET}

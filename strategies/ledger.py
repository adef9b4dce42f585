"""The privacy ledger: each client's DP epsilon as its training replies report it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message

from fedlora.results import RoundRecord
from fedlora.schema import PrivacyConfig

EPSILON_KEY = "dp-epsilon"  # train metric: the client's epsilon over all its rounds so far


class PrivacyLedger:
    """Partition id -> the epsilon its accountant reported last (it spent it even if its update
    was then rejected)."""

    def __init__(self, privacy: PrivacyConfig) -> None:
        self.privacy = privacy
        self.epsilon: dict[int, float] = {}

    def note(self, replies: Iterable[Message], record: RoundRecord) -> None:
        spent = {}
        for msg in replies:
            if msg.has_error() or "metrics" not in msg.content:
                continue
            metrics = msg.content["metrics"]
            if EPSILON_KEY in metrics and "partition-id" in metrics:
                spent[int(metrics["partition-id"])] = float(metrics[EPSILON_KEY])
        if spent:
            self.epsilon.update(spent)
            record.extra["dp_epsilon"] = {str(k): v for k, v in sorted(spent.items())}

    def report(self) -> dict[str, Any] | None:
        """``{"epsilon": max over clients, "delta", "per_client", ...}`` when privacy.dp is on."""
        if not self.privacy.dp:
            return None
        return {"epsilon": max(self.epsilon.values(), default=0.0), "delta": self.privacy.delta,
                "per_client": {str(k): v for k, v in sorted(self.epsilon.items())},
                "noise_multiplier": self.privacy.noise_multiplier, "target_epsilon": self.privacy.target_epsilon,
                "max_grad_norm": self.privacy.max_grad_norm}

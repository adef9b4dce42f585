"""Wire format of FLoRA's stacked factors, shared by the server (strategies/flora.py) and the
client (clients/trainers/flora.py).

A round's stack is one unit-scale (A, B) pair per module (B A is the update itself); in a
download it travels under the keys ``stack::<round>::<module>::A`` and ``...::B``, next to the
head arrays.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedlora.lora import Factors, Payload, join_payload, split_payload

STACK_PREFIX = "stack::"


def stack_payload(server_round: int, stack: Mapping[str, Factors]) -> Payload:
    """One round's stack as download arrays keyed ``stack::<round>::<module>::A|B``."""
    return join_payload({f"{STACK_PREFIX}{server_round}::{m}": f for m, f in stack.items()})


def read_stacks(payload: Mapping[str, np.ndarray]) -> dict[int, dict[str, Factors]]:
    """Inverse of :func:`stack_payload` over a whole download: round -> module -> stack."""
    rounds: dict[int, Payload] = {}
    for key, value in payload.items():
        if key.startswith(STACK_PREFIX):
            server_round, rest = key.removeprefix(STACK_PREFIX).split("::", 1)
            rounds.setdefault(int(server_round), {})[rest] = value
    return {t: split_payload(p)[0] for t, p in sorted(rounds.items())}

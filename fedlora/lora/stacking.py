"""FLoRA's stacking: a weighted sum of LoRA products held exactly as one taller LoRA.

A round's stack is one unit-scale (A, B) pair per module (B A is the update itself); in a
download it travels under the keys ``stack::<round>::<module>::A`` and ``...::B``, next to the
head arrays. FlexLoRA keeps its global model the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedlora.lora.factors import Factors, Payload, Weights, join_payload, split_payload
from fedlora.lora.svd import factor_svd

STACK_PREFIX = "stack::"


def stack(clients: Sequence[Mapping[str, Factors]], weights: Weights, scales: Sequence[float]) -> dict[str, Factors]:
    """Per module A = [p_1 s_1 A_1; ...; p_K s_K A_K], B = [B_1 ... B_K], so that
    B A = sum_k p_k s_k B_k A_k exactly (the scales folded into A: the stack has unit scale)."""
    out: dict[str, Factors] = {}
    for module in clients[0]:
        A = np.concatenate([p * s * c[module].A for c, p, s in zip(clients, weights, scales)], axis=0)  # (R, d_in)
        B = np.concatenate([c[module].B for c in clients], axis=1)  # (d_out, R)
        out[module] = Factors(A.astype(np.float32), B.astype(np.float32))
    return out


def concat_stacks(stacks: Sequence[Mapping[str, Factors]]) -> dict[str, Factors]:
    """Stacks of several rounds as one unit-scale stack per module: B A = sum of their products.
    When the total rank reaches min(d_out, d_in) the stack is compressed to that rank with the
    exact SVD (B = U S, A = V^T), which leaves B A unchanged.
    """
    out: dict[str, Factors] = {}
    for module in stacks[0]:
        A = np.concatenate([s[module].A for s in stacks], axis=0)  # (R_total, d_in)
        B = np.concatenate([s[module].B for s in stacks], axis=1)  # (d_out, R_total)
        if A.shape[0] >= min(B.shape[0], A.shape[1]):
            svd = factor_svd([B], [A], [1.0])
            A, B = svd.Vt, svd.U * svd.S
        out[module] = Factors(A.astype(np.float32), B.astype(np.float32))
    return out


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

"""Simulated client failures and malformed updates (``[faults]``), to exercise the server.

Draws are deterministic per (faults.seed, round, partition), so a run with failures is
reproducible and the same clients fail again when a run is repeated.
"""

from __future__ import annotations

import numpy as np

from fedlora.config import FaultsConfig
from fedlora.lora import A_SUFFIX, Payload


class SimulatedClientFailure(RuntimeError):
    """Raised inside the ClientApp to play a crashed silo."""


def _rng(faults: FaultsConfig, server_round: int, partition_id: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([faults.seed, server_round, partition_id, salt])


def maybe_fail(faults: FaultsConfig, server_round: int, partition_id: int) -> None:
    """Raise with probability ``faults.drop_rate``."""
    if faults.drop_rate and _rng(faults, server_round, partition_id, 1).random() < faults.drop_rate:
        raise SimulatedClientFailure(
            f"client {partition_id} failed round {server_round} (simulated: faults.drop_rate={faults.drop_rate})"
        )


def maybe_corrupt(faults: FaultsConfig, server_round: int, partition_id: int, upload: Payload) -> tuple[Payload, str]:
    """With probability ``faults.corrupt_rate`` return a malformed copy of ``upload`` and its kind."""
    rng = _rng(faults, server_round, partition_id, 2)
    if not faults.corrupt_rate or not upload or rng.random() >= faults.corrupt_rate:
        return upload, ""
    kind = str(rng.choice(faults.corrupt_kinds))
    return corrupt(upload, kind), kind


def corrupt(upload: Payload, kind: str) -> Payload:
    """A malformed copy of ``upload`` of the given kind."""
    bad = {k: v.copy() for k, v in upload.items()}
    key = min(bad)
    if kind == "nan":
        bad[key].flat[0] = np.nan
    elif kind == "inf":
        bad[key].flat[0] = np.inf
    elif kind == "shape":
        bad[key] = bad[key].ravel()[:-1] if bad[key].size > 1 else np.zeros(2, bad[key].dtype)
    elif kind == "rank":
        a_keys = [k for k in bad if k.endswith(A_SUFFIX)] or [key]
        bad[a_keys[0]] = np.concatenate([bad[a_keys[0]], bad[a_keys[0]][:1]], axis=0)  # one more row
    elif kind == "keys":
        bad["unexpected::A"] = np.zeros((1, 1), np.float32)
    elif kind == "norm":
        bad = {k: v * 1e6 for k, v in bad.items()}
    else:
        raise ValueError(f"unknown corruption kind {kind!r}")
    return bad

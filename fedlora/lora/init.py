"""LoRA initialisations shared by the server and every client (one kaiming bound, here).

peft draws a module's A from a kaiming-uniform law, U(-1/sqrt(d_in), 1/sqrt(d_in)), out of
torch's global RNG: the same seed gives the same A on every machine *for the same rank*, but a
rank-2 and a rank-8 client get unrelated matrices. Methods that share a factor across clients
with different ranks (FFA-LoRA's frozen A, FedSA-LoRA's averaged A) need component j to mean the
same thing on every client. :func:`nested_A` draws A from the same law with a generator seeded by
(seed, module name), filled row by row, so the rank-r matrix is the first r rows of the rank-R
one for every r <= R, and no communication is needed to agree on it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import numpy as np

from fedlora.lora.factors import A_SUFFIX, Payload


def kaiming_bound(d_in: int) -> float:
    """1 / sqrt(d_in): the bound of peft's default A init (kaiming_uniform_ with a = sqrt(5))."""
    return 1.0 / math.sqrt(d_in)


def kaiming_rows(count: int, d_in: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` rows of peft's default A init, U(-bound, bound), from ``rng`` (count, d_in)."""
    bound = kaiming_bound(d_in)
    return rng.uniform(-bound, bound, size=(count, d_in)).astype(np.float32)


def nested_A(module: str, rank: int, d_in: int, seed: int) -> np.ndarray:
    """A (rank, d_in) ~ U(-1/sqrt(d_in), 1/sqrt(d_in)); nested: ``nested_A(m, r)`` are the first
    r rows of ``nested_A(m, R)`` for r <= R. Identical on every client and on the server."""
    generator = np.random.default_rng([seed, zlib.crc32(module.encode())])
    return kaiming_rows(rank, d_in, generator)  # (rank, d_in)


def nested_A_payload(module_shapes: Mapping[str, tuple[int, int]], rank: int, seed: int) -> Payload:
    """``<module>::A`` -> :func:`nested_A` for every module ((d_out, d_in) shapes)."""
    return {module + A_SUFFIX: nested_A(module, rank, d_in, seed) for module, (_, d_in) in module_shapes.items()}

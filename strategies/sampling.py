"""Who takes part in a round: the seeded client sample, and which rounds evaluate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedlora.schema import ExperimentConfig, sample_size


def seeded_sample(partitions: Sequence[int], rng: np.random.Generator, fraction: float, minimum: int) -> list[int]:
    """A sample of ``partitions`` drawn by ``rng`` (the strategy's, seeded by ``train.seed`` and
    checkpointed; Flower's ``sample_nodes`` uses the global RNG): ``fraction`` of them, at least
    ``minimum`` (:func:`fedlora.schema.sample_size`), in the partitions' order."""
    size = sample_size(len(partitions), fraction, minimum)
    chosen = rng.choice(len(partitions), size=size, replace=False)
    return [partitions[i] for i in sorted(chosen)]


def evaluation_round(experiment: ExperimentConfig, server_round: int) -> bool:
    """Whether the server evaluates in ``server_round``: every ``federation.evaluate_every`` rounds,
    and the last (a train message of such a round asks the client for its received-model metrics)."""
    every = experiment.federation.evaluate_every
    return server_round % every == 0 or server_round >= experiment.train.rounds

"""Server optimisers on a method's mean update: FedAvgM, FedAdam, FedYogi, with Flower's arithmetic.

``[server_optimizer]`` (``fedlora.schema.ServerOptimizerConfig``) turns the global arrays a method's
mean gives into a step of a server optimiser: with x the global arrays a round started from (what
every client downloads alike: the LoRA factors the method averages and the head) and y the method's
aggregate of the round, the pseudo-gradient is y - x and

- ``fedavgm`` (Hsu et al., 2019; Flower's ``FedAvgM``): g = x - y; with momentum, v = g in the
  first round, then v = momentum v + g; x <- x - lr v (torch SGD's convention);
- ``fedadam`` (Reddi et al., ICLR 2021; Flower's ``FedAdam``): d = y - x; m = beta_1 m + (1 - beta_1) d;
  v = beta_2 v + (1 - beta_2) d^2; x <- x + eta_t m / (sqrt(v) + tau), eta_t = lr sqrt(1 - beta_2^(t+1))
  / (1 - beta_1^(t+1)), t the server round (Flower's bias correction, its exponent included);
- ``fedyogi`` (Reddi et al.; Flower's ``FedYogi``): m as FedAdam's; v = v - (1 - beta_2) d^2
  sign(v - d^2); x <- x + lr m / (sqrt(v) + tau).

m and v start at zero. Why not Flower's classes themselves: they are whole strategies, whose
``aggregate_train`` runs their own FedAvg over the reply Messages (every array of the record,
weighted by ``num-examples``, a log line per round) and whose FedOpt takes x from ``configure_train``.
A LoRA method's mean is its own (A and B averaged separately and zero-padded to the largest rank,
weights capped by ``faults.max_client_share``, a robust rule, the SecAgg+ sum), so only the
arithmetic after the mean applies, and it is here, expression for expression as Flower 1.39 writes
it, float32 moments included; tests/test_server_optimizer.py runs Flower's strategies on the same
arrays and compares. Where Flower's default would turn a server optimiser off (FedAvgM's momentum
0), fedlora's default is on (``server_optimizer.momentum = 0.9``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedlora.lora import Payload
from fedlora.schema import ServerOptimizerConfig

Moments = dict[str, dict[str, np.ndarray]]  # "momentum" (fedavgm), "m" and "v" (fedadam, fedyogi) -> key -> array


def server_step(config: ServerOptimizerConfig, server_round: int, current: Mapping[str, np.ndarray],
                aggregated: Mapping[str, np.ndarray], moments: Moments) -> tuple[Payload, Moments]:
    """The new global arrays after the optimiser's step from ``current`` (x) towards ``aggregated``
    (the method's mean, y), and the optimiser's new moments (``moments`` is not changed). Each array
    keeps ``current``'s dtype. ValueError when the two hold other keys or shapes."""
    if current.keys() != aggregated.keys() or any(current[k].shape != aggregated[k].shape for k in current):
        raise ValueError("the server optimiser needs the aggregate to have the keys and shapes of the global arrays")
    step = {"fedavgm": fedavgm, "fedadam": fedadam, "fedyogi": fedyogi}.get(config.name)
    if step is None:
        return dict(aggregated), moments
    new, moments = step(config, server_round, dict(current), dict(aggregated), moments)
    return {k: np.asarray(v, dtype=current[k].dtype) for k, v in new.items()}, moments


def fedavgm(config: ServerOptimizerConfig, server_round: int, current: Payload, aggregated: Payload,
            moments: Moments) -> tuple[Payload, Moments]:
    """Flower's ``FedAvgM.aggregate_train`` after its FedAvg (server SGD with momentum)."""
    lr, momentum = config.resolved_lr(), config.momentum
    if momentum == 0.0 and lr == 1.0:  # Flower's server_opt = False: the mean as it is
        return aggregated, moments
    pseudo_gradient = {k: current[k] - aggregated[k] for k in current}  # updates are the opposite of gradients
    if momentum > 0.0:
        previous = moments.get("momentum")
        if not previous:
            velocity = pseudo_gradient
        else:
            velocity = {k: momentum * previous[k] + pseudo_gradient[k] for k in current}
        moments = {**moments, "momentum": velocity}
        pseudo_gradient = velocity
    return {k: current[k] - lr * pseudo_gradient[k] for k in current}, moments


def _first_moment(config: ServerOptimizerConfig, current: Payload, aggregated: Payload,
                  moments: Moments) -> tuple[Payload, Payload]:
    """Flower's ``FedOpt._compute_deltat_and_mt``: (delta_t, m_t)."""
    delta = {k: aggregated[k] - current[k] for k in current}
    m = moments.get("m") or {k: np.zeros_like(v) for k, v in aggregated.items()}
    return delta, {k: config.beta_1 * m[k] + (1 - config.beta_1) * delta[k] for k in current}


def fedadam(config: ServerOptimizerConfig, server_round: int, current: Payload, aggregated: Payload,
            moments: Moments) -> tuple[Payload, Moments]:
    """Flower's ``FedAdam.aggregate_train`` after its FedAvg."""
    delta, m = _first_moment(config, current, aggregated, moments)
    v = moments.get("v") or {k: np.zeros_like(x) for k, x in aggregated.items()}
    v = {k: config.beta_2 * v[k] + (1 - config.beta_2) * (delta[k] ** 2) for k in current}
    eta_norm = (config.resolved_lr() * np.sqrt(1 - np.power(config.beta_2, server_round + 1.0))
                / (1 - np.power(config.beta_1, server_round + 1.0)))
    new = {k: x + eta_norm * m[k] / (np.sqrt(v[k]) + config.tau) for k, x in current.items()}
    return new, {**moments, "m": m, "v": v}


def fedyogi(config: ServerOptimizerConfig, server_round: int, current: Payload, aggregated: Payload,
            moments: Moments) -> tuple[Payload, Moments]:
    """Flower's ``FedYogi.aggregate_train`` after its FedAvg."""
    delta, m = _first_moment(config, current, aggregated, moments)
    v = moments.get("v") or {k: np.zeros_like(x) for k, x in aggregated.items()}
    v = {k: v[k] - (1.0 - config.beta_2) * (delta[k] ** 2) * np.sign(v[k] - delta[k] ** 2) for k in current}
    new = {k: x + config.resolved_lr() * m[k] / (np.sqrt(v[k]) + config.tau) for k, x in current.items()}
    return new, {**moments, "m": m, "v": v}

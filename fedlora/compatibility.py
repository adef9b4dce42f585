"""What a method can take of the rest of the config: its capabilities, and the config checks they drive.

A method declares its :class:`Capabilities` (``fedlora/methods/<name>.py``); the platform's features
that only some methods can carry (DP-SGD, causal LMs, robust aggregation, SecAgg+, server optimisers,
FedProx, mixed ranks) are refused here, in one line each, for a method that cannot take them, naming
the methods that can. The rules read the experiment's sections (:mod:`fedlora.schema`) and the
method's capabilities, never the registry: :func:`check` is handed the capabilities of every known
method (the "use one of ..." lists), so this module sits beside the schema, below ``fedlora.methods``.
:func:`fedlora.config.build_config` runs it after the schema and the method's options have been read,
before the method's own ``check``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fedlora.errors import ConfigError
from fedlora.schema import ExperimentConfig, minimum_uploads, sample_size

Catalogue = Mapping[str, "Capabilities"]  # method name -> its capabilities, every known method


@dataclass(frozen=True)
class Capabilities:
    """What a method declares about itself (rendered into the README's capability matrix)."""

    personalized: bool
    uploads: str
    downloads: str
    mixed_ranks: bool = False  # clients may declare different ranks (False: one rank, clients.mixed_rank_policy)
    partial_participation: bool = True
    dp_compatible: bool = True  # its client step runs under Opacus DP-SGD
    paper: str = ""
    causal_lm: str = ""  # why the method refuses model.kind = 'causal_lm' ('' = it runs on causal LMs)
    # faults.aggregation = median / trimmed_mean / bulyan replaces the method's weighted means of uploaded
    # arrays coordinate by coordinate, krum / multikrum / bulyan select whole uploads first
    # (strategies/robust.py; a linear method only); False: the method refuses them, saying why
    robust_aggregation: bool = False
    not_robust: str = ""  # why a method refuses faults.aggregation other than 'mean' (robust_aggregation False)
    # Flower's DifferentialPrivacyClientSideFixedClipping can wrap the strategy (with fixedclipping_mod on
    # the clients): its aggregate is a fixed-weight mean of the uploads, each upload is the download
    # plus the client's update, and it continues from the noised arrays it is given (docs/flower.md)
    flower_dp: bool = False
    not_flower_dp: str = ""  # why the wrapper cannot wrap the method (flower_dp False)
    # secure_aggregation.enabled (SecAgg+, docs/secure-aggregation.md): the method's aggregate is the weighted
    # mean of the uploads, A rows and B columns zero-padded to the round's largest rank, and each upload has the
    # keys and shapes of its download (a client masks upload - download; the server sees only the mean)
    secure_aggregation: bool = False
    not_secure: str = ""  # why the method refuses secure aggregation (secure_aggregation False)
    secure_one_rank: str = ""  # why it refuses secure aggregation with mixed ranks ('' = mixed ranks are fine)
    # [server_optimizer] (FedAvgM, FedAdam, FedYogi: strategies/server_optimizer.py) steps on the method's mean: its
    # aggregate is a mean of the uploads, its global arrays are what every client downloads alike (cut to its rank),
    # and ``load_arrays`` continues from other arrays of their keys and shapes
    server_optimizer: bool = False
    not_server_optimizer: str = ""  # why the method refuses a server optimiser (server_optimizer False)
    # train.proximal_mu (FedProx's client term): the client starts its local training from what it downloaded and
    # trains through fedlora.training.train / optimise with the trainer's step_options()
    proximal: bool = False
    not_proximal: str = ""  # why the method refuses FedProx's term (proximal False)


def check(config: ExperimentConfig, name: str, caps: Capabilities, catalogue: Catalogue) -> None:
    """ConfigError for the first platform feature ``config`` asks of the method ``name`` that its
    capabilities ``caps`` refuse (``catalogue``: every known method's, for the list of those that can)."""
    for rule in (_check_rank_policy, _check_privacy, _check_causal_lm, _check_robust_aggregation,
                 _check_secure_aggregation, _check_fl_optimisers):
        rule(name, caps, config, catalogue)


def _usable(catalogue: Catalogue, can: Callable[[Capabilities], bool]) -> str:
    """The methods whose capabilities pass ``can``, by name, comma-separated."""
    return ", ".join(name for name in sorted(catalogue) if can(catalogue[name]))


def _check_privacy(name: str, caps: Capabilities, config: ExperimentConfig, catalogue: Catalogue) -> None:
    """``privacy.dp`` with a method whose client step Opacus cannot make private."""
    if config.privacy.dp and not caps.dp_compatible:
        usable = _usable(catalogue, lambda c: c.dp_compatible)
        raise ConfigError(f"privacy.dp = true is not supported by strategy '{name}' (its client step is "
                          f"not DP-SGD compatible); use one of {usable}, or set privacy.dp = false")


def _check_causal_lm(name: str, caps: Capabilities, config: ExperimentConfig, catalogue: Catalogue) -> None:
    """``model.kind = 'causal_lm'`` with a method that has no meaning for generation."""
    if config.model.kind == "causal_lm" and caps.causal_lm:
        raise ConfigError(f"strategy '{name}' does not run with model.kind = 'causal_lm': "
                          f"{caps.causal_lm}; use another strategy or model.kind = 'classification'")


def _check_robust_aggregation(name: str, caps: Capabilities, config: ExperimentConfig, catalogue: Catalogue) -> None:
    """``faults.aggregation`` other than 'mean' with a method whose aggregate is not a mean of arrays;
    a Byzantine-robust selection whose rounds sample fewer uploads than its guarantee needs."""
    faults = config.faults
    if faults.aggregation == "mean":
        return
    if caps.robust_aggregation:
        clients = config.data.num_clients
        sampled = sample_size(clients, config.federation.fraction_train, config.federation.min_clients)
        needed = minimum_uploads(faults.aggregation, faults.num_malicious)
        if sampled < needed:
            raise ConfigError(f"faults.aggregation = '{faults.aggregation}' with faults.num_malicious = "
                              f"{faults.num_malicious} needs {needed} uploads a round, but a round samples "
                              f"{sampled} of data.num_clients = {clients}; sample more clients, lower "
                              "faults.num_malicious, or use 'median' / 'trimmed_mean'")
        return
    usable = _usable(catalogue, lambda c: c.robust_aggregation)
    raise ConfigError(f"faults.aggregation = '{config.faults.aggregation}' is not supported by strategy "
                      f"'{name}': {caps.not_robust}; use one of {usable}, or "
                      "faults.aggregation = 'mean'")


def _check_secure_aggregation(name: str, caps: Capabilities, config: ExperimentConfig, catalogue: Catalogue) -> None:
    """``secure_aggregation.enabled`` with a method or a config SecAgg+ cannot aggregate: a method
    whose aggregate is not a weighted mean of the uploads, a robust ``faults.aggregation`` or the
    anomaly rule's rejection (they need each upload), mixed ranks where the method's mean is not over
    zero-padded uploads, fewer than 2 sampled clients, parameters Flower refuses, a threshold at most
    half of the shares (unless allowed), a sum that could wrap, an error bound above ``max_error``."""
    secure = config.secure_aggregation
    if not secure.enabled:
        return
    from fedlora import secagg  # cryptography: loaded only for a secure run

    if not caps.secure_aggregation:
        usable = _usable(catalogue, lambda c: c.secure_aggregation)
        raise ConfigError(f"secure_aggregation.enabled = true is not supported by strategy '{name}': "
                          f"{caps.not_secure}; use one of {usable}, or secure_aggregation.enabled = false")
    if config.faults.aggregation != "mean":
        raise ConfigError(f"secure_aggregation.enabled = true needs faults.aggregation = 'mean' (the server sees only "
                          f"the masked sum, not the uploads '{config.faults.aggregation}' combines)")
    if config.faults.anomaly_action == "reject":
        raise ConfigError("secure_aggregation.enabled = true cannot run with faults.anomaly_action = 'reject': the "
                          "anomaly rule needs each update, the server sees only the masked sum (its secure "
                          "counterpart: secure_aggregation.clip_norm bounds every update)")
    ranks = set(config.clients.ranks) or {int(r) for r, share in config.clients.rank_tiers.items() if share > 0}
    if caps.secure_one_rank and len(ranks) > 1 and caps.mixed_ranks:
        raise ConfigError(f"secure_aggregation.enabled = true with strategy '{name}' needs one LoRA rank, "
                          f"but clients declare ranks {sorted(ranks)}: {caps.secure_one_rank}; give every client one rank")
    clients = config.data.num_clients
    sampled = sample_size(clients, config.federation.fraction_train, config.federation.min_clients)
    if sampled < 2:
        raise ConfigError(f"secure_aggregation.enabled = true needs at least 2 clients a round, but a round samples "
                          f"{sampled} of data.num_clients = {clients}")
    quantization = secure.quantization_range or secagg.quantization_range(sampled, secure.modulus_range)
    problem = (secagg.flower_problem(secure.num_shares, secure.reconstruction_threshold, quantization,
                                     secure.modulus_range)
               or secagg.wrap_problem(sampled, quantization, secure.modulus_range))
    if problem:
        raise ConfigError(f"secure_aggregation: {problem}")
    shares = secagg.resolve_shares(secure.num_shares, sampled)
    threshold = secagg.resolve_threshold(secure.reconstruction_threshold, shares)
    if threshold > shares:
        raise ConfigError(f"secure_aggregation.reconstruction_threshold = {threshold} is above the {shares} shares "
                          f"a round of {sampled} clients makes (num_shares = {secure.num_shares!r}): no secret could "
                          "be reconstructed")
    problem = secagg.threshold_problem(threshold, shares, secure.allow_low_threshold)
    if problem:
        raise ConfigError(f"secure_aggregation: {problem} (a round of {sampled} clients, num_shares = "
                          f"{secure.num_shares!r}, reconstruction_threshold = {secure.reconstruction_threshold!r})")
    clip = secagg.clip_bound(secure.clip_norm, config.faults.max_update_norm)  # C: what every client clips to
    if secure.clipping_range and secure.clipping_range < clip:
        raise ConfigError(f"secure_aggregation.clipping_range = {secure.clipping_range:g} is below the clipping norm "
                          f"{clip:g} (clip_norm, else faults.max_update_norm): a clipped update could still hold an "
                          "entry beyond it")
    bound = secagg.error_bound(secagg.clipping_range(clip, secure.clipping_range), sampled, quantization, 1.0)
    if secure.max_error and bound > secure.max_error:
        raise ConfigError(f"secure_aggregation: the worst-case error bound 3 c N / T = {bound:.3g} (c = "
                          f"{secagg.clipping_range(clip, secure.clipping_range):g}, N = {sampled}, T = "
                          f"{secagg.power(quantization)}) is above max_error = {secure.max_error:g}; lower "
                          "clipping_range or raise quantization_range")


def _check_fl_optimisers(name: str, caps: Capabilities, config: ExperimentConfig, catalogue: Catalogue) -> None:
    """``[server_optimizer]`` or ``train.proximal_mu`` with a method that cannot take it (its
    capabilities say why)."""
    optimizer = config.server_optimizer.name
    if optimizer != "none" and not caps.server_optimizer:
        usable = _usable(catalogue, lambda c: c.server_optimizer)
        raise ConfigError(f"server_optimizer.name = '{optimizer}' is not supported by strategy '{name}': "
                          f"{caps.not_server_optimizer}; use one of {usable}, or server_optimizer.name = 'none'")
    if config.train.proximal_mu and not caps.proximal:
        usable = _usable(catalogue, lambda c: c.proximal)
        raise ConfigError(f"train.proximal_mu = {config.train.proximal_mu:g} (FedProx) is not supported by strategy "
                          f"'{name}': {caps.not_proximal}; use one of {usable}, or train.proximal_mu = 0")


def _check_rank_policy(name: str, caps: Capabilities, config: ExperimentConfig, catalogue: Catalogue) -> None:
    """A same-rank method with ``clients.mixed_rank_policy = refuse`` and mixed configured ranks."""
    ranks = set(config.clients.ranks) or {int(r) for r, share in config.clients.rank_tiers.items() if share > 0}
    if caps.mixed_ranks or config.clients.mixed_rank_policy != "refuse" or len(ranks) < 2:
        return
    usable = _usable(catalogue, lambda c: c.mixed_ranks)
    raise ConfigError(
        f"strategy '{name}' needs one LoRA rank for every client but clients declare ranks "
        f"{sorted(ranks)}; use one of {usable}, or set clients.mixed_rank_policy=smallest"
    )

"""Per-client differential privacy: DP-SGD with Opacus on the trainable (LoRA + head) parameters.

One client's local training is made private with Opacus (Poisson-sampled batches, per-example
gradient clipping at ``privacy.max_grad_norm``, Gaussian noise ``noise_multiplier x
max_grad_norm``). The RDP accountant composes *every* round the client trained in: its history
``[(noise_multiplier, sample_rate, steps), ...]`` travels in the client's ``context.state``
(and its checkpoint), so the epsilon it reports is the client's epsilon over the whole run so far.

With ``privacy.target_epsilon`` the noise multiplier is chosen once for the most steps a client
can take in the run (``train.rounds`` rounds of its per-round steps, as if sampled every round),
so the reported epsilon stays <= the target whatever the sampling.

Noise the server cannot replay: by default the Gaussian noise and the Poisson sampling draw from
torch generators seeded with fresh operating-system entropy (``secrets``) in every call; the seed
never leaves this function. ``privacy.reproducible_noise`` (research runs only) seeds them from
the caller's ``seed`` instead, which the server can derive. Opacus' ``secure_mode`` (a CSPRNG,
torchcsprng) has no build for this torch, so the generator itself is torch's default one.

Notes (docs/design.md, Opacus): the model is moved to its device and put in ``train()`` mode before it is
wrapped; the adapter is read from the unwrapped peft model afterwards; DoRA is not supported by
Opacus; gradient hooks that edit ``p.grad`` after backward (FedHera's prefix gating) would be
ignored by the DP optimiser, which steps on per-example gradients, so such methods declare
``dp_compatible = False`` and are refused at config time.
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedlora.schema import PrivacyConfig
from fedlora.training import StepOptions, TrainStats, cross_entropy_loss, optimise

History = list[tuple[float, float, int]]  # (noise multiplier, sample rate, steps), RDPAccountant.history


@dataclass
class PrivateTrainStats:
    """A private training call: the usual stats plus the client's privacy spent so far."""

    stats: TrainStats
    epsilon: float
    noise_multiplier: float
    sample_rate: float
    history: History = field(default_factory=list)


def epsilon_of(history: History, delta: float) -> float:
    """Epsilon of a client's whole accountant history (RDP accountant); 0 with no steps."""
    from opacus.accountants import RDPAccountant

    if not history:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = [tuple(h) for h in history]
    return float(accountant.get_epsilon(delta=delta))


def noise_for_target(privacy: PrivacyConfig, sample_rate: float, total_steps: int) -> float:
    """The noise multiplier with which ``total_steps`` steps at ``sample_rate`` stay within
    ``privacy.target_epsilon`` (or the configured ``noise_multiplier``)."""
    if privacy.target_epsilon is None:
        return float(privacy.noise_multiplier or 0.0)
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=privacy.target_epsilon, target_delta=privacy.delta,
                                      sample_rate=sample_rate, steps=max(1, total_steps), accountant="rdp"))


def private_train(
    model: Any,
    loader: Any,
    *,
    privacy: PrivacyConfig,
    epochs: int,
    lr: float,
    device: Any,
    rounds: int,
    history: History,
    seed: int | None = None,
    max_steps: int = 0,
    weight_decay: float = 0.0,
    loss_fn: Callable[[Any, dict[str, Any]], Any] = cross_entropy_loss,
    options: StepOptions | None = None,
) -> PrivateTrainStats:
    """DP-SGD (AdamW steps on the privatised gradient) over the trainable parameters of ``model``;
    ``history`` is the client's accountant history before this call (returned extended).

    ``seed``: None (the default, and what ``privacy.reproducible_noise = false`` passes) draws the
    noise and sampling seeds from the operating system's entropy; an int makes them reproducible
    (and known to whoever knows the int). ``options``: the step loop's knobs that DP-SGD takes (a
    schedule, FedProx's term: :func:`fedlora.training.optimise`); accumulation and batch clipping
    are refused with privacy.dp when the config is read."""
    import torch
    from opacus import PrivacyEngine
    from opacus.data_loader import DPDataLoader

    if options is not None and (options.accumulation > 1 or options.max_grad_norm or options.gradient_checkpointing):
        raise ValueError("DP-SGD takes no gradient accumulation, batch clipping or gradient checkpointing "
                         "(Opacus samples, clips and differentiates per example)")

    sampling_seed, noise_seed = (secrets.randbits(63), secrets.randbits(63)) if seed is None else (seed, seed + 1)
    model.to(device).train()  # before wrapping (docs/design.md, Opacus notes)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    poisson = DPDataLoader.from_data_loader(loader, generator=torch.Generator().manual_seed(sampling_seed))
    sample_rate = 1.0 / len(poisson)
    per_round = epochs * len(poisson)
    if max_steps:
        per_round = min(per_round, max_steps)
    sigma = noise_for_target(privacy, sample_rate, rounds * per_round)
    with warnings.catch_warnings():
        # Opacus warns, when the engine is built, that its secure mode (a CSPRNG) is off: documented
        # above; the generator's seed is OS entropy unless privacy.reproducible_noise asks otherwise
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        # the frozen backbone's embeddings receive no gradient; Opacus notices it on every step
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        engine = PrivacyEngine(accountant="rdp")
        engine.accountant.history = [tuple(h) for h in history]
        private_model, optimizer, poisson = engine.make_private(
            module=model, optimizer=optimizer, data_loader=poisson, noise_multiplier=sigma,
            max_grad_norm=privacy.max_grad_norm, poisson_sampling=False,  # already Poisson, seeded above
            noise_generator=torch.Generator(device=device).manual_seed(noise_seed),
        )
        try:
            stats = optimise(private_model, poisson, optimizer, epochs, max_steps, loss_fn, options=options)
        finally:
            private_model._close()  # remove Opacus' hooks and per-example grads: the peft model is plain again
    new_history: History = [tuple(h) for h in engine.accountant.history]
    return PrivateTrainStats(stats, epsilon_of(new_history, privacy.delta), sigma, sample_rate, new_history)

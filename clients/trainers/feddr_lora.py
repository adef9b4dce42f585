"""FedDR-LoRA's client: a robust and a noise branch over one local A, a loss-based clean posterior
weighting the robust branch, negative learning in the noise branch.

The method's home is ``fedlora/methods/feddr_lora.py`` (its [RECON] choices are the options of
:class:`~fedlora.methods.feddr_lora.FedDRLoRAOptions`; the clean / suspect split is its
:func:`~fedlora.methods.feddr_lora.gmm_clean_posterior`). Per adapted module the client holds

- ``A`` (r, d_in): local, never uploaded, shared by both branches (``topology = shared_a``);
- ``B^r`` (d_out, r): the robust up-projection, overwritten by the global B every round and
  uploaded after training; it is peft's ordinary ``lora_B``, so the peft model *is* the robust
  branch f_r = W0 x + s B^r A x and inference / evaluation use it alone;
- ``B^n`` (d_out, r): the noise up-projection (zero at the start), local, never uploaded. The noise
  branch f_n = W0 x + s B^n A x is the same peft model called with B^n in place of B^r
  (``torch.func.functional_call``), so the negative-learning loss reaches A and B^n (and the head
  only with ``noise_head = shared``) but never B^r. ``topology = two_lora`` also swaps in a separate local ``A^n``.

Local objective: ``warmup_rounds`` rounds of plain cross-entropy on f_r; afterwards a
2-component Gaussian mixture on the per-sample CE of f_r (one per given label, ``split_scope =
class``) gives every sample its clean posterior w_i (the low-loss component; ``split = epoch``:
fitted once per local epoch, in eval mode before the epoch's first step, on the samples that epoch
trains on; ``batch``: on each batch's training CE).
The loss is the robust term R + beta * mean NL(f_n on all samples, complementary labels y-bar != y),
NL(p, y) = -log(1 - p_y), with R = sum_batch w_i CE_i / (n_batch * mean_split w) by default
(``robust_loss = posterior``: noisy-looking samples pull f_r less, none is dropped), the plain mean
CE (``all``) or the mean CE over the clean samples (``clean``: posterior > ``clean_threshold``).
``nl_target = given`` puts NL on the suspects with their given labels instead. ``noise_branch =
false`` removes B^n and NL (the ablation): the loss is R alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora import protocol
from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import B_SUFFIX, HEAD_PREFIX, Payload, from_array_record, payload_key, to_array_record
from fedlora.methods.feddr_lora import (
    WEIGHT_FLOOR,
    robust_weights,
    split_counts,
    split_posterior,
    split_quality,
    weight_sums,
)
from fedlora.models import adapter_payload
from fedlora.training import TrainStats, model_inputs, predict_logits, train

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

Batch = dict[str, "torch.Tensor"]

NOISE_STATE_KEY = "fedlora.feddr_lora.noise"  # context.state entry holding B^n (and A^n)
NOISE_SUFFIX = "_noise"  # state keys <module>::B_noise (B^n), <module>::A_noise (A^n): the factor's payload key + it


# --------------------------------------------------------------------------------------------
# pure functions (tested with hand-made inputs)
# --------------------------------------------------------------------------------------------


def negative_learning_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample NL(p, y) = -log(1 - p_y), "the label is not y".

    Computed as logsumexp(z) - logsumexp(z without z_y), which equals -log(1 - softmax(z)_y)
    exactly and stays finite when p_y -> 1 (a clamp of 1 - p_y would flatten the gradient there).
    ``logits`` (n, C), ``target`` (n,) -> (n,).
    """
    import torch

    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # bf16 autocast on CUDA: the log-sum-exp needs float32
    others = logits.masked_fill(torch.nn.functional.one_hot(target, logits.shape[-1]).bool(), -math.inf)
    return torch.logsumexp(logits, dim=-1) - torch.logsumexp(others, dim=-1)


def robust_term(ce: torch.Tensor, weights: torch.Tensor, mode: str, split_mean: float = 1.0) -> torch.Tensor:
    """The robust branch's objective from per-sample CE (n,) and weights (n,) (``robust_weights``).

    ``posterior``: sum_i w_i CE_i / (n * split_mean), split_mean = the mean weight over the samples
    the split was fitted on (floored at WEIGHT_FLOOR, so all-zero weights give 0); ``clean``: the
    mean CE over the samples with weight 1 (0 with a gradient graph when there is none); ``all``:
    the mean CE.
    """
    if mode == "all":
        return ce.mean()
    if mode == "clean":
        clean = weights > 0
        return ce[clean].mean() if bool(clean.any()) else ce.sum() * 0.0
    return (weights * ce).sum() / (ce.shape[0] * max(split_mean, WEIGHT_FLOOR))


def noise_targets(
    labels: torch.Tensor, clean: torch.Tensor, nl_target: str, complementary: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, targets) of the noise branch's negative learning: every sample with its
    complementary label (``nl_target = complementary``), or the suspects with their given label."""
    import torch

    if nl_target == "complementary":
        return torch.ones_like(clean), complementary
    return ~clean, labels


def complementary_labels(labels: torch.Tensor, num_classes: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random label different from each given label (``nl_target = complementary``)."""
    import torch

    shift = torch.randint(1, num_classes, labels.shape, generator=generator)
    return (labels.cpu() + shift) % num_classes


class EpochSplitBatches:
    """A training loader whose every pass first draws that epoch's batches (at most the steps left
    of ``max_steps``; 0 = no cap), hands them to ``on_epoch`` (the per-epoch split) and then yields
    them. The loader is iterated once per pass, as the plain training loop does, so the batches and
    their order are the ones the loop would have trained on."""

    def __init__(self, loader: Any, max_steps: int, on_epoch: Callable[[list[Batch]], None]) -> None:
        self.loader, self.max_steps, self.on_epoch = loader, max_steps, on_epoch
        self.drawn = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        left = self.max_steps - self.drawn if self.max_steps else None
        batches = list(itertools.islice(self.loader, left))
        self.drawn += len(batches)
        if batches:
            self.on_epoch(batches)
        yield from batches


# --------------------------------------------------------------------------------------------
# the client
# --------------------------------------------------------------------------------------------


class FedDRLoRATrainer(LocalTrainer):
    """FedDR-LoRA's client: train A, B^r, B^n (and the head); upload B^r (and a global head)."""

    reuse_model = False  # not shown safe to reuse (it changes more than parameter values): built fresh


    def __init__(self, job: Any) -> None:
        import torch

        super().__init__(job)
        seed = self.config.train.seed + 1000 * job.server_round + job.profile.partition_id
        self.generator = torch.Generator().manual_seed(seed)  # complementary labels
        self.noise: dict[str, torch.nn.Parameter] = {}  # peft parameter name -> B^n / A^n
        # split = epoch: clean posterior of the current epoch's samples (nan elsewhere) and the mean
        # robust weight over them (the normaliser of robust_loss = posterior)
        self.posterior = np.full(len(job.data.train), np.nan)
        self.split_mean = 1.0
        self.counts: dict[str, float] = {}  # split counts summed over the round's splits
        self.weights: dict[str, float] = {}  # robust-CE weight sums per group over the trained samples
        self.splits = 0
        train_columns = job.data.train.column_names
        self.is_noisy = np.asarray(job.data.train["is_noisy"][:], dtype=bool) if "is_noisy" in train_columns else None

    # ------------------------------------------------------------------ model and state
    @property
    def warming_up(self) -> bool:
        return self.job.server_round <= self.options.warmup_rounds

    def prepare(self, download: Payload) -> PeftModel:
        """Local A (and B^r, head) overlaid with the global B; B^n (and A^n) from the state."""
        import torch

        model = super().prepare(download)
        if not self.options.noise_branch:
            return model
        stored = from_array_record(self.job.state.array_records[NOISE_STATE_KEY]) if NOISE_STATE_KEY in self.job.state else {}
        generator = torch.Generator().manual_seed(self.config.train.seed + 7919 * (self.job.profile.partition_id + 1))
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                self.noise[name] = _noise_parameter(stored.get(_state_key(name)), torch.zeros_like(param))
            elif ".lora_A." in name and self.options.topology == "two_lora":
                A_n = torch.empty_like(param)
                torch.nn.init.kaiming_uniform_(A_n, a=math.sqrt(5), generator=generator)  # peft's init of A
                self.noise[name] = _noise_parameter(stored.get(_state_key(name)), A_n)
        return model

    def save_state(self, payload: Payload) -> None:
        super().save_state(payload)
        if not self.options.noise_branch:
            return
        noise = {_state_key(name): p.detach().float().cpu().numpy() for name, p in self.noise.items()}
        self.job.state[NOISE_STATE_KEY] = to_array_record(noise)

    def upload(self, model: PeftModel) -> Payload:
        """B^r of every module, plus the head when ``model.head = global``; never A or B^n."""
        send_head = self.config.model.head == "global"
        return {
            key: value
            for key, value in adapter_payload(model).items()
            if key.endswith(B_SUFFIX) or (send_head and key.startswith(HEAD_PREFIX))
        }

    # ------------------------------------------------------------------ training
    def trainable_parameters(self, model: PeftModel, loader: Any) -> list[torch.nn.Parameter]:
        """The model's trainable parameters plus the noise branch (B^n, and A^n for two_lora; none
        with ``noise_branch = false``)."""
        import torch

        self.noise = {  # leaves on the training device, so the optimiser updates what the loss uses
            name: torch.nn.Parameter(p.detach().to(self.device).clone()) for name, p in self.noise.items()
        }
        return super().trainable_parameters(model, loader) + list(self.noise.values())

    def fit(self, model: PeftModel) -> TrainStats:
        """After the warm-up with ``split = epoch``: the plain loop over :class:`EpochSplitBatches`,
        so each epoch's split is fitted on exactly the batches that epoch trains on."""
        if self.warming_up or self.options.split != "epoch" or self.config.privacy.dp:
            return super().fit(model)
        cfg = self.config.train
        loader = self.loader(self.job.data.train, "train", shuffle=True)
        split_epochs = EpochSplitBatches(loader, cfg.max_steps, lambda batches: self._epoch_split(model, batches))
        return train(
            model, split_epochs,  # type: ignore[arg-type]  # iterated like the DataLoader it wraps
            epochs=cfg.local_epochs, lr=self.lr, device=self.device, max_steps=cfg.max_steps,
            weight_decay=cfg.weight_decay, loss_fn=self.loss, after_backward=self.after_backward,
            parameters=self.trainable_parameters(model, loader), precision=self.precision,
            options=self.step_options(),
        )

    def loss(self, model: PeftModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        inputs = model_inputs(batch, self.device)
        labels = batch["labels"].to(self.device)
        index = batch["index"].cpu().numpy()
        ce = F.cross_entropy(model(**inputs).logits.float(), labels, reduction="none")  # (n,) robust branch
        if self.warming_up:
            self._note_weights(np.ones(len(index)), index, flagged=None)
            return ce.mean()
        posterior, split_mean = self._posterior(ce, labels, index)  # (n,), the normaliser
        clean = posterior > self.options.clean_threshold
        weights = robust_weights(posterior, self.options.robust_loss, self.options.clean_threshold)  # (n,)
        self._note_weights(weights, index, flagged=~clean)
        loss = robust_term(ce, torch.as_tensor(weights, dtype=ce.dtype, device=ce.device), self.options.robust_loss,
                           split_mean)
        if not self.options.noise_branch or self.options.beta == 0:
            return loss
        complementary = self._complementary(labels) if self.options.nl_target == "complementary" else labels
        rows, targets = noise_targets(labels, torch.from_numpy(clean).to(ce.device), self.options.nl_target, complementary)
        if rows.any():
            rows_inputs = inputs if bool(rows.all()) else {k: v[rows] for k, v in inputs.items()}
            noise_logits = self._noise_forward(model, rows_inputs)  # (m, C) noise branch, the NL rows only
            loss = loss + self.options.beta * negative_learning_loss(noise_logits, targets[rows]).mean()
        return loss

    def train_metrics(self) -> dict[str, float]:
        """Robust-CE weight sums per group (every round) and, after the warm-up, the split's
        counts and quality against the injected noise (``is_noisy``)."""
        metrics = {protocol.FEDDR_NOISE_PREFIX + key: value for key, value in self.weights.items()}
        if self.splits:
            if "noisy" in self.counts:
                metrics |= {protocol.FEDDR_NOISE_PREFIX + key: value for key, value in split_quality(self.counts).items()}
            metrics |= {protocol.FEDDR_NOISE_PREFIX + key: value for key, value in self.counts.items()}
        return {k: v for k, v in metrics.items() if math.isfinite(v)}

    # ------------------------------------------------------------------ internals
    def _noise_forward(self, model: PeftModel, inputs: dict[str, Any]) -> torch.Tensor:
        from torch.func import functional_call

        swapped: dict[str, torch.Tensor] = dict(self.noise)  # B^n (and A^n) in place of B^r (and A)
        if self.options.noise_head == "detached":  # the head acts in f_n but only f_r trains it
            swapped |= {n: p.detach() for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n}
        return functional_call(model, swapped, args=(), kwargs=inputs).logits.float()

    def _epoch_split(self, model: PeftModel, batches: list[Batch]) -> None:
        """Clean posterior of the epoch's samples from the per-sample CE of f_r (eval mode)."""
        import torch
        import torch.nn.functional as F

        logits, labels = predict_logits(model, batches, self.device, self.precision)  # type: ignore[arg-type]  # any iterable
        model.train()
        index = torch.cat([b["index"] for b in batches]).numpy()
        losses = F.cross_entropy(logits, labels, reduction="none").numpy()
        posterior = split_posterior(losses, labels.numpy(), self.options.split_scope, self.config.train.seed)
        self.posterior[:] = np.nan
        self.posterior[index] = posterior
        self.split_mean = float(robust_weights(posterior, self.options.robust_loss, self.options.clean_threshold).mean())
        self._count(posterior <= self.options.clean_threshold, index)

    def _posterior(self, ce: torch.Tensor, labels: torch.Tensor, index: np.ndarray) -> tuple[np.ndarray, float]:
        """(clean posterior (n,) of the batch, the mean robust weight over the split's samples): the
        epoch's split, or (``split = batch``, or a batch outside the epoch's split) a fit on the
        batch's own CE."""
        posterior = self.posterior[index]
        if self.options.split == "epoch" and np.isfinite(posterior).all():
            return posterior, self.split_mean
        losses, given = ce.detach().cpu().numpy(), labels.cpu().numpy()
        posterior = split_posterior(losses, given, self.options.split_scope, self.config.train.seed)
        self._count(posterior <= self.options.clean_threshold, index)
        weights = robust_weights(posterior, self.options.robust_loss, self.options.clean_threshold)
        return posterior, float(weights.mean())

    def _count(self, suspect: np.ndarray, index: np.ndarray) -> None:
        """Add one split's counts (flagged, samples; with the truth also true positives, noisy)."""
        self.splits += 1
        if self.is_noisy is not None:
            counts = split_counts(suspect, self.is_noisy[index])
        else:
            counts = {"flagged": float(np.sum(suspect)), "samples": float(len(suspect))}
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0.0) + value

    def _note_weights(self, weights: np.ndarray, index: np.ndarray, flagged: np.ndarray | None) -> None:
        """Add the robust-CE weights of a batch's samples per group (truly noisy / clean, flagged /
        unflagged by the split; each only when known)."""
        groups: dict[str, np.ndarray] = {}
        if self.is_noisy is not None:
            groups |= {"noisy": self.is_noisy[index], "clean": ~self.is_noisy[index]}
        if flagged is not None:
            groups |= {"flagged": flagged, "unflagged": ~flagged}
        for key, value in weight_sums(weights, groups).items():
            self.weights[key] = self.weights.get(key, 0.0) + value

    def _complementary(self, labels: torch.Tensor) -> torch.Tensor:
        num_classes = len(self.job.federated.label_names)
        return complementary_labels(labels, num_classes, self.generator).to(labels.device)


def _state_key(peft_name: str) -> str:
    """``base_model.model.X.lora_B.default.weight`` -> ``X::B_noise`` (A^n: ``X::A_noise``): the
    factor's payload key (:func:`fedlora.lora.payload_key`) and :data:`NOISE_SUFFIX`."""
    return payload_key(peft_name) + NOISE_SUFFIX


def _noise_parameter(stored: np.ndarray | None, initial: torch.Tensor) -> torch.nn.Parameter:
    import torch

    value = torch.from_numpy(np.asarray(stored, dtype=np.float32).copy()) if stored is not None else initial
    if tuple(value.shape) != tuple(initial.shape):
        raise ValueError(f"stored noise factor has shape {tuple(value.shape)}, expected {tuple(initial.shape)}")
    return torch.nn.Parameter(value.to(initial.device))

"""FedDR-LoRA's client: a robust and a noise branch over one local A, negative learning on suspects.

The method's home is ``fedlora/methods/feddr_lora.py`` (its [RECON] choices are the options of
:class:`~fedlora.methods.feddr_lora.FedDRLoRAOptions`; the clean / suspect split is its
:func:`~fedlora.methods.feddr_lora.gmm_clean_mask`). Per adapted module the client holds

- ``A`` (r, d_in): local, never uploaded, shared by both branches (``topology = shared_a``);
- ``B^r`` (d_out, r): the robust up-projection, overwritten by the global B every round and
  uploaded after training; it is peft's ordinary ``lora_B``, so the peft model *is* the robust
  branch f_r = W0 x + s B^r A x and inference / evaluation use it alone;
- ``B^n`` (d_out, r): the noise up-projection (zero at the start), local, never uploaded. The noise
  branch f_n = W0 x + s B^n A x is the same peft model called with B^n in place of B^r
  (``torch.func.functional_call``), so the negative-learning loss reaches A and B^n (and the head
  only with ``noise_head = shared``) but never B^r. ``topology = two_lora`` also swaps in a separate local ``A^n``.

Local objective: ``warmup_rounds`` rounds of plain cross-entropy on f_r; afterwards a
2-component Gaussian mixture on the per-sample CE of f_r splits the samples into clean D_c (the
low-loss component, posterior > ``clean_threshold``) and suspect D_n, and the loss is
mean CE(f_r on all samples) + beta * mean NL(f_n on all samples, complementary labels y-bar != y),
NL(p, y) = -log(1 - p_y). With these defaults the split is measured (its precision and recall are
reported) but does not act; it acts with ``robust_loss = clean`` (CE of f_r on D_c only) or
``nl_target = given`` (NL on D_n with the given labels).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from clients.trainers.base import LocalTrainer
from fedlora.lora import B_SUFFIX, HEAD_PREFIX, Payload, from_array_record, to_array_record
from fedlora.methods.feddr_lora import NOISE_METRIC_PREFIX, gmm_clean_mask, split_counts, split_quality
from fedlora.models import PEFT_PREFIX, adapter_payload
from fedlora.training import model_inputs, predict_logits

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

NOISE_STATE_KEY = "fedlora.feddr_lora.noise"  # context.state entry holding B^n (and A^n)
NOISE_B_SUFFIX = "::B_noise"
NOISE_A_SUFFIX = "::A_noise"


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


def robust_term(ce: torch.Tensor, clean: torch.Tensor, mode: str) -> torch.Tensor:
    """The robust branch's objective from per-sample CE (n,): mean over the clean samples
    (``robust_loss = clean``; 0 with a gradient graph when none is clean) or over all (``all``)."""
    if mode == "all":
        return ce.mean()
    return ce[clean].mean() if bool(clean.any()) else ce.sum() * 0.0


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


# --------------------------------------------------------------------------------------------
# the client
# --------------------------------------------------------------------------------------------


class FedDRLoRATrainer(LocalTrainer):
    """FedDR-LoRA's client: train A, B^r, B^n (and the head); upload B^r (and a global head)."""

    strategy_names: ClassVar[tuple[str, ...]] = ("feddr_lora",)

    def __init__(self, job: Any) -> None:
        import torch

        super().__init__(job)
        seed = self.config.train.seed + 1000 * job.server_round + job.profile.partition_id
        self.generator = torch.Generator().manual_seed(seed)  # complementary labels
        self.noise: dict[str, torch.nn.Parameter] = {}  # peft parameter name -> B^n / A^n
        self.clean: np.ndarray | None = None  # per-epoch split: clean mask over the local set
        self.counts = {"flagged": 0.0, "true-positives": 0.0, "noisy": 0.0, "samples": 0.0}
        self.batches_seen = 0
        self.steps_per_epoch = 1
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
        """The model's trainable parameters plus the noise branch (B^n, and A^n for two_lora)."""
        import torch

        self.steps_per_epoch = max(1, len(loader))  # the per-epoch split refits every this many batches
        self.noise = {  # leaves on the training device, so the optimiser updates what the loss uses
            name: torch.nn.Parameter(p.detach().to(self.device).clone()) for name, p in self.noise.items()
        }
        return super().trainable_parameters(model, loader) + list(self.noise.values())

    def loss(self, model: PeftModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F

        if self.options.split == "epoch" and self.batches_seen % self.steps_per_epoch == 0 and not self.warming_up:
            self.clean = self._epoch_split(model)
        self.batches_seen += 1
        inputs = model_inputs(batch, self.device)
        labels = batch["labels"].to(self.device)
        ce = F.cross_entropy(model(**inputs).logits.float(), labels, reduction="none")  # (n,) robust branch
        if self.warming_up:
            return ce.mean()
        clean = self._batch_clean(ce, batch)  # (n,) bool
        loss = robust_term(ce, clean, self.options.robust_loss)
        complementary = self._complementary(labels) if self.options.nl_target == "complementary" else labels
        suspect, targets = noise_targets(labels, clean, self.options.nl_target, complementary)
        if suspect.any() and self.options.beta > 0:
            noise_logits = self._noise_forward(model, inputs)  # (n, C) noise branch
            nl = negative_learning_loss(noise_logits[suspect], targets[suspect])
            loss = loss + self.options.beta * nl.mean()
        return loss

    def train_metrics(self) -> dict[str, float]:
        """Split quality against the injected noise (``is_noisy``); empty during warm-up."""
        if not self.splits:
            return {}
        quality = split_quality(self.counts)
        metrics = {NOISE_METRIC_PREFIX + key: value for key, value in quality.items()}
        metrics |= {NOISE_METRIC_PREFIX + key: value for key, value in self.counts.items()}
        return {k: v for k, v in metrics.items() if math.isfinite(v)}

    # ------------------------------------------------------------------ internals
    def _noise_forward(self, model: PeftModel, inputs: dict[str, Any]) -> torch.Tensor:
        from torch.func import functional_call

        swapped: dict[str, torch.Tensor] = dict(self.noise)  # B^n (and A^n) in place of B^r (and A)
        if self.options.noise_head == "detached":  # the head acts in f_n but only f_r trains it
            swapped |= {n: p.detach() for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n}
        return functional_call(model, swapped, args=(), kwargs=inputs).logits.float()

    def _epoch_split(self, model: PeftModel) -> np.ndarray:
        """Clean mask over the whole local set from the per-sample CE of f_r (eval mode)."""
        import torch.nn.functional as F

        loader = self.loader(self.job.data.train, "train", shuffle=False)
        logits, labels = predict_logits(model, loader, self.device)  # unshuffled: row i = index i
        model.train()
        losses = F.cross_entropy(logits, labels, reduction="none").numpy()
        clean = gmm_clean_mask(losses, self.options.clean_threshold, seed=self.config.train.seed)
        self._count(~clean, np.arange(len(clean)))
        return clean

    def _batch_clean(self, ce: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        index = batch["index"].cpu().numpy()
        if self.options.split == "epoch" and self.clean is not None:
            clean = self.clean[index]
        else:
            losses = ce.detach().cpu().numpy()
            clean = gmm_clean_mask(losses, self.options.clean_threshold, seed=self.config.train.seed)
            self._count(~clean, index)
        return torch.from_numpy(clean).to(ce.device)

    def _count(self, suspect: np.ndarray, index: np.ndarray) -> None:
        self.splits += 1
        is_noisy = self.is_noisy[index] if self.is_noisy is not None else np.zeros(len(index), dtype=bool)
        for key, value in split_counts(suspect, is_noisy).items():
            self.counts[key] += value

    def _complementary(self, labels: torch.Tensor) -> torch.Tensor:
        num_classes = len(self.job.federated.label_names)
        return complementary_labels(labels, num_classes, self.generator).to(labels.device)


def _state_key(peft_name: str) -> str:
    """``base_model.model.X.lora_B.default.weight`` -> ``X::B_noise`` (A^n: ``X::A_noise``)."""
    module = peft_name.removeprefix(PEFT_PREFIX).split(".lora_")[0]
    return module + (NOISE_B_SUFFIX if ".lora_B." in peft_name else NOISE_A_SUFFIX)


def _noise_parameter(stored: np.ndarray | None, initial: torch.Tensor) -> torch.nn.Parameter:
    import torch

    value = torch.from_numpy(np.asarray(stored, dtype=np.float32).copy()) if stored is not None else initial
    if tuple(value.shape) != tuple(initial.shape):
        raise ValueError(f"stored noise factor has shape {tuple(value.shape)}, expected {tuple(initial.shape)}")
    return torch.nn.Parameter(value.to(initial.device))

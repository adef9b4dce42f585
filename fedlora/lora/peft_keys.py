"""Payload <-> peft state dict: the one codec between fedlora's array names and peft's.

A payload (what travels, what a client keeps) names a LoRA factor ``<module>::A`` / ``<module>::B``
(:data:`~fedlora.lora.factors.A_SUFFIX`, :data:`~fedlora.lora.factors.B_SUFFIX`) and a trained
head parameter ``head::<name>`` (:data:`~fedlora.lora.factors.HEAD_PREFIX`); ``<module>`` is the
module's name in the backbone (``bert.encoder.layer.0.attention.self.query``). peft's adapter
state dict (``get_peft_model_state_dict`` / ``set_peft_model_state_dict``, one named adapter at a
time) names the same arrays ``base_model.model.<module>.lora_A.weight`` and
``base_model.model.<name>``; the model's own modules are ``base_model.model.<module>``
(:func:`peft_module`). Every trainer and ``fedlora.models`` go through here, so the mapping is
written once:

    payload_key(peft_key(k)) == k          for every factor and head key k
    peft_key(payload_key(p)) == p          for every key p of peft's adapter state dict

A state dict key with the adapter's name in it (``...lora_A.default.weight``, ``model.state_dict()``)
names the same factor. Values: float32 numpy arrays in a payload, float32 CPU tensors in the state
dict peft loads (:func:`to_peft_state`, :func:`from_peft_state`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from fedlora.lora.factors import A_SUFFIX, B_SUFFIX, HEAD_PREFIX, Payload

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."  # a PeftModel's path to the backbone's modules
# base_model.model.<module>.lora_<A|B>[.<adapter>].weight
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")


def peft_module(module: str) -> str:
    """A backbone module's name in the peft model (``model.get_submodule`` / ``named_modules``)."""
    return PEFT_PREFIX + module


def payload_module(peft_name: str) -> str:
    """Inverse of :func:`peft_module`: the backbone's name of a peft model's module."""
    return peft_name.removeprefix(PEFT_PREFIX)


def peft_key(key: str) -> str:
    """``<module>::A`` -> ``base_model.model.<module>.lora_A.weight`` (``::B`` -> ``lora_B``);
    ``head::<name>`` -> ``base_model.model.<name>``."""
    if key.endswith(A_SUFFIX):
        return f"{peft_module(key[: -len(A_SUFFIX)])}.lora_A.weight"
    if key.endswith(B_SUFFIX):
        return f"{peft_module(key[: -len(B_SUFFIX)])}.lora_B.weight"
    return peft_module(key.removeprefix(HEAD_PREFIX))


def payload_key(key: str) -> str:
    """Inverse of :func:`peft_key`: a factor of peft's adapter state dict (with or without the
    adapter's name) -> ``<module>::A`` / ``::B``; any other entry (a ``modules_to_save`` head) ->
    ``head::<name>``."""
    factor = _FACTOR.match(key)
    if factor is None:
        return HEAD_PREFIX + payload_module(key)
    suffix = A_SUFFIX if factor["factor"] == "A" else B_SUFFIX
    return payload_module(factor["module"]) + suffix


def from_peft_state(state: Mapping[str, torch.Tensor]) -> Payload:
    """peft's adapter state dict -> a payload of float32 numpy arrays, copies: a payload taken from a
    model stays what it was when the model trains on, or is reset for the next client (a plain
    ``.numpy()`` of a float32 CPU parameter is a view of it)."""
    import torch

    return {payload_key(key): tensor.detach().to("cpu", torch.float32, copy=True).numpy() for key, tensor in state.items()}


def to_peft_state(payload: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A payload -> the state dict ``set_peft_model_state_dict`` loads (float32 tensors, copies)."""
    import torch

    return {peft_key(key): torch.from_numpy(np.asarray(array, dtype=np.float32).copy())
            for key, array in payload.items()}

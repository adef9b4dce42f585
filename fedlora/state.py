"""A safe codec for checkpointed state: JSON for the structure, safetensors for the arrays.

Nothing is unpickled: a checkpoint folder from someone else can at worst fail to load, never run
code. The structure may hold None, bools, ints, floats (NaN / inf included), strings, lists,
tuples, sets, dicts with any of those as keys, numpy arrays and scalars, numpy random generators
(their bit-generator state), and instances of the dataclasses / named tuples registered with
:func:`register` (an explicit allow-list, looked up by name; an unknown name is an error, never
an import). Anything else refuses to encode, with its type named.

Decoding is as strict: a structure nested deeper than :data:`MAX_DEPTH`, an unknown tag or type
name, an object with fields its class does not declare, or an array name the arrays do not hold
is a :class:`StateError`, never a crash or a guess.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

_REGISTERED: dict[str, type] = {}
MAX_DEPTH = 64  # deepest nesting a stored structure may have (a strategy's state is a few levels deep)


class StateError(ValueError):
    """State that cannot be encoded, or a stored structure that is not one this codec wrote."""


def register(cls: type[T]) -> type[T]:
    """Allow instances of ``cls`` (a dataclass or a NamedTuple) in checkpointed state."""
    if not (dataclasses.is_dataclass(cls) or hasattr(cls, "_fields")):
        raise TypeError(f"{cls.__name__} is neither a dataclass nor a NamedTuple")
    _REGISTERED[_name(cls)] = cls
    return cls


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def encode(value: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """``value`` as a JSON-compatible structure plus the arrays it refers to (name -> array)."""
    arrays: dict[str, np.ndarray] = {}
    return _encode(value, arrays), arrays


def decode(structure: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Inverse of :func:`encode` (StateError for anything this codec did not write)."""
    check_depth(structure)
    return _decode(structure, arrays)


def check_depth(structure: Any, limit: int = MAX_DEPTH) -> None:
    """StateError when ``structure`` (JSON values) nests deeper than ``limit`` (checked without recursion)."""
    stack: list[tuple[Any, int]] = [(structure, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise StateError(f"the stored structure nests deeper than {limit} levels")
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return number if math.isfinite(number) else {"__float__": repr(number)}
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise StateError("object arrays cannot be checkpointed")
        name = f"a{len(arrays)}"
        arrays[name] = np.ascontiguousarray(value)
        return {"__array__": name}
    if isinstance(value, np.random.Generator):
        return {"__rng__": _encode(value.bit_generator.state, arrays)}
    fields: tuple[str, ...] | None = getattr(type(value), "_fields", None)
    if fields is not None and isinstance(value, tuple):  # a NamedTuple
        return _encode_object(value, {f: getattr(value, f) for f in fields}, arrays)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_object(value, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, arrays)
    if isinstance(value, list):
        return [_encode(v, arrays) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, arrays) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_encode(v, arrays) for v in sorted(value, key=repr)]}
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    raise StateError(f"cannot checkpoint a value of type {type(value).__name__}")


def _encode_object(value: Any, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
    name = _name(type(value))
    if name not in _REGISTERED:
        raise StateError(f"cannot checkpoint {type(value).__qualname__}: register it with fedlora.state.register")
    return {"__object__": name, "fields": {k: _encode(v, arrays) for k, v in fields.items()}}


def _decode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise StateError(f"unexpected stored value {str(value)[:60]!r}")
    tag = next(iter(value))
    if len(value) == 2 and (tag != "__object__" or "fields" not in value):
        raise StateError(f"unexpected stored value {str(value)[:60]!r}")
    decoders: dict[str, Callable[[Any], Any]] = {
        "__float__": lambda text: float(text),
        "__array__": lambda name: _array(arrays, name),
        "__rng__": lambda state: _generator(_decode(state, arrays)),
        "__tuple__": lambda items: tuple(_decode(v, arrays) for v in items),
        "__set__": lambda items: {_decode(v, arrays) for v in items},
        "__dict__": lambda pairs: {_decode(k, arrays): _decode(v, arrays) for k, v in pairs},
        "__object__": lambda name: _object(name, value.get("fields"), arrays),
    }
    if tag not in decoders:
        raise StateError(f"unexpected stored tag {tag!r}")
    return decoders[tag](value[tag])


def _array(arrays: dict[str, np.ndarray], name: Any) -> np.ndarray:
    if not isinstance(name, str) or name not in arrays:
        raise StateError(f"the state refers to a missing array {name!r}")
    return arrays[name]


def _generator(state: Any) -> np.random.Generator:
    if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
        raise StateError("a stored random generator is not numpy's PCG64")
    generator = np.random.default_rng()
    generator.bit_generator.state = state
    return generator


def _object(name: Any, fields: Any, arrays: dict[str, np.ndarray]) -> Any:
    cls = _REGISTERED.get(name) if isinstance(name, str) else None
    if cls is None or not isinstance(fields, dict):
        raise StateError(f"the state holds an object of an unknown type {name!r}")
    declared = getattr(cls, "_fields", None) or [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in fields if k not in declared)
    if unknown:
        raise StateError(f"a stored {cls.__qualname__} has fields {unknown[:5]} its class does not declare")
    return cls(**{k: _decode(v, arrays) for k, v in fields.items()})

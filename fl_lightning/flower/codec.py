"""Payloads, tasks, updates and client states as plain data: a JSON structure and named tensors' bytes.

What travels between a Flower ServerApp and its ClientApps is records of arrays (each with its dtype and shape)
and of configuration values, never pickled objects: :func:`encode` turns a value made of tensors, numbers,
strings, containers and the federation's payload types into a JSON text that names each tensor by its position,
and the tensors as raw little-endian bytes with their dtype and shape; :func:`decode` builds the value again from
those two and nothing else. A class is rebuilt only when it is one of :data:`KNOWN` (the payloads every method
sends, and ``ClientSpec``), by its dataclass fields: a message cannot make the receiver run code of its choosing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import torch

from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, TensorPayload
from ..knowledge.class_stats import ClassStatistics
from ..knowledge.compression import LowRankUpdate

# the dataclasses a message may carry, by name: every payload kind of the strategies, and the client
KNOWN: dict[str, type] = {
    cls.__name__: cls
    for cls in (ModelWeights, TensorPayload, ClassStatistics, LowRankUpdate, ClientSpec, ClientTask, ClientUpdate)
}

_DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


class Encoded:
    """A value as a JSON structure and the tensors it names (``tensors[i]`` is ``{"t": i}`` in the structure)."""

    def __init__(self, structure: str, tensors: list[tuple[str, list[int], bytes]]):
        self.structure, self.tensors = structure, tensors

    @property
    def nbytes(self) -> int:
        """Bytes of the structure and the tensors' data."""
        return len(self.structure.encode()) + sum(len(data) for _, _, data in self.tensors)


def tensor_bytes(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor's dtype name, shape and bytes (on the CPU, contiguous, little-endian as torch stores them)."""
    if str(tensor.dtype) not in _DTYPES:
        raise TypeError(f"a tensor of dtype {tensor.dtype} cannot travel as a Flower record")
    flat = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    return str(tensor.dtype), list(tensor.shape), flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def tensor_of(dtype: str, shape: list[int], data: bytes) -> torch.Tensor:
    """The tensor :func:`tensor_bytes` gave the parts of (a copy that owns its memory)."""
    kind = _DTYPES.get(dtype)
    if kind is None:
        raise ValueError(f"a record holds a tensor of unknown dtype {dtype!r}")
    if not data:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)


def encode(value: Any) -> Encoded:
    """``value`` as an :class:`Encoded` (see the module docstring); a kind it cannot carry is a TypeError."""
    tensors: list[tuple[str, list[int], bytes]] = []

    def walk(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            tensors.append(tensor_bytes(item))
            return {"t": len(tensors) - 1}
        if isinstance(item, np.ndarray):
            tensors.append(tensor_bytes(torch.from_numpy(np.ascontiguousarray(item))))
            return {"n": len(tensors) - 1}
        if item is None or isinstance(item, (bool, str)):
            return {"v": item}
        if isinstance(item, (int, np.integer)):
            return {"v": int(item)}
        if isinstance(item, (float, np.floating)):
            number = float(item)
            return {"v": number} if math.isfinite(number) else {"f": repr(number)}  # nan, inf: JSON has none
        if isinstance(item, dict):
            return {"d": [[walk(key), walk(inner)] for key, inner in item.items()]}
        if isinstance(item, list):
            return {"l": [walk(inner) for inner in item]}
        if isinstance(item, tuple):
            return {"u": [walk(inner) for inner in item]}
        if isinstance(item, (set, frozenset)):
            return {"s": [walk(inner) for inner in sorted(item, key=repr)]}
        name = type(item).__name__
        if dataclasses.is_dataclass(item) and KNOWN.get(name) is type(item):
            return {"c": name, "a": {f.name: walk(getattr(item, f.name)) for f in dataclasses.fields(item)}}
        raise TypeError(f"a {name} cannot travel as a Flower record (tensors, numbers, strings, containers, payloads)")

    structure = walk(value)
    return Encoded(json.dumps(structure, separators=(",", ":")), tensors)


def decode(encoded: Encoded) -> Any:
    """The value :func:`encode` made ``encoded`` of; its tensors on the CPU."""

    def build(node: dict[str, Any]) -> Any:
        (kind, body), *rest = node.items()
        if kind == "t":
            return tensor_of(*encoded.tensors[body])
        if kind == "n":
            return tensor_of(*encoded.tensors[body]).numpy()
        if kind == "v":
            return body
        if kind == "f":
            return float(body)
        if kind == "d":
            return {_hashable(build(key)): build(inner) for key, inner in body}
        if kind == "l":
            return [build(inner) for inner in body]
        if kind == "u":
            return tuple(build(inner) for inner in body)
        if kind == "s":
            return {build(inner) for inner in body}
        if kind == "c":
            cls = KNOWN.get(body)
            if cls is None:
                raise ValueError(f"a record names the class {body!r}, which is not one a message may carry")
            fields = {name: build(inner) for name, inner in rest[0][1].items()}
            return _made(cls, fields)
        raise ValueError(f"a record's structure has an entry of unknown kind {kind!r}")

    return build(json.loads(encoded.structure))


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _made(cls: type, fields: dict[str, Any]) -> Any:
    """An instance of the dataclass ``cls`` with ``fields``, those the constructor takes given to it."""
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    made = cls(**{k: v for k, v in fields.items() if k in init})
    for name, value in fields.items():
        if name not in init:
            object.__setattr__(made, name, value)
    return made

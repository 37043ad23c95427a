"""An encoded value (``codec``) as Flower records and back: its tensors as an ArrayRecord of Arrays (dtype, shape,
raw bytes: ``stype`` :data:`STYPE`), its structure as a string in a ConfigRecord."""

from __future__ import annotations

from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from .codec import Encoded, decode, encode

STYPE = "torch.raw"  # the tensor's bytes as torch stores them (little-endian, C order); no pickle, no numpy header


def put(records: RecordDict, name: str, value: Any) -> int:
    """Stores ``value`` under ``name`` (``<name>.arrays`` and ``<name>.structure``); returns the bytes stored."""
    encoded = encode(value)
    records[f"{name}.arrays"] = ArrayRecord(
        {str(i): Array(dtype, tuple(shape), STYPE, data) for i, (dtype, shape, data) in enumerate(encoded.tensors)}
    )
    records[f"{name}.structure"] = ConfigRecord({"structure": encoded.structure})
    return encoded.nbytes


def has(records: RecordDict, name: str) -> bool:
    """Whether ``records`` holds a value stored under ``name``."""
    return f"{name}.structure" in records


def take(records: RecordDict, name: str) -> tuple[Any, int]:
    """The value stored under ``name`` and its bytes."""
    arrays = records[f"{name}.arrays"]
    structure = records[f"{name}.structure"]
    if not isinstance(arrays, ArrayRecord) or not isinstance(structure, ConfigRecord):
        raise ValueError(f"the message's {name!r} records are not an ArrayRecord and a ConfigRecord")
    tensors = []
    for i in range(len(arrays)):
        array = arrays[str(i)]
        if array.stype != STYPE:
            raise ValueError(f"the message's {name!r} array {i} has stype {array.stype!r}, not {STYPE!r}")
        tensors.append((array.dtype, list(array.shape), array.data))
    encoded = Encoded(str(structure["structure"]), tensors)
    return decode(encoded), encoded.nbytes

"""Named domain types that cross module boundaries.

Everything a client receives or sends is a :class:`Payload` that knows its size in bytes, so the
communication ledger counts exactly what an algorithm exchanges, never an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

ClientId = int
Role = str  # name of a model slot, e.g. "global", "aux", "target", "small", "cnn3"
StateDict = dict[str, torch.Tensor]
PAD = -100  # label ignored by the loss and the accuracy: padding tokens of sequence targets


def tensor_bytes(tensors: Mapping[str, torch.Tensor] | list[torch.Tensor] | torch.Tensor) -> int:
    """Bytes needed to send ``tensors`` as they are stored (numel times element size)."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return sum(t.numel() * t.element_size() for t in values)


class Payload:
    """Something sent between the server and a client; subclasses define :attr:`nbytes`."""

    @property
    def nbytes(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class ModelWeights(Payload):
    """A model's state dict (parameters and buffers) for one role."""

    role: Role
    state: StateDict

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.state)


@dataclass
class TensorPayload(Payload):
    """Named tensors that are not a model's weights (class logits, features, representations)."""

    kind: str
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors)


@dataclass(frozen=True)
class ClientSpec:
    """A client of the population: its id, its tier and the model roles that tier trains."""

    id: ClientId
    tier: str
    roles: tuple[Role, ...]


@dataclass
class ClientTask:
    """What the server sends one client for one round: its payloads, in the phase the orchestrator sets."""

    client: ClientSpec
    round: int
    downlink: dict[str, Payload] = field(default_factory=dict)
    phase: str = "train"


@dataclass
class ClientUpdate:
    """What a client returns after local training.

    Attributes:
        client: the client that trained.
        num_samples: labeled examples it trained on (the FedAvg weight).
        uplink: payloads sent to the server.
        metrics: local training statistics (mean loss, ...), logged but not sent.
    """

    client: ClientSpec
    num_samples: int
    uplink: dict[str, Payload] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

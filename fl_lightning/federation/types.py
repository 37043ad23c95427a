"""Named domain types that cross module boundaries.

Everything a client receives or sends is a :class:`Payload` that knows its size in bytes, so the
communication ledger counts exactly what an algorithm exchanges, never an estimate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

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
    """A model's weights for one role: the part of its state dict that a deployment sends.

    Strategies put in ``state`` only the :func:`exchanged_keys` of the model (its trainable parameters
    and the buffers of its trainable parts), so a frozen backbone is neither sent nor counted.
    """

    role: Role
    state: StateDict

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.state)

    @classmethod
    def part(cls, role: Role, state: StateDict, keys: list[str], copy: bool = False) -> ModelWeights:
        """The ``keys`` of ``state`` (a model's :func:`exchanged_keys`); ``copy`` for a live module's tensors."""
        if not copy:
            return cls(role, {k: state[k] for k in keys})
        with torch.no_grad():  # a clone without autograd history: one op per tensor instead of detach + clone
            return cls(role, {k: state[k].clone() for k in keys})


def clone_state(state: Mapping[str, torch.Tensor]) -> StateDict:
    """A detached copy of ``state`` (e.g. ``module.state_dict()``), safe to keep while the module trains on.

    Example: ``saved = clone_state(model.state_dict())``.
    """
    return {k: v.detach().clone() for k, v in state.items()}


def exchanged_keys(model: torch.nn.Module) -> list[str]:
    """State-dict keys of ``model`` that a real deployment exchanges, in state-dict order.

    These are the trainable parameters and the buffers (batch-norm statistics) of the trainable parts.
    A frozen part (every parameter of it has ``requires_grad=False``, e.g. paper 001's ViT backbone)
    never changes, so each side keeps its own copy: neither its parameters nor its buffers are sent.
    A buffer belongs to the nearest module around it that has parameters (a non-affine batch norm
    to its block); it is sent when any parameter of that module trains. A frozen part must keep its
    buffers fixed (eval mode, as ``ViTFeatures``); statistics it updated would stay on each client.
    """
    # tied weights keep every name, as the state dict does: the receiver loads each key it is given
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    owners = {}  # module path -> whether the module has parameters, and whether any of them trains
    for path, module in model.named_modules(remove_duplicate=False):
        names = [f"{path}.{n}" if path else n for n, _ in module.named_parameters(remove_duplicate=False)]
        owners[path] = (bool(names), any(n in trainable for n in names))
    buffers = {
        f"{path}.{n}" if path else n
        for path, m in model.named_modules(remove_duplicate=False)
        for n, _ in m.named_buffers(recurse=False)
    }

    def buffer_trains(key: str) -> bool:
        path = key.rpartition(".")[0]
        while True:
            has_params, trains = owners.get(path, (False, False))
            if has_params or not path:
                return trains
            path = path.rpartition(".")[0]

    return [k for k in model.state_dict() if k in trainable or (k in buffers and buffer_trains(k))]


def load_exchanged(model: torch.nn.Module, state: StateDict) -> None:
    """Loads received weights (the :func:`exchanged_keys` part) into ``model``; the rest stays as it is."""
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise KeyError(f"received weights have keys the model does not: {result.unexpected_keys[:5]}")


P = TypeVar("P", bound=Payload)


def payload_of(payloads: Mapping[str, Payload], name: str, kind: type[P]) -> P:
    """``payloads[name]``, checked to be a ``kind`` (so a strategy reads its fields with their types).

    Example: ``payload_of(task.downlink, "global", ModelWeights).state``.
    """
    payload = payloads[name]
    if not isinstance(payload, kind):
        raise TypeError(f"payload {name!r} is a {type(payload).__name__}, expected a {kind.__name__}")
    return payload


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
    downlink: Mapping[str, Payload] = field(default_factory=dict)
    phase: str = "train"

    def received(self, name: str, kind: type[P]) -> P:
        """The downlink payload ``name``, checked to be a ``kind``: ``task.received("global", ModelWeights)``."""
        return payload_of(self.downlink, name, kind)


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
    uplink: Mapping[str, Payload] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def sent(self, name: str, kind: type[P]) -> P:
        """The uplink payload ``name``, checked to be a ``kind``: ``update.sent("global", ModelWeights)``."""
        return payload_of(self.uplink, name, kind)

"""Width slicing (HeteroFL): a rate-r sub-model holds the first ceil(r * n) units of every layer of one global model.

A builder supports slicing when it takes a ``rate`` argument and builds the rate-r model whose parameter
shapes are exactly the leading blocks of the rate-1 model's (same names, each dimension cut to the
first entries); it marks the model with :func:`mark_sliceable`. The input channels of the first layer
and the classes of the output layer are never cut. ``digits_mlp``, ``digits_cnn``, ``resnet20`` and the
CIFAR ResNets ``cifar_resnet10`` ... ``cifar_resnet50`` support it (:data:`SLICEABLE_BUILDERS`); other
builders are refused by the strategies that need slicing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from ..federation.errors import ConfigError
from ..federation.types import StateDict, clone_state
from .base import FeatureClassifier

SLICEABLE_BUILDERS = ("digits_cnn", "digits_mlp", "resnet20") + tuple(
    f"cifar_resnet{depth}" for depth in (10, 14, 18, 22, 26, 34, 50)
)


def sliced_width(units: int, rate: float) -> int:
    """``ceil(rate * units)``: the units a rate-``rate`` sub-model keeps of a layer of ``units``."""
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 1:
        raise ConfigError(f"model rate must be in (0, 1], got {rate!r}; e.g. rate: 0.25 for HeteroFL's rate c.")
    # rounded first, so that 0.1 * 30 = 3.0000000000000004 keeps 3 units, not 4
    return max(1, math.ceil(round(units * rate, 9)))


class _Scale:
    """HeteroFL's scaler: a layer's output divided by the rate in training, unchanged in evaluation."""

    def __init__(self, rate: float):
        self.rate = rate

    def __call__(self, module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        return output / self.rate if module.training else output


def add_scaler(layer: nn.Module, rate: float) -> None:
    """Divides ``layer``'s output by ``rate`` in training (Diao et al. 2021, Sec. 3.2, the "scaler").

    A forward hook rather than a module, so the sub-model's parameter names (``features.2.weight``) stay
    the global model's and slices line up by name; at rate 1 nothing is added.
    """
    if rate != 1:
        layer.register_forward_hook(_Scale(rate))


def mark_sliceable(model: FeatureClassifier, rate: float) -> FeatureClassifier:
    """Records on ``model`` that it is the rate-``rate`` slice of its builder's rate-1 model."""
    model.width_rate = float(rate)
    return model


def slice_state(state: Mapping[str, Tensor], shapes: Mapping[str, torch.Size]) -> StateDict:
    """The sub-model's entries of a global state dict: each tensor cut to the first ``shapes[k][d]``
    indices of every dimension d (copies, safe to send)."""
    return {k: state[k][tuple(slice(0, n) for n in shape)].clone() for k, shape in shapes.items()}


def scatter_state(state: Mapping[str, Tensor], sub: Mapping[str, Tensor]) -> StateDict:
    """A copy of ``state`` with each of ``sub``'s tensors written over the leading block it was cut from."""
    out = {k: v.clone() for k, v in state.items()}
    for k, v in sub.items():
        out[k][tuple(slice(0, n) for n in v.shape)] = v
    return out


def not_a_slice(global_shapes: Mapping[str, torch.Size], sub_shapes: Mapping[str, torch.Size]) -> str | None:
    """Why ``sub_shapes`` is not a leading-block slice of ``global_shapes``, or None when it is."""
    if set(sub_shapes) != set(global_shapes):
        different = sorted(set(sub_shapes) ^ set(global_shapes))
        return f"their parameter names differ ({', '.join(different[:3])})"
    for k, shape in sub_shapes.items():
        whole = global_shapes[k]
        if len(shape) != len(whole) or any(n > m for n, m in zip(shape, whole)):
            return f"{k} has shape {tuple(shape)}, not a leading block of {tuple(whole)}"
    return None


@torch.no_grad()
def batch_norm_statistics(model: nn.Module, parameters: Mapping[str, Tensor], batches: Iterable[Tensor]) -> StateDict:
    """``model``'s full state with ``parameters`` and batch-norm statistics from one pass over ``batches``.

    HeteroFL's static batch norm (Sec. 3.2) never sends running statistics: clients normalise with their
    batch's statistics, and before evaluation the statistics of the global model are accumulated over the
    training data (``momentum=None``: the plain mean over batches of each batch's mean and variance).
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    model.load_state_dict({**model.state_dict(), **parameters})
    momenta = [m.momentum for m in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    was_training = model.training
    model.train()
    for x in batches:
        model(x)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    model.train(was_training)
    return clone_state(model.state_dict())

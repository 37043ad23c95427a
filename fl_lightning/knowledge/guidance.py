"""FedL2G's learned guidance (Zhang et al., arXiv 2410.06490): guiding vectors, the guided loss, the meta step
that gives their gradient, and the server's step on them.

The server holds one guiding vector per class, ``g`` ``[C, D]``: a target for each class's features (``D`` the
representation size, the feature variant) or logits (``D = C``, the logit variant). A client trains on
``CE(z, y) + w * MSE(o, g_y)``, ``o`` the features or the logits. To learn ``g``, a client takes one
differentiable SGD step of that loss on a study batch, measures the cross-entropy of the stepped model on a
quiz batch it never trains on, and sends that loss's gradient w.r.t. ``g``: guidance is learned for what it
does to the client's own objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from ..federation.padding import class_index, padded_loss

GuideTarget = Literal["feature", "logit"]  # what the guiding vectors are targets for


def guide_loss(outputs: Tensor, labels: Tensor, vectors: Tensor) -> Tensor:
    """``MSE(o, g_y)``: the mean over every element ``B x D`` of the squared distance of ``outputs`` ``[B, D]`` to
    their classes' guiding vectors ``vectors`` ``[C, D]`` (over the real rows of a padded batch)."""
    return padded_loss(F.mse_loss, outputs, vectors[class_index(labels)])


def guided_loss(guided: Tensor, logits: Tensor, labels: Tensor, vectors: Tensor, weight: float) -> Tensor:
    """``CE(logits, y) + weight * MSE(guided, g_y)``, ``guided`` the features or the logits ``[B, D]``."""
    return F.cross_entropy(logits, labels) + weight * guide_loss(guided, labels, vectors)


class GuidedOutputs(nn.Module):
    """A model's ``(guided, logits)``: its features and logits (``feature``), or its logits twice (``logit``),
    so that one functional call gives both. ``model`` has ``features`` and ``head`` for the feature variant."""

    def __init__(self, model: nn.Module, target: GuideTarget):
        super().__init__()
        self.model, self.target = model, target

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.target == "logit":
            logits = self.model(x)
            return logits, logits
        features = self.model.features(x)
        return features, self.model.head(features)


def guide_gradients(
    model: nn.Module,
    study: Sequence[tuple[Tensor, Tensor]],
    quiz: Sequence[tuple[Tensor, Tensor]],
    vectors: Tensor,
    lr: float,
    weight: float,
    target: GuideTarget,
) -> Tensor:
    """The meta step: the gradient ``[C, D]`` of the quiz loss after one guided SGD step w.r.t. the guiding vectors.

    ``theta' = theta - lr * grad_theta mean_b [CE + weight * MSE(o, g_y)]`` over the ``study`` batches, then
    ``d/dg mean_b CE(f_theta'(x), y)`` over the ``quiz`` batches, differentiating through the step. The model
    itself is not changed: the step lives in a functional copy of its parameters, and its buffers (batch-norm
    statistics, which the forward passes update in training mode) are copies. Rows of classes absent from the
    study batches are 0.
    """
    outputs = GuidedOutputs(model, target)
    params = {name: p for name, p in outputs.named_parameters() if p.requires_grad}
    buffers = {name: b.clone() for name, b in outputs.named_buffers()}
    guides = vectors.detach().clone().requires_grad_(True)

    def forward(parameters: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
        return functional_call(outputs, {**parameters, **buffers}, (x,))

    study_loss = sum(guided_loss(*forward(params, x), y, guides, weight) for x, y in study) / len(study)
    grads = torch.autograd.grad(study_loss, list(params.values()), create_graph=True, allow_unused=True)
    stepped = {name: p if g is None else p - lr * g for (name, p), g in zip(params.items(), grads)}
    quiz_loss = sum(F.cross_entropy(forward(stepped, x)[1], y) for x, y in quiz) / len(quiz)
    (gradient,) = torch.autograd.grad(quiz_loss, guides)
    return gradient


class ClassGradientMean:
    """The per-class mean of the clients' guide gradients: each class's rows averaged over the clients that sent
    one (unweighted), 0 for a class nobody sent.

    Args:
        num_classes: C.
        dim: D.
    """

    def __init__(self, num_classes: int, dim: int):
        self.sums = torch.zeros(num_classes, dim, dtype=torch.float64)
        self.counts = torch.zeros(num_classes, dtype=torch.long)

    def add(self, labels: Tensor, gradients: Tensor) -> None:
        """One client's gradients ``[S, D]`` of the classes ``labels`` ``[S]``."""
        labels = labels.long().cpu()
        self.sums.index_add_(0, labels, gradients.detach().cpu().double())
        self.counts.index_add_(0, labels, torch.ones_like(labels))

    def mean(self) -> Tensor:
        """``[C, D]`` float32: the mean per class, 0 where no client sent the class."""
        return (self.sums / self.counts.clamp(min=1)[:, None]).float()


def clipped_sgd_step(vectors: Tensor, gradient: Tensor, lr: float, max_norm: float) -> Tensor:
    """``vectors - lr * gradient``, the gradient first scaled to norm ``max_norm`` if its norm (over every element)
    is larger, as ``torch.nn.utils.clip_grad_norm_`` scales it (by ``max_norm / (norm + 1e-6)``)."""
    scale = max_norm / (float(gradient.norm()) + 1e-6)
    if scale < 1.0:
        gradient = gradient * scale
    return vectors - lr * gradient.to(vectors.device)

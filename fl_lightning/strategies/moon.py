"""MOON: Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021 (Sec. 3.2-3.3, eq. 1-3, Algorithm 1)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, Positive
from ..federation.errors import ConfigError
from ..federation.types import ClientTask, ClientUpdate, ModelWeights, load_exchanged
from ..models.base import FeatureClassifier
from .base import ServerContext
from .fedavg import FedAvg


def model_contrastive_loss(z: Tensor, z_global: Tensor, z_previous: list[Tensor], temperature: float) -> Tensor:
    """MOON's eq. 2, averaged over the batch.

    ``l_con = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + sum_prev e^{sim(z, z_prev)/tau}) )``
    with ``sim`` the cosine similarity: the global model's representation is the positive, each previous
    local model's a negative. It is a cross-entropy whose target is column 0 of the similarity logits,
    as the official code computes it; with no previous model the loss is exactly 0.

    Args:
        z: the local model's projections ``[B, D]``.
        z_global: the frozen global model's projections of the same inputs ``[B, D]``.
        z_previous: the frozen previous local models' projections (model_buffer_size of them).
        temperature: tau.
    """
    similarities = [F.cosine_similarity(z, z_global, dim=-1)]
    similarities += [F.cosine_similarity(z, other, dim=-1) for other in z_previous]
    logits = torch.stack(similarities, dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def frozen(model: FeatureClassifier, weights: dict[str, Tensor]) -> FeatureClassifier:
    """A copy of ``model`` holding ``weights``, in eval mode and without gradients (a MOON reference model)."""
    reference = copy.deepcopy(model)
    load_exchanged(reference, weights)  # received weights leave out a frozen part, which the copy keeps
    return reference.eval().requires_grad_(False)


class MOON(FedAvg):
    """Model-contrastive federated learning: FedAvg whose local loss pulls the representation toward
    the global model's and away from the client's previous local model's.

    The model is an encoder, a projection head and a classifier on the projection ``z``
    (``models.<role>.projection_dim``). Each sampled client loads the global model and trains on
    ``CE(y, f(x)) + mu * l_con`` (eq. 3), ``l_con`` of :func:`model_contrastive_loss` against the received
    global model and the client's own previous local model, both frozen and in eval mode
    (model_buffer_size 1). The previous model is the client's state; before its first round a client has
    none and its ``l_con`` is 0. The server is FedAvg; the global model is evaluated on the global test set.
    Defaults are the paper's; how paper 001 runs MOON: ``docs/algorithms.md``, MOON.

    Args:
        mu: weight of the model-contrastive term (1, the paper's CIFAR-100 value and the code's default).
        temperature: tau of the cosine-similarity softmax.
        (roles, weighted: as FedAvg; ``weighted: true`` is the code's sample-count weighting)
    """

    needs_split = True  # reads the models' features and head apart

    def __init__(
        self, mu: NonNegative = 1.0, temperature: Positive = 0.5, roles: list[str] | None = None, weighted: bool = True
    ):
        super().__init__(roles, weighted)
        self.mu, self.temperature = mu, temperature
        self._references: dict[str, FeatureClassifier] = {}  # frozen copies refilled each fit (not state)

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        if len(server.roles) != 1:
            raise ConfigError(
                f"MOON is homogeneous: every client must train the same model, but the tiers train {server.roles}; "
                "list one role in every tier."
            )
        role = server.roles[0]
        if getattr(server.model(role), "projection_dim", None) is None:
            raise ConfigError(
                f"MOON needs a projection head on its model; add projection_dim (256 in MOON's code) to "
                f"models.{role}, e.g. {role}: {{builder: digits_cnn, projection_dim: 256}}."
            )

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        received = task.received(role, ModelWeights).state
        module = ctx.load(role)
        load_exchanged(module.model, received)
        own = ctx.fits_run_later  # the executor runs the fit after the next client's update: copies of its own
        global_model = self._frozen("global", module.model, received, own)
        previous = ctx.state.get("previous")
        previous_models = [self._frozen("previous", module.model, previous, own)] if previous is not None else []
        mu, temperature = self.mu, self.temperature  # values, not the strategy, in the closure

        @vmappable  # pure (CUDA graphs); batched, each client's reference models are its own, so it runs alone
        def step(module, batch, i):
            x, y = batch
            z = module.model.features(x)
            loss = F.cross_entropy(module.model.head(z), y)
            if mu == 0:
                return loss
            with torch.no_grad():
                z_global = global_model.features(x)
                z_previous = [model.features(x) for model in previous_models]
            return loss + mu * model_contrastive_loss(z, z_global, z_previous, temperature)

        stats = ctx.fit(role, step_fn=step)
        weights = ctx.weights(role)
        ctx.state["previous"] = weights
        return ClientUpdate(
            task.client, ctx.num_examples(), {role: self.outgoing(role, weights)}, {f"{role}/loss": stats["loss"]}
        )

    def _frozen(self, kind: str, model: FeatureClassifier, weights: dict[str, Tensor], own: bool) -> FeatureClassifier:
        """What :func:`frozen` gives, without copying a module each fit: one frozen copy per kind, refilled
        in place (the same tensors every fit, so a CUDA graph of the step keeps its key). ``own``: a fit that runs
        after the next client's update (``ctx.fits_run_later``), which would refill that copy, gets its own."""
        if own:
            return frozen(model, weights)
        reference = self._references.get(kind)
        if reference is None:
            reference = self._references[kind] = frozen(model, weights)
            return reference
        with torch.no_grad():
            reference.load_state_dict(model.state_dict())  # as a fresh copy of the model would be
        load_exchanged(reference, weights)
        return reference

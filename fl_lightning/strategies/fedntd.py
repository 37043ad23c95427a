"""FedNTD: Lee, Jeong, Shin, Yun, "Preservation of the Global Knowledge by Not-True Distillation in Federated
Learning", NeurIPS 2022."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, Positive
from ..federation.types import ClientTask, ClientUpdate, ModelWeights, Role, load_exchanged
from ..knowledge.distillation import not_true_distillation_loss
from ..models.base import FeatureClassifier
from .base import ServerContext
from .fedavg import FedAvg
from .moon import frozen


class FedNTD(FedAvg):
    """Not-true distillation: FedAvg whose local loss keeps the global model's view of the classes a
    sample does not belong to.

    Each sampled client loads the global model and trains on ``CE(y, f(x)) + beta * L_NTD``, ``L_NTD`` the
    KL divergence from the received global model's softmax over the not-true classes (the true class's logit
    left out, temperature ``tau``) to the local model's, times ``tau^2``
    (:func:`~fl_lightning.knowledge.distillation.not_true_distillation_loss`); the global model is frozen
    and in eval mode. The server is FedAvg, weighted by example counts as the authors' code. The method is
    defined for one architecture: every client trains the same model (one role). Defaults are the authors'
    configuration (tau 1, beta 1); where the implementation follows the paper and where the code:
    ``docs/algorithms.md``, FedNTD.

    Args:
        beta: weight of the not-true distillation term (0: FedAvg).
        tau: temperature of both not-true softmaxes.
        (roles, weighted: as FedAvg)
    """

    def __init__(
        self, beta: NonNegative = 1.0, tau: Positive = 1.0, roles: list[str] | None = None, weighted: bool = True
    ):
        super().__init__(roles, weighted)
        self.beta, self.tau = beta, tau
        # per role one frozen copy of the global model, refilled once per round (not state: the task carries
        # the weights). Every client of a round distils from the same copy, so the batched executor groups
        # their steps (their closures hold one object) and CUDA graphs keep their key from round to round.
        self._global: dict[Role, tuple[int, FeatureClassifier]] = {}

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_architecture()

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        received = task.received(role, ModelWeights).state
        module = ctx.load(role)
        load_exchanged(module.model, received)
        teacher = self._frozen_global(role, task.round, module.model, received)
        beta, tau = self.beta, self.tau  # values, not the strategy, in the closure

        @vmappable  # pure: batched clients (one teacher object for all), CUDA graphs
        def step(module, batch, i):
            x, y = batch
            z = module.model(x)
            loss = F.cross_entropy(z, y)  # ignores a padded row's label PAD (batched clients in lockstep)
            if beta == 0:
                return loss
            with torch.no_grad():
                z_global = teacher(x)
            return loss + beta * not_true_distillation_loss(z, z_global, y, tau)

        stats = ctx.fit(role, step_fn=step)
        weights = self.outgoing(role, module.model.state_dict(), copy=True)
        return ClientUpdate(task.client, ctx.num_examples("train"), {role: weights}, {f"{role}/loss": stats["loss"]})

    def _frozen_global(self, role: Role, rnd: int, model: FeatureClassifier, weights: dict) -> FeatureClassifier:
        """The round's global model, frozen: one copy per role, refilled in place at a round's first client (all
        clients of a round receive the same weights, and every fit of a round has run before the next begins)."""
        held = self._global.get(role)
        if held is None:
            reference = frozen(model, weights)
        else:
            done, reference = held
            if done == rnd:
                return reference
            with torch.no_grad():
                reference.load_state_dict(model.state_dict())  # the client's model holds the received weights now
        self._global[role] = (rnd, reference)
        return reference

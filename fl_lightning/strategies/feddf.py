"""FedDF: Lin, Kong, Stich, Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated Learning",
NeurIPS 2020 (Algorithm 1; the appendix's algorithm for several model prototypes). The paper was not at
hand: its details here are recalled, not checked against its text."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ..federation.bounds import NonNegativeInt, Positive, PositiveInt
from ..federation.types import ClientUpdate
from ..knowledge.codistill import random_batches
from ..knowledge.distillation import kl_to_targets
from .base import ServerContext
from .fedavg import FedAvg


class FedDF(FedAvg):
    """FedAvg per model prototype, then server-side distillation of the clients' logit ensemble.

    Clients train their prototype's global model with cross-entropy and upload it, exactly as FedAvg (one
    role per client: each role is a prototype). The server, each round (Algorithm 1):

    1. averages each prototype's uploads weighted by labeled examples, where the distillation starts;
    2. averages every received model's eval-mode logits on the unlabeled server set over all the round's
       clients, of every prototype (AvgLogits; several prototypes each learn from the ensemble of all);
    3. trains each prototype that received uploads for ``steps`` Adam steps on batches drawn with
       replacement from the server set with ``T^2 KL(softmax(mean_k z_k / T) || softmax(z / T))`` and makes
       the student the new global model.

    Nothing is added to FedAvg's traffic. How the paper's and paper 001's settings map to the options:
    ``docs/algorithms.md``, FedDF.

    Args:
        steps: N, distillation steps per prototype and round (0: plain FedAvg).
        lr: Adam learning rate of the distillation (a fresh optimizer each round).
        batch_size: server examples per distillation step.
        temperature: T of the ensemble's and the student's softmax.
        (roles, weighted: as FedAvg; ``weighted: true`` is Algorithm 1's n_k / n)
    """

    central_privacy = False  # the ensemble predicts with every received model, not with their mean

    def __init__(
        self,
        steps: NonNegativeInt = 500,
        lr: Positive = 1e-3,
        batch_size: PositiveInt = 64,
        temperature: Positive = 1.0,
        roles: list[str] | None = None,
        weighted: bool = True,
    ):
        super().__init__(roles, weighted)
        self.steps, self.lr, self.batch_size, self.temperature = steps, lr, batch_size, temperature

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        self.server_x = server.server_inputs()
        self.teacher: Tensor | None = None  # the last round's ensemble targets [N_server, C], for inspection

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        # drawn before the clients run, so the batches depend on the round's server seed only
        generator = self.server.round_generator()
        logit_sum: Tensor | None = None
        members, trained = 0, set()

        def predicting(updates):
            """Each received model's logits join the ensemble as its update streams into FedAvg's average."""
            nonlocal logit_sum, members
            for update in updates:
                for role, payload in update.uplink.items():
                    # an upload leaves out a frozen part, identical to the global model's
                    weights = {**self.state.global_weights[role], **payload.state}
                    z = self.server.predict(role, weights, self.server_x).double()
                    logit_sum = z if logit_sum is None else logit_sum + z
                    members += 1
                    trained.add(role)
                yield update

        super().aggregate(rnd, predicting(updates))
        if logit_sum is None:  # no member: nothing to distill
            return {}
        self.teacher = F.softmax((logit_sum / members).float() / self.temperature, dim=1)
        for role in (r for r in self.roles if r in trained and self.steps):
            batches = itertools.islice(
                random_batches(self.server_x, self.teacher, self.batch_size, generator), self.steps
            )
            self.state.global_weights[role] = self.server.train(
                role,
                self.state.global_weights[role],
                batches,
                self.distillation_step,
                lambda params: torch.optim.Adam(params, lr=self.lr),
            )
        return {"server/ensemble_size": float(members)}

    def distillation_step(self, module, batch, i):
        x, targets = batch
        return kl_to_targets(module(x), targets, self.temperature)

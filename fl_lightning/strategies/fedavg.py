"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data", 2017."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..federation.errors import ConfigError
from ..federation.seeding import Owner, derive_seed
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Role,
    StateDict,
    load_exchanged,
)
from ..knowledge import WeightedAverage
from .base import SentWeights, ServerContext, Strategy, global_metrics


@dataclass
class FedAvgState:
    """What FedAvg carries from round to round."""

    global_weights: dict[Role, StateDict]  # per role, the global model's whole state dict


class FedAvg(Strategy):
    """Federated averaging, one global model per role.

    Each sampled client receives the global weights of every role it trains (among ``roles``), runs
    local SGD on its labeled data and sends the weights back; the server replaces each role's global
    weights with the mean over the clients that trained it, weighted by their number of labeled
    examples (``weighted: true``, McMahan et al. Algorithm 1) or uniformly (``weighted: false``, as in
    paper 001's code). With one role per architecture this is per-architecture averaging, and with a
    tier filter on the sampler it gives paper 001's weak-only and strong-only baselines.

    Weights travel as a deployment would send them: trainable parameters and the buffers of trainable
    parts only (:func:`~fl_lightning.federation.types.exchanged_keys`); a frozen backbone stays where it is.

    Args:
        roles: the roles to train; all roles of the population when not given.
        weighted: weight clients by their labeled example count.
        clients_per_round: per role, a cohort of that many clients drawn each round from all clients
            holding the role, instead of the sampler's clients (one FedAvg pool per role, paper 002).
    """

    state: FedAvgState
    central_privacy = True

    def __init__(
        self, roles: list[str] | None = None, weighted: bool = True, clients_per_round: dict[str, int] | None = None
    ):
        self.roles: list[str] = list(roles or [])  # empty: the population's roles, filled in at setup
        self.weighted = weighted
        self.clients_per_round = clients_per_round

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        roles = self.roles or server.roles
        unknown = [r for r in roles if r not in server.roles]
        if unknown:
            raise ConfigError(f"{self.name} roles {unknown} are not trained by any tier; tiers train {server.roles}.")
        self.roles = list(roles)
        self.state = FedAvgState({role: server.initial_weights(role) for role in self.roles})
        self.outgoing = SentWeights(server, self.roles)
        for role, k in (self.clients_per_round or {}).items():
            holders = sum(role in c.roles for c in server.clients)
            if role not in self.roles or not 1 <= k <= holders:
                raise ConfigError(
                    f"clients_per_round[{role!r}] = {k} is impossible: {holders} clients train that role."
                )

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        assigned: dict[int, list[str]] = {}
        for index, role in enumerate(self.roles):
            for client in self.cohort(rnd, role, index, clients):
                assigned.setdefault(client.id, []).append(role)
        return [
            ClientTask(
                self.server.clients[cid], rnd, {r: self.outgoing(r, self.state.global_weights[r]) for r in roles}
            )
            for cid, roles in sorted(assigned.items())
        ]

    def cohort(self, rnd: int, role: str, index: int, sampled: list) -> list:
        """The clients that train ``role`` this round: the sampled ones holding it, or, with
        ``clients_per_round[role]``, that many drawn from all its holders (paper 002 samples each pool)."""
        if not self.clients_per_round or role not in self.clients_per_round:
            return [c for c in sampled if role in c.roles]
        holders = [c for c in self.server.clients if role in c.roles]
        rng = np.random.default_rng(derive_seed(self.server.seed, rnd, Owner.COHORTS, index))
        return [holders[i] for i in np.sort(rng.choice(len(holders), self.clients_per_round[role], replace=False))]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        uplink, metrics = {}, {}
        for role in task.downlink:
            model = ctx.load(role).model
            load_exchanged(model, task.received(role, ModelWeights).state)
            metrics[f"{role}/loss"] = ctx.fit(role)["loss"]
            uplink[role] = self.outgoing(role, model.state_dict(), copy=True)
        return ClientUpdate(task.client, ctx.num_examples("train"), uplink, metrics)

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        weights = self.state.global_weights
        for role, average in self.client_averages(updates).items():
            weights[role] = {**weights[role], **average}  # a frozen part, never sent, stays
        return {}

    def client_averages(self, updates: Iterator[ClientUpdate]) -> dict[Role, StateDict]:
        """The round's uploads averaged per role, for the roles some client trained (streaming: one running
        sum per role, one client's weights at a time)."""
        averages = {role: WeightedAverage() for role in self.roles}
        for update in updates:
            for role in update.uplink:
                averages[role].add(update.sent(role, ModelWeights).state, update.num_samples if self.weighted else 1.0)
        results = {role: average.result() for role, average in averages.items() if average.count}
        if self.server.central_noise is not None:  # central differential privacy (run/privacy.py)
            return {role: self.private_average(role, mean, averages[role].count) for role, mean in results.items()}
        return results

    def private_average(self, role: Role, mean: StateDict, count: int) -> StateDict:
        """Central privacy's FedAvg (DP-FedAvg): each upload was the weights this round sent plus a clipped change,
        so ``count * (mean - sent)`` is the sum of the changes; the new weights are the weights sent plus that sum,
        noised, over the expected number of uploads of ``role`` (not ``count``, which would tell who took part).
        Integer buffers, sent back as received, stay."""
        sent = self.outgoing(role, self.state.global_weights[role]).state
        changes = {k: (v.double() - sent[k].double()) * count for k, v in mean.items() if v.dtype.is_floating_point}
        holders = [c for c in self.server.clients if role in c.roles]
        noised, expected = self.server.private_sum(changes, holders)
        return {k: (sent[k].double() + noised[k] / expected).to(v.dtype) if k in noised else v for k, v in mean.items()}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        return global_metrics(evaluator, self.state.global_weights)

    @property
    def monitor(self) -> str:
        return f"{self.roles[-1]}/test_acc"

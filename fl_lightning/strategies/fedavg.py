"""FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data", 2017."""

from __future__ import annotations

from ..client.context import ClientContext
from ..errors import ConfigError
from ..evaluation import Evaluator
from ..knowledge import WeightedAverage
from ..types import ClientTask, ClientUpdate, ModelWeights
from .base import ServerContext, Strategy


class FedAvg(Strategy):
    """Federated averaging, one global model per role.

    Each sampled client receives the global weights of every role it trains (among ``roles``), runs
    local SGD on its labeled data and sends the weights back; the server replaces each role's global
    weights with the mean over the clients that trained it, weighted by their number of labeled
    examples (``weighted: true``, McMahan et al. Algorithm 1) or uniformly (``weighted: false``, as in
    paper 001's code). With one role per architecture this is per-architecture averaging, and with a
    tier filter on the sampler it gives paper 001's weak-only and strong-only baselines.

    Args:
        roles: the roles to train; all roles of the population when not given.
        weighted: weight clients by their labeled example count.
    """

    state_attributes = ("global_weights",)

    def __init__(self, roles: list[str] | None = None, weighted: bool = True):
        self.roles = roles
        self.weighted = weighted

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        roles = self.roles or server.roles
        unknown = [r for r in roles if r not in server.roles]
        if unknown:
            raise ConfigError(f"FedAvg roles {unknown} are not trained by any tier; tiers train {server.roles}.")
        self.roles = list(roles)
        self.global_weights = {role: server.initial_weights(role) for role in self.roles}

    def configure_round(self, rnd, clients, phase="train"):
        tasks = []
        for client in clients:
            roles = [r for r in self.roles if r in client.roles]
            if roles:
                tasks.append(ClientTask(client, rnd, {r: ModelWeights(r, self.global_weights[r]) for r in roles}))
        return tasks

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        uplink, metrics = {}, {}
        for role, payload in task.downlink.items():
            ctx.load(role, payload.state)
            metrics[f"{role}/loss"] = ctx.fit(role)["loss"]
            uplink[role] = ModelWeights(role, ctx.weights(role))
        return ClientUpdate(task.client, ctx.num_examples("train"), uplink, metrics)

    def aggregate(self, rnd, updates, phase="train"):
        averages = {role: WeightedAverage() for role in self.roles}
        for update in updates:
            for role, payload in update.uplink.items():
                averages[role].add(payload.state, update.num_samples if self.weighted else 1.0)
        for role, average in averages.items():
            if average.count:
                self.global_weights[role] = average.result()
        return {}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        metrics = {}
        for role in self.roles:
            for name, value in evaluator.global_model(role, self.global_weights[role]).items():
                metrics[f"{role}/test_{name}"] = value
        return metrics

    @property
    def monitor(self) -> str:
        return f"{self.roles[-1]}/test_acc"

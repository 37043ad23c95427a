"""HeteroFL: Diao, Ding, Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for
Heterogeneous Clients", ICLR 2021 (Sec. 3.1-3.2, eq. 1-3, Algorithm 1)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.errors import ConfigError
from ..federation.seeding import Owner, Stream, derive_seed
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, Payload, StateDict, TensorPayload
from ..models.slicing import SLICEABLE_BUILDERS, batch_norm_statistics, not_a_slice, slice_state
from .base import ServerContext, Strategy, global_metrics


class SliceAverage:
    """HeteroFL's aggregation (eq. 3): each entry of the global model averaged, unweighted, over the
    clients whose sub-model holds it; an entry no client holds keeps its previous value.

    Output-layer entries (``row_keys``, the head: rows are classes) are averaged per class over the
    clients that have the class, when their uploads come with their label set (the official code's
    ``label_split``).
    """

    def __init__(self, like: StateDict, row_keys: set[str]):
        self.sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in like.items()}
        self.counts = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in like.items()}
        self.row_keys = row_keys

    def add(self, sub: StateDict, classes: Tensor | None = None) -> None:
        """Adds one client's sub-model; ``classes`` (bool ``[C]``) limits its output rows to those it has."""
        for k, v in sub.items():
            block = tuple(slice(0, n) for n in v.shape)
            held = torch.ones(v.shape, dtype=torch.float64, device=v.device)
            if classes is not None and k in self.row_keys:
                held = held * classes.to(held).view(-1, *([1] * (v.dim() - 1)))
            self.sums[k][block] += v.detach().double() * held
            self.counts[k][block] += held

    def result(self, previous: StateDict) -> StateDict:
        out = {}
        for k, old in previous.items():
            count = self.counts[k]
            mean = self.sums[k] / count.clamp(min=1.0)
            out[k] = torch.where(count > 0, mean, old.double()).to(old.dtype)
        return out


@dataclass
class HeteroFLState:
    """What HeteroFL's server carries from round to round."""

    global_weights: StateDict  # the rate-1 model's parameters (batch-norm statistics are never kept)


class HeteroFL(Strategy):
    """Width-sliced sub-models of one global model, aggregated where they overlap.

    The global model is the role built at ``rate: 1``; every other role is the same builder with a
    smaller ``rate`` (levels a-e: 1, 1/2, 1/4, 1/8, 1/16), whose layers keep the first ``ceil(r * n)``
    channels or units (``models/slicing.py``). A client receives the slice of the global parameters its
    rate holds, about ``r^2 |theta|`` numbers, trains it and sends it back with its label set; the server
    averages each entry over the clients holding it (:class:`SliceAverage`, eq. 3). As the paper and the
    official code: sliced layers divide their output by the rate in training (the builders' hook); batch
    norm is static (running statistics are never sent; the global model's are accumulated over every
    client's training data before evaluation); a client's logits of classes it has no example of are
    zeroed in its loss (``mask``). The global model is evaluated on the global test set. More, with the
    sliceable builders: ``docs/algorithms.md``, HeteroFL.

    Args:
        mode: ``dynamic`` draws every client's rate each round (every tier lists every rate role);
            ``fixed`` gives each client its tier's one role.
        proportions: dynamic mode's share of each rate role (equal shares when not given).
        label_split: average output rows only over clients that have the class (the code's ``label_split``).
        mask: zero the logits of a client's absent classes in its training loss (the code's ``mask``).
    """

    needs_split = True  # reads the models' features and head apart

    state: HeteroFLState

    def __init__(
        self,
        mode: Literal["dynamic", "fixed"] = "dynamic",
        proportions: dict[str, float] | None = None,
        label_split: bool = True,
        mask: bool = True,
    ):
        self.mode, self.proportions, self.label_split, self.mask = mode, proportions, label_split, mask

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        rates = {role: getattr(server.model(role), "width_rate", None) for role in server.roles}
        plain = [role for role, rate in rates.items() if rate is None]
        if plain:
            raise ConfigError(
                f"HeteroFL needs width-sliceable models, but role {plain[0]!r} is not built by a builder with a "
                f"rate argument; use one of {', '.join(SLICEABLE_BUILDERS)} with rate: 1, 0.5, 0.25, ..."
            )
        full = [role for role, rate in rates.items() if rate == 1]
        if len(full) != 1:
            raise ConfigError(
                f"HeteroFL needs exactly one role at rate 1 (the global model); the roles' rates are {rates}."
            )
        self.global_role, self.rates = full[0], rates
        self.shapes = {role: self.parameter_shapes(role) for role in server.roles}
        for role in server.roles:
            reason = not_a_slice(self.shapes[self.global_role], self.shapes[role])
            if reason:
                raise ConfigError(
                    f"HeteroFL role {role!r} is not a slice of the global role {self.global_role!r}: {reason}; "
                    "give every role the same builder and arguments, differing only in rate."
                )
        self.row_keys = {f"head.{name}" for name, _ in server.model(self.global_role).head.named_parameters()}
        initial = server.initial_weights(self.global_role)
        self.state = HeteroFLState({k: initial[k] for k in self.shapes[self.global_role]})
        self.check_rates(server)

    def parameter_shapes(self, role: str) -> dict[str, torch.Size]:
        """The role's parameters' shapes: what is sent (batch-norm statistics are not)."""
        names = self.server.parameter_names(role)
        return {k: v.shape for k, v in self.server.model(role).state_dict().items() if k in names}

    def check_rates(self, server: ServerContext) -> None:
        if self.mode == "fixed":
            server.require_one_role_per_client(" (mode fixed)")
            return
        shares = self.proportions or {role: 1.0 for role in server.roles}
        unknown = [role for role in shares if role not in server.roles]
        if unknown or not all(share >= 0 for share in shares.values()) or not sum(shares.values()) > 0:
            raise ConfigError(
                f"HeteroFL proportions must give non-negative shares of the roles {server.roles} (some positive); "
                f"got {shares}."
            )
        self.draw_roles = sorted(shares)
        self.draw_shares = np.array([shares[role] for role in self.draw_roles], dtype=float)
        lacking = [c.id for c in server.clients if not set(self.draw_roles) <= set(c.roles)]
        if lacking:
            raise ConfigError(
                f"HeteroFL mode dynamic draws each client's rate every round, so every tier must list every rate "
                f"role {self.draw_roles} (clients {lacking[:5]} do not); list them all, or use mode: fixed."
            )

    def round_roles(self, rnd: int) -> list[str]:
        """Every client's role this round, indexed by client id (the code draws one rate per user)."""
        if self.mode == "fixed":
            return [c.roles[0] for c in self.server.clients]
        rng = np.random.default_rng(derive_seed(self.server.seed, rnd, Owner.SERVER, Stream.SUBMODEL_RATE))
        picks = rng.choice(
            len(self.draw_roles), size=len(self.server.clients), p=self.draw_shares / self.draw_shares.sum()
        )
        return [self.draw_roles[i] for i in picks]

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        roles = self.round_roles(rnd)
        tasks = []
        for client in clients:
            role = roles[client.id]
            sub = slice_state(self.state.global_weights, self.shapes[role])
            tasks.append(ClientTask(client, rnd, {role: ModelWeights(role, sub)}))
        return tasks

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        (role,) = task.downlink
        payload = task.received(role, ModelWeights)
        module = ctx.load(role)
        # batch-norm statistics stay whatever the instance holds: training normalises with batch statistics
        module.model.load_state_dict({**module.model.state_dict(), **payload.state})
        labels = ctx.data_y[ctx.indices.train]
        classes = torch.bincount(labels, minlength=self.server.data.num_classes) > 0
        absent = ctx.on_device("absent_classes", ~classes)  # one address per name: CUDA graphs keep their key
        mask = self.mask  # a value, not the strategy, in the closure

        @vmappable  # pure: batched clients, CUDA graphs
        def step(module, batch, i):
            x, y = batch
            z = module(x)
            if mask:
                z = z.masked_fill(absent, 0.0)
            return F.cross_entropy(z, y)

        stats = ctx.fit(role, step_fn=step)
        trained = ctx.weights(role)
        uplink: dict[str, Payload] = {
            role: ModelWeights(role, {k: trained[k] for k in payload.state}),
            "label_split": TensorPayload("label_split", {"classes": classes}),
        }
        return ClientUpdate(task.client, ctx.num_examples(), uplink, {f"{role}/loss": stats["loss"]})

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        average = SliceAverage(self.state.global_weights, self.row_keys)
        for update in updates:
            classes = update.sent("label_split", TensorPayload).tensors["classes"] if self.label_split else None
            (sub,) = (update.sent(name, ModelWeights).state for name in update.uplink if name != "label_split")
            average.add(sub, classes)
        self.state.global_weights = average.result(self.state.global_weights)
        return {}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        weights = self.state.global_weights
        model = self.server.model(self.global_role)
        if set(model.state_dict()) != set(weights):  # batch norm: statistics of the global model first
            data = self.server.data
            train = torch.cat([c.train for c in data.clients])
            batches = (data.x[train[i : i + 512]] for i in range(0, len(train), 512))
            weights = batch_norm_statistics(model, weights, batches)
        return global_metrics(evaluator, {self.global_role: weights})

    @property
    def monitor(self) -> str:
        return f"{self.global_role}/test_acc"

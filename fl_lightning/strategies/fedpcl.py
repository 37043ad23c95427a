"""FedPCL: Tan et al., "Federated Learning from Pre-Trained Models: A Contrastive Learning Approach", NeurIPS 2022."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import Positive
from ..federation.errors import ConfigError
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, StateDict, TensorPayload
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.prototype_contrast import fill_missing, prototype_ce_loss, prototype_supcon_loss
from .base import PersonalModels, ServerContext, Split, Strategy
from .fedproto import dense_prototypes, prototype_head

UNIT_TOLERANCE = 1e-3  # how far from 1 a probed projection's length may be (float rounding)


@dataclass
class FedPCLState:
    """What FedPCL's server keeps between rounds."""

    client_prototypes: Tensor  # [N, C, D] every client's latest upload (zeros where it has no class)
    client_has: Tensor  # [N, C] bool: the classes of that upload
    global_prototypes: Tensor  # [C, D] the last round's uploads averaged per class
    global_has: Tensor  # [C] bool


class FedPCL(PersonalModels, Strategy):
    """Personal projections over frozen backbones, trained against class prototypes by contrastive losses.

    Client k keeps its own model, whose ``features`` end in unit-length projections ``z`` (the
    ``frozen_backbones`` builder: frozen extractors, then a trainable Linear + ReLU + L2 norm). Each round it
    receives the global prototypes ``P_g`` and every client's latest prototypes ``P_j`` (a set's missing classes
    filled from ``P_g``) and trains on ``loss: supcon``, the official code's supervised contrastive loss with
    the prototypes of each set as anchors, summed over the sets (:func:`prototype_supcon_loss`), or
    ``prototype_ce``, HtFLlib's ``CE(z P_g / tau) + 1/K sum_j CE(z P_j / tau)`` (:func:`prototype_ce_loss`).
    In round 1, before any prototype exists, it does not train. After training it uploads the class means of
    its projections over its training data (eval mode): ``S x (D + 1)`` numbers for S classes. The server
    keeps every client's latest upload and averages the round's uploads per class (unweighted) into ``P_g``;
    it sends ``R x (D + 1)`` numbers for the R classes of ``P_g`` and ``M x (D + 2)`` for the M rows of all
    clients' sets (each with its class and its client).

    Inference is by the nearest prototype (L2), the client's own (``inference: own``, the official code) or
    the global ones, run as a linear head; a client that has uploaded nothing yet uses the global ones, and
    before any prototype exists its own head is used. Paper, official code and HtFLlib compared:
    ``docs/algorithms.md``, FedPCL.

    Args:
        loss: ``supcon`` (official code) or ``prototype_ce`` (HtFLlib).
        tau: the temperature (0.07 in the official code; HtFLlib's versions 0.07 or 1.0).
        inference: nearest ``own`` prototype or nearest ``global`` prototype.
        split: where personal models are evaluated: ``test`` (each client's local test split, the official
            code) or ``global``.
    """

    needs_split = True  # reads the models' features and swaps their head

    state: FedPCLState

    def __init__(
        self,
        loss: Literal["supcon", "prototype_ce"] = "supcon",
        tau: Positive = 0.07,  # the temperature
        inference: Literal["own", "global"] = "own",
        split: Split = "test",
    ):
        self.loss, self.tau, self.inference, self.split = loss, tau, inference, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        feature_dim = server.shared_feature_dim(
            "compares every client's projections with every other's prototypes",
            "Give all roles the same projection_dim.",
        )
        server.require_linear_heads(
            "evaluates by the nearest prototype through a linear head", "Use the frozen_backbones builder."
        )
        for role in server.roles:
            self._check_unit_length(server, role)
            # no loss reads the head (evaluation replaces it by prototypes): frozen, it is a tensor no step leaves
            # without a gradient, which the batched executor needs, and the optimizer skips it as before
            server.model(role).head.requires_grad_(False)
        num_clients = max(c.id for c in server.clients) + 1
        self.num_classes, self.feature_dim = server.data.num_classes, feature_dim
        c, d = self.num_classes, self.feature_dim
        self.state = FedPCLState(
            torch.zeros(num_clients, c, d),
            torch.zeros(num_clients, c, dtype=torch.bool),
            torch.zeros(c, d),
            torch.zeros(c, dtype=torch.bool),
        )

    @staticmethod
    def _check_unit_length(server: ServerContext, role: str) -> None:
        """Refuses a model whose features are not L2-normalised: prototypes of unit vectors are what the losses
        and the nearest-prototype head compare (probed on a few examples in eval mode; nothing random runs)."""
        lengths = server.features(role, server.initial_weights(role), server.data.x[:8]).float().norm(dim=1)
        if lengths.max() > 1 + UNIT_TOLERANCE or lengths.max() < 1 - UNIT_TOLERANCE:
            raise ConfigError(
                f"FedPCL needs unit-length projections, but the features of role {role!r} have lengths up to "
                f"{lengths.max():.3g}; build it with frozen_backbones (its projection ends in an L2 normalisation)."
            )

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        state = self.state
        global_prototypes = ClassStatistics.padded(
            "global_prototypes", {"prototypes": state.global_prototypes}, state.global_has
        ).compact()
        owners, labels = torch.nonzero(state.client_has, as_tuple=True)
        client_sets = TensorPayload(
            "client_prototypes",
            {
                "prototypes": state.client_prototypes[owners, labels],  # [M, D]
                "labels": labels.to(torch.int32),
                "owners": owners.to(torch.int32),
            },
        )
        downlink = {"global_prototypes": global_prototypes, "client_prototypes": client_sets}
        return [ClientTask(c, rnd, dict(downlink)) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        device = ctx.data_x.device
        received = task.received("global_prototypes", ClassStatistics)
        global_prototypes, global_has = dense_prototypes(received, self.num_classes, device)
        metrics = {}
        if bool(global_has.any()):  # round 1 has no prototypes: nothing to train against yet (both codes)
            sets, has = self.received_sets(task.received("client_prototypes", TensorPayload), device)
            sets, has = fill_missing(sets, has, global_prototypes, global_has)
            step = self.local_step(
                ctx.on_device("global", global_prototypes),
                ctx.on_device("global_has", global_has),
                ctx.on_device("sets", sets),
                ctx.on_device("sets_has", has),
            )
            metrics[f"{role}/loss"] = ctx.fit(role, step_fn=step)["loss"]
        ctx.state["weights"] = ctx.weights(role)
        upload = self.local_prototypes(module, ctx)
        return ClientUpdate(task.client, ctx.num_examples(), {"local_prototypes": upload}, metrics)

    def local_step(self, global_prototypes: Tensor, global_has: Tensor, sets: Tensor, has: Tensor):
        """The step function of ``loss`` against the received prototypes (``[C, D]``, ``[C]``; ``[K, C, D]``,
        ``[K, C]``)."""
        tau, supcon = self.tau, self.loss == "supcon"  # values, not the strategy, in the closure

        @vmappable  # pure: batched clients, CUDA graphs
        def step(module, batch, i):
            x, y = batch
            z = module.features(x)
            if supcon:
                return prototype_supcon_loss(z, y, sets, has, tau)
            own_term = prototype_ce_loss(z, y, sets, has, tau)
            return prototype_ce_loss(z, y, global_prototypes[None], global_has[None], tau) + own_term

        return step

    def received_sets(self, payload: TensorPayload, device) -> tuple[Tensor, Tensor]:
        """``[K, C, D]`` prototypes and ``[K, C]`` availability of the K clients in ``payload``."""
        rows, labels, owners = (payload.tensors[k].to(device) for k in ("prototypes", "labels", "owners"))
        clients, position = torch.unique(owners.long(), return_inverse=True)
        sets = torch.zeros(len(clients), self.num_classes, self.feature_dim, device=device)
        has = torch.zeros(len(clients), self.num_classes, dtype=torch.bool, device=device)
        sets[position, labels.long()] = rows.to(sets.dtype)
        has[position, labels.long()] = True
        return sets, has

    @torch.no_grad()
    def local_prototypes(self, module, ctx: ClientContext) -> ClassStatistics:
        """Class means ``[S, D]`` of the eval-mode projections of the client's training data (compact)."""
        module.eval()
        idx, size = ctx.indices.train, ctx.eval_batch_size
        collector = ClassStatsCollector(self.num_classes, {"prototypes": self.feature_dim}, idx.device)
        for start in range(0, len(idx), size):
            chosen = idx[start : start + size]
            collector.add(ctx.data_y[chosen], prototypes=module.features(ctx.data_x[chosen]).float())
        return collector.result("local_prototypes").compact()

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        state = self.state
        sums = torch.zeros(self.num_classes, self.feature_dim, dtype=torch.float64)
        counts = torch.zeros(self.num_classes, dtype=torch.long)
        for update in updates:
            upload, cid = update.sent("local_prototypes", ClassStatistics), update.client.id
            labels, rows = upload.labels.long().cpu(), upload.vectors["prototypes"].detach().float().cpu()
            state.client_prototypes[cid] = 0.0  # the client's latest upload replaces its earlier one
            state.client_has[cid] = False
            state.client_prototypes[cid, labels] = rows
            state.client_has[cid, labels] = True
            sums[labels] += rows.double()
            counts[labels] += 1
        state.global_has = counts > 0
        state.global_prototypes = (sums / counts.clamp(min=1)[:, None]).float()
        return {"server/classes_with_prototype": float(state.global_has.sum())}

    # ------------------------------------------------------------------ evaluation
    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The client's model with the nearest-prototype head of its own (or the global) prototypes."""
        role, weights = super().personal_weights(client, state)
        prototypes, available = self.state.global_prototypes, self.state.global_has
        if self.inference == "own" and bool(self.state.client_has[client.id].any()):
            prototypes, available = self.state.client_prototypes[client.id], self.state.client_has[client.id]
        if not bool(available.any()):
            return role, weights
        device = weights["head.weight"].device
        head = prototype_head(prototypes.to(device), available.to(device))
        return role, {**weights, **{f"head.{k}": v.to(weights[f"head.{k}"].dtype) for k, v in head.items()}}

"""LG-FedAvg: Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", 2020 (Sec. 3, Algorithm 1; a baseline of paper 004)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from torch import nn

from ..client.context import ClientContext
from ..federation.errors import ConfigError
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, StateDict
from ..knowledge import WeightedAverage
from .base import PersonalModels, ServerContext, Split, Strategy


def shared_keys(model: nn.Module, global_layers: int | None) -> list[str]:
    """State-dict keys of the globally shared part: the head, or the top ``global_layers`` layers.

    A layer is a module without children that holds parameters or buffers; layers are taken in
    registration order, which is the forward order of the models here (features, then head).
    """
    if global_layers is None:
        return [k for k in model.state_dict() if k.startswith("head.")]
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if not list(module.children()) and (list(module.parameters(False)) or list(module.buffers(False)))
    ]
    if not 1 <= global_layers <= len(layers):
        raise ConfigError(
            f"LG-FedAvg global_layers must be between 1 and the model's {len(layers)} layers, got {global_layers}."
        )
    return [f"{name}.{key}" for name, module in layers[-global_layers:] for key in module.state_dict()]


@dataclass
class LGFedAvgState:
    """What LG-FedAvg's server carries from round to round."""

    global_weights: StateDict  # the global part (head or top layers), named as the first role names it


class LGFedAvg(PersonalModels, Strategy):
    """Local representations, global top layers: clients keep their lower layers and average the top ones.

    Each round a sampled client receives the global part, puts it on top of its own local layers, trains
    the whole model with cross-entropy on its data, keeps it and uploads the global part; the server
    averages the uploads (Algorithm 1). Both directions carry the global part only: the head (``global_layers:
    null``, HtFLlib's heterogeneous version that paper 004 measures, ``D x C + C`` numbers) or the top k
    layers (``global_layers: k``, the paper), matched by position across architectures, whose shapes must
    agree. Each client starts from its own initialisation with the initial global part on top. Which part
    the paper, HtFLlib and the official code share: ``docs/algorithms.md``, LG-FedAvg.

    Args:
        global_layers: the top k layers are global; ``None``: the head (HtFLlib, paper 004).
        weighted: weight the average by labeled examples (HtFLlib); ``false`` is the official code's plain mean.
        evaluate_with: ``global`` scores each client's local layers under the current global part (both
            codes copy it to every client after a round); ``local`` the model as the client last trained it.
        split: where personal models are evaluated: ``test`` (the local test split, paper 004) or ``global``.
    """

    name = "LG-FedAvg"
    state: LGFedAvgState

    def __init__(
        self,
        global_layers: int | None = None,
        weighted: bool = True,
        evaluate_with: Literal["global", "local"] = "global",
        split: Split = "test",
    ):
        self.needs_split = global_layers is None  # the shared part is then the model's head
        self.global_layers, self.weighted, self.evaluate_with, self.split = (
            global_layers,
            weighted,
            evaluate_with,
            split,
        )

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        self.keys = {r: shared_keys(server.model(r), self.global_layers) for r in server.roles}
        shapes = {r: [tuple(server.model(r).state_dict()[k].shape) for k in keys] for r, keys in self.keys.items()}
        if len({tuple(s) for s in shapes.values()}) != 1:
            part = "head" if self.global_layers is None else f"top {self.global_layers} layers"
            raise ConfigError(
                f"LG-FedAvg averages the {part} of every model, so they must have the same shapes; got {shapes}. "
                "Give the builders the same top layers (e.g. the same representation size)."
            )
        first = server.roles[0]
        self.names = self.keys[first]  # the global part's names on the wire: the first role's
        initial = server.initial_weights(first)
        self.state = LGFedAvgState({k: initial[k] for k in self.names})

    def with_global(self, role: str, local: StateDict, global_weights: StateDict) -> StateDict:
        """``local`` with the global part put in its place (matched by position for other architectures)."""
        return {**local, **{own: global_weights[name] for name, own in zip(self.names, self.keys[role])}}

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        shared = ModelWeights("global_layers", self.state.global_weights)
        return [ClientTask(c, rnd, {"global_layers": shared}) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        local = self.server.own_weights(task.client, ctx.state.get("weights"))
        ctx.load(role, self.with_global(role, local, task.received("global_layers", ModelWeights).state))
        stats = ctx.fit(role)
        trained = ctx.weights(role)
        ctx.state["weights"] = trained
        uplink = ModelWeights("global_layers", {name: trained[own] for name, own in zip(self.names, self.keys[role])})
        return ClientUpdate(task.client, ctx.num_examples(), {"global_layers": uplink}, {f"{role}/loss": stats["loss"]})

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        average = WeightedAverage()
        for update in updates:
            average.add(update.sent("global_layers", ModelWeights).state, update.num_samples if self.weighted else 1.0)
        if average.count:
            self.state.global_weights = average.result()
        return {}

    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The client's local model, with the current global part on top (``evaluate_with: global``)."""
        role, local = super().personal_weights(client, state)
        if self.evaluate_with == "global":
            local = self.with_global(role, local, self.state.global_weights)
        return role, local

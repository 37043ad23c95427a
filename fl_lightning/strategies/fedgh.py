"""FedGH: Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header" (paper 004)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from torch import nn

from ..client.context import ClientContext
from ..federation.bounds import NonNegative
from ..federation.errors import ConfigError
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, StateDict, clone_state
from ..knowledge.class_stats import ClassStatistics, class_means
from ..knowledge.header import train_header
from .base import PersonalModels, ServerContext, Strategy


@dataclass
class FedGHState:
    """What FedGH's server carries from round to round."""

    header: StateDict  # the global prediction header, an nn.Linear's "weight" [C, D] and "bias" [C]


class FedGH(PersonalModels, Strategy):
    """Personalized heterogeneous feature extractors sharing one global prediction header.

    Each round (Algorithm 1) a client loads its own extractor and the global header, trains the whole
    model on its local data, keeps the trained model, and uploads its local averaged
    representation (LAR) of every class it holds: the mean ``features`` output of its training data in
    eval mode, with the class label, ``S * (D + 1)`` numbers for S classes (Sec. 4.3). The server takes
    SGD steps of cross-entropy on the global header with learning rate ``header_lr`` (eta_g), clients
    in arrival order, and broadcasts the header (``D * C + C`` numbers).

    The personalized model of a client is its locally trained model, extractor and header after its
    last local training (what Algorithm 1 returns and the official code evaluates). It is evaluated on
    each client's local test split, so recipes set ``data.local_split``, e.g. [0.8, 0.1, 0.1].

    Args:
        header_lr: eta_g (0.01 in the paper).
        header_update: ``per_lar``, one SGD step per uploaded class representation (eq. 4 as written,
            the code's loop); ``per_client``, one step on the mean loss over a client's LARs.
        evaluate_with: ``local``, each client's locally trained header (paper, code); ``global_header``,
            each client's extractor with the current global header.
    """

    needs_split = True  # reads the models' features and head apart

    split = "test"  # personal models are evaluated on each client's local test split
    state: FedGHState

    def __init__(
        self,
        header_lr: NonNegative = 0.01,  # 0: the global header stays as initialised (a test isolates the LARs so)
        header_update: Literal["per_lar", "per_client"] = "per_lar",
        evaluate_with: Literal["local", "global_header"] = "local",
    ):
        self.header_lr, self.header_update, self.evaluate_with = header_lr, header_update, evaluate_with

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        heads = {r: server.model(r).head for r in server.roles}
        shapes = {r: (h.in_features, h.out_features) if isinstance(h, nn.Linear) else None for r, h in heads.items()}
        shape = shapes[server.roles[0]]
        if shape is None or len(set(shapes.values())) != 1:
            raise ConfigError(
                f"FedGH needs every role's head to be one nn.Linear of the same shape (the shared "
                f"header); got {shapes}. Give all builders the same representation size."
            )
        self.state = FedGHState(clone_state(heads[server.roles[0]].state_dict()))
        self.num_classes = server.data.num_classes
        self.feature_dim = shape[0]

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        header = ModelWeights("header", self.state.header)
        return [ClientTask(c, rnd, {"header": header}) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        local = self.server.own_weights(task.client, ctx.state.get("weights"))
        header = task.received("header", ModelWeights).state
        weights = {**local, **{f"head.{k}": v for k, v in header.items()}}  # eq. 5
        module = ctx.load(role, weights)
        stats = ctx.fit(role)
        ctx.state["weights"] = ctx.weights(role)  # the header too: the local model is what gets evaluated
        lars = self.local_averaged_representations(module, ctx)
        return ClientUpdate(task.client, ctx.num_examples(), {"lars": lars}, {f"{role}/loss": stats["loss"]})

    def local_averaged_representations(self, module, ctx: ClientContext) -> ClassStatistics:
        """Class means ``[S, D]`` of eval-mode representations over the local training data (compact)."""
        module.eval()
        dims = ("representations", self.feature_dim)
        return class_means(
            module.features,
            ctx.data_x,
            ctx.data_y,
            ctx.indices.train,
            ctx.eval_batch_size,
            dims,
            self.num_classes,
            "lars",
        )

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        weight = self.state.header["weight"]  # [C, D]
        header = nn.Linear(weight.shape[1], weight.shape[0]).to(weight.device)
        header.load_state_dict(self.state.header)
        losses, per_lar = [], self.header_update == "per_lar"
        for update in updates:  # clients in arrival order
            lars = update.sent("lars", ClassStatistics)
            reps, labels = lars.vectors["representations"], lars.labels.long()
            losses += train_header(header, reps, labels, self.header_lr, per_lar)
        self.state.header = clone_state(header.state_dict())
        return {"server/header_loss": sum(losses) / max(len(losses), 1)}

    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The client's locally trained model (its own initial one before it first trains), with the global
        header in place of its own under ``evaluate_with: global_header``."""
        role, local = super().personal_weights(client, state)
        if self.evaluate_with == "global_header":
            local = {**local, **{f"head.{k}": v for k, v in self.state.header.items()}}
        return role, local

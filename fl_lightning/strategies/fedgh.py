"""FedGH: Yi et al., "FedGH: Heterogeneous Federated Learning with Generalized Global Header" (paper 004)."""

from __future__ import annotations

import torch
from torch import nn

from ..client.context import ClientContext
from ..errors import ConfigError
from ..evaluation import Evaluator
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.header import header_step
from ..types import ClientTask, ClientUpdate, ModelWeights
from .base import ServerContext, Strategy


class FedGH(Strategy):
    """Personalized heterogeneous feature extractors sharing one global prediction header.

    Each round (Algorithm 1) a client loads its own extractor and the global header, trains the whole
    model on its local data, keeps everything but the header, and uploads its local averaged
    representation (LAR) of every class it holds: the mean ``features`` output of its training data in
    eval mode, with the class label, ``S * (D + 1)`` numbers for S classes (Sec. 4.3). The server takes
    one SGD step of cross-entropy on the global header per client's LARs, in arrival order, with
    learning rate ``header_lr`` (eta_g), and broadcasts the header (``D * C + C`` numbers).

    Personalized models (a client's extractor with the current global header) are evaluated on each
    client's local test split, so recipes set ``data.local_split``, e.g. [0.8, 0.1, 0.1].

    Args:
        header_lr: eta_g (0.01 in the paper).
    """

    state_attributes = ("header",)

    def __init__(self, header_lr: float = 0.01):
        self.header_lr = header_lr

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client("FedGH")
        heads = {r: server.model(r).head for r in server.roles}
        shapes = {r: (h.in_features, h.out_features) if isinstance(h, nn.Linear) else None for r, h in heads.items()}
        if None in shapes.values() or len(set(shapes.values())) != 1:
            raise ConfigError(
                f"FedGH needs every role's head to be one nn.Linear of the same shape (the shared "
                f"header); got {shapes}. Give all builders the same representation size."
            )
        self.header = {k: v.detach().clone() for k, v in heads[server.roles[0]].state_dict().items()}
        self.num_classes = server.data.num_classes
        self.feature_dim = shapes[server.roles[0]][0]

    def configure_round(self, rnd, clients, phase="train"):
        header = ModelWeights("header", self.header)
        return [ClientTask(c, rnd, {"header": header}) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        body = self.server.own_weights(task.client, ctx.state.get("body"))
        weights = {**body, **{f"head.{k}": v for k, v in task.downlink["header"].state.items()}}
        module = ctx.load(role, weights)
        stats = ctx.fit(role)
        ctx.state["body"] = {k: v for k, v in ctx.weights(role).items() if not k.startswith("head.")}
        lars = self.local_averaged_representations(module, ctx)
        return ClientUpdate(task.client, ctx.num_examples(), {"lars": lars}, {f"{role}/loss": stats["loss"]})

    @torch.no_grad()
    def local_averaged_representations(self, module, ctx: ClientContext) -> ClassStatistics:
        """Class means ``[S, D]`` of eval-mode representations over the local training data (compact)."""
        module.eval()
        idx, size = ctx.indices.train, ctx.loop.training.eval_batch_size
        collector = ClassStatsCollector(self.num_classes, {"representations": self.feature_dim}, idx.device)
        for start in range(0, len(idx), size):
            chosen = idx[start : start + size]
            collector.add(ctx.data_y[chosen], representations=module.features(ctx.data_x[chosen]))
        return collector.result("lars").compact()

    def aggregate(self, rnd, updates, phase="train"):
        header = nn.Linear(self.header["weight"].shape[1], self.header["weight"].shape[0]).to(
            self.header["weight"].device
        )
        header.load_state_dict(self.header)
        losses = []
        for update in updates:  # one step per client, in arrival order
            lars = update.uplink["lars"]
            losses.append(header_step(header, lars.vectors["representations"], lars.labels.long(), self.header_lr))
        self.header = {k: v.detach().clone() for k, v in header.state_dict().items()}
        return {"server/header_loss": sum(losses) / max(len(losses), 1)}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        return evaluator.personalized(self.personal_weights, split="test")

    def personal_weights(self, client, state):
        body = self.server.own_weights(client, state.get("body"))
        return client.roles[0], {**body, **{f"head.{k}": v for k, v in self.header.items()}}

    @property
    def monitor(self) -> str:
        return "personal/test_acc"

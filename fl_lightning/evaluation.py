"""Evaluation of global and personalized models on held-out data."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .client.loop import LocalLoop
from .data import FederatedData
from .types import PAD, ClientSpec, StateDict


class Evaluator:
    """Evaluates role weights on the global test set or a client's local split.

    Weights are loaded into the role's shared instance (no new module is built); results are exact
    sums over the whole split, independent of the batch size.
    """

    def __init__(
        self,
        loop: LocalLoop,
        data: FederatedData,
        clients: list[ClientSpec] | None = None,
        client_states: dict[int, dict] | None = None,
    ):
        self.loop = loop
        self.data = data
        self.clients = clients or []
        self.client_states = client_states if client_states is not None else {}
        self.per_client: dict[int, float] = {}  # personal accuracy of each client at the last evaluation

    def global_model(self, role: str, weights: StateDict | None) -> dict[str, float]:
        """Accuracy and mean cross-entropy of ``weights`` on the global test set (and ``acc_<name>`` on
        each of the data set's extra test sets)."""
        result = self._run(role, weights, self.data.test_x, self.data.test_y)
        for name, (x, y) in self.data.extra_tests.items():
            result[f"acc_{name}"] = self._run(role, None, x, y)["acc"]
        return result

    def personal(self, role: str, weights: StateDict | None, client_id: int, split: str = "test") -> dict[str, float]:
        """Accuracy and loss of a client's model on its local ``split`` (``test`` or ``val``)."""
        idx = getattr(self.data.clients[client_id], split)
        if len(idx) == 0:
            raise ValueError(
                f"client {client_id} has an empty local {split} split; set data.local_split, e.g. [0.8, 0.1, 0.1]"
            )
        return self._run(role, weights, self.data.x[idx], self.data.y[idx])

    def personalized(
        self,
        weights_of: Callable[[ClientSpec, dict], tuple[str, StateDict]],
        split: str = "global",
        prefix: str = "personal",
    ) -> dict[str, float]:
        """Mean, spread and per-tier mean accuracy of every client's own model.

        Args:
            weights_of: gives a client's (role, weights) from the client and its persistent state.
            split: ``global`` evaluates each client on the global test set (FedHe, Felo); ``test`` on its
                local test split (FedGH's 8:1:1 setting).
            prefix: metric name prefix.
        """
        accs: dict[str, list[float]] = {}
        losses = []
        for client in self.clients:
            role, weights = weights_of(client, self.client_states.get(client.id, {}))
            result = (
                self.global_model(role, weights)
                if split == "global"
                else self.personal(role, weights, client.id, split)
            )
            accs.setdefault(client.tier, []).append(result["acc"])
            losses.append(result["loss"])
        every = [a for tier in accs.values() for a in tier]
        self.per_client = {client.id: acc for client, acc in zip(self.clients, self._in_order(accs))}
        metrics = {
            f"{prefix}/test_acc": float(np.mean(every)),
            f"{prefix}/test_acc_std": float(np.std(every)),
            f"{prefix}/test_acc_min": float(np.min(every)),
            f"{prefix}/test_loss": float(np.mean(losses)),
        }
        if len(accs) > 1:
            metrics.update({f"{prefix}/{tier}/test_acc": float(np.mean(v)) for tier, v in accs.items()})
        return metrics

    def _in_order(self, accs: dict[str, list[float]]) -> list[float]:
        """Per-tier lists back in client order (for reports of the per-client distribution)."""
        cursor = {tier: iter(values) for tier, values in accs.items()}
        return [next(cursor[client.tier]) for client in self.clients]

    @torch.no_grad()
    def _run(self, role: str, weights: StateDict | None, x: Tensor, y: Tensor) -> dict[str, float]:
        module = self.loop.slots[role].module
        if weights is not None:
            module.model.load_state_dict(weights)
        module.eval()
        loss_sum = torch.zeros((), device=x.device)
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        size = self.loop.training.eval_batch_size
        with self.loop.fabric.autocast():
            for start in range(0, len(y), size):
                loss, right = module.test_step((x[start : start + size], y[start : start + size]))
                loss_sum += loss.float()
                correct += right
        n = max(int((y != PAD).sum()), 1)  # tokens for sequence targets, examples otherwise
        return {"acc": correct.item() / n, "loss": loss_sum.item() / n}

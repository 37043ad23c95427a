"""Evaluation of global and personalized models on held-out data."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import numpy as np
import torch
from torch import Tensor

from ..data import FederatedData
from ..distributed.ranks import current_ranks, exchange
from ..federation.errors import ConfigError
from ..federation.seeding import Owner, Stream, derive_seed
from ..federation.types import PAD, ClientSpec, StateDict
from ..models import FeatureClassifier
from .loop import LocalLoop
from .module import ClientModule
from .stacked_eval import StackedEvaluation

log = logging.getLogger(__name__)
COLLAPSED = 0.95  # a global model predicting one class for this share of the test set has collapsed


class ClientStates(Protocol):
    """Every client's persistent state by client id, as the evaluator reads it: a mapping, or the run's store
    (``run.client_store.ClientStateStore``)."""

    def get(self, client_id: int, default: dict, /) -> Any: ...

    def __contains__(self, client_id: int, /) -> bool: ...


@dataclass
class PersonalEvaluation:
    """Which clients a personalized evaluation covers (every client at every evaluation by default).

    Every client of a personalized method starts from its own seeded model, so a client that never
    trained still costs a model build and a pass over the test set: linear in the population. These
    options bound that cost; whenever an evaluation covers fewer clients than the population, its row
    says how many in ``personal/clients_evaluated`` (the ``personal/`` metrics are over those clients).

    Attributes:
        sample: evaluate a seeded sample of this many clients at each evaluation but the last round's,
            which evaluates them all; ``None`` evaluates them all every time.
        untrained: ``evaluate`` clients that never trained with their initial model (as every client is
            by default), or ``skip`` them: the metrics are then over the clients that have trained.
        clients_per_batch: evaluate up to this many clients of one architecture together on the global
            test set (their weights stacked, one batched forward pass per test batch: ``torch.func.vmap``);
            1 evaluates one client at a time. Metrics equal one at a time's to float tolerance (bit for
            bit on linear layers, within a few units in the last place through convolutions); models
            vmap cannot run (LSTMs), local test splits and models a strategy assembles from several roles'
            (FedMRL's fused models) are evaluated one client at a time. Memory grows with it: this many
            copies of the weights and of a test batch's activations.
        average: what ``personal/test_acc`` (and each tier's) averages: ``clients``, the mean of every client's
            accuracy; ``examples``, the share of all evaluated examples classified correctly, each client
            weighted by its examples (HtFLlib's sum of correct predictions over the sum of samples). The loss
            follows it; ``personal/test_acc_std`` and ``_min`` stay over clients.
    """

    sample: int | None = None
    untrained: Literal["evaluate", "skip"] = "evaluate"
    clients_per_batch: int = 1
    average: Literal["clients", "examples"] = "clients"

    def __post_init__(self):
        if not isinstance(self.clients_per_batch, int) or self.clients_per_batch < 1:
            raise ConfigError(
                f"evaluation.clients_per_batch must be a whole number of at least 1 (1: one client at a time), "
                f"got {self.clients_per_batch!r}; e.g. 64."
            )
        if self.sample is not None and self.sample < 1:
            raise ConfigError(
                f"evaluation.sample must be at least 1 (or null: every client), got {self.sample}; e.g. 100."
            )


class Evaluator:
    """Evaluates role weights on the global test set or a client's local split.

    Weights are loaded into the role's shared instance (no new module is built); results are exact
    sums over the whole split, independent of the batch size. ``plan`` and ``seed`` choose the clients a
    personalized evaluation covers (:class:`PersonalEvaluation`); the orchestrator calls :meth:`begin`
    before each evaluation.
    """

    def __init__(
        self,
        loop: LocalLoop,
        data: FederatedData,
        clients: list[ClientSpec] | None = None,
        client_states: ClientStates | None = None,
        plan: PersonalEvaluation | None = None,
        seed: int = 0,
    ):
        self.loop = loop
        self.data = data
        self.clients = clients or []
        self.client_states: ClientStates = client_states if client_states is not None else {}
        self.plan = plan or PersonalEvaluation()
        self.seed = seed
        self.round, self.final = 0, True
        self.per_client: dict[int, float] = {}  # personal accuracy of each client at the last evaluation
        self._stacked: dict[str, StackedEvaluation | None] = {}  # per role; None: evaluated one at a time
        self._most_stacked: dict[str, int] = {}  # per role, the most clients stacked since more ran out of memory
        self.validation: dict[str, dict[str, float]] = {}  # per role, this evaluation's scores on the val splits
        self._pooled_val: tuple[Tensor, Tensor] | None = None
        self._wrappers: dict[str, ClientModule] = {}  # strategies' assembled models in their module wrapper

    def begin(self, rnd: int, final: bool) -> None:
        """The evaluation of round ``rnd`` starts (``final``: the run's last round, which covers every client)."""
        self.round, self.final = rnd, final
        self.validation = {}

    @property
    def validating(self) -> bool:
        """Whether the clients hold local val splits (a val share in ``data.local_split``): global models are then
        also scored on them, pooled, so that tuning can choose on data the test set does not hold."""
        split = getattr(self.data, "local_split", (1.0, 0.0, 0.0))
        return split[1] > 0

    def validation_metrics(self) -> dict[str, float]:
        """``<role>/val_acc`` and ``<role>/val_loss`` of the global models this evaluation scored."""
        return {
            f"{role}/val_{name}": scores[name] for role, scores in self.validation.items() for name in ("acc", "loss")
        }

    def _val_set(self) -> tuple[Tensor, Tensor]:
        """Every client's local val split, pooled (the partition is fixed for the run: gathered once)."""
        if self._pooled_val is None:
            idx = torch.cat([client.val for client in self.data.clients])
            self._pooled_val = (self.data.x[idx], self.data.y[idx])
        return self._pooled_val

    def global_model(self, role: str, weights: StateDict | None) -> dict[str, float]:
        """Accuracy, mean cross-entropy and ``top_class_share`` of ``weights`` on the global test set (and
        ``acc_<name>`` on each of the data set's extra test sets).

        With local val splits (:attr:`validating`) it also scores ``weights`` on them, for
        :meth:`validation_metrics`. ``top_class_share`` is the share of test examples given the most predicted
        class; a model that gives one class to at least 95% of them (where the labels are not that skewed) has
        collapsed, a
        warning says so (docs/algorithms.md, "What the digits recipes reach").
        """
        result = self._on_test_sets(role, weights)
        if self.validating:  # the weights are loaded: the pooled val splits with them
            self.validation[role] = self._run(role, None, *self._val_set(), shared=True)
        labels = self.data.test_y[self.data.test_y != PAD]
        if result["top_class_share"] >= COLLAPSED > _top_share(torch.bincount(labels.flatten())):
            log.warning(
                "%s gives one class to %.0f%% of the %d test examples at round %d: the model has collapsed "
                "(diverged or dead units); if it lasts, lower the learning rate or standardise the inputs.",
                role,
                100 * result["top_class_share"],
                len(labels),
                self.round,
            )
        return result

    def _on_test_sets(self, role: str, weights: StateDict | None) -> dict[str, float]:
        result = self._run(role, weights, self.data.test_x, self.data.test_y, shared=True)
        for name, (x, y) in self.data.extra_tests.items():
            result[f"acc_{name}"] = self._run(role, None, x, y, shared=True)["acc"]
        return result

    def personal(self, role: str, weights: StateDict | None, client_id: int, split: str = "test") -> dict[str, float]:
        """Accuracy and loss of a client's model on its local ``split`` (``test`` or ``val``)."""
        return self._run(role, weights, *self._split(client_id, split))

    def _split(self, client_id: int, split: str) -> tuple[Tensor, Tensor]:
        idx = getattr(self.data.clients[client_id], split)
        if len(idx) == 0:
            raise ValueError(
                f"client {client_id} has an empty local {split} split; set data.local_split, e.g. [0.8, 0.1, 0.1]"
            )
        return self.data.x[idx], self.data.y[idx]

    def personalized(
        self,
        weights_of: Callable[[ClientSpec, dict], tuple[str, StateDict]],
        split: str = "global",
        prefix: str = "personal",
        models: Mapping[str, torch.nn.Module] | None = None,
    ) -> dict[str, float]:
        """Mean, spread and per-tier mean accuracy of every client's own model (or of those ``plan`` covers).

        Args:
            weights_of: gives a client's (role, weights) from the client and its persistent state.
            split: ``global`` evaluates each client on the global test set (FedHe, Felo); ``test`` on its
                local test split (FedGH's 8:1:1 setting).
            prefix: metric name prefix.
            models: a model the strategy assembles from the roles' instances, per name that ``weights_of``
                gives instead of a role (FedMRL's fused model: two extractors, a projector and a head); the
                weights are loaded into it and clients are evaluated one at a time.
        """
        covered = self._covered()
        if not covered:  # `untrained: skip` before any client trained
            nan = float("nan")
            self.per_client = {}
            names = ("test_acc", "test_acc_std", "test_acc_min", "test_loss")
            return {**{f"{prefix}/{name}": nan for name in names}, f"{prefix}/clients_evaluated": 0.0}
        accs: dict[str, list[float]] = {}
        losses, counts = [], []
        for client, (acc, loss) in zip(covered, self._scores(covered, weights_of, split, models)):
            accs.setdefault(client.tier, []).append(acc)
            losses.append(loss)
            if self.plan.average == "examples":
                counts.append(self._examples(client, split))
        every = [a for tier in accs.values() for a in tier]
        self.per_client = {client.id: acc for client, acc in zip(covered, self._in_order(accs, covered))}
        metrics = {
            f"{prefix}/test_acc": float(np.mean(every)),
            f"{prefix}/test_acc_std": float(np.std(every)),
            f"{prefix}/test_acc_min": float(np.min(every)),
            f"{prefix}/test_loss": float(np.mean(losses)),
        }
        if len(accs) > 1:
            metrics.update({f"{prefix}/{tier}/test_acc": float(np.mean(v)) for tier, v in accs.items()})
        if self.plan.average == "examples":  # HtFLlib's: correct predictions over samples, all clients together
            metrics.update(self._pooled(covered, self._in_order(accs, covered), losses, counts, prefix))
        if len(covered) < len(self.clients):  # the row says what its personal metrics cover
            metrics[f"{prefix}/clients_evaluated"] = float(len(covered))
        return metrics

    def _examples(self, client: ClientSpec, split: str) -> int:
        """How many labels a client's personal evaluation on ``split`` scores."""
        labels = self.data.test_y if split == "global" else self.data.y[getattr(self.data.clients[client.id], split)]
        return int((labels != PAD).sum())

    @staticmethod
    def _pooled(
        covered: list[ClientSpec], accs: list[float], losses: list[float], counts: list[int], prefix: str
    ) -> dict[str, float]:
        """``average: examples``: the personal accuracy and loss (and each tier's accuracy) over all examples,
        each client's share weighted by its number of examples."""
        metrics = {
            f"{prefix}/test_acc": float(np.average(accs, weights=counts)),
            f"{prefix}/test_loss": float(np.average(losses, weights=counts)),
        }
        tiers = dict.fromkeys(client.tier for client in covered)
        if len(tiers) > 1:
            for tier in tiers:
                mine = [i for i, client in enumerate(covered) if client.tier == tier]
                metrics[f"{prefix}/{tier}/test_acc"] = float(
                    np.average([accs[i] for i in mine], weights=[counts[i] for i in mine])
                )
        return metrics

    def _scores(
        self,
        covered: list[ClientSpec],
        weights_of: Callable[[ClientSpec, dict], tuple[str, StateDict]],
        split: str,
        models: Mapping[str, torch.nn.Module] | None = None,
    ) -> list[tuple[float, float]]:
        """``(accuracy, mean loss)`` of each covered client's model, in the order of ``covered``.

        Personal models may rightly favour their client's classes: no collapse warning. ``weights_of`` is
        called in client order whichever way the clients are evaluated (a client's initial weights reseed
        torch's generator, so the order decides where it is left), on every rank. With several ranks each
        evaluates its share (every ``world``-th client, or chunk of clients evaluated together: the chunks
        of one process, so each score is computed as there) and the ranks exchange their scores.
        """
        ranks = current_ranks()
        # one at a time: local splits differ per client, and a strategy's assembled models are not stacked
        if models is not None or split != "global" or self.plan.clients_per_batch == 1:
            if split != "global" and ranks.world > 1:
                for client in covered:  # an empty split fails every rank alike, not one while the others wait
                    if not len(getattr(self.data.clients[client.id], split)):
                        self._split(client.id, split)  # its message
            scores = {}
            for position, client in enumerate(covered):
                role, weights = weights_of(client, self.client_states.get(client.id, {}))
                if position % ranks.world != ranks.rank:
                    continue  # another rank's share
                x, y = (self.data.test_x, self.data.test_y) if split == "global" else self._split(client.id, split)
                module = self._assembled(role, models[role]) if models is not None else None
                scores[position] = _acc_loss(self._run(role, weights, x, y, module=module))
            return _every_ranks(scores, len(covered))
        return _every_ranks(self._stacked_scores(covered, weights_of, ranks.rank, ranks.world), len(covered))

    def _stacked_scores(
        self,
        covered: list[ClientSpec],
        weights_of: Callable[[ClientSpec, dict], tuple[str, StateDict]],
        rank: int = 0,
        world: int = 1,
    ) -> dict[int, tuple[float, float]]:
        """Clients of one role evaluated together, ``plan.clients_per_batch`` at a time, on the global test set;
        this rank's chunks only (every ``world``-th, counted in the order they fill), by position in ``covered``."""
        scores: dict[int, tuple[float, float]] = {}
        pending: dict[str, list[tuple[int, StateDict]]] = {}
        chunks = 0
        for position, client in enumerate(covered):
            role, weights = weights_of(client, self.client_states.get(client.id, {}))
            pending.setdefault(role, []).append((position, weights))
            if len(pending[role]) == self.plan.clients_per_batch:
                chunk = pending.pop(role)
                if chunks % world == rank:
                    scores.update(self._evaluate_together(role, chunk))
                chunks += 1
        for role, chunk in pending.items():
            if chunks % world == rank:
                scores.update(self._evaluate_together(role, chunk))
            chunks += 1
        return scores

    def _evaluate_together(self, role: str, chunk: list[tuple[int, StateDict]]) -> dict[int, tuple[float, float]]:
        """One chunk of a role's clients batched, or one at a time where the role's model cannot be batched."""
        x, y = self.data.test_x, self.data.test_y
        if role not in self._stacked:
            model, size = self.loop.slots[role].module.model, self.loop.training.eval_batch_size
            self._stacked[role] = StackedEvaluation(model, size, self.loop.fabric.autocast)
        stacked = self._stacked[role]
        most = self._most_stacked.get(role, len(chunk))
        if stacked is not None and len(chunk) > most:
            return {
                k: v
                for start in range(0, len(chunk), most)
                for k, v in self._evaluate_together(role, chunk[start : start + most]).items()
            }
        if stacked is not None:
            try:
                scores = stacked.scores([weights for _, weights in chunk], x, y)
            except torch.OutOfMemoryError:  # too many clients' models at once for the device: halves, still stacked
                if len(chunk) == 1:
                    return {position: _acc_loss(self._run(role, weights, x, y)) for position, weights in chunk}
                half = -(-len(chunk) // 2)
                self._most_stacked[role] = half  # later evaluations start from what fitted
                log.warning("%s: %d clients evaluated at once exceed the device's memory; halving", role, len(chunk))
                return {**self._evaluate_together(role, chunk[:half]), **self._evaluate_together(role, chunk[half:])}
            except Exception as err:  # noqa: BLE001 - vmap cannot run every model (LSTMs: no batching rule)
                log.warning("%s's clients are evaluated one at a time: batched evaluation failed (%s)", role, err)
                self._stacked[role] = None
            else:
                if not stacked.slow:
                    return {position: score for (position, _), score in zip(chunk, scores)}
                # vmap looped over the clients for some op: batching gains nothing here. This chunk is scored
                # one at a time too, like the role's later chunks, so that no score depends on which chunk found
                # it out (with ranks, each finds it in a chunk of its own)
                self._stacked[role] = None
        return {position: _acc_loss(self._run(role, weights, x, y)) for position, weights in chunk}

    def _covered(self) -> list[ClientSpec]:
        """The clients this evaluation covers: all, or the trained ones, or a seeded sample of those."""
        clients = self.clients
        if self.plan.untrained == "skip":
            clients = [c for c in clients if c.id in self.client_states]
        k = self.plan.sample
        if k is not None and not self.final and k < len(clients):
            rng = np.random.default_rng(derive_seed(self.seed, self.round, Owner.SERVER, Stream.EVAL_SAMPLE))
            clients = [clients[i] for i in np.sort(rng.choice(len(clients), k, replace=False))]
        return clients

    @staticmethod
    def _in_order(accs: dict[str, list[float]], clients: list[ClientSpec]) -> list[float]:
        """Per-tier lists back in client order (for reports of the per-client distribution)."""
        cursor = {tier: iter(values) for tier, values in accs.items()}
        return [next(cursor[client.tier]) for client in clients]

    def _assembled(self, name: str, model: torch.nn.Module) -> ClientModule:
        """``model`` (a strategy's assembled model) in the module wrapper whose ``test_step`` the evaluation runs,
        made once per name and model."""
        wrapped = self._wrappers.get(name)
        if wrapped is None or wrapped.model is not model:
            # only its test_step runs, which needs the model's forward alone (not features and head)
            wrapped = self._wrappers[name] = ClientModule(cast(FeatureClassifier, model), None)
        return wrapped

    @torch.no_grad()
    def _run(
        self,
        role: str,
        weights: StateDict | None,
        x: Tensor,
        y: Tensor,
        shared: bool = False,
        module: ClientModule | None = None,
    ) -> dict[str, float]:
        """Accuracy, loss and top-class share of ``weights`` on ``(x, y)``, in the role's instance or in ``module``.
        ``shared`` (every rank evaluates the same model on the same set): each rank passes every ``world``-th batch
        and the ranks exchange the batches' sums, which every rank then adds up in batch order, as one process
        does."""
        module = module if module is not None else self.loop.slots[role].module
        if weights is not None:
            module.model.load_state_dict(weights)
        module.eval()
        size = self.loop.training.eval_batch_size
        starts = range(0, len(y), size)
        ranks = current_ranks()
        shared = shared and ranks.world > 1 and len(starts) > 1  # one batch: every rank passes it, no exchange
        if shared:
            starts = starts[ranks.rank :: ranks.world]
        sums = {}
        with self.loop.fabric.autocast():
            for start in starts:
                sums[start] = module.test_step((x[start : start + size], y[start : start + size]))
        if shared:
            sums = {start: part for share in exchange(sums) for start, part in share.items()}
            if sorted(sums) != list(range(0, len(y), size)):  # the ranks disagree on the test set or its batches
                raise RuntimeError(f"the ranks' shares of {role}'s evaluation do not cover the test set's batches once")
        loss_sum = torch.zeros((), device=x.device)  # float32 whatever the precision (test_step sums in float32)
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        predicted = torch.zeros((), dtype=torch.long, device=x.device)
        for start in sorted(sums):
            loss, right, counts = sums[start]
            loss_sum += loss.float()
            correct += right
            predicted = predicted + counts
        n = max(int((y != PAD).sum()), 1)  # tokens for sequence targets, examples otherwise
        return {"acc": correct.item() / n, "loss": loss_sum.item() / n, "top_class_share": _top_share(predicted)}


def _every_ranks(scores: dict[int, tuple[float, float]], count: int) -> list[tuple[float, float]]:
    """Every client's score in position order: this rank's ``scores`` and, with several ranks, the others'."""
    if current_ranks().world > 1:
        scores = {position: score for share in exchange(scores) for position, score in share.items()}
    return [scores[position] for position in range(count)]


def _acc_loss(result: dict[str, float]) -> tuple[float, float]:
    return result["acc"], result["loss"]


def _top_share(counts: Tensor) -> float:
    """Share of the most frequent entry of per-class ``counts`` (0 for no counts)."""
    total = int(counts.sum()) if counts.numel() else 0
    return int(counts.max()) / total if total else 0.0

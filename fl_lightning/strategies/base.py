"""The Strategy interface: the few hooks an algorithm overrides.

The orchestrator owns the round loop and calls, per round::

    for phase in strategy.phases:                                     # usually just ("train",)
        tasks   = strategy.configure_round(rnd, sampled_clients, phase)   # what each client receives
        updates = (strategy.client_update(task, ctx) for each task)       # lazily, one client at a time
        strategy.aggregate(rnd, updates, phase)                           # server-side math, streaming
    strategy.evaluate(evaluator)                                      # every eval_every rounds and at the end

A round has several phases when the server must aggregate between two client steps (paper 001: the
auxiliary model is averaged before strong clients distill from it).

Payloads in ``ClientTask.downlink`` and ``ClientUpdate.uplink`` are all that crosses the network, so the
communication ledger counts them without any help from the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.loop import LocalLoop
from ..client.steps import StepFn
from ..data import FederatedData
from ..federation.errors import ConfigError
from ..federation.schedules import round_progress
from ..federation.seeding import Stream, derive_seed
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, StateDict
from ..models import FeatureClassifier


@dataclass
class ServerContext:
    """What a strategy sees of the server: the population, the data, the run's length and the roles' models.

    Strategies read model facts (feature size, head, parameter names), get initial weights, and train or
    evaluate a role's model on the server (distillation, codistillation) only through these methods, so
    server-side training runs in the same Fabric loop, device and precision as the clients.
    """

    clients: list[ClientSpec]
    roles: list[str]
    data: FederatedData
    rounds: int
    seed: int
    _loop: LocalLoop

    # ------------------------------------------------------------------ the run
    def progress(self, rnd: int) -> float:
        """How far round ``rnd`` is through the run: 0 in round 1, 1 in the last round."""
        return round_progress(rnd, self.rounds)

    def server_inputs(self, method: str) -> Tensor:
        """The server's unlabeled examples ``[N, ...]`` (labels are never read); ``method`` names who needs them."""
        if len(self.data.server_idx) == 0:
            raise ConfigError(
                f"{method} needs unlabeled server data; set data.init_args.server_fraction (e.g. 0.2) or "
                "an out-of-domain server set."
            )
        return self.data.x[self.data.server_idx]

    def server_labeled(self, method: str) -> tuple[Tensor, Tensor]:
        """The server's public examples with their labels ``([N, ...], [N])``, for methods whose public set
        is labeled (FedMD's transfer learning); ``method`` names who needs them.

        It is the same set as :meth:`server_inputs` (``data.server_fraction``); an out-of-domain
        ``server_dataset`` has no labels and is refused.
        """
        if len(self.data.server_idx) == 0:
            raise ConfigError(
                f"{method} needs labeled public data on the server; set data.init_args.server_fraction (e.g. 0.2)."
            )
        x, y = self.data.x[self.data.server_idx], self.data.y[self.data.server_idx]
        if y.dim() != 1 or bool((y < 0).any()):
            raise ConfigError(
                f"{method} needs labeled public data, but the server set has no class labels (an out-of-domain "
                "server_dataset or sequence targets); use data.init_args.server_fraction on a classification set."
            )
        return x, y

    # ------------------------------------------------------------------ model facts
    def model(self, role: str) -> FeatureClassifier:
        """The role's model instance, to read its structure (its weights belong to whoever loaded them last)."""
        return self._loop.slots[role].module.model

    def feature_dim(self, role: str) -> int:
        return self.model(role).feature_dim

    def parameter_names(self, role: str) -> set[str]:
        """Names of the role's trainable parameters (not buffers such as batch-norm statistics)."""
        return {n for n, p in self.model(role).named_parameters() if p.requires_grad}

    def initial_weights(self, role: str, client_id: int | None = None) -> StateDict:
        """The role's initial weights: the run's global initialisation, or a client's own one.

        A client's own initialisation (personalized methods, where every client starts from its own
        random model as in FedHe's and Felo's code) is built once from a seed derived from the client id.
        """
        if client_id is None:
            return {k: v.detach().clone() for k, v in self.model(role).state_dict().items()}
        return self._loop.fresh_weights(role, derive_seed(self.seed, 0, client_id, Stream.CLIENT_INIT))

    def own_weights(self, client: ClientSpec, stored: StateDict | None) -> StateDict:
        """A personalized client's stored weights, or its own initial ones before its first round."""
        return stored if stored is not None else self.initial_weights(client.roles[0], client.id)

    # ------------------------------------------------------------------ server-side computation
    @torch.no_grad()
    def features(self, role: str, weights: StateDict, x: Tensor, batch_size: int = 512) -> Tensor:
        """Eval-mode features ``[N, D]`` of the role's model with ``weights`` on ``x`` (FedGKT's evaluation)."""
        module = self._loop.slots[role].module
        module.model.load_state_dict(weights)
        module.eval()
        with self._loop.fabric.autocast():
            return torch.cat([module.model.features(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])

    @torch.no_grad()
    def predict(self, role: str, weights: StateDict, x: Tensor, batch_size: int = 512) -> Tensor:
        """Eval-mode logits ``[N, C]`` of the role's model with ``weights`` on ``x``."""
        module = self._loop.slots[role].module
        module.model.load_state_dict(weights)
        module.eval()
        with self._loop.fabric.autocast():
            return torch.cat([module(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])

    def train(
        self,
        role: str,
        weights: StateDict,
        batches: Iterable[tuple],
        step_fn: StepFn,
        optimizer: Callable[[Iterable[Tensor]], torch.optim.Optimizer],
        return_loss: bool = False,
    ) -> StateDict | tuple[StateDict, float]:
        """Trains the role's model from ``weights`` with a fresh server optimizer; returns the new weights.

        ``step_fn(module, batch, i) -> loss`` as in client training; ``optimizer`` builds the server's
        optimizer from the parameters (e.g. ``lambda p: torch.optim.Adam(p, lr=1e-3)``, or
        ``knowledge.server_optim.server_optimizer``). ``return_loss`` also returns the mean training loss,
        which the loop accumulates anyway (0 when there was no step).
        """
        module = self._loop.slots[role].module
        module.model.load_state_dict(weights)
        stats = self._loop.run_steps(module, optimizer(module.parameters()), batches, step_fn)
        trained = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        return (trained, stats["loss"]) if return_loss else trained

    def require_server_only_role(self, method: str, role: str) -> None:
        """Refuses a server model role that a tier also gives to clients (FedGEMS, FedGKT)."""
        held = [c.id for c in self.clients if role in c.roles]
        if held:
            raise ConfigError(
                f"{method} server_role {role!r} is the server's own model, but tiers give it to "
                f"clients {held[:5]}; give the server a model role that no tier lists."
            )

    def require_one_role_per_client(self, method: str) -> None:
        several = [c.id for c in self.clients if len(c.roles) != 1]
        if several:
            raise ConfigError(
                f"{method} gives every client exactly one model; each tier must list one role "
                f"(clients {several[:5]} list several)."
            )


class Strategy:
    """Base class of federated algorithms (one algorithm per file in ``fl_lightning/strategies``).

    Subclasses list the attributes that make up the server state in ``state_attributes``; they are
    saved in checkpoints and restored on resume.
    """

    state_attributes: tuple[str, ...] = ()
    phases: tuple[str, ...] = ("train",)
    # whether the method reads a model's features and head apart (prototypes, representations, a swapped head):
    # a LightningModule client model must then declare them (client/lightning.py); whole-model methods need not
    needs_split: bool = False

    def setup(self, server: ServerContext) -> None:
        """Called once before the first round (and before a checkpoint is restored)."""
        self.server = server

    def server_roles(self) -> tuple[str, ...]:
        """Model roles that only the server trains (FedGKT's and FedGEMS's large model): built with the
        tiers' roles although no tier lists them. Their names are keys of the recipe's ``models``."""
        return ()

    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        """The tasks of ``phase``: usually one per sampled client, but a strategy may address any client
        of ``self.server.clients`` (paper 001's strong clients join every round)."""
        raise NotImplementedError

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        raise NotImplementedError

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        """Consumes the round's updates (each exactly once) and updates the server state.

        Returns server-side metrics to log (may be empty).
        """
        raise NotImplementedError

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        raise NotImplementedError

    @property
    def monitor(self) -> str:
        """The metric that decides the best round (and an Optuna objective by default)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The server state as tensors and plain containers only (checkpoints load with weights_only)."""
        return {name: _export(getattr(self, name)) for name in self.state_attributes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.state_attributes:
            setattr(self, name, _restore(getattr(self, name, None), state[name]))


def roles_to_build(tier_roles: list[str], strategy: Strategy) -> list[str]:
    """Every model role of a run: the tiers' roles, then the strategy's server-only roles."""
    return list(tier_roles) + [r for r in strategy.server_roles() if r not in tier_roles]


class PersonalModels:
    """For methods whose clients each keep their own model in ``ctx.state["weights"]`` (FedHe, FD, DS-FL, ...).

    Evaluates every client's own model (its stored weights, or its own initialisation before it has
    trained) on the global test set or its local test split (``split``), monitored by the mean accuracy.
    Put it before ``Strategy`` in the bases; a method with more to report overrides ``evaluate``.
    """

    split: str = "global"

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        return evaluator.personalized(self.personal_weights, split=self.split)

    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        return client.roles[0], self.server.own_weights(client, state.get("weights"))

    @property
    def monitor(self) -> str:
        return "personal/test_acc"


def check_evaluation_split(strategy: Strategy, server: ServerContext) -> None:
    """A personalized method's ``split`` names a set every client has: checked by the orchestrator before
    training rather than at the first evaluation after it."""
    method, split = type(strategy).__name__, getattr(strategy, "split", None)
    if split is None:
        return
    if split not in ("global", "test", "val"):
        raise ConfigError(f"{method} split must be global, test or val, got {split!r}.")
    if split != "global":
        empty = [c.id for c in server.clients if not len(getattr(server.data.clients[c.id], split))]
        if empty:
            raise ConfigError(
                f"{method} evaluates each client on its local {split} split, but client(s) {empty[:5]} have none; "
                "set data.local_split (train, val, test shares), e.g. [0.8, 0.1, 0.1], "
                "or the strategy's split: global."
            )


def _export(value: Any) -> Any:
    """Objects with a ``state_dict`` (banks, server optimizers, a CVAE) are saved as that dict."""
    if callable(getattr(value, "state_dict", None)):
        return value.state_dict()
    if isinstance(value, dict):
        return {k: _export(v) for k, v in value.items()}
    return value


def _restore(current: Any, saved: Any) -> Any:
    """Loads ``saved`` into the object that ``setup`` built, or returns it when it is plain data."""
    if callable(getattr(current, "load_state_dict", None)):
        current.load_state_dict(saved)
        return current
    holds_objects = isinstance(current, dict) and any(
        callable(getattr(v, "load_state_dict", None)) for v in current.values()
    )
    if holds_objects and isinstance(saved, dict):
        return {k: _restore(current.get(k), v) for k, v in saved.items()}
    return _on_devices_of(current, saved)


def _on_devices_of(current: Any, saved: Any) -> Any:
    """``saved`` with each tensor on the device of the tensor in the same place of ``current`` (what ``setup``
    built). Checkpoints load on the CPU; a run resumed on a GPU must find its global weights there, as a fresh
    run has them, while state that ``setup`` keeps on the CPU (FD's sums) stays there."""
    if isinstance(saved, torch.Tensor):
        return saved.to(current.device) if isinstance(current, torch.Tensor) else saved
    if isinstance(saved, dict) and isinstance(current, dict):
        return {k: _on_devices_of(current.get(k), v) for k, v in saved.items()}
    if type(saved) in (list, tuple) and type(current) in (list, tuple) and len(saved) == len(current):
        return type(saved)(_on_devices_of(c, v) for c, v in zip(current, saved))
    return saved


def require_private_and_shared_role(server: ServerContext, shared: str, method: str, word: str) -> None:
    """Every client lists exactly two roles: its private model's and the shared ``shared`` role."""
    if shared not in server.roles:
        raise ConfigError(
            f"{method} trains a private and a shared {word} model on every client; no tier lists the {word} "
            f"role {shared!r} (tiers train {server.roles}): give each tier roles [<private>, {shared}]."
        )
    wrong = [c.id for c in server.clients if len(c.roles) != 2 or shared not in c.roles]
    if wrong:
        raise ConfigError(
            f"{method} trains two models per client: every tier must list its private model's role and "
            f"{shared!r} (e.g. roles: [cnn_large, {shared}]); clients {wrong[:5]} do not."
        )

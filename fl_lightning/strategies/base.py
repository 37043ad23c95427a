"""The Strategy interface: the few hooks an algorithm overrides.

The orchestrator owns the round loop and calls, per round::

    for phase in strategy.phases():                          # one Phase("train", ...) unless overridden
        tasks   = phase.configure(rnd, sampled_clients)      # what each client receives
        updates = (phase.client_update(task, ctx) for each task)  # lazily, one client at a time
        phase.aggregate(rnd, updates)                        # server-side math, streaming; None: drained
    strategy.evaluate(evaluator)                             # every eval_every rounds and at the end

A one-phase method implements the three hooks ``configure_round``, ``client_update`` and ``aggregate`` (and
``evaluate`` and ``monitor``); the base class turns them into its one phase. A round has several phases
when the server must aggregate between two client steps (paper 001: the auxiliary model is averaged before
strong clients distill from it): such a method overrides :meth:`Strategy.phases` and names a method per
phase and event, so no hook compares phase names. A phase whose clients send nothing the server uses
(a local digest) has no ``aggregate``: the orchestrator runs its clients and drains their updates.

Payloads in ``ClientTask.downlink`` and ``ClientUpdate.uplink`` are all that crosses the network, so the
communication ledger counts them without any help from the strategy.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, overload

import torch
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.loop import LocalLoop
from ..client.steps import StepFn
from ..data import FederatedData
from ..distributed.capacity import OWN_STATES, allocating
from ..federation.bounds import Bounded
from ..federation.errors import ConfigError
from ..federation.schedules import round_progress
from ..federation.seeding import MAX_PHASES, Stream, derive_seed
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Role,
    StateDict,
    clone_state,
    exchanged_keys,
)
from ..knowledge.public_set import target_batches
from ..models import FeatureClassifier
from .public_exchange import PublicExchange


@dataclass
class ServerContext:
    """What a strategy sees of the server: the population, the data, the run's length and the roles' models.

    Strategies read model facts (feature size, head, parameter names), get initial weights, and train or
    evaluate a role's model on the server (distillation, codistillation) only through these methods, so
    server-side training runs in the same Fabric loop, device and precision as the clients.

    ``method`` is the strategy's name, which :meth:`Strategy.setup` sets; the checks below name it in their
    messages (``DS-FL needs unlabeled server data; ...``).
    """

    clients: list[ClientSpec]
    roles: list[str]
    data: FederatedData
    rounds: int
    seed: int
    _loop: LocalLoop
    method: str = "the strategy"
    central_noise: Callable[[Mapping[str, Tensor], list[ClientSpec]], tuple[dict[str, Tensor], float]] | None = None
    """Central differential privacy's noise (set by the run when ``privacy.where`` is ``server``; see
    :meth:`private_sum`)."""
    whole_class_tables: bool = False
    """Uploads pass differential privacy's mechanism, which sends per-class tables with a row for every class."""

    def private_sum(self, total: Mapping[str, Tensor], senders: list[ClientSpec]) -> tuple[dict[str, Tensor], float]:
        """Central differential privacy of an aggregate: ``total``, the sum of the round's uploads to it (each
        clipped by the run), with Gaussian noise, and the expected number of uploads from ``senders`` (the clients
        that may send to it) to divide it by for their mean. A mean over the uploads that came would release how
        many did, and so whether a client took part; DP-FedAvg divides by this fixed number. A strategy whose
        aggregate is such a mean or sum calls it when ``central_noise`` is set and sets ``central_privacy``."""
        if self.central_noise is None:
            raise RuntimeError(f"{self.method} asked for central privacy's noise in a run without where: server")
        return self.central_noise(total, senders)

    # ------------------------------------------------------------------ the run
    def progress(self, rnd: int) -> float:
        """How far round ``rnd`` is through the run: 0 in round 1, 1 in the last round."""
        return round_progress(rnd, self.rounds)

    @property
    def batch_size(self) -> int:
        """Examples per client training step (``training.batch_size``), for checks of the set-up that depend on it."""
        return self._loop.training.batch_size

    def round_generator(self) -> torch.Generator:
        """A generator for server-side randomness (batch orders), seeded from torch's global generator, which the
        orchestrator seeds per round and phase: what it draws depends on the run's seed and the round only."""
        return torch.Generator().manual_seed(int(torch.randint(2**62, ())))

    def server_inputs(self) -> Tensor:
        """The server's unlabeled examples ``[N, ...]`` (labels are never read)."""
        if len(self.data.server_idx) == 0:
            raise ConfigError(
                f"{self.method} needs unlabeled server data; set data.init_args.server_fraction (e.g. 0.2) or "
                "an out-of-domain server set."
            )
        return self.data.x[self.data.server_idx]

    def server_labeled(self) -> tuple[Tensor, Tensor]:
        """The server's public examples with their labels ``([N, ...], [N])``, for methods whose public set
        is labeled (FedMD's transfer learning).

        It is the same set as :meth:`server_inputs` (``data.server_fraction``); an out-of-domain
        ``server_dataset`` has no labels and is refused.
        """
        if len(self.data.server_idx) == 0:
            raise ConfigError(
                f"{self.method} needs labeled public data on the server; set data.init_args.server_fraction (e.g. 0.2)."
            )
        x, y = self.data.x[self.data.server_idx], self.data.y[self.data.server_idx]
        if y.dim() != 1 or bool((y < 0).any()):
            raise ConfigError(
                f"{self.method} needs labeled public data, but the server set has no class labels (an out-of-domain "
                "server_dataset or sequence targets); use data.init_args.server_fraction on a classification set."
            )
        return x, y

    def public_exchange(self, size: int | None, option: str, word: str, labeled: bool) -> PublicExchange:
        """Round subsets of ``size`` examples of the server's public set (labeled: :meth:`server_labeled`, else
        :meth:`server_inputs`), refused when ``size`` does not fit it; ``option`` and ``word`` name them in the
        message (DS-FL's ``open_size`` of its ``open`` set)."""
        num_public = len(self.server_labeled()[1]) if labeled else len(self.server_inputs())
        return PublicExchange(self.method, num_public, size, option, word, self.seed)

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
            return clone_state(self.model(role).state_dict())
        with allocating(f"client {client_id}'s own model of role {role!r}", self._loop.sizes.get(role), OWN_STATES):
            return self._loop.fresh_weights(role, derive_seed(self.seed, 0, client_id, Stream.CLIENT_INIT))

    def own_weights(self, client: ClientSpec, stored: StateDict | None, role: Role | None = None) -> StateDict:
        """A personalized client's stored weights, or its own initial ones of ``role`` (its first role when
        None) before its first round."""
        return stored if stored is not None else self.initial_weights(role or client.roles[0], client.id)

    # ------------------------------------------------------------------ server-side computation
    @torch.no_grad()
    def features(self, role: str, weights: StateDict | None, x: Tensor, batch_size: int = 512) -> Tensor:
        """Eval-mode features ``[N, D]`` of the role's model with ``weights`` on ``x`` (FedGKT's evaluation);
        ``weights`` None: the weights the role's instance holds (a server-only role no client loads, such as
        FedKTL's generator, keeps its built ones)."""
        module = self._eval_module(role, weights)
        with self._loop.fabric.autocast():
            return torch.cat([module.model.features(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])

    @torch.no_grad()
    def head_outputs(self, role: str, weights: StateDict | None, h: Tensor, batch_size: int = 512) -> Tensor:
        """Eval-mode ``head`` outputs of the role's model on features ``h`` ``[N, D]`` (a generator's images from its
        latents: FedKTL); ``weights`` as in :meth:`features`."""
        module = self._eval_module(role, weights)
        with self._loop.fabric.autocast():
            return torch.cat([module.model.head(h[i : i + batch_size]) for i in range(0, len(h), batch_size)])

    def _eval_module(self, role: str, weights: StateDict | None):
        module = self._loop.slots[role].module
        if weights is not None:
            module.model.load_state_dict(weights)
        return module.eval()

    @torch.no_grad()
    def predict(self, role: str, weights: StateDict, x: Tensor, batch_size: int = 512) -> Tensor:
        """Eval-mode logits ``[N, C]`` of the role's model with ``weights`` on ``x``."""
        module = self._loop.slots[role].module
        module.model.load_state_dict(weights)
        module.eval()
        with self._loop.fabric.autocast():
            return torch.cat([module(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])

    @overload
    def train(
        self,
        role: str,
        weights: StateDict,
        batches: Iterable[tuple],
        step_fn: StepFn,
        optimizer: Callable[[Iterable[Tensor]], torch.optim.Optimizer],
        return_loss: Literal[False] = False,
    ) -> StateDict: ...

    @overload
    def train(
        self,
        role: str,
        weights: StateDict,
        batches: Iterable[tuple],
        step_fn: StepFn,
        optimizer: Callable[[Iterable[Tensor]], torch.optim.Optimizer],
        return_loss: Literal[True],
    ) -> tuple[StateDict, float]: ...

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
        trained = clone_state(module.model.state_dict())
        return (trained, stats["loss"]) if return_loss else trained

    def train_on_rows(
        self,
        role: str,
        weights: StateDict,
        x: Tensor,
        loss: Callable[[Tensor, Tensor], Tensor],
        optimizer: Callable[[Iterable[Tensor]], torch.optim.Optimizer],
        batch_size: int,
        steps: int | None = None,
    ) -> tuple[StateDict, float]:
        """Trains the role's model on shuffled batches of the rows of ``x`` (``steps`` of them; None: one pass);
        ``loss(outputs, rows)`` is the loss of the model's outputs on ``x[rows]``, its targets looked up by the
        row indices (FedGEMS's fused teachers, FedGKT's client logits). Returns the weights and the mean loss."""
        generator = self.round_generator()
        batches = target_batches(x, torch.arange(len(x), device=x.device), batch_size, steps, generator)

        def step(module, batch, i):
            inputs, rows = batch
            return loss(module(inputs), rows)

        return self.train(role, weights, batches, step, optimizer, return_loss=True)

    # ------------------------------------------------------------------ checks of the set-up, at setup
    def shared_feature_dim(self, why: str, fix: str, roles: Iterable[str] | None = None) -> int:
        """The one feature size D of ``roles`` (every role by default), for methods that compare or average
        representations across architectures; refused, saying ``why`` and the ``fix``, when the sizes differ.

        Example: ``server.shared_feature_dim("averages representations across models", "Give all builders the
        same representation size (e.g. hidden: 64).")``.
        """
        dims = {r: self.feature_dim(r) for r in (self.roles if roles is None else roles)}
        if len(set(dims.values())) != 1:
            raise ConfigError(f"{self.method} {why}, so every role needs the same feature size; got {dims}. {fix}")
        return next(iter(dims.values()))

    def require_prototype_inference(self) -> None:
        """Nearest-prototype inference (FedProto's and FedTGP's ``inference: prototypes``) swaps every role's head
        for a linear one: each must be one ``nn.Linear``."""
        self.require_linear_heads(
            "replaces each model's head by a linear one for nearest-prototype inference",
            "Use inference: local_head for other heads.",
        )

    def require_linear_heads(self, why: str, fix: str) -> None:
        """Every role's head is one ``nn.Linear`` (nearest-prototype inference swaps it); refused saying ``why``."""
        if any(not isinstance(self.model(r).head, torch.nn.Linear) for r in self.roles):
            heads = {r: type(self.model(r).head).__name__ for r in self.roles}
            raise ConfigError(f"{self.method} {why}, so every head must be one nn.Linear; got {heads}. {fix}")

    def require_server_only_role(self, role: str) -> None:
        """Refuses a server model role that a tier also gives to clients (FedGEMS, FedGKT)."""
        held = [c.id for c in self.clients if role in c.roles]
        if held:
            raise ConfigError(
                f"{self.method} server_role {role!r} is the server's own model, but tiers give it to "
                f"clients {held[:5]}; give the server a model role that no tier lists."
            )

    def require_one_role_per_client(self, when: str = "") -> None:
        """Refuses a tier that lists several roles; ``when`` names the option that asks for one role
        (``" (mode fixed)"``)."""
        several = [c.id for c in self.clients if len(c.roles) != 1]
        if several:
            raise ConfigError(
                f"{self.method}{when} gives every client exactly one model; each tier must list one role "
                f"(clients {several[:5]} list several)."
            )

    def require_one_architecture(self) -> None:
        """Every client trains one model, the same role for all: a method its paper defines for one architecture
        (FedNTD, FedETF, CCVR, FedNH)."""
        self.require_one_role_per_client()
        if len(self.roles) != 1:
            raise ConfigError(
                f"{self.method} is defined for one architecture: every client must train the same model, but the "
                f"tiers train {self.roles}; list one role in every tier."
            )

    def require_private_and_shared_role(self, shared: str, word: str) -> None:
        """Every client lists exactly two roles: its private model's and the shared ``shared`` role (FML's
        meme, FedKD's mentee; ``word`` names it in the message)."""
        if shared not in self.roles:
            raise ConfigError(
                f"{self.method} trains a private and a shared {word} model on every client; no tier lists the "
                f"{word} role {shared!r} (tiers train {self.roles}): give each tier roles [<private>, {shared}]."
            )
        wrong = [c.id for c in self.clients if len(c.roles) != 2 or shared not in c.roles]
        if wrong:
            raise ConfigError(
                f"{self.method} trains two models per client: every tier must list its private model's role and "
                f"{shared!r} (e.g. roles: [cnn_large, {shared}]); clients {wrong[:5]} do not."
            )


Configure = Callable[[int, list[ClientSpec]], list[ClientTask]]
ClientWork = Callable[[ClientTask, ClientContext], ClientUpdate]
Aggregate = Callable[[int, Iterator[ClientUpdate]], dict[str, float]]


@dataclass(frozen=True)
class Phase:
    """One exchange of a round: the server's downlink, the clients' work on it, the server's use of the uplink.

    Args:
        name: the phase's name (``task.phase`` of its tasks, the progress line, the batched executor's groups).
        configure: ``(rnd, sampled_clients) -> tasks``; may address any client of the population.
        client_update: ``(task, ctx) -> update``, on the client side.
        aggregate: ``(rnd, updates) -> server metrics``, consuming every update; None when the server uses
            nothing of the phase's uploads (the orchestrator runs the clients and drains their updates).

    Example, FedMD's local digest after the consensus::

        Phase("digest", self.configure_digest, self.digest)
    """

    name: str
    configure: Configure
    client_update: ClientWork
    aggregate: Aggregate | None = None


ONE_PHASE_HOOKS = frozenset({"configure_round", "client_update", "aggregate"})


class _StrategyMeta(ABCMeta):
    """Checks the protocol when a strategy class is made: ``phases`` is a method (the tuple of phase names of
    older versions is refused in one sentence), and a class that overrides ``phases`` need not implement the
    one-phase hooks, which only the default ``phases`` calls."""

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any):
        declared = namespace.get("phases")
        if declared is not None and not callable(declared):
            raise TypeError(
                f"{name}.phases = {declared!r} is the old form; define `def phases(self) -> tuple[Phase, ...]` that "
                "returns one Phase(name, configure, client_update, aggregate) per phase (fl_lightning.strategies.base)."
            )
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        if not getattr(getattr(cls, "phases", None), "one_phase_default", False):
            cls.__abstractmethods__ = frozenset(cls.__abstractmethods__ - ONE_PHASE_HOOKS)
        return cls


class Strategy(Bounded, metaclass=_StrategyMeta):
    """Base class of federated algorithms (one algorithm per file in ``fl_lightning/strategies``).

    What a strategy carries from round to round is one dataclass in ``self.state``, which ``setup``
    builds and the hooks update (FedAvg's ``FedAvgState`` holds the global weights); it is all that a
    checkpoint saves of the strategy (:meth:`state_dict`, the fields as keys). Values used within one
    round only (a round's uploaders between two phases) are plain attributes and are not saved. A
    strategy without server state (Standalone, DS-FL, FedMD) leaves ``state`` at ``None``.

    Example, the state of a method that keeps global weights and a class bank::

        @dataclass
        class MyState:
            global_weights: dict[Role, StateDict]
            bank: ClassBank  # an object with state_dict / load_state_dict is saved as that dict

        def setup(self, server):
            super().setup(server)
            self.state = MyState({r: server.initial_weights(r) for r in server.roles}, ClassBank(10, 10))
    """

    name: ClassVar[str]  # the method's name in messages: the class name unless a subclass spells it otherwise
    # whether the method reads a model's features and head apart (prototypes, representations, a swapped head):
    # a LightningModule client model must then declare them (client/lightning.py); whole-model methods need not
    needs_split: bool = False
    central_privacy: ClassVar[bool] = False  # its aggregate is a sum or mean of uploads, noised by server.private_sum
    state: Any = None  # the server state, a dataclass that setup builds (see above)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def setup(self, server: ServerContext) -> None:
        """Called once before the first round (and before a checkpoint is restored): checks the set-up and
        builds ``self.state``."""
        self.server = server
        server.method = self.name

    def server_roles(self) -> tuple[str, ...]:
        """Model roles that only the server trains (FedGKT's and FedGEMS's large model): built with the
        tiers' roles although no tier lists them. Their names are keys of the recipe's ``models``."""
        return ()

    def phases(self) -> tuple[Phase, ...]:
        """The round's phases, in order; by default one, ``train``, made of the three one-phase hooks."""
        return (Phase("train", self.configure_round, self.client_update, self.aggregate),)

    phases.one_phase_default = True  # type: ignore[attr-defined]  # what _StrategyMeta looks for

    @abstractmethod
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        """The round's tasks: usually one per sampled client, but a strategy may address any client of
        ``self.server.clients`` (FedKD's cohorts)."""

    @abstractmethod
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        """One client's work on ``task``, on the client side: trains through ``ctx``, returns the uplink."""

    @abstractmethod
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        """Consumes the round's updates (each exactly once) and updates the server state.

        Returns server-side metrics to log (may be empty).
        """

    @abstractmethod
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        """The metrics of the current models (accuracy keys contain ``acc``)."""

    @property
    @abstractmethod
    def monitor(self) -> str:
        """The metric that decides the best round (and an Optuna objective by default)."""

    def state_dict(self) -> dict[str, Any]:
        """The server state's fields as tensors and plain containers only (checkpoints load with weights_only)."""
        if self.state is None:
            return {}
        return {f.name: _export(getattr(self.state, f.name)) for f in fields(self.state)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` gave into the state that ``setup`` built."""
        if self.state is None:
            return
        for f in fields(self.state):
            setattr(self.state, f.name, _restore(getattr(self.state, f.name), saved[f.name]))


def phase_table(strategy: Strategy) -> tuple[Phase, ...]:
    """The strategy's phases, checked once after ``setup`` (the orchestrator's and asynchronous rounds' source):
    at least one, each a :class:`Phase`, with distinct names, and no more than the seed streams provide for."""
    phases = tuple(strategy.phases())
    kinds = {type(p).__name__ for p in phases if not isinstance(p, Phase)}
    if not phases or kinds:
        raise TypeError(
            f"{strategy.name}.phases() must return a non-empty tuple of Phase objects"
            + (f", got {', '.join(sorted(kinds))}" if kinds else ", got none")
            + "; e.g. (Phase('train', self.configure_round, self.client_update, self.aggregate),)."
        )
    names = [p.name for p in phases]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TypeError(f"{strategy.name}.phases() names {repeated} more than once; give each phase its own name.")
    if len(phases) > MAX_PHASES:
        raise TypeError(f"{strategy.name}.phases() has {len(phases)} phases; a round has at most {MAX_PHASES}.")
    return phases


def global_metrics(evaluator: Evaluator, weights: Mapping[Role, StateDict]) -> dict[str, float]:
    """``<role>/test_<metric>`` of each role's global model on the global test set, in ``weights``' order.

    Example: ``global_metrics(evaluator, {"meme": w})`` gives ``{"meme/test_acc": ..., "meme/test_loss": ...}``.
    """
    metrics = {}
    for role, role_weights in weights.items():
        for name, value in evaluator.global_model(role, role_weights).items():
            metrics[f"{role}/test_{name}"] = value
    return metrics


class SentWeights:
    """Cuts a role's weights to the part that travels, its :func:`exchanged_keys` (a frozen backbone stays home).

    Example: ``self.outgoing = SentWeights(server, roles)`` in ``setup``; then
    ``self.outgoing(role, self.state.global_weights[role])`` is the ``ModelWeights`` payload to send.
    """

    def __init__(self, server: ServerContext, roles: Iterable[Role]):
        self.keys = {role: exchanged_keys(server.model(role)) for role in roles}

    def __call__(self, role: Role, state: StateDict, copy: bool = False) -> ModelWeights:
        """The sent part of ``state``; ``copy`` for a module's live tensors, which the next client overwrites."""
        return ModelWeights.part(role, state, self.keys[role], copy)


def roles_to_build(tier_roles: list[str], strategy: Strategy) -> list[str]:
    """Every model role of a run: the tiers' roles, then the strategy's server-only roles."""
    return list(tier_roles) + [r for r in strategy.server_roles() if r not in tier_roles]


Split = Literal["global", "test", "val"]  # where personal models are evaluated: the global test set, or local splits


class PersonalModels:
    """For methods whose clients each keep their own model in ``ctx.state["weights"]`` (FedHe, FD, DS-FL, ...).

    Evaluates every client's own model (its stored weights, or its own initialisation before it has
    trained) on the global test set or its local ``split``, monitored by the mean accuracy
    ``personal/test_acc``. Put it before ``Strategy`` in the bases. A method whose own model is not the
    client's first role overrides :meth:`personal_role` (FML's private model); one with more to report
    extends ``evaluate`` (FedGEMS adds its server model).
    """

    split: Split = "global"
    server: ServerContext  # the Strategy's, which this class comes before in the bases

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        return evaluator.personalized(self.personal_weights, split=self.split)

    def personal_role(self, client: ClientSpec) -> Role:
        """The role of the client's own model."""
        return client.roles[0]

    def load_own(self, task: ClientTask, ctx: ClientContext) -> tuple[Role, Any]:
        """Loads the client's own model (its stored weights, or its own initialisation before its first round)
        into its role's instance; returns the role and the module."""
        role = self.personal_role(task.client)
        return role, ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights"), role))

    def keep_own(
        self, task: ClientTask, ctx: ClientContext, uplink: dict[str, Any], metrics: dict[str, float]
    ) -> ClientUpdate:
        """Stores the client's trained own model in its state; the update that carries ``uplink`` and ``metrics``."""
        ctx.state["weights"] = ctx.weights(self.personal_role(task.client))
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[Role, StateDict]:
        """The role and weights of the client's own model, from its persistent ``state``."""
        role = self.personal_role(client)
        return role, self.server.own_weights(client, state.get("weights"), role)

    @property
    def monitor(self) -> str:
        return "personal/test_acc"


def check_evaluation_split(strategy: Strategy, server: ServerContext) -> None:
    """A personalized method's local ``split`` is one every client has: checked by the orchestrator before
    training rather than at the first evaluation after it."""
    split = getattr(strategy, "split", None)
    if split is None or split == "global":
        return
    empty = [c.id for c in server.clients if not len(getattr(server.data.clients[c.id], split))]
    if empty:
        raise ConfigError(
            f"{strategy.name} evaluates each client on its local {split} split, but client(s) {empty[:5]} have "
            "none; set data.local_split (train, val, test shares), e.g. [0.8, 0.1, 0.1], "
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

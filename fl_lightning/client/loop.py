"""The lightweight local training loop on Lightning Fabric, and the one-instance-per-role model pool.

Fabric decides the device and the precision (``setup_module``, ``autocast``, ``backward`` and the
precision plugin's optimizer step). The hot loop calls the unwrapped module and optimizer: Fabric's
module wrapper costs about 20% per step on the digits models (measured, benchmarks/results/log.md), and a
single-device run needs none of what it adds.
"""

from __future__ import annotations

import copy
import functools
import importlib
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from ..distributed.capacity import allocating
from ..models import FeatureClassifier, ModelSpec
from .seeded_init import SeededInitializer
from .steps import ModelSlot, StepFn, training_step
from .training import LocalTraining

if TYPE_CHECKING:  # annotations only: Fabric is imported when a run starts (fabric_loader), never by the parser
    import lightning as L

    from .fit_runner import FitRunner
    from .graphs import StepGraphs
    from .module import ClientModule


def role_seed(seed: int, role: str) -> int:
    """A stable seed per (run seed, role), so a role's initial weights do not depend on build order."""
    return (seed * 1_000_003 + zlib.crc32(role.encode())) % (2**31)


def plain_single_device(fabric: L.Fabric | None) -> bool:
    """Whether ``fabric`` trains on one device in 32-true: its autocast is then a no-op and its backward and
    optimizer step are the plain ``loss.backward()`` and ``optimizer.step()``. The strategy and precision plugin
    must be Fabric's own classes, not subclasses, which may add to a step."""
    if fabric is None:  # a loop that never trains (the ranks' bookkeeping in tests)
        return False
    package = type(fabric).__module__.rpartition(".")[0]  # lightning_fabric or lightning.fabric (fabric_class)
    strategies = importlib.import_module(f"{package}.strategies")
    plugins = importlib.import_module(f"{package}.plugins")
    strategy = fabric.strategy
    return type(strategy) is strategies.SingleDeviceStrategy and type(strategy.precision) is plugins.Precision


class LocalLoop:
    """Runs optimizer steps of a role's module over batches, with a step function of the strategy.

    Attributes:
        fit_runner: who runs the fits :meth:`fit` is asked for: None, the loop itself, at once; while a client of
            the batched executor has its turn, that client (:class:`~.fit_runner.FitRunner`), which runs them
            later, batched with other clients' fits.
    """

    def __init__(self, fabric: L.Fabric, training: LocalTraining, rounds: int):
        self.fabric = fabric
        self.plain_single_device = plain_single_device(fabric)  # how run_steps makes a step, decided once
        self.training = training
        self.rounds = rounds
        self.slots: dict[str, ModelSlot[ClientModule]] = {}
        self.phase_start: dict[str, dict] = {}  # optimizer states every client of a phase starts from
        self._initializers: dict[str, SeededInitializer] = {}  # per role, for fresh_weights
        self.sizes: dict[str, int] = {}  # bytes of each role's weights (build_slots), named if a copy cannot be made
        self.graphs: StepGraphs | None = None  # runtime.cuda_graphs: client fits replay their steps (client/graphs/)
        self.helpers: dict[
            tuple, ModelSlot[torch.nn.Module]
        ] = {}  # strategies' small trained modules, one per name and shapes
        self.fit_runner: FitRunner | None = None  # set by the batched executor for the duration of a client's turn

    @property
    def fits_run_later(self) -> bool:
        """Whether the fits of the client running now are handed to the batched executor and run after this
        client's code has moved on (and other clients' code has run): what a step closes over must stay this
        client's until then."""
        return self.fit_runner is not None

    def build_slots(
        self, models: dict[str, ModelSpec], roles: list[str], seed: int, sizes: dict[str, int] | None = None, **context
    ) -> None:
        """Builds one module per role (weights seeded per role) and its optimizer, once per run. Every role is one
        of ``models`` (``fit`` checks that before any data is loaded); ``sizes``: the roles' weights in bytes as
        estimated, where known, named if memory runs out (:attr:`sizes` then holds the built ones')."""
        self.specs, self.context = models, context
        for role in roles:
            torch.manual_seed(role_seed(seed, role))
            size = (sizes or {}).get(role)
            with allocating(f"the model of role {role!r} (builder {models[role].builder})", size):
                module = self._wrapped(role, models[role].build(**context))
                # device and precision from Fabric; its wrapper's .module is the module given
                module = cast("ClientModule", self.fabric.setup_module(module).module)
                optimizer = module.configure_optimizers()
            self.slots[role] = ModelSlot(module, optimizer, [g["lr"] for g in optimizer.param_groups])
            self.sizes[role] = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))

    def _wrapped(self, role: str, model: torch.nn.Module) -> ClientModule:
        """A built model in its module wrapper: the built-in steps, or a user's LightningModule's own."""
        if isinstance(model, FeatureClassifier):
            from .module import ClientModule

            return ClientModule(model, self.training.optimizer_factory())
        from .lightning import LightningClientModule  # ModelSpec.build returns nothing else

        return LightningClientModule(model, role)

    def begin_phase(self) -> None:
        """Notes the optimizer states of the phase's start (``optimizer_state: shared_per_phase``)."""
        if self.training.optimizer_state == "shared_per_phase":
            self.phase_start = {
                role: copy.deepcopy(slot.optimizer.state_dict())
                for role, slot in self.slots.items()
                if slot.optimizer.state
            }

    def note_fit_outside_loop(self, why: str) -> None:
        """Counts a fit the strategy runs itself, outside :meth:`fit` (models trained together), as a sequential
        one with ``why`` when the batched executor runs this client (``summary.json``); nothing otherwise."""
        if self.fit_runner is not None:
            self.fit_runner.note_sequential(1, why)

    def fresh_weights(self, role: str, seed: int) -> dict[str, Tensor]:
        """Weights of a newly built model of ``role`` (seeded); used once per client by personalized methods.

        One cached instance per role is re-initialised in place where that gives exactly a build's
        weights (checked once per role, :class:`~fl_lightning.client.seeded_init.SeededInitializer`).
        """
        if role not in self._initializers:
            spec, context = self.specs[role], self.context
            self._initializers[role] = SeededInitializer(lambda: spec.build(**context))
        return self._initializers[role].weights(seed, self.fabric.device)

    def helper(self, name: str, module: torch.nn.Module, weights: dict[str, Tensor] | None = None) -> torch.nn.Module:
        """The one instance of a strategy's small trained module ``name`` with ``module``'s shapes (FedKD's
        ``W_h``), on the device and holding ``weights``, or ``module``'s own values when None.

        Valid until the next client's update. One instance keeps a step's tensors at fixed addresses, so
        that with ``runtime.cuda_graphs`` every client's fit replays the same graphs. Inside a client the
        batched executor may pause (its fits run later, interleaved with other clients'), a client gets
        ``module`` itself instead.
        """
        if self.fits_run_later:
            module = module.to(self.fabric.device)
            if weights is not None:
                module.load_state_dict(weights)
            return module
        key = (name, type(module), tuple((k, tuple(v.shape), v.dtype) for k, v in module.state_dict().items()))
        slot = self.helpers.get(key)
        if slot is None:  # the first module given becomes the instance
            instance = module.to(self.fabric.device)
            optimizer = self._helper_optimizer(instance)
            slot = self.helpers[key] = ModelSlot(instance, optimizer, [g["lr"] for g in optimizer.param_groups])
        with torch.no_grad():
            slot.module.load_state_dict(weights if weights is not None else module.state_dict())
        return slot.module

    def helper_optimizer(self, module: torch.nn.Module) -> tuple[torch.optim.Optimizer, list[float]]:
        """An optimizer of the recipe's kind with a fresh state for ``module``, and its base learning rates:
        the instance's own (its state cleared) for a module of :meth:`helper`, else a new one."""
        slot = next((slot for slot in self.helpers.values() if slot.module is module), None)
        if slot is not None:
            slot.optimizer.state.clear()
            return slot.optimizer, slot.base_lrs
        optimizer = self._helper_optimizer(module)
        return optimizer, [g["lr"] for g in optimizer.param_groups]

    def _helper_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = self.training.optimizer_factory()(module.parameters())
        if self.graphs is not None:  # Adam in capturable mode, as every role's (graphs.prepare_optimizer)
            from .graphs import prepare_optimizer

            prepare_optimizer(optimizer)
        return optimizer

    def num_steps(self, num_examples: int) -> int:
        if self.training.local_steps is not None:
            return self.training.local_steps
        if self.training.drop_last:
            return self.training.local_epochs * max(1, num_examples // self.training.batch_size)
        return self.training.local_epochs * -(-num_examples // self.training.batch_size)

    def fit(
        self,
        slot: ModelSlot,
        batches: Iterable[tuple],
        rnd: int,
        step_fn: StepFn | None = None,
        on_record: Callable[[tuple], None] | None = None,
    ) -> dict[str, float]:
        """Trains ``slot.module`` on ``batches`` with ``step_fn`` (default: its ``training_step``): at once
        (:meth:`fit_now`), or, while a :attr:`fit_runner` holds the loop, handed to it and run later with other
        clients' fits. Either way the fit has run, and the slot holds its result, when this returns.

        Returns the mean training loss and the number of steps. A step function may return ``(loss, record)``:
        ``on_record`` receives each step's record (detached), which is how a pure step hands out what it
        observed (FedHe's logits).
        """
        if self.fit_runner is not None:  # a client of the batched executor: its fit runs with its group's
            role = next(r for r, s in self.slots.items() if s is slot)
            return self.fit_runner.run_fit(slot, role, batches, rnd, step_fn or training_step, on_record)
        return self.fit_now(slot, batches, rnd, step_fn, on_record)

    def fit_now(
        self,
        slot: ModelSlot,
        batches: Iterable[tuple],
        rnd: int,
        step_fn: StepFn | None = None,
        on_record: Callable[[tuple], None] | None = None,
    ) -> dict[str, float]:
        """:meth:`fit`, run at once whoever holds the loop: at the round's learning rate, its steps replayed from
        CUDA graphs when ``runtime.cuda_graphs`` is on. The loss is accumulated as a tensor so that no step waits
        for a device sync."""
        factor = self.training.lr_schedule(rnd, self.rounds)
        for group, base in zip(slot.optimizer.param_groups, slot.base_lrs):
            group["lr"] = base * factor
        if self.graphs is not None:
            clip = self.training.grad_clip_norm
            return self.graphs.run_steps(
                slot.module, slot.optimizer, batches, step_fn or training_step, clip, on_record
            )
        return self.run_steps(slot.module, slot.optimizer, batches, step_fn, self.training.grad_clip_norm, on_record)

    def _step_calls(
        self, module: ClientModule, optimizer: torch.optim.Optimizer, step_fn: StepFn
    ) -> tuple[Callable[[tuple, int], Any], Callable[[Tensor], None], Callable[[], Any]]:
        """A fit's forward (``step_fn`` on a batch), backward and optimizer step: Fabric's, or, on one device in
        32-true (:attr:`plain_single_device`), the plain calls Fabric's would make, 21 Python calls fewer per step
        (benchmarks/results/log.md)."""
        if self.plain_single_device:
            return functools.partial(step_fn, module), Tensor.backward, optimizer.step
        autocast = self.fabric.autocast

        def forward(batch: tuple, i: int) -> Any:
            with autocast():
                return step_fn(module, batch, i)

        return forward, self.fabric.backward, functools.partial(self.fabric.strategy.optimizer_step, optimizer)

    def run_steps(
        self,
        module: ClientModule,
        optimizer: torch.optim.Optimizer,
        batches: Iterable[tuple],
        step_fn: StepFn | None = None,
        clip: float | None = None,
        on_record: Callable[[tuple], None] | None = None,
    ) -> dict[str, float]:
        """The hot loop shared by client training and the server's own training (distillation).

        Fabric supplies autocast, backward and the precision plugin's optimizer step, so a server-side
        student trains under the same device and precision as the clients. Autocast covers each step's
        forward only: inside one autocast block torch caches the low-precision copy of every weight, so
        a block spanning several optimizer steps would keep computing with the first step's weights
        (under bf16-mixed the head then grows unchecked and test losses reach 1e8; docs/algorithms.md).
        """
        forward, backward, optimizer_step = self._step_calls(module, optimizer, step_fn or training_step)
        module.train()
        total, steps = torch.zeros((), device=self.fabric.device), 0
        for i, batch in enumerate(batches):
            optimizer.zero_grad(set_to_none=True)
            loss = forward(batch, i)
            if isinstance(loss, tuple):  # (loss, record): what the step observed goes to on_record
                loss, record = loss
                if on_record is not None:
                    on_record(tuple(t.detach() for t in record))
            backward(loss)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            optimizer_step()
            total += loss.detach().float()
            steps += 1
        return {"loss": (total / max(steps, 1)).item(), "steps": float(steps)}

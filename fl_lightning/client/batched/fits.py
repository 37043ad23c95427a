"""Clients of one architecture trained as one vmapped computation (``torch.func``).

A group of paused client fits (``fit_request.FitRequest``) that train the same role with the same step
function runs as one computation per step: each client's parameters, buffers (batch-norm running
statistics included) and optimizer moments are stacked along a leading client dimension, each client's
batch comes from its own batch stream in its own order, and one ``vmap(grad_and_value(step))`` call
computes every client's loss and gradient. The optimizer update is applied to the stacked tensors
with each client's own step count. Numbers equal the sequential loop's to float tolerance (convolutions
of a vmapped batch use other kernels), not bit for bit.

A step function may run batched only when it is a pure function of its module, batch and closure:
the default cross-entropy step is; a strategy marks others with :func:`vmappable`. Whatever cannot run
batched (a step with side effects, dropout drawing random numbers (``randomness``), an optimizer other than
SGD / Adam / AdamW, several parameter groups, a single client) runs through the sequential loop, so the
executor never changes what a strategy computes, only how many clients share a kernel launch.

This module forms the groups and falls back; ``group_training.GroupTraining`` trains one group (its state
in ``flat_store``, its optimizer rules in ``stacked_optim``, its modules reparametrized by
``reparametrize``); ``fit_request`` holds what a paused client carries.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .fit_request import FitRequest, random_state, restore, set_random_state, snapshot_optimizer, snapshot_slots
from .fit_request import step_key as _step_key
from .group_training import GroupTraining, NotBatchable, OutOfMemory
from .lockstep import LockstepMemory
from .randomness import random_layers
from .stacked_optim import update_rule
from .step_closures import closure_values, identity

if TYPE_CHECKING:
    from ..loop import LocalLoop

log = logging.getLogger(__name__)


class BatchedFit:
    """Runs groups of fit requests batched where they can be, sequentially where not."""

    def __init__(self, loop: LocalLoop, lockstep: bool = False):
        self.loop = loop
        self.lockstep = LockstepMemory() if lockstep else None  # runtime.lockstep: every client at every step
        self.unbatchable: dict[Any, str] = {}  # (role, step code) pairs whose first batched step failed, and why
        self.memory_limit: dict[str, int] = {}  # per role, the most clients batched since a larger group ran out
        self.counts = {"batched_fits": 0, "sequential_fits": 0}  # reported in summary.json
        self.sequential_reasons: dict[str, int] = {}  # why fits ran sequentially, in fits (summary.json)
        self.random: dict[tuple, str | None] = {}  # (role, modes): why random layers keep its fits sequential
        self.warned: set[str] = set()  # roles whose random layers the log has named

    def run(self, requests: list[FitRequest]) -> None:
        groups: dict[Any, list[FitRequest]] = {}
        for request in requests:
            groups.setdefault(self._group_key(request), []).append(request)
        for key, group in groups.items():
            if isinstance(key, str):  # why these fits cannot be batched
                self._all_sequential(group, key)
                continue
            limit = self.memory_limit.get(group[0].role, len(group))
            for start in range(0, len(group), limit):
                self._run_part(group[start : start + limit])

    def _run_part(self, part: list[FitRequest]) -> None:
        """Batched if it can be; halved while the device's memory cannot hold it (remembered for the role)."""
        if len(part) == 1:
            self._all_sequential(part, _ALONE)
            return
        if _step_key(part[0]) in self.unbatchable:
            self._all_sequential(part, self.unbatchable[_step_key(part[0])])
            return
        try:
            batched = self._try_batched(part)
        except OutOfMemory:
            batched = None  # outside the handler: the failed attempt's tensors are freed with its frames
        if batched is None:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = -(-len(part) // 2)
            role = part[0].role
            self.memory_limit[role] = min(self.memory_limit.get(role, half), half)
            log.warning("%s: %d clients at once exceed the device's memory; batching at most %d", role, len(part), half)
            self._run_part(part[:half])
            self._run_part(part[half:])
        elif batched:
            self.counts["batched_fits"] += len(part)
        else:
            self._all_sequential(part, self.unbatchable[_step_key(part[0])])

    def _all_sequential(self, group: list[FitRequest], why: str) -> None:
        for request in group:
            self._sequential(request)
        self.note_sequential(len(group), why)

    def note_sequential(self, fits: int, why: str) -> None:
        """Counts ``fits`` that ran through the sequential loop, with the reason summary.json gives."""
        self.counts["sequential_fits"] += fits
        self.sequential_reasons[why] = self.sequential_reasons.get(why, 0) + fits

    # ------------------------------------------------------------------ grouping
    def _group_key(self, request: FitRequest) -> Any:
        """Requests with equal keys can share one vmapped step; a string: why this one runs sequentially."""
        fn = request.step_fn
        function = getattr(fn, "__func__", fn)
        if fn is not _default_step() and not getattr(function, "vmappable", False):
            return "the step is not marked pure (@vmappable)"
        if fn is _default_step() and not self.loop.slots[request.role].module.pure_training_step:
            return "the role's LightningModule has its own training_step (not known to be pure)"
        if getattr(self.loop.fabric.strategy.precision, "scaler", None) is not None:  # 16-mixed scales the loss
            return "fp16 mixed precision scales the loss"
        slot = self.loop.slots[request.role]
        optimizer = slot.optimizer
        if update_rule(optimizer) is None:
            return f"the optimizer is {type(optimizer).__name__} (batched: SGD, Adam and AdamW)"
        if len(optimizer.param_groups) != 1:
            return "the optimizer has several parameter groups"
        if optimizer.param_groups[0].get("dampening"):  # SGD's first momentum step would differ (clone vs add)
            return "SGD's dampening"
        if _step_key(request) in self.unbatchable:
            return self.unbatchable[_step_key(request)]
        random = self._randomness(request)
        if random is not None:
            return random
        constants = tuple(
            ("tensor", tuple(v.shape), v.dtype) if isinstance(v, Tensor) else ("value", identity(v))
            for v in closure_values(fn)
        )
        state_keys = tuple(sorted((n, tuple(sorted(s))) for n, s in request.optimizer_state.items()))
        return (request.role, function.__code__, constants, request.modes, state_keys, request.rnd)

    def _randomness(self, request: FitRequest) -> str | None:
        """Why random layers keep this fit out of a vmapped group (None: none draws); a warning once per role."""
        key = (request.role, request.modes)
        if key not in self.random:
            layers = random_layers(self.loop, request.role, request.modes)
            self.random[key] = (
                f"random layers ({', '.join(layers)}): one vmapped step cannot draw from each client's own stream"
                if layers
                else None
            )
            if layers and request.role not in self.warned:
                self.warned.add(request.role)
                log.warning(
                    "runtime.executor batched: role %r has dropout or another random layer (%s), whose draws one "
                    "vmapped step cannot take from each client's own random stream, so its fits run one client at "
                    "a time, with the numbers of runtime.executor sequential.",
                    request.role,
                    ", ".join(layers),
                )
        return self.random[key]

    # ------------------------------------------------------------------ sequential fallback
    def _sequential(self, request: FitRequest) -> None:
        """The fit exactly as the sequential executor runs it, on this client's restored state."""
        loop = self.loop
        restore(loop, request)
        set_random_state(request.rng_state)
        slot = loop.slots[request.role]
        request.result = loop.fit(slot, request.batches, request.rnd, request.step_fn, request.on_record)
        request.rng_state = random_state()
        request.slots = snapshot_slots(loop)
        request.optimizer_state = snapshot_optimizer(slot)

    # ------------------------------------------------------------------ batched
    def _try_batched(self, group: list[FitRequest]) -> bool:
        """Trains the group batched (True), or leaves it untouched for the sequential loop (False); raises
        :class:`OutOfMemory`, the group untouched too, when its stacked state or first step does not fit."""
        first = group[0]
        try:
            try:
                training = GroupTraining(self.loop, group, self.lockstep)
            except torch.OutOfMemoryError as err:  # stacking the group's state: nothing consumed yet
                raise OutOfMemory(str(err)) from err
            training.run()  # converts running out of memory in its first step itself (later, it cannot)
        except OutOfMemory:
            raise
        except NotBatchable as err:
            self.unbatchable[_step_key(first)] = (
                f"its first batched step failed: {str(err).splitlines()[0] if str(err) else '?'}"
            )
            return False
        return True


_ALONE = "no other client of its chunk trained the same role, step and settings at the same point"


def _default_step():
    from ..steps import training_step as _training_step

    return _training_step

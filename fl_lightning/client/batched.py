"""Clients of one architecture trained as one vmapped computation (``torch.func``).

A group of paused client fits (``executor.FitRequest``) that train the same role with the same step
function runs as one computation per step: each client's parameters, buffers (batch-norm running
statistics included) and optimizer moments are stacked along a leading client dimension, each client's
batch comes from its own batch stream in its own order, and one ``vmap(grad_and_value(step))`` call
computes every client's loss and gradient. The optimizer update is applied to the stacked tensors
with each client's own step count. Numbers equal the sequential loop's to float tolerance (convolutions
of a vmapped batch use other kernels), not bit for bit.

A step function may run batched only when it is a pure function of its module, batch and closure:
the default cross-entropy step is; a strategy marks others with :func:`vmappable`. Whatever cannot run
batched (a step with side effects, dropout drawing random numbers, an optimizer other than SGD / Adam /
AdamW, several parameter groups, a single client) runs through the sequential loop, so the executor
never changes what a strategy computes, only how many clients share a kernel launch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..data.transforms import to_device

if TYPE_CHECKING:
    from .loop import LocalLoop, StepFn

log = logging.getLogger(__name__)


def vmappable(step_fn: Callable) -> Callable:
    """Marks a step function as pure: its loss depends only on its module, batch and closure values,
    it changes nothing outside (no collectors, no Python lists), draws no random numbers, and reaches the
    same trained tensors at every step and batch size (the batched executor checks the first step only: a
    tensor torch's optimizer would skip for want of a gradient in a later step would be moved by momentum
    or weight decay there)."""
    step_fn.vmappable = True
    return step_fn


@dataclass
class FitRequest:
    """A client's local fit, paused until the executor has run it (alone or batched with others).

    ``slots`` holds every role's parameters and buffers as the client left them when it asked for the fit
    (a teacher in another role is part of the client's state too); after the fit they are the trained ones.
    """

    role: str
    batches: Iterator[tuple]
    step_fn: StepFn
    on_record: Callable[[tuple], None] | None
    rnd: int
    slots: dict[str, dict[str, Tensor]]
    modes: tuple[tuple[bool, ...], ...]
    optimizer_state: dict[str, dict[str, Tensor]]
    rng_state: tuple
    result: dict[str, float] = field(default_factory=dict)


class BatchedFit:
    """Runs groups of fit requests batched where they can be, sequentially where not."""

    def __init__(self, loop: LocalLoop):
        self.loop = loop
        self.unbatchable: dict[Any, str] = {}  # (role, step code) pairs whose first batched step failed, and why
        self.memory_limit: dict[str, int] = {}  # per role, the most clients batched since a larger group ran out
        self.counts = {"batched_fits": 0, "sequential_fits": 0}  # reported in summary.json
        self.sequential_reasons: dict[str, int] = {}  # why fits ran sequentially, in fits (summary.json)

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
        except _OutOfMemory:
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
        if getattr(self.loop.fabric.strategy.precision, "scaler", None) is not None:  # 16-mixed scales the loss
            return "fp16 mixed precision scales the loss"
        slot = self.loop.slots[request.role]
        optimizer = slot.optimizer
        if _update_rule(optimizer) is None:
            return f"the optimizer is {type(optimizer).__name__} (batched: SGD, Adam and AdamW)"
        if len(optimizer.param_groups) != 1:
            return "the optimizer has several parameter groups"
        if optimizer.param_groups[0].get("dampening"):  # SGD's first momentum step would differ (clone vs add)
            return "SGD's dampening"
        if _step_key(request) in self.unbatchable:
            return self.unbatchable[_step_key(request)]
        constants = tuple(
            ("tensor", tuple(v.shape), v.dtype) if isinstance(v, Tensor) else ("value", _identity(v))
            for v in _closure_values(fn)
        )
        state_keys = tuple(sorted((n, tuple(sorted(s))) for n, s in request.optimizer_state.items()))
        return (request.role, function.__code__, constants, request.modes, state_keys, request.rnd)

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
        :class:`_OutOfMemory`, the group untouched too, when its stacked state or first step does not fit."""
        first = group[0]
        try:
            try:
                training = _GroupTraining(self.loop, group)
            except torch.OutOfMemoryError as err:  # stacking the group's state: nothing consumed yet
                raise _OutOfMemory(str(err)) from err
            training.run()  # converts running out of memory in its first step itself (later, it cannot)
        except _OutOfMemory:
            raise
        except _NotBatchable as err:
            self.unbatchable[_step_key(first)] = (
                f"its first batched step failed: {str(err).splitlines()[0] if str(err) else '?'}"
            )
            return False
        return True


_ALONE = "no other client of its chunk trained the same role, step and settings at the same point"


def _step_key(request: FitRequest) -> tuple:
    """(role, step function's code): what a failed first step marks as not batchable for the rest of the run."""
    return request.role, getattr(request.step_fn, "__func__", request.step_fn).__code__


class _NotBatchable(Exception):
    """The first vmapped step failed (e.g. data-dependent control flow, random numbers): run sequentially."""


class _OutOfMemory(_NotBatchable):
    """The group's stacked state or its first step ran out of device memory: run it in smaller groups."""


class _GroupTraining:
    """One group's fits: stacked state, per-step batches, vmapped gradients, stacked optimizer update.

    Every stacked tensor lives in a :class:`_FlatStore`: the trained parameters in ``[clients, P]`` rows
    (one buffer per dtype), each optimizer moment in rows of the same layout, the other roles' parameters
    in rows of their own, module buffers in contiguous blocks. Gradients are taken with respect to the
    parameter rows themselves, so the optimizer rule is a few whole-buffer operations, and vmap sees a few
    buffers instead of hundreds of tensors (its input and output handling was a fifth of a step on a GPU).
    """

    def __init__(self, loop: LocalLoop, group: list[FitRequest]):
        self.loop, self.group = loop, group
        first = group[0]
        self.role = first.role
        self.slot = loop.slots[first.role]
        self.clients = len(group)
        module = self.slot.module
        self.trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        self.rule = _update_rule(self.slot.optimizer)
        group_options = self.slot.optimizer.param_groups[0]
        self.options = {k: v for k, v in group_options.items() if k != "params"}
        self.options["lr"] = self.slot.base_lrs[0] * loop.training.lr_schedule(first.rnd, loop.rounds)
        self.options["decoupled_weight_decay"] = isinstance(self.slot.optimizer, torch.optim.AdamW) or bool(
            group_options.get("decoupled_weight_decay")
        )
        device = loop.fabric.device
        trained = {("slot", self.role, n) for n in self.trainable}
        # a tensor that two roles share (one module in two roles) is stored once, under the trained role's name
        # when it is one of them: reparametrizing that name changes the module both roles hold
        self.alias = _shared_tensors(loop, trained)
        tensors: dict[tuple, Tensor] = {}
        for role, named in first.slots.items():
            for name in named:
                if ("slot", role, name) not in self.alias:
                    tensors["slot", role, name] = torch.stack([r.slots[role][name] for r in group])
        buffers = {("slot", role, n) for role, slot in loop.slots.items() for n, _ in slot.module.named_buffers()}
        if first.optimizer_state and set(first.optimizer_state) != set(self.trainable):
            raise _NotBatchable("the optimizer state does not cover every trained parameter")
        self.kind_of = {
            n: (tensors["slot", self.role, n].dtype, tensors["slot", self.role, n].device) for n in self.trainable
        }
        for name in self.trainable:  # moments in the parameters' order, so each moment's rows match theirs
            if first.optimizer_state:
                values = {
                    k: torch.stack([r.optimizer_state[name][k] for r in group]).to(device)
                    for k in first.optimizer_state[name]
                }
            else:  # fresh moments, made for the whole group at once (torch makes them at the first step)
                values = _fresh_state(self.rule, self.options, tensors["slot", self.role, name][0], self.clients)
            for key, value in values.items():
                if key != "step":
                    tensors["moment", key, name] = value
                    continue
                # one count per client and dtype; torch counts per parameter, which differ only when a parameter
                # once had no gradient (torch skips it): then the sequential loop keeps the counts apart
                count = tensors.setdefault(("step", self.kind_of[name]), value.to(torch.float32))
                if not torch.equal(count, value.to(torch.float32)):
                    raise _NotBatchable("the optimizer's step counts differ between parameters")
        self.moment_keys = sorted({key[1] for key in tensors if key[0] == "moment"})
        tensors[_TOTAL] = torch.zeros(self.clients, device=device)

        in_rows, self.eval_norms = _norm_buffers_for_rows(loop, self.role, first.modes)

        def label(key: tuple) -> str:
            if key in buffers and key not in in_rows:
                return "blocks"  # updated in place by vmap's batch-norm rule inside the forward: must be contiguous
            if key in trained:
                return "params"
            if key[0] == "moment":
                return f"moment:{key[1]}"
            return "frozen" if key[0] == "slot" else "counters"

        self.store = _FlatStore(tensors, label)
        for key in self.moment_keys:  # a rule adds moment rows to parameter rows element for element
            for kind, (_, sizes, _) in self.store.layout.items():
                if kind[0] == "params" and self.store.layout.get((f"moment:{key}", *kind[1:]), (0, None))[1] != sizes:
                    raise _NotBatchable(f"the optimizer's {key} does not match the parameters' dtypes and shapes")
        # closure values: one object for every client stays as it is; per-client tensors are stacked and mapped
        per_client = list(zip(*(_closure_values(r.step_fn) for r in group)))
        self.tensor_cells = [  # the group key made sure that other values are equal numbers or one object
            i
            for i, values in enumerate(per_client)
            if isinstance(values[0], Tensor) and any(v is not values[0] for v in values)
        ]
        self.cells = [torch.stack(v) if i in self.tensor_cells else v[0] for i, v in enumerate(per_client)]
        # every role's module under one container: one reparametrization gives each the client's tensors
        # (keyed by position: a role's name may hold a dot, which a module name may not)
        self.role_keys = {role: f"role{i}" for i, role in enumerate(loop.slots)}
        self.roles = torch.nn.ModuleDict({self.role_keys[role]: slot.module for role, slot in loop.slots.items()})
        self.tied = _tied_names(self.roles)  # found once: torch's tie_weights would search every step
        self.reparametrize = _Reparametrization(self.roles)
        self.step_index = 0
        # plain SGD moves a tensor by its gradient alone: a zero gradient leaves it as torch's skipping would
        self.checked_use = self.rule is _sgd and not self.options["momentum"] and not self.options["weight_decay"]
        self.pending_records: list[tuple[Callable, tuple]] | None = []  # step 0's, delivered once it has passed

    def run(self) -> None:
        mixed = str(getattr(self.loop.fabric.strategy.precision, "precision", "")).endswith("-mixed")
        with _batch_norm_in_float32(self.roles) if mixed else contextlib.nullcontext():
            self._run()

    def _run(self) -> None:
        from .loop import BatchStream

        loop, group = self.loop, self.group
        for role, modes in zip(loop.slots, group[0].modes):
            for module, training in zip(loop.slots[role].module.modules(), modes):
                module.training = training
        self.slot.module.train()  # as the sequential loop does for the trained role
        steps = [0] * self.clients
        # a BatchStream itself (not its generator): its next_parts lets every client's batch be gathered at once
        streams = [r.batches if isinstance(r.batches, BatchStream) else iter(r.batches) for r in group]
        gathered = _gatherable(streams)  # every client's indices and draws, gathered and augmented at once
        active = list(range(self.clients))
        step = 0
        while active:
            batches: dict[int, tuple] = {}
            by_shape: dict[tuple, list[int]] = {}
            try:
                for k in list(active):
                    batch = streams[k].next_parts() if gathered else self._next_batch(k, streams[k])
                    if batch is None:
                        active.remove(k)
                    else:
                        batches[k] = batch
                for k, batch in batches.items():
                    if not gathered and not all(isinstance(t, Tensor) for t in batch):  # e.g. from ctx.fit(batches=)
                        if step == 0:
                            raise _NotBatchable("a batch holds something other than tensors")
                        raise TypeError(
                            f"a batch of step {step} holds {[type(t).__name__ for t in batch]} where the first held "
                            "tensors only; give ctx.fit batches of tensors, or run with --runtime.executor sequential."
                        )
                    shape = len(batch[0]) if gathered else tuple(tuple(t.shape) for t in batch)
                    by_shape.setdefault(shape, []).append(k)
                for members in by_shape.values():
                    self.step_index = step
                    if gathered:
                        batch = _gather(streams[members[0]], [batches[k] for k in members])
                    else:
                        batch = tuple(torch.stack(parts) for parts in zip(*(batches[k] for k in members)))
                    self._step(members, batch, step)
                    for k in members:
                        steps[k] += 1
            except (_NotBatchable, torch.OutOfMemoryError) as err:
                if step > 0 and isinstance(err, torch.OutOfMemoryError):  # the group's state has moved on: no split
                    raise RuntimeError(
                        f"the device ran out of memory in step {step} of {self.clients} clients batched (their "
                        "first step fitted); lower runtime.batch_clients or use --runtime.executor sequential."
                    ) from err
                if step > 0:  # _NotBatchable comes from a first step only
                    raise
                # nothing of the group has changed: give the clients their first batches back
                for k, request in enumerate(group):
                    first = batches.get(k)
                    # its random state stays after the draw: the given-back batch is not drawn again
                    if gathered:  # the stream itself, so that a retried group still gathers at once
                        if first is not None:
                            streams[k].give_back(first)
                        request.batches = streams[k]
                    else:
                        request.batches = itertools.chain([first] if first is not None else [], streams[k])
                if isinstance(err, torch.OutOfMemoryError):
                    raise _OutOfMemory(str(err)) from err
                raise
            if self.pending_records is not None:  # every group of the first step ran batched
                for on_record, observed in self.pending_records:
                    on_record(observed)
                self.pending_records = None
            step += 1
        views = self.store.views()
        totals = views[_TOTAL]
        means = (totals / torch.tensor([max(s, 1) for s in steps], device=totals.device)).tolist()
        for k, request in enumerate(group):
            request.result = {"loss": means[k], "steps": float(steps[k])}
            request.slots = {
                role: {n: views[self.alias.get(("slot", role, n), ("slot", role, n))][k] for n in named}
                for role, named in request.slots.items()
            }
            state = {n: {key: views["moment", key, n][k] for key in self.moment_keys} for n in self.trainable}
            for name, values in state.items():
                if ("step", self.kind_of[name]) in views:  # each parameter its own count, as torch keeps them
                    values["step"] = views["step", self.kind_of[name]][k].clone()
            request.optimizer_state = state

    def _next_batch(self, k: int, stream: Iterator[tuple]) -> tuple | None:
        """The client's next batch, drawn under its own global random state (as its sequential fit would)."""
        request = self.group[k]
        torch.default_generator.set_state(request.rng_state[0])
        batch = next(stream, None)
        request.rng_state = (torch.default_generator.get_state(), request.rng_state[1])
        return batch

    def _step(self, members: list[int], batch: tuple, step: int) -> None:
        """One optimizer step of the clients ``members`` (ascending) on their stacked batches ``[m, B, ...]``.

        Consecutive clients (all of them, or one) are views of the store, so the update writes in place;
        scattered ones are gathered (one indexing call per buffer) and scattered back after.
        """
        first, m = members[0], len(members)
        if members[-1] - first + 1 == m:  # consecutive: views, nothing copied
            selection = self.store.select(first, m)
        else:
            selection = self.store.gather(to_device(torch.tensor(members), self.loop.fabric.device))
        params = self.store.rows(selection, "params")
        frozen = self.store.rows(selection, "frozen")
        views = self.store.views(selection, ("blocks", "counters"))
        buffers = {key: view for key, view in views.items() if key in self.store.blocks}
        index = selection.index
        cells = [self.cells[i][first : first + m] if index is None else self.cells[i][index] for i in self.tensor_cells]
        try:
            if not self.checked_use:
                self._check_every_parameter_is_used(params, frozen, buffers, cells, batch)
            grads, (losses, record) = self._gradients(
                params, frozen, buffers, cells, batch, unbatched=m == 1 and step > 0
            )
        except torch.OutOfMemoryError:
            raise  # not a step that cannot run batched: _run splits the group (first step) or stops
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            if step == 0:
                raise _NotBatchable(str(err)) from err
            raise
        if any(norm.training for norm in self.eval_norms):
            # a batch norm put into training mode updates statistics that sit in strided rows, where vmap's rule drops it
            message = "the step switches a batch norm of another role into training mode"
            if step == 0:
                raise _NotBatchable(message)
            raise RuntimeError(  # too late to fall back: this step's update of those statistics is lost
                f"{message} after its first step; a @vmappable step must not change modules' modes "
                "(set them before ctx.fit), or run with --runtime.executor sequential."
            )
        clip = self.loop.training.grad_clip_norm
        if clip is not None:
            grads = _clip_per_client(grads, clip)
        state = {kind: {key: moments[kind] for key, moments in self._moments(selection).items()} for kind in params}
        for kind, values in state.items():
            if ("step", kind) in views:
                values["step"] = views["step", kind]
        with torch.no_grad():
            self.rule(params, grads, state, self.options)  # in place: the rows are the store's
            views[_TOTAL].add_(losses.detach().float())
        self.store.scatter(selection)
        for j, k in enumerate(members):  # each client's record to its own callback, in client order
            on_record = self.group[k].on_record
            if on_record is not None and record:
                observed = tuple(t[j].detach() for t in record)
                if self.pending_records is None:
                    on_record(observed)
                else:  # a later group of step 0 may still fail, and the sequential loop would record it again
                    self.pending_records.append((on_record, observed))

    def _check_every_parameter_is_used(self, params: dict, frozen: dict, buffers: dict, cells: list, batch: tuple):
        """Refuses a step that leaves a trained tensor without a gradient: torch's optimizer skips such a tensor
        (no decay, no momentum), while a whole-row update would move it. One client, copies of its tensors."""
        self.checked_use = True
        one = torch.utils._pytree.tree_map_only(Tensor, lambda t: t[0].detach().clone(), (params, frozen, buffers))
        leaves = {key: value.requires_grad_() for key, value in self.store.split("params", one[0]).items()}
        cells_of_one, batch_of_one = torch.utils._pytree.tree_map_only(Tensor, lambda t: t[0], (cells, batch))
        tensors = {**self.store.split("frozen", one[1]), **one[2], **leaves}
        with torch.enable_grad():
            loss, _ = self.loss_of(self._step_fn(cells_of_one), tensors, batch_of_one, self.step_index)
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        unused = [key[2] for key, g in zip(leaves, grads) if g is None]
        if unused:
            raise _NotBatchable(f"the step leaves {', '.join(unused)} without a gradient")

    def _moments(self, selection: _Selection) -> dict[str, dict[tuple, Tensor]]:
        return {key: self.store.rows(selection, f"moment:{key}") for key in self.moment_keys}

    def _gradients(
        self, params: dict, frozen: dict, buffers: dict, cells: list, batch: tuple, unbatched=False
    ) -> tuple:
        """Every member's gradients (of the parameter rows) and (loss, record) in one vmapped call
        (benchmarks/compile_probe.py replaces it with a compiled one). ``unbatched``: one member, computed
        by plain autograd on its own views (a client alone in its step, e.g. the only one with a short batch,
        needs neither vmap nor torch.func's wrapping) and given its client dimension back; never in a group's
        first step, whose vmapped call checks that the step is pure."""
        if not unbatched:
            compute = torch.func.grad_and_value(self._loss, has_aux=True)
            return torch.func.vmap(compute, randomness="error")(params, frozen, buffers, cells, batch)
        leaves = {kind: flat[0].detach().requires_grad_() for kind, flat in params.items()}  # aliases: no copy
        # comprehensions, not a pytree map: ~4 Python calls fewer per tensor, and a lone step is host-bound on a GPU
        frozen = {kind: flat[0] for kind, flat in frozen.items()}
        buffers = {key: view[0] for key, view in buffers.items()}
        cells, batch = [cell[0] for cell in cells], tuple(t[0] for t in batch)
        with torch.enable_grad():
            loss, record = self._loss(leaves, frozen, buffers, cells, batch)
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        # rows of a dtype the loss does not reach (every tensor was checked to be used: none, in practice)
        grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves.values(), grads)]
        grads = {kind: g.unsqueeze(0) for kind, g in zip(leaves, grads)}
        return grads, (loss.detach().unsqueeze(0), tuple(t.detach().unsqueeze(0) for t in record))

    def _loss(self, params: dict, frozen: dict, buffers: dict, tensor_cells: list[Tensor], batch: tuple) -> tuple:
        """One client's loss with every role's module holding that client's tensors (vmap maps the clients)."""
        tensors = {**self.store.split("frozen", frozen), **buffers, **self.store.split("params", params)}
        return self.loss_of(self._step_fn(tensor_cells), tensors, batch, self.step_index)

    def _step_fn(self, tensor_cells: list[Tensor]) -> Callable:
        """The first client's own step function, with one client's closure tensors where they differ."""
        step_fn = self.group[0].step_fn
        if self.tensor_cells:
            cells = list(self.cells)
            for i, value in zip(self.tensor_cells, tensor_cells):
                cells[i] = value
            step_fn = _rebuild(step_fn, cells)
        return step_fn

    def loss_of(self, step_fn: Callable, tensors: dict[tuple, Tensor], batch: tuple, step: int) -> tuple:
        """``step_fn``'s (loss, record) for one client, every role's module holding that client's tensors
        (``tensors``: ``("slot", role, name)`` -> tensor)."""
        named = {f"{self.role_keys[key[1]]}.{key[2]}": value for key, value in tensors.items()}
        for names in self.tied:  # a tensor held under several names (tied weights, a module two roles share)
            given = next((named[n] for n in names if n in named), None)
            if given is not None:
                named.update(dict.fromkeys(names, given))
        with self.reparametrize(named), self.loop.fabric.autocast():  # autocast: the forward only
            loss = step_fn(self.slot.module, batch, step)
        loss, record = loss if isinstance(loss, tuple) else (loss, ())
        return loss.float(), tuple(record)


_TOTAL = ("total",)  # the store's entry for each client's summed loss


@dataclass
class _Selection:
    """Some consecutive clients of a store (views of its buffers) or a gathered copy of scattered ones."""

    flats: dict[tuple, Tensor]
    count: int
    first: int
    whole: int  # clients the buffers in ``flats`` hold
    index: Tensor | None = None  # the gathered clients, to scatter back


class _FlatStore:
    """Tensors ``[clients, ...]`` kept in a few flat buffers, one per label, dtype and device; every tensor is
    a view of its buffer. A step of some clients gathers each buffer once (``index_select``) and scatters it
    back once (``index_copy_``), whatever the number of tensors.

    Two layouts. Rows (any label but ``blocks``): one ``[clients, N]`` buffer whose row is a client's tensors
    side by side, in the order given; a tensor's view is strided. Buffers with equal labels' layouts (the
    parameters and each moment) line up element for element, so an optimizer rule runs on whole rows.
    ``blocks``: each tensor's ``[clients, ...]`` kept whole, one after another in a 1-D buffer, so its views
    are contiguous. Buffers the forward updates in place (batch norm's running statistics) must be
    contiguous: vmap's batch-norm rule writes a strided running mean into a copy and drops the update. A
    gather of blocks reads element positions computed from the clients' indices (cached per client count).
    """

    def __init__(self, tensors: dict[Any, Tensor], label: Callable[[Any], str] = lambda key: "rows"):
        self.clients = len(next(iter(tensors.values())))
        by_kind: dict[tuple, list] = {}
        for key, t in tensors.items():
            by_kind.setdefault((label(key), t.dtype, t.device), []).append(key)
        self.flats: dict[tuple, Tensor] = {}
        self.layout: dict[tuple, tuple[list, list[int], list[tuple[int, ...]]]] = {}
        for kind, keys in by_kind.items():
            shapes = [tuple(tensors[k].shape[1:]) for k in keys]
            if kind[0] == "blocks":
                self.flats[kind] = torch.cat([tensors[k].reshape(-1) for k in keys])
            else:
                self.flats[kind] = torch.cat([tensors[k].reshape(self.clients, -1) for k in keys], dim=1)
            self.layout[kind] = (keys, [math.prod(shape) for shape in shapes], shapes)
        self.blocks = {key for kind, (keys, _, _) in self.layout.items() if kind[0] == "blocks" for key in keys}
        self._positions: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}
        self._all = _Selection(self.flats, self.clients, 0, self.clients)
        self._full = self._views(self._all)

    def select(self, first: int, count: int) -> _Selection:
        return self._all if count == self.clients else _Selection(self.flats, count, first, self.clients)

    def gather(self, index: Tensor) -> _Selection:
        flats = {kind: flat.index_select(0, self._where(kind, index)) for kind, flat in self.flats.items()}
        return _Selection(flats, len(index), 0, len(index), index)

    def scatter(self, selection: _Selection) -> None:
        """Writes a gathered selection back (a selection of views needs nothing)."""
        if selection.index is not None:
            for kind, flat in self.flats.items():
                flat.index_copy_(0, self._where(kind, selection.index), selection.flats[kind])

    def views(self, selection: _Selection | None = None, labels: tuple[str, ...] | None = None) -> dict[Any, Tensor]:
        """Views ``[m, ...]`` of every tensor in ``selection`` (all clients when None), or of ``labels``' tensors
        only (a step needs the buffers and counters as views; the rows it takes whole)."""
        return self._full if selection is None or selection is self._all else self._views(selection, labels)

    def rows(self, selection: _Selection, label: str) -> dict[tuple, Tensor]:
        """The ``[m, N]`` buffers of ``label`` in ``selection``, by (dtype, device)."""
        out = {}
        for kind, flat in selection.flats.items():
            if kind[0] == label:
                whole = selection.whole == selection.count
                out[kind[1:]] = flat if whole else flat.narrow(0, selection.first, selection.count)
        return out

    def split(self, label: str, rows: dict[tuple, Tensor]) -> dict[Any, Tensor]:
        """Each tensor's view of ``label``'s buffers ``[..., N]`` (a client's row inside vmap): ``[..., *shape]``."""
        out = {}
        for kind, flat in rows.items():
            keys, sizes, shapes = self.layout[(label, *kind)]
            lead = flat.shape[:-1]
            for key, part, shape in zip(keys, flat.split(sizes, dim=-1), shapes):
                out[key] = part.view((*lead, *shape))  # a tuple: a 0-d tensor inside vmap has neither
        return out

    def _where(self, kind: tuple, index: Tensor) -> Tensor:
        """What to index ``kind``'s buffer with for the clients ``index``: rows, or element positions."""
        if kind[0] != "blocks":
            return index
        m = len(index)
        if (kind, m) not in self._positions:  # position of sub element q = base + client(member) * stride
            member, base, stride, offset = [], [], [], 0
            for n in self.layout[kind][1]:
                member.append(torch.arange(m).repeat_interleave(n))
                base.append(offset * self.clients + torch.arange(n).repeat(m))
                stride.append(torch.full((m * n,), n))
                offset += n
            self._positions[kind, m] = tuple(torch.cat(part).to(index.device) for part in (member, base, stride))
        member, base, stride = self._positions[kind, m]
        return base + index[member] * stride

    def _views(self, selection: _Selection, labels: tuple[str, ...] | None = None) -> dict[Any, Tensor]:
        m, first, whole = selection.count, selection.first, selection.whole
        views = {}
        for kind, (keys, sizes, shapes) in self.layout.items():
            if labels is not None and kind[0] not in labels:
                continue
            flat = selection.flats[kind]
            if kind[0] != "blocks":
                rows = flat if m == whole else flat.narrow(0, first, m)
                for key, part, shape in zip(keys, rows.split(sizes, dim=1), shapes):
                    views[key] = part.view(m, *shape)
            else:
                offset = 0
                for key, n, shape in zip(keys, sizes, shapes):
                    begin = offset * whole + first * n
                    views[key] = flat[begin : begin + m * n].view(m, *shape)
                    offset += n
        return views


def _tied_names(module: torch.nn.Module) -> list[list[str]]:
    """Groups of names under which ``module`` holds one tensor (tied weights, a submodule in two places)."""
    names: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return [group for group in names.values() if len(group) > 1]


_NORM_FORWARDS = (torch.nn.modules.batchnorm._BatchNorm.forward, torch.nn.SyncBatchNorm.forward)


def _norm_buffers_for_rows(loop: LocalLoop, trained_role: str, modes: tuple) -> tuple[set[tuple], list]:
    """Batch-norm buffers that may sit in strided rows, and the batch norms whose mode a step must not change.

    Only batch norm's own rule writes a buffer into a copy when the buffer is strided; every buffer passed to
    vmap on its own costs a step ~30 Python calls of torch.func's input handling (the teacher's and the other
    roles' statistics are half of a ResNet pair's ~136 inputs). So rows hold the running statistics of a batch
    norm in evaluation mode (it only reads them: a teacher, a role the step does not train) and every batch
    norm's ``num_batches_tracked``, which its forward increments with an ordinary in-place add.
    """
    keys, eval_norms = set(), []
    # the trained role runs in training mode throughout, a module it shares with another role too
    trained = {id(m) for m in loop.slots[trained_role].module.modules()}
    for role, role_modes in zip(loop.slots, modes):
        module = loop.slots[role].module
        for (prefix, submodule), training in zip(module.named_modules(), role_modes):
            # torch's own forward only: a subclass may update its statistics in evaluation mode (test-time adaptation)
            if type(submodule).forward not in _NORM_FORWARDS:
                continue
            training = training or id(submodule) in trained
            at = f"{prefix}." if prefix else ""
            names = ["num_batches_tracked"] if training else ["running_mean", "running_var", "num_batches_tracked"]
            keys |= {("slot", role, at + name) for name in names if submodule._buffers.get(name) is not None}
            if not training:
                eval_norms.append(submodule)
    return keys, eval_norms


def _shared_tensors(loop: LocalLoop, trained: set) -> dict[tuple, tuple]:
    """``("slot", role, name)`` -> the key a group stores that tensor under, for tensors several roles hold."""
    holders: dict[int, list[tuple]] = {}
    for role, slot in loop.slots.items():
        for name, t in [*slot.module.named_parameters(), *slot.module.named_buffers()]:
            holders.setdefault(id(t), []).append(("slot", role, name))
    alias = {}
    for keys in holders.values():
        if len(keys) > 1:
            kept = next((key for key in keys if key in trained), keys[0])
            alias |= {key: kept for key in keys if key != kept}
    return alias


def _gatherable(streams: list) -> bool:
    """Whether every client's batches come from one pool with one augmentation that can be drawn per client."""
    from .loop import BatchStream

    if not all(type(s) is BatchStream for s in streams):
        return False
    first = streams[0]
    augment_ok = first.augment is None or hasattr(first.augment, "draw")
    return augment_ok and all(s.x is first.x and s.y is first.y and (s.augment == first.augment) for s in streams[1:])


def _gather(stream, parts: list[tuple[Tensor, Tensor | None]]) -> tuple[Tensor, ...]:
    """The stacked batches ``[m, B, ...]`` of m clients: one gather from the pool, one augmentation call
    with every client's own draws (bit-identical to gathering and augmenting client by client)."""
    index = torch.stack([chosen for chosen, _ in parts])  # [m, B]
    x = stream.x[index.reshape(-1)]
    if stream.augment is not None:
        x = stream.augment.apply(x, torch.cat([draws for _, draws in parts]))
    x = x.reshape(*index.shape, *x.shape[1:])
    return (x,) if stream.y is None else (x, stream.y[index])


# ---------------------------------------------------------------------------- optimizer updates
def _update_rule(optimizer: torch.optim.Optimizer) -> Callable | None:
    """The stacked-tensor update that equals ``optimizer``'s step per client; None when there is none."""
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return _sgd
    if kind is torch.optim.Adam or kind is torch.optim.AdamW:
        return _adam
    return None


def _fresh_state(rule: Callable, options: dict, param: Tensor, clients: int) -> dict[str, Tensor]:
    """Zero moments for ``clients`` stacked copies of ``param``. A zero momentum buffer gives SGD's first
    step exactly (0 * m + g = g: dampening 0 is required) and Adam starts from zeros as torch does."""
    shape = (clients, *param.shape)
    if rule is _sgd:
        return {"momentum_buffer": param.new_zeros(shape)} if options["momentum"] else {}
    state = {"step": param.new_zeros(clients), "exp_avg": param.new_zeros(shape), "exp_avg_sq": param.new_zeros(shape)}
    if options.get("amsgrad"):
        state["max_exp_avg_sq"] = param.new_zeros(shape)
    return state


def _sgd(params: dict, grads: dict, state: dict, options: dict) -> None:
    """``torch.optim.SGD``'s update (weight decay, momentum, Nesterov) on stacked tensors, in place."""
    lr, decay, momentum = options["lr"], options["weight_decay"], options["momentum"]
    for name, param in params.items():
        grad = grads[name] if not options.get("maximize") else -grads[name]
        if decay:
            grad = grad.add(param, alpha=decay)
        if momentum:
            buffer = state[name]["momentum_buffer"].mul_(momentum).add_(grad)
            grad = grad.add(buffer, alpha=momentum) if options["nesterov"] else buffer
        param.add_(grad, alpha=-lr)


def _adam(params: dict, grads: dict, state: dict, options: dict) -> None:
    """``torch.optim.Adam`` / ``AdamW``'s update on stacked tensors, in place, with each client's own step count."""
    lr, decay, eps = options["lr"], options["weight_decay"], options["eps"]
    beta1, beta2 = options["betas"]
    corrections: dict[tuple, tuple[Tensor, Tensor]] = {}
    for name, param in params.items():
        grad = grads[name] if not options.get("maximize") else -grads[name]
        moments = state[name]
        moments["step"] += 1
        if decay and options["decoupled_weight_decay"]:
            param.mul_(1 - lr * decay)
        elif decay:
            grad = grad.add(param, alpha=decay)
        moments["exp_avg"].lerp_(grad, 1 - beta1)
        moments["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        cached = (param.dim(), param.dtype, param.device)  # every parameter of a client has taken the same steps
        if cached not in corrections:
            steps = moments["step"].double()
            shape = (-1,) + (1,) * (param.dim() - 1)
            step_size = (lr / (1 - beta1**steps)).to(param.dtype).view(shape)
            corrections[cached] = (step_size, torch.sqrt(1 - beta2**steps).to(param.dtype).view(shape))
        step_size, correction = corrections[cached]
        second = moments["exp_avg_sq"]
        if options.get("amsgrad"):
            torch.maximum(moments["max_exp_avg_sq"], second, out=moments["max_exp_avg_sq"])
            second = moments["max_exp_avg_sq"]
        denominator = (second.sqrt() / correction).add_(eps)
        param.sub_(step_size * moments["exp_avg"] / denominator)


def _clip_per_client(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """``clip_grad_norm_`` applied to each client's gradients separately (norm over all its parameters)."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    coefficient = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: g * coefficient.view((-1,) + (1,) * (g.dim() - 1)) for n, g in grads.items()}


# ---------------------------------------------------------------------------- slots and closures
def snapshot_slots(loop: LocalLoop) -> dict[str, dict[str, Tensor]]:
    """Copies of every role's parameters and buffers, as the instances hold them now."""
    return {
        role: {name: t.detach().clone() for name, t in [*slot.module.named_parameters(), *slot.module.named_buffers()]}
        for role, slot in loop.slots.items()
    }


def snapshot_optimizer(slot) -> dict[str, dict[str, Tensor]]:
    """The role's optimizer state by parameter name (tensors copied)."""
    names = {p: n for n, p in slot.module.named_parameters()}
    return {
        names[p]: {k: v.clone() if isinstance(v, Tensor) else torch.tensor(v) for k, v in s.items() if v is not None}
        for p, s in slot.optimizer.state.items()
    }


def training_modes(loop: LocalLoop) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(m.training for m in slot.module.modules()) for slot in loop.slots.values())


def restore(loop: LocalLoop, request: FitRequest) -> None:
    """Puts the client's tensors, modes and the fitted role's optimizer state back into the shared instances."""
    with torch.no_grad():
        for role, slot in loop.slots.items():
            live = dict([*slot.module.named_parameters(), *slot.module.named_buffers()])
            saved = request.slots[role]
            torch._foreach_copy_([live[n] for n in saved], list(saved.values()))
    for slot, modes in zip(loop.slots.values(), request.modes):
        for module, training in zip(slot.module.modules(), modes):
            module.training = training
    restore_optimizer(loop, request)


def restore_optimizer(loop: LocalLoop, request: FitRequest) -> None:
    """Puts the fitted role's optimizer state (as the request holds it) into the role's optimizer."""
    slot = loop.slots[request.role]
    params = dict(slot.module.named_parameters())
    slot.optimizer.state.clear()
    for name, values in request.optimizer_state.items():
        slot.optimizer.state[params[name]] = {
            k: (v.to("cpu", torch.float32) if k == "step" else v.clone()) for k, v in values.items()
        }


def random_state() -> tuple[Tensor, Tensor | None]:
    """torch's global random state (CPU, and CUDA once in use): a paused client keeps its own."""
    return torch.default_generator.get_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None


def set_random_state(state: tuple[Tensor, Tensor | None]) -> None:
    torch.default_generator.set_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _closure_values(fn: Callable) -> list:
    """The values a step function closes over (a bound method's instance first)."""
    function = getattr(fn, "__func__", fn)
    values = [fn.__self__] if hasattr(fn, "__func__") else []
    return values + [cell.cell_contents for cell in (function.__closure__ or ())]


def _rebuild(fn: Callable, values: list) -> Callable:
    """``fn`` with its closure values replaced (one client's slices of the stacked tensors)."""
    if not values:
        return fn
    function = getattr(fn, "__func__", fn)
    offset = 1 if hasattr(fn, "__func__") else 0
    cells = tuple(types.CellType(v) for v in values[offset:])
    rebuilt = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, cells
    )
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    return types.MethodType(rebuilt, values[0]) if offset else rebuilt


def _identity(value: Any) -> Any:
    """Closure values that are not tensors must be the same object (or equal numbers) to share a group."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return (type(value), value if not (isinstance(value, float) and math.isnan(value)) else "nan")
    return id(value)


class _Reparametrization:
    """Puts tensors into a module under their names while a block runs, then gives the originals back.

    torch.func.functional_call only calls ``forward``, and a step function calls other methods (``features``,
    ``head``), so the module's own entries are swapped, as torch's ``_reparametrize_module`` does. That one looks
    up each name's submodule and checks each tensor at every call (~1,600 Python calls a step for ResNet20 and
    its teacher); here the ``(dict, key)`` entry of every name is found once per set of names and a step costs
    one dict write per tensor.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.plans: dict[tuple[str, ...], list[tuple[dict, str]] | None] = {}

    @contextlib.contextmanager
    def __call__(self, tensors: dict[str, Tensor]) -> Iterator[None]:
        names = tuple(tensors)
        plan = self.plans.get(names, ())
        if plan == ():
            plan = self.plans[names] = self._plan(names)
        if plan is None:  # a name that is a plain attribute, not a parameter or buffer: torch's general swap
            from torch.nn.utils.stateless import _reparametrize_module

            with _reparametrize_module(self.module, tensors, stack_weights=True):
                yield
            return
        originals = [entries[key] for entries, key in plan]
        try:
            for (entries, key), tensor in zip(plan, tensors.values()):
                entries[key] = tensor
            yield
        finally:
            # in reverse: a tensor reachable under two names (one submodule in two places) ends as its original
            for (entries, key), original in zip(reversed(plan), reversed(originals)):
                entries[key] = original

    def _plan(self, names: tuple[str, ...]) -> list[tuple[dict, str]] | None:
        plan = []
        for name in names:
            owner, _, key = name.rpartition(".")
            submodule = self.module.get_submodule(owner)
            if key in submodule._parameters:
                plan.append((submodule._parameters, key))
            elif key in submodule._buffers:
                plan.append((submodule._buffers, key))
            else:
                return None
        return plan


@contextlib.contextmanager
def _batch_norm_in_float32(module: torch.nn.Module):
    """Batch norm of a bf16 / fp16 input in float32, its result in the input's dtype, while the block runs.

    Under autocast a convolution hands batch norm a bf16 input; the plain kernel takes it with float32
    running statistics, but vmap's batch-norm rule fails ("expected scalar type BFloat16 but found Float").
    Normalising the float32 copy and casting back gives what the plain kernel gives to bf16 rounding.
    """
    low = (torch.bfloat16, torch.float16)

    def to_float32(norm, args):
        if args and isinstance(args[0], Tensor) and args[0].dtype in low:
            norm.__dict__["_batched_input_dtype"] = args[0].dtype
            return (args[0].float(), *args[1:])
        return None

    def back_to_input_dtype(norm, args, output):
        dtype = norm.__dict__.pop("_batched_input_dtype", None)
        return output.to(dtype) if dtype is not None else None

    handles = []
    for norm in module.modules():
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            handles += [norm.register_forward_pre_hook(to_float32), norm.register_forward_hook(back_to_input_dtype)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _default_step():
    from .loop import _training_step

    return _training_step

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

import itertools
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


def vmappable(step_fn: Callable) -> Callable:
    """Marks a step function as pure: its loss depends only on its module, batch and closure values,
    it changes nothing outside (no collectors, no Python lists) and draws no random numbers."""
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
        self.unbatchable: set[Any] = set()  # (role, step code) pairs whose first batched step failed
        self.counts = {"batched_fits": 0, "sequential_fits": 0}  # reported in summary.json

    def run(self, requests: list[FitRequest]) -> None:
        groups: dict[Any, list[FitRequest]] = {}
        for request in requests:
            groups.setdefault(self._group_key(request), []).append(request)
        for key, group in groups.items():
            if key is not None and len(group) > 1 and self._try_batched(group):
                self.counts["batched_fits"] += len(group)
                continue
            for request in group:
                self._sequential(request)
            self.counts["sequential_fits"] += len(group)

    # ------------------------------------------------------------------ grouping
    def _group_key(self, request: FitRequest) -> Any:
        """Requests with equal keys can share one vmapped step; None: this one must run alone."""
        fn = request.step_fn
        function = getattr(fn, "__func__", fn)
        if fn is not _default_step() and not getattr(function, "vmappable", False):
            return None
        if getattr(self.loop.fabric.strategy.precision, "scaler", None) is not None:  # 16-mixed scales the loss
            return None
        slot = self.loop.slots[request.role]
        optimizer = slot.optimizer
        if _update_rule(optimizer) is None or len(optimizer.param_groups) != 1:
            return None
        if optimizer.param_groups[0].get("dampening"):  # SGD's first momentum step would differ (clone vs add)
            return None
        if (request.role, function.__code__) in self.unbatchable:
            return None
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
        first = group[0]
        try:
            _GroupTraining(self.loop, group).run()
        except _NotBatchable:
            code = getattr(first.step_fn, "__func__", first.step_fn).__code__
            self.unbatchable.add((first.role, code))
            return False
        return True


class _NotBatchable(Exception):
    """The first vmapped step failed (e.g. data-dependent control flow, random numbers): run sequentially."""


class _GroupTraining:
    """One group's fits: stacked state, per-step batches, vmapped gradients, stacked optimizer update."""

    def __init__(self, loop: LocalLoop, group: list[FitRequest]):
        self.loop, self.group = loop, group
        first = group[0]
        self.role = first.role
        self.slot = loop.slots[first.role]
        self.clients = len(group)
        self.stacked = {
            role: {name: torch.stack([r.slots[role][name] for r in group]) for name in first.slots[role]}
            for role in first.slots
        }
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
        self.state = {
            name: {key: torch.stack([r.optimizer_state[name][key] for r in group]).to(device) for key in keys}
            for name, keys in first.optimizer_state.items()
        }
        if not self.state:  # fresh moments, made for the whole group at once (torch makes them at the first step)
            params = dict(module.named_parameters())
            self.state = {n: _fresh_state(self.rule, self.options, params[n], self.clients) for n in self.trainable}
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
        self.step_index = 0

    def run(self) -> None:
        loop, group = self.loop, self.group
        for role, modes in zip(loop.slots, group[0].modes):
            for module, training in zip(loop.slots[role].module.modules(), modes):
                module.training = training
        self.slot.module.train()  # as the sequential loop does for the trained role
        totals = torch.zeros(self.clients, device=loop.fabric.device)
        steps = [0] * self.clients
        streams = [iter(r.batches) for r in group]
        gathered = _gatherable(streams)  # every client's indices and draws, gathered and augmented at once
        rng_before = [r.rng_state for r in group]
        active = list(range(self.clients))
        step = 0
        while active:
            batches = {}
            for k in list(active):
                batch = streams[k].next_parts() if gathered else self._next_batch(k, streams[k])
                if batch is None:
                    active.remove(k)
                else:
                    batches[k] = batch
            by_shape: dict[tuple, list[int]] = {}
            for k, batch in batches.items():
                shape = len(batch[0]) if gathered else tuple(tuple(t.shape) for t in batch)
                by_shape.setdefault(shape, []).append(k)
            try:
                for members in by_shape.values():
                    self.step_index = step
                    if gathered:
                        batch = _gather(streams[members[0]], [batches[k] for k in members])
                    else:
                        batch = tuple(torch.stack(parts) for parts in zip(*(batches[k] for k in members)))
                    losses = self._step(members, batch, step)
                    if len(members) == self.clients:  # no index tensor: it would be a copy to the GPU per step
                        totals += losses
                    else:
                        totals.index_add_(0, to_device(torch.tensor(members), totals.device), losses)
                    for k in members:
                        steps[k] += 1
            except _NotBatchable:  # nothing of the group has changed: give the clients their first batches back
                for k, request in enumerate(group):
                    first = batches.get(k)
                    if first is not None and gathered:
                        first = tuple(t[0] for t in _gather(streams[k], [first]))
                    request.batches = itertools.chain([first] if first is not None else [], streams[k])
                    request.rng_state = rng_before[k]
                raise
            step += 1
        means = (totals / torch.tensor([max(s, 1) for s in steps], device=totals.device)).tolist()
        for k, request in enumerate(group):
            request.result = {"loss": means[k], "steps": float(steps[k])}
            request.slots = {role: {n: t[k] for n, t in tensors.items()} for role, tensors in self.stacked.items()}
            request.optimizer_state = {n: {key: t[k] for key, t in s.items()} for n, s in self.state.items()}

    def _next_batch(self, k: int, stream: Iterator[tuple]) -> tuple | None:
        """The client's next batch, drawn under its own global random state (as its sequential fit would)."""
        request = self.group[k]
        torch.default_generator.set_state(request.rng_state[0])
        batch = next(stream, None)
        request.rng_state = (torch.default_generator.get_state(), request.rng_state[1])
        return batch

    def _step(self, members: list[int], batch: tuple, step: int) -> Tensor:
        """One optimizer step of the clients ``members`` on their stacked batches ``[m, B, ...]``; their losses."""
        everyone = len(members) == self.clients
        index = None if everyone else to_device(torch.tensor(members), self.loop.fabric.device)
        take = (lambda t: t) if everyone else (lambda t: t.index_select(0, index))
        stacked = {role: {n: take(t) for n, t in tensors.items()} for role, tensors in self.stacked.items()}
        params = {n: stacked[self.role][n] for n in self.trainable}
        cells = [take(self.cells[i]) for i in self.tensor_cells]
        try:
            grads, (losses, record) = self._gradients(params, stacked, cells, batch)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            if step == 0:
                raise _NotBatchable(str(err)) from err
            raise
        clip = self.loop.training.grad_clip_norm
        if clip is not None:
            grads = _clip_per_client(grads, clip)
        state = (
            self.state
            if everyone
            else {n: {k: t.index_select(0, index) for k, t in s.items()} for n, s in self.state.items()}
        )
        self.rule(params, grads, state, self.options)
        if everyone:
            self.stacked[self.role].update(params)
        else:  # write the members' new weights, buffers and moments back into the whole group's
            stacked[self.role].update(params)
            for role, tensors in stacked.items():
                for name, value in tensors.items():
                    self.stacked[role][name].index_copy_(0, index, value)
            for name, values in state.items():
                for key, value in values.items():
                    self.state[name][key].index_copy_(0, index, value)
        for j, k in enumerate(members):  # each client's record to its own callback, in client order
            on_record = self.group[k].on_record
            if on_record is not None and record:
                on_record(tuple(t[j].detach() for t in record))
        return losses.detach().float()

    def _gradients(self, params: dict, stacked: dict, cells: list[Tensor], batch: tuple) -> tuple:
        """Every member's gradients and (loss, record) in one vmapped call (benchmarks/compile_probe.py
        replaces it with a compiled one)."""
        compute = torch.func.grad_and_value(self._loss, has_aux=True)
        return torch.func.vmap(compute, randomness="error")(params, stacked, cells, batch)

    def _loss(self, params: dict[str, Tensor], stacked: dict, tensor_cells: list[Tensor], batch: tuple) -> Tensor:
        """One client's loss with every role's module holding that client's tensors (vmap maps the clients)."""
        step_fn = self.group[0].step_fn  # the first client's own function when no closure value differs
        if self.tensor_cells:
            cells = list(self.cells)
            for i, value in zip(self.tensor_cells, tensor_cells):
                cells[i] = value
            step_fn = _rebuild(step_fn, cells)
        return self.loss_of(step_fn, params, stacked, batch, self.step_index)

    def loss_of(self, step_fn: Callable, params: dict, stacked: dict, batch: tuple, step: int) -> tuple:
        """``step_fn``'s (loss, record) for one client, every role's module holding that client's tensors."""
        loop = self.loop
        tensors = {
            f"{self.role_keys[role]}.{name}": value
            for role in loop.slots
            for name, value in ({**stacked[role], **params} if role == self.role else stacked[role]).items()
        }
        with _reparametrize(self.roles, tensors), loop.fabric.autocast():  # autocast: the forward only, as sequential
            loss = step_fn(self.slot.module, batch, step)
        loss, record = loss if isinstance(loss, tuple) else (loss, ())
        return loss.float(), tuple(record)


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
    """``torch.optim.SGD``'s update (weight decay, momentum, Nesterov) on stacked tensors."""
    lr, decay, momentum = options["lr"], options["weight_decay"], options["momentum"]
    for name, param in params.items():
        grad = grads[name] if not options.get("maximize") else -grads[name]
        if decay:
            grad = grad.add(param, alpha=decay)
        if momentum:
            buffer = state[name]["momentum_buffer"].mul_(momentum).add_(grad)
            grad = grad.add(buffer, alpha=momentum) if options["nesterov"] else buffer
        params[name] = param.add(grad, alpha=-lr)


def _adam(params: dict, grads: dict, state: dict, options: dict) -> None:
    """``torch.optim.Adam`` / ``AdamW``'s update on stacked tensors, with each client's own step count."""
    lr, decay, eps = options["lr"], options["weight_decay"], options["eps"]
    beta1, beta2 = options["betas"]
    corrections: dict[int, tuple[Tensor, Tensor]] = {}
    for name, param in params.items():
        grad = grads[name] if not options.get("maximize") else -grads[name]
        moments = state[name]
        moments["step"] += 1
        if decay and options["decoupled_weight_decay"]:
            param = param * (1 - lr * decay)
        elif decay:
            grad = grad.add(param, alpha=decay)
        moments["exp_avg"].lerp_(grad, 1 - beta1)
        moments["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if param.dim() not in corrections:  # every parameter of a client has taken the same number of steps
            steps = moments["step"].double()
            shape = (-1,) + (1,) * (param.dim() - 1)
            step_size = (lr / (1 - beta1**steps)).to(param.dtype).view(shape)
            corrections[param.dim()] = (step_size, torch.sqrt(1 - beta2**steps).to(param.dtype).view(shape))
        step_size, correction = corrections[param.dim()]
        second = moments["exp_avg_sq"]
        if options.get("amsgrad"):
            torch.maximum(moments["max_exp_avg_sq"], second, out=moments["max_exp_avg_sq"])
            second = moments["max_exp_avg_sq"]
        denominator = (second.sqrt() / correction).add_(eps)
        params[name] = param - step_size * moments["exp_avg"] / denominator


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


def _reparametrize(module: torch.nn.Module, tensors: dict[str, Tensor]):
    # torch.func.functional_call only calls forward; a step function calls other methods (features, head)
    from torch.nn.utils.stateless import _reparametrize_module

    # stack_weights: restore in reverse order, so that a tensor two roles share (one module in two roles)
    # gets its original back, as nested contexts would
    return _reparametrize_module(module, tensors, stack_weights=True)


def _default_step():
    from .loop import _training_step

    return _training_step

"""One group's fits trained as one vmapped computation per step (``batched.BatchedFit`` forms the groups).

Every client's parameters, buffers and optimizer moments are stacked in a :class:`~.flat_store.FlatStore`;
each step gathers every member's batch from its own stream, computes all gradients in one
``vmap(grad_and_value(step))`` call and applies the optimizer's rule (``stacked_optim``) to whole rows.
Clients step together while their batches have one shape, or, in lockstep (``lockstep``), all of them
at every step with their batches padded.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from ...data.transforms import to_device
from ...federation.padding import padded_rows
from .fit_request import step_key
from .flat_store import FlatStore, Selection
from .gathering import gather, gatherable
from .lockstep import Lockstep, LockstepMemory, PaddedStep
from .masked_norm import masked_batch_norms, unmaskable_norm
from .placement import norm_buffers_for_rows, shared_tensors
from .reparametrize import Reparametrization, batch_norm_in_float32, tied_names
from .stacked_optim import clip_per_client, fresh_state, sgd, update_rule
from .step_closures import closure_values, rebuild

if TYPE_CHECKING:
    from ..loop import LocalLoop
    from .fit_request import FitRequest


class NotBatchable(Exception):
    """The first vmapped step failed (e.g. data-dependent control flow, random numbers): run sequentially."""


class OutOfMemory(NotBatchable):
    """The group's stacked state or its first step ran out of device memory: run it in smaller groups."""


class GroupTraining:
    """One group's fits: stacked state, per-step batches, vmapped gradients, stacked optimizer update.

    Every stacked tensor lives in a :class:`FlatStore`: the trained parameters in ``[clients, P]`` rows
    (one buffer per dtype), each optimizer moment in rows of the same layout, the other roles' parameters
    in rows of their own, module buffers in contiguous blocks. Gradients are taken with respect to the
    parameter rows themselves, so the optimizer rule is a few whole-buffer operations, and vmap sees a few
    buffers instead of hundreds of tensors (its input and output handling was a fifth of a step on a GPU).
    """

    def __init__(self, loop: LocalLoop, group: list[FitRequest], lockstep: LockstepMemory | None = None):
        self.loop, self.group = loop, group
        first = group[0]
        self.role = first.role
        self.slot = loop.slots[first.role]
        self.clients = len(group)
        self.trainable = [n for n, p in self.slot.module.named_parameters() if p.requires_grad]
        rule = update_rule(self.slot.optimizer)
        assert rule is not None, "BatchedFit batches only fits whose optimizer has a stacked update"
        self.rule = rule
        self.options = self._optimizer_options(first.rnd)
        trained = {("slot", self.role, n) for n in self.trainable}
        # a tensor that two roles share (one module in two roles) is stored once, under the trained role's name
        # when it is one of them: reparametrizing that name changes the module both roles hold
        self.alias = shared_tensors(loop, trained)
        tensors = self._stacked_slots()
        self.count_kind = {  # the step count a parameter shares: one per dtype and device
            n: (tensors["slot", self.role, n].dtype, tensors["slot", self.role, n].device) for n in self.trainable
        }
        tensors.update(self._stacked_moments(tensors))
        self.moment_keys = sorted({key[1] for key in tensors if key[0] == "moment"})
        tensors[_TOTAL] = torch.zeros(self.clients, device=loop.fabric.device)
        self.store, self.eval_norms = self._flat_store(tensors, trained)
        self.stacked_cells, self.closure_values = _closure_values(group)
        # every role's module under one container: one reparametrization gives each the client's tensors
        # (keyed by position: a role's name may hold a dot, which a module name may not)
        self.role_keys = {role: f"role{i}" for i, role in enumerate(loop.slots)}
        self.roles = torch.nn.ModuleDict({self.role_keys[role]: slot.module for role, slot in loop.slots.items()})
        self.tied = tied_names(self.roles)  # found once: torch's tie_weights would search every step
        self.reparametrize = Reparametrization(self.roles)
        self.step_index = 0
        # plain SGD moves a tensor by its gradient alone: a zero gradient leaves it as torch's skipping would
        self.checked_use = self.rule is sgd and not self.options["momentum"] and not self.options["weight_decay"]
        self.pending_records: list[tuple[Callable, tuple]] | None = []  # step 0's, delivered once it has passed
        self.mixed = str(getattr(loop.fabric.strategy.precision, "precision", "")).endswith("-mixed")
        self.memory = lockstep  # None: lockstep is off for the run
        self.lockstep = self._lockstep(lockstep)  # None: the group's clients step together by batch shape

    def _optimizer_options(self, rnd: int) -> dict:
        """The optimizer's hyper-parameters for this round's fits (the learning rate of the round)."""
        group_options = self.slot.optimizer.param_groups[0]
        options = {k: v for k, v in group_options.items() if k != "params"}
        options["lr"] = self.slot.base_lrs[0] * self.loop.training.lr_schedule(rnd, self.loop.rounds)
        options["decoupled_weight_decay"] = isinstance(self.slot.optimizer, torch.optim.AdamW) or bool(
            group_options.get("decoupled_weight_decay")
        )
        return options

    def _stacked_slots(self) -> dict[tuple, Tensor]:
        """Every role's parameters and buffers, stacked over the group's clients (``("slot", role, name)``); a
        tensor two roles share once."""
        group = self.group
        return {
            ("slot", role, name): torch.stack([r.slots[role][name] for r in group])
            for role, named in group[0].slots.items()
            for name in named
            if ("slot", role, name) not in self.alias
        }

    def _stacked_moments(self, tensors: dict[tuple, Tensor]) -> dict[tuple, Tensor]:
        """The optimizer's moments of every trained parameter, stacked (``("moment", key, name)``), in the
        parameters' order so that each moment's rows match theirs, and one step count per client and dtype."""
        first, device = self.group[0], self.loop.fabric.device
        if first.optimizer_state and set(first.optimizer_state) != set(self.trainable):
            raise NotBatchable("the optimizer state does not cover every trained parameter")
        moments: dict[tuple, Tensor] = {}
        for name in self.trainable:
            if first.optimizer_state:
                values = {
                    k: torch.stack([r.optimizer_state[name][k] for r in self.group]).to(device)
                    for k in first.optimizer_state[name]
                }
            else:  # fresh moments, made for the whole group at once (torch makes them at the first step)
                values = fresh_state(self.rule, self.options, tensors["slot", self.role, name][0], self.clients)
            for key, value in values.items():
                if key != "step":
                    moments["moment", key, name] = value
                    continue
                # one count per client and dtype; torch counts per parameter, which differ only when a parameter
                # once had no gradient (torch skips it): then the sequential loop keeps the counts apart
                count = moments.setdefault(("step", self.count_kind[name]), value.to(torch.float32))
                if not torch.equal(count, value.to(torch.float32)):
                    raise NotBatchable("the optimizer's step counts differ between parameters")
        return moments

    def _flat_store(self, tensors: dict[tuple, Tensor], trained: set[tuple]) -> tuple[FlatStore, list]:
        """The group's stacked tensors in flat buffers: trained parameters and each moment in rows of one layout,
        the other roles' parameters in rows, module buffers in blocks; and the batch norms in evaluation mode."""
        loop = self.loop
        buffers = {("slot", role, n) for role, slot in loop.slots.items() for n, _ in slot.module.named_buffers()}
        in_rows, eval_norms = norm_buffers_for_rows(loop, self.role, self.group[0].modes)

        def label(key: tuple) -> str:
            if key in buffers and key not in in_rows:
                return "blocks"  # updated in place by vmap's batch-norm rule inside the forward: must be contiguous
            if key in trained:
                return "params"
            if key[0] == "moment":
                return f"moment:{key[1]}"
            return "frozen" if key[0] == "slot" else "counters"

        store = FlatStore(tensors, label)
        for key in self.moment_keys:  # a rule adds moment rows to parameter rows element for element
            for kind, (_, sizes, _) in store.layout.items():
                if kind[0] == "params" and store.layout.get((f"moment:{key}", *kind[1:]), (0, None))[1] != sizes:
                    raise NotBatchable(f"the optimizer's {key} does not match the parameters' dtypes and shapes")
        return store, eval_norms

    def _lockstep(self, memory: LockstepMemory | None) -> Lockstep | None:
        """The group's lockstep, or None: lockstep is off, or refused for this step function or a batch norm."""
        if memory is None:
            return None
        first = self.group[0]
        why = memory.refused.get(step_key(first)) or unmaskable_norm({r: s.module for r, s in self.loop.slots.items()})
        if why is None:
            return Lockstep(memory, step_key(first), self.loop.fabric.device)
        memory.refuse(step_key(first), why)
        return None

    def run(self) -> None:
        with contextlib.ExitStack() as stack:
            if self.mixed:
                stack.enter_context(batch_norm_in_float32(self.roles))
            if self.lockstep is not None:  # inside the float32 hooks: the masked statistics see the float32 input
                stack.enter_context(masked_batch_norms(self.roles))
            self._run()

    def _run(self) -> None:
        from ..batches import BatchStream

        loop, group = self.loop, self.group
        for role, modes in zip(loop.slots, group[0].modes):
            for module, training in zip(loop.slots[role].module.modules(), modes):
                module.training = training
        self.slot.module.train()  # as the sequential loop does for the trained role
        steps = [0] * self.clients
        # a BatchStream itself (not its generator): its next_parts lets every client's batch be gathered at once
        streams = [r.batches if isinstance(r.batches, BatchStream) else iter(r.batches) for r in group]
        gathered = gatherable(streams)  # every client's indices and draws, gathered and augmented at once
        active = list(range(self.clients))
        step = 0
        while active:
            batches: dict[int, tuple] = {}
            by_shape: dict[int | tuple, list[int]] = {}  # by rows when gathered, else by the tensors' shapes
            try:
                for k in list(active):
                    # gathered: every stream is a BatchStream (gatherable)
                    batch = cast(BatchStream, streams[k]).next_parts() if gathered else self._next_batch(k, streams[k])
                    if batch is None:
                        active.remove(k)
                    else:
                        batches[k] = batch
                for k, batch in batches.items():
                    if not gathered and not all(isinstance(t, Tensor) for t in batch):  # e.g. from ctx.fit(batches=)
                        if step == 0:
                            raise NotBatchable("a batch holds something other than tensors")
                        raise TypeError(
                            f"a batch of step {step} holds {[type(t).__name__ for t in batch]} where the first held "
                            "tensors only; give ctx.fit batches of tensors, or run with --runtime.executor sequential."
                        )
                    shape = len(batch[0]) if gathered else tuple(tuple(t.shape) for t in batch)
                    by_shape.setdefault(shape, []).append(k)
                self.step_index = step
                self._step_every_client(streams, batches, by_shape, gathered, steps)
            except (NotBatchable, torch.OutOfMemoryError) as err:
                if step > 0 and isinstance(err, torch.OutOfMemoryError):  # the group's state has moved on: no split
                    raise RuntimeError(
                        f"the device ran out of memory in step {step} of {self.clients} clients batched (their "
                        "first step fitted); lower runtime.batch_clients or use --runtime.executor sequential."
                    ) from err
                if step > 0:  # NotBatchable comes from a first step only
                    raise
                # nothing of the group has changed: give the clients their first batches back
                for k, request in enumerate(group):
                    first = batches.get(k)
                    # its random state stays after the draw: the given-back batch is not drawn again
                    if gathered:  # the stream itself, so that a retried group still gathers at once
                        if first is not None:
                            cast(BatchStream, streams[k]).give_back(first)
                        request.batches = streams[k]
                    else:
                        request.batches = itertools.chain([first] if first is not None else [], streams[k])
                if isinstance(err, torch.OutOfMemoryError):
                    raise OutOfMemory(str(err)) from err
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
                if ("step", self.count_kind[name]) in views:  # each parameter its own count, as torch keeps them
                    values["step"] = views["step", self.count_kind[name]][k].clone()
            request.optimizer_state = state

    def _step_every_client(self, streams, batches: dict, by_shape: dict, gathered: bool, steps: list[int]) -> None:
        """This step of every client that has a batch: one padded call in lockstep, else one per batch shape."""
        step, lockstep = self.step_index, self.lockstep
        if lockstep is not None and batches and lockstep.applies(streams, batches, gathered):
            batch, padded = lockstep.padded_batch(self.clients, streams, batches, gathered)
            if padded.mask is None or lockstep.honoured(self, streams, batches, gathered, padded):
                self._step(list(range(self.clients)), batch, step, padded)
                for k in batches:
                    steps[k] += 1
                lockstep.count(batches, padded)
                return
            self.lockstep = None  # from this step on, by shape
        for members in by_shape.values():
            if gathered:
                batch = gather(streams[members[0]], [batches[k] for k in members])
            else:
                batch = tuple(torch.stack(parts) for parts in zip(*(batches[k] for k in members)))
            self._step(members, batch, step)
            for k in members:
                steps[k] += 1
            if self.memory is not None:
                self.memory.counts["by_shape_steps"] += 1

    def _next_batch(self, k: int, stream: Iterator[tuple]) -> tuple | None:
        """The client's next batch, drawn under its own global random state (as its sequential fit would)."""
        request = self.group[k]
        torch.default_generator.set_state(request.rng_state[0])
        batch = next(stream, None)
        request.rng_state = (torch.default_generator.get_state(), request.rng_state[1])
        return batch

    def client_loss(self, k: int, batch: tuple, mask: Tensor | None) -> float:
        """Client ``k``'s loss on ``batch`` (no gradient), on copies of its tensors (batch norm moves statistics)."""
        selection = self.store.select(0, self.clients)
        params, frozen = self.store.rows(selection, "params"), self.store.rows(selection, "frozen")
        blocks = {key: view for key, view in self.store.views(selection).items() if key in self.store.blocks}
        one = torch.utils._pytree.tree_map_only(Tensor, lambda t: t[k].detach().clone(), (params, frozen, blocks))
        tensors = {**self.store.split("frozen", one[1]), **one[2], **self.store.split("params", one[0])}
        cells = [self.closure_values[i][k] for i in self.stacked_cells]
        loss, _ = self.reparametrized_loss(self._step_fn(cells), tensors, batch, self.step_index, mask)
        return float(loss)

    def _indices(self, clients: list[int]) -> Tensor:
        return to_device(torch.tensor(clients), self.loop.fabric.device)

    def _step(self, members: list[int], batch: tuple, step: int, padded: PaddedStep | None = None) -> None:
        """One optimizer step of the clients ``members`` (ascending) on their stacked batches ``[m, B, ...]``.

        Consecutive clients (all of them, or one) are views of the store, so the update writes in place;
        scattered ones are gathered (one indexing call per buffer) and scattered back after. ``padded``: a
        lockstep step of every client, under its mask; the clients that have finished their steps get their
        state back after it (one gather before, one scatter after).
        """
        first, m = members[0], len(members)
        if members[-1] - first + 1 == m:  # consecutive: views, nothing copied
            selection = self.store.select(first, m)
        else:
            selection = self.store.gather(self._indices(members))
        finished = self.store.gather(self._indices(padded.finished)) if padded and padded.finished else None
        mask = padded.mask if padded is not None else None
        params = self.store.rows(selection, "params")
        frozen = self.store.rows(selection, "frozen")
        views = self.store.views(selection, ("blocks", "counters"))
        buffers = {key: view for key, view in views.items() if key in self.store.blocks}
        index = selection.index
        cells = [
            self.closure_values[i][first : first + m] if index is None else self.closure_values[i][index]
            for i in self.stacked_cells
        ]
        try:
            if not self.checked_use:
                self._check_every_parameter_is_used(params, frozen, buffers, cells, batch, mask)
            grads, (losses, record) = self._gradients(
                params, frozen, buffers, cells, batch, unbatched=m == 1 and step > 0, mask=mask
            )
        except torch.OutOfMemoryError:
            raise  # not a step that cannot run batched: _run splits the group (first step) or stops
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            if step == 0:
                raise NotBatchable(str(err)) from err
            raise
        if any(norm.training for norm in self.eval_norms):
            # a batch norm put into training mode updates statistics that sit in strided rows, where vmap's rule
            # drops it
            message = "the step switches a batch norm of another role into training mode"
            if step == 0:
                raise NotBatchable(message)
            raise RuntimeError(  # too late to fall back: this step's update of those statistics is lost
                f"{message} after its first step; a @vmappable step must not change modules' modes "
                "(set them before ctx.fit), or run with --runtime.executor sequential."
            )
        clip = self.loop.training.grad_clip_norm
        if clip is not None:
            grads = clip_per_client(grads, clip)
        state = {kind: {key: moments[kind] for key, moments in self._moments(selection).items()} for kind in params}
        for kind, values in state.items():
            if ("step", kind) in views:
                values["step"] = views["step", kind]
        with torch.no_grad():
            self.rule(params, grads, state, self.options)  # in place: the rows are the store's
            views[_TOTAL].add_(losses.detach().float())
        self.store.scatter(selection)
        if finished is not None:  # their step is undone: parameters, moments, step counts, statistics, losses
            self.store.scatter(finished)
        for j, k in enumerate(members):  # each client's record to its own callback, in client order
            on_record = self.group[k].on_record
            if on_record is not None and record and not (padded and padded.real[k] == 0):
                observed = tuple(t[j].detach() for t in record)
                observed = padded.cut(k, observed) if padded is not None else observed
                if self.pending_records is None:
                    on_record(observed)
                else:  # a later group of step 0 may still fail, and the sequential loop would record it again
                    self.pending_records.append((on_record, observed))

    def _check_every_parameter_is_used(
        self, params: dict, frozen: dict, buffers: dict, cells: list, batch: tuple, mask: Tensor | None = None
    ):
        """Refuses a step that leaves a trained tensor without a gradient: torch's optimizer skips such a tensor
        (no decay, no momentum), while a whole-row update would move it. One client, copies of its tensors."""
        self.checked_use = True
        one = torch.utils._pytree.tree_map_only(Tensor, lambda t: t[0].detach().clone(), (params, frozen, buffers))
        leaves = {key: value.requires_grad_() for key, value in self.store.split("params", one[0]).items()}
        cells_of_one, batch_of_one = torch.utils._pytree.tree_map_only(Tensor, lambda t: t[0], (cells, batch))
        tensors = {**self.store.split("frozen", one[1]), **one[2], **leaves}
        with torch.enable_grad():
            mask_of_one = mask[0] if mask is not None else None
            loss, _ = self.reparametrized_loss(
                self._step_fn(cells_of_one), tensors, batch_of_one, self.step_index, mask_of_one
            )
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        unused = [key[2] for key, g in zip(leaves, grads) if g is None]
        if unused:
            raise NotBatchable(f"the step leaves {', '.join(unused)} without a gradient")

    def _moments(self, selection: Selection) -> dict[str, dict[tuple, Tensor]]:
        return {key: self.store.rows(selection, f"moment:{key}") for key in self.moment_keys}

    def _gradients(
        self, params: dict, frozen: dict, buffers: dict, cells: list, batch: tuple, unbatched=False, mask=None
    ) -> tuple:
        """Every member's gradients (of the parameter rows) and (loss, record) in one vmapped call
        (benchmarks/probes/compile_probe.py replaces it with a compiled one). ``unbatched``: one member, computed
        by plain autograd on its own views (a client alone in its step, e.g. the only one with a short batch,
        needs neither vmap nor torch.func's wrapping) and given its client dimension back; never in a group's
        first step, whose vmapped call checks that the step is pure. ``mask``: ``[m, B]``, a padded batch's."""
        if not unbatched:
            compute = torch.func.grad_and_value(self._loss, has_aux=True)
            masks = () if mask is None else (mask,)  # vmap maps tensors only: no mask, no input
            return torch.func.vmap(compute, randomness="error")(params, frozen, buffers, cells, batch, *masks)
        leaves = {kind: flat[0].detach().requires_grad_() for kind, flat in params.items()}  # aliases: no copy
        # comprehensions, not a pytree map: ~4 Python calls fewer per tensor, and a lone step is host-bound on a GPU
        frozen = {kind: flat[0] for kind, flat in frozen.items()}
        buffers = {key: view[0] for key, view in buffers.items()}
        cells, batch = [cell[0] for cell in cells], tuple(t[0] for t in batch)
        with torch.enable_grad():
            loss, record = self._loss(leaves, frozen, buffers, cells, batch, None if mask is None else mask[0])
            found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        # rows of a dtype the loss does not reach (every tensor was checked to be used: none, in practice)
        filled = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves.values(), found)]
        grads = {kind: g.unsqueeze(0) for kind, g in zip(leaves, filled)}
        return grads, (loss.detach().unsqueeze(0), tuple(t.detach().unsqueeze(0) for t in record))

    def _loss(
        self, params: dict, frozen: dict, buffers: dict, tensor_cells: list[Tensor], batch: tuple, mask=None
    ) -> tuple:
        """One client's loss with every role's module holding that client's tensors (vmap maps the clients)."""
        tensors = {**self.store.split("frozen", frozen), **buffers, **self.store.split("params", params)}
        return self.reparametrized_loss(self._step_fn(tensor_cells), tensors, batch, self.step_index, mask)

    def _step_fn(self, tensor_cells: list[Tensor]) -> Callable:
        """The first client's own step function, with one client's closure tensors where they differ."""
        step_fn = self.group[0].step_fn
        if self.stacked_cells:
            cells = list(self.closure_values)
            for i, value in zip(self.stacked_cells, tensor_cells):
                cells[i] = value
            step_fn = rebuild(step_fn, cells)
        return step_fn

    def reparametrized_loss(
        self, step_fn: Callable, tensors: dict[tuple, Tensor], batch: tuple, step: int, mask: Tensor | None = None
    ) -> tuple:
        """``step_fn``'s (loss, record) for one client, every role's module holding that client's tensors
        (``tensors``: ``("slot", role, name)`` -> tensor), under its padded batch's ``mask`` ``[B]`` if any."""
        named = {f"{self.role_keys[key[1]]}.{key[2]}": value for key, value in tensors.items()}
        for names in self.tied:  # a tensor held under several names (tied weights, a module two roles share)
            given = next((named[n] for n in names if n in named), None)
            if given is not None:
                named.update(dict.fromkeys(names, given))
        with padded_rows(mask), self.reparametrize(named), self.loop.fabric.autocast():  # autocast: the forward only
            loss = step_fn(self.slot.module, batch, step)
        loss, record = loss if isinstance(loss, tuple) else (loss, ())
        return loss.float(), tuple(record)


def _closure_values(group: list[FitRequest]) -> tuple[list[int], list]:
    """The group's step-function closure: the positions of the cells that hold a tensor of each client's own,
    and every cell's value (those tensors stacked over the clients; any other value one object for all)."""
    per_client = list(zip(*(closure_values(r.step_fn) for r in group)))
    stacked = [  # the group key made sure that other values are equal numbers or one object
        i
        for i, values in enumerate(per_client)
        if isinstance(values[0], Tensor) and any(v is not values[0] for v in values)
    ]
    return stacked, [torch.stack(v) if i in stacked else v[0] for i, v in enumerate(per_client)]


_TOTAL = ("total",)  # the store's entry for each client's summed loss

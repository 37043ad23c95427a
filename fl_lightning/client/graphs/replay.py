"""Local training steps replayed as CUDA graphs (``runtime.cuda_graphs``): the sequential loop without its host cost.

:class:`StepGraphs` takes over ``LocalLoop.fit``'s steps (and :meth:`StepGraphs.run_joint_steps` those of models
trained together). A step is replayed only where a replay cannot compute anything else than the eager step:
a pure step (the default cross-entropy, or one marked ``@vmappable``), SGD, Adam or AdamW, and a key that
covers every value the step reads (the module's tensor addresses and modes, the closure, the optimizer's
hyper-parameters, the batch's shapes). A key's first step runs eagerly, its second is traced
(:class:`~.trace.StepTrace` refuses random draws, host reads and tensors on another device) and then captured;
later steps copy their batch into the graph's inputs and replay. :func:`~.optimizers.prepare_optimizer` makes Adam
capturable for every step of the run, so eager and replayed steps round alike. On a CPU,
:class:`CheckedReruns` stands in for CUDA graphs and fails where a replay would differ.

Why each rule is there, and what it costs: ``docs/executor.md``, "CUDA graphs".
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...federation.errors import ConfigError
from .capture import CudaGraphs, Graph, Trainee, fit_key_of
from .optimizers import (
    ZERO_LR,
    KeptState,
    fresh_state_is_zero,
    keeps_state,
    pause_capturable_at_zero_lr,
    resume_capturable,
)
from .trace import CheckedReruns, StepTrace

log = logging.getLogger(__name__)


def backend_for(device: torch.device) -> CudaGraphs:
    """The graph backend of ``device``: CUDA graphs, the only device they exist for."""
    if device.type != "cuda":
        raise ConfigError(
            f"runtime.cuda_graphs needs a CUDA device, but this run trains on {device.type}; set "
            "runtime.cuda_graphs false (or runtime.accelerator cuda on a machine with an NVIDIA GPU)."
        )
    return CudaGraphs(device)


class StepGraphs:
    """Runs a role's local fits, replaying each step from a CUDA graph where its key allows it."""

    def __init__(self, backend: CudaGraphs | CheckedReruns, capacity: int = 256):
        self.backend, self.capacity = backend, capacity
        self.graphs: dict[tuple, Graph] = {}
        self.refused: dict[tuple, str] = {}  # step keys whose first run showed they cannot be replayed
        self.seen: set[tuple] = set()  # step keys met once: captured when they come again
        self.kept: dict[int, KeptState] = {}  # per optimizer: the state tensors graphs were captured with
        self.counts = {"graphed_steps": 0, "eager_steps": 0, "captures": 0, "dropped": 0}
        self.eager_reasons: dict[str, int] = {}  # why steps ran eagerly, in steps (summary.json)
        self._fit_ids: dict[tuple, int] = {}
        self._fit_numbers = itertools.count()
        self._resident: dict[tuple, Tensor] = {}  # ClientContext.on_device: per (name, shape, dtype)

    def run_steps(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Iterable[tuple],
        step_fn: Callable,
        clip: float | None,
        on_record: Callable[[tuple], None] | None,
    ) -> dict[str, float]:
        """One client's fit; the same result as ``LocalLoop.run_steps``'s plain 32-bit path."""
        total, steps = self._fit(Trainee(module, ((module, optimizer),)), batches, step_fn, clip, on_record)
        return {"loss": (total / max(steps, 1)).item(), "steps": float(steps)}

    def run_joint_steps(
        self,
        modules: dict[str, nn.Module],
        trained: Sequence[tuple[nn.Module, torch.optim.Optimizer]],
        batches: Iterable[tuple],
        step_fn: Callable,
        clip: float | None,
    ) -> dict[str, float]:
        """Models of one client trained together (``client.joint.fit_jointly``): per batch, one backward
        pass of the sum of the losses ``step_fn(modules, batch, i)`` returns per role, then each module of
        ``trained`` clipped on its own and stepped by its optimizer. Returns each role's mean loss."""
        roles = tuple(modules)
        trainee = Trainee(modules, tuple(trained), roles)
        total, steps = self._fit(trainee, batches, step_fn, clip, None)
        return dict(zip(roles, (total / max(steps, 1)).tolist()))

    def _fit(self, trainee: Trainee, batches, step_fn, clip, on_record) -> tuple[Tensor, int]:
        self._forget_freed(trainee)
        trainee.train()
        default_adam = [o for _, o in trainee.pairs if pause_capturable_at_zero_lr(o)]
        fit_key, why = (None, ZERO_LR) if default_adam else fit_key_of(trainee, step_fn, clip)
        try:
            return self._steps(fit_key, why, trainee, batches, step_fn, clip, on_record)
        finally:
            for optimizer in default_adam:
                resume_capturable(optimizer)

    def resident(self, name: str, tensor: Tensor, device: torch.device) -> Tensor:
        """``tensor``'s values in a device tensor kept under ``name``, shape and dtype (refilled in place), so
        that the steps of every client and round closing over it share one graph key. Only for fits that run
        before the next copy: the sequential executor's (``ClientContext.on_device`` asks)."""
        key = (name, tuple(tensor.shape), tensor.dtype)
        kept = self._resident.get(key)
        if kept is None:
            kept = self._resident[key] = tensor.to(device, copy=True)
        else:
            kept.copy_(tensor)
        return kept

    def _steps(self, fit_key, why, trainee, batches, step_fn, clip, on_record) -> tuple[Tensor, int]:
        if fit_key is not None:  # a small number per key: the long key is hashed once a fit, not at every step
            if fit_key not in self._fit_ids and len(self._fit_ids) >= 16 * self.capacity:
                self._drop_all()  # keys that change every fit (a new tensor in the closure) would otherwise pile up
            fit_id = self._fit_ids.get(fit_key)
            if fit_id is None:  # never a number used before: a graph kept from before a drop must not match
                fit_id = self._fit_ids[fit_key] = next(self._fit_numbers)
            fit_key = fit_id
        total, steps = torch.zeros(trainee.loss_shape, device=self.backend.device), 0
        for i, batch in enumerate(batches):
            loss, record = self._one_step(fit_key, why, trainee, batch, i, step_fn, clip)
            if record is not None and on_record is not None:
                on_record(record)
            total += loss.float()
            steps += 1
        return total, steps

    def _one_step(self, fit_key, why, trainee, batch, i, step_fn, clip) -> tuple[Tensor, tuple | None]:
        """A step replayed, or run for real and captured (a key's second), or run eagerly (counted with why)."""
        reason = why
        if fit_key is not None:
            try:
                key = (fit_key, tuple((t.shape, t.dtype) for t in batch))
            except AttributeError:  # a batch of other things than tensors: nothing to copy into a graph
                key, reason = None, "a batch holds something other than tensors"
            if key is not None:
                graph = self.graphs.get(key)
                if graph is None and key not in self.refused:
                    if key in self.seen:  # a key that recurs: worth a capture (a one-off shape is not)
                        return self._run_and_capture(key, trainee, batch, i, step_fn, clip)
                    self.seen.add(key)
                    reason = "a key's first step (captured if the key recurs)"
                elif graph is not None and self._states_in_place(trainee):
                    return self._replay(key, graph, batch)
                else:
                    reason = self.refused.get(
                        key, "the optimizer's state is missing (a fit's first step makes it) or new"
                    )
        trainee.zero_grad()
        self._count_eager(reason)
        return trainee.step(batch, i, step_fn, clip)

    def _replay(self, key: tuple, graph: Graph, batch: tuple) -> tuple[Tensor, tuple | None]:
        for static, tensor in zip(graph.inputs, batch):
            static.copy_(tensor)
        loss, record = graph.handle.replay()
        self.counts["graphed_steps"] += 1
        return loss, None if record is None else tuple(t.clone() for t in record)  # the next replay reuses it

    def summary(self) -> dict[str, Any]:
        """The counts of this process since it started (a resumed run's since the resume)."""
        summary = {**self.counts, "graphs": len(self.graphs), "eager_reasons": dict(self.eager_reasons)}
        if not self.counts["graphed_steps"] + self.counts["eager_steps"]:
            summary["note"] = "no local fit went through the training loop: this method trains its own way"
        return summary

    def _count_eager(self, reason: str | None) -> None:
        self.counts["eager_steps"] += 1
        reason = reason or "not replayable"
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1

    def _run_and_capture(self, key, trainee, batch, i, step_fn, clip) -> tuple[Tensor, tuple | None]:
        """Runs the step for real (the capture's warm-up), checked op by op, then captures its graph."""
        inputs = tuple(t.clone() for t in batch)  # the graph's input tensors, filled before each replay
        trainee.zero_grad()
        trace = StepTrace(self.backend.device)
        with self.backend.warm_up(), trace:
            loss, record = trainee.step(inputs, i, step_fn, clip)
        record = None if record is None else tuple(t.clone() for t in record)
        if trace.problem is not None:
            return self._refuse(key, trace.problem, loss, record)
        if not self._states_in_place(trainee):
            return self._refuse(key, "the optimizer keeps no state for some parameter", loss, record)

        def body() -> tuple[Tensor, tuple | None]:
            trainee.zero_grad()  # gradients are the step's own, not added to the last step's
            return trainee.step(inputs, i, step_fn, clip)

        if len(self.graphs) >= self.capacity:  # before the capture: a graph freed after it would break it
            self._drop_all()
        try:
            handle = self.backend.capture(body)
        except Exception as err:  # noqa: BLE001 (whatever the capture met, the step stays eager)
            trainee.zero_grad()
            self._drop_all()  # the failed graph's teardown may have cleared the workspace the others use
            return self._refuse(
                key, f"capture failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}", loss, record
            )
        trainee.zero_grad()  # no gradient attribute left pointing into the graphs' shared memory
        self.graphs[key] = Graph(handle, inputs)
        self.counts["captures"] += 1
        self._count_eager("a key's second step (run, then captured)")
        return loss, record

    def _drop_all(self) -> None:
        """Forgets every graph and key at once. Not one graph at a time: freeing one graph clears the cuBLAS
        workspace of the capture stream, which the others still use (pytorch/pytorch#193402)."""
        self.counts["dropped"] += len(self.graphs)
        self.graphs.clear()
        self.refused.clear()
        self.seen.clear()
        self._fit_ids.clear()  # graph keys hold these numbers: they go together
        for number, kept in list(self.kept.items()):  # freed optimizers' states: no graph uses them any more
            if kept.owner() is None:
                del self.kept[number]

    def _refuse(self, key, reason: str, loss: Tensor, record) -> tuple[Tensor, tuple | None]:
        if reason not in self.refused.values():
            log.warning("runtime.cuda_graphs: a step runs eagerly: %s", reason)
        self.refused[key] = reason
        self._count_eager(reason)
        return loss, record

    def _forget_freed(self, trainee: Trainee) -> None:
        """Drops the state kept for a freed optimizer (one made per fit) whose id one of ``trainee``'s took: it is
        not this one's, and once let go its tensors' memory may be reused, so no graph captured with it may
        replay either: every graph goes."""
        for _, optimizer in trainee.pairs:
            kept = self.kept.get(id(optimizer))
            if kept is not None and kept.owner() is not optimizer:
                del self.kept[id(optimizer)]
                self._drop_all()

    def _states_in_place(self, trainee: Trainee) -> bool:
        return all(self._state_in_place(optimizer) for _, optimizer in trainee.pairs)

    def _state_in_place(self, optimizer: torch.optim.Optimizer) -> bool:
        """Puts the optimizer's state tensors into those the graphs were captured with (the first
        capture's); False where that cannot be done (no capture yet made them, or the state holds other
        parameters or entries than then)."""
        state = optimizer.state
        kept = self.kept.get(id(optimizer))  # this optimizer's own (_forget_freed ran at the fit's start)
        if kept is not None and state.get(kept.params[0], {}).get(kept.names[0]) is kept.tensors[0]:
            return True  # the replays' case: checked first
        if not keeps_state(optimizer):
            return True
        params = [p for group in optimizer.param_groups for p in group["params"] if p in state]
        if not params and kept is not None and fresh_state_is_zero(optimizer):
            # a fresh state (optimizer_state reset, a client's first fit): zeros, which Adam's first step
            # starts from and SGD's turns into a copy of the gradient, so the first step replays too
            torch._foreach_zero_(kept.tensors)
            kept.install(state)
            return True
        # in the state's own order: a fresh state installed from these keeps the order the optimizer makes
        # (saved client states then pickle, and hash, as the eager run's do)
        entries = [(p, name) for p in params for name, value in state[p].items() if isinstance(value, Tensor)]
        if not entries:
            return False
        current = [state[p][name] for p, name in entries]
        if kept is None:
            params, names = [p for p, _ in entries], [n for _, n in entries]
            self.kept[id(optimizer)] = KeptState(params, names, current, weakref.ref(optimizer))
            return True
        if len(entries) != len(kept.params) or any(
            p is not q or name != kept_name for (p, name), q, kept_name in zip(entries, kept.params, kept.names)
        ):
            return False  # other parameters or entries than when the graphs were captured: stay eager
        with torch.no_grad():
            torch._foreach_copy_(kept.tensors, current)
        kept.install(state)
        return True

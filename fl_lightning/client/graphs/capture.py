"""One captured step: what a fit trains (one module, or models trained together), the step as the plain loop
makes it, the key a replay must share with its capture, and the CUDA backend that records and replays."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .keys import frozen, module_key
from .optimizers import CAPTURABLE, REPLAYED_OPTIMIZERS


@dataclass
class Graph:
    handle: Any  # Replay, or graph_trace's rerun
    inputs: tuple[Tensor, ...]


def _step(module, optimizer, batch, i, step_fn, clip) -> tuple[Tensor, tuple | None]:
    """One optimizer step, as ``LocalLoop.run_steps``'s plain path makes it (gradients already cleared)."""
    loss = step_fn(module, batch, i)
    record = None
    if isinstance(loss, tuple):
        loss, record = loss
        record = tuple(t.detach() for t in record)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    optimizer.step()
    return loss.detach(), record


def _joint_step(modules, pairs, roles, batch, i, step_fn, clip) -> tuple[Tensor, None]:
    """One step of models trained together, as ``client.joint.fit_jointly`` makes it: its losses, one per
    role, stacked in the roles' order."""
    losses = step_fn(modules, batch, i)
    sum(losses[role] for role in roles).backward()
    for module, optimizer in pairs:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
    return torch.stack([losses[role].detach() for role in roles]), None


@dataclass(frozen=True)
class Trainee:
    """What a fit's steps train: the step function's first argument (a module, or a joint step's modules by
    role) and the (module, optimizer) pairs that each step clips one by one and steps after its backward."""

    argument: Any
    pairs: tuple[tuple[nn.Module, torch.optim.Optimizer], ...]
    roles: tuple[str, ...] | None = None  # a joint step's: it returns a loss per role

    @property
    def loss_shape(self) -> tuple[int, ...]:
        return () if self.roles is None else (len(self.roles),)

    def train(self) -> None:
        for module, _ in self.pairs:
            module.train()

    def zero_grad(self) -> None:
        for _, optimizer in self.pairs:
            optimizer.zero_grad(set_to_none=True)

    def step(self, batch, i, step_fn, clip) -> tuple[Tensor, tuple | None]:
        if self.roles is None:
            ((module, optimizer),) = self.pairs
            return _step(module, optimizer, batch, i, step_fn, clip)
        return _joint_step(self.argument, self.pairs, self.roles, batch, i, step_fn, clip)


def fit_key_of(trainee: Trainee, step_fn: Callable, clip) -> tuple[tuple | None, str | None]:
    """What a fit's steps must share with a graph's capture to replay it, or (None, why they cannot)."""
    from ..steps import training_step as _training_step

    function = getattr(step_fn, "__func__", step_fn)
    if step_fn is not _training_step and not getattr(function, "vmappable", False):
        return None, "the step is not marked pure (@vmappable)"
    for _, optimizer in trainee.pairs:
        if type(optimizer) not in REPLAYED_OPTIMIZERS:
            return None, f"the optimizer is {type(optimizer).__name__} (graphs replay SGD, Adam and AdamW steps)"
        if isinstance(optimizer, CAPTURABLE) and not all(group.get("capturable") for group in optimizer.param_groups):
            return (
                None,
                f"the {type(optimizer).__name__} optimizer is not in capturable mode "
                "(an optimizer of the method's own)",
            )
    hyper = tuple(
        tuple((k, frozen(v, 0)) for k, v in group.items() if k != "params")
        for _, optimizer in trainee.pairs
        for group in optimizer.param_groups
    )
    argument = trainee.argument
    given = id(argument) if trainee.roles is None else tuple((role, id(argument[role])) for role in trainee.roles)
    trained = tuple((module_key(module), id(optimizer)) for module, optimizer in trainee.pairs)
    closure = frozen(step_fn, 3)  # the step, its closure values, their attributes, and theirs
    return (given, trained, hyper, clip, closure), None


class CudaGraphs:
    """Captures with ``torch.cuda.graph`` on a side stream, every graph in one shared memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def warm_up(self) -> Iterator[None]:
        """The step before a capture runs on the capture's side stream (as torch's documentation asks)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    def capture(self, body: Callable[[], tuple]) -> Replay:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                outputs = body()
        except BaseException:
            del graph  # torn down now, before any other capture (its teardown clears the stream's cuBLAS workspace)
            raise
        finally:  # a capture that fails in capture_end leaves the capture stream current (torch.cuda.graph's exit)
            torch.cuda.set_stream(current)
        return Replay(graph, outputs)


class Replay:
    def __init__(self, graph, outputs: tuple):
        self.graph, self.outputs = graph, outputs

    def replay(self) -> tuple:
        self.graph.replay()
        return self.outputs

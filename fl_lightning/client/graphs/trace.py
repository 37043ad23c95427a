"""What a CUDA graph of a training step would get wrong, found on any device (``runtime.cuda_graphs``).

:class:`StepTrace` watches a step op by op (a ``TorchDispatchMode``): what no graph can replay as the eager
step runs (random draws, host reads of tensors, tensors on another device), and the sequence of operations
with their Python arguments and the addresses of the tensors from outside the step, which a replay repeats
exactly. :class:`CheckedReruns` stands in for CUDA graphs where there are none (the tests, a CPU dry run of
the GPU benchmark): a "replay" reruns the step and raises :class:`ReplayMismatch` wherever a real graph would
silently have replayed the capture's values or addresses instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SCALARS = (bool, int, float, complex, str, bytes, type(None))
_RANDOM_WORDS = ("rand", "bernoulli", "normal", "uniform", "dropout", "multinomial", "exponential", "poisson")
# ops whose result the host must read (a sync), which a capture cannot contain
_HOST_READS = {
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "bincount",
}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}  # indices a boolean mask: a nonzero inside


class StepTrace(TorchDispatchMode):
    """Watches a step's operations: what a graph could not replay (``problem``), and the sequence of
    operations with their Python arguments and the addresses of the tensors from outside the step
    (``ops``), which a replay must repeat exactly. ``undo`` keeps a copy of every outside tensor when the
    step first uses it, so that :meth:`restore` can take the step back."""

    def __init__(self, device: torch.device, ops: bool = False, undo: bool = False):
        super().__init__()
        self.device, self.keep_ops, self.undo = device, ops or undo, undo
        self.problem: str | None = None
        self.ops: list[tuple] = []
        self._made: set[int] = set()  # storages the step allocated
        self._outside: set[int] = set()  # storages the step found (weights, buffers, inputs, momenta)
        self._saved: dict[int, tuple[Tensor, Tensor]] = {}

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.problem is None:
            self.problem = self._problem(name, args, kwargs)
        if not self.keep_ops:  # a warm-up: only the problems
            return func(*args, **kwargs)
        if name == "lift_fresh" and args[0].numel() <= 16:
            # a constant the step makes from Python numbers (torch.tensor(1.0)): the same numbers are the
            # same operation, wherever they were allocated (a graph bakes the value of such a scalar)
            self.ops.append((str(func), ("constant", args[0].dtype, tuple(args[0].flatten().tolist())), ()))
            self._made.add(_storage(args[0]))
        else:
            self.ops.append((str(func), self._arguments(args), self._arguments(kwargs)))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and _storage(t) not in self._outside:
                self._made.add(_storage(t))
        return out

    def _problem(self, name: str, args, kwargs) -> str | None:
        if any(word in name for word in _RANDOM_WORDS):
            return f"the step draws random numbers ({name}), which a replay would not redraw as the eager step does"
        leaves = tree_leaves((args, kwargs))
        if name in _HOST_READS or (
            name in _INDEXING
            and len(args) > 1
            and any(isinstance(t, Tensor) and t.dtype in (torch.bool, torch.uint8) for t in tree_leaves(args[1]))
        ):
            return f"the step reads a tensor's value on the host ({name}: .item(), bool(), a boolean mask, ...)"
        for t in leaves:
            if isinstance(t, Tensor) and t.device != self.device:
                return f"the step uses a tensor on {t.device} ({name}) while it trains on {self.device}"
        return None

    def _arguments(self, values) -> tuple:
        out: list[object] = []
        for v in tree_leaves(values):
            if isinstance(v, Tensor):
                storage = _storage(v)
                if storage in self._made:
                    out.append("made")
                else:
                    self._outside.add(storage)
                    out.append(("outside", v.data_ptr(), tuple(v.shape)))
                    if self.undo and id(v) not in self._saved:  # before any change: an op's schema does not
                        self._saved[id(v)] = (v, v.detach().clone())  # always say what it writes (batch norm)
            elif isinstance(v, SCALARS):
                out.append(v)
            else:
                out.append(str(v))
        return tuple(out)

    def restore(self) -> None:
        """Puts back every outside tensor as the step found it (latest copies first, so the earliest wins
        where views overlap)."""
        with torch.no_grad():
            for tensor, saved in reversed(self._saved.values()):
                tensor.copy_(saved)


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
        return id(t)


class CheckedReruns:
    """Stands in for CUDA graphs on a CPU (tests): a capture runs the step once under :class:`StepTrace` and
    takes it back (a real capture runs nothing), a replay reruns it and raises :class:`ReplayMismatch` when its
    operations, Python arguments or outside tensors' addresses differ from the capture's: the cases where a
    CUDA graph would silently replay the capture's values instead."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.replays = 0

    def warm_up(self):
        return contextlib.nullcontext()

    def capture(self, body: Callable[[], tuple]) -> _Rerun:
        trace = StepTrace(self.device, undo=True)
        with trace:
            body()
        trace.restore()
        return _Rerun(self, body, trace.ops)


@contextlib.contextmanager
def capturable_adam_on_cpu():
    """Lets Adam's ``capturable`` mode run on CPU tensors, which torch refuses only because no CPU graph
    exists to capture it in: its arithmetic is the same on any device, so the stand-in can check it."""
    from torch.optim import adam

    real = adam._get_capturable_supported_devices
    adam._get_capturable_supported_devices = lambda *args, **kwargs: [*real(*args, **kwargs), "cpu"]
    try:
        yield
    finally:
        adam._get_capturable_supported_devices = real


class ReplayMismatch(AssertionError):
    """A rerun differed from its capture: a CUDA graph would have replayed stale values or addresses."""


class _Rerun:
    def __init__(self, owner: CheckedReruns, body: Callable[[], tuple], ops: list[tuple]):
        self.owner, self.body, self.ops = owner, body, ops

    def replay(self) -> tuple:
        trace = StepTrace(self.owner.device, ops=True)
        with trace:
            outputs = self.body()
        self.owner.replays += 1
        if trace.ops != self.ops:
            first = next(
                (i for i, (a, b) in enumerate(zip(trace.ops, self.ops)) if a != b), min(len(trace.ops), len(self.ops))
            )
            seen = trace.ops[first] if first < len(trace.ops) else None
            captured = self.ops[first] if first < len(self.ops) else None
            raise ReplayMismatch(f"operation {first} differs from the capture: {seen} vs captured {captured}")
        return outputs

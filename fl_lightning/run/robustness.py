"""Non-finite client updates (divergence) and faults injected into the simulation.

A diverging run (a learning rate, ``kd_weight`` or ``server_lr`` far too large) sends NaN or infinite
weights. The orchestrator checks each client's uplink once (one device sync per client, never per step)
and applies the recipe's ``divergence`` policy: ``stop`` ends the run with one sentence naming the
round, the client and the fix; ``drop`` skips that client's update and counts it.

:class:`Faults` makes chosen clients crash, return NaN, straggle past the round's deadline or lose their
upload, each drawn from its own seeded stream per (seed, round, client), so a resumed run injects the
same faults as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..federation.errors import ConfigError
from ..federation.seeding import Stream, derive_seed
from ..federation.types import ClientUpdate

FAULT_KINDS = ("crash", "nan", "straggle", "drop_upload")
"""Injected faults, in the order their rates are stacked on one uniform draw."""

LOWER_RATES = "lower the learning rate (training.optimizer.init_args.lr), the strategy's kd_weight or server_lr"
"""The fix for non-finite numbers of any kind: smaller steps."""
SKIP_UPDATES = "set divergence: drop to skip such updates"
"""The fix for non-finite client updates only: the server state and evaluations cannot be skipped."""
FIX = f"{LOWER_RATES}, or {SKIP_UPDATES}"
"""Both fixes, for a client's non-finite update."""


class Diverged(ConfigError):
    """The run produced non-finite numbers and the ``divergence`` policy is ``stop`` (CLI: exit 2).

    Attributes:
        round: the round in which it happened.
    """

    def __init__(self, message: str, rnd: int):
        super().__init__(message)
        self.round = rnd


@dataclass
class Faults:
    """Faults injected into the simulated clients (none by default).

    Each rate is the probability that a client's task in a round fails that way; the rates stack on one
    seeded uniform draw per (seed, round, client), so at most one fault hits a task.

    Attributes:
        crash: the client fails before it sends anything: its update is lost (no uplink, state unchanged).
        nan: the client's uplink tensors become NaN; the ``divergence`` policy decides what follows.
        straggle: the client trains but misses the round's deadline: in synchronous rounds its update is
            dropped (no uplink counted); in asynchronous mode it arrives ``straggle_factor`` times later.
        drop_upload: the client trains but its upload is lost in transit (downlink counted, no uplink).
        clients: only these client ids are faulty; every client when not given.
        straggle_factor: asynchronous mode: a straggler's simulated duration is multiplied by this.
    """

    crash: float = 0.0
    nan: float = 0.0
    straggle: float = 0.0
    drop_upload: float = 0.0
    clients: list[int] | None = None
    straggle_factor: float = 10.0

    def __post_init__(self):
        for kind in FAULT_KINDS:
            rate = getattr(self, kind)
            if not 0.0 <= rate <= 1.0:
                raise ConfigError(f"faults.{kind} must be a probability between 0 and 1, got {rate}; e.g. 0.1.")
        total = sum(getattr(self, kind) for kind in FAULT_KINDS)
        if total > 1.0 + 1e-12:
            raise ConfigError(
                f"the fault rates faults.crash + nan + straggle + drop_upload add up to {total:g}, more than 1; "
                "lower them so that their sum is at most 1."
            )
        if not self.straggle_factor >= 1.0:
            raise ConfigError(f"faults.straggle_factor must be at least 1, got {self.straggle_factor}; e.g. 10.")
        if self.clients is not None and any(c < 0 for c in self.clients):
            raise ConfigError(f"faults.clients must be client ids (0 or more), got {self.clients}.")

    def check_clients(self, num_clients: int) -> None:
        """Refuses client ids the population does not have."""
        unknown = sorted(c for c in self.clients or [] if c >= num_clients)
        if unknown:
            raise ConfigError(
                f"faults.clients names client id(s) {unknown} but the population has {num_clients} clients "
                f"(ids 0 to {num_clients - 1}); name existing ids."
            )

    def draw(self, seed: int, rnd: int, client_id: int, stream: int = 0) -> str | None:
        """The fault of one client's task (None for a healthy one), from its own seeded stream."""
        if self.clients is not None and client_id not in self.clients:
            return None
        parts = (seed, rnd, client_id, Stream.FAULTS, *((stream,) if stream else ()))
        u = np.random.default_rng(derive_seed(*parts)).uniform()
        edge = 0.0
        for kind in FAULT_KINDS:
            edge += getattr(self, kind)
            if u < edge:
                return kind
        return None


@dataclass(frozen=True)
class Robustness:
    """What the run does about faulty clients: the faults it injects and what a non-finite update does."""

    faults: Faults | None = None
    """Faults injected into the clients; none when None."""
    divergence: Literal["stop", "drop"] = "stop"
    """What a client update with NaN or infinite values does: ``stop`` the run (exit 2) or is ``drop``ped
    (counted in ``faults/dropped_nonfinite``)."""

    @property
    def may_lose_updates(self) -> bool:
        """Whether a client's update can fail to reach the server (an injected fault, or a dropped non-finite
        update): a phase may then end without an update, and each round's row counts what was lost."""
        return self.faults is not None or self.divergence == "drop"

    @property
    def event_keys(self) -> tuple[str, ...]:
        """The counts a round's row and ``summary.json`` report when updates may be lost."""
        return (*(FAULT_KINDS if self.faults is not None else ()), "dropped_nonfinite", "phases_without_updates")

    def check_clients(self, num_clients: int) -> None:
        """Refuses fault client ids the population does not have."""
        if self.faults is not None:
            self.faults.check_clients(num_clients)

    def fault_of(self, seed: int, rnd: int, client_id: int, stream: int = 0) -> str | None:
        """The injected fault of one client's task (:meth:`Faults.draw`); None for a healthy one or no faults."""
        return self.faults.draw(seed, rnd, client_id, stream) if self.faults is not None else None


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors inside a payload (dataclass fields, dicts, lists), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _poisoned(value: Any) -> Any:
    """A copy of ``value`` whose floating-point tensors are all NaN (the original is left untouched)."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, float("nan")) if value.is_floating_point() else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value, **{f.name: _poisoned(getattr(value, f.name)) for f in dataclasses.fields(value)}
        )
    if isinstance(value, dict):
        return {k: _poisoned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_poisoned(v) for v in value)
    return value


def poison(update: ClientUpdate) -> None:
    """Replaces every floating-point tensor of the update's uplink with NaN (the ``nan`` fault)."""
    update.uplink = {name: _poisoned(payload) for name, payload in update.uplink.items()}


def nonfinite_parts(update: ClientUpdate) -> list[str]:
    """Names of the uplink payloads and local metrics holding NaN or infinity (empty: all finite).

    One sync for the whole uplink (per device and dtype): a device sync per client, not per tensor or step.
    """
    tensors = [t for payload in update.uplink.values() for t in _tensors(payload)]
    bad = [f"metric {k}" for k, v in update.metrics.items() if not math.isfinite(v)]
    bad += [f"metric {k} = {v:.3g} (exploded)" for k, v in update.metrics.items() if _exploded(k, v)]
    if not all_finite(tensors):
        bad = [f"uplink {name}" for name, p in update.uplink.items() if not all_finite(_tensors(p))] + bad
    return bad


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether no element of ``tensors`` is NaN or infinite.

    A cheap total first, per device and dtype: NaN and infinity propagate into a sum (or a sum of squares), so
    a finite total clears every element at the cost of one read of the tensors and one sync. Only a total
    that is not finite (a non-finite element, or finite values whose total overflowed) goes on to the exact
    test: each tensor's largest magnitude from one ``_foreach_norm`` (infinity norm), through which NaN and
    infinity propagate and finite values cannot overflow. So the answer is the exact one either way, and an
    update that passes, the common case, costs a sum: 0.2 ms for 1.6 M float32 weights on a CPU where the
    infinity norm took 5 ms (docs/reference/measurements.md).
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.layout == torch.sparse_coo:
            t = t._values()  # the stored values (duplicates unsummed: a sum that overflows is not seen)
        elif t.layout != torch.strided:
            t = t.values()
        if t.is_complex():  # each part's magnitude: |z| itself could overflow while both parts are finite
            t = torch.view_as_real(t.resolve_conj())
        if not t.is_floating_point() or not t.numel():  # integers are finite; an empty tensor has no maximum
            continue
        if t.dtype not in _NORM_DTYPES:  # float8 and the like: _foreach_norm has no kernel for them
            t = t.float()
        groups.setdefault((t.device, t.dtype), []).append(t)
    return all(
        bool(_total(group).isfinite()) or bool(torch.stack(torch._foreach_norm(group, float("inf"))).isfinite().all())
        for group in groups.values()
    )


def _total(group: list[torch.Tensor], fused: bool | None = None) -> torch.Tensor:
    """A number that is finite only if every element of ``group`` (one device and dtype) is finite.

    On a CPU the sum of each tensor's sum: the cheapest full read there (``_foreach_norm`` has no fused CPU
    kernel and its infinity norm is not vectorised). Elsewhere (``fused``) the sum of the 2-norms from one
    ``_foreach_norm``: one kernel launch for the whole group on a GPU. Half-precision tensors are reduced in
    float32, so that their totals do not overflow at 65,504.
    """
    dtype = torch.float32 if group[0].dtype in (torch.float16, torch.bfloat16) else None
    if fused if fused is not None else group[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(group, 2, dtype=dtype)).sum()
    return torch.stack([t.sum(dtype=dtype) for t in group]).sum()


_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

LOSS_LIMIT = 1e4  # a training loss beyond this has exploded (cross-entropy of a uniform guess over C classes is ln C)


def _exploded(key: str, value: float) -> bool:
    """A finite local loss so large that training has diverged (kd_weight 1e8 reaches 1e6 and stays finite)."""
    return key.endswith("loss") and math.isfinite(value) and abs(value) > LOSS_LIMIT


def nonfinite_metrics(metrics: dict[str, Any]) -> list[str]:
    """Metric names with NaN or infinite values, except those of an evaluation that covered no client."""
    empty = {k.rsplit("/", 1)[0] for k, v in metrics.items() if k.endswith("/clients_evaluated") and v == 0}
    return [
        k
        for k, v in metrics.items()
        if isinstance(v, float) and not math.isfinite(v) and k.rsplit("/", 1)[0] not in empty
    ]

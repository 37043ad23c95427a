"""Client-level differential privacy for every payload a client uploads, and its accounting.

The unit of privacy is a client's whole upload of one round's phase: every tensor it sends is clipped, as one
vector, to the L2 bound ``clip``, and Gaussian noise of standard deviation ``noise_multiplier * clip`` is added,
either on the client before the upload leaves it (``where: client``, local DP) or once on the server to the sum of
the round's clipped uploads (``where: server``, central DP, for the methods whose aggregation is a sum or mean),
which a mean divides by the expected number of uploads under the sampler, a number fixed before the round (as
DP-FedAvg does): the number received changes when a client is added or removed, and would be released with it.
The neighbouring relation is client-level: one client's whole contribution added or removed.
What the bound applies to, per payload kind:

- model weights (a role's weights, a header, a projector, a generator): the change from the weights the client
  received for that payload this round (the weight delta); weights sent without a received copy: the weights
  themselves. Integer buffers (batch-norm step counters) are sent back as received.
- per-class tables (mean logits, prototypes, class representations): the table of every class, a zero row for a
  class the client does not hold, so that which classes a client holds is not sent either. A per-class count
  cannot be bounded with the table and is refused.
- other tensors (logits or soft labels on a public set): the tensors as they are. Integer tensors (labels,
  positions, raw examples' indices) cannot be noised and are refused.

The example counts clients report (FedAvg's weights) are not sent: with privacy on every client counts as one.

The accountant is Google's ``dp-accounting`` (RDP): each phase of each round whose uploads the server uses is one
Gaussian mechanism of the noise multiplier (the phases of a round, on the same sampled clients, are accounted as
one mechanism of their uploads side by side); with the :class:`~fl_lightning.federation.sampling.PoissonSampler`
and central noise a round is Poisson-subsampled at the sampler's rate (amplification); any other sampler, and
local noise (the server knows who was sampled), count every step at rate 1. ``dp-accounting`` is the optional
extra ``privacy`` and is imported only by a run with a ``privacy`` section.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..federation.errors import ConfigError
from ..federation.sampling import ClientSampler, PoissonSampler
from ..federation.seeding import Owner, Stream, derive_seed
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, Payload, TensorPayload
from ..knowledge.class_stats import ClassStatistics

ACCOUNTANT = "rdp"


@dataclass
class Privacy:
    """Client-level differential privacy of what clients upload (none when the section is absent).

    Attributes:
        where: ``client``: each client noises its clipped upload before sending it (local DP; the server is not
            trusted); ``server``: the server adds the noise once to the sum or mean of the clipped uploads
            (central DP; the server sees the clipped uploads).
        clip: the L2 bound of a client's whole upload of a round (see the module's text for what it bounds per
            payload kind).
        noise_multiplier: the noise's standard deviation in units of ``clip``; calibrated from ``target_epsilon``
            when not given.
        target_epsilon: the budget of the whole run; a plan that would spend more is refused before round 1.
        delta: the delta of the (epsilon, delta) guarantee; at most 1 / number of clients is advised.
    """

    where: Literal["client", "server"] = "client"
    clip: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5

    def __post_init__(self):
        if not self.clip > 0:
            raise ConfigError(f"privacy.clip must be a positive L2 bound, got {self.clip}; e.g. clip: 1.0.")
        if self.noise_multiplier is not None and self.noise_multiplier < 0:
            raise ConfigError(
                f"privacy.noise_multiplier must be 0 or more, got {self.noise_multiplier}; e.g. noise_multiplier: 1.0."
            )
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ConfigError(f"privacy.target_epsilon must be positive, got {self.target_epsilon}; e.g. 8.0.")
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta must be between 0 and 1 (exclusive), got {self.delta}; e.g. 1e-5.")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ConfigError(
                "privacy needs a noise_multiplier or a target_epsilon to calibrate one from; e.g. target_epsilon: 8."
            )


def dp_accounting_module() -> Any:
    """``dp_accounting``, imported only when a run asks for privacy; one sentence when it is not installed."""
    try:
        import dp_accounting
        import dp_accounting.rdp  # noqa: F401 - the accountant's module
    except ImportError:
        raise ConfigError(
            "privacy needs the dp-accounting package: install the extra with pip install 'fl-lightning[privacy]'."
        ) from None
    return dp_accounting


def sampling_rate(sampler: ClientSampler, where: str) -> float:
    """The rate the accountant amplifies by: the Poisson sampler's under central noise, 1 otherwise."""
    if isinstance(sampler, PoissonSampler) and sampler.tiers is None and where == "server":
        return float(sampler.rate)
    return 1.0


def epsilon_spent(noise_multiplier: float, rate: float, steps: int, delta: float, per_round: int = 1) -> float:
    """Epsilon at ``delta`` after ``steps`` Gaussian mechanisms of ``noise_multiplier`` (Poisson-subsampled at
    ``rate`` when below 1, ``per_round`` of them under one draw of the clients), from dp-accounting's RDP
    accountant; 0 before any step, infinite without noise."""
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    dp = dp_accounting_module()
    accountant = dp.rdp.RdpAccountant()
    accountant.compose(_event(dp, noise_multiplier, rate, steps, per_round))
    return float(accountant.get_epsilon(delta))


def _event(dp: Any, noise_multiplier: float, rate: float, steps: int, per_round: int = 1) -> Any:
    """``steps`` Gaussian mechanisms, ``per_round`` of them (a round's phases) on the same sampled clients: those
    are one Gaussian mechanism of the phases' uploads side by side, whose L2 sensitivity is sqrt(per_round) times
    the bound, so of noise multiplier z / sqrt(per_round), subsampled once."""
    event = dp.GaussianDpEvent(noise_multiplier / math.sqrt(per_round))
    if rate < 1.0:
        event = dp.PoissonSampledDpEvent(rate, event)
    return dp.SelfComposedDpEvent(event, steps // per_round)


def calibrate(target_epsilon: float, delta: float, rate: float, steps: int, per_round: int = 1) -> float:
    """The smallest noise multiplier whose ``steps`` mechanisms spend at most ``target_epsilon`` at ``delta``."""
    dp = dp_accounting_module()
    return float(
        dp.calibrate_dp_mechanism(
            dp.rdp.RdpAccountant,
            lambda z: _event(dp, z, rate, steps, per_round),
            target_epsilon,
            delta,
            dp.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )
    )


class PrivacyMechanism:
    """The recipe's ``privacy`` for one run: the noise multiplier, the accountant's inputs, and the mechanism that
    clips (and, with ``where: client``, noises) each upload and noises the server's aggregates.

    Args:
        privacy: the recipe's section.
        sampler: the run's client sampler (Poisson sampling gives amplification).
        num_clients: the population's size (a delta above its inverse warns).
        rounds: the run's planned rounds.
        phases: the strategy's phases per round whose uploads the server uses (each one step of the accountant).
        num_classes: the classes of per-class tables (sent whole).
        seed: the run seed (the noise's streams).
        population: the clients, whose sampling probabilities give central noise its denominator (needed with
            ``where: server``).
    """

    def __init__(
        self,
        privacy: Privacy,
        sampler: ClientSampler,
        num_clients: int,
        rounds: int,
        phases: int,
        num_classes: int,
        seed: int,
        population: Sequence[ClientSpec] | None = None,
    ):
        self.privacy, self.num_classes, self.seed, self.phases = privacy, num_classes, seed, phases
        self.where, self.clip, self.delta = privacy.where, privacy.clip, privacy.delta
        self.rate = sampling_rate(sampler, privacy.where)
        if privacy.delta > 1.0 / num_clients:
            warnings.warn(
                f"privacy.delta {privacy.delta:g} is above 1 / {num_clients} clients: a mechanism that fully reveals "
                "one client in 1 / delta would meet it; choose a delta well below 1 / clients.",
                stacklevel=2,
            )
        self.planned_steps = rounds * phases
        if privacy.noise_multiplier is None:
            assert privacy.target_epsilon is not None  # Privacy refuses neither
            self.noise_multiplier = calibrate(
                privacy.target_epsilon, self.delta, self.rate, self.planned_steps, self.phases
            )
        else:
            self.noise_multiplier = float(privacy.noise_multiplier)
        self.rounds = rounds
        self._check_plan()
        self._inclusion = None if population is None else _inclusion(sampler, list(population))
        self._server_draws = 0
        self._round = 0

    @property
    def std(self) -> float:
        """The noise's standard deviation per coordinate of a client's upload (of the sum, on the server)."""
        return self.noise_multiplier * self.clip

    def _check_plan(self) -> None:
        planned, target = self.epsilon(self.rounds), self.privacy.target_epsilon
        if target is not None and planned > target * (1 + 1e-6):
            raise ConfigError(
                f"the plan spends epsilon {planned:.4g} over {self.rounds} rounds (noise_multiplier "
                f"{self.noise_multiplier:g}, sampling rate {self.rate:g}, delta {self.delta:g}), more than "
                f"privacy.target_epsilon {target:g}; raise the noise_multiplier, or drop it to calibrate one, or "
                "plan fewer rounds."
            )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the noise multiplier the rounds so far were noised with."""
        return {"noise_multiplier": self.noise_multiplier}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume goes on with the noise multiplier of the rounds before (a calibration over more rounds would
        change it, and the epsilon of the rounds done with it), its plan checked again."""
        self.noise_multiplier = float(state["noise_multiplier"])
        self._check_plan()

    # ------------------------------------------------------------------ accounting
    def steps(self, rounds_done: int) -> int:
        """The mechanism's compositions after ``rounds_done`` rounds."""
        return rounds_done * self.phases

    def epsilon(self, rounds_done: int) -> float:
        """Epsilon spent after ``rounds_done`` rounds (recomputed from them: a resume continues exactly)."""
        return epsilon_spent(self.noise_multiplier, self.rate, self.steps(rounds_done), self.delta, self.phases)

    def summary(self, rounds_done: int) -> dict[str, Any]:
        """The ``privacy`` block of ``summary.json``."""
        return {
            "epsilon": self.epsilon(rounds_done),
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "sampling_rate": self.rate,
            "steps": self.steps(rounds_done),
            "accountant": ACCOUNTANT,
            "where": self.where,
        }

    # ------------------------------------------------------------------ the client's side
    def privatize(self, method: str, task: ClientTask, update: ClientUpdate, phase: int) -> ClientUpdate:
        """The update as it leaves the client: its payloads clipped together to ``clip`` (and noised with
        ``where: client``), its example count replaced by 1."""
        parts = {
            name: _vectors(method, name, payload, task.downlink, self.num_classes)
            for name, payload in update.uplink.items()
        }
        norm = math.sqrt(
            sum(float(v.double().square().sum()) for part in parts.values() for v in part.tensors.values())
        )
        scale = min(1.0, self.clip / norm) if norm > 0 else 1.0
        generator = None
        if self.where == "client":
            seed = derive_seed(self.seed, task.round, task.client.id, Stream.PRIVACY, phase)
            generator = torch.Generator().manual_seed(seed)
        uplink = {}
        for name, part in parts.items():
            noised = {key: self._noised(value * scale, generator) for key, value in part.tensors.items()}
            uplink[name] = part.rebuild(noised)
        update.uplink, update.num_samples = uplink, 1
        return update

    def _noised(self, value: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None or self.std == 0:
            return value
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * self.std
        return (value.double() + noise.to(value.device)).to(value.dtype)

    # ------------------------------------------------------------------ the server's side
    def begin_round(self, rnd: int) -> None:
        """The server's noise of round ``rnd`` starts its own stream."""
        self._round, self._server_draws = rnd, 0

    def central_noise(
        self, total: Mapping[str, torch.Tensor], senders: Sequence[ClientSpec]
    ) -> tuple[dict[str, torch.Tensor], float]:
        """DP-FedAvg's server side: ``total``, the sum of the round's clipped contributions to one aggregate, with
        Gaussian noise of standard deviation ``noise_multiplier * clip`` (one client changes the sum by at most
        ``clip``), and the number to divide it by for a mean: the expected number of contributions from
        ``senders`` (the clients that may send to this aggregate) under the sampler. That number is fixed before
        the round; the number received would tell who took part, so a mean over it is not what is accounted.
        Integer tensors stay as they are."""
        if self.where != "server":
            raise RuntimeError("central_noise is the server's noise, which a run with where: client never adds")
        if self._inclusion is None:
            raise RuntimeError(
                "central noise needs the population's sampling probabilities (PrivacyMechanism's population)"
            )
        self._server_draws += 1
        seed = derive_seed(self.seed, self._round, Owner.SERVER, Stream.PRIVACY, self._server_draws)
        generator = torch.Generator().manual_seed(seed)
        out = {}
        for key, value in total.items():
            if value.dtype.is_floating_point and self.std > 0:
                noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * self.std
                value = (value.double() + noise.to(value.device)).to(value.dtype)
            out[key] = value
        return out, self.expected_count(senders)

    def expected_count(self, senders: Sequence[ClientSpec]) -> float:
        """The expected number of ``senders`` a round samples (the sum of their sampling probabilities)."""
        assert self._inclusion is not None
        return float(sum(self._inclusion.get(client.id, 0.0) for client in senders))


def _inclusion(sampler: ClientSampler, population: list[ClientSpec]) -> dict[int, float]:
    try:
        return sampler.inclusion(population)
    except NotImplementedError:
        raise ConfigError(
            f"privacy where: server divides by the expected number of clients a round samples, which "
            f"{type(sampler).__name__} does not give (ClientSampler.inclusion); use UniformSampler or PoissonSampler, "
            "or where: client."
        ) from None


@dataclass
class _Vectors:
    """The float tensors of one payload that the bound applies to, and how to make the payload from them again."""

    tensors: dict[str, torch.Tensor]
    rebuild: Callable[[dict[str, torch.Tensor]], Payload]


def _vectors(method: str, name: str, payload: Payload, downlink: Mapping[str, Payload], num_classes: int) -> _Vectors:
    """What of ``payload`` is clipped and noised (see the module's text), or one sentence why it cannot be."""
    if isinstance(payload, ModelWeights):
        received = downlink.get(name)
        reference = received.state if isinstance(received, ModelWeights) else {}
        deltas, fixed = {}, {}
        for key, value in payload.state.items():
            ref = reference.get(key)
            if value.dtype.is_floating_point:
                deltas[key] = value - ref.to(value) if ref is not None and ref.shape == value.shape else value
            elif ref is not None:
                fixed[key] = ref.clone()  # a step counter goes back as it came
            else:
                raise _refused(method, name, f"its integer tensor {key!r} came with no received copy to send back")
        with_ref = {k for k in deltas if k in reference and reference[k].shape == deltas[k].shape}

        def weights(noised: dict[str, torch.Tensor]) -> Payload:
            state = {}
            for key in payload.state:
                if key in fixed:
                    state[key] = fixed[key]
                else:
                    state[key] = noised[key] + reference[key].to(noised[key]) if key in with_ref else noised[key]
            return ModelWeights(payload.role, state)

        return _Vectors(deltas, weights)
    if isinstance(payload, ClassStatistics):
        if "counts" in payload.vectors:
            raise _refused(
                method, name, "it carries per-class counts, which the bound cannot cover (use uniform weighting)"
            )
        _check_float(method, name, payload.vectors)
        labels = payload.labels.long()
        keep = labels >= 0
        dense = {}
        for key, rows in payload.vectors.items():
            table = torch.zeros(num_classes, rows.shape[1], dtype=rows.dtype, device=rows.device)
            table[labels[keep].to(rows.device)] = rows[keep.to(rows.device)]
            dense[key] = table
        every = torch.arange(num_classes, dtype=torch.int32, device=payload.labels.device)
        return _Vectors(dense, lambda noised: ClassStatistics(payload.kind, noised, every.clone()))
    if isinstance(payload, TensorPayload):
        _check_float(method, name, payload.tensors)
        return _Vectors(dict(payload.tensors), lambda noised: TensorPayload(payload.kind, noised))
    raise _refused(method, name, f"a {type(payload).__name__} is no payload kind the mechanism knows how to bound")


def _check_float(method: str, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    for key, value in tensors.items():
        if not value.dtype.is_floating_point:
            raise _refused(method, name, f"its {value.dtype} tensor {key!r} (labels or indices) cannot be noised")


def _refused(method: str, name: str, why: str) -> ConfigError:
    return ConfigError(f"privacy cannot bound {method}'s upload {name!r}: {why}; run {method} without privacy.")

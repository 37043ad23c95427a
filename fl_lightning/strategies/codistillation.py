"""Server-side codistillation between two model pools (paper 002, Algorithms 1 and 2): the round shared by
PeriodicCodist and MergedCodist, in which each pool's student learns from the other pool's frozen teacher on
the server's unlabeled examples, and :class:`CodistillationPools`, the base both methods build on. Its
targets and batches are :mod:`fl_lightning.knowledge.codistill`'s."""

from __future__ import annotations

import functools
import itertools
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..data.transforms import random_flips
from ..federation.bounds import Bounded, Fraction01, NonNegative, NonNegativeInt, Positive, PositiveInt
from ..federation.errors import ConfigError
from ..federation.schedules import linear_decay
from ..federation.types import ClientUpdate, Role, StateDict
from ..knowledge.codistill import codistillation_targets, mixup, random_batches
from ..knowledge.distillation import kl_to_targets
from .fedadam import FedAdam

if TYPE_CHECKING:
    from .base import ServerContext


class Codistillation(Bounded):
    """Settings and run of one bidirectional codistillation round between two model pools.

    Teachers are frozen copies of the current models; each student starts from its own current model
    and learns from the other pool's teacher (Algorithm 1 line 7 / Algorithm 2 line 6).

    Args:
        steps: s, distillation steps per codistillation round.
        batch_size: server examples per step (drawn with replacement from the server's unlabeled set).
        lr: Adam learning rate of each student (a number, or one per student role).
        lr_final: the rate in the last round as a fraction of ``lr`` (linear decay over rounds; 1: none).
        temperature: softmax temperature of each teacher (a number, or one per teacher role).
        student_reg: beta, weight of the student's own initial soft labels in its targets.
        augment: augment the distillation examples (Appendix C.1); ``None`` does so for image inputs
            ``[N, C, H, W]`` and not for token inputs.
        mixup: the Beta(a, a) concentration a of mixup's ``lam`` (the paper's "beta = 2"); ``None`` or 0: no mixup.
        flips: extra random horizontal and vertical flips (each with probability 0.5, per example).
        data_augmentation: first apply the data set's training augmentation (FedJAX's crop and flip on
            CIFAR, which the paper's "additional" flips come on top of).
    """

    def __init__(
        self,
        steps: NonNegativeInt = 50,
        batch_size: PositiveInt = 64,
        lr: Positive | dict[str, Positive] = 1e-3,
        lr_final: NonNegative = 1.0,
        temperature: Positive | dict[str, Positive] = 1.0,
        student_reg: Fraction01 = 0.0,
        augment: bool | None = None,
        mixup: NonNegative | None = 2.0,  # a Beta concentration
        flips: bool = True,
        data_augmentation: bool = True,
    ):
        self.steps, self.batch_size, self.lr, self.lr_final = steps, batch_size, lr, lr_final
        self.temperature, self.student_reg = temperature, student_reg
        self.augment, self.mixup, self.flips, self.data_augmentation = augment, mixup, flips, data_augmentation

    @staticmethod
    def _per_role(value, role):
        return value[role] if isinstance(value, dict) else value

    def check_roles(self, method: str, roles) -> None:
        """Refuses a per-role ``lr`` or ``temperature`` that misses one of the pools' roles (found at setup,
        not in the first codistillation round)."""
        for option, value in (("lr", self.lr), ("temperature", self.temperature)):
            missing = [role for role in roles if isinstance(value, dict) and role not in value]
            if missing:
                raise ConfigError(
                    f"{method}'s distillation {option} gives no value for role(s) {missing}; give one per role "
                    f"({', '.join(roles)}) or a single number."
                )

    def run(
        self,
        server: ServerContext,
        weights: dict[str, StateDict],
        roles: tuple[str, str],
        x: Tensor,
        progress: float,
        generator: torch.Generator,
    ) -> dict[str, StateDict]:
        """Students of both roles; ``progress`` in [0, 1] decays the learning rates."""
        augment = self.augmentation(x, server.data.augment)
        if augment is None:  # the teachers' predictions on the server set serve every step
            logits = {r: server.predict(r, weights[r], x) for r in roles}
        students = {}
        for student, teacher in (roles, roles[::-1]):
            temperature = self._per_role(self.temperature, teacher)
            lr = self._per_role(self.lr, student) * linear_decay(progress, self.lr_final)
            if augment is None:
                targets = codistillation_targets(logits[teacher], logits[student], temperature, self.student_reg)
                batches: Iterable[tuple[Tensor, Tensor]] = itertools.islice(
                    random_batches(x, targets, self.batch_size, generator), self.steps
                )
            else:  # the teachers label the augmented (mixed, flipped) examples themselves
                inputs = self.augmented_examples(x, augment, generator)
                teacher_logits = server.predict(teacher, weights[teacher], inputs)
                own = server.predict(student, weights[student], inputs) if self.student_reg else teacher_logits
                targets = codistillation_targets(teacher_logits, own, temperature, self.student_reg)
                b = min(self.batch_size, len(x))
                batches = ((inputs[i : i + b], targets[i : i + b]) for i in range(0, len(inputs), b))

            def step(module, batch, i, temperature=temperature):
                xb, tb = batch
                return kl_to_targets(module(xb), tb, temperature)

            students[student] = server.train(
                student, weights[student], batches, step, functools.partial(torch.optim.Adam, lr=lr)
            )
        return students

    def augmentation(
        self, x: Tensor, data_augment: Callable[[Tensor, torch.Generator], Tensor]
    ) -> Callable[[Tensor, torch.Generator], Tensor] | None:
        """The batch augmentation of the distillation examples, or ``None`` when they are used as they are."""
        images = x.dim() == 4 and x.is_floating_point()
        if self.augment is False or (self.augment is None and not images):
            return None
        if not images:
            raise ConfigError(
                f"Codistillation augment: true needs image inputs [N, C, H, W]; the server set has shape "
                f"{tuple(x.shape)} ({x.dtype}). Set distillation augment: false (or null: images only)."
            )

        def augment(batch: Tensor, generator: torch.Generator) -> Tensor:
            if self.data_augmentation:
                batch = data_augment(batch, generator)
            if self.flips:
                batch = random_flips(batch, generator)
            if self.mixup:
                batch = mixup(batch, generator, self.mixup)[0]
            return batch

        return augment

    def augmented_examples(
        self, x: Tensor, augment: Callable[[Tensor, torch.Generator], Tensor], generator: torch.Generator
    ) -> Tensor:
        """All ``steps`` batches of one student, ``[steps * batch, ...]``: drawn with replacement, then augmented.

        They are built before training so that the frozen teacher and the student's initial model
        (student regularisation) label them in one pass each.
        """
        b = min(self.batch_size, len(x))
        batches = []
        for _ in range(self.steps):
            idx = torch.randint(len(x), (b,), generator=generator).to(x.device)
            batches.append(augment(x[idx], generator))
        return torch.cat(batches)


class CodistillationPools(FedAdam):
    """Two FedAdam pools, a small and a large model, that the server codistils on its unlabeled examples: what
    PeriodicCodist (every ``period`` rounds) and MergedCodist (every round, merged into the update) share.

    All clients train the small model; high-capacity clients (the tiers that also list the large role) train
    the large one. A subclass decides in ``aggregate`` when and how the students of :meth:`students` enter.

    Args:
        small_role, large_role: the two pools' roles.
        distillation: steps, batch size, learning rates, temperatures and student regularization.
        (server_lr, server_lr_final, beta1, beta2, eps, weighted, clients_per_round: as FedAdam)
    """

    def __init__(
        self, small_role: str = "small", large_role: str = "large", distillation: Codistillation | None = None, **kwargs
    ):
        super().__init__([small_role, large_role], **kwargs)  # FedAdam's server optimizer options
        self.pools = (small_role, large_role)
        self.distillation = distillation or Codistillation()

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        self.distillation.check_roles(self.name, self.pools)
        self.server_x = server.server_inputs()

    def students(self, rnd: int) -> dict[Role, StateDict]:
        """Each pool's student, distilled from the other pool's frozen current model (round ``rnd``'s schedule
        and batch order)."""
        generator = self.server.round_generator()
        weights = self.state.global_weights
        return self.distillation.run(
            self.server, weights, self.pools, self.server_x, self.server.progress(rnd), generator
        )

    @abstractmethod
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        """FedAdam's aggregation with the codistillation of the subclass."""

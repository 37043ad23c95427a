"""What a strategy's ``client_update`` sees of one client: its data, its state and the role slots."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..data import ClientData, FederatedData
from ..federation.seeding import Stream, derive_seed, seed_torch  # noqa: F401 (re-exported: strategies import them from here)
from ..federation.types import ClientSpec, StateDict, clone_state
from .batches import BatchStream, batch_stream
from .loop import LocalLoop
from .steps import ModelSlot, StepFn

if TYPE_CHECKING:  # annotations only
    from .module import ClientModule


class ClientContext:
    """One client's view during one round.

    Attributes:
        client: id, tier and roles.
        round: the round number (from 1).
        state: the client's persistent state across rounds (personal weights, buffers); saved in
            checkpoints. Strategies store tensors here, never Python objects that cannot be pickled.
        generator: the client's random stream for this round (batch order, augmentation).
    """

    def __init__(
        self,
        client: ClientSpec,
        rnd: int,
        loop: LocalLoop,
        data: FederatedData,
        state: dict,
        seed: int,
        stream: int = 0,
    ):
        self.client = client
        self.round = rnd
        self.state = state
        self.loop = loop
        self._data = data
        # `stream` tells apart several updates of one client in one round (asynchronous mode)
        parts = (seed, rnd, client.id, Stream.BATCH_ORDER) + ((stream,) if stream else ())
        self.generator = torch.Generator().manual_seed(derive_seed(*parts))
        self._loaded: set[str] = set()
        self.trained_steps: dict[str, int] = {}  # per role, the optimizer steps of this update (the compute estimate)

    # ------------------------------------------------------------------ data
    @property
    def indices(self) -> ClientData:
        return self._data.clients[self.client.id]

    @property
    def data_x(self) -> Tensor:
        """The data pool; index it with ``indices`` (for passes that are not training steps, e.g. LARs)."""
        return self._data.x

    @property
    def data_y(self) -> Tensor:
        return self._data.y

    @property
    def public_indices(self) -> Tensor:
        """Pool indices of the public set that the server and every client hold (``data.server_fraction``).

        DS-FL and FedMD clients predict on it; a round's subset is sent as positions into it.
        """
        return self._data.server_idx

    def on_device(self, name: str, tensor: Tensor) -> Tensor:
        """``tensor`` (server knowledge a step closes over, read only) on the training device, valid until
        the next client's update.

        Without graphs it is ``tensor.to(device)``: one payload every client receives stays one object, which
        the batched executor then shares instead of stacking a copy per client. With ``runtime.cuda_graphs``
        it is a copy at one address per ``name``, refilled in place for each client: a step's graph key holds
        its tensors' addresses, so what the server sends anew every round (FedHe's class logits) would
        otherwise make a new key, and a new capture, at every fit. (Graphs run the sequential executor: a
        client's fit has ended before the next client's update begins.)
        """
        graphs = self.loop.graphs
        if graphs is None or self.fits_run_later:  # a fit run later must not see the next client's refill
            return tensor.to(self.data_x.device)
        return graphs.resident(name, tensor, self.data_x.device)

    @property
    def fits_run_later(self) -> bool:
        """Whether this client's :meth:`fit` hands the fit to the batched executor, which runs it after this
        ``client_update`` has moved on and other clients' have run (it returns once the fit has run): what a step
        closes over must then be this client's own, not an instance the next client refills."""
        return self.loop.fits_run_later

    def num_examples(self, split: str = "train") -> int:
        return len(getattr(self.indices, split))

    # ------------------------------------------------------------------ the recipe's training settings
    @property
    def batch_size(self) -> int:
        """Examples per training step (``training.batch_size``)."""
        return self.loop.training.batch_size

    @property
    def eval_batch_size(self) -> int:
        """Examples per forward pass outside training (``training.eval_batch_size``): uploads of logits,
        features or representations."""
        return self.loop.training.eval_batch_size

    def learning_rate(self, role: str) -> float:
        """The role's learning rate in this round: the recipe's (its optimizer's first parameter group) times
        ``training.lr_schedule``'s factor, as the round's fit steps with. For a step a strategy takes itself
        (FedL2G's differentiable step)."""
        training = self.loop.training
        return self.slot(role).base_lrs[0] * training.lr_schedule(self.round, self.loop.rounds)

    def local_steps(self, num_examples: int | None = None) -> int:
        """The steps of one local training on ``num_examples`` examples (the training split's when None):
        ``training.local_steps``, or ``training.local_epochs`` passes of :attr:`batch_size`."""
        return self.loop.num_steps(self.num_examples() if num_examples is None else num_examples)

    def epoch_steps(self, num_examples: int) -> int:
        """The steps of one pass over ``num_examples`` examples at :attr:`batch_size` (the last batch partial).

        Example: 100 examples at batch size 32 take 4 steps.
        """
        return -(-num_examples // self.batch_size)

    def batches(
        self,
        split: str = "train",
        steps: int | None = None,
        batch_size: int | None = None,
        indices: Tensor | None = None,
    ) -> BatchStream:
        """Training batches of a local split (``train`` labeled, ``unlabeled`` gives ``(x,)``), or of the
        labeled public set (``public``: FedMD's transfer learning; the strategy checks it has labels).

        ``indices`` (pool indices, a part of ``split``) draws from those examples only: FedL2G trains on its
        training split less the examples it holds out as a quiz.
        """
        if indices is not None:
            idx = indices
        else:
            idx = self.public_indices if split == "public" else getattr(self.indices, split)
        steps = steps if steps is not None else self.local_steps(len(idx))
        y = None if split == "unlabeled" else self._data.y
        # a data set's own CropFlip can be drawn per client and applied to many clients at once (batched
        # executor); a data set that overrides augment() is called as it is
        data = self._data
        augment = data.augmentation if type(data).augment is FederatedData.augment else data.augment
        return batch_stream(
            data.x, y, idx, batch_size or self.batch_size, steps, self.generator, augment, self.loop.training.drop_last
        )

    # ------------------------------------------------------------------ models
    def load(self, role: str, weights: StateDict | None = None) -> ClientModule:
        """Loads ``weights`` (if given) into the role's shared instance and prepares its optimizer."""
        slot = self.slot(role)
        if weights is not None:
            slot.module.model.load_state_dict(weights)
        mode = self.loop.training.optimizer_state
        if mode == "reset":
            slot.optimizer.state.clear()
        elif mode == "per_client" or mode == "shared_per_phase":
            saved = self.state.get(f"optimizer/{role}") if mode == "per_client" else self.loop.phase_start.get(role)
            if saved is None:
                slot.optimizer.state.clear()
            elif mode == "per_client":
                slot.optimizer.load_state_dict(saved)
            else:  # load_state_dict keeps the tensors, which the steps update in place: the next client needs them
                slot.optimizer.load_state_dict(copy.deepcopy(saved))
        self._loaded.add(role)
        return slot.module

    def fit(
        self,
        role: str,
        split: str = "train",
        step_fn: StepFn | None = None,
        steps: int | None = None,
        batches: Iterable[tuple] | None = None,
        on_record: Callable[[tuple], None] | None = None,
    ) -> dict[str, float]:
        """Trains the loaded role on a local split with ``step_fn`` (default cross-entropy); returns the mean
        loss and the number of steps.

        ``batches`` replaces the split's batches (public examples paired with the server's targets).
        A step may return ``(loss, record)`` (a tuple of tensors): ``on_record`` gets each step's record.
        Under the batched executor the fit runs later, with other clients' (:attr:`fits_run_later`); it has run,
        and the role's module holds its result, when this returns.
        """
        batches = batches if batches is not None else self.batches(split, steps)
        stats = self.loop.fit(self.slot(role), batches, self.round, step_fn, on_record)
        self.count_steps(role, int(stats["steps"]))
        return stats

    def count_steps(self, role: str, steps: int) -> None:
        """Adds ``steps`` training steps of ``role`` to this update's count (the run's compute estimate,
        ``client/flops.py``); :meth:`fit` counts its own, a strategy training a role otherwise calls it."""
        self.trained_steps[role] = self.trained_steps.get(role, 0) + steps

    def helper(self, name: str, module: torch.nn.Module, weights: StateDict | None = None) -> torch.nn.Module:
        """A small module the strategy trains next to its roles (FedKD's ``W_h``), holding this client's
        ``weights`` (``module``'s own values when None): one instance per name and shapes, reused by every
        client and valid until the next client's update (:meth:`LocalLoop.helper`). ``fit_jointly`` trains
        it with a fresh optimizer state."""
        return self.loop.helper(name, module, weights)

    def weights(self, role: str) -> StateDict:
        """A copy of the role's current weights, safe to keep after the next client reuses the instance."""
        return clone_state(self.slot(role).module.model.state_dict())

    def slot(self, role: str) -> ModelSlot:
        if role not in self.client.roles:
            raise KeyError(f"client {self.client.id} (tier {self.client.tier}) does not train role {role!r}")
        return self.loop.slots[role]

    def finish(self) -> None:
        """Keeps per-client optimizer state, when the recipe asks for it."""
        if self.loop.training.optimizer_state == "per_client":
            for role in self._loaded:
                state = self.loop.slots[role].optimizer.state_dict()
                self.state[f"optimizer/{role}"] = {
                    "state": {
                        k: {n: v.clone() if isinstance(v, Tensor) else v for n, v in s.items()}
                        for k, s in state["state"].items()
                    },
                    "param_groups": state["param_groups"],
                }

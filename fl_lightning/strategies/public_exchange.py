"""The public-set exchange that DS-FL, FedMD and FedGEMS share: each round a subset of the server's public set,
its positions sent down, the clients' outputs on it sent up, and the server's reply to the clients that sent
them. The methods differ in what they upload and reply (probabilities, logits, a server model's logits), not in
this bookkeeping, which lives here once."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ..client.context import ClientContext
from ..federation.errors import ConfigError
from ..federation.types import ClientSpec, ClientTask, TensorPayload
from ..knowledge.public_set import public_inputs, received_positions, round_subset, subset_downlink


class PublicExchange:
    """Round subsets of a public set of ``num_public`` examples, and the downlinks around them.

    Args:
        method: the method's name, for the message that refuses ``size``.
        num_public: examples in the public set (the server's split, which every client holds too).
        size: examples per round (``None``: the whole set, and no positions travel).
        option: the option ``size`` came from (``open_size``, ``public_size``), named in the message.
        word: what the method calls the set (``open``, ``public``).
        seed: the run's seed, from which each round's subset is drawn.

    Example (FedMD's setup, then its communicate phase)::

        self.exchange = server.public_exchange(self.public_size, "public_size", labeled=True)
        tasks = self.exchange.tasks(rnd, clients)
    """

    def __init__(self, method: str, num_public: int, size: int | None, option: str, word: str, seed: int):
        if size is not None and not 1 <= size <= num_public:
            raise ConfigError(
                f"{method} {option} {size} must be between 1 and the {word} set's {num_public} examples "
                "(data.server_fraction); lower it, or set null for the whole set."
            )
        self.num_public, self.size, self.seed = num_public, size, seed
        self.name = f"{word}_positions"  # the downlink payload's name, and where a client keeps its positions

    def subset(self, rnd: int) -> Tensor | None:
        """Round ``rnd``'s sorted positions, the same on every call of the round (``None``: the whole set)."""
        return round_subset(self.seed, rnd, self.num_public, self.size)

    def tasks(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        """One task per client carrying round ``rnd``'s positions (nothing for the whole set)."""
        down = subset_downlink(self.name, self.subset(rnd))
        return [ClientTask(c, rnd, dict(down)) for c in clients]

    @staticmethod
    def reply(
        rnd: int, uploaders: list[ClientSpec], name: str, tensors: Mapping[str, Tensor] | None
    ) -> list[ClientTask]:
        """The server's ``name`` payload of ``tensors`` to each client that uploaded this round; none when
        nobody did (``tensors`` is None then)."""
        if not uploaders or tensors is None:
            return []
        payload = TensorPayload(name, dict(tensors))
        return [ClientTask(c, rnd, {name: payload}) for c in uploaders]

    def received(self, task: ClientTask, ctx: ClientContext) -> tuple[Tensor, Tensor | None]:
        """On the client: the round's public inputs and positions, the positions remembered in the client's state
        for its reply phase (:meth:`recalled`)."""
        positions = received_positions(task.downlink, self.name)
        if positions is not None:
            ctx.state[self.name] = positions
        return public_inputs(ctx.data_x, ctx.public_indices, positions), positions

    def recalled(self, ctx: ClientContext) -> tuple[Tensor, Tensor | None]:
        """On the client, in the reply phase: the inputs and positions :meth:`received` kept, forgotten now."""
        positions = ctx.state.pop(self.name, None)
        return public_inputs(ctx.data_x, ctx.public_indices, positions), positions

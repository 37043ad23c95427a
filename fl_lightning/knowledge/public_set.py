"""A public set that the server and every client hold (DS-FL's open set, FedMD's public data).

The set itself is known to both sides before training (``data.server_fraction``; clients reach it
through ``ClientContext.public_indices``), so a round only needs to say which of its examples it uses:
positions into the set, drawn by the server from the round's own random stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from ..federation.seeding import Owner, Stream, derive_seed
from ..federation.types import ClientSpec, ClientUpdate, Payload, TensorPayload, payload_of


def round_subset(seed: int, rnd: int, num_public: int, size: int | None) -> Tensor | None:
    """Sorted int32 positions of the ``size`` public examples round ``rnd`` uses; ``None`` for the whole set.

    Drawn without replacement from a stream of the run seed and the round only, so a resumed run draws
    the same subsets.
    """
    if size is None:
        return None
    generator = torch.Generator().manual_seed(derive_seed(seed, rnd, Owner.SERVER, Stream.PUBLIC_SUBSET))
    return torch.randperm(num_public, generator=generator)[:size].sort().values.to(torch.int32)


def subset_downlink(name: str, positions: Tensor | None) -> dict[str, Payload]:
    """What tells a client the round's subset: a ``name`` payload of its positions (``n`` int32), or nothing
    when the round uses the whole set."""
    return {} if positions is None else {name: TensorPayload(name, {"positions": positions})}


def received_positions(downlink: Mapping[str, Payload], name: str) -> Tensor | None:
    """The positions a :func:`subset_downlink` sent, or ``None`` for the whole set."""
    return payload_of(downlink, name, TensorPayload).tensors["positions"] if name in downlink else None


def mean_upload(updates: Iterable[ClientUpdate], name: str, key: str) -> tuple[Tensor | None, list[ClientSpec]]:
    """The clients' ``name`` payloads' ``key`` tensors averaged in float64 (returned as float32), and the clients
    that sent them in arrival order; ``None`` when nobody did (DS-FL's soft labels, FedMD's consensus)."""
    total, senders = sum_upload(updates, name, key)
    return (None if total is None else (total / len(senders)).float()), senders


def sum_upload(updates: Iterable[ClientUpdate], name: str, key: str) -> tuple[Tensor | None, list[ClientSpec]]:
    """The clients' ``name`` payloads' ``key`` tensors summed in float64, and the clients that sent them in arrival
    order; ``None`` when nobody did."""
    total: Tensor | None = None
    senders: list[ClientSpec] = []
    for update in updates:
        values = update.sent(name, TensorPayload).tensors[key].double()
        total = values if total is None else total + values
        senders.append(update.client)
    return total, senders


def public_inputs(data_x: Tensor, public_indices: Tensor, positions: Tensor | None) -> Tensor:
    """The public examples at ``positions`` (all of them for ``None``), from the in-memory pool."""
    if positions is None:
        return data_x[public_indices]
    return data_x[public_indices[positions.to(public_indices.device).long()]]


@torch.no_grad()
def eval_logits(module: nn.Module, x: Tensor, batch_size: int) -> Tensor:
    """Eval-mode logits ``[N, C]`` (float32) of a client's loaded module, in batches."""
    module.eval()
    return torch.cat([module(x[i : i + batch_size]).float() for i in range(0, len(x), batch_size)])


def target_batches(
    x: Tensor, targets: Tensor, batch_size: int, steps: int | None, generator: torch.Generator
) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches ``(x, targets)`` over fresh permutations of the examples: ``steps`` of them, or one pass.

    As a data loader with shuffling: a pass sees every example once and its last batch may be smaller.
    """
    n = len(x)
    steps = -(-n // batch_size) if steps is None else steps
    produced = 0
    while produced < steps:
        order = torch.randperm(n, generator=generator).to(x.device)
        for start in range(0, n, batch_size):
            if produced == steps:
                return
            chosen = order[start : start + batch_size]
            yield x[chosen], targets[chosen]
            produced += 1

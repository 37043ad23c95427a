"""Every client's batch of a step gathered from the pool at once (the batched executor's data path).

When every client draws from one pool with one augmentation that can be drawn per client (a
``CropFlip``), a step takes each client's indices and draws (``BatchStream.next_parts``) and makes all
the batches with one indexing call and one augmentation call, bit-identical to client by client.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor


def gatherable(streams: list) -> bool:
    """Whether every client's batches come from one pool with one augmentation that can be drawn per client."""
    from ..batches import BatchStream

    if not all(type(s) is BatchStream for s in streams):
        return False
    first = streams[0]
    augment_ok = first.augment is None or hasattr(first.augment, "draw")
    return augment_ok and all(s.x is first.x and s.y is first.y and (s.augment == first.augment) for s in streams[1:])


def gather(stream, parts: list[tuple[Tensor, Tensor | None]]) -> tuple[Tensor, ...]:
    """The stacked batches ``[m, B, ...]`` of m clients: one gather from the pool, one augmentation call
    with every client's own draws (bit-identical to gathering and augmenting client by client)."""
    index = torch.stack([chosen for chosen, _ in parts])  # [m, B]
    x = stream.x[index.reshape(-1)]
    if stream.augment is not None:
        # an augmentation that draws (gatherable) has drawn for every batch
        x = stream.augment.apply(x, torch.cat([cast(Tensor, draws) for _, draws in parts]))
    x = x.reshape(*index.shape, *x.shape[1:])
    return (x,) if stream.y is None else (x, stream.y[index])

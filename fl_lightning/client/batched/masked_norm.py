"""Batch norm over the real rows of a padded batch (the batched executor in lockstep, ``runtime.lockstep``).

A batch norm in training mode normalises with its batch's statistics and moves its running statistics
towards them: padded rows must count in neither. While a group trains in lockstep, every batch norm of
its modules normalises with the mean and (biased) variance of the rows :func:`~fl_lightning.federation.
padding.real_rows` marks, and moves its running mean and (unbiased) variance as torch's does, from those
rows alone; with no mask (a step with nothing padded) or in evaluation mode it is torch's own forward.
Inside vmap the statistics are each client's own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ...federation.padding import real_rows


def unmaskable_norm(modules: dict[str, torch.nn.Module]) -> str | None:
    """Why the batch norms of ``modules`` (by role) cannot leave padded rows out (a subclass with its own
    forward, such as SyncBatchNorm, computes statistics this module does not know), or None."""
    for role, module in modules.items():
        for name, norm in module.named_modules():
            if isinstance(norm, _BatchNorm) and type(norm).forward is not _BatchNorm.forward:
                kind = type(norm).__name__
                return f"{role}'s {name} is a {kind} with its own forward, whose statistics would count padded rows"
    return None


@contextlib.contextmanager
def masked_batch_norms(module: torch.nn.Module) -> Iterator[None]:
    """Every batch norm of ``module`` computes over the real rows while the block runs (see the module)."""
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    before = [norm.__dict__.get("forward") for norm in norms]
    for norm in norms:
        # an instance attribute over the class's method, as torch.nn.Module allows; deleted again below
        norm.forward = functools.partial(_masked_forward, norm, norm.forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for norm, forward in zip(norms, before):
            del norm.forward
            if forward is not None:
                norm.forward = forward  # type: ignore[method-assign]  # the instance's own, put back


def _masked_forward(norm: _BatchNorm, plain: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    rows = real_rows()
    batch_statistics = norm.training or (norm.running_mean is None and norm.running_var is None)
    if rows is None or not batch_statistics:
        return plain(x)  # evaluation mode normalises each row on its own: padded rows change nothing
    norm._check_input_dim(x)
    weight = rows.to(x.dtype).view(-1, *[1] * (x.dim() - 1))  # [B, 1, ...]
    dims = [0, *range(2, x.dim())]  # every dimension but the channels
    count = rows.sum() * x[0, 0].numel()  # real examples x positions per channel
    channel = (1, -1, *[1] * (x.dim() - 2))
    mean = (x * weight).sum(dims) / count
    centered = x - mean.view(channel)
    variance = (centered.square() * weight).sum(dims) / count
    out = centered * torch.rsqrt(variance + norm.eps).view(channel)
    if norm.weight is not None:
        out = out * norm.weight.view(channel) + norm.bias.view(channel)
    if norm.training and norm.track_running_stats:
        tracked, running_mean, running_var = norm.num_batches_tracked, norm.running_mean, norm.running_var
        # track_running_stats: torch registered the three buffers
        assert tracked is not None and running_mean is not None and running_var is not None
        tracked.add_(1)
        factor = norm.momentum if norm.momentum is not None else 1.0 / tracked
        with torch.no_grad():  # as torch's kernel: (1 - momentum) * running + momentum * batch (lerp_ has no vmap rule)
            running_mean.mul_(1 - factor).add_(mean.detach() * factor)
            unbiased = variance.detach() * count / (count - 1).clamp(min=1)
            running_var.mul_(1 - factor).add_(unbiased * factor)
    return out

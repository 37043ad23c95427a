"""The local training compute of a run, estimated: each role's FLOPs of one training step, counted once at the
start of a run, times the steps its clients take.

A step's FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on the role's model with meta tensors
(shapes without data): one forward pass over a batch of ``training.batch_size`` examples shaped like the data
set's, then the backward pass of their sum, so nothing is computed, no random number is drawn and no weight or
buffer changes. It counts what FlopCounterMode counts, the matrix products and convolutions (a multiply and an
add are 2 FLOPs); the gradients of frozen parameters and of the input are not computed, so not counted. What
a method adds to a plain step is not in it (a teacher's forward pass inside the step, MOON's two extra
models, passes outside training), and a partial last batch counts as a full one: the estimate ranks methods
by the training they do, as papers' "computation per round" does.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn


def step_flops(model: nn.Module, sample: Tensor, batch_size: int) -> int:
    """FLOPs of one training step (forward and backward) of ``model`` on ``batch_size`` examples like ``sample``.

    Example: ``nn.Linear(4, 3)`` on batches of 2 takes 2 x 2 x 4 x 3 = 48 FLOPs forward and 48 for the weight's
    gradient (the input needs none): 96.
    """
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    meta = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad) for name, t in tensors}
    batch = torch.zeros((batch_size, *sample.shape[1:]), dtype=sample.dtype, device="meta")
    with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
        output = functional_call(model, meta, (batch,))
        output = output[0] if isinstance(output, (tuple, list)) else output
        if output.requires_grad:
            output.float().sum().backward()
    return int(counter.get_total_flops())


def role_step_flops(
    models: dict[str, nn.Module], sample: Tensor, batch_size: int
) -> tuple[dict[str, int], dict[str, str]]:
    """Per role, the FLOPs of one training step (:func:`step_flops`), and why a role's could not be counted (a
    model that cannot run on meta tensors: an LSTM, a user's module calling ``.item()``)."""
    counted, failed = {}, {}
    for role, model in models.items():
        try:
            counted[role] = step_flops(model, sample, batch_size)
        except Exception as err:  # noqa: BLE001 - any model's error: the run goes on, its compute is not counted
            failed[role] = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return counted, failed

"""Two models of one client trained together on the same batches: mutual learning (FML, FedKD).

A client that trains a private model next to a shared one lists both roles in its tier (e.g.
``roles: [cnn_large, meme]``); the strategy loads both with ``ctx.load`` and calls :func:`fit_jointly`
with a step function that returns each role's loss. One backward pass of their sum, then one step of
each role's optimizer per batch, is exactly two simultaneous updates when each loss reads the other
model's outputs detached (deep mutual learning as written), and is the official FedKD code's and
HtFLlib's single objective when it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..federation.errors import ConfigError
from .pause import note_sequential_fit

if TYPE_CHECKING:
    from .context import ClientContext
    from .module import ClientModule

JointStepFn = Callable[[dict[str, "ClientModule"], tuple, int], dict[str, Tensor]]


def fit_jointly(
    ctx: ClientContext,
    roles: Sequence[str],
    step_fn: JointStepFn,
    helpers: Sequence[nn.Module] = (),
    split: str = "train",
) -> dict[str, float]:
    """Trains the loaded ``roles`` of one client together: per batch, one backward pass of the sum of the
    losses ``step_fn`` returns, then one step of each role's optimizer.

    Each role's optimizer runs at the round's learning rate (the recipe's ``lr_schedule``) and each
    role's gradient is clipped at ``training.grad_clip_norm`` on its own (HtFLlib clips each model
    separately). ``helpers`` (FedKD's ``W_h``, best one instance from ``ctx.helper``) are trained too, with
    a fresh optimizer state of the recipe's kind. Returns the mean loss of each role. With
    ``runtime.cuda_graphs`` the steps of a step function marked
    :func:`~fl_lightning.client.batched.fits.vmappable` are replayed from CUDA graphs
    (:meth:`~fl_lightning.client.graphs.replay.StepGraphs.run_joint_steps`).
    """
    loop = ctx.loop
    if getattr(loop.fabric.strategy.precision, "scaler", None) is not None:
        # the fp16 loss scaler updates its scale after each optimizer step; a second optimizer in the
        # same step would unscale with the new scale
        raise ConfigError(
            "models trained together on one client (FML, FedKD) cannot use fp16 mixed precision's loss "
            "scaler here; set runtime precision to 32-true or bf16-mixed."
        )
    note_sequential_fit("models trained together (fit_jointly) train one client at a time")
    slots = {role: ctx.slot(role) for role in roles}
    factor = loop.training.lr_schedule(ctx.round, loop.rounds)
    trained = [(slot.module, slot.optimizer, slot.base_lrs) for slot in slots.values()]
    trained += [(helper, *loop.helper_optimizer(helper)) for helper in helpers]
    for _, optimizer, base_lrs in trained:
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base * factor
    modules = {role: slot.module for role, slot in slots.items()}
    trained = [(module, optimizer) for module, optimizer, _ in trained]
    clip = loop.training.grad_clip_norm
    batches = ctx.batches(split)
    for role in roles:
        ctx.count_steps(role, batches.num_steps)
    if loop.graphs is not None:  # runtime.cuda_graphs: the same steps, replayed where their key allows
        return loop.graphs.run_joint_steps(modules, trained, batches, step_fn, clip)
    for module, _ in trained:
        module.train()
    optimizer_step = loop.fabric.strategy.optimizer_step
    totals = {role: torch.zeros((), device=loop.fabric.device) for role in roles}
    steps = 0
    for i, batch in enumerate(batches):
        for _, optimizer in trained:
            optimizer.zero_grad(set_to_none=True)
        with loop.fabric.autocast():  # the forward only: see LocalLoop.run_steps (stale low-precision weights)
            losses = step_fn(modules, batch, i)
        loop.fabric.backward(sum(losses[role] for role in roles))
        for module, optimizer in trained:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            optimizer_step(optimizer)
        for role in roles:
            totals[role] += losses[role].detach().float()
        steps += 1
    return {role: (total / max(steps, 1)).item() for role, total in totals.items()}

"""Where a group's tensors live in its flat store: the batch-norm statistics that may sit in strided rows, and
the tensors that several roles share (stored once)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..loop import LocalLoop

_NORM_FORWARDS = (torch.nn.modules.batchnorm._BatchNorm.forward, torch.nn.SyncBatchNorm.forward)


def norm_buffers_for_rows(loop: LocalLoop, trained_role: str, modes: tuple) -> tuple[set[tuple], list]:
    """Batch-norm buffers that may sit in strided rows, and the batch norms whose mode a step must not change.

    Only batch norm's own rule writes a buffer into a copy when the buffer is strided; every buffer passed to
    vmap on its own costs a step ~30 Python calls of torch.func's input handling (the teacher's and the other
    roles' statistics are half of a ResNet pair's ~136 inputs). So rows hold the running statistics of a batch
    norm in evaluation mode (it only reads them: a teacher, a role the step does not train) and every batch
    norm's ``num_batches_tracked``, which its forward increments with an ordinary in-place add.
    """
    keys, eval_norms = set(), []
    # the trained role runs in training mode throughout, a module it shares with another role too
    trained = {id(m) for m in loop.slots[trained_role].module.modules()}
    for role, role_modes in zip(loop.slots, modes):
        module = loop.slots[role].module
        for (prefix, submodule), training in zip(module.named_modules(), role_modes):
            # torch's own forward only: a subclass may update its statistics in evaluation mode (test-time adaptation)
            if type(submodule).forward not in _NORM_FORWARDS:
                continue
            training = training or id(submodule) in trained
            at = f"{prefix}." if prefix else ""
            names = ["num_batches_tracked"] if training else ["running_mean", "running_var", "num_batches_tracked"]
            keys |= {("slot", role, at + name) for name in names if submodule._buffers.get(name) is not None}
            if not training:
                eval_norms.append(submodule)
    return keys, eval_norms


def shared_tensors(loop: LocalLoop, trained: set) -> dict[tuple, tuple]:
    """``("slot", role, name)`` -> the key a group stores that tensor under, for tensors several roles hold."""
    holders: dict[int, list[tuple]] = {}
    for role, slot in loop.slots.items():
        for name, t in [*slot.module.named_parameters(), *slot.module.named_buffers()]:
            holders.setdefault(id(t), []).append(("slot", role, name))
    alias: dict[tuple, tuple] = {}
    for keys in holders.values():
        if len(keys) > 1:
            kept = next((key for key in keys if key in trained), keys[0])
            alias |= {key: kept for key in keys if key != kept}
    return alias

"""Giving a module other tensors for the duration of a call (one client's, inside the batched executor's vmap)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def tied_names(module: torch.nn.Module) -> list[list[str]]:
    """Groups of names under which ``module`` holds one tensor (tied weights, a submodule in two places)."""
    names: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return [group for group in names.values() if len(group) > 1]


class Reparametrization:
    """Puts tensors into a module under their names while a block runs, then gives the originals back.

    torch.func.functional_call only calls ``forward``, and a step function calls other methods (``features``,
    ``head``), so the module's own entries are swapped, as torch's ``_reparametrize_module`` does. That one looks
    up each name's submodule and checks each tensor at every call (~1,600 Python calls a step for ResNet20 and
    its teacher); here the ``(dict, key)`` entry of every name is found once per set of names and a step costs
    one dict write per tensor.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.plans: dict[tuple[str, ...], list[tuple[dict, str]] | None] = {}

    @contextlib.contextmanager
    def __call__(self, tensors: dict[str, Tensor]) -> Iterator[None]:
        names = tuple(tensors)
        plan = self.plans.get(names, ())
        if plan == ():
            plan = self.plans[names] = self._plan(names)
        if plan is None:  # a name that is a plain attribute, not a parameter or buffer: torch's general swap
            from torch.nn.utils.stateless import _reparametrize_module

            with _reparametrize_module(self.module, tensors, stack_weights=True):
                yield
            return
        originals = [entries[key] for entries, key in plan]
        try:
            for (entries, key), tensor in zip(plan, tensors.values()):
                entries[key] = tensor
            yield
        finally:
            # in reverse: a tensor reachable under two names (one submodule in two places) ends as its original
            for (entries, key), original in zip(reversed(plan), reversed(originals)):
                entries[key] = original

    def _plan(self, names: tuple[str, ...]) -> list[tuple[dict, str]] | None:
        plan: list[tuple[dict, str]] = []
        for name in names:
            owner, _, key = name.rpartition(".")
            submodule = self.module.get_submodule(owner)
            if key in submodule._parameters:
                plan.append((submodule._parameters, key))
            elif key in submodule._buffers:
                plan.append((submodule._buffers, key))
            else:
                return None
        return plan


@contextlib.contextmanager
def batch_norm_in_float32(module: torch.nn.Module):
    """Batch norm of a bf16 / fp16 input in float32, its result in the input's dtype, while the block runs.

    Under autocast a convolution hands batch norm a bf16 input; the plain kernel takes it with float32
    running statistics, but vmap's batch-norm rule fails ("expected scalar type BFloat16 but found Float").
    Normalising the float32 copy and casting back gives what the plain kernel gives to bf16 rounding.
    """
    low = (torch.bfloat16, torch.float16)

    def to_float32(norm, args):
        if args and isinstance(args[0], Tensor) and args[0].dtype in low:
            norm.__dict__["_batched_input_dtype"] = args[0].dtype
            return (args[0].float(), *args[1:])
        return None

    def back_to_input_dtype(norm, args, output):
        dtype = norm.__dict__.pop("_batched_input_dtype", None)
        return output.to(dtype) if dtype is not None else None

    handles = []
    for norm in module.modules():
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            handles += [norm.register_forward_pre_hook(to_float32), norm.register_forward_hook(back_to_input_dtype)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

"""Optimizer updates of many clients at once, on tensors stacked along a leading client dimension.

Each rule equals torch's own optimizer step applied to each client separately (tested against it in
``tests/test_batched_units.py``); the batched executor runs it on whole flat rows of parameters and moments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def update_rule(optimizer: torch.optim.Optimizer) -> Callable | None:
    """The stacked-tensor update that equals ``optimizer``'s step per client; None when there is none."""
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return sgd
    if kind is torch.optim.Adam or kind is torch.optim.AdamW:
        return adam
    return None


def fresh_state(rule: Callable, options: dict, param: Tensor, clients: int) -> dict[str, Tensor]:
    """Zero moments for ``clients`` stacked copies of ``param``. A zero momentum buffer gives SGD's first
    step exactly (0 * m + g = g: dampening 0 is required) and Adam starts from zeros as torch does."""
    shape = (clients, *param.shape)
    if rule is sgd:
        return {"momentum_buffer": param.new_zeros(shape)} if options["momentum"] else {}
    state = {"step": param.new_zeros(clients), "exp_avg": param.new_zeros(shape), "exp_avg_sq": param.new_zeros(shape)}
    if options.get("amsgrad"):
        state["max_exp_avg_sq"] = param.new_zeros(shape)
    return state


def sgd(params: dict, grads: dict, state: dict, options: dict) -> None:
    """``torch.optim.SGD``'s update (weight decay, momentum, Nesterov) on stacked tensors, in place."""
    lr, decay, momentum = options["lr"], options["weight_decay"], options["momentum"]
    for name, param in params.items():
        grad = grads[name] if not options.get("maximize") else -grads[name]
        if decay:
            grad = grad.add(param, alpha=decay)
        if momentum:
            buffer = state[name]["momentum_buffer"].mul_(momentum).add_(grad)
            grad = grad.add(buffer, alpha=momentum) if options["nesterov"] else buffer
        param.add_(grad, alpha=-lr)


def adam(params: dict, grads: dict, state: dict, options: dict) -> None:
    """``torch.optim.Adam`` / ``AdamW``'s update on stacked tensors, in place, with each client's own step count."""
    lr, decay, eps = options["lr"], options["weight_decay"], options["eps"]
    beta1, beta2 = options["betas"]
    corrections: dict[tuple, tuple[Tensor, Tensor]] = {}
    for name, param in params.items():
        grad = grads[name] if not options.get("maximize") else -grads[name]
        moments = state[name]
        moments["step"] += 1
        if decay and options["decoupled_weight_decay"]:
            param.mul_(1 - lr * decay)
        elif decay:
            grad = grad.add(param, alpha=decay)
        moments["exp_avg"].lerp_(grad, 1 - beta1)
        moments["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        cached = (param.dim(), param.dtype, param.device)  # every parameter of a client has taken the same steps
        if cached not in corrections:
            steps = moments["step"].double()
            shape = (-1,) + (1,) * (param.dim() - 1)
            step_size = (lr / (1 - beta1**steps)).to(param.dtype).view(shape)
            corrections[cached] = (step_size, torch.sqrt(1 - beta2**steps).to(param.dtype).view(shape))
        step_size, correction = corrections[cached]
        second = moments["exp_avg_sq"]
        if options.get("amsgrad"):
            torch.maximum(moments["max_exp_avg_sq"], second, out=moments["max_exp_avg_sq"])
            second = moments["max_exp_avg_sq"]
        denominator = (second.sqrt() / correction).add_(eps)
        param.sub_(step_size * moments["exp_avg"] / denominator)


def clip_per_client(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """``clip_grad_norm_`` applied to each client's gradients separately (norm over all its parameters)."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    coefficient = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: g * coefficient.view((-1,) + (1,) * (g.dim() - 1)) for n, g in grads.items()}

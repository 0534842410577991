"""Steps the user's own torch.optim optimizer on this rank's parameters.

The optimizer is built over the real model parameters, so param groups, state and lr
changes (schedulers, `opt.param_groups[0]["lr"] = ...`) behave exactly as in eager.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def build(optimizer: Callable | torch.optim.Optimizer | None, model):
    """The user's optimizer over `model`'s parameters (or over a list of tensors: ZeRO shards)."""
    params = model.parameters() if isinstance(model, torch.nn.Module) else list(model)
    if optimizer is None:
        return torch.optim.SGD(params, lr=1e-3)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a callable(params) -> torch.optim.Optimizer; it "
                            f"returned {type(opt).__name__}.")
        return opt
    raise TypeError("optimizer must be a callable(params) -> torch.optim.Optimizer, e.g. "
                    "`lambda ps: torch.optim.AdamW(ps, lr=1e-3)`.")


def apply_gradients(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor | None]) -> None:
    """p.grad = g, step, then drop grads (as `zero_grad(set_to_none=True)` would)."""
    for p, g in zip(params, grads):
        p.grad = g if g is None or g.dtype == p.dtype else g.to(p.dtype)
    opt.step()
    for p in params:
        p.grad = None

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


# torch.optim classes with a fused kernel (one multi-tensor kernel per step on CPU and CUDA)
FUSED = ("Adam", "AdamW", "SGD", "Adagrad")


def prefer_fused(opt: torch.optim.Optimizer | None) -> bool:
    """Plan.codegen="inductor": the optimizer runs torch's fused kernel where the user left
    the implementation to torch (fused=None and foreach=None in every group) and torch has
    one for its class, device and dtypes - on CPU torch would otherwise loop over the
    tensors one op at a time (the same update, ~3x the time: docs/benchmarks.md). Called
    before the first step (the state is made for the fused kernel). Returns whether it did."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    if opt is None or type(opt).__name__ not in FUSED or type(opt).__module__.split(".")[:2] \
            != ["torch", "optim"] or opt.state:
        return False
    devices = _get_fused_kernels_supported_devices()
    for g in opt.param_groups:
        if g.get("fused") is not None or g.get("foreach") is not None or \
                g.get("differentiable") or g.get("capturable"):
            return False
        if not all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in g["params"]):
            return False
        if not all(p.device.type in devices and p.dtype in (torch.float32, torch.float16,
                   torch.bfloat16, torch.float64) for p in g["params"]):
            return False
    for g in opt.param_groups:
        g["fused"] = True
    if hasattr(opt, "_need_device_dtype_check_for_fused") or type(opt).__name__ == "SGD":
        opt._need_device_dtype_check_for_fused = True
    return True


def like_param(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`g` in `p`'s dtype and memory layout, as autograd's AccumulateGrad hands gradients to
    optimizers. A graph's gradient may come out in another layout (a convolution weight's
    in channels-last order); torch's fused optimizer kernels walk a parameter and its
    gradient as flat memory, so a mismatched layout pairs the wrong elements - a silently
    wrong update (seen: ConvNeXt with fused AdamW). Strides of size-1 dims do not matter."""
    if g.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)) as it is
        return g
    if g.shape == p.shape and any(n > 1 and a != b
                                  for n, a, b in zip(p.shape, p.stride(), g.stride())):
        return torch.empty_like(p).copy_(g)  # p's strides (a dense p's) and dtype, one copy
    return g if g.dtype == p.dtype else g.to(p.dtype)


def apply_gradients(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor | None]) -> None:
    """p.grad = g, step, then drop grads (as `zero_grad(set_to_none=True)` would)."""
    for p, g in zip(params, grads):
        p.grad = g if g is None else like_param(g, p)
    opt.step()
    for p in params:
        p.grad = None

"""Steps the user's own torch.optim optimizer on this rank's parameters.

The optimizer is built over the real model parameters, so param groups, state and lr
changes (schedulers, `opt.param_groups[0]["lr"] = ...`) behave exactly as in eager.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx

from fxpar.compiler import ir


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


# --- updates overlapped with the last gradient all-reduces ----------------------------------
# A data-parallel step ends with the last gradient buckets' all-reduces in flight and nothing
# to compute: the compute thread waits for them, then steps the optimizer over every
# parameter. A bucket already reduced can be stepped in that wait instead (its parameters are
# read by no later node), as DeepSpeed and torch's optimizer-in-backward overlap the update
# with the reduction. torch.optim's updates are per parameter (state, weight decay, step
# count), so stepping the buckets one by one - each step() sees only that bucket's gradients -
# is the same update as one step() over all of them, bit for bit.

def splittable(opt: torch.optim.Optimizer | None) -> str | None:
    """Why `opt` cannot be stepped bucket by bucket (None: it can): torch.optim's own classes
    update each parameter from its own gradient and state; LBFGS (a closure over all of them),
    other libraries' optimizers and step hooks (they expect one call per step) cannot."""
    from torch.optim import optimizer as torch_optimizer
    if opt is None:
        return "no optimizer on this rank"
    if type(opt).__module__.split(".")[:2] != ["torch", "optim"] or \
            isinstance(opt, torch.optim.LBFGS):
        return f"{type(opt).__name__} may not update each parameter on its own"
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or \
            torch_optimizer._global_optimizer_pre_hooks or \
            torch_optimizer._global_optimizer_post_hooks:
        return "optimizer step hooks are registered (they expect one step() per step)"
    return None


_ready_updates = None  # the running step's BucketUpdates (set by the trainer)


def update_ready(k: int, loss: torch.Tensor, *grads: torch.Tensor) -> None:
    """Graph node (see `interleave`): bucket k's gradients are final - step its parameters."""
    if _ready_updates is not None:
        _ready_updates(k, loss, grads)


class BucketUpdates:
    """Steps `opt` over one bucket of `params` at a time as the graph reaches each bucket's
    `update_ready` node; the first checks the loss (a non-finite loss updates nothing and
    the trainer raises after the graph, as without buckets)."""

    def __init__(self, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 buckets: list[list[int]]):
        self.opt, self.params, self.buckets = opt, params, buckets
        self.done: set[int] = set()
        self.finite = True

    def __enter__(self):
        global _ready_updates
        self.done, self.finite, _ready_updates = set(), True, self
        return self

    def __exit__(self, *exc):
        global _ready_updates
        _ready_updates = None

    def __call__(self, k: int, loss: torch.Tensor, grads) -> None:
        if not self.finite:
            return
        if not self.done and not bool(torch.isfinite(loss).all()):
            self.finite = False  # nothing updated; the trainer raises NonFiniteLossError
            return
        apply_gradients(self.opt, [self.params[i] for i in self.buckets[k]], grads)
        self.done.add(k)

    def rest(self) -> list[int]:
        """Parameters no bucket node stepped (gradients made without a collective)."""
        stepped = {i for k in self.done for i in self.buckets[k]}
        return [i for i in range(len(self.params)) if i not in stepped]


def interleave(gm: torch.fx.GraphModule, n_params: int) -> tuple[torch.fx.GraphModule | None,
                                                                  list[list[int]]]:
    """A copy of `gm` (loss, grads[n_params], ...) with an `update_ready(k, loss, *grads)`
    node after each gradient bucket's wait, where the bucket's parameters are read by no later
    node; the buckets (parameter indices, in the order their nodes run). What the loss still
    needs after the first update's place moves before it (a sum loss's wait, which the overlap
    pass sank to the end: its all-reduce, issued at the end of the forward, is done long
    since): the first update checks the loss. (None, []) when no update would run before
    another bucket's wait (one bucket, no collectives)."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    order = {n: i for i, n in enumerate(g.nodes)}
    out = next(n for n in g.nodes if n.op == "output")
    loss, grads = out.args[0][0], out.args[0][1:1 + n_params]
    params = [n for n in g.nodes if n.op == "placeholder"][:n_params]
    groups: dict[torch.fx.Node, list[int]] = {}
    for i, grad in enumerate(grads):
        n = grad
        while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is not wait \
                and len(n.all_input_nodes) == 1:  # views, getitems, casts of the bucket
            n = n.all_input_nodes[0]
        if isinstance(n, torch.fx.Node) and n.target is wait:
            groups.setdefault(n, []).append(i)
    if len(groups) < 2 or not isinstance(loss, torch.fx.Node) or loss.op == "placeholder":
        return None, []
    buckets = [groups[w] for w in sorted(groups, key=order.__getitem__)]
    points = [max([order[grads[i]] for i in idx] +
                  [order[u] for i in idx for u in params[i].users]) for idx in buckets]
    if not any(p < max(order[w] for w in groups) for p in points[:-1]):
        return None, []
    nodes = list(g.nodes)
    first = nodes[min(points)]
    late, todo = set(), [loss]  # what the loss still needs after the first update's point
    while todo:
        n = todo.pop()
        if n not in late and order[n] > order[first]:
            late.add(n)
            todo.extend(n.all_input_nodes)
    for n in sorted(late, key=order.__getitem__):
        first.append(n)
        first = n
    order = {n: i for i, n in enumerate(g.nodes)}
    anchors = [max(nodes[p], loss, key=order.__getitem__) for p in points]
    last = {}
    for k, (idx, anchor) in enumerate(zip(buckets, anchors)):
        with g.inserting_after(last.get(anchor, anchor)):  # (same point: in bucket order)
            call = last[anchor] = g.call_function(update_ready,
                                                  (k, loss, *(grads[i] for i in idx)))
        call.meta[ir.REGION] = ir.OPTIMIZER
    g.lint()
    return torch.fx.GraphModule(gm, g), buckets

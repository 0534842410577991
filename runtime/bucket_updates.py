"""Optimizer updates between the last gradient all-reduces of a data-parallel step.

A data-parallel step ends with the last gradient buckets' all-reduces in flight and nothing
to compute: the compute thread waits for them, then steps the optimizer over every
parameter. A bucket already reduced can be stepped in that wait instead (its parameters are
read by no later node), as DeepSpeed and torch's optimizer-in-backward overlap the update
with the reduction. torch.optim's updates are per parameter (state, weight decay, step
count), so stepping the buckets one by one - each step() sees only that bucket's gradients -
is the same update as one step() over all of them, bit for bit.

`interleave` puts an `update_ready` node after each bucket's wait in the rank's graph; the
trainer runs the graph inside a `BucketUpdates` (the node's callback, set for the step as
runtime/comm's recorder is). A step that fails part-way (a peer lost on a later bucket's
wait) leaves the buckets stepped so far updated: such a job restarts from its last
checkpoint (runtime/faults.py) in any case.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx
from torch.optim import optimizer as torch_optimizer

from fxpar.core import cost, ir
from fxpar.runtime.optim import apply_gradients

_wait = torch.ops._c10d_functional.wait_tensor.default


def splittable(opt: torch.optim.Optimizer | None,
               params: Sequence[torch.Tensor] | None = None) -> str | None:
    """Why `opt` cannot be stepped bucket by bucket (None: it can): torch.optim's own classes
    update each parameter from its own gradient and state; LBFGS (a closure over all of
    them), other libraries' optimizers, step hooks and a replaced `step` (they expect one call
    per step) cannot, nor an optimizer over tensors other than `params` (checked when
    given: at start-up; hooks can come later, so the rest is checked every step)."""
    if opt is None:
        return "no optimizer on this rank"
    if type(opt).__module__.split(".")[:2] != ["torch", "optim"] or \
            isinstance(opt, torch.optim.LBFGS):
        return f"{type(opt).__name__} may not update each parameter on its own"
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or \
            torch_optimizer._global_optimizer_pre_hooks or \
            torch_optimizer._global_optimizer_post_hooks:
        return "optimizer step hooks are registered (they expect one step() per step)"
    step = opt.__dict__.get("step")  # (an lr scheduler's counting wrapper is fine)
    if step is not None and not getattr(step, "_wrapped_by_lr_sched", False):
        return "the optimizer's step() is replaced (it may expect one call per step)"
    if params is not None:
        mine = {id(p) for p in params}
        if any(id(p) not in mine for g in opt.param_groups for p in g["params"]):
            return "the optimizer holds tensors that are not this rank's parameters"
    return None


_ready_updates = None  # the running step's BucketUpdates


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
        self._over_params = id(opt)  # the optimizer last found to hold only `params`

    def usable(self, opt: torch.optim.Optimizer | None) -> bool:
        """Whether this step may run bucket by bucket with `opt` (the rank's optimizer now:
        hooks may have been registered, or the optimizer replaced, since the last step)."""
        if splittable(opt, None if id(opt) == self._over_params else self.params) is not None:
            return False
        self.opt, self._over_params = opt, id(opt)
        return True

    def __enter__(self):
        global _ready_updates
        for p in self.params:  # a gradient left by eager code would be stepped per bucket
            p.grad = None
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
    node after each gradient bucket's wait, where no later node reads the bucket's parameters
    or a view of them; the buckets (parameter indices, in the order their nodes run). What
    the loss still needs after the first update's place moves before it (a sum loss's wait,
    which the overlap pass sank to the end: its all-reduce, issued at the end of the
    forward, is done long since): the first update checks the loss. (None, []) when no
    update would run before another bucket's wait (one bucket, no collectives)."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    order = {n: i for i, n in enumerate(g.nodes)}
    out = next(n for n in g.nodes if n.op == "output")
    loss, grads = out.args[0][0], out.args[0][1:1 + n_params]
    groups: dict[torch.fx.Node, list[int]] = {}
    for i, grad in enumerate(grads):
        n = grad
        while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is not _wait \
                and len(n.all_input_nodes) == 1:  # views, getitems, casts of the bucket
            n = n.all_input_nodes[0]
        if isinstance(n, torch.fx.Node) and n.target is _wait:
            groups.setdefault(n, []).append(i)
    if len(groups) < 2 or not isinstance(loss, torch.fx.Node) or loss.op == "placeholder":
        return None, []
    last_read = _last_reads(gm, g, n_params, order)
    buckets = [groups[w] for w in sorted(groups, key=order.__getitem__)]
    points = [max([order[grads[i]] for i in idx] + [last_read[i] for i in idx])
              for idx in buckets]
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


def _last_reads(gm, g, n_params, order) -> list[int]:
    """Per parameter, the position of the last node that reads it or a view of it (a view
    op's result, a getitem of one, a compiled run's output that its code returns as a view
    of that input): the optimizer updates parameters in place."""
    params = [n for n in g.nodes if n.op == "placeholder"][:n_params]
    alias = {p: {i} for i, p in enumerate(params)}  # node -> parameters it may be a view of
    last = [order[p] for p in params]
    for n in g.nodes:
        ins = [a for a in n.all_input_nodes if a in alias]
        for a in ins:
            for i in alias[a]:
                last[i] = max(last[i], order[n])
        if not ins:
            continue
        if n.target is operator.getitem and n.args[0].op == "call_module":
            src, views = n.args[0], _output_views(gm, n.args[0].target)
            j = views.get(n.args[1]) if views is not None else None
            if views is None:  # (an unknown module: any output may be any input)
                alias[n] = set().union(*(alias[a] for a in ins))
            elif j is not None and src.args[j] in alias:
                alias[n] = set(alias[src.args[j]])
        elif cost.is_view(n):  # (a view op, an item of a split's views)
            alias[n] = set().union(*(alias[a] for a in ins))
    return last


def _output_views(gm, name) -> dict[int, int] | None:
    """A compiled run's outputs that are views of its inputs: {output index: input index}
    (from the run's source graph, which the compiled code computes); None if unknown."""
    source = getattr(getattr(gm, name, None), "source", None)
    if not isinstance(source, torch.fx.GraphModule):
        return None
    phs = [n for n in source.graph.nodes if n.op == "placeholder"]
    out = next(n for n in source.graph.nodes if n.op == "output")
    views = {}
    for j, o in enumerate(out.args[0]):
        while isinstance(o, torch.fx.Node) and cost.is_view(o):
            o = o.args[0]
        if isinstance(o, torch.fx.Node) and o.op == "placeholder":
            views[j] = phs.index(o)
    return views

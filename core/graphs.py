"""Graph utilities shared by the pass manager and the passes: copies, snapshots, and the
fake-tensor re-propagation that keeps (or checks) every node's meta["val"].

A pass imports these from here, never from the pass manager (compiler/pass_manager.py), which
imports every pass: that way no import cycle needs hiding inside a function.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.core import ir, sharding
from fxpar.core.ir import ancestors
from fxpar.core.errors import PassError, ShardingError
from fxpar.core.sharding import Partial, Shard


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of a graph, output node meta included (node meta dicts are copied shallowly)."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(graph, {}))
    old_out = next(n for n in reversed(graph.nodes) if n.op == "output")
    next(n for n in reversed(g.nodes) if n.op == "output").meta = dict(old_out.meta)
    return g


def snapshot(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A cheap copy of a graph module, for pm.stage_graphs: its Python code is generated
    when first called or printed (torch's lazy graph module), as most snapshots never are."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    new = _LazyGraphModule(gm, copy_graph(gm.graph))
    new.meta = dict(gm.meta)
    return new


def fake_like(t: torch.Tensor, mode: FakeTensorMode, device=None) -> torch.Tensor:
    """A fake tensor in `mode` with t's shape, strides and dtype, on `device` (default t's)."""
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                   device=t.device if device is None else device)


def fake_inputs(gm: torch.fx.GraphModule, mode: FakeTensorMode) -> list:
    return [fake_like(n.meta[ir.VAL], mode) for n in gm.graph.nodes if n.op == "placeholder"]


def fake_propagate(gm: torch.fx.GraphModule, *, check: bool) -> None:
    """Re-run the graph on fake tensors. check=True: every meta["val"] must match (shape,
    dtype); check=False: store the fresh values (used by passes that change shapes)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = fake_inputs(gm, mode)
    # checking: a node that repeats an op already checked on the same values (the same
    # meta["val"] objects in and out: a repeated block's copy, compiler/repeated_blocks.py)
    # computes what that one did, and is not run again
    seen: dict = {}

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return ("n", id(a.meta.get(ir.VAL, a)))
        if isinstance(a, (tuple, list)):
            return (type(a), tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return (dict, tuple((k, arg(v)) for k, v in a.items()))
        return a

    def key(n):
        if not check or n.op != "call_function" or ir.VAL not in n.meta:
            return None
        return (n.target, id(n.meta[ir.VAL]), arg(n.args), arg(n.kwargs))

    class Prop(torch.fx.Interpreter):
        def run_node(self, n):
            k = key(n)
            if k is not None:
                try:
                    if k in seen:
                        return seen[k]
                except TypeError:  # (an unhashable constant argument)
                    k = None
            res = self._run(n)
            if k is not None:
                seen[k] = res
            return res

        def _run(self, n):
            with mode:
                try:
                    res = super().run_node(n)
                except (RuntimeError, ValueError):  # a view's stride error: repaired or raised
                    dense = None if check else _densify_view_input(n)
                    if dense is None:
                        raise
                    self.env[dense] = super().run_node(dense)
                    dense.meta[ir.VAL] = self.env[dense]
                    res = super().run_node(n)
            if n.op == "get_attr" and isinstance(res, torch.Tensor):
                # a constant baked into the graph (e.g. a lifted tensor literal) enters as a
                # fake tensor too: fake mode would otherwise run ops on it for real, custom
                # collectives included
                res = mode.from_tensor(res)
            if n.op in ("placeholder", "output"):
                return res
            if check:
                old = n.meta.get(ir.VAL)
                _compare(n, old, res)
            else:
                n.meta[ir.VAL] = res
            return res

    Prop(gm).run(*args)


def fake_run(node: torch.fx.Node) -> None:
    """node.meta["val"] from its op run on fake copies of its inputs' values: a pass's few new
    nodes given their values (dtype promotion included) without propagating the whole graph."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta[ir.VAL]
            return fake_like(v, mode) if isinstance(v, torch.Tensor) else v
        if isinstance(a, (tuple, list)):
            return type(a)(fake(x) for x in a)
        return a
    args, kwargs = fake(tuple(node.args)), {k: fake(v) for k, v in node.kwargs.items()}
    with mode:
        node.meta[ir.VAL] = node.target(*args, **kwargs)


def _densify_view_input(n: torch.fx.Node) -> torch.fx.Node | None:
    """A view the traced layout allowed (e.g. of a transposed matmul result) that a pass made
    impossible by giving its input another layout (a collective's dense result): the input is
    made dense first. Returns the dense copy's node (None: `n` is no such view)."""
    if n.target is not torch.ops.aten.view.default or not isinstance(n.args[0], torch.fx.Node):
        return None
    with n.graph.inserting_before(n):
        dense = n.graph.call_function(torch.ops.aten.clone.default, (n.args[0],),
                                      {"memory_format": torch.contiguous_format})
    dense.meta.update({k: n.meta[k] for k in (ir.REGION, ir.MODULE, ir.STAGE, ir.PHASE,
                                               ir.RECOMPUTE) if k in n.meta})
    if ir.SHARD in n.args[0].meta:  # a copy is placed like what it copies
        dense.meta[ir.SHARD] = n.args[0].meta[ir.SHARD]
    n.replace_input_with(n.args[0], dense)
    return dense


def _compare(n, old, new):
    if isinstance(new, torch.Tensor):
        if not isinstance(old, torch.Tensor) or old.shape != new.shape or old.dtype != new.dtype:
            raise PassError(f"node {n.name} ({n.target}): meta['val'] says "
                            f"{getattr(old, 'shape', old)}/{getattr(old, 'dtype', '')} but the "
                            f"graph computes {tuple(new.shape)}/{new.dtype}")
    elif isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)):
        for o, v in zip(old, new):
            _compare(n, o, v)


def verify(gm: torch.fx.GraphModule, values: bool = True) -> None:
    """The graph is well formed, every op names its region and module, and (values=True)
    every node's meta["val"] is what the graph computes."""
    gm.graph.lint()
    for n in gm.graph.nodes:
        if n.op == "call_function" and (ir.REGION not in n.meta or ir.MODULE not in n.meta):
            raise PassError(f"node {n.name} ({n.target}) lacks meta['region'] or meta['module']")
    if values:
        fake_propagate(gm, check=True)


def count_ops(gm: torch.fx.GraphModule, target: Any) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def param_grads(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Any]]:
    """Each parameter placeholder of a captured joint graph with the node its gradient
    output is (None where it has none): the output's gradients follow the loss in the
    parameters' order (capture's `n_grads`)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grads = list(out.args[0])[1:1 + out.meta.get(ir.N_GRADS, 0)]
    params = [p for p in gm.graph.nodes if p.op == "placeholder"
              and p.meta.get(ir.ROLE) == "param"]
    return [(p, grads[i] if i < len(grads) and isinstance(grads[i], torch.fx.Node) else None)
            for i, p in enumerate(params)]


def grad_sum_trees(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, list, list]]:
    """(root, adds, summed parts) for every gradient output that is a tree of backward adds
    over backward values (a weight read more than once: tied or shared)."""
    out = next(n for n in graph.nodes if n.op == "output")

    def a_sum(n):  # a backward add of two per-microbatch values
        return (n.op == "call_function" and n.target is torch.ops.aten.add.Tensor
                and len(n.args) == 2 and not n.kwargs and n.meta.get(ir.REGION) == ir.BACKWARD
                and all(isinstance(a, torch.fx.Node) for a in n.args))

    trees = []
    for root in out.all_input_nodes:
        if not a_sum(root) or set(root.users) != {out}:
            continue
        tree, leaves, todo = [], [], [root]
        while todo:  # the adds summing into the gradient, and what they sum
            n = todo.pop()
            tree.append(n)
            for a in n.args:
                (todo if a_sum(a) and set(a.users) == {n} else leaves).append(a)
        if all(a.op == "call_function" and a.meta.get(ir.REGION) == ir.BACKWARD
               for a in leaves):
            trees.append((root, tree, leaves))
    return trees


def summed_buffer_updates(gm: torch.fx.GraphModule, sig: ir.GraphSignature) -> list[bool]:
    """Per mutated buffer (`sig.mutated_buffers` order): whether running the step once per
    microbatch, writing the buffer back after each, leaves it where one step on the whole
    batch does. True for a counter summed over the batch's rows (an MoE layer's
    tokens-per-expert): new = buffer + a value that is a sum over rows (found as DTensor's
    Partial(sum) with the batch split by rows), read by neither the loss nor a gradient, and
    reading no mutated buffer (each microbatch would see the earlier ones' updates). Not an
    addend the same for any rows (BatchNorm's num_batches_tracked + 1, a step counter: m
    microbatches would add it m times), a mean over rows, or any other form (BatchNorm's
    running statistics: new = (1 - m) * buffer + m * stat)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    buffer_ph = {name: placeholders[sig.num_params + k]
                 for k, name in enumerate(sig.buffer_names)}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = torch.utils._pytree.tree_leaves(out.args)
    n_mut = len(sig.mutated_buffers)
    updates = values[len(values) - n_mut:] if n_mut else []
    trained = ancestors([v for v in values[:len(values) - n_mut]
                          if isinstance(v, torch.fx.Node)])  # what the loss and grads read
    mutated = {buffer_ph[name] for name in sig.mutated_buffers}
    rows = {n for n in placeholders if n.meta.get(ir.ROLE) == "batch"
            and isinstance(n.meta.get(ir.VAL), torch.Tensor) and n.meta[ir.VAL].dim() > 0}
    addends: dict[int, torch.fx.Node] = {}  # buffer index -> its addend, if it may be a sum
    for k, (name, new) in enumerate(zip(sig.mutated_buffers, updates)):
        ph = buffer_ph[name]
        if ph in trained or not (isinstance(new, torch.fx.Node) and new.target in (
                torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar) and len(new.args) == 2
                and new.kwargs.get("alpha", 1) == 1):
            continue
        a, b = new.args
        other = b if a is ph else a if b is ph else None
        if not isinstance(other, torch.fx.Node):  # (a constant: added once per microbatch)
            continue
        seen = ancestors([other])
        if seen & mutated or not seen & rows:
            continue
        addends[k] = other
    summed = _row_sums(gm, list(addends.values()), rows) if addends else set()
    return [k in addends and addends[k] in summed for k in range(n_mut)]


def packing(start: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """What makes collective `start`'s input from the shards - the nodes data_parallel marks
    ir.PACK (their copy into one input, their quantization), which the overlap pass moves
    with the collective - and what that packing reads (the shards; `start`'s own input where
    nothing is packed)."""
    packs, reads, todo = [], [], list(start.all_input_nodes)
    while todo:
        a = todo.pop()
        if a in packs or a in reads:
            continue
        if a.meta.get(ir.PACK):
            packs.append(a)
            todo += a.all_input_nodes
        else:
            reads.append(a)
    return packs, reads


def _row_sums(gm: torch.fx.GraphModule, values: list[torch.fx.Node],
              rows: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Those of `values` that are sums over the batch's rows: placed Partial(sum) by
    DTensor's rules when the batch leaves are split by rows (a dry run of the graph that
    computes them, on a 2-way mesh that owns no process group). Its log lines are held
    back: this is not a plan that runs those ops on whole inputs."""
    keep = ancestors(values)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n in keep:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[v] for v in values))
    sub = torch.fx.GraphModule(gm, g)
    placements = {n.name: (Shard(0),) for n in rows if n in keep}
    try:
        with sharding.quiet():
            specs, _ = sharding.dry_run(sub, sharding.make_mesh(2), placements, ["rows"],
                                        region=None)
    except ShardingError:  # (an op DTensor cannot place: not known to be a sum)
        return set()
    back = {env[v]: v for v in values}
    out = set()
    for n, spec in specs.items():
        if n in back and all(type(p) is Partial and p.reduce_op == "sum"
                             for p in spec.placements):
            out.add(back[n])
    return out

"""A mean loss over a batch split across ranks, reduced exactly in one all-reduce.

Shared by the passes that split the batch (data_parallel: its rows; context_parallel: its
sequence): DTensor's rule leaves each rank's mean cross-entropy Partial(avg), which is the
global mean only when every rank counts as many targets. With microbatches the count of a
microbatch's targets is a program of its own (`target_count_program`), cut from the graph
before either pass shards it.
"""
from __future__ import annotations

import operator

import torch

from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.sharding import Partial, Replicate

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _all_reduce_fed_by(v, group):
    """The one all-reduce over `group` that `v` feeds, directly or through views (which may
    have other users: the loss's view also seeds the backward), and those views."""
    found, views, todo = [], [], [v]
    while todo:
        for u in todo.pop().users:
            if u.target is c10d.all_reduce.default and u.args[2] == group:
                found.append(u)
            elif u.target in ir.RESHAPES:
                views.append(u)
                todo.append(u)
    return (found[0], views) if len(found) == 1 and len(found[0].users) == 1 else None


def exact_mean_loss(graph, group, n):
    """A mean cross-entropy (nll_loss_forward, reduction mean) over a batch split n ways
    (its rows over dp, or its sequence over cp) becomes, by DTensor's rule, a loss that is
    Partial(avg) -- the average of each rank's mean -- and a count of targets that is
    Partial(sum), all-reduced for the backward: two scalar all-reduces per microbatch, and a
    loss that is not the global mean when the ranks count different targets (ignore_index, class
    weights). One all-reduce of (this rank's sum, its count) gives both exactly: the gradient
    already used the global count, now the loss does."""
    for nll in [n for n in graph.nodes if n.target is aten.nll_loss_forward.default]:
        reduction = nll.args[3] if len(nll.args) > 3 else nll.kwargs.get("reduction", 1)
        if reduction != 1 or nll.meta[ir.VAL][0].dtype != nll.meta[ir.VAL][1].dtype:
            continue
        # each output's all-reduce (the count's may read a copy of the getitem that remat
        # made for the backward; a forward-only graph does not reduce the count at all)
        reduced = {0: [], 1: []}
        for u in nll.users:
            if u.target is operator.getitem and (found := _all_reduce_fed_by(u, group)):
                reduced[u.args[1]].append(found)
        if len(reduced[0]) != 1 or len(reduced[1]) > 1:
            continue
        ar_mean, views = reduced[0][0]
        ar_count = reduced[1][0][0] if reduced[1] else None
        wait_mean = next(iter(ar_mean.users))
        wait_count = next(iter(ar_count.users)) if ar_count is not None else None
        avg = list(wait_mean.users)
        if not (len(avg) == 1 and avg[0].target is aten.div.Scalar and avg[0].args[1] == n):
            continue
        done = _reduced_pair(graph, nll, group)
        with graph.inserting_before(done.next):
            count_all = _emit_like(graph, nll, aten.select.int, (done, 0, 1), (Replicate(),))
            total = _emit_like(graph, nll, aten.select.int, (done, 0, 0), (Replicate(),))
            loss = _emit_like(graph, nll, aten.div.Tensor, (total, count_all), (Replicate(),))
        if wait_count is not None:
            wait_count.replace_all_uses_with(count_all)
        avg[0].replace_all_uses_with(loss)
        for dead in (avg[0], wait_mean, ar_mean, wait_count, ar_count, *reversed(views),
                     *list(nll.users)):
            if dead is not None and not dead.users:  # (the loss's view seeds the backward)
                graph.erase_node(dead)


def exact_mean_terms(graph, group, n) -> None:
    """A mean cross-entropy that is one term of a larger loss (a second head, an MoE's
    auxiliary loss added to it), which `exact_mean_loss` leaves alone: DTensor's rule keeps it
    Partial(avg) until the sum is reduced, so the loss averages each rank's mean - not the
    batch's mean when the ranks count different targets (ignore_index: padding, a masked
    LM's labels). Its value on each rank is made this rank's sum * n / the group's count,
    whose average over the n ranks is the batch's mean; the count is all-reduced for it (the
    backward already divides by the group's count: the gradients were exact)."""
    order = {x: i for i, x in enumerate(graph.nodes)}
    for nll in [x for x in graph.nodes if x.target is aten.nll_loss_forward.default
                and x.meta.get(ir.REGION) == ir.FORWARD]:
        reduction = nll.args[3] if len(nll.args) > 3 else nll.kwargs.get("reduction", 1)
        means = sorted((u for u in nll.users if u.target is operator.getitem and u.args[1] == 0
                        and u.meta.get(ir.SHARD) == (Partial("avg"),)
                        and any(not w.meta.get(ir.LOSS_REDUCTION)
                                and w.meta.get(ir.REGION) != ir.BACKWARD for w in u.users)),
                       key=order.__getitem__)
        if reduction != 1 or not means or any(u.meta.get(ir.LOSS_REDUCTION) for u in nll.users):
            continue  # (not one, or the loss alone: exact_mean_loss's already)

        def emit(target, args, shard, comm=False):  # (values: the dp pass propagates them)
            return _emit_like(graph, nll, target, args, shard, comm)
        done = None  # (the count's all-reduce, after the first mean in graph order)
        for mean in means:
            readers = [w for w in mean.users if not w.meta.get(ir.LOSS_REDUCTION)
                       and w.meta.get(ir.REGION) != ir.BACKWARD]
            with graph.inserting_before(mean.next):
                count = emit(operator.getitem, (nll, 1), (Partial("sum"),))
                if done is None:
                    done = emit(c10d.wait_tensor.default, (emit(
                        c10d.all_reduce.default, (count, "sum", group), (Partial("sum"),),
                        True),), (Replicate(),), True)
                total = _local_sum(emit, mean, count, (Partial("avg"),))
                scaled = emit(aten.div.Tensor, (emit(aten.mul.Scalar, (total, n),
                                                     (Partial("avg"),)), done),
                              (Partial("avg"),))
            for w in readers:
                w.replace_input_with(mean, scaled)


def _emit_like(graph, like, target, args, shard, comm=False):
    """A node of the loss's reduction, in `like`'s region and module (COMM for a collective)."""
    node = graph.call_function(target, args)
    node.meta[ir.REGION] = ir.COMM if comm else like.meta.get(ir.REGION, ir.FORWARD)
    node.meta[ir.MODULE], node.meta[ir.SHARD] = like.meta.get(ir.MODULE, ""), shard
    node.meta[ir.LOSS_REDUCTION] = True
    return node


def _local_sum(emit, mean, count, shard):
    """This rank's sum of the loss from its (mean, count): a rank whose targets are all
    ignored has mean 0/0 = nan and contributes 0."""
    return emit(aten.where.ScalarOther, (emit(aten.ne.Scalar, (count, 0), None),
                                         emit(aten.mul.Tensor, (mean, count), shard), 0.0),
                shard)


def _reduced_pair(graph, nll, group):
    """(the sum of every rank's loss, of its target count) over `group`: one all-reduce of
    this rank's (sum, count) from `nll`'s local (mean, count), emitted right after `nll`;
    -> its wait."""
    def emit(target, args, shard, comm=False):
        return _emit_like(graph, nll, target, args, shard, comm)
    with graph.inserting_before(nll.next):  # in the forward, right after the loss
        mean = emit(operator.getitem, (nll, 0), (Partial("sum"),))
        count = emit(operator.getitem, (nll, 1), (Partial("sum"),))
        total = _local_sum(emit, mean, count, (Partial("sum"),))
        pair = emit(aten.stack.default, ([total, count],), (Partial("sum"),))
        return emit(c10d.wait_tensor.default, (
            emit(c10d.all_reduce.default, (pair, "sum", group), (Partial("sum"),), True),),
            (Replicate(),), True)


def regroup_mean_loss(graph, from_group: str, group: str) -> None:
    """The mean loss `exact_mean_loss` made exact over `from_group` (context parallelism:
    the sequence's chunks), made exact over `group` once the batch's rows are split too (the
    whole dp group). The data-parallel pass's sharding rules carry the first rewrite's
    nodes over the row split as any other ops: each row group's mean times the rows' count,
    averaged - the global mean only where every row group counts as many targets (a masked
    LM's labels do not). Here the pair (this rank's sum, its count) is summed over `group`
    instead, from the loss's own local outputs, and what read the old pair - the loss and
    the backward's target count - reads the new one; the old reduction's nodes are erased."""
    for old in [n for n in graph.nodes if n.target is c10d.all_reduce.default
                and n.meta.get(ir.LOSS_REDUCTION) and n.args[2] == from_group]:
        nlls = [a for a in ir.ancestors([old]) if a.target is aten.nll_loss_forward.default]
        if len(nlls) != 1:
            raise PlanError(
                f"data parallelism with context parallelism: the mean loss reduced by "
                f"{old.name} reads {len(nlls)} cross-entropies, not one; please report this "
                "model to fxpar (its loss could not be made the mean over every rank's "
                "targets).")
        (nll,) = nlls
        (old_wait,) = old.users
        partial = [u.name for u in old_wait.users if u.meta.get(ir.SHARD) != (Replicate(),)]
        if partial:  # (the row split reduced them again: the new pair would be summed twice)
            raise PlanError(
                f"data parallelism with context parallelism: the mean loss's {partial} are "
                "not whole after the rows split; please report this model to fxpar (its loss "
                "could not be made the mean over every rank's targets).")
        old_wait.replace_all_uses_with(_reduced_pair(graph, nll, group))
        dead, erased = [old_wait], set()
        while dead:  # the old reduction's nodes, back to what other nodes still read
            n = dead.pop()
            if n not in erased and not n.users and n.op == "call_function" and n is not nll:
                dead.extend(n.all_input_nodes)
                graph.erase_node(n)
                erased.add(n)



# --- the mean loss's target count, for microbatches (passes/data_parallel.py) -------------

def mean_nll_loss(graph) -> torch.fx.Node | None:
    """The forward's one mean, unweighted nll_loss_forward whose targets come from the batch
    alone (None when there is none). A mean nll loss that cannot be counted so is refused."""
    nlls = [n for n in graph.nodes if n.target is aten.nll_loss_forward.default
            and n.meta.get(ir.REGION) == ir.FORWARD
            and (n.args[3] if len(n.args) > 3 else 1) == 1]
    if not nlls:
        return None
    nll = nlls[0]
    problem = None
    if len(nlls) > 1:
        problem = f"it has {len(nlls)} mean cross-entropy losses"
    elif nll.args[2] is not None:
        problem = "its cross-entropy has class weights"
    elif batch_only(nll.args[1]) is None:
        problem = "its cross-entropy's targets depend on the model's parameters"
    if problem is not None:
        raise PlanError(
            f"microbatches > 1: this model's loss is a mean over the targets it counts "
            f"(cross-entropy, node {nll.name}, module '{nll.meta.get(ir.MODULE, '')}'), and "
            f"{problem}, so fxpar cannot weight the microbatches by their target counts (the "
            "mean of per-microbatch means differs from the batch mean when the counts differ, "
            "e.g. with padding or ignore_index). Use microbatches=1, or a loss_fn that "
            "returns one mean cross-entropy over targets taken from the batch.")
    return nll


def batch_only(node) -> list | None:
    """The nodes computing `node` from batch inputs only, in graph order (None if any
    parameter or buffer is involved)."""
    seen, todo = {}, [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op == "placeholder" and n.meta.get(ir.ROLE) != "batch":
            return None
        if n.op not in ("placeholder", "call_function", "get_attr"):
            return None
        seen[n] = True
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def target_count_program(gm, nll) -> torch.fx.GraphModule:
    """(batch leaves of one microbatch) -> the number of its targets nll counts, as the loss's
    dtype: the graph's own computation of the target (shifts, padding), then != ignore_index."""
    g = torch.fx.Graph()
    env = {}
    for n in gm.graph.nodes:  # the user's batch leaves, in order (not fp16's loss scale)
        if n.op == "placeholder" and n.meta.get(ir.FQN, "").startswith("batch["):
            env[n] = g.placeholder(n.name)
    for n in batch_only(nll.args[1]):
        if n not in env:
            env[n] = g.node_copy(n, env.__getitem__)
    ignore = nll.args[4] if len(nll.args) > 4 else -100
    counted = g.call_function(aten.ne.Scalar, (env[nll.args[1]], ignore))
    g.output(g.call_function(aten.sum.default, (counted,)))  # int64: exact at any size
    counter = torch.fx.GraphModule(gm, g)
    counter.meta[ir.COUNTER_DTYPE] = nll.meta[ir.VAL][1].dtype  # the share's (total_weight's) dtype
    return counter

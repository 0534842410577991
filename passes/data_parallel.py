"""Data parallelism as a graph transformation, exact.

The batch leaves become Shard(0) over the dp group; the sharding engine propagates that
through the joint graph (DTensor's per-op rules) and inserts the collectives that anything
coupling samples needs: BatchNorm's batch statistics (sums -> all-reduce), a loss that
averages (Partial(avg) -> all-reduce / dp), or sums (Partial(sum) -> all-reduce).
Gradients come out Partial(sum) and are all-reduced in buckets, as DDP does: one flat
all-reduce per bucket, issued right after its last gradient is computed. Buckets follow the
order the backward produces gradients and are sized by the cost model's alpha-beta estimate
(few large buckets when latency dominates, small ones when the backward left after a bucket
is short), or by a fixed `Plan.bucket_mb`.

Every collective is emitted with its wait right after it (blocking); passes/overlap.py then
moves waits to their first use and starts as early as inputs and memory allow.

Because the graph is traced at the global batch, constants like the 1/N of a mean are
already global: no rescaling of gradients is needed, which is what makes this exact.

ZeRO (`Plan.zero`) changes only what the gradients become: 1 = each bucket all-reduced and
this rank's 1/dp slice output; 2 = reduce-scattered instead; 3 = additionally every
parameter input is this rank's flat shard, all-gathered just before its forward use and again
before its backward use, one collective per layer each way (and one reduce-scatter of the
layer's gradients). runtime/zero.py steps the optimizer on the shards.

HSDP (`Plan.dp_shard` < dp): ZeRO's collectives run within a shard group of dp_shard ranks
(reduce-scatters, ZeRO-3's all-gathers) and each summed shard is all-reduced across the
dp // dp_shard replicas (`_ZeroGroups`); the batch's own collectives (loss, batch statistics)
stay on the whole dp group.

Expert parallelism (`Plan.ep`): an ep group's ranks hold different experts, so an expert
weight is shared only by the dp // ep ranks holding the same experts ("edp"). Its gradient is
summed there, and ZeRO shards it there (DeepSpeed's expert-data-parallel ZeRO, torchtitan's
FSDP of experts over dp_shard_mod_ep): expert buckets and ZeRO-3 units never mix with the
others, each reduced, sharded and gathered over its own group. With HSDP too (each expert
group inside a shard group), an expert weight is sharded over its shard group's ranks holding
the same experts ("edp_shard") and its shards summed across the replicas ("dp_rep"), as the
others are over "dp_shard".
"""
from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx

from fxpar.core import cost, ir
from fxpar.core import quantized_comm as qcomm
from fxpar.core.errors import BatchError, PlanError, ShardingError
from fxpar.core.graphs import copy_graph, fake_propagate, fake_run, packing
from fxpar.core.ir import ancestors
from fxpar.core.mean_loss import (exact_mean_loss, exact_mean_terms, mean_nll_loss,
                                   regroup_mean_loss, target_count_program)
from fxpar.core.sharding import (Partial, Replicate, Shard, dry_run, make_mesh, redistribute,
                                     shard_graph)

log = logging.getLogger(__name__)
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    dp: int | None = 1
    zero: int = 0
    dp_shard: int | None = None
    hpz: int | None = None
    microbatches: int = 1
    bucket_mb: float | None = None
    comm_quantization: str = "none"
    batch_stats: str = "whole"
    cp: int = 1
    ep: int = 1


CONTRACT = ir.PassContract(
    "data_parallel", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.MODULE, ir.ROLE, ir.FQN, ir.N_GRADS}),
    # a pipeline's stages and parts, tensor parallelism's placements, expert parallelism's
    # experts: where present, the reductions follow them
    reads=frozenset({ir.STAGE, ir.PHASE, ir.SHARD, ir.LOSS_COUNT, ir.EXPERT_PARAMS,
                     ir.EXPERT_SLOTS, ir.EP_TOKENS}),
    provides=frozenset({ir.BUCKET, ir.PACK, ir.BATCH_SHARD_DIMS, ir.ZERO_BUCKETS,
                        ir.PARAMS_SHARDED, ir.LOSS_COUNT, ir.COUNTER_DTYPE}),
    values_fresh=True)  # (its values propagated by the pass: not again by the manager)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    # (a forward-only graph, evaluate's, runs the whole batch at once)
    joint = any(n.meta.get(ir.REGION) == ir.BACKWARD for n in gm.graph.nodes
                if n.op == "call_function")
    if options.microbatches > 1 and joint and options.batch_stats == "whole":
        _refuse_row_coupling(gm)  # ("microbatch": each microbatch is its own batch, as asked)
    nll = mean_nll_loss(gm.graph) if options.microbatches > 1 and joint else None
    # the per-microbatch count of targets, taken from the unsharded graph (see below; context
    # parallelism, which shards the graph before this pass, took it before it did)
    loss_count = gm.meta.get(ir.LOSS_COUNT) or (
        target_count_program(gm, nll) if nll is not None else None)
    gm = _split_batch(gm, options, ctx)
    gm.meta[ir.LOSS_COUNT] = loss_count
    if loss_count is not None:
        _mean_over_microbatches(gm, nll, options.dp)
    return gm


def without_gradient_reduction(gm: torch.fx.GraphModule, n_grads: int,
                               dp_group: str = ir.GROUPS["dp"]) -> torch.fx.GraphModule:
    """A copy of a finished dp graph whose gradient outputs (the `n_grads` after the loss)
    are this rank's own Partial sums (summed over the dp group they are the batch's
    gradients): the dp all-reduce each reaches back to through its bucket's wait, split and
    views is dropped; every other collective (the loss, batch statistics, tensor
    parallelism's) kept.
    Plan.grad_compression's compressed phase runs it (runtime/onebit_adam.py)."""
    out = torch.fx.GraphModule(gm, copy_graph(gm.graph))
    out.meta = dict(gm.meta)
    graph = out.graph
    output = next(n for n in graph.nodes if n.op == "output")
    passing = (aten.view.default, aten.reshape.default, operator.getitem,
               aten.split_with_sizes.default, c10d.wait_tensor.default)
    starts = {}
    for v in output.args[0][1:1 + n_grads]:
        while isinstance(v, torch.fx.Node) and v.op == "call_function" and (
                v.target in passing or (v.target is c10d.all_reduce.default and
                                        v.args[2] != dp_group)):  # (a tp reduction)
            v = v.args[0]
        if isinstance(v, torch.fx.Node) and v.target is c10d.all_reduce.default:
            starts[v] = None
    for start in starts:
        for wait in list(start.users):
            wait.replace_all_uses_with(start.args[0])
            graph.erase_node(wait)
        graph.erase_node(start)
    out.recompile()
    return out


@dataclasses.dataclass(frozen=True)
class _ZeroGroups:
    """Where ZeRO's collectives go: shards over `group` (`n` ranks); with HSDP each summed
    shard is then all-reduced over `replicas` (`reps` ranks; None without HSDP)."""
    group: str
    n: int
    replicas: str | None = None
    reps: int = 1

    @classmethod
    def of(cls, options, group_names) -> "_ZeroGroups":
        dp, s = options.dp, options.dp_shard
        if not s or s >= dp:
            return cls(group_names["dp"], dp)
        return cls(group_names["dp_shard"], s, group_names["dp_rep"], dp // s)


@dataclasses.dataclass(frozen=True)
class _Experts:
    """Expert parallelism's expert weights (parameter indices), the group their gradients
    sum over (`whole`: the dp // ep ranks holding the same experts, "edp") and the groups
    ZeRO shards them over (`zg`: "edp"; with HSDP its shard group's part, "edp_shard", and
    the replicas)."""
    params: frozenset
    zg: _ZeroGroups
    whole: _ZeroGroups

    @classmethod
    def of(cls, params, options, group_names) -> "_Experts":
        dp, s, ep = options.dp, options.dp_shard, options.ep
        whole = _ZeroGroups(group_names["edp"], dp // ep)
        zg = whole if not s or s >= dp else _ZeroGroups(
            group_names["edp_shard"], s // ep, group_names["dp_rep"], dp // s)
        return cls(frozenset(params), zg, whole)


def _classes(indices, zg: _ZeroGroups, experts: _Experts | None, whole: bool = False):
    """`indices` as [(the others, over `zg`), (the experts, over their ZeRO groups, or
    `whole`: "edp")]; all over `zg` without ep."""
    if experts is None:
        return [(list(indices), zg)]
    return [([i for i in indices if i not in experts.params], zg),
            ([i for i in indices if i in experts.params],
             experts.whole if whole else experts.zg)]


def _across_replicas(graph, shard, zg: _ZeroGroups):
    """HSDP: this shard group's summed shard all-reduced over the replicas (the whole dp
    group's sum); the shard itself without HSDP."""
    if zg.replicas is None:
        return shard
    started = _emit(graph, c10d.all_reduce.default, (shard, "sum", zg.replicas))
    started.meta[ir.SHARD] = (Partial("sum"),)
    return _emit(graph, c10d.wait_tensor.default, (started,))


def _split_batch(gm: torch.fx.GraphModule, options, ctx) -> torch.fx.GraphModule:
    dp = options.dp
    if dp == 1:
        gm.meta[ir.BATCH_SHARD_DIMS] = [None] * sum(
            1 for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "batch")
        return gm
    group = ctx.group_names["dp"]
    # with context parallelism the rows split over the groups across cp groups ("cdp"), and
    # the gradients (partial over the sequence too) sum over the whole dp group
    cp = options.cp or 1
    rows, row_group = dp // cp, ctx.group_names["cdp"] if cp > 1 else group
    placements, shard_dims = {}, []
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta[ir.ROLE] == "batch":
            v = n.meta[ir.VAL]
            if v.dim() == 0 or rows == 1:
                shard_dims.append(None)
                continue
            if v.shape[0] % rows:
                over = f"dp={dp}" if cp == 1 else f"dp/cp={rows}"
                raise BatchError(
                    f"the global batch does not divide over {over} ranks: {n.meta[ir.FQN]} "
                    f"has {v.shape[0]} rows on its batch dimension (dim 0). Use a global batch "
                    f"size that is a multiple of {rows}, or a plan with a dp that divides "
                    f"{v.shape[0] * cp}.")
            placements[n.name] = (Shard(0),)
            shard_dims.append(0)
    gm.meta[ir.BATCH_SHARD_DIMS] = shard_dims

    if rows > 1:
        shard_graph(gm, make_mesh(rows), placements, [row_group], local_dispatch=True)
    if cp > 1 and rows > 1:
        _partial_gradients(gm, row_group, rows)
    # gradient buckets: a fixed size if the plan gives one, else the cost model sizes them
    # (None); ZeRO-3 reduce-scatters per layer instead (_reduce_scatter_by_layer)
    bucket_bytes = None if options.bucket_mb is None else int(options.bucket_mb * 2**20)
    zg = _ZeroGroups.of(options, ctx.group_names)
    ep = options.ep or 1
    # (the weights of ep's experts: slices of grouped experts, slots of listed ones)
    held = [*(gm.meta.get(ir.EXPERT_PARAMS) or ()), *(s[0] for s in gm.meta.get(
        ir.EXPERT_SLOTS) or ())]
    experts = _Experts.of(held, options, ctx.group_names) if ep > 1 else None
    _reduce_outputs(gm, group, dp, bucket_bytes, options.zero, ctx.profile,
                    quantized="gradients" in options.comm_quantization, zero_groups=zg,
                    rows=(row_group, rows), experts=experts)
    if rows > 1:
        exact_mean_loss(gm.graph, row_group, rows)
    if rows > 1 and cp == 1:  # (a mean cross-entropy among other terms of the loss)
        exact_mean_terms(gm.graph, row_group, rows)
    if cp > 1 and rows > 1:  # (context parallelism's exact mean, over the sequence's chunks)
        regroup_mean_loss(gm.graph, ctx.group_names["cp"], group)
    if options.zero == 3:
        # (with microbatches a step's forward and backward run as separate parts, one
        # microbatch at a time: a kept forward copy would be stashed per microbatch)
        _gather_params_before_use(gm, zg.group, zg.n, keep_tail=options.microbatches == 1,
                                  quantized="weights" in options.comm_quantization,
                                  secondary=(ctx.group_names["dp_shard"], options.hpz)
                                  if options.hpz else None, experts=experts)
        gm.meta[ir.PARAMS_SHARDED] = True
    for n in gm.graph.nodes:  # batch placeholders now hold local shards
        if n.name in placements:
            v = n.meta[ir.VAL]
            n.meta[ir.VAL] = v.new_empty((v.shape[0] // rows, *v.shape[1:]))
    if ctx.fresh_values:
        fake_propagate(gm, check=False)
    return gm


def _partial_gradients(gm, row_group: str, rows: int) -> None:
    """Context parallelism left every gradient a partial sum over its cp group; make each a
    partial sum over the rows' group too (one whole over the rows: this rank keeps it, the
    others contribute zeros), so one sum over the dp group completes every gradient."""
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    outs = list(out.args[0])
    for i in range(1, 1 + out.meta[ir.N_GRADS]):
        g = outs[i]
        if g is None:
            continue
        have = g.meta.get(ir.SHARD) or (Replicate(),)
        if have == (Partial("sum"),):
            continue
        with graph.inserting_before(out):
            p = redistribute(graph, g, have, (Partial("sum"),), [row_group], [rows],
                             {ir.MODULE: g.meta.get(ir.MODULE, ""), ir.REGION: ir.BACKWARD})
        p.meta[ir.SHARD] = (Partial("sum"),)
        outs[i] = p
    out.args = (tuple(outs),)


def _reduce_outputs(gm, group, dp, bucket_bytes, zero, profile, quantized,
                    zero_groups: _ZeroGroups, rows: tuple[str, int] | None = None,
                    experts: _Experts | None = None):
    """Loss -> Replicate (all-reduce), gradients -> bucketed all-reduce, buffers -> Replicate.
    With ZeRO (1, 2) the gradient outputs are this rank's shard of each flat bucket (over
    `zero_groups`: the whole dp group unless HSDP); `quantized` (ZeRO-2/3,
    Plan.comm_quantization): reduce-scattered as int4 (qgZ). `rows`: the (group, size) the
    batch's rows split over, where the loss and buffers are reduced (the dp group unless
    context parallelism splits the sequence over part of it). `experts` (ep): an expert
    gradient left partial (the all-to-all dispatch: the ep group's rows for this rank's
    experts) is summed over its "edp" group, and with ZeRO sharded there."""
    row_group, rows = rows or (group, dp)
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    outs = list(out.args[0])
    n_p = out.meta[ir.N_GRADS]
    loss, grads, bufs = outs[0], outs[1:1 + n_p], outs[1 + n_p:]

    def to_replicate(v):
        if v is None or v.meta.get(ir.SHARD) in (None, (Replicate(),)):
            return v
        with graph.inserting_before(out):
            r = redistribute(graph, v, v.meta[ir.SHARD], (Replicate(),), [row_group], [rows],
                             {ir.MODULE: v.meta.get(ir.MODULE, ""), ir.REGION: ir.COMM})
        r.meta[ir.SHARD] = (Replicate(),)
        return r

    loss = to_replicate(loss)
    bufs = [to_replicate(b) for b in bufs]

    order = {n: i for i, n in enumerate(graph.nodes)}
    if zero:
        grads = _zero_shard_buckets(graph, grads, group, dp, bucket_bytes, zero, order, out,
                                    gm.meta, profile, quantized, zero_groups, experts)
        out.meta[ir.N_GRADS] = len(grads)
        out.args = ((loss, *grads, *bufs),)
        return
    # gradients: Partial(sum) ones go in buckets; anything else is redistributed on its own
    partial = {i for i, g in enumerate(grads)
               if g is not None and g.meta.get(ir.SHARD) == (Partial("sum"),)}
    for i, g in enumerate(grads):
        if i not in partial:
            grads[i] = to_replicate(g)
    for members, czg in _classes(sorted(partial), _ZeroGroups(group, dp), experts, True):
        grp, n = czg.group, czg.n
        if n == 1:  # (one ep group: its rows are the step's, the gradients complete)
            continue
        for bucket in _buckets(graph, [grads[i] for i in members], bucket_bytes, n,
                               c10d.all_reduce.default, profile):
            idx = [members[j] for j in bucket]
            reduced = _all_reduce_bucket(graph, [grads[i] for i in idx], grp, order, out)
            for i, r in zip(idx, reduced):
                grads[i] = r
    out.args = ((loss, *grads, *bufs),)


# --- a mean loss over microbatches ----------------------------------------------------------
# With m microbatches each run of the graph sees 1/m of the (global) batch, and the runtime
# averages the m losses and gradients. A mean cross-entropy divides by the number of targets
# it counts (ignore_index: padding, unmasked MLM positions): the mean of m means equals the
# mean over the whole batch only when every microbatch counts as many targets. So the count
# becomes an input: the runtime counts the targets of the whole step first (a small program
# cut out of the graph: the target's batch-only computation, then != ignore_index, summed)
# and gives every microbatch C_total / m, which the backward divides by (nll_loss_backward's
# total_weight) and the loss is rescaled to (this microbatch's sum / (C_total / m)). The
# average of the m results is then sum / C_total, exactly, for the loss and every gradient.

def microbatch_refusal(gm: torch.fx.GraphModule) -> str | None:
    """Why this joint graph cannot take microbatches > 1 exactly (None: it can). For the
    planner, which must not propose such a plan."""
    try:
        nll = mean_nll_loss(gm.graph)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        if nll is not None and not _only_through(out.args[0][0], nll):
            raise PlanError("the loss adds other terms to a mean cross-entropy")
        _refuse_row_coupling(gm)
    except PlanError as e:
        return str(e)
    return None


# per-row losses: their batch mean or sum is what microbatching takes apart (the mean
# cross-entropy's count is handled by _mean_over_microbatches)
_LOSS_OPS = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
             aten.mse_loss.default, aten.binary_cross_entropy.default,
             aten.binary_cross_entropy_with_logits.default, aten.smooth_l1_loss.default,
             aten.huber_loss.default, aten.kl_div.default}
_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}
# ops that take values by their position along a dim: on the dim the batch's split lies
# along, "the first half" of a microbatch is not the whole batch's
_POSITION_PICKS = {aten.select.int, aten.unbind.int, aten.slice.Tensor, aten.narrow.default,
                   aten.split.Tensor, aten.split_with_sizes.default,
                   aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default}


def _refuse_row_coupling(gm: torch.fx.GraphModule) -> None:
    """microbatches > 1 runs the graph on each microbatch's rows alone, which equals one
    step on the whole batch only if no row reads another row's values before the loss: refuse
    where one does (PlanError naming the op). Found with DTensor's rules (a dry run of the
    forward with the batch split in two): a batch reduction feeding on into the computation
    (BatchNorm's statistics without running buffers, a mean over the batch) is a Partial value
    made whole; a matmul that turns the batch into a non-batch dimension (CLIP's [B, B]
    image-text scores) needs a split operand made whole; so does a pick by position along
    the dim the split lies on (Doge's router: its logits viewed [2, tokens, keys], the first
    half of the tokens' values then unbound as every token's first key). Gathers of other
    ops (a view that cannot stay split, MoE routing's sort over all tokens) are rows
    computed apart, as before, and not refused; so are counts over the batch read only as a
    grouped matmul's group offsets (`_only_group_sizes`)."""
    placements = {n.name: (Shard(0),) for n in gm.graph.nodes if n.op == "placeholder"
                  and n.meta.get(ir.ROLE) == "batch" and n.meta[ir.VAL].dim() > 0}
    if not placements:
        return
    try:
        _, requests = dry_run(gm, make_mesh(2), placements, ["rows"])
    except ShardingError as e:  # (an op DTensor cannot place: dp would refuse it too)
        log.warning("microbatches: could not check whether rows of the batch are computed "
                    "together (%s); training as if they are not", e)
        return
    trained = _feeding_training(gm)
    for node, _value, have, need in requests:
        if node.target in _LOSS_OPS or node not in trained or _only_group_sizes(node) or \
                node.meta.get(ir.LOSS_REDUCTION):  # (context parallelism's exact mean)
            continue
        reduced = any(isinstance(p, Partial) for p in have) and \
            not any(isinstance(p, Partial) for p in need)
        crossed = node.target in _MATMULS | _POSITION_PICKS and \
            any(isinstance(p, Shard) for p in have) and not any(isinstance(p, Shard) for p in need)
        if reduced or crossed:
            raise PlanError(
                f"microbatches > 1: rows of the batch are computed together in this model "
                f"({node.target} at node {node.name}, module '{node.meta.get(ir.MODULE, '')}' "
                f"reads {_coupling(node, reduced)}, e.g. batch statistics, a contrastive "
                "score matrix or a view that moves rows into another dim), so running each "
                "microbatch alone is not one step on the whole batch. Use microbatches=1 "
                "(dp splits such a batch exactly: fxpar adds the collectives).")


def _coupling(node: torch.fx.Node, reduced: bool) -> str:
    if reduced:
        return "a sum over the batch"
    if node.target in _POSITION_PICKS:
        return "rows of the batch by their position"
    return "every row of the batch"


_SIZE_OPS = {aten.cumsum.default, aten._to_copy.default, aten.view.default,
             aten.clone.default}


def _only_group_sizes(node: torch.fx.Node) -> bool:
    """Whether `node` (a count over the batch's rows, e.g. tokens per expert) is read only as
    the group offsets of grouped matmuls (through cumsum and casts): an MoE's experts then
    multiply each row by its own expert's weights whatever the other rows' counts, so a
    microbatch's own counts give each of its rows the result the whole batch gives it."""
    def as_offsets(v: torch.fx.Node) -> bool:
        for u in v.users:
            if u.target is aten._grouped_mm.default:
                if v in u.args[:2] or not (u.args[2:3] == (v,) or u.kwargs.get("offs") is v):
                    return False
            elif u.target in (torch.ops.fxpar.expert_window.default,
                              torch.ops.fxpar.ep_route.default):
                continue  # (ep's window of this rank's experts, or its all-to-all's route:
                # the rows each expert takes, group sizes)
            elif not (u.target in _SIZE_OPS and as_offsets(u)):
                return False
        return bool(v.users)
    return node.target in _SIZE_OPS and as_offsets(node)


def _feeding_training(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes the loss or a gradient reads: not those that only feed a buffer update of
    the form buffer + value (a load counter summed over the batch; summed over the
    microbatches too, so rows counted together there are exact)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    roots = [v for v in torch.utils._pytree.tree_leaves(out.args)
             if isinstance(v, torch.fx.Node) and not (
                 v.target in (aten.add.Tensor, aten.add.Scalar) and any(
                     isinstance(a, torch.fx.Node) and a.op == "placeholder"
                     and a.meta.get(ir.ROLE) == "buffer" for a in v.args))]
    return ancestors(roots)


def _mean_over_microbatches(gm, nll, dp: int) -> None:
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    loss = out.args[0][0]
    backs = [n for n in graph.nodes if n.target is aten.nll_loss_backward.default]
    count = backs[0].args[6] if backs else None  # this microbatch's (over every dp rank)
    # (over every dp rank: the reduced count the loss divides by, or the count of a loss
    # computed on whole rows on every rank - an op with no rule for split rows before it)
    whole = count is not None and count.meta.get(ir.SHARD) == (Replicate(),)
    if count is None or not _only_through(loss, nll) or (
            dp > 1 and count not in ancestors([loss]) and not whole):
        raise PlanError(
            "microbatches > 1: this model's loss adds other terms to a mean cross-entropy "
            f"(module '{nll.meta.get(ir.MODULE, '')}'), so fxpar cannot weight the "
            "microbatches by their target counts (the mean of per-microbatch means differs "
            "from the batch mean when the counts differ, e.g. with padding or ignore_index). "
            "Use microbatches=1.")
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(phs[-1]):
        share = graph.placeholder("loss_count")
    share.meta.update({ir.ROLE: "batch", ir.FQN: "loss_count", ir.REGION: ir.FORWARD,
                       ir.MODULE: "", ir.VAL: count.meta[ir.VAL].new_empty(())})
    gm.meta[ir.BATCH_SHARD_DIMS] = [*gm.meta[ir.BATCH_SHARD_DIMS], None]
    for b in backs:
        b.args = (*b.args[:6], share, *b.args[7:])
    if count.meta.get(ir.REGION) != ir.FORWARD:  # (remat's copy): the loss needs the forward's
        count = next((u for u in nll.users if u.target is operator.getitem and u.args[1] == 1
                      and u.meta.get(ir.REGION) == ir.FORWARD), None)
        if count is None:
            with graph.inserting_after(nll):
                count = graph.call_function(operator.getitem, (nll, 1))
            count.meta.update({k: v for k, v in nll.meta.items() if k != ir.VAL})
            count.meta[ir.VAL] = nll.meta[ir.VAL][1]
    # the new nodes run where the loss is made (its pipeline stage and phase: a forward-only
    # run, evaluate under a pipeline, must compute them)
    meta = {k: loss.meta[k] for k in (ir.REGION, ir.SHARD, ir.STAGE, ir.PHASE) if k in loss.meta}
    meta.setdefault(ir.REGION, ir.FORWARD)
    meta[ir.MODULE] = nll.meta.get(ir.MODULE, "")

    def emit(target, args):
        node = graph.call_function(target, args)
        node.meta.update(meta)
        fake_run(node)  # (its dtype promoted as torch does: a bf16 loss by an fp32 count)
        return node
    with graph.inserting_before(out):  # a microbatch whose targets are all ignored adds 0
        rescaled = emit(aten.div.Tensor, (emit(aten.mul.Tensor, (loss, count)), share))
        nonzero = emit(aten.ne.Scalar, (count, 0))
        new_loss = emit(aten.where.ScalarOther, (nonzero, rescaled, 0.0))
    out.args = ((new_loss, *out.args[0][1:]),)


# what may lie between the mean cross-entropy and the loss: views and casts of it, scaling
# by a constant, and the data-parallel pass's exact reduction (sum and count all-reduced)
_LINEAR = {operator.getitem, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
           aten.div.Scalar, aten.where.ScalarOther, aten.ne.Scalar, aten.stack.default,
           aten.select.int, aten.clone.default, aten._to_copy.default,
           c10d.all_reduce.default, c10d.wait_tensor.default}


def _only_through(loss, nll) -> bool:
    """Whether the loss is the mean cross-entropy `nll` alone, up to views, casts, constant
    factors and the data-parallel reduction: no other term, nothing nonlinear (a loss**2
    would make the rescaled microbatch losses wrong)."""
    up = ancestors([loss])
    if nll not in up:
        return False
    down, todo = set(), [nll]
    while todo:
        for u in todo.pop().users:
            if u not in down and u in up:
                down.add(u)
                todo.append(u)
    if any(n.op == "call_function" and n.target not in _LINEAR and n.target not in ir.RESHAPES
           for n in down):
        return False
    todo, seen = [loss], set()  # and the model reaches the loss through nll only
    while todo:
        n = todo.pop()
        if n in seen or n is nll:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.meta.get(ir.ROLE) in ("param", "buffer"):
            return False
        todo.extend(n.all_input_nodes)
    return True


def _zero_shard_buckets(graph, grads, group, dp, bucket_bytes, zero, order, out, decided,
                        profile, quantized, zg: _ZeroGroups, experts: _Experts | None = None):
    """ZeRO-1: all-reduce each flat bucket, keep this rank's 1/n slice. ZeRO-2:
    reduce-scatter it (each rank receives only its summed slice: half the bytes of an
    all-reduce, and no full-size reduced gradient), then (HSDP) all-reduce the slice across
    the replicas. n: the ranks `zg` shards over (expert weights: `experts.zg`'s; a bucket of
    one rank's shard is its whole, no collective). Returns one shard node per bucket and
    records the bucket layout in decided[ir.ZERO_BUCKETS] (the graph module's meta)."""
    with_grad = [i for i, g in enumerate(grads) if g is not None]
    for members, czg in _classes(with_grad, _ZeroGroups(group, dp), experts, True):
        for i in members:  # everything in a bucket must be a partial sum (over its whole sum)
            pl = grads[i].meta.get(ir.SHARD)
            if pl != (Partial("sum"),):
                # (in the gradient's pipeline part: buckets are cut per stage by it)
                meta = {k: grads[i].meta[k] for k in (ir.STAGE, ir.PHASE) if k in grads[i].meta}
                with graph.inserting_before(out):
                    grads[i] = redistribute(graph, grads[i], pl, (Partial("sum"),),
                                            [czg.group], [czg.n],
                                            {ir.MODULE: grads[i].meta.get(ir.MODULE, ""),
                                             ir.REGION: ir.COMM, **meta})
    # positions again: the redistributions above are new nodes (all after the old ones; a
    # bucket of two of them placed after the first one read the second before it existed)
    order = {n: i for i, n in enumerate(graph.nodes)}
    classes = _classes(with_grad, zg, experts)
    if zero == 3:
        return _reduce_scatter_by_layer(graph, grads, classes, order, out, decided, quantized)
    shards = []
    decided[ir.ZERO_BUCKETS] = []
    target = c10d.reduce_scatter_tensor.default if zero >= 2 else c10d.all_reduce.default
    for with_grad, zg in classes:
        n = zg.n
        # (ZeRO-1: the whole group's all-reduce, dp for the others, "edp" for the experts,
        # then this rank's slice over `zg`: its shard group with HSDP)
        whole = experts.whole.group if experts and zg is experts.zg else group
        for bucket in _buckets(graph, [grads[i] for i in with_grad], bucket_bytes, n, target,
                               profile):
            idx = [with_grad[j] for j in bucket]
            decided[ir.ZERO_BUCKETS].append(idx)
            shards.append(_zero_shard(graph, [grads[i] for i in idx], whole, zero, order, out,
                                      quantized, zg))
    return shards


def _zero_shard(graph, members, group, zero, order, out, quantized, zg: _ZeroGroups):
    """This rank's shard of one ZeRO-1/2 bucket of gradients `members` (see above)."""
    n = zg.n
    segments = _row_segments(members, n) if quantized else None
    with graph.inserting_before(_after_last(members, order)):
        flat = _flat_bucket(graph, members, multiple_of=n)
        if n == 1:  # (one rank holds the whole: nothing to cut; HSDP: summed over replicas)
            flat = _across_replicas(graph, flat, zg)
            flat.meta[ir.SHARD] = (Shard(0),)
            return flat
        if quantized:
            done = _start_quantized_reduce_scatter(graph, flat, segments, n, zg.group)
        elif zero >= 2:
            started = _emit(graph, c10d.reduce_scatter_tensor.default,
                            (flat, "sum", n, zg.group))
            done = _across_replicas(graph, _emit(graph, c10d.wait_tensor.default, (started,)),
                                    zg)
        else:
            started = _emit(graph, c10d.all_reduce.default, (flat, "sum", group))
            done = _emit(graph, c10d.wait_tensor.default, (started,))
    with graph.inserting_before(out):
        if quantized:
            shard = _across_replicas(graph, _quantized_shard(
                graph, done, segments, n, members[0].meta[ir.VAL].dtype), zg)
        elif zero >= 2:
            shard = done
        else:
            shard = _emit(graph, torch.ops.fxpar.local_chunk.default, (done, 0, n, zg.group))
    shard.meta[ir.SHARD] = (Shard(0),)
    return shard


def _reduce_scatter_by_layer(graph, grads, classes, order, out, decided, quantized=False):
    """ZeRO-3: each gradient's output is this rank's shard of it, laid out as its parameter's
    shard (one bucket per parameter, decided[ir.ZERO_BUCKETS]). The gradients one layer makes
    in one pipeline part are reduce-scattered by one collective, issued after the last of them:
    each padded to dp equal pieces, the pieces side by side ([dp, sum of shard sizes]: row r is
    what rank r keeps), so the result is this rank's shards back to back. `classes`: the
    gradient indices of each group (the others, ep's experts) and the _ZeroGroups they shard
    over (dp here: its ranks; HSDP all-reduces the shards across its replicas after; one
    rank: its shard is the whole, no collective)."""
    every = sorted(i for idx, _ in classes for i in idx)
    decided[ir.ZERO_BUCKETS] = [[i] for i in reversed(every)]
    params = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(ir.ROLE) == "param"]
    units: dict = {}
    for c, (idx, zg) in enumerate(classes):
        for i in reversed(idx):  # the order the backward makes them
            g = grads[i]
            key = (c, g.meta.get(ir.STAGE), g.meta.get(ir.PHASE), _layer_of_param(params[i]),
                   g.meta[ir.VAL].dtype)
            units.setdefault(key, (zg, []))[1].append(i)
    shard_of = {}
    for zg, idx in units.values():
        group, dp = zg.group, zg.n
        members = [grads[i] for i in idx]
        if dp == 1:  # (HSDP: each whole one summed over the replicas)
            for i, g in zip(idx, members):
                with graph.inserting_before(_after_last([g], order)):
                    shard_of[i] = _across_replicas(graph, _flat_bucket(graph, [g]), zg)
                shard_of[i].meta[ir.SHARD] = (Shard(0),)
            continue
        sizes = [-(-g.meta[ir.VAL].numel() // dp) for g in members]
        with graph.inserting_before(_after_last(members, order)):
            rows = []
            for g, size in zip(members, sizes):
                flat = _flat_bucket(graph, [g], multiple_of=dp)
                if len(members) > 1:
                    flat = _emit(graph, aten.view.default, (flat, [dp, size]))
                    flat.meta[ir.SHARD] = (Partial("sum"),)
                rows.append(flat)
            if len(members) > 1:
                packed = _emit(graph, aten.cat.default, (rows, 1))
                flat = _emit(graph, aten.view.default, (packed, [dp * sum(sizes)]))
                packed.meta[ir.SHARD] = flat.meta[ir.SHARD] = (Partial("sum"),)
            if quantized:
                done = _start_quantized_reduce_scatter(graph, flat, sizes, dp, group)
            else:
                started = _emit(graph, c10d.reduce_scatter_tensor.default,
                                (flat, "sum", dp, group))
                done = _across_replicas(graph, _emit(graph, c10d.wait_tensor.default,
                                                     (started,)), zg)
        if quantized:
            with graph.inserting_before(out):
                done = _across_replicas(graph, _quantized_shard(
                    graph, done, sizes, dp, members[0].meta[ir.VAL].dtype), zg)
        done.meta[ir.SHARD] = (Shard(0),)
        if len(members) == 1:
            shard_of[idx[0]] = done
            continue
        with graph.inserting_before(out):
            pieces = _emit(graph, aten.split_with_sizes.default, (done, sizes))
            for k, i in enumerate(idx):
                shard_of[i] = _emit(graph, operator.getitem, (pieces, k))
                shard_of[i].meta[ir.SHARD] = (Shard(0),)
    return [shard_of[b[0]] for b in decided[ir.ZERO_BUCKETS]]


def _start_quantized_reduce_scatter(graph, flat, sizes, dp, group):
    """qgZ (core/quantized_comm.py): `flat` ([dp * sum(sizes)], row r what rank r keeps:
    segments of `sizes`, one per tensor) as int4 blocks, part r sent to rank r by one
    all-to-all; returns its wait."""
    payload = qcomm.int4_payload(_bucket_op(graph), flat, sizes, dp)
    part = qcomm.int4_bytes(sizes)
    started = _emit(graph, c10d.all_to_all_single.default, (payload, [part] * dp, [part] * dp,
                                                             group))
    return _emit(graph, c10d.wait_tensor.default, (started,))


def _row_segments(members, dp) -> list[int]:
    """qgZ on a flat bucket (ZeRO-2): the bucket's dp rows cut at every row's tensor
    boundaries (and its padding's), the same cuts in every row, so no block of a row holds
    two tensors: segments of one tensor each, in every row."""
    sizes = [g.meta[ir.VAL].numel() for g in members]
    size = -(-sum(sizes) // dp)
    starts = [sum(sizes[:k]) for k in range(1, len(sizes) + 1)]
    cuts = sorted({b - r * size for b in starts for r in range(dp) if 0 < b - r * size < size})
    return [b - a for a, b in zip([0, *cuts], [*cuts, size])]


def _quantized_shard(graph, received, sizes, dp, dtype):
    """This rank's summed [sum(sizes)] shard of a qgZ reduce-scatter, in `dtype`."""
    return qcomm.sum_of_int4_payloads(_bucket_op(graph), received, sizes, dp, dtype)


def _bucket_op(graph):
    """core/quantized_comm's `op`: each op a node of the bucket's communication."""
    return lambda target, *args, **kwargs: _emit(graph, target, args, kwargs)


def _layer_of_param(p) -> str:
    """The layer (ir.layer_of) of the module owning parameter placeholder `p`: ZeRO-3's unit
    of one collective. Taken from the parameter's name, not from the module meta of the ops
    reading it (a bias gradient's sum is attributed to the next module the backward visits)."""
    fqn = p.meta.get(ir.FQN) or p.name
    return ir.layer_of(fqn.rsplit(".", 1)[0] if "." in fqn else fqn)


def _gather_params_before_use(gm, group, dp, keep_tail=True, quantized=False, secondary=None,
                              experts: _Experts | None = None):
    """ZeRO-3 (FSDP FULL_SHARD): every parameter placeholder becomes this rank's flat 1/dp
    shard; full weights are all-gathered just before their first use in the forward and again
    before their first use in the backward, so each gathered copy dies after its last use there.
    The weights of one layer (their names' module path up to its block index, e.g.
    `transformer.h.3`) read in one pipeline part are gathered by one collective, as FSDP2
    gathers one flat buffer per wrapped block: their shards are copied into one input and the
    result copied out into whole weights (one gloo/NCCL call per layer instead of one per
    weight). Views of a weight made in the forward (e.g. its transpose) that the backward
    reads are re-made from the backward's gather, so no forward copy is kept alive for the
    backward, except the tail's (_kept_from_forward).
    Under pipeline parallelism each stage that reads the weight gathers it itself, in each
    of its own forward and backward parts (never a full weight sent between stages or kept from a
    microbatch's forward to its backward), as FSDP2 does under pipelining.
    `quantized` (Plan.comm_quantization, qwZ): each gather carries int8 blocks.
    `secondary` = (group, n) (Plan.hpz, ZeRO++'s hpZ): each backward gather reads a
    secondary 1/n shard the forward cut from its own gathered copy (`_secondary_shards`), over
    that group of n neighbouring ranks, instead of the 1/dp shard over the whole dp group.
    `experts` (ep): expert weights are sharded and gathered over their "edp" group instead."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    fwd, bwd = [], []  # (param, first reader, its readers: [(node, value read)]) per part
    views_of, full = {}, {}  # per param: its forward views; its whole (numel, shape)
    params = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(ir.ROLE) == "param"]
    over = {p: (experts.zg.n, experts.zg.group) for i, p in enumerate(params)
            if experts and i in experts.params}
    for p in params:
        val = p.meta[ir.VAL]
        full[p] = (val.numel(), list(val.shape))
        p.meta[ir.VAL] = val.new_empty((-(-val.numel() // over.get(p, (dp,))[0]),))
        p.meta[ir.SHARD] = (Shard(0),)
        views_of[p] = _forward_views_of(p)     # p and its forward views, in graph order
        bwd_uses = [(u, v) for v in views_of[p] for u in v.users
                    if u.meta.get(ir.REGION) == ir.BACKWARD]
        fwd_users = sorted((u for u in p.users if u.meta.get(ir.REGION) != ir.BACKWARD),
                           key=order.__getitem__)
        fwd += [(p, users[0], [(u, p) for u in users])
                for users in _by_stage(fwd_users, lambda u: u)]
        bwd += [(p, uses[0][0], uses) for uses in _by_stage(
            sorted(bwd_uses, key=lambda uv: order[uv[0]]), lambda uv: uv[0])]

    fwd_fulls: dict = {}
    for p, whole, readers in _gathered_by_layer(graph, fwd, dp, group, order, full, quantized,
                                                over):
        fwd_fulls.setdefault(p, []).append(whole)
        for u, _ in readers:
            u.replace_input_with(p, whole)
    if keep_tail:
        bwd = _kept_from_forward(graph, bwd, fwd_fulls, views_of)
    if secondary is not None:
        gathered = _gathered_from_secondary(graph, bwd, fwd_fulls, secondary, full,
                                            quantized, (dp, group))
    else:
        gathered = _gathered_by_layer(graph, bwd, dp, group, order, full, quantized, over)
    for p, whole, uses in gathered:
        first = uses[0][0]
        env = {p: whole}
        env.update({f: whole for f in fwd_fulls.get(p, [])})
        copies = []
        for v in views_of[p][1:]:
            with graph.inserting_before(first):
                env[v] = graph.node_copy(v, lambda a: env.get(a, a))
            env[v].meta.update({ir.REGION: ir.BACKWARD, ir.SHARD: (Replicate(),)})
            _place_like(env[v], first)
            copies.append(env[v])
        for u, v in uses:
            u.replace_input_with(v, env[v])
        for c in reversed(copies):  # views this stage's backward does not read
            if not c.users:
                graph.erase_node(c)
    for p, views in views_of.items():
        for v in reversed(views[1:]):  # forward views the backward no longer reads
            if not v.users:
                graph.erase_node(v)


def _gathered_from_secondary(graph, requests, fwd_fulls, secondary, full, quantized, primary):
    """hpZ: for each backward request (param, first reader, readers) a secondary shard -- the
    rank's 1/n of the forward's whole copy (padded to n pieces), cut right after it is made
    and kept to the backward -- then gathered by layer over the group of n ranks, as
    `_gathered_by_layer` gathers primary shards (`primary` = (dp, group): for a weight the
    forward does not read). Yields (param, its whole weight, readers)."""
    group, n = secondary
    of_param, reqs, rest = {}, [], []
    for p, first, readers in requests:
        if len(fwd_fulls.get(p, [])) != 1:  # (one forward part: hpZ runs at pp=1, m=1)
            rest.append((p, first, readers))
            continue
        (whole,) = fwd_fulls[p]
        meta = {ir.REGION: ir.FORWARD, ir.MODULE: whole.meta.get(ir.MODULE, ""),
                ir.SHARD: (Shard(0),)}
        pad = -full[p][0] % n
        with graph.inserting_before(whole.next):  # (in this order, right after the gather)
            flat = graph.call_function(aten.reshape.default, (whole, [-1]))
            padded = graph.call_function(aten.constant_pad_nd.default, (flat, [0, pad])) \
                if pad else flat
            sec = graph.call_function(torch.ops.fxpar.local_chunk.default, (padded, 0, n, group))
        for node in {flat, padded, sec}:
            node.meta.update(meta)
        sec.meta[ir.VAL] = p.meta[ir.VAL].new_empty((-(-full[p][0] // n),))
        sec.meta[ir.FQN] = p.meta.get(ir.FQN)  # (its layer: one gather per layer)
        full[sec], of_param[sec] = full[p], p
        reqs.append((sec, first, readers))
    order = {node: i for i, node in enumerate(graph.nodes)}
    yield from _gathered_by_layer(graph, rest, *primary, order, full, quantized)
    for sec, whole, readers in _gathered_by_layer(graph, reqs, n, group, order, full,
                                                  quantized):
        yield of_param[sec], whole, readers


def _kept_from_forward(graph, requests, fwd_fulls, views_of) -> list:
    """The backward requests that need a gather of their own; the others read the forward's
    copy. A weight the backward reads soon after the forward last did (the loss head, the
    final norm, the last block: nothing but units under half its size gathered in between)
    keeps its forward copy instead of being freed and gathered again at the turn from forward
    to backward, where nothing is left to hide the gather behind (FSDP2 keeps its root's
    weights the same way). Only within one part: a pipeline stage's forward and backward are
    different parts and always gather apart, and with microbatches the caller does not ask
    (forward and backward run as parts then too, pp=1 included)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    fwd_starts = [n for n in graph.nodes if _gathers_params(n)
                  and n.meta.get(ir.REGION) != ir.BACKWARD]
    rest = []
    for p, first, uses in requests:
        part = (first.meta.get(ir.STAGE), first.meta.get(ir.PHASE))
        full = next((f for f in fwd_fulls.get(p, [])
                     if (f.meta.get(ir.STAGE), f.meta.get(ir.PHASE)) == part), None)
        if full is None:
            rest.append((p, first, uses))
            continue
        start = next((a for a in ancestors([full])  # (through the copy-out, dequantizing)
                      if a.target is c10d.all_gather_into_tensor.default), None)
        if start is None:  # (a shard of one rank: a view of the whole weight, kept free)
            for u, v in uses:
                if v is p:
                    u.replace_input_with(p, full)
            continue
        last_fwd = max(order[u] for v in (full, *views_of[p][1:]) for u in v.users
                       if u.meta.get(ir.REGION) != ir.BACKWARD)
        between = sum(_shard_bytes(s) for s in fwd_starts
                      if s is not start and last_fwd < order[s] < order[first])
        if 2 * between >= _shard_bytes(start):
            rest.append((p, first, uses))
            continue
        for u, v in uses:
            if v is p:
                u.replace_input_with(p, full)
    return rest


def _gathers_params(n) -> bool:
    """A ZeRO-3 parameter all-gather (not one the sharding engine made of an activation)."""
    if n.target is not c10d.all_gather_into_tensor.default:
        return False
    x = n.args[0]
    return bool(x.meta.get(ir.PACK)) or (x.op == "placeholder"
                                         and x.meta.get(ir.ROLE) == "param")


def _shard_bytes(gather) -> int:
    """Bytes of the shards an all-gather reads (its parameter placeholder, or the shards
    its packing reads: their copy into one input, their quantization)."""
    return sum(cost.tensor_bytes(x.meta[ir.VAL]) for x in packing(gather)[1])


def _gathered_by_layer(graph, requests, dp, group, order, full, quantized=False, over=None):
    """One all-gather per (pipeline part, layer, dtype) of the requests (param, first reader,
    readers), inserted before the group's earliest first reader; over the `dp` ranks of
    `group`, or a parameter's own (ranks, group) in `over`. Yields (param, its whole
    weight, readers). Outside numbered blocks a layer is one module (`lm_head`)."""
    units: dict = {}
    for p, first, readers in requests:
        key = (first.meta.get(ir.STAGE), first.meta.get(ir.PHASE), _layer_of_param(p),
               p.meta[ir.VAL].dtype, (over or {}).get(p, (dp, group)))
        units.setdefault(key, []).append((p, first, readers))
    for key, members in units.items():
        before = min((first for _, first, _ in members), key=order.__getitem__)
        fulls = _gather(graph, [p for p, _, _ in members], *key[-1], before, full, quantized)
        for (p, _, readers), whole in zip(members, fulls):
            yield p, whole, readers


def _by_stage(items, node_of) -> list[list]:
    """Items (in graph order) grouped by their node's pipeline part, (stage, phase): one
    group without stages; zero-bubble's input- and weight-gradient parts of a stage gather
    apart (neither may read what the other has not run yet)."""
    groups: dict = {}
    for it in items:
        n = node_of(it)
        groups.setdefault((n.meta.get(ir.STAGE), n.meta.get(ir.PHASE)), []).append(it)
    return list(groups.values())


def _place_like(node, like) -> None:
    """Put a node the pass inserts into the pipeline part (stage, phase) of `like`."""
    for k in (ir.STAGE, ir.PHASE):
        if k in like.meta:
            node.meta[k] = like.meta[k]
        else:
            node.meta.pop(k, None)


def _forward_views_of(p):
    """p followed by the forward view ops reachable from it through views only."""
    out, frontier = [p], [p]
    while frontier:
        nxt = []
        for v in frontier:
            for u in v.users:
                if (u.meta.get(ir.REGION) != ir.BACKWARD and u.op == "call_function"
                        and u not in out and cost.is_view(u)):
                    out.append(u)
                    nxt.append(u)
        frontier = nxt
    order = {n: i for i, n in enumerate(p.graph.nodes)}
    return [p] + sorted(out[1:], key=order.__getitem__)


def _gather(graph, shards, dp, group, before, full, quantized=False):
    """The whole weights of `shards` (parameter placeholders holding flat 1/dp shards; `full`:
    each one's whole numel and shape), inserted before `before`: all-gather + wait (+ unpad)
    + view to each parameter's shape.
    Several shards travel in one collective: copied into one input (rank r's part of the
    result is then its shards back to back, [dp, sum of shard sizes]) and each weight copied
    out of its columns, FSDP2's all-gather copy-in / copy-out. `quantized` (qwZ): the input
    is quantized to int8 blocks and every rank's part dequantized after the gather
    (core/quantized_comm.py); the quantization is packing (ir.PACK) too, so the overlap
    pass moves it with the collective."""
    meta = {ir.REGION: before.meta.get(ir.REGION, ir.FORWARD),
            ir.MODULE: before.meta.get(ir.MODULE, ""), ir.SHARD: (Replicate(),)}
    sizes = [s.meta[ir.VAL].numel() for s in shards]
    nodes, fulls = [], []
    if dp == 1:  # (one rank's shard is the whole weight: nothing to gather)
        with graph.inserting_before(before):
            fulls = [graph.call_function(aten.view.default, (s, full[s][1])) for s in shards]
        for n in fulls:
            n.meta.update(meta)
            _place_like(n, before)
        return fulls
    with graph.inserting_before(before):
        if len(shards) == 1:
            packed = shards[0]
        else:
            packed = graph.call_function(aten.cat.default, (list(shards),))
            packed.meta[ir.PACK] = True
            nodes.append(packed)
        if quantized:
            payload = qcomm.int8_payload(_into(graph, nodes), packed, sizes)
            for n in nodes:
                n.meta[ir.PACK] = True
            packed = payload
        nodes.append(graph.call_function(c10d.all_gather_into_tensor.default,
                                         (packed, dp, group)))
        nodes.append(graph.call_function(c10d.wait_tensor.default, (nodes[-1],)))
        if quantized:
            qcomm.from_int8_payloads(_into(graph, nodes), nodes[-1], sizes, dp,
                                     shards[0].meta[ir.VAL].dtype)
        if len(shards) == 1:
            flats = [nodes[-1]]
        else:
            nodes.append(graph.call_function(aten.view.default, (nodes[-1], [dp, sum(sizes)])))
            nodes.append(graph.call_function(aten.split_with_sizes.default,
                                             (nodes[-1], sizes, 1)))
            pieces, flats = nodes[-1], []
            for k, size in enumerate(sizes):
                nodes.append(graph.call_function(operator.getitem, (pieces, k)))
                nodes.append(graph.call_function(aten.clone.default, (nodes[-1],),
                                                 {"memory_format": torch.contiguous_format}))
                nodes.append(graph.call_function(aten.view.default, (nodes[-1], [dp * size])))
                flats.append(nodes[-1])
        for shard, size, flat in zip(shards, sizes, flats):
            numel, shape = full[shard]
            if numel != dp * size:
                nodes.append(graph.call_function(aten.slice.Tensor, (flat, 0, 0, numel)))
                flat = nodes[-1]
            nodes.append(graph.call_function(aten.view.default, (flat, shape)))
            fulls.append(nodes[-1])
    for n in nodes:
        n.meta.update(meta)
        _place_like(n, before)
    return fulls


def _into(graph, nodes):
    """core/quantized_comm's `op`: each op a node appended to `nodes`."""
    def op(target, *args, **kwargs):
        nodes.append(graph.call_function(target, args, kwargs))
        return nodes[-1]
    return op


def _buckets(graph, grads, bucket_bytes, dp, target, profile=None):
    """Bucket index lists over `grads`; never mixing pipeline stages (a bucket is one
    collective, run by the stage that made its gradients)."""
    by_stage: dict = {}
    for j, g in enumerate(grads):
        by_stage.setdefault(g.meta.get(ir.STAGE), []).append(j)
    if len(by_stage) > 1:
        out = []
        for idx in by_stage.values():
            out += [[idx[k] for k in b] for b in _buckets(graph, [grads[j] for j in idx],
                                                          bucket_bytes, dp, target, profile)]
        return out
    if bucket_bytes is not None:
        return assign_buckets(grads, bucket_bytes)
    nodes = list(graph.nodes)
    profile = (profile or cost.DeviceProfile.for_device(next(  # (a pass run alone)
        n.meta[ir.VAL].device for n in nodes if n.op == "placeholder"))).for_collectives()
    clock, ready = 0.0, {}
    for n in nodes:  # when each gradient exists, by the cost model, in execution order
        clock += cost.node_time(n, profile) if n.op == "call_function" else 0.0
        ready[n] = clock
    return assign_buckets_by_cost(grads, [ready[g] for g in grads], profile, dp, target)


def assign_buckets_by_cost(grads: list[torch.fx.Node], ready: list[float], profile, dp: int,
                           target) -> list[list[int]]:
    """Buckets that minimise when the last one finishes communicating, by the alpha-beta model.

    Gradients are taken in the order they become ready; a bucket (contiguous run, one dtype)
    starts when its last gradient exists and the link is free, and takes
    cost.comm_time(bytes). Dynamic program over prefixes: finish[j] = min over i of
    max(ready[j], finish[i]) + time(bytes of i+1..j); the earliest finish of a prefix is
    also the best start for what follows, so the minimum is exact. Large alpha -> few big
    buckets; a long backward after a gradient -> smaller buckets that start early, but none
    below 4 alpha x bandwidth bytes (except the last)."""
    # a bucket's transfer time should dominate its latency: at least 4 alpha of bytes
    # (>= 80% of link bandwidth), else per-message costs the model only roughly knows add up
    floor = cost.min_bucket_bytes(profile)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j in sorted(range(len(grads)), key=lambda j: (ready[j], -j)):
        by_dtype.setdefault(grads[j].meta[ir.VAL].dtype, []).append(j)
    buckets = []
    for order in by_dtype.values():
        sizes = [cost.tensor_bytes(grads[j].meta[ir.VAL]) for j in order]
        prefix = [0]
        for b in sizes:
            prefix.append(prefix[-1] + b)
        m = len(order)
        finish, cut = [0.0] + [float("inf")] * m, [0] * (m + 1)
        for j in range(1, m + 1):
            r = ready[order[j - 1]]
            for i in range(j):
                if j < m and prefix[j] - prefix[i] < floor:
                    continue  # latency-dominated bucket (only the last may be that small)
                t = max(r, finish[i]) + cost.comm_time(target, prefix[j] - prefix[i], dp,
                                                       profile)
                if t < finish[j]:
                    finish[j], cut[j] = t, i
        j, found = m, []
        while j:
            found.append(order[cut[j]:j])
            j = cut[j]
        buckets.extend(reversed(found))
    return buckets


def assign_buckets(grads: list[torch.fx.Node], bucket_bytes: int) -> list[list[int]]:
    """DDP-style buckets over gradient nodes: reverse order (the backward produces the last
    parameters' gradients first), one dtype per bucket, closed once it holds >= bucket_bytes."""
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for j in reversed(range(len(grads))):
        v = grads[j].meta[ir.VAL]
        cur, size = open_by_dtype.get(v.dtype, ([], 0))
        cur.append(j)
        size += v.numel() * v.element_size()
        if size >= bucket_bytes:
            buckets.append(cur)
            open_by_dtype.pop(v.dtype, None)
        else:
            open_by_dtype[v.dtype] = (cur, size)
    buckets.extend(cur for cur, _ in open_by_dtype.values())
    return buckets


def _emit(graph, target, args, kwargs=None):
    """A node of a gradient bucket's packing or communication (region comm)."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta[ir.REGION], node.meta[ir.MODULE], node.meta[ir.BUCKET] = ir.COMM, "", True
    return node


def _after_last(grads, order):
    """Where a bucket's collective goes: right after its last gradient is computed."""
    return max(grads, key=lambda n: order.get(n, len(order))).next


def _flat_bucket(graph, grads, multiple_of=1):
    """The gradients flattened into one vector (zero-padded to a multiple of `multiple_of`)."""
    flats = [_emit(graph, aten.reshape.default, (g, [-1])) for g in grads]
    flat = _emit(graph, aten.cat.default, (flats,)) if len(flats) > 1 else flats[0]
    pad = -sum(g.meta[ir.VAL].numel() for g in grads) % multiple_of
    if pad:
        flat = _emit(graph, aten.constant_pad_nd.default, (flat, [0, pad]))
    for n in (*flats, flat):
        n.meta[ir.SHARD] = (Partial("sum"),)
    return flat


def _all_reduce_bucket(graph, grads, group, order, out):
    with graph.inserting_before(_after_last(grads, order)):
        flat = _flat_bucket(graph, grads)
        started = _emit(graph, c10d.all_reduce.default, (flat, "sum", group))
        done = _emit(graph, c10d.wait_tensor.default, (started,))
    with graph.inserting_before(out):
        sizes = [g.meta[ir.VAL].numel() for g in grads]
        pieces = _emit(graph, aten.split_with_sizes.default, (done, sizes))
        result = []
        for k, g in enumerate(grads):
            piece = _emit(graph, operator.getitem, (pieces, k))
            r = _emit(graph, aten.view.default, (piece, list(g.meta[ir.VAL].shape)))
            r.meta[ir.SHARD] = (Replicate(),)
            result.append(r)
    started.meta[ir.SHARD], done.meta[ir.SHARD] = (Partial("sum"),), (Replicate(),)
    return result

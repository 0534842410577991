"""Tensor parallelism found on the graph: Megatron-style column -> row pairs, no module names.
(An MoE's grouped matmul by a stack of expert matrices is a linear of each expert alike.)

Why this way: peers need a plan per model (Megatron's layers, DTensor's `parallelize_module`
keyed by module names, DeepSpeed AutoTP's name rules). Here the plan is read off the ATen
graph. A linear (mm/addmm whose weight is a parameter) whose activation arrives replicated is
split column-wise (its output features sharded); one whose activation arrives sharded on the
features it contracts is split row-wise (its output is a partial sum). Whether a column
split pays off is checked by propagating the placements through the forward (DTensor's own
per-op rules, core/sharding.dry_run): if the sharded features reach an op that needs them
whole (a LayerNorm, a residual add, the loss) before a row partner contracts them, the
column split is dropped and that weight stays replicated. On a transformer block this finds
QKV -> attention (heads split) -> output projection, and up/gate -> down projection: two
all-reduces in the forward and two in the backward, as Megatron.

A projection whose output is split into pieces (nanoGPT's and GPT-2's fused QKV, litgpt's
grouped-query one with q wider than k and v) is rewritten first so each rank's contiguous
slice of the weight holds its share of every piece: the weight is stored interleaved (rank
r holds rows [q_r; k_r; v_r]) and the split becomes a split of each rank's block, which
DTensor's rules shard without communication. The runtime keeps
the weight in that layout (gm.meta[ir.TP_LAYOUTS]) and undoes it in full_state_dict().

Then core/sharding.shard_graph propagates the chosen placements through the whole joint
graph on the tp mesh and inserts the collectives; the gradients come out placed like their
weights (local shards), the loss and buffers replicated.
"""
from __future__ import annotations

import dataclasses
import operator
import warnings

import torch
import torch.fx

from fxpar.core import cost, ir
from fxpar.core.errors import PlanError, ShardingError
from fxpar.core.experts import GROUPED_MM
from fxpar.core.graphs import copy_graph, fake_propagate
from fxpar.core.sharding import (Partial, Replicate, Shard, dry_run, is_split, make_mesh,
                                     redistribute, row_dims, shard_graph)

aten = torch.ops.aten
_GROUPED = getattr(GROUPED_MM, "default", None)  # (the overload a graph holds)


@dataclasses.dataclass(eq=False)  # hashed by identity: one per matmul node
class Linear:
    """A matmul of activations by a parameter: nn.Linear's mm/addmm, or a grouped matmul
    of rows sorted by expert by a [experts, ...] stack of expert matrices (Hugging Face's
    and torchtitan's grouped experts: each expert's linear, split over tp alike)."""
    mm: torch.fx.Node           # aten.mm / aten.addmm / aten._grouped_mm in the forward
    weight: torch.fx.Node       # the weight's parameter placeholder
    act: torch.fx.Node          # the activation (mat1)
    transposed: bool            # weight stored [out, in] and read through t() (nn.Linear)
    bias: torch.fx.Node | None  # addmm's bias, if a parameter placeholder
    lead: int = 0               # 1 for a stack of expert matrices (dim 0: the expert)
    # the experts' own 2-D weights where the grouped matmul stacks them (listed experts run
    # grouped, passes/grouped_experts): each split alike; `weight` is the first
    stacked: tuple = ()

    @property
    def params(self) -> tuple:  # every parameter this linear's role places
        return self.stacked or (self.weight,)

    @property
    def out_dim(self) -> int:   # weight dim of the output features
        return self.lead + (0 if self.transposed else 1)

    @property
    def in_dim(self) -> int:    # weight dim contracted with the activation
        return self.lead + (1 if self.transposed else 0)

    @property
    def operand(self) -> torch.fx.Node:  # the matmul's weight argument
        return self.mm.args[1] if self.lead or self.stacked else self.mm.args[-1]


@dataclasses.dataclass
class Decision:
    """gm.meta[ir.TP_REPORT]: what the pass chose (for tests, viz and the report)."""
    tp: int
    column: list[str]           # weight names split by output features
    row: list[str]              # weight names split by input features
    replicated: list[str]       # linear weights left whole (no row partner found)
    interleaved: dict[str, object]  # weight/bias name -> its fused output's pieces (k, or
    #                                 their sizes where they differ)
    placements: dict[str, tuple]  # parameter name -> placements on the tp mesh
    gathered: list[str] = dataclasses.field(default_factory=list)  # column outputs all-gathered
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # whole weight -> why


def _decide(gm, options, ctx):
    """The pass's decisions, made on `gm` before any sharding: the fused projections
    rewritten for their split (meta["val"] refreshed), then each linear's role and each
    parameter's placement (Plan.tp_style)."""
    tp, group, sig = options.tp, ctx.group_names["tp"], ctx.signature
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {n: sig.param_names[i] for i, n in enumerate(phs[:sig.num_params])}
    linears = find_linears(gm, params)
    interleaved = {}  # placeholder -> (dim holding the fused pieces, the layout's pieces)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grads = list(out.args[0])[1:1 + sig.num_params]  # empty in a forward-only graph
    reads = {}
    for lin in linears:
        reads[lin.weight] = reads.get(lin.weight, 0) + 1
    for lin in linears:
        # (an RNN's gates, read once per time step: as they are, in the training and the
        # evaluation graph alike; a stack of experts' weights: passes/grouped_experts leaves
        # experts with fused pieces as traced under tp)
        if reads[lin.weight] > 1 or lin.stacked:
            continue
        # a weight (or bias) something else reads too - a tied table's lookup - would be read
        # in the interleaved layout there
        if not _read_only_by(lin) or (lin.bias is not None and not _bias_read_only_by(lin)):
            continue
        i = phs.index(lin.weight)
        kept = ctx.tp_layouts[i] if ctx.tp_layouts is not None else None
        if ctx.tp_layouts is not None and not (kept and ir.fused_pieces(kept[2])):
            continue  # (evaluate's graph: what training interleaved - it may find no backward
            #            to rewrite, a frozen weight's - and nothing else)
        k = _rewrite_fused_split(gm, lin, tp, grads[i] if i < len(grads) else None)
        if k:
            interleaved[lin.weight] = (lin.out_dim, k)
            if lin.bias is not None:
                interleaved[lin.bias] = (0, k)
    if interleaved:  # the rewritten nodes' meta["val"], once for all of them
        gm.recompile()
        fake_propagate(gm, check=False)

    mesh = make_mesh(tp)
    if options.tp_style == "all-gather":
        roles, placements, why = all_gather_placements(gm, linears, params, tp)
    else:
        roles, placements, why = choose_placements(gm, linears, params, mesh, group, tp)
        if options.tp_style == "auto":
            _gather_where_cheaper(roles, placements, tp, ctx)
    if ctx.tp_layouts is not None:
        roles, placements = _kept(ctx.tp_layouts, phs, linears, roles)
    return phs, params, linears, interleaved, mesh, roles, placements, why


def _kept(layouts, phs, linears, decided):
    """The roles and placements of given parameter layouts (the training graph's, for
    evaluate's forward-only graph, which alone may have decided other splits: the runtime
    holds the training program's shards). Any placement of the weights is valid: the
    sharding engine inserts what the activations then need."""
    placements = {phs[i]: (Shard(lay[0]),) for i, lay in enumerate(layouts)
                  if lay is not None and lay[0] is not None}
    roles = {}
    for lin in linears:
        pl = placements.get(lin.weight)
        role = "replicated" if pl is None else "column" if pl[0].dim == lin.out_dim else "row"
        # (a column split's gather after its matmul, where the graph decided it too)
        roles[lin] = decided.get(lin) if role == "column" and decided.get(lin, "").startswith(
            "column") else role
    return roles, placements


def roles(gm: torch.fx.GraphModule, sig: ir.GraphSignature, tp: int = 2,
          tp_style: str = "auto", device=None) -> dict[str, str]:
    """{linear weight name: "column" | "row" | "column+gather" | "replicated"}: what `run`
    would make of each linear at degree `tp`, decided on a copy of `gm` without sharding
    it (the planner prices these roles instead of finding pairs itself)."""
    copy = torch.fx.GraphModule(gm, copy_graph(gm.graph))
    ctx = _DecideContext(sig, {"tp": "tp"}, device)
    _, params, _, _, _, found, _, _ = _decide(copy, Options(tp=tp, tp_style=tp_style), ctx)
    return {params[p]: r for lin, r in found.items() for p in lin.params}


@dataclasses.dataclass(frozen=True)
class _DecideContext:  # what _decide reads of a PassContext (roles() runs without one)
    signature: ir.GraphSignature
    group_names: dict
    device: object = None
    profile: object = None
    tp_layouts: list | None = None


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    tp: int | None = 1
    tp_style: str = "auto"
    sequence_parallel: bool = False
    dp: int = 1  # (with cp: whether the batch rows are split too, see run)
    cp: int | None = 1


CONTRACT = ir.PassContract(
    "tensor_parallel", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.MODULE, ir.ROLE, ir.N_GRADS}),
    reads=frozenset({ir.RECOMPUTE}),
    provides=frozenset({ir.SHARD, ir.VOCAB_SHARD, ir.TP_LAYOUTS, ir.TP_REPORT}),
    # the split cuts the graph as captured, the one the planner partitions on its copy, so
    # its stages are the ones the planner priced; the collectives come after
    after=frozenset({"pipeline_split"}),
    applies=lambda o: (o.tp or 1) > 1,
    values_fresh=True)  # (run ends with graphs.fake_propagate)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    tp = options.tp
    if tp == 1:
        return gm
    group = ctx.group_names["tp"]
    sig = ctx.signature
    phs, params, linears, interleaved, mesh, roles, placements, why = _decide(gm, options, ctx)
    _check_divisible(placements, tp)
    prefer, gather = _residual_stream(gm, linears, roles, tp) if options.sequence_parallel \
        else (None, None)
    gathered = {lin.mm: (Replicate(),) for lin, r in roles.items() if r == "column+gather"}
    if gathered:
        prefer = {**(prefer or {}), **gathered}
    # the rows data parallelism splits after this pass are never split here too (a partial
    # sum reduce-scattered onto them, e.g. an MoE router's logits): two splits of one dim
    rows = row_dims(gm) if options.dp // (options.cp or 1) > 1 else None
    shard_graph(gm, mesh, {n.name: pl for n, pl in placements.items()}, [group],
                reduce_shared_partials=True, prefer=prefer, gather_first=gather,
                split_random_ops=True, rows=rows)
    _place_outputs(gm, placements, sig, group, tp)
    for n, pl in placements.items():  # parameter placeholders now hold local shards
        v = n.meta[ir.VAL]
        shape = list(v.shape)
        for p in pl:
            if isinstance(p, Shard):
                shape[p.dim] //= tp
        n.meta[ir.VAL] = v.new_empty(shape)
    fake_propagate(gm, check=False)

    layouts = gm.meta[ir.TP_LAYOUTS] = [None] * sig.num_params
    for n in set(placements) | set(interleaved):
        shard = next((p for p in placements.get(n, ()) if isinstance(p, Shard)), None)
        il_dim, pieces = interleaved.get(n, (None, 1))
        layouts[phs.index(n)] = (None if shard is None else shard.dim, il_dim, pieces)
    whole = list(dict.fromkeys(params[p] for lin, r in roles.items() if r == "replicated"
                               for p in lin.params))
    reasons = {params[p]: why[lin.weight] for lin in roles for p in lin.params
               if lin.weight in why and params[p] in whole}
    gm.meta[ir.TP_REPORT] = Decision(
        tp, [params[p] for lin, r in roles.items() if r.startswith("column") for p in lin.params],
        [params[p] for lin, r in roles.items() if r == "row" for p in lin.params], whole,
        {params[n]: k for n, (_, k) in interleaved.items()},
        {params[n]: pl for n, pl in placements.items()},
        [params[lin.weight] for lin, r in roles.items() if r == "column+gather"], reasons)
    n_weights = len({p for lin in roles for p in lin.params})
    if not roles or len(whole) == n_weights:
        warnings.warn(f"tp={tp}: no column->row linear pair was found in this model's graph, "
                      "so every tp rank computes the whole model (replication only)."
                      + _reason_lines(whole, reasons))
    elif whole:
        warnings.warn(
            f"tp={tp}: {len(whole)} of {n_weights} linear layers stay whole on every tp rank, "
            "computed redundantly (the tensor_parallel graph's meta['tensor_parallel'].reasons "
            "lists each):" + _reason_lines(whole, reasons))
    return gm


def _reason_lines(whole, reasons, most=10) -> str:
    lines = [f"\n  {w}: {reasons.get(w, 'no split was found for it')}" for w in whole[:most]]
    if len(whole) > most:
        lines.append(f"\n  ... and {len(whole) - most} more")
    return "".join(lines)


# --- finding the linears ------------------------------------------------------------------

def find_linears(gm: torch.fx.GraphModule, params: dict) -> list[Linear]:
    """Forward mm/addmm nodes whose weight is a 2-D parameter, and grouped matmuls of rows
    by a 3-D parameter (a stack of expert matrices, read as is or through a transpose of
    its last two dims), in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get(ir.REGION) != ir.FORWARD:
            continue
        lead = 0
        if n.target is aten.mm.default:
            act, w, bias = n.args[0], n.args[1], None
        elif n.target is aten.addmm.default and not n.kwargs:
            bias, act, w = n.args[0], n.args[1], n.args[2]
        elif n.target is _GROUPED and len(n.args) == 3 and not n.kwargs and \
                n.args[0].meta[ir.VAL].dim() == 2:  # (no bias, no out_dtype)
            act, w, bias, lead = n.args[0], n.args[1], None, 1
            lin = _stacked_linear(n, act, params)
            if lin is not None:
                out.append(lin)
                continue
        elif n.target is aten.bmm.default:  # every expert on every token (Llama 4's): the
            # tokens [experts, tokens, in] by a stack [experts, in, out], each expert's linear
            act, w, bias, lead = n.args[0], n.args[1], None, 1
        else:
            continue
        transposed = isinstance(w, torch.fx.Node) and (
            w.target is aten.t.default if not lead else _swaps_last_two(w))
        src = _uncast(w.args[0] if transposed else w)
        bias = _uncast(bias)
        if src in params and src.meta[ir.VAL].dim() == 2 + lead:
            out.append(Linear(n, src, act, transposed, bias if bias in params else None, lead))
    return out


def _stacked_linear(mm, act, params) -> Linear | None:
    """A grouped matmul by stack([t(w_0), t(w_1), ...]) of the experts' own 2-D weights (each
    read through t(), or each as is), all of one shape: one Linear placing all of them."""
    stack = mm.args[1]
    if not isinstance(stack, torch.fx.Node) or stack.target is not aten.stack.default or \
            (stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)) != 0:
        return None
    leaves = stack.args[0]
    transposed = {isinstance(x, torch.fx.Node) and x.target is aten.t.default for x in leaves}
    if len(transposed) != 1:
        return None
    t = transposed.pop()
    ws = [_uncast(x.args[0] if t else x) for x in leaves]
    if len(set(ws)) != len(ws) or not all(w in params and w.meta[ir.VAL].dim() == 2 for w in ws) \
            or len({tuple(w.meta[ir.VAL].shape) for w in ws}) != 1:
        return None
    return Linear(mm, ws[0], act, t, None, 0, tuple(ws))


def _swaps_last_two(node) -> bool:
    """node is a transpose of its input's last two dims."""
    if node.target is not aten.transpose.int:
        return False
    rank = node.args[0].meta[ir.VAL].dim()
    return sorted(d % rank for d in node.args[1:3]) == [rank - 2, rank - 1]


def _uncast(node):
    """The parameter behind a mixed-precision pass's dtype cast of it (passes/precision.py
    casts a weight once for its half-precision matmuls), else `node`."""
    if isinstance(node, torch.fx.Node) and node.target is aten._to_copy.default and \
            set(node.kwargs) == {"dtype"} and node.args[0].op == "placeholder":
        return node.args[0]
    return node


def _root(node):
    """The value `node` is a chain of views/transposes/transfers (and mixed-precision dtype
    casts) of (a transpose: of a matrix, or of each matrix of a stack)."""
    while isinstance(node, torch.fx.Node) and (node.target in (*ir.RESHAPES, aten.t.default) or (
            node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"}) or (
            node.target is aten.transpose.int and _swaps_last_two(node))):
        node = node.args[0]
    return node


# --- fused projections ----------------------------------------------------------------------

def _rewrite_fused_split(gm, lin: Linear, tp: int, grad_of_weight) -> int:
    """If lin's output is cut into pieces along its features (a fused QKV; a grouped-query
    one's q wider than its k and v), each a multiple of tp, by one split or by slices that
    partition the features (Phi-3's), rewrite the cut (and remat's recomputed copies of
    it) and its backward (the cat, or the sum of slice_backwards, the weight's gradient is
    computed from) for the interleaved layout; returns the layout's pieces
    (runtime/tp_slices: k equal pieces, or their sizes) or 0. The new nodes' meta["val"] is
    left to the caller's fake propagation."""
    graph = gm.graph
    found = _fused_pieces(lin)
    if found is None:
        return 0
    y, sizes, takers = found
    if len(sizes) < 2 or any(s % tp for s in sizes):
        return 0
    shape = list(y.meta[ir.VAL].shape)
    shares = [s // tp for s in sizes]  # (each rank's share of each piece)
    lead, k = shape[:-1], len(sizes)
    # the cut's backward: cat(grads of the pieces) or a sum of each piece's slice_backward,
    # which the weight's gradient reads
    has_backward = any(n.op == "call_function" and n.meta.get(ir.REGION) == ir.BACKWARD
                       for n in graph.nodes)
    if takers[0].target is aten.slice.Tensor:
        back = _slice_backwards(graph, shape, sizes, grad_of_weight)
    else:
        back = [n for n in graph.nodes if n.target is aten.cat.default
                and n.meta.get(ir.REGION) == ir.BACKWARD and len(n.args[0]) == k
                and (n.args[1] if len(n.args) > 1 else 0) % len(shape) == len(shape) - 1
                and n.meta.get(ir.VAL) is not None and list(n.meta[ir.VAL].shape) == shape
                and all(p.meta.get(ir.VAL) is not None and p.meta[ir.VAL].shape[-1] == w
                        for p, w in zip(n.args[0], sizes))
                and _feeds(n, grad_of_weight)][:1]
    if not back and has_backward:
        # e.g. an RNN's gates, whose weight is read once per time step and whose gradient
        # is a sum, not one cat: the weight is left as it is (a plain linear, which the
        # column check then keeps whole if its split cannot stay split)
        return 0

    def emit(target, args, region_meta, like=None):
        node = graph.call_function(target, args)
        node.meta.update(region_meta)
        node.meta[ir.VAL] = like
        return node

    # each cut of the projection's output - remat may recompute it in the backward - as a
    # split of each rank's block [.., tp, q_r; k_r; v_r] into the pieces' shares
    order = {n: i for i, n in enumerate(graph.nodes)}
    cuts: dict = {}  # the value cut -> [(its cutting node, the piece it takes: None = all)]
    for j, t in enumerate(takers):
        for n in [t, *(c for c in graph.nodes if c.target is t.target and c is not t
                       and c.args[1:] == t.args[1:] and c.meta.get(ir.RECOMPUTE)
                       and _reads_weight(c.args[0], lin.weight))]:
            cuts.setdefault(n.args[0], []).append((n, None if len(takers) == 1 else j))
    for x, nodes in cuts.items():
        first = min((n for n, _ in nodes), key=order.get)
        meta = {ir.MODULE: first.meta.get(ir.MODULE, ""), ir.REGION: first.meta.get(ir.REGION)}
        if first.meta.get(ir.RECOMPUTE):
            meta[ir.RECOMPUTE] = first.meta[ir.RECOMPUTE]
        with graph.inserting_before(first):
            v = emit(aten.view.default, (x, [*lead, tp, sum(shares)]), meta)
            parts = emit(aten.split_with_sizes.default, (v, shares, -1), meta)
            pieces = []
            for j in range(k):
                cont = emit(aten.clone.default, (emit(operator.getitem, (parts, j), meta),), meta)
                cont.kwargs = {"memory_format": torch.contiguous_format}
                pieces.append(emit(aten.view.default, (cont, [*lead, sizes[j]]), meta))
        for n, j in nodes:
            if j is None:  # (a split: each getitem takes its piece)
                for g in [u for u in n.users if u.target is operator.getitem]:
                    g.replace_all_uses_with(pieces[g.args[1]])
                    graph.erase_node(g)
            else:
                n.replace_all_uses_with(pieces[j])
            graph.erase_node(n)

    bmeta = {ir.MODULE: back[0].meta.get(ir.MODULE, "") if back else "", ir.REGION: ir.BACKWARD}
    if back and back[0].target is aten.cat.default:
        cat = back[0]
        with graph.inserting_before(cat):
            parts = [emit(aten.view.default, (p, [*lead, tp, c]), bmeta)
                     for p, c in zip(cat.args[0], shares)]
            flat = emit(aten.view.default, (emit(aten.cat.default, (parts, -1), bmeta),
                                            shape), bmeta)
        cat.replace_all_uses_with(flat)
        graph.erase_node(cat)
    elif back:  # each piece's gradient in its place of every rank's block, zeros elsewhere
        offsets = [sum(shares[:j]) for j in range(k)]
        for j, sb in enumerate(back):
            with graph.inserting_before(sb):
                g = emit(aten.view.default, (sb.args[0], [*lead, tp, shares[j]]), bmeta)
                padded = emit(aten.constant_pad_nd.default, (g, [
                    offsets[j], sum(shares) - offsets[j] - shares[j]], 0.0), bmeta)
                flat = emit(aten.view.default, (padded, shape), bmeta)
            sb.replace_all_uses_with(flat)
            graph.erase_node(sb)
    return k if len(set(sizes)) == 1 else tuple(sizes)


def _fused_pieces(lin: Linear):
    """(y, piece sizes, [the cutting nodes]) where lin's output y (its matmul or a view of it)
    is cut along its features, which it holds whole, by one split (one node) or by slices
    that partition them (a node per piece, in order), and read by nothing else in the
    forward; else None."""
    views = _views_of(lin.mm)
    readers = [u for v in views for u in v.users
               if u not in views and u.meta.get(ir.REGION) == ir.FORWARD]
    if not readers or any(not u.args or u.args[0] not in views for u in readers) or \
            len({u.args[0] for u in readers}) != 1:
        return None
    y = readers[0].args[0]
    shape = list(y.meta[ir.VAL].shape)
    # along the projection's features, whole: a view that regroups them first (CodeGen's
    # [B, T, groups, 3 * d], split in d within each group) cuts something else
    if shape[-1] != lin.mm.meta[ir.VAL].shape[-1]:
        return None
    last, n = len(shape) - 1, shape[-1]
    if len(readers) == 1 and readers[0].target in (aten.split.Tensor,
                                                   aten.split_with_sizes.default):
        split = readers[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim % len(shape) != last:
            return None
        if split.target is aten.split_with_sizes.default:
            return y, list(split.args[1]), [split]
        size = split.args[1]
        return (y, [size] * (n // size), [split]) if n % size == 0 else None
    cuts = []
    for u in readers:
        if u.target is not aten.slice.Tensor or u.kwargs:
            return None
        dim, start, end, step = (list(u.args[1:]) + [0, None, None, 1][len(u.args) - 1:])[:4]
        start, end = start or 0, n if end is None else min(end, n)
        if dim % len(shape) != last or step != 1 or start < 0 or end <= start:
            return None
        cuts.append((start, end, u))
    cuts.sort(key=lambda c: c[:2])
    if cuts[0][0] != 0 or cuts[-1][1] != n or any(
            a[1] != b[0] for a, b in zip(cuts, cuts[1:])):
        return None
    return y, [e - s for s, e, _ in cuts], [u for _, _, u in cuts]


def _slice_backwards(graph, shape, sizes, grad_of_weight) -> list:
    """The slice_backward of each piece (in order) whose sum the weight's gradient reads
    (the backward of slices that partition a projection's features), or []."""
    ranges = [(sum(sizes[:j]), sum(sizes[:j + 1])) for j in range(len(sizes))]

    def piece(n):  # the (start, end) n puts its gradient at, or None
        if n.target is not aten.slice_backward.default or list(n.args[1]) != shape or \
                n.args[2] % len(shape) != len(shape) - 1 or n.args[5] != 1:
            return None
        return n.args[3], min(n.args[4], shape[-1])
    for first in graph.nodes:  # (every layer's look alike: the one this weight's reads)
        if first.meta.get(ir.REGION) != ir.BACKWARD or piece(first) != ranges[0]:
            continue
        top = first  # up the sum's adds to the whole gradient
        while len(top.users) == 1 and next(iter(top.users)).target is aten.add.Tensor:
            top = next(iter(top.users))
        if not _feeds(top, grad_of_weight):
            continue
        terms, todo = [], [top]  # and down them to the terms summed
        while todo:
            n = todo.pop()
            if n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs:
                todo.extend(a for a in n.args if isinstance(a, torch.fx.Node))
            else:
                terms.append(n)
        by_piece = {piece(t): t for t in terms}
        if len(terms) == len(ranges) and sorted(by_piece, key=str) == sorted(ranges, key=str):
            return [by_piece[r] for r in ranges]
    return []


def _reads_weight(node, weight) -> bool:
    """node is (a view of) a matmul whose weight operand is (a transpose of) `weight`."""
    node = _root(node)
    if not isinstance(node, torch.fx.Node) or node.target not in (
            aten.mm.default, aten.addmm.default, _GROUPED, aten.bmm.default):
        return False
    return any(_root(a) is weight for a in node.args if isinstance(a, torch.fx.Node))


def _feeds(cat, grad) -> bool:
    """The weight's gradient output is (a view/transpose/transfer of) a matmul reading
    `cat` (directly or through views: with remat or pipeline cuts the activation it is
    multiplied with may be a recomputed or received copy, so the gradient is the anchor)."""
    if grad is None:
        return False
    if grad.target is aten.div.Tensor and isinstance(grad.args[1], torch.fx.Node) and \
            grad.args[1].meta[ir.VAL].dim() == 0:  # fp16: the gradient unscaled by the loss
        grad = grad.args[0]                      # scale (passes/precision.py)
    mm = _root(grad)  # (a grouped matmul's weight gradient: a grouped matmul too)
    return isinstance(mm, torch.fx.Node) and mm.target in (
        aten.mm.default, _GROUPED, aten.bmm.default) and any(
        _root(a) is cat for a in mm.args if isinstance(a, torch.fx.Node))


def _views_of(node):
    out, todo = [node], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.target in ir.RESHAPES:
                out.append(u)
                todo.append(u)
    return out


# --- choosing placements --------------------------------------------------------------------

def choose_placements(gm, linears, params, mesh, group, tp):
    """-> ({Linear: "column" | "row" | "replicated"}, {param placeholder: placements},
    {weight left whole: why, in words}).

    Embedding tables of token ids are split over the vocabulary (Shard(0): each rank looks
    up the ids it holds, one all-reduce of the result); a table tied to the LM head decides
    at its lookup, and the head then is a column split whose logits stay split through the
    vocab-parallel cross-entropy (core/vocab_parallel.py)."""
    by_mm = {lin.mm: lin for lin in linears}
    weight_uses = _weight_uses(gm, linears)
    lookups = _token_lookups(gm, params)
    for w, nodes in lookups.items():
        weight_uses.setdefault(w, set()).update(nodes)
    eligible = {w for w in weight_uses if all(u in weight_uses[w] for u in _forward_users(w))}
    failed: dict = {}  # weights whose split does not pay off -> why
    for _ in range(len(linears) + len(lookups) + 1):
        roles: dict[Linear, str] = {}
        decided: dict[torch.fx.Node, tuple] = {}
        why: dict[torch.fx.Node, str] = {}

        def decide(node, specs):
            if node.target is aten.embedding.default and node.args[0] in eligible and \
                    node.args[0] not in decided and node in lookups.get(node.args[0], ()):
                w = node.args[0]
                pl = (Replicate(),) if w in failed or not _splits(w, 0, tp) else (Shard(0),)
                if pl == (Replicate(),):
                    why[w] = failed.get(w) or _indivisible(w, 0, "rows", tp)
                decided[w] = pl
                return {w.name: pl}
            lin = by_mm.get(node)
            if lin is not None and lin.weight in decided and lin not in roles:
                pl = decided[lin.weight][0]
                roles[lin] = "column" if pl == Shard(lin.out_dim) else \
                    "row" if pl == Shard(lin.in_dim) else "replicated"
                return None
            if lin is not None and lin.weight not in decided:
                act = specs.get(lin.act)
                pl = act.placements[0] if act is not None else Replicate()
                last = lin.act.meta[ir.VAL].dim() - 1
                role, w = "replicated", Replicate()
                if any(p in decided for p in lin.params):
                    why[lin.weight] = "another matmul reads one of its experts' weights"
                elif not all(p in eligible for p in lin.params):
                    other = next(p for p in lin.params if p not in eligible)
                    why[lin.weight] = _other_use(other, weight_uses[other])
                elif isinstance(pl, Shard) and pl.dim == last:
                    if _splits(lin.weight, lin.in_dim, tp):
                        role, w = "row", Shard(lin.in_dim)
                    else:
                        why[lin.weight] = _indivisible(lin.weight, lin.in_dim, "input features",
                                                       tp)
                elif pl == Replicate():
                    if lin.weight in failed:
                        why[lin.weight] = failed[lin.weight]
                    elif _splits(lin.weight, lin.out_dim, tp):
                        role, w = "column", Shard(lin.out_dim)
                    else:
                        why[lin.weight] = _indivisible(lin.weight, lin.out_dim,
                                                       "output features", tp)
                else:
                    why[lin.weight] = f"its input arrives {pl} (not whole, nor split on the " \
                        "features it contracts)"
                roles[lin] = role
                new = [p for p in lin.params if p not in decided]
                for p in new:
                    decided[p] = (w,)
                return {p.name: (w,) for p in new}
            # any other forward use of a still-undecided weight: it stays whole
            return {a.name: (Replicate(),) for a in node.all_input_nodes
                    if a in eligible and a not in decided and node not in weight_uses[a]}

        pending = {w.name: None for w in eligible}  # placed when their matmul is reached
        try:
            specs, requests = dry_run(gm, mesh, pending, [group], decide=decide,
                                      reduce_shared_partials=True, split_random_ops=True)
        except ShardingError as e:
            raise PlanError(
                f"tp={tp} cannot split this model evenly: {e} Choose a tp that divides the "
                "number of attention heads (and of key/value heads), the hidden size and the "
                "MLP width.") from None
        new_failed = {w: text for w, text in _failed_columns(
            gm, linears, decided, specs, requests).items() if w not in failed}
        if not new_failed:
            break
        failed.update(new_failed)
    placements = {w: pl for w, pl in decided.items() if pl != (Replicate(),)}
    _mark_vocab_backward(gm, lookups, placements)
    # a bias (or any parameter) every forward use of which wants the same shard: store it so
    placements.update(_absorbed_shards(gm, params, placements, mesh, group))
    return roles, placements, why


def _indivisible(weight, dim, what, tp) -> str:
    return f"its {weight.meta[ir.VAL].shape[dim]} {what} do not divide by tp={tp}"


def _other_use(weight, uses) -> str:
    other = next((u for u in _forward_users(weight) if u not in uses), None)
    return "the forward also reads it outside its matmul" + (
        f" ({_op_name(other)} in '{other.meta.get(ir.MODULE, '')}')" if other is not None
        else "")


def _op_name(node) -> str:
    t = node.target
    return t.__name__.split(".")[0] if isinstance(t, torch._ops.OpOverload) else str(t)


# ops that need their input's features whole, and the words for why
_NEEDS_WHOLE = {
    "native_layer_norm": "a LayerNorm over the features",
    "_fused_rms_norm": "an RMSNorm over the features",
    "view": "a view that regroups the split features (e.g. heads or a width that tp does "
            "not divide, or one key/value head shared by every head)",
    "_unsafe_view": "a view that regroups the split features (e.g. heads or a width that tp "
                    "does not divide, or one key/value head shared by every head)",
    "add": "an add with a whole value (e.g. a residual)",
    "slice": "a slice across the split features",
    **{name: "attention whose key/value heads do not split like its query heads" for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")},
}


def _why_gathered(node, value) -> str:
    """Why a column split failed: the op that needed its split output whole."""
    head = "split by its output features, its output would be needed whole"
    at = node if node is not None else value
    if at is None:
        return head + " before a row split could contract it"
    name, where = _op_name(at), f"in '{at.meta.get(ir.MODULE, '')}'"
    what = f"{_NEEDS_WHOLE[name]} ({name} {where})" if name in _NEEDS_WHOLE else f"{name} {where}"
    return f"{head} by {what} before a row split could contract it"


def _splits(weight, dim, tp) -> bool:
    """Whether `weight` splits evenly over tp ranks along `dim` (else it stays whole: e.g. a
    classifier with 5 labels, GPT-2's 50257-token vocabulary)."""
    return weight.meta[ir.VAL].shape[dim] % tp == 0


def all_gather_placements(gm, linears, params, tp):
    """tp_style="all-gather": every linear split by output features, output gathered."""
    roles, placements, why = {}, {}, {}
    uses = _weight_uses(gm, linears)
    for lin in linears:
        w = lin.weight
        if lin.stacked:  # (experts' weights stacked for a grouped matmul: output gathered
            why[w] = "its experts' weights are stacked for a grouped matmul"  # per expert
        elif not all(u in uses[w] for u in _forward_users(w)):  # is not done here)
            why[w] = _other_use(w, uses[w])
        elif w.meta[ir.VAL].shape[lin.out_dim] % tp:
            why[w] = _indivisible(w, lin.out_dim, "output features", tp)
        elif placements.get(w, (Shard(lin.out_dim),)) != (Shard(lin.out_dim),):
            why[w] = "another matmul reads it split on another dim"
        ok = w not in why
        roles[lin] = "column+gather" if ok else "replicated"
        if ok:
            placements[w] = (Shard(lin.out_dim),)
            if lin.bias is not None:
                placements[lin.bias] = (Shard(0),)
    return roles, placements, why


def _gather_where_cheaper(roles, placements, tp, ctx):
    """tp_style="auto": a linear left whole (no row partner) is split by output features and
    its output all-gathered if the cost model says 1/tp of its FLOPs plus the gather beat
    computing it whole on every rank.

    Only a weight this linear alone reads: a weight with any other forward use (an input
    embedding tied to the head and looked up with ids the vocab-parallel lookup does not
    take, a second linear) was left whole because that use needs it whole, and splitting it
    here would hand that use a shard it reads as the whole table."""
    profile = ctx.profile or cost.DeviceProfile.for_device(ctx.device or "cpu")
    c10d = torch.ops._c10d_functional
    for lin, r in list(roles.items()):
        w = lin.weight
        if r != "replicated" or w in placements or lin.stacked or \
                w.meta[ir.VAL].shape[lin.out_dim] % tp:
            continue
        if not _read_only_by(lin):
            continue
        whole = cost.node_time(lin.mm, profile)
        split = whole / tp + cost.comm_time(c10d.all_gather_into_tensor.default,
                                            cost.tensor_bytes(lin.mm.meta[ir.VAL]), tp, profile)
        if split < whole:
            roles[lin] = "column+gather"
            placements[w] = (Shard(lin.out_dim),)
            if lin.bias is not None:
                placements[lin.bias] = (Shard(0),)


def _read_only_by(lin) -> bool:
    """Whether the forward reads lin's weight only through lin's matmul (its t() and dtype
    cast included, each of them read by nothing else in the forward)."""
    own = _weight_uses(None, [lin])[lin.weight]  # the mm, the t(), the cast
    todo, seen = [lin.weight], set()
    while todo:
        n = todo.pop()
        for u in _forward_users(n):
            if u not in own:
                return False
            if u is not lin.mm and u not in seen:
                seen.add(u)
                todo.append(u)
    return True


def _bias_read_only_by(lin) -> bool:
    """Whether the forward reads lin's bias only as its addmm's (through a dtype cast: the
    half-precision graph's)."""
    todo = [lin.bias]
    while todo:
        for u in _forward_users(todo.pop()):
            if u.target is aten._to_copy.default and set(u.kwargs) <= {"dtype", "layout",
                                                                      "device"}:
                todo.append(u)
            elif u is not lin.mm:
                return False
    return True


def _weight_uses(gm, linears):
    """Per weight: the forward nodes that read it as a linear's weight (the mm, its t())."""
    uses: dict = {}
    for lin in linears:
        s = uses.setdefault(lin.weight, set())
        s.add(lin.mm)
        w = lin.operand
        if lin.stacked:  # (each expert's weight: the stack, its t() and cast)
            for leaf, p in zip(w.args[0], lin.stacked):
                ps = uses.setdefault(p, set())
                ps.update({lin.mm, w, leaf})
                if lin.transposed and leaf.args[0] is not p:
                    ps.add(leaf.args[0])
                elif not lin.transposed and leaf is not p:
                    ps.add(leaf)
            continue
        if lin.transposed:
            s.add(w)
            w = w.args[0]
        if w is not lin.weight:  # its half-precision cast
            s.add(w)
    return uses


def _forward_users(n):
    return [u for u in n.users if u.meta.get(ir.REGION) == ir.FORWARD]


def _token_lookups(gm, params) -> dict:
    """Parameter -> its forward embedding lookups whose ids are (views of) a batch input."""
    out: dict = {}
    for n in gm.graph.nodes:
        # a padding_idx (BERT's, RoBERTa's tables) is fine: core/vocab_parallel.py keeps
        # its row's gradient at zero; scale_grad_by_freq / sparse backwards have no rule there
        if n.target is aten.embedding.default and n.meta.get(ir.REGION) == ir.FORWARD and \
                n.args[0] in params and not any(n.args[3:]) and not n.kwargs:
            ids = _root(n.args[1])
            if ids.op == "placeholder" and ids.meta.get(ir.ROLE) == "batch":
                out.setdefault(n.args[0], set()).add(n)
    return out


def _mark_vocab_backward(gm, lookups, placements):
    """The backward of a split table's lookup accumulates only this rank's rows."""
    for w, nodes in lookups.items():
        if placements.get(w) != (Shard(0),):
            continue
        ids = {_root(n.args[1]) for n in nodes}
        for n in gm.graph.nodes:
            if n.target is aten.embedding_dense_backward.default and \
                    _root(n.args[1]) in ids and n.args[2] == w.meta[ir.VAL].shape[0]:
                n.meta[ir.VOCAB_SHARD] = True


def _failed_columns(gm, linears, decided, specs, requests) -> dict:
    """Weights split by output features whose sharded output reaches an op that needs it
    gathered -> why (the first such op, in words)."""
    col = {lin.mm: lin.weight for lin in linears
           if decided.get(lin.weight) == (Shard(lin.out_dim),)}
    row = {lin.mm for lin in linears if decided.get(lin.weight) == (Shard(lin.in_dim),)}
    origin: dict[torch.fx.Node, set] = {}
    for n in gm.graph.nodes:
        if n not in specs or n.op != "call_function":
            continue
        if n in col:
            origin[n] = {col[n]}
        elif n not in row:
            o = set().union(*(origin.get(a, set()) for a in n.all_input_nodes))
            if o:
                origin[n] = o
    failed: dict = {}
    for node, value, have, need in requests:
        if any(is_split(h) for h in have) and have != need:
            for w in origin.get(value, ()):
                failed.setdefault(w, _why_gathered(node, value))
    return failed


def _absorbed_shards(gm, params, placements, mesh, group):
    """Parameters left replicated whose every forward use chunks them the same way (a column
    linear's bias): shard them at rest instead (1/tp of the memory, no chunking)."""
    specs, requests = dry_run(gm, mesh, {n.name: pl for n, pl in placements.items()}, [group],
                              reduce_shared_partials=True, split_random_ops=True)
    wants: dict = {}
    for node, value, have, need in requests:
        if value in params and value not in placements:
            wants.setdefault(value, []).append((node, need))
    out = {}
    for p, ws in wants.items():
        needs = {need for _, need in ws}
        users = {node for node, _ in ws}
        if len(needs) == 1 and isinstance(next(iter(needs))[0], Shard) and \
                users == set(_forward_users(p)):
            out[p] = next(iter(needs))
    return out


def _check_divisible(placements, tp):
    for n, pl in placements.items():
        for p in pl:
            if isinstance(p, Shard) and n.meta[ir.VAL].shape[p.dim] % tp:
                raise PlanError(
                    f"tp={tp} does not divide dimension {p.dim} (size "
                    f"{n.meta[ir.VAL].shape[p.dim]}) of parameter "
                    f"{n.meta.get('fqn', n.name)}: choose a tp that divides the hidden size, "
                    "the number of heads and the MLP width.")


def _residual_stream(gm, linears, roles, tp) -> tuple[dict, dict]:
    """Sequence parallelism: the residual adds (forward and backward) of the activations the
    column splits read, to be split over the sequence (dim 1 of [batch, seq, hidden]); and
    the flattening views that feed matmuls, where the sequence is gathered first."""
    shapes = set()
    for lin in linears:
        if roles.get(lin) == "column":
            src = lin.act.args[0] if lin.act.target in ir.RESHAPES else lin.act
            v = src.meta.get(ir.VAL)
            if isinstance(v, torch.Tensor) and v.dim() == 3 and v.shape[1] % tp == 0:
                shapes.add(tuple(v.shape))
    if not shapes:
        raise PlanError("Plan.sequence_parallel: no [batch, sequence, hidden] activation "
                        f"divisible by tp={tp} feeds the split matmuls of this model; use "
                        "sequence_parallel=False (or a sequence length divisible by tp).")
    prefer = {n: (Shard(1),) for n in gm.graph.nodes
              if n.target in (aten.add.Tensor, aten.embedding.default)
              and isinstance(n.meta.get(ir.VAL), torch.Tensor)
              and tuple(n.meta[ir.VAL].shape) in shapes}
    gather = {n: 1 for n in gm.graph.nodes if n.target in ir.RESHAPES and isinstance(
        n.args[0], torch.fx.Node) and isinstance(n.args[0].meta.get(ir.VAL), torch.Tensor)
        and tuple(n.args[0].meta[ir.VAL].shape) in shapes and n.meta[ir.VAL].dim() == 2}
    return prefer, gather


# --- outputs ---------------------------------------------------------------------------------

def _place_outputs(gm, placements, sig, group, tp):
    """Gradients placed like their weights (this rank's shard), loss and buffers whole."""
    graph = gm.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    n_g = out.meta.get(ir.N_GRADS, sig.num_params)
    phs = [n for n in graph.nodes if n.op == "placeholder"]

    def place(v, want):
        if not isinstance(v, torch.fx.Node):
            return v
        have = v.meta.get(ir.SHARD)
        if have is None or tuple(have) == tuple(want):
            return v
        with graph.inserting_before(out):
            r = redistribute(graph, v, have, want, [group], [tp],
                             {ir.MODULE: v.meta.get(ir.MODULE, ""), ir.REGION: ir.COMM})
        r.meta[ir.SHARD] = tuple(want)
        return r

    rep = (Replicate(),)
    new = [place(outs[0], rep)]
    for i, g in enumerate(outs[1:1 + n_g]):
        new.append(place(g, placements.get(phs[i], rep)))
    new += [place(b, rep) for b in outs[1 + n_g:]]
    out.args = (tuple(new),)
    # a Partial that was summed into a replicated value is not left anywhere
    for n in graph.nodes:
        if n.op == "output":
            for v in n.args[0]:
                if isinstance(v, torch.fx.Node) and any(
                        isinstance(p, Partial) for p in (v.meta.get(ir.SHARD) or ())):
                    raise ShardingError(f"fxpar bug: output {v.name} is still a partial sum")

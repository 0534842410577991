"""An MoE's token dispatch run on each data-parallel rank's own rows: a sharding rule.

An MoE layer sorts its (token, expert) pairs by expert, gathers each pair's token, runs the
experts as grouped matmuls over the sorted rows (`offs`: each expert's end row, from a
histogram of the expert ids) and scatters the results back to the tokens. DTensor has no
rule for a sort along a split dimension, so the sharding engine would make the routed rows
whole on every dp rank (each rank computing every rank's rows). Yet every step of the
dispatch is per pair: run on a rank's own pairs - its own sort, histogram and grouped
matmuls - it gives that rank's rows of the whole batch's result exactly, and the expert
weights' gradients (grouped matmuls summing over rows) are partial sums over the ranks, as
any weight gradient under dp is.

`analyze` proves that of a graph, op by op, by tracking each value's row order: a value's
rows are in the batch's order (G) or in a sort's order, and an integer value may hold row
positions (a pointer into an order). A sort makes both (sorted values; indices pointing
into G); an index with pointers into x's order reads x's rows in the pointers' order; an
index_put / scatter writes its source's rows to the pointers' positions; histograms and
their cumulative sums are partial counts; a grouped matmul needs rows in a sort's order and
counts from the same rank. Every other op must keep the rows where they are (pointwise,
transpose, view, split, select or reduce along other dims). A value in a sort's order, or a
pointer, may reach only ops so typed; a dispatch (the values connected through them) whose
ops all type, with at least one grouped matmul, is run locally by `rule`: rows split along
their row dim, counts and weight gradients partial, factories sized to the local rows.
Expert parallelism's all-to-all ops (core/experts.py) type too: the rows a dispatch receives
are in its route's own order, its combine's back in the order the dispatch read. Anything
else (a capacity computed over the sorted rows, expert parallelism's windows)
keeps DTensor's rules, and with them the gathered rows.

Under context parallelism the tokens a rank holds are its chunks of every sequence,
flattened behind the batch: a strided shard of the token rows (DTensor's _StridedShard, one
block per sequence). A dispatch whose tokens arrive so keeps them so (`row_blocks`): its
other row inputs are split the same way and its results leave in that layout, with no
token gathered. A dispatch whose tokens arrive otherwise under cp (whole, or split plainly
on a dim the dp pass splits too) keeps DTensor's rules, as before it was found.

Experts listed in an nn.ModuleList pick their rows with `torch.where(mask)`, which
compiler/padded_nonzero traces at mask.numel() positions (-1 where the mask is false) and
reads / writes through a copy with one zero row after the rows, listed in the mask's
memory order (a (k, tokens) view of a token-major tensor token by token). Made from a
rank's own mask rows, the positions along the listing's outermost dim are pointers into the
rank's own rows (the arange counting them made local, the other columns plain keys): a -1
then reads the rank's own pad row, so such a pointer may only index a value padded so, of as
many rows as the arange counted, and a write through it is cut back to the local rows. Such
a routing types with or without a grouped matmul after it.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import networkx
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fxpar.core import experts as _experts  # (registers fxpar::ep_*)
from fxpar.core import ir

_GROUPED_MM = _experts.GROUPED_MM

aten = torch.ops.aten
G = "G"  # the batch's own row order

_SORTS = {aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable}
_COUNTS = {aten.histc.default, aten.bincount.default}
_COUNT_CHAIN = {aten.cumsum.default, aten._to_copy.default, aten.clone.default,
                aten.alias.default, aten.view.default}  # (offs from counts: kept partial)
_COUNT_KEEP = {*_COUNT_CHAIN, aten.select.int, aten.sum.dim_IntList}
# expert parallelism's all-to-all dispatch (core/experts.py): rows sent to their experts'
# ranks come back as rows in an order of their own (the dispatch's), and its combine puts
# them back in the order the dispatch read
_EP_ROUTE = torch.ops.fxpar.ep_route.default
_EP_DISPATCH = torch.ops.fxpar.ep_dispatch.default
_EP_COMBINE = torch.ops.fxpar.ep_combine.default
RANK_ROWS_OPS = frozenset({_EP_ROUTE, _EP_DISPATCH, _EP_COMBINE})  # (no other rule)
_POINTER_KEEP = {aten.div.Tensor_mode, aten.floor_divide.default, aten._to_copy.default,
                 aten.clone.default, aten.alias.default}
_ELEMENTWISE = {aten._to_copy.default, aten.clone.default, aten.alias.default,
                aten.div.Tensor_mode, aten.floor_divide.default,
                torch.ops._c10d_functional.wait_tensor.default}
# tensor parallelism's sums inside an expert: element by element over the tp ranks, which
# hold the same rows (no other group's: ep's ranks hold different rows)
_TP_SUM = torch.ops._c10d_functional.all_reduce.default
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default}
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor}
_LOCAL_CHUNK = "fxpar::local_chunk"  # (by name: core/sharding registers it after importing this)
_SUMS = {aten.sum.dim_IntList}
_LIKE = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
         aten.full_like.default}
# factories a dispatch writes into (index_put's destination, arange's positions): their
# leading size is the rows', made local. (op -> index of the size argument, or of the end)
_FACTORIES = {aten.new_zeros.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1,
              aten.zeros.default: 0, aten.empty.memory_format: 0, aten.full.default: 0,
              aten.arange.default: 0, aten.arange.start: 1, aten.arange.start_step: 1}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_PUTS = {aten.index_put.default}
_SCATTERS = {aten.scatter_add.default, aten.scatter.src, aten.scatter_reduce.two}
_GATHERS = {aten.gather.default}
# torchtitan's scatter_add along dim 0 (dst, index, src), registered when torchtitan loads
_TITAN_SCATTER = "torchtitan::deterministic_scatter_add"


@dataclasses.dataclass(frozen=True)
class Tag:
    """What a dispatch value is: "rows" (row dim `dim`, in `order`, holding positions of
    `ptr`'s order if an index), "counts" (a rank's histogram: partial), "partial" (a sum
    over rows: partial) or "free" (a factory: local rows, any order)."""
    kind: str
    dim: int = 0
    order: object = G
    ptr: object = None
    pad: int = 0  # zero rows after the rows (compiler/padded_nonzero's: a -1 reads them)
    neg: bool = False  # a pointer that may hold -1: it reads / writes padded values only
    span: int | None = None  # a pointer from an arange: the (global) rows it points into
    cols: tuple | None = None  # (rows, columns) of pointers: each column's ptr (or None)


@dataclasses.dataclass
class Local:
    """How `rule` places one dispatch node: its output tag(s), the placement each input
    from outside the dispatch takes (rows split on a dim, or whole), and whether its
    leading size is resized to the local rows (a factory)."""
    out: object
    inputs: dict
    resize: bool = False
    view_dim: int | None = None  # a view's / expand's (slice_backward's) size argument to
    #                              make local there
    slice_end: bool = False  # a slice back to the rows of a padded value: its end made local


class _Untyped(Exception):
    """An op that cannot run on a rank's own rows (its dispatch keeps DTensor's rules)."""


def _val(n):
    return n.meta.get(ir.VAL) if isinstance(n, torch.fx.Node) else None


def _is_exit(t: Tag | None) -> bool:
    """A value back in the batch's order (or a partial sum): DTensor's rules take it on."""
    if isinstance(t, tuple):
        return False
    return t is None or t.kind == "partial" or (t.kind == "rows" and t.order == G
                                                and t.ptr is None and t.pad == 0
                                                and t.cols is None)


def analyze(gm: torch.fx.GraphModule, n: int, placed=None) -> dict[torch.fx.Node, Local]:
    """The nodes of every MoE dispatch on `gm` that runs on each of `n` ranks' own rows
    (see the module docstring), with how each is placed. Expert counts made outside a
    dispatch (torchtitan sums a one-hot of the routing over the batch) must be partial
    sums, i.e. each rank's own: `placed(nodes)` gives their placements under DTensor's
    rules ({node: placements}); without it such a dispatch is not run locally."""
    if _GROUPED_MM is None:
        return {}
    tags: dict = {}
    local: dict = {}
    parent: dict = {}
    bad: set = set()
    matmul_roots: set = set()
    outside: dict = {}  # expert counts made outside a dispatch -> the matmuls reading them

    def find(x):
        while parent.get(x, x) is not x:
            x = parent[x]
        return x

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra is not rb:
            parent[ra] = rb
            if ra in bad:
                bad.add(rb)
            if ra in matmul_roots:
                matmul_roots.add(rb)

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0] in tags:
            t = tags[node.args[0]]
            tags[node] = t[node.args[1]] if isinstance(t, tuple) else t
            parent.setdefault(node, node)
            union(node, node.args[0])
            continue
        ins = [a for a in node.all_input_nodes if a in tags]
        starts = node.target in _SORTS or node.target in _COUNTS or \
            node.target is _EP_ROUTE or _position_grid(node) == 0
        if not starts and all(_is_exit(tags[a]) for a in ins):
            continue
        try:
            entry = _type(node, tags)
        except _Untyped:  # a dispatch value reaches an op that cannot run on local rows
            parent.setdefault(node, node)
            for a in ins:
                union(node, a)
            bad.add(find(node))
            continue
        if entry is None:
            continue
        local[node] = entry
        tags[node] = entry.out
        parent.setdefault(node, node)
        for a in ins:
            union(node, a)
        for a, how in _made_local(entry):  # a factory the dispatch writes into, or a copy
            local[a] = how                       # of rows padded for it
            tags[a] = how.out
            parent.setdefault(a, a)
            union(node, a)
        if node.target in (_GROUPED_MM.default, aten.arange.default):  # (an arange typed:
            matmul_roots.add(find(node))                                 # a routing's positions)
        for a, how in entry.inputs.items():
            if how == "counts":  # offs made outside: its cumsum and casts run on local
                while a.target in _COUNT_CHAIN and a not in local:  # counts too
                    local[a] = Local(Tag("counts"), {})
                    tags[a] = local[a].out
                    parent.setdefault(a, a)
                    union(node, a)
                    a = a.args[0]
                outside.setdefault(a, set()).add(node)
    # every user of a value in a sort's order, of a pointer or of a factory is typed
    for node, entry in local.items():
        outs = entry.out if isinstance(entry.out, tuple) else (entry.out,)
        if all(_is_exit(t) or t.kind == "counts" for t in outs):
            continue
        users = list(node.users)
        for u in list(users):
            if u.target is operator.getitem:
                users.remove(u)
                users.extend(u.users)
        if any(u not in local and not _dtype_only(u, node) for u in users):
            bad.add(find(node))
    if outside:
        pl = placed(list(outside)) if placed is not None else {}
        for a, readers in outside.items():
            if tuple(pl.get(a) or ()) != (Partial("sum"),):
                bad.update(find(m) for m in readers)
    bad.update(find(x) for x, e in local.items() if not _splits(x, e, n))
    return {x: e for x, e in local.items() if find(x) in matmul_roots and find(x) not in bad}


def _made_local(entry: Local):
    """The inputs `entry` takes as made for it: a factory ("free": sized to the local
    rows), or a copy of rows with a zero row padded after them ("padded": the copy, and
    its source's factory, placed here)."""
    for a, how in entry.inputs.items():
        if how == "free":
            yield a, Local(Tag("free"), {}, resize=True)
        elif how == "padded":
            src = a.args[0]
            if src.target in _FACTORIES and src.target not in _ARANGES:
                yield src, Local(Tag("free"), {}, resize=True)
                yield a, Local(Tag("free", 0, pad=1), {})
            else:
                yield a, Local(Tag("rows", 0, G, pad=1), {src: 0})


def _position_grid(node) -> int | None:
    """How slowly the positions `node` counts vary in compiler/padded_nonzero's listing
    (0: the outermost dim of the mask's memory order, each value one block of positions),
    `node` an arange -> view -> expand -> reshape -> stack(cols, 1) -> where(mask,
    positions, -1) of a dim larger than 1; else None."""
    if node.op != "call_function" or node.target is not aten.arange.default:
        return None
    chain, shapes = node, []
    for op in (aten.view.default, aten.expand.default, aten.reshape.default):
        users = list(chain.users)
        if len(users) != 1 or users[0].target is not op:
            return None
        chain = users[0]
        shapes.append(list(chain.args[1]))
    own, grid = shapes[0], shapes[1]  # (the arange viewed along its dim; the whole grid)
    if own.count(1) != len(own) - 1:
        return None  # (a dim of size 1: no block of positions to own)
    j = next(i for i, s in enumerate(own) if s != 1)
    (stack,) = chain.users if len(chain.users) == 1 else (None,)
    if stack is None or stack.target is not aten.stack.default or stack.args[1:] != (1,):
        return None
    if not any(u.target is aten.where.ScalarOther and u.args[1] is stack and u.args[2] == -1
               for u in stack.users) or len(stack.users) != 1:
        return None
    return sum(1 for s in grid[:j] if s != 1)


def _dtype_only(user, x) -> bool:
    """`user` reads x for its dtype and device alone (new_zeros(x, size): a whole-size
    factory, e.g. tp's zeros chunked over the features before a backward index_add)."""
    return user.target in _FACTORIES and user.args[0] is x and x not in user.args[1:]


def _splits(node, entry, n) -> bool:
    """Every row dim of the node's values divides over the n ranks."""
    outs = entry.out if isinstance(entry.out, tuple) else (entry.out,)
    vals = _val(node) if isinstance(_val(node), (tuple, list)) else (_val(node),)
    for t, v in zip(outs, vals):
        if t.kind in ("rows", "free") and isinstance(v, torch.Tensor) and (
                v.dim() <= t.dim or (v.shape[t.dim] - t.pad) % n):
            return False
    for a, how in entry.inputs.items():
        if isinstance(how, int) and _val(a).shape[how] % n:
            return False
    return True


def _rows(tags, a) -> Tag | None:
    t = tags.get(a)
    if isinstance(t, Tag) and t.kind in ("rows", "free"):
        return t
    return None


def _type(node: torch.fx.Node, tags: dict) -> Local | None:
    """The Local of `node` given its inputs' tags, or None where it cannot run on a rank's
    own rows (raises _Untyped for the same)."""
    op, args = node.target, node.args
    out = _val(node)

    def tag(a):
        return tags.get(a) if isinstance(a, torch.fx.Node) else None

    if op in _SORTS:
        x = args[0]
        positional = op in (aten.sort.default, aten.argsort.default) and len(args) > 1
        dim = args[1] if positional else node.kwargs.get("dim", -1)
        t = tag(x)
        if t is not None and _val(x).dim() == 1 and dim in (0, -1) and _inverts(node, x, t):
            # a sort's permutation sorted again (ascending): its inverse, each position's
            # place in the sorted order (passes/grouped_experts puts rows back with it)
            inverse = Tag("rows", 0, G, t.order)
            return Local(inverse if op in (aten.argsort.default, aten.argsort.stable)
                         else (Tag("rows", 0, G, G), inverse), {})
        if _val(x).dim() != 1 or dim not in (0, -1) or (
                t is not None and not (t.kind == "rows" and t.order == G and t.ptr is None)):
            return None
        ins = {} if t is not None else {x: 0}
        values, indices = Tag("rows", 0, node), Tag("rows", 0, node, G)
        return Local(indices if op in (aten.argsort.default, aten.argsort.stable)
                     else (values, indices), ins)
    if op in _COUNTS:
        x = args[0]
        t = tag(x)
        if _val(x).dim() != 1 or (t is not None and (t.kind != "rows" or t.ptr is not None)):
            return None
        return Local(Tag("counts"), {} if t is not None else {x: 0})
    if op is aten.arange.default and _position_grid(node) == 0:
        # padded_nonzero's positions along the mask's first dim: a rank's own positions
        return Local(Tag("rows", 0, G, G, span=args[0]), {}, resize=True)
    if op in _FACTORIES:
        return None  # (reads a value for its dtype alone: typed by the op it feeds)
    ts = {a: tags[a] for a in node.all_input_nodes if a in tags}
    if op in (_EP_ROUTE, _EP_DISPATCH, _EP_COMBINE):
        return _expert_parallel(node, tags)
    if any(t.kind == "counts" for t in ts.values()):
        if _GROUPED_MM is not None and op is _GROUPED_MM.default:
            return _grouped_mm(node, tags)
        if op in _COUNT_KEEP and len(ts) == 1:
            return Local(Tag("counts"), {})
        if all(t.kind == "counts" for t in ts.values()):
            return None  # (a reader of the counts alone: DTensor's rules reduce them)
        raise _Untyped
    if _GROUPED_MM is not None and op is _GROUPED_MM.default:
        return _grouped_mm(node, tags)
    if op in _PADDED_OPS:
        return _PADDED_OPS[op](node, tags)
    if op in _LIKE:
        t = _rows(tags, args[0])
        return Local(Tag("free", t.dim), {}) if t is not None else None
    if op in _TRANSPOSES:
        t = _only_rows(ts)
        return Local(_moved(t, _transposed_dim(node, t.dim, _val(args[0]).dim())), {})
    if op in _VIEWS:
        t = _only_rows(ts)
        sized = op in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                       aten.expand.default)
        d = _view_dim(_val(args[0]).shape, t.dim, out.shape,
                      regroup=sized and op is not aten.expand.default)
        if d is None:
            raise _Untyped
        return Local(_moved(t, d), {}, view_dim=d if sized else None)
    chunk = getattr(op, "_name", None) == _LOCAL_CHUNK  # (a tp rank's features)
    if op is aten.slice.Tensor and len(ts) == 1 and next(iter(ts.values())).pad:
        return _cut(node, next(iter(ts.values())))
    if op in _SPLITS or chunk:
        t = _only_rows(ts)
        dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
        if op is aten.slice.Tensor or chunk:
            dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
        if dim % _val(args[0]).dim() == t.dim:
            raise _Untyped
        return Local(t, {})
    if op is aten.slice_backward.default:  # (a slice's gradient along another dim: GPT-OSS's
        t = _only_rows(ts)                   # gate and up, every other feature)
        if args[2] % len(args[1]) == t.dim:
            raise _Untyped
        return Local(t, {}, view_dim=t.dim)  # (its whole size: the local rows')
    if op is aten.select.int:  # (along another dim: tp's interleaved pieces of a row)
        t = _only_rows(ts)
        dim = args[1] % _val(args[0]).dim()
        if dim == t.dim:
            raise _Untyped
        return Local(_moved(t, t.dim - (dim < t.dim)), {})
    if op is aten.cat.default:
        xs, dim = args[0], args[1] if len(args) > 1 else 0
        got = [tags.get(x) for x in xs]
        if any(g is None or g.kind != "rows" or g.ptr is not None or g.pad or
               g.cols is not None for g in got) or len(
                {(g.order, g.dim) for g in got}) != 1 or dim % out.dim() == got[0].dim:
            raise _Untyped
        return Local(got[0], {})
    if op in _SUMS:
        t = _only_rows(ts)
        if t.ptr is not None:
            raise _Untyped
        dims = [d % _val(args[0]).dim() for d in (args[1] or range(_val(args[0]).dim()))]
        keep = len(args) > 2 and args[2] or node.kwargs.get("keepdim", False)
        if t.dim in dims:
            return Local(Tag("partial"), {})
        d = t.dim if keep else t.dim - sum(1 for x in dims if x < t.dim)
        return Local(_moved(t, d), {})
    if op is aten.index.Tensor:
        return _index(node, tags)
    if op is aten.index_select.default:
        return _read(node, tags, args[0], args[2], args[1])
    if op in _GATHERS:
        x, dim, idx = args[0], args[1], args[2]
        return _read(node, tags, x, idx, dim)
    if op in _PUTS:
        dst, (idx, *more), src = args[0], args[1], args[2]
        return _write(node, tags, dst, idx, src, more)
    if op in _SCATTERS:
        dst, dim, idx, src = args[:4]
        if dim % out.dim() != 0:
            raise _Untyped
        return _write(node, tags, dst, idx, src)
    if op is aten.index_add.default:  # (rows summed into zeros by key: a bias's gradient)
        dst, dim, idx, src = args[:4]
        alpha = args[4] if len(args) > 4 else node.kwargs.get("alpha", 1)
        ti = tags.get(idx)
        if dim % out.dim() != 0 or alpha != 1 or ti is None or ti.ptr is not None:
            raise _Untyped
        return _write(node, tags, dst, idx, src)
    if getattr(op, "_name", None) == _TITAN_SCATTER:
        return _write(node, tags, *args[:3])
    if op is _TP_SUM and args[2] == ir.GROUPS["tp"]:
        return _pointwise(node, tags)
    if op in _ELEMENTWISE or (isinstance(op, torch._ops.OpOverload)
                              and torch.Tag.pointwise in op.tags):
        return _pointwise(node, tags)
    raise _Untyped


# --- compiler/padded_nonzero's routing: `torch.where(mask)` at mask.numel() rows ----------
# Its positions (each mask position's indices, -1 where the mask is false) made from a
# rank's own mask rows point into that rank's own rows; the values they index carry one
# zero row after the rows (a -1 reads or writes it), cut away after a write.

def _stack(node, tags) -> Local:
    """Columns stacked (1-D rows side by side): the rows kept; a pointer among them
    (padded_nonzero's positions along the mask's first dim) remembered by column."""
    xs, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    got = [tags.get(x) for x in xs]
    typed = [t for t in got if t is not None]
    if dim % 2 != 1 or any(_val(x).dim() != 1 for x in xs) or any(
            t.kind != "rows" or t.pad or t.cols is not None or t.neg for t in typed) or \
            len({t.order for t in typed}) != 1 or sum(t.ptr is not None for t in typed) > 1:
        raise _Untyped
    order = typed[0].order
    if order != G and len(typed) < len(xs):
        raise _Untyped  # (batch-ordered columns beside sorted ones)
    ins = {x: 0 for x, t in zip(xs, got) if t is None}  # (a column of the rank's own rows)
    cols = tuple(t.ptr if t is not None else None for t in got)
    span = next((t.span for t in typed if t.ptr is not None), None)
    return Local(Tag("rows", 0, order, cols=cols if any(cols) else None, span=span), ins)


def _unbind(node, tags) -> Local:
    """Columns taken apart: each a pointer (or not) as its column was; or rows unbound
    along another dim."""
    x, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    t = tags.get(x)
    ndim = _val(x).dim()
    if t is None or t.kind != "rows" or t.pad or dim % ndim == t.dim:
        raise _Untyped
    if t.cols is not None:
        return Local(tuple(Tag("rows", 0, t.order, c, neg=t.neg and c is not None,
                               span=t.span if c is not None else None) for c in t.cols), {})
    if t.ptr is not None:
        raise _Untyped
    return Local(tuple(_moved(t, t.dim - (dim % ndim < t.dim))
                       for _ in range(_val(x).shape[dim])), {})


def _padded_positions(node, tags) -> Local | None:
    """where(mask, positions, -1): the pointers of the mask's true positions, -1 (a pad
    row) at the others; the mask a rank's own rows."""
    cond, x, other = node.args
    t = tags.get(x)
    if t is None or (t.ptr is None and t.cols is None):
        return _pointwise(node, tags)
    if other != -1 or t.kind != "rows" or t.pad or t.order != G:
        raise _Untyped
    tc = tags.get(cond)
    if tc is not None:
        if tc.kind != "rows" or tc.order != G or tc.ptr is not None or tc.pad or \
                tc.cols is not None or tc.dim != t.dim:
            raise _Untyped
        return Local(dataclasses.replace(t, neg=True), {})
    cv = _val(cond)
    if cv.dim() != _val(x).dim() or cv.shape[t.dim] != _val(x).shape[t.dim]:
        raise _Untyped
    return Local(dataclasses.replace(t, neg=True), {cond: t.dim})


def _pad(node, tags) -> Local:
    """A zero row padded after the rows (or pads along other dims: the rows kept)."""
    x, spec = node.args[0], list(node.args[1])
    t = tags.get(x)
    if t is None or t.kind not in ("rows", "free") or t.pad or t.cols is not None or \
            t.ptr is not None:
        raise _Untyped
    ndim = _val(x).dim()
    at = 2 * (ndim - 1 - t.dim)
    row = spec[at:at + 2] if at < len(spec) else [0, 0]
    if row == [0, 0]:
        return Local(t, {})
    if row != [0, 1] or t.dim != 0 or _row_pad(node) != 1:
        raise _Untyped
    return Local(dataclasses.replace(t, pad=1), {})


def _cut(node, t: Tag) -> Local:
    """A padded value sliced back to its rows (after a write through padded pointers)."""
    x, dim, start, end = (list(node.args) + [None] * 4)[:4]
    step = node.args[4] if len(node.args) > 4 else 1
    if dim % _val(x).dim() != t.dim or start not in (0, None) or step != 1 or \
            end != _val(x).shape[t.dim] - t.pad:
        raise _Untyped
    return Local(dataclasses.replace(t, pad=0), {}, slice_end=True)


_PADDED_OPS = {aten.stack.default: _stack, aten.unbind.int: _unbind,
               aten.where.ScalarOther: _padded_positions, aten.constant_pad_nd.default: _pad}


def _inverts(node, x, t: Tag) -> bool:
    """`node` sorts, ascending, the indices output of the sort that made order `t.order` (a
    permutation of the batch's rows: each row's position once)."""
    src = t.order
    descending = node.kwargs.get("descending", False) or (
        node.target in (aten.sort.default, aten.argsort.default) and len(node.args) > 2
        and node.args[2])
    return (t.kind == "rows" and t.ptr == G and isinstance(src, torch.fx.Node)
            and src.target in (aten.sort.default, aten.sort.stable)
            and x.target is operator.getitem and x.args == (src, 1) and not descending)


def _only_rows(ts: dict) -> Tag:
    if len(ts) != 1:
        raise _Untyped
    t = next(iter(ts.values()))
    if t.kind not in ("rows", "free") or t.pad or t.cols is not None:
        raise _Untyped
    return t


def _moved(t: Tag, d: int) -> Tag:
    return dataclasses.replace(t, dim=d)


def _transposed_dim(node, d: int, ndim: int) -> int:
    if node.target is aten.t.default:
        return 1 - d if ndim == 2 else d
    if node.target is aten.transpose.int:
        a, b = (x % ndim for x in node.args[1:3])
        return b if d == a else a if d == b else d
    perm = [x % ndim for x in node.args[1]]
    return perm.index(d)


def _view_dim(shape, d: int, out_shape, regroup: bool = False) -> int | None:
    """The dim of `out_shape` holding dim d of `shape` whole, with the same elements
    before it (a view that keeps the rows), else None. `regroup` (a view, not an expand):
    also the dim the rows lead, merged with the dims after them or split into dims (each
    rank's rows still one block of it)."""
    before = math.prod(shape[:d])
    acc = 1
    for e, size in enumerate(out_shape):
        if acc == before and size == shape[d]:
            return e
        if acc == before and regroup and (
                any(size == math.prod(shape[d:j]) for j in range(d + 2, len(shape) + 1)) or
                any(shape[d] == math.prod(out_shape[e:j])
                    for j in range(e + 2, len(out_shape) + 1))):
            return e
        acc *= size
    return None


def _pointwise(node, tags) -> Local:
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        raise _Untyped
    found, ins = [], {}
    for a in node.all_input_nodes:
        v = _val(a)
        t = tags.get(a)
        if t is not None:
            if t.kind not in ("rows", "free") or not isinstance(v, torch.Tensor) or t.pad \
                    or t.cols is not None:
                raise _Untyped
            found.append((t, t.dim + out.dim() - v.dim()))
    if not found:
        raise _Untyped
    dims = {d for _, d in found}
    orders = {t.order for t, _ in found if t.kind == "rows"}
    ptrs = {t.ptr for t, _ in found if t.kind == "rows"}
    if len(dims) != 1 or len(orders) > 1 or len(ptrs) > 1:
        raise _Untyped
    d = dims.pop()
    order = orders.pop() if orders else None
    ptr = ptrs.pop() if ptrs else None
    if ptr is not None and (node.target not in _POINTER_KEEP or any(
            isinstance(_val(a), torch.Tensor) and _val(a).dim() > 0
            for a in node.all_input_nodes if a not in tags)):
        raise _Untyped  # (arithmetic on row positions beyond pair -> token, by a number)
    rows = out.shape[d]
    for a in node.all_input_nodes:
        if a in tags:
            continue
        v = _val(a)
        if not isinstance(v, torch.Tensor):
            continue
        k = d - (out.dim() - v.dim())
        if k >= 0 and v.shape[k] == rows and rows != 1:
            if order not in (G, None):  # batch-ordered rows meeting sorted ones
                raise _Untyped
            ins[a] = k
        else:
            ins[a] = "whole"
    if order is None:
        return Local(Tag("free", d), ins)
    return Local(Tag("rows", d, order, ptr), ins)


def _index(node, tags) -> Local:
    x, indices = node.args[0], node.args[1]
    if not indices or any(i is None for i in indices):
        raise _Untyped
    return _read(node, tags, x, indices[0], 0, indices[1:])


def _read(node, tags, x, idx, dim, more=()) -> Local:
    """x's rows read at the positions `idx` holds (index, gather along dim 0; `more`:
    indices into x's next dims, one per row), or a parameter's rows looked up by each row's
    key (GPT-OSS's expert biases by expert id)."""
    ti, tx = tags.get(idx), tags.get(x)
    if dim % _val(x).dim() != 0 or ti is None or ti.kind != "rows" or ti.dim != 0 or \
            ti.cols is not None:
        raise _Untyped
    if ti.ptr is None:  # (keys, not row positions: the table whole, the rows the keys')
        if tx is not None or not _is_param(x) or more:
            raise _Untyped
        return Local(Tag("rows", 0, ti.order), {x: "whole"})
    ins = _pointed(x, tx, ti, more, tags)
    if more and tx is not None and tx.ptr is not None:
        raise _Untyped
    return Local(Tag("rows", 0, ti.order, tx.ptr if tx is not None else None), ins)


def _pointed(x, tx, ti: Tag, more, tags) -> dict:
    """The inputs x takes as the value pointer `ti` indexes (with `more` indices into its
    next dims): x's rows in the order ti points into, padded where ti holds -1, as many
    as the rows ti was counted over. {} if x is typed already."""
    ins = {}
    pad = tx.pad if tx is not None else 0
    if tx is None:
        if ti.ptr != G:
            raise _Untyped
        pad = _row_pad(x)
        ins[x] = "padded" if pad else 0
    elif tx.kind == "free":
        if tx.dim != 0:
            raise _Untyped
    elif tx.kind != "rows" or tx.dim != 0 or tx.order != ti.ptr or tx.cols is not None:
        raise _Untyped
    if (ti.neg and pad != 1) or (ti.span is not None and _val(x).shape[0] - pad != ti.span):
        raise _Untyped  # (a -1 would read a row of the rank's own, or rows counted otherwise)
    for k in more:  # (each row's index into a dim every rank holds whole)
        tk = tags.get(k) if isinstance(k, torch.fx.Node) else None
        if tk is None or tk.kind != "rows" or tk.dim != 0 or tk.order != ti.order or \
                tk.ptr is not None or tk.pad or tk.cols is not None:
            raise _Untyped
    return ins


def _row_pad(x) -> int:
    """1 where x is compiler/padded_nonzero's copy of a value with one zero row after its
    rows (constant_pad_nd padding dim 0 by (0, 1)), else 0."""
    if not isinstance(x, torch.fx.Node) or x.target is not aten.constant_pad_nd.default:
        return 0
    spec, ndim = list(x.args[1]), _val(x).dim()
    value = x.args[2] if len(x.args) > 2 else x.kwargs.get("value", 0)
    return int(len(spec) == 2 * ndim and spec[-2:] == [0, 1] and value == 0)


def _write(node, tags, dst, idx, src, more=()) -> Local:
    """src's rows written to the positions `idx` holds (index_put, scatter along dim 0;
    `more`: indices into dst's next dims), or summed into zeros by each row's key (a
    looked-up parameter's gradient: partial)."""
    ti = tags.get(idx) if isinstance(idx, torch.fx.Node) else None
    if ti is None or ti.kind != "rows" or ti.dim != 0 or ti.cols is not None:
        raise _Untyped
    if ti.ptr is None:  # (keys: each rank sums its own rows' into the zeros, as a weight's
        ts = tags.get(src) if isinstance(src, torch.fx.Node) else None  # gradient is)
        if more or not ((node.target is aten.index_add.default or
                         node.target is aten.index_put.default and _accumulates(node)) and
                        tags.get(dst) is None and _zeros(dst) and ts is not None and
                        ts.kind == "rows" and ts.dim == 0 and ts.order == ti.order and
                        ts.ptr is None):
            raise _Untyped
        return Local(Tag("partial"), {dst: "whole"})
    td = tags.get(dst)
    if td is None and dst.target in _FACTORIES and dst.target not in _ARANGES:
        if ti.neg:
            raise _Untyped
        ins = {dst: "free"}
    else:
        ins = _pointed(dst, td, ti, more, tags)
    pad = td.pad if td is not None else _row_pad(dst)
    ptr = None
    if isinstance(src, torch.fx.Node):
        ts, v = tags.get(src), _val(src)
        if ts is None and src.target in _ARANGES:
            if _arange_from_zero(src):
                ins[src] = "free"
                ptr = ti.order
            else:
                raise _Untyped
        elif ts is None:
            if v.dim() == 0 or v.shape[0] == 1:
                ins[src] = "whole"
            elif ti.order == G:
                ins[src] = 0
            else:
                raise _Untyped
        elif ts.kind != "rows" or ts.dim != 0 or ts.order != ti.order or ts.pad or \
                ts.cols is not None:
            raise _Untyped
        else:
            ptr = ts.ptr
    if more and ptr is not None:
        raise _Untyped
    return Local(Tag("rows", 0, ti.ptr, ptr, pad=pad), ins)


def _is_param(x) -> bool:
    """A parameter or buffer of the model, or a stack of them (passes/grouped_experts' of
    the experts' biases): the same whole tensor on every dp rank."""
    if isinstance(x, torch.fx.Node) and x.target is aten.stack.default:
        return all(_is_param(a) for a in x.args[0])
    return isinstance(x, torch.fx.Node) and x.op == "placeholder" and \
        x.meta.get(ir.ROLE) in ("param", "buffer")


def _accumulates(node) -> bool:
    """An index_put that adds to its destination (accumulate=True)."""
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))


def _zeros(n) -> bool:
    """n is a factory of zeros."""
    if not isinstance(n, torch.fx.Node):
        return False
    if n.target in (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default):
        return True
    fill = n.args[2] if n.target is aten.new_full.default else n.args[1] \
        if n.target in (aten.full.default, aten.full_like.default) else None
    return fill == 0 and fill is not None


def _arange_from_zero(n) -> bool:
    a = n.args
    if n.target is aten.arange.default:
        return True
    start = a[0]
    step = a[2] if len(a) > 2 else n.kwargs.get("step", 1)
    return start == 0 and step == 1


def _expert_parallel(node, tags) -> Local:
    op, (x, route) = node.target, node.args[:2]
    tx, tr = tags.get(x), tags.get(route)
    if op is _EP_ROUTE:  # (offs made outside a dispatch: checked partial, as a matmul's)
        if tx is not None and tx.kind != "counts":
            raise _Untyped
        return Local(Tag("counts"), {} if tx is not None else {x: "counts"})
    if tr is None or tr.kind != "counts" or tx is None or tx.kind != "rows" or \
            tx.dim != 0 or tx.ptr is not None or tx.order == G:
        raise _Untyped
    if op is _EP_DISPATCH:  # the route's order (each dispatch on a route sends alike), which
        # remembers the one it read
        return Local(Tag("rows", 0, ("dispatched", route, tx.order)), {})
    if not (isinstance(tx.order, tuple) and tx.order[0] == "dispatched"):
        raise _Untyped
    return Local(Tag("rows", 0, tx.order[2]), {})  # (the combine: back in the order read)


def _grouped_mm(node, tags) -> Local:
    a, b = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    to = tags.get(offs)
    if not isinstance(offs, torch.fx.Node) or (to is not None and to.kind != "counts"):
        raise _Untyped
    ins = {} if to is not None else {offs: "counts"}  # (made outside: checked partial)
    ta, tb = tags.get(a), tags.get(b)
    if ta is None or ta.kind != "rows" or ta.order == G or ta.ptr is not None:
        raise _Untyped
    if tb is None and _val(b).dim() == 3 and ta.dim == 0:
        return Local(Tag("rows", 0, ta.order), {**ins, b: "whole"})
    if tb is not None and tb.kind == "rows" and tb.order == ta.order and ta.dim == 1 \
            and tb.dim == 0 and tb.ptr is None:
        return Local(Tag("partial"), ins)
    raise _Untyped


# --- the sharding rule ------------------------------------------------------------------

def _split(dim: int, blocks: int | None):
    return Shard(dim) if blocks in (None, 1) else _StridedShard(dim, split_factor=blocks)


def _placement(t: Tag, blocks: int | None):
    return Partial("sum") if t.kind in ("counts", "partial") else _split(t.dim, blocks)


def components(local: dict) -> dict:
    """{node: its dispatch (the frozenset of its nodes)}: the nodes `analyze` found, joined
    by the values they pass each other (a forward and its backward are one dispatch: the
    backward reads the forward's sort)."""
    g = networkx.Graph()
    g.add_nodes_from(local)
    for n in local:
        for a in n.all_input_nodes:
            a = a.args[0] if a.target is operator.getitem else a
            if a in local:
                g.add_edge(n, a)
    return {n: c for c in map(frozenset, networkx.connected_components(g)) for n in c}


def defer_tokenless_nodes(graph: torch.fx.Graph, local: dict) -> None:
    """Move each dispatch node that reads nothing made from the batch (an arange's positions,
    a routing's column keys, their views and stacks) to just before its first user, so that
    a dispatch's first node placed reads its tokens and `row_blocks` decides on them (litgpt's
    Mixtral's second layer stacked its positions before its tokens arrived, and kept
    DTensor's rules)."""
    tokens: set = set()
    for n in graph.nodes:
        if n.op == "placeholder" and n.meta.get(ir.ROLE) == "batch" or \
                any(a in tokens for a in n.all_input_nodes):
            tokens.add(n)
    for n in reversed(list(graph.nodes)):
        if n in local and n not in tokens and n.users and not n.is_impure() and not (
                isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            # (fx keeps each node's _sort_key in graph order as nodes move)
            min(n.users, key=lambda u: u._sort_key).prepend(n)


def row_blocks(sh, node) -> int | None:
    """How the dispatch's rows are split, one way for all of its nodes (fixed at its first):
    plainly (None), or in blocks (context parallelism: the sequence split flattened behind
    the batch, a strided shard of `blocks` blocks, each token's pairs inside its token's
    place) where the row inputs from outside that arrive split so (the tokens it gathers)
    agree, so that those stay where they are and its results leave in the layout they came
    in. Every other row input is then split the same way (a whole one cut, a plain one
    moved). Under cp a dispatch runs locally only so (core/sharding: else DTensor's rules);
    with one row in the batch (`sh.one_row`: a sequence flattened is a plain shard of its
    tokens) a plain split is one block."""
    comp = sh.local_components.get(node)
    if comp not in sh.row_blocks:
        kind = (_StridedShard, Shard) if sh.one_row else _StridedShard
        factors = {getattr(p, "split_factor", 1) for n in comp
                   for a, how in sh.local[n].inputs.items()
                   if isinstance(how, int) and not isinstance(how, bool)
                   and isinstance(p := getattr(sh.specs.get(a), "placements", (None,))[0],
                                  kind) and p.dim == how}
        # (rows in blocks of different sizes: all split plainly, as dp splits them)
        sh.row_blocks[comp] = factors.pop() if len(factors) == 1 else None
    return sh.row_blocks[comp]


def rule(sh, node, entry: Local):
    """Place `node` of a local dispatch (sh: core/sharding's _Sharder on a 1-D mesh): its
    inputs from outside the dispatch split on their row dim (whole for weights), its
    output(s) as tagged, a factory sized to the local rows."""
    want = {}
    blocks = row_blocks(sh, node)
    for a, how in entry.inputs.items():
        if how in ("free", "counts", "padded"):  # (a factory: resized, a padded copy: placed
            continue                             # itself; counts: partial already)
        want[a] = (Replicate(),) if how == "whole" else (_split(how, blocks),)
    sh.place(node, want)
    if entry.resize:
        _resize(node, sh.mesh_sizes[0])
    if entry.slice_end:
        node.args = (*node.args[:3], node.args[3] // sh.mesh_sizes[0], *node.args[4:])
    if entry.view_dim is not None and node.args[1][entry.view_dim] != -1:
        size = list(node.args[1])
        size[entry.view_dim] //= sh.mesh_sizes[0]
        node.args = (node.args[0], size, *node.args[2:])
    val = node.meta.get(ir.VAL)
    if isinstance(entry.out, tuple):
        return tuple(sh.out_spec((_placement(t, blocks),), v) for t, v in zip(entry.out, val))
    return sh.out_spec((_placement(entry.out, blocks),), val)


def _resize(node, n: int) -> None:
    """A factory's leading size (or arange's end) divided by n: the local rows."""
    at = _FACTORIES[node.target]
    args = list(node.args)
    if node.target in _ARANGES:
        args[at] = args[at] // n
    else:
        size = list(args[at])
        size[0] = size[0] // n
        args[at] = size
    node.args = tuple(args)

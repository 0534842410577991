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
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard

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


class _Untyped(Exception):
    """An op that cannot run on a rank's own rows (its dispatch keeps DTensor's rules)."""


def _val(n):
    return n.meta.get(ir.VAL) if isinstance(n, torch.fx.Node) else None


def _is_exit(t: Tag | None) -> bool:
    """A value back in the batch's order (or a partial sum): DTensor's rules take it on."""
    if isinstance(t, tuple):
        return False
    return t is None or t.kind == "partial" or (t.kind == "rows" and t.order == G
                                                and t.ptr is None)


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
        starts = node.target in _SORTS or node.target in _COUNTS or node.target is _EP_ROUTE
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
        for a, how in entry.inputs.items():  # a factory the dispatch writes into
            if how == "free":
                local[a] = Local(Tag("free"), {}, resize=True)
                tags[a] = local[a].out
                parent.setdefault(a, a)
                union(node, a)
        if node.target is _GROUPED_MM.default:
            matmul_roots.add(find(node))
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
                v.dim() <= t.dim or v.shape[t.dim] % n):
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
    if op in _LIKE:
        t = _rows(tags, args[0])
        return Local(Tag("free", t.dim), {}) if t is not None else None
    if op in _TRANSPOSES:
        t = _only_rows(ts)
        return Local(_moved(t, _transposed_dim(node, t.dim, _val(args[0]).dim())), {})
    if op in _VIEWS:
        t = _only_rows(ts)
        d = _view_dim(_val(args[0]).shape, t.dim, out.shape)
        if d is None:
            raise _Untyped
        sized = op in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                       aten.expand.default)
        return Local(_moved(t, d), {}, view_dim=d if sized else None)
    chunk = getattr(op, "_name", None) == _LOCAL_CHUNK  # (a tp rank's features)
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
        if any(g is None or g.kind != "rows" or g.ptr is not None for g in got) or len(
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
        if more:
            raise _Untyped
        return _write(node, tags, dst, idx, src)
    if op in _SCATTERS:
        dst, dim, idx, src = args[:4]
        if dim % out.dim() != 0:
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
    if t.kind not in ("rows", "free"):
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


def _view_dim(shape, d: int, out_shape) -> int | None:
    """The dim of `out_shape` holding dim d of `shape` whole, with the same elements
    before it (a view that keeps the rows), else None."""
    before = math.prod(shape[:d])
    acc = 1
    for e, size in enumerate(out_shape):
        if acc == before and size == shape[d]:
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
            if t.kind not in ("rows", "free") or not isinstance(v, torch.Tensor):
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
    if len(indices) != 1 or indices[0] is None:
        raise _Untyped
    return _read(node, tags, x, indices[0], 0)


def _read(node, tags, x, idx, dim) -> Local:
    """x's rows read at the positions `idx` holds (index, gather along dim 0), or a
    parameter's rows looked up by each row's key (GPT-OSS's expert biases by expert id)."""
    ti, tx = tags.get(idx), tags.get(x)
    if dim % _val(x).dim() != 0 or ti is None or ti.kind != "rows" or ti.dim != 0:
        raise _Untyped
    if ti.ptr is None:  # (keys, not row positions: the table whole, the rows the keys')
        if tx is not None or not _is_param(x):
            raise _Untyped
        return Local(Tag("rows", 0, ti.order), {x: "whole"})
    ins = {}
    if tx is None:
        if ti.ptr != G:
            raise _Untyped
        ins[x] = 0
    elif tx.kind != "rows" or tx.dim != 0 or tx.order != ti.ptr:
        raise _Untyped
    return Local(Tag("rows", 0, ti.order, tx.ptr if tx is not None else None), ins)


def _write(node, tags, dst, idx, src) -> Local:
    """src's rows written to the positions `idx` holds (index_put, scatter along dim 0), or
    summed into zeros by each row's key (a looked-up parameter's gradient: partial)."""
    ti = tags.get(idx) if isinstance(idx, torch.fx.Node) else None
    if ti is None or ti.kind != "rows" or ti.dim != 0:
        raise _Untyped
    if ti.ptr is None:  # (keys: each rank sums its own rows' into the zeros, as a weight's
        ts = tags.get(src) if isinstance(src, torch.fx.Node) else None  # gradient is)
        if not (node.target is aten.index_put.default and _accumulates(node) and
                tags.get(dst) is None and _zeros(dst) and ts is not None and
                ts.kind == "rows" and ts.dim == 0 and ts.order == ti.order and ts.ptr is None):
            raise _Untyped
        return Local(Tag("partial"), {dst: "whole"})
    ins = {}
    td = tags.get(dst)
    if td is None:
        if dst.target in _FACTORIES and dst.target not in _ARANGES:
            ins[dst] = "free"
        elif ti.ptr == G:
            ins[dst] = 0
        else:
            raise _Untyped
    elif not (td.kind == "free" or (td.kind == "rows" and td.dim == 0 and td.order == ti.ptr)):
        raise _Untyped
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
        elif ts.kind != "rows" or ts.dim != 0 or ts.order != ti.order:
            raise _Untyped
        else:
            ptr = ts.ptr
    return Local(Tag("rows", 0, ti.ptr, ptr), ins)


def _is_param(x) -> bool:
    """A parameter or buffer of the model (the same whole tensor on every dp rank)."""
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

def _placement(t: Tag):
    return Partial("sum") if t.kind in ("counts", "partial") else Shard(t.dim)


def rule(sh, node, entry: Local):
    """Place `node` of a local dispatch (sh: core/sharding's _Sharder on a 1-D mesh): its
    inputs from outside the dispatch split on their row dim (whole for weights), its
    output(s) as tagged, a factory sized to the local rows."""
    want = {}
    for a, how in entry.inputs.items():
        if how in ("free", "counts"):  # (a factory: resized; counts: partial already)
            continue
        want[a] = (Replicate(),) if how == "whole" else (Shard(how),)
    sh.place(node, want)
    if entry.resize:
        _resize(node, sh.mesh_sizes[0])
    if entry.view_dim is not None and node.args[1][entry.view_dim] != -1:
        size = list(node.args[1])
        size[entry.view_dim] //= sh.mesh_sizes[0]
        node.args = (node.args[0], size, *node.args[2:])
    val = node.meta.get(ir.VAL)
    if isinstance(entry.out, tuple):
        return tuple(sh.out_spec((_placement(t),), v) for t, v in zip(entry.out, val))
    return sh.out_spec((_placement(entry.out),), val)


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

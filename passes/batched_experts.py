"""Experts that pick a copy of their weights for every row, run as grouped matmuls.

Hugging Face's 'batched_mm' experts (`config._experts_implementation = "batched_mm"`)
multiply each routed (token, k) row by its expert's matrix picked for that row,
`bmm(W[expert_ids], x.unsqueeze(-1))`: a copy of an expert's matrix per row, rows x out x in
elements per projection, forward and backward (the backward sums one outer product per row
into W's gradient with `index_put(..., accumulate=True)`). The same function as their
grouped form. This pass finds those products on the joint graph - a 3-D weight indexed by
one row's expert ids, read only by batched matrix-vector products and summed back by
index_put - and writes each layer as Hugging Face's grouped experts compute it: the rows
sorted by expert once (a stable sort of the ids; `offs`, each expert's end row, from their
histogram), each product an `aten._grouped_mm` reading W itself, each weight gradient one
grouped matmul over the sorted rows; the row-wise ops between the products run on the
sorted rows (a bias picked per row added there, picked by the sorted ids), and the rows
leave in their own order. The copies are gone; the FLOPs are the same. tp splits and ep
distributes the experts as it does Hugging Face's grouped ones. Values: the batched form's
up to the order of float sums (a grouped matmul's kernel for each row's products; an
expert's weight gradient summed over its rows by a matmul where index_put added them one
by one).

Left as traced (the reason kept in gm.meta[ir.BATCHED_EXPERTS], logged): a picked weight
read other than by a matrix-vector product, a weight gradient not summed back to W by its
ids, feature sizes `_grouped_mm` cannot take, and on CUDA a precision other than bf16 (as
passes/grouped_experts: torch runs other grouped matmuls group by group).
"""
from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx
from torch._inductor.pattern_matcher import stable_topological_sort

from fxpar.core import ir
from fxpar.core.expert_lists import between, param_behind, row_inputs, val
from fxpar.core.experts import GROUPED_MM, why_not_grouped_on
from fxpar.core.graphs import copy_graph, fake_propagate, fake_run

aten = torch.ops.aten
log = logging.getLogger("fxpar.batched_experts")


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    precision: str = "fp32"


CONTRACT = ir.PassContract(
    "batched_experts", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.ROLE}),
    provides=frozenset({ir.BATCHED_EXPERTS}),
    # on the graph as captured: every later pass sees Hugging Face's grouped form (and
    # before grouped_experts, which rewrites other experts: one order for every plan)
    before=frozenset({"grouped_experts", "pipeline_split", "precision", "remat",
                      "tensor_parallel", "expert_parallel", "data_parallel"}),
    applies=lambda o: GROUPED_MM is not None,
    finds=lambda gm: bool(find(gm)),
    values_fresh=True)


@dataclasses.dataclass
class Picked:
    """One layer: the experts' ids of its rows, and the weights they pick ([E, a, b])."""
    ids: torch.fx.Node
    picks: list
    module: str

    @property
    def rows(self) -> int:
        return val(self.ids).shape[0]

    @property
    def experts(self) -> int:
        return val(self.picks[0].args[0]).shape[0]


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    layers = find(gm)
    why = why_not_grouped_on(getattr(ctx, "device", None), options.precision)
    if why:
        gm.meta[ir.BATCHED_EXPERTS] = [_entry(x, why) for x in layers]
        log.info("batched_experts: experts left picked per row: %s", why)
        return gm
    report = [_entry(layer, why_not(layer)) for layer in layers]
    for r in report:
        if r["why"]:
            log.info("batched_experts: %r picks its experts' weights per row: %s",
                     r["module"], r["why"])
    if not any(r["grouped"] for r in report):
        gm.meta[ir.BATCHED_EXPERTS] = report
        return gm
    work = torch.fx.GraphModule(gm, copy_graph(gm.graph))  # (gm stays whole if this fails)
    work.meta = dict(gm.meta)
    try:
        mine = find(work)  # (the copy's nodes, in the same order)
        folds = [_rewrite(work.graph, layer) for layer, r in zip(mine, report) if r["grouped"]]
        stable_topological_sort(work.graph)  # (each sort was put after what it sorts)
        work.graph.eliminate_dead_code()  # (the products and picks replaced)
        for fold in folds:
            _fold(work.graph, *fold)
        stable_topological_sort(work.graph)
        work.graph.eliminate_dead_code()
        work.graph.lint()
        work.recompile()
        fake_propagate(work, check=False)
    except Exception as e:  # noqa: BLE001 - fxpar's own rewrite failed: run as traced
        log.warning("batched_experts: grouping the experts failed (%s: %s); they run as "
                    "traced (a copy of an expert matrix per row). Please report this model "
                    "to fxpar.", type(e).__name__, e)
        gm.meta[ir.BATCHED_EXPERTS] = [{**r, "grouped": False, "why": r["why"] or
                                        f"{type(e).__name__}: {e}"} for r in report]
        return gm
    work.meta[ir.BATCHED_EXPERTS] = report
    return work


def _entry(layer: Picked, why: str | None) -> dict:
    return {"module": layer.module, "experts": layer.experts, "rows": layer.rows,
            "grouped": why is None, "why": why}


# --- finding the layers ----------------------------------------------------------------

def find(gm: torch.fx.GraphModule) -> list[Picked]:
    """Each set of 3-D parameters picked row by row with one index tensor, `W[ids]`."""
    by_ids: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.index.Tensor or \
                len(n.args[1]) != 1 or not isinstance(n.args[1][0], torch.fx.Node):
            continue
        w, ids = n.args[0], n.args[1][0]
        vw, vi = val(w), val(ids)
        if isinstance(vw, torch.Tensor) and vw.dim() == 3 and isinstance(vi, torch.Tensor) \
                and vi.dim() == 1 and vi.dtype in (torch.int64, torch.int32) and \
                param_behind(w) is not None:
            by_ids.setdefault(ids, []).append(n)
    return [Picked(ids, picks, picks[0].meta.get(ir.MODULE, "")) for ids, picks in
            by_ids.items()]


def _vector(v: torch.fx.Node, rows: int) -> bool:
    """`v` is [rows, k, 1] or [rows, 1, k]: one vector a row."""
    s = tuple(val(v).shape)
    return len(s) == 3 and s[0] == rows and 1 in s[1:]


def _products(layer: Picked) -> tuple[list, list] | str:
    """([(bmm, matrix operand position, transposed?, pick)], [(index_put, a, b)]): the
    layer's matrix-vector products, and its weight gradients (each row's outer product
    a[s] b[s]^T summed by expert), or why it is not only those."""
    products, grads = [], []
    for p in layer.picks:
        todo = [(p, False)]  # (a reader of the picks, through transposes of each matrix)
        while todo:
            x, t = todo.pop()
            for u in x.users:
                if _swaps_matrix(u):
                    todo.append((u, not t))
                    continue
                if u.target is not aten.bmm.default or u.args[0] is u.args[1]:
                    return (f"{u.name} ({u.target}) reads the weights {p.name} picks per "
                            "row, not as a batched matrix-vector product")
                at = list(u.args).index(x)
                if not _vector(u.args[1 - at], layer.rows):
                    return (f"{u.name} multiplies the picked weights by "
                            f"{tuple(val(u.args[1 - at]).shape)}, not one vector a row")
                products.append((u, at, t, p))
    for u in layer.ids.users:
        if u.target in (aten.index_put.default, aten._index_put_impl_.default) and \
                list(u.args[1]) == [layer.ids]:
            v, t = u.args[2], False
            if val(v).dim() == 2:  # (a bias's gradient: rows summed by expert as they are)
                continue
            while _swaps_matrix(v):
                v, t = v.args[0], not t
            if v.target is not aten.bmm.default or len(u.args) < 4 or not u.args[3] or \
                    val(u).shape[0] != layer.experts or \
                    not all(_vector(a, layer.rows) for a in v.args[:2]) or \
                    val(v.args[0]).shape[2] != 1:
                return (f"{u.name} sums {v.name} ({v.target}) into a weight gradient by "
                        "expert, not one outer product a row")
            grads.append((u, v.args[1] if t else v.args[0], v.args[0] if t else v.args[1]))
    return products, grads


def _swaps_matrix(n: torch.fx.Node) -> bool:
    """`n` transposes each row's matrix ([rows, a, b] -> [rows, b, a])."""
    return n.target is aten.transpose.int and {d % 3 for d in n.args[1:3]} == {1, 2}


def why_not(layer: Picked) -> str | None:
    """Why `layer` cannot run grouped (None: it can)."""
    if len({tuple(val(p.args[0]).shape[:1]) for p in layer.picks}) != 1:
        return "its picked weights have different expert counts"
    found = _products(layer)
    if isinstance(found, str):
        return found
    for p in layer.picks:  # (aten._grouped_mm reads strides of 16 bytes: sizes of 8 in bf16)
        if any(s % 8 for s in val(p.args[0]).shape[1:]):
            return (f"{p.args[0].name} is {tuple(val(p.args[0]).shape)}: a grouped matmul "
                    "needs feature sizes that are multiples of 8 (16 bytes in bf16)")
    return None


# --- the rewrite -------------------------------------------------------------------------

def _rewrite(graph: torch.fx.Graph, layer: Picked) -> tuple:
    """Each product as a grouped matmul over the rows sorted by expert, each between a sort
    and an unsort of its own; what `_fold` takes to run the ops between one product's unsort
    and the next one's sort on the sorted rows."""
    products, grads = _products(layer)
    rows, n_exp = layer.rows, layer.experts

    def emit(target, *args, like=None, **kwargs):  # (with its value: `_fold` reads shapes)
        n = graph.call_function(target, args, kwargs)
        like = like or layer.ids
        n.meta[ir.REGION] = like.meta.get(ir.REGION, ir.FORWARD)
        n.meta[ir.MODULE] = like.meta.get(ir.MODULE, layer.module)
        fake_run(n)
        return n

    with graph.inserting_before(layer.ids.next):
        key = emit(aten._to_copy.default, layer.ids, dtype=torch.int64)
        srt = emit(aten.sort.stable, key, stable=True)
        key_s, perm = emit(operator.getitem, srt, 0), emit(operator.getitem, srt, 1)
        inv = emit(operator.getitem, emit(aten.sort.stable, perm, stable=True), 1)
        # (exact below 2^24 rows, as Hugging Face's counts)
        counts = emit(aten.histc.default, emit(aten._to_copy.default, key,
                                               dtype=torch.float32), n_exp, 0, n_exp - 1)
        offs = emit(aten._to_copy.default, emit(aten.cumsum.default, counts, 0),
                    dtype=torch.int32)
    sorts, unsorts = {}, []

    def sorted_rows(v):  # (one sort per tensor, a product's and a gradient's alike; in the
        # tensor's own region: a forward value's sort is forward work wherever it is read)
        v = _flat(v, rows)
        if v not in sorts:
            with graph.inserting_after(v):
                x = v if val(v).dim() == 2 else emit(aten.reshape.default, v, [rows, -1],
                                                     like=v)
            with graph.inserting_after(x):
                sorts[v] = emit(aten.index_select.default, x, 0, perm, like=v)
        return sorts[v]

    for mm, at, t, p in products:  # mm: [rows, a, 1] = M @ v, or [rows, 1, b] = v @ M
        w = p.args[0]
        with graph.inserting_before(mm):
            x = sorted_rows(mm.args[1 - at])
            # (v @ M reads M = W[ids] or its transpose; M @ v reads M's transpose)
            weight = w if t == (at == 0) else emit(aten.transpose.int, w, 1, 2, like=mm)
            y = emit(GROUPED_MM.default, x, weight, offs, like=mm)
            back = emit(aten.index_select.default, y, 0, inv, like=mm)
            out = emit(aten.reshape.default, back, list(val(mm).shape), like=mm)
        for u in list(mm.users):  # (its unit dim squeezed: the grouped matmul's rows as
            # they are, so tp sees a fused projection's split on the matmul itself)
            if u.target in (aten.squeeze.dim, aten.squeeze.dims) and \
                    tuple(val(u).shape) == (rows, val(mm).numel() // rows):
                u.replace_all_uses_with(back)
        mm.replace_all_uses_with(out)
        unsorts.append(_biased(graph, back, layer.ids, key_s, inv, emit) or back)
    for put, a, b in grads:  # [E, a, b] += a[s] (x) b[s] for each row s of each expert
        with graph.inserting_before(put):
            at = emit(aten.transpose.int, sorted_rows(a), 0, 1, like=put)
            g = emit(GROUPED_MM.default, at, sorted_rows(b), offs, like=put)
            zeros = put.args[0]
            if not (zeros.target in (aten.new_zeros.default, aten.zeros.default,
                                     aten.zeros_like.default)):
                g = emit(aten.add.Tensor, zeros, g, like=put)
        put.replace_all_uses_with(g)
    return list(sorts.values()), unsorts, perm, inv, rows


def _biased(graph, back, ids, key_s, inv, emit) -> torch.fx.Node | None:
    """A bias picked per row and added to a product's rows (`out.add_(b[ids])`), added on
    the sorted rows instead, picked by the sorted ids (Hugging Face's grouped form: tp
    splits such a linear with its bias); the rows put back after it (None: no such add)."""
    y = back.args[0]
    for u in back.users:
        if u.target is not aten.add.Tensor or len(u.args) != 2 or u.kwargs:
            continue
        b = u.args[1] if u.args[0] is back else u.args[0]
        if isinstance(b, torch.fx.Node) and b.target is aten.index.Tensor and \
                list(b.args[1]) == [ids] and val(b).shape == val(u).shape:
            with graph.inserting_before(u):
                pick = emit(aten.index.Tensor, b.args[0], [key_s], like=b)
                summed = emit(aten.add.Tensor, *((y, pick) if u.args[0] is back else
                                                 (pick, y)), like=u)
                out = emit(aten.index_select.default, summed, 0, inv, like=u)
            u.replace_all_uses_with(out)
            return out
    return None


def _flat(v: torch.fx.Node, rows: int) -> torch.fx.Node:
    """The tensor a row's vector `v` ([rows, k, 1] or [rows, 1, k]) views, through unit dims
    added or swapped (the same elements in the same order)."""
    while v.op == "call_function" and (
            v.target is aten.unsqueeze.default or v.target is aten.transpose.int and
            1 in val(v).shape[1:]) and val(v.args[0]).shape[0] == rows:
        v = v.args[0]
    return v


def _fold(graph, sorts: list, unsorts: list, perm, inv, rows: int) -> None:
    """Run the row-wise ops between an unsort and a sort on the sorted rows (a copy of each,
    reading the sorted rows entering them), dropping those unsorts and sorts: the rows stay
    sorted from the first product to the last, as in Hugging Face's grouped form."""
    region = between([(u, 0) for u in unsorts], [(s.args[0], 0) for s in sorts], rows)
    if not region:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    twin, entering = {u: u.args[0] for u in unsorts if u in region}, {}

    def sorted_input(a, d, before):
        if (a, d) not in entering:
            with graph.inserting_before(before):
                entering[(a, d)] = graph.call_function(aten.index_select.default, (a, d, perm))
            entering[(a, d)].meta.update({k: a.meta[k] for k in (ir.REGION, ir.MODULE)
                                          if k in a.meta})
        return entering[(a, d)]

    for n in sorted(region, key=order.__getitem__):
        if n in twin:
            continue
        carried = row_inputs(n, region[n], rows) or {}
        with graph.inserting_before(n):
            copy = graph.node_copy(n, lambda a: twin[a] if a in twin else (
                sorted_input(a, carried[a], n) if a in carried else a))
        twin[n] = copy
    for n in region:  # (a unit dim added and dropped again: the value itself, as the
        # grouped form has it, so tp sees a fused projection's pieces on the matmul)
        c = twin[n]
        if c.target is aten.squeeze.dim and c.args[0].target is aten.unsqueeze.default and \
                c.args[1] % val(n.args[0]).dim() == c.args[0].args[1] % val(n.args[0]).dim():
            c.replace_all_uses_with(c.args[0].args[0])
    for s in sorts:
        x = s.args[0]
        if x in region and region[x] == 0:
            s.replace_all_uses_with(twin[x])
    for n, r in region.items():  # what leaves the region: its rows back in their order
        for u in list(n.users):
            if u in region or u.target is aten.index_select.default and u.args[2] is perm:
                continue
            with graph.inserting_before(u):
                src = twin[n]
                if isinstance(val(n), (tuple, list)):  # (a split's piece read outside)
                    src = graph.call_function(operator.getitem, (src, u.args[1]))
                back = graph.call_function(aten.index_select.default, (src, r, inv))
            back.meta.update({k: n.meta[k] for k in (ir.REGION, ir.MODULE) if k in n.meta})
            if isinstance(val(n), (tuple, list)):
                u.replace_all_uses_with(back)
            else:
                u.replace_input_with(n, back)

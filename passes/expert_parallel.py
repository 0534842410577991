"""Expert parallelism as a graph transformation, exact (Plan.ep).

An MoE layer written as grouped matmuls (Hugging Face's default experts, torchtitan's: the
(token, expert) pairs sorted by expert, `offs` = each expert's end row, `aten._grouped_mm(rows,
W[E, ...], offs)` up and down, and their backward on the same `offs`) is found on the joint
graph by those matmuls. Expert parallelism splits the experts over groups of ep neighbouring
dp ranks (the "ep" group): rank r holds experts [r E/ep, (r+1) E/ep) (the parameter is this
rank's E/ep slice along dim 0). Two rewrites, by how the dp pass will run the layer:

- all-to-all, where the dispatch runs on each dp rank's own rows (core/local_dispatch: the
  sort, the histogram and the grouped matmuls over the rank's pairs): the layer's counts
  are exchanged once (fxpar::ep_route), each row tensor entering the layer's row-wise
  region (the grouped matmuls and the activation between them, forward and backward) is
  sent to its experts' ranks (fxpar::ep_dispatch), the grouped matmuls run on the rows
  received with their counts, and each row tensor leaving the region comes back
  (fxpar::ep_combine). The expert gradients are the ep group's rows' for this rank's
  experts: partial over the groups, summed over "edp" by the dp pass.
- gathered rows, where the dispatch reads every row (a capacity over the sorted rows) and
  the dp pass makes the rows whole on every dp rank: this rank's run of the sorted rows is
  moved to the front of each row tensor entering the region (a gather by `idx = arange(S)
  + start`; fxpar::expert_window reads the rank's start and local offs from the global
  offs: one graph for every rank), the grouped matmuls run on it (rows past the local offs
  are never computed), and where a row tensor leaves the region its run is put back in
  place, zeros elsewhere, and all-reduced over the ep group: every row is made by exactly
  one rank. The expert gradients are then complete (every token's), reduced by nobody.

Experts kept as an nn.ModuleList (an experts loop, each expert run on the rows routing picks
for it) are run in slots (see "experts written as nn.ModuleList" below). Batched matmuls over
gathered weights are refused by name: their experts are not one parameter to split.
"""
from __future__ import annotations

import dataclasses
import operator
import re

import networkx
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._inductor.pattern_matcher import stable_topological_sort

from fxpar.core import experts as _experts  # noqa: F401  (registers fxpar::expert_window)
from fxpar.core import sharding as _sharding  # noqa: F401  (registers fxpar::local_chunk)
from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.graphs import fake_propagate
from fxpar.core.sharding import batch_local_dispatch

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_GROUPED_MM = getattr(aten, "_grouped_mm", None)
_TRANSPOSES = {aten.t.default, aten.transpose.int}
# ops a weight passes through on its way to a grouped matmul (a cast under bf16, a
# transpose for W.T); the weight is the parameter they start from
_WEIGHT_PATH = {aten.t.default, aten.transpose.int, aten._to_copy.default, aten.clone.default,
                aten.alias.default, *ir.RESHAPES}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    ep: int = 1
    dp: int | None = 1


CONTRACT = ir.PassContract(
    "expert_parallel", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.MODULE, ir.ROLE, ir.FQN}),
    # the nodes it adds join their neighbours' pipeline part; a tp-split weight is left alone
    reads=frozenset({ir.STAGE, ir.PHASE, ir.TP_LAYOUTS}),
    provides=frozenset({ir.EXPERT_PARAMS, ir.EXPERT_SLOTS, ir.EP_REPORT, ir.DYNAMIC_ROWS}),
    # the data-parallel pass shards the rewritten graph: its engine carries the ep group's
    # collectives as another mesh axis's
    before=frozenset({"data_parallel", "overlap", "fusion"}),
    after=frozenset({"precision", "remat"}),
    applies=lambda o: (o.ep or 1) > 1,
    values_fresh=True)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    ep = options.ep
    group = ctx.group_names["ep"]
    skipped: list[str] = []
    layers, lists = find_layers(gm), find_expert_lists(gm, skipped)
    if not layers and not lists:
        raise PlanError(
            f"Plan.ep={ep}: no MoE layer found on the graph. Expert parallelism splits experts "
            "stored as one parameter [experts, ...] and run by aten._grouped_mm (Hugging "
            "Face's experts by default, config._experts_implementation='grouped_mm'), or "
            "kept as an nn.ModuleList of identical experts each run on the rows routed to it; "
            "'batched_mm' experts cannot be split. Use ep=1 (ZeRO or tp shard such experts "
            "like any weight)." + (" Lists of identical modules that are not experts: " +
                                   "; ".join(skipped) + "." if skipped else ""))
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "param"]
    index = {n: i for i, n in enumerate(params)}
    layouts = gm.meta.get(ir.TP_LAYOUTS) or [None] * len(params)
    split, report = set(), []
    # the layers whose dispatch the dp pass runs on each rank's own rows: their rows go to
    # their experts' ranks and back by all-to-all; the others' rows are every dp rank's
    local = batch_local_dispatch(gm, options.dp or 1) if layers else {}
    for layer in layers:
        e = layer.offs.meta[ir.VAL].numel()
        if e % ep:
            raise PlanError(f"Plan.ep={ep}: the MoE layer {layer.module!r} has {e} experts, "
                            f"which do not split evenly over {ep} ranks. Use an ep that "
                            f"divides {e}.")
        tp_split = [w.meta[ir.FQN] for w in layer.weights if layouts[index[w]]]
        if tp_split:
            raise PlanError(f"Plan.ep={ep}: the expert weights {tp_split} are also split by "
                            "tensor parallelism; one weight takes one split. Use ep=1 or tp=1.")
        all_to_all = all(m in local for m in layer.matmuls)
        if all_to_all:
            _rewrite_all_to_all(gm.graph, layer, e // ep, group, ep)
        else:
            _rewrite(gm.graph, layer, e // ep, group)
        for w in layer.weights:
            if w not in split:
                v = w.meta[ir.VAL]
                w.meta[ir.VAL] = v.new_empty((v.shape[0] // ep, *v.shape[1:]))
                split.add(w)
        report.append({"module": layer.module, "experts": e, "per_rank": e // ep,
                       "rows": layer.rows, "weights": [w.meta[ir.FQN] for w in layer.weights],
                       "region": len(layer.region), "entering": len(layer.entering),
                       "leaving": len(layer.leaving),
                       "dispatch": "all-to-all" if all_to_all else "gathered rows"})
    slots = []
    for lst in lists:
        e = len(lst.experts)
        if e % ep:
            raise PlanError(f"Plan.ep={ep}: {lst.module!r} has {e} experts, which do not "
                            f"split evenly over {ep} ranks. Use an ep that divides {e}.")
        stages = sorted({n.meta[ir.STAGE] for x in lst.experts for n in (*x.region, *x.entering)
                         if ir.STAGE in n.meta})
        if len(stages) > 1:  # (a slot runs after the rows of all its experts are picked)
            raise PlanError(f"Plan.ep={ep}: a pipeline stage boundary falls among the experts of "
                            f"{lst.module!r} (they span stages {stages}); a slot runs experts of "
                            "one stage. Use another pp, or ep=1.")
        tp_split = [p.meta[ir.FQN] for x in lst.experts for p in x.params.values()
                    if layouts[index[p]]]
        if tp_split:
            raise PlanError(f"Plan.ep={ep}: the expert weights {tp_split[:4]} are also split "
                            "by tensor parallelism; one weight takes one split. Use ep=1 or "
                            "tp=1.")
        slots += _rewrite_list(gm, lst, ep, group, index)
        first = lst.experts[0]
        report.append({"module": lst.module, "experts": e, "per_rank": e // ep,
                       "rows": lst.rows, "weights": [p.meta[ir.FQN] for x in lst.experts
                                                     for p in x.params.values()],
                       "region": len(first.region), "entering": len(first.entering),
                       "leaving": len(first.leaving), "dispatch": "expert slots"})
    gm.graph.lint()
    gm.recompile()
    fake_propagate(gm, check=False)
    gm.meta[ir.EXPERT_PARAMS] = sorted(index[w] for w in split)
    gm.meta[ir.EXPERT_SLOTS] = slots
    gm.meta[ir.EP_REPORT] = report
    return gm


# --- finding the layers ---------------------------------------------------------------------

@dataclasses.dataclass
class Layer:
    """One MoE layer: its offs, grouped matmuls, row-wise region (node -> row dim), the
    weights it splits, the row tensors entering the region and the region's nodes whose rows
    leave it."""
    offs: torch.fx.Node
    rows: int
    matmuls: list
    region: dict
    weights: list
    entering: list
    leaving: list
    module: str


def find_layers(gm: torch.fx.GraphModule) -> list[Layer]:
    """Every MoE layer of grouped matmuls on `gm`, by its offs node (forward and backward
    matmuls share it)."""
    if _GROUPED_MM is None:
        return []
    by_offs: dict[torch.fx.Node, list] = {}
    for n in gm.graph.nodes:
        if n.target is _GROUPED_MM.default:
            offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
            if not isinstance(offs, torch.fx.Node):
                raise PlanError(f"Plan.ep: the grouped matmul {n.name} (module "
                                f"{n.meta.get(ir.MODULE, '')!r}) has no offs; expert "
                                "parallelism needs each expert's rows given by offs.")
            by_offs.setdefault(offs, []).append(n)
    every = {m for mms in by_offs.values() for m in mms}
    return [_layer(offs, mms, every) for offs, mms in by_offs.items()]


def _val(n):
    return n.meta.get(ir.VAL) if isinstance(n, torch.fx.Node) else None


def _first_tensor(v):
    return v[0] if isinstance(v, (tuple, list)) else v


def _roles(mm) -> list[tuple[torch.fx.Node, int]]:
    """A grouped matmul's row-space operands (node, row dim): rows x W -> rows (forward, and
    the backward's input gradient), or rows^T x rows -> [E, ...] (a weight gradient)."""
    a, b = mm.args[0], mm.args[1]
    if _val(a).dim() == 2 and _val(b).dim() == 3:
        return [(a, 0)]
    if _val(a).dim() == 2 and _val(b).dim() == 2 and _val(mm).dim() == 3:
        return [(a, 1), (b, 0)]
    raise PlanError(f"Plan.ep: the grouped matmul {mm.name} (module "
                    f"{mm.meta.get(ir.MODULE, '')!r}) multiplies {tuple(_val(a).shape)} by "
                    f"{tuple(_val(b).shape)}; expert parallelism knows a 2-D rows operand "
                    "with 3-D expert weights, and the weight gradient it makes.")


def _row_inputs(node, row: int, rows: int) -> dict | None:
    """{input: its row dim} for the inputs of `node` that carry its rows (row dim `row` of
    its output, `rows` long), or None if `node` is not row-wise (it mixes or reorders rows)."""
    op = node.target
    if node.op != "call_function":
        return None
    if op is operator.getitem:
        return {node.args[0]: row}
    if _GROUPED_MM is not None and op is _GROUPED_MM.default:
        return dict(_roles(node))
    out = _first_tensor(_val(node))
    if not isinstance(out, torch.Tensor):
        return None
    if op in _TRANSPOSES:
        x = node.args[0]
        if op is aten.t.default:
            return {x: 1 - row} if out.dim() == 2 else None
        d0, d1 = (d % out.dim() for d in node.args[1:3])
        return {x: d1 if row == d0 else d0 if row == d1 else row}
    if op in _SPLITS or op is aten.slice.Tensor or op is aten.cat.default:
        at = 2 if op in _SPLITS else 1
        dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
        if dim % out.dim() == row:
            return None
        ins = node.args[0] if op is aten.cat.default else [node.args[0]]
        return {x: row for x in ins}
    if op in ir.RESHAPES:
        x = node.args[0]
        ok = row == 0 and _val(x).dim() >= 1 and _val(x).shape[0] == rows == out.shape[0]
        return {x: 0} if ok else None
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        found = {}
        for x in node.all_input_nodes:
            v = _val(x)
            if isinstance(v, torch.Tensor):
                d = row - (out.dim() - v.dim())
                if d >= 0 and v.shape[d] == rows:
                    found[x] = d
        return found
    return None


def _out_row(user, node, row: int, rows: int) -> int | None:
    """The row dim of `user`'s output if `user` is row-wise in `node`'s rows, else None."""
    out = _first_tensor(_val(user))
    if not isinstance(out, torch.Tensor) or user.op != "call_function":
        return None
    if user.target is operator.getitem:
        cand = row
    elif user.target is aten.t.default:
        cand = 1 - row
    elif user.target is aten.transpose.int:
        d0, d1 = (d % out.dim() for d in user.args[1:3])
        cand = d1 if row == d0 else d0 if row == d1 else row
    elif isinstance(user.target, torch._ops.OpOverload) and \
            torch.Tag.pointwise in user.target.tags:
        cand = row + (out.dim() - _val(node).dim()) if not isinstance(_val(node), (
            tuple, list)) else row
    else:
        cand = row
    if cand is None or not 0 <= cand < out.dim() or out.shape[cand] != rows:
        return None
    ins = _row_inputs(user, cand, rows)
    return cand if ins is not None and ins.get(node) == row else None


def _between(outs, ins, rows: int, given: dict | None = None) -> dict:
    """{node: row dim} of the nodes between row-wise ops: reached forward from `outs`
    ((node, row dim) pairs) through row-wise users and backward from `ins` through row-wise
    inputs. A node of `given` ({node: {row input: dim}}) takes its row inputs from there and
    is not passed through forward (it is a start of its own)."""
    given = given or {}
    fwd: dict = {}
    todo = list(outs)
    while todo:
        n, r = todo.pop()
        if fwd.get(n) == r:
            continue
        fwd[n] = r
        for u in n.users:
            c = None if u in given else _out_row(u, n, r, rows)
            if c is not None:
                todo.append((u, c))
    bwd: dict = {}
    todo = list(ins)
    while todo:
        n, r = todo.pop()
        if bwd.get(n) == r:
            continue
        bwd[n] = r
        todo.extend(((given[n] if n in given else _row_inputs(n, r, rows)) or {}).items())
    return {n: r for n, r in fwd.items() if bwd.get(n) == r}


def _layer(offs, mms, every: set) -> Layer:
    """`every`: the graph's grouped matmuls (remat's recomputed copy of a layer has offs of
    its own, and reads the same weights)."""
    module = next((m.meta.get(ir.MODULE, "") for m in mms if m.meta.get(ir.MODULE)), "")
    rows = next(_val(a).shape[d] for m in mms for a, d in _roles(m))
    # forward from every matmul's rows out, backward from every matmul's rows in, through
    # row-wise ops: the region is what lies on both (the ops between grouped matmuls)
    region = _between([(m, 0) for m in mms if _val(m).dim() == 2],
                      [x for m in mms for x in _roles(m)], rows)
    for m in mms:
        region[m] = 0 if _val(m).dim() == 2 else None  # (a weight gradient: expert space)
        for a, d in _roles(m):  # a transposed operand (rows^T of a weight gradient)
            if a.target in _TRANSPOSES and a not in region:
                region[a] = d
    for n in list(region):  # a split's pieces go with it
        if isinstance(_val(n), (tuple, list)):
            for u in n.users:
                region.setdefault(u, region[n])
    entering, leaving = {}, []
    for n, r in region.items():
        for x, d in (_roles(n) if r is None else (_row_inputs(n, r, rows) or {}).items()):
            if x not in region:
                if d != 0:
                    raise PlanError(f"Plan.ep: {x.name} enters the MoE layer {module!r} with "
                                    f"its rows on dim {d}; expert parallelism moves rows on "
                                    "dim 0.")
                entering.setdefault(x, None)
        if r is None:  # (a weight gradient: expert space, no rows leave)
            continue
        if any(u not in region for u in n.users) and not isinstance(_val(n), (tuple, list)):
            if r != 0:
                raise PlanError(f"Plan.ep: {n.name} leaves the MoE layer {module!r} with its "
                                f"rows on dim {r}; expert parallelism moves rows on dim 0.")
            leaving.append(n)
    weights = []
    for m in mms:
        if _val(m).dim() == 2:
            w = _weight_of(m.args[1], m, module)
            if w not in weights:
                weights.append(w)
    experts = _val(offs).numel()
    for w in weights:
        _only_experts_read(w, every, experts, module)
    return Layer(offs, rows, mms, region, weights, list(entering), leaving, module)


def _only_experts_read(w, mms: set, experts: int, module: str) -> None:
    """Split along dim 0, an expert weight must be read only by grouped matmuls (`mms`: each
    rewritten with its layer's local offs), as their experts operand, through casts, views
    and transposes that keep dim 0 the experts; and dim 0 must be the experts: any other
    reader would compute on this rank's slice alone."""
    if _val(w).dim() != 3 or _val(w).shape[0] != experts:
        raise PlanError(f"Plan.ep: the weight {w.meta.get(ir.FQN, w.name)} of the MoE layer "
                        f"{module!r} is {tuple(_val(w).shape)}, not [{experts} experts, ...]; "
                        "expert parallelism splits a 3-D weight along its experts.")
    todo = [w]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in mms and u.args[1] is n:
                continue
            v = _val(u)
            keeps = u.target in _WEIGHT_PATH and isinstance(v, torch.Tensor) and \
                v.dim() == 3 and v.shape[0] == experts and not (
                    u.target is aten.transpose.int and 0 in {d % 3 for d in u.args[1:3]})
            if not keeps:
                raise PlanError(
                    f"Plan.ep: the expert weight {w.meta.get(ir.FQN, w.name)} of {module!r} "
                    f"is also read by {u.name} ({u.target}, module "
                    f"{u.meta.get(ir.MODULE, '')!r}), not only as grouped matmuls' experts; "
                    "split over ep ranks, that op would see this rank's experts alone. Use "
                    "ep=1 for this model.")
            todo.append(u)


def _weight_of(x, mm, module):
    n = x
    while n.op == "call_function" and n.target in _WEIGHT_PATH:
        n = n.args[0]
    if n.op == "call_function" and n.target is torch.ops.fxpar.local_chunk.default:
        raise PlanError(f"Plan.ep: tensor parallelism already splits the experts of "
                        f"{module!r} (a local_chunk of their weight feeds {mm.name}); one "
                        "weight takes one split. Use ep=1 (experts split over tp) or tp=1.")
    if n.op != "placeholder" or n.meta.get(ir.ROLE) != "param":
        raise PlanError(f"Plan.ep: the experts' weight of the grouped matmul {mm.name} "
                        f"(module {module!r}) is computed by {n.name} ({n.target}), not a "
                        "parameter; expert parallelism splits parameters [experts, ...].")
    return n


# --- the rewrite ----------------------------------------------------------------------------

def _emit(graph, target, args, like, region=None, kwargs=None):
    n = graph.call_function(target, args, kwargs or {})
    n.meta[ir.REGION] = region or like.meta.get(ir.REGION, ir.FORWARD)
    n.meta[ir.MODULE] = like.meta.get(ir.MODULE, "")
    for key in (ir.STAGE, ir.PHASE):  # (a pipeline's part: the node it sits by)
        if key in like.meta:
            n.meta[key] = like.meta[key]
    return n


def _in_first_part(node, users) -> None:
    """A node made for `users` runs in the pipeline part of the first of them to run."""
    phase = ir.first_phase(users)
    if phase is not None:
        node.meta[ir.PHASE] = phase


def _after(graph: torch.fx.Graph, offs: torch.fx.Node):
    """emit(target, *args, **kwargs): a node after offs (then after the last emitted), placed
    as offs is."""
    anchor = offs

    def emit(target, *args, **kwargs):
        nonlocal anchor
        with graph.inserting_after(anchor):
            n = _emit(graph, target, args, offs, kwargs=kwargs)
        anchor = n
        return n
    return emit


def _rewrite(graph: torch.fx.Graph, layer: Layer, per_rank: int, group: str) -> None:
    offs, rows = layer.offs, layer.rows
    dev = _val(offs).device
    order = {n: i for i, n in enumerate(graph.nodes)}
    emit = _after(graph, offs)  # the window's nodes go right after offs, in order
    window = emit(torch.ops.fxpar.expert_window.default, offs, per_rank, group)
    start = emit(aten.select.int, window, 0, 0)
    count = emit(aten.select.int, window, 0, per_rank)
    local_offs = emit(aten._to_copy.default, emit(aten.slice.Tensor, window, 0, 1,
                                                 per_rank + 1), dtype=torch.int32)
    ar = emit(aten.arange.default, rows, dtype=torch.int64, device=dev, pin_memory=False)
    take = emit(aten.clamp.default, emit(aten.add.Tensor, ar, start), None, rows - 1)
    rel = emit(aten.sub.Tensor, ar, start)
    inside = emit(aten.logical_and.default, emit(aten.ge.Scalar, rel, 0),
                  emit(aten.lt.Tensor, rel, count))
    back = emit(aten.clamp.default, rel, 0, rows - 1)
    computed = emit(aten.view.default, emit(aten.lt.Tensor, ar, count), [rows, 1])

    for m in layer.matmuls:
        m.replace_input_with(offs, local_offs)
        if layer.region[m] == 0:  # rows past this rank's are left unwritten: zeros instead,
            # so every value is defined (Inductor's code is checked against the graph's)
            users = list(m.users)
            with graph.inserting_after(m):
                zeroed = _emit(graph, aten.where.ScalarOther, (computed, m, 0.0), m)
            zeroed.meta[ir.VAL] = m.meta[ir.VAL]
            for u in users:
                u.replace_input_with(m, zeroed)
            layer.region[zeroed] = 0
            if m in layer.leaving:
                layer.leaving[layer.leaving.index(m)] = zeroed
    for x in layer.entering:  # this rank's run of rows first
        users = [u for u in x.users if u in layer.region]
        first = min(users, key=order.__getitem__)
        with graph.inserting_before(first):
            moved = _emit(graph, aten.index.Tensor, (x, [take]), first)
        _in_first_part(moved, users)
        for u in users:
            u.replace_input_with(x, moved)
    for y in layer.leaving:  # back in place, zeros elsewhere, summed over the ep group
        users = [u for u in y.users if u not in layer.region]
        with graph.inserting_after(y):
            placed = _emit(graph, aten.index.Tensor, (y, [back]), y)
        with graph.inserting_after(placed):
            mask = _emit(graph, aten.view.default,
                         (inside, [rows] + [1] * (_val(y).dim() - 1)), y)
        with graph.inserting_after(mask):
            kept = _emit(graph, aten.where.ScalarOther, (mask, placed, 0.0), y)
        with graph.inserting_after(kept):
            summed = _emit(graph, c10d.all_reduce.default, (kept, "sum", group), y,
                           region=ir.COMM)
        with graph.inserting_after(summed):
            whole = _emit(graph, c10d.wait_tensor.default, (summed,), y, region=ir.COMM)
        for u in users:
            u.replace_input_with(y, whole)



def _rewrite_all_to_all(graph: torch.fx.Graph, layer: Layer, per_rank: int, group: str,
                        ep: int) -> None:
    """The layer's rows are this dp rank's own (core/local_dispatch): each row tensor entering
    the region is sent to its experts' ranks (fxpar::ep_dispatch: the rows received, sorted
    by this rank's experts; as many as the routing sends, so the region's nodes are marked
    ir.DYNAMIC_ROWS and its views sized by the rows infer them), the grouped matmuls run on
    the rank's experts with the received counts, and each row tensor leaving comes back
    (fxpar::ep_combine).
    The expert weights' gradients are then the ep group's rows' for this rank's experts:
    partial over the groups (the dp pass sums them over "edp")."""
    offs, rows = layer.offs, layer.rows
    stages = sorted({n.meta[ir.STAGE] for n in layer.region if ir.STAGE in n.meta})
    if len(stages) > 1:  # (a transfer between stages is sized by the graph's values)
        raise PlanError(f"Plan.ep: a pipeline stage boundary falls inside the MoE layer "
                        f"{layer.module!r} (its expert rows span stages {stages}); the rows "
                        "between its all-to-alls are as many as the routing sends, which no "
                        "stage transfer can carry. Use another pp, or ep=1.")
    emit = _after(graph, offs)
    route = emit(torch.ops.fxpar.ep_route.default, offs, per_rank, group)
    received = emit(aten.sum.dim_IntList, emit(aten.select.int, route, 0, 1), [0])
    local_offs = emit(aten._to_copy.default, emit(aten.cumsum.default, received, 0),
                      dtype=torch.int32)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for m in layer.matmuls:
        m.replace_input_with(offs, local_offs)
    for n, r in layer.region.items():  # a view inside sized by the rows: the received ones,
        # as many as there are (-1; the graph's values: the most there can be, ep x rows)
        if n.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                        aten.expand.default) and r is not None and n.args[1][r] == rows:
            size = list(n.args[1])
            if -1 in size and n.target is not aten.expand.default:
                raise PlanError(f"Plan.ep: {n.name} in the MoE layer {layer.module!r} views "
                                f"its routed rows as {size}, with a -1 besides the rows: "
                                "the received rows' count is the one size left to infer")
            size[r] = -1  # (expand's -1 keeps the size)
            n.args = (n.args[0], size, *n.args[2:])
        n.meta[ir.DYNAMIC_ROWS] = True
    for x in layer.entering:
        users = [u for u in x.users if u in layer.region]
        first = min(users, key=order.__getitem__)
        with graph.inserting_before(first):
            sent = _emit(graph, torch.ops.fxpar.ep_dispatch.default, (x, route, group), first)
        sent.meta[ir.DYNAMIC_ROWS] = True
        _in_first_part(sent, users)
        for u in users:
            u.replace_input_with(x, sent)
    for y in layer.leaving:
        users = [u for u in y.users if u not in layer.region]
        with graph.inserting_after(y):
            back = _emit(graph, torch.ops.fxpar.ep_combine.default, (y, route, group), y)
        for u in users:
            u.replace_input_with(y, back)


# --- experts written as nn.ModuleList -------------------------------------------------------
# Hand-written MoE code (DeepSeek's and Mistral's reference code, litgpt) keeps its experts as
# a list of modules and loops over them: each expert's rows picked by routing (x[idx]), run
# through the expert, and added back (y[idx] += ...). The joint graph holds one such region
# per expert, forward and backward; the experts are not one parameter to slice. Expert
# parallelism gives the ep group's ranks "slots" instead: slot j is the graph of expert j
# (its region), and on ep rank q it runs expert q * E/ep + j, whose weights the runtime binds
# to the slot's parameters (Program.expert_slots). Every rank routes every token (the dp
# pass keeps such a dispatch's rows whole on every rank), so each row tensor entering slot
# j's region is the one of this rank's expert (fxpar::expert_pick among the slot's experts'
# rows), and each row tensor leaving it is all-gathered over the ep group, its pieces read
# where each of the slot's experts' results was read. The other experts' regions are
# removed, their parameters left unread (held by their own ranks as slots). The slots'
# gradients are those of every row: whole, reduced by nobody.

_LIST_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.)")  # (a lookahead: nested lists' indices too)
_MATMULS = {aten.mm.default: 0, aten.addmm.default: 1}  # op -> its rows operand


@dataclasses.dataclass
class Expert:
    """One expert of a list: its parameters (name below the expert -> placeholder), its
    row-wise region (node -> row dim; None: a weight gradient, which sums the rows), and the
    row tensors entering and leaving the region, each in graph order (so the experts of a
    list correspond position by position)."""
    module: str
    rows: int
    params: dict
    region: dict
    entering: list
    leaving: list
    dead: set  # what goes with the expert when its region is removed (weight paths, grads)


@dataclasses.dataclass
class ExpertList:
    module: str
    rows: int
    experts: list


def find_expert_lists(gm: torch.fx.GraphModule, skipped: list | None = None
                      ) -> list[ExpertList]:
    """Every list of experts on `gm`: a ModuleList whose members hold the same parameters,
    run side by side (none reads another's result) on rows each gathered by routing. Lists
    of identical members that are not experts are appended to `skipped` with the reason."""
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "param"]
    lists: dict[str, dict[int, dict]] = {}
    for p in params:
        fqn = p.meta[ir.FQN]
        for m in _LIST_INDEX.finditer(fqn):
            lists.setdefault(fqn[:m.start()], {}).setdefault(int(m.group(1)), {})[
                fqn[m.end() + 1:]] = p
    out, grads, order = [], _grad_nodes(gm, params), {n: i for i, n in enumerate(gm.graph.nodes)}
    forward: dict[str, list] = {}  # module -> the forward ops tagged with it
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.meta.get(ir.REGION) == ir.FORWARD:
            forward.setdefault(n.meta.get(ir.MODULE) or "", []).append(n)
    for prefix, members in lists.items():
        if len(members) < 2 or sorted(members) != list(range(len(members))):
            continue
        first = members[0]
        if any(set(m) != set(first) or any(
                (_val(m[k]).shape, _val(m[k]).dtype) != (_val(first[k]).shape, _val(first[k]).dtype)
                for k in first) for m in members.values()):
            continue
        modules = [f"{prefix}.{k}" if prefix else str(k) for k in range(len(members))]
        why = _not_side_by_side([_ops_of(forward, m) for m in modules[:2]])
        if why:
            if skipped is not None:
                skipped.append(f"{prefix or 'the model'!r}: {why}")
            continue
        experts = [_expert(m, members[k], grads, order, _ops_of(forward, m))
                   for k, m in enumerate(modules)]
        rows = {e.rows for e in experts}
        canon = [_canonical(e, order) for e in experts]
        if any(c != canon[0] for c in canon[1:]) or len(rows) > 1 or \
                len({(len(e.entering), len(e.leaving)) for e in experts}) > 1:
            raise PlanError(f"Plan.ep: the experts of {prefix!r} do not run the same graph "
                            "(their ops, arguments or row counts differ, or they read tensors "
                            "of their own besides their parameters); expert parallelism runs "
                            "one expert's graph for each. Use ep=1 for this model.")
        out.append(ExpertList(prefix, rows.pop(), experts))
    return out


def _canonical(e: Expert, order: dict) -> list:
    """The expert's region as one graph runs it for any expert of its list: each node's op,
    row dim and arguments, a node named by its role (a region node by position, an entering
    row tensor by index, a weight by its name below the expert, through the ops on its way),
    any other node as itself (what the experts must share: a slot runs with expert j's)."""
    nodes = sorted(e.region, key=order.get)
    pos = {n: i for i, n in enumerate(nodes)}
    enter = {x: i for i, x in enumerate(e.entering)}
    names = {p: name for name, p in e.params.items()}

    def role(a):
        if not isinstance(a, torch.fx.Node):
            return a
        if a in pos:
            return ("region", pos[a])
        if a in enter:
            return ("entering", enter[a])
        if a in names:
            return ("weight", names[a])
        if a in e.dead:  # (a weight's way to the region: a transpose, a cast)
            return (a.target, pytree.tree_map(role, (a.args, a.kwargs)))
        return ("shared", a)
    return [(n.target, e.region[n], pytree.tree_map(role, (n.args, n.kwargs)), n in e.leaving)
            for n in nodes]


def _ops_of(forward: dict, module: str) -> list:
    """The forward ops of `module` and its submodules (`forward`: module -> its own ops)."""
    return [n for m, ops in forward.items() if m == module or m.startswith(module + ".")
            for n in ops]


def _not_side_by_side(fwd: list[list]) -> str | None:
    """Why the forward ops `fwd` of a list's first two members are not experts run side by
    side: each's input rows gathered by routing (an index op, through views and casts),
    neither computed from the other's nodes (a stack of layers feeds each into the next);
    None if they are."""
    if not all(fwd):
        return "a member runs no op of its own"
    inputs = []
    for nodes in fwd:
        inside = set(nodes)
        ins = {x for n in nodes for x in n.all_input_nodes
               if x not in inside and x.op != "placeholder"}
        if not any(_routed(x) for x in ins):
            return "its members' inputs are not rows picked by an index op (routing)"
        inputs.append(ins)
    if ir.ancestors(list(inputs[1])) & set(fwd[0]):
        return "each member reads the one before (a stack of layers)"
    if inputs[0] == inputs[1]:
        return "its members read the same rows"
    return None


def _routed(x) -> bool:
    """x is rows picked by an index op, through views and casts."""
    while x.op == "call_function" and x.target in _WEIGHT_PATH | {aten.expand.default}:
        x = x.args[0]
    return x.op == "call_function" and x.target is aten.index.Tensor


def _grad_nodes(gm, params) -> dict:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if not out.meta.get(ir.N_GRADS):  # (evaluate()'s forward-only graph)
        return {}
    return {p: out.args[0][1 + i] for i, p in enumerate(params)}


def _expert(module: str, weights: dict, grads: dict, order: dict, ops: list) -> Expert:
    """Expert `module` (its parameters `weights`, its forward ops `ops`), as the Expert."""
    paths = set(weights.values())
    todo = list(paths)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "call_function" and u.target in _WEIGHT_PATH and u not in paths:
                paths.add(u)
                todo.append(u)
    seeds = {}  # node -> {row input: dim}
    for p in sorted(paths, key=order.get):  # (in graph order: the same on every rank)
        for u in p.users:
            if u in paths or u.op != "call_function":
                continue
            if u.target in _MATMULS:
                x = u.args[_MATMULS[u.target]]
                seeds[u] = {x: 0}
            elif isinstance(u.target, torch._ops.OpOverload) and \
                    torch.Tag.pointwise in u.target.tags:
                seeds[u] = None  # (rows found below, once they are known)
            else:
                raise PlanError(
                    f"Plan.ep: a weight of the expert {module!r} is read by {u.name} "
                    f"({u.target}, module {u.meta.get(ir.MODULE, '')!r}); expert parallelism "
                    "over nn.ModuleList experts runs experts made of linear layers and "
                    "row-wise ops, each expert's weights read only by its own layers. Use "
                    "ep=1 for this model.")
    mms = [s for s, ins in seeds.items() if ins]
    if not mms:
        raise PlanError(f"Plan.ep: the expert {module!r} multiplies no rows by its weights; "
                        "expert parallelism runs experts made of linear layers.")
    rows = _val(mms[0]).shape[0]
    for s in seeds:
        if seeds[s] is None:
            seeds[s] = _row_inputs(s, 0, rows) if _val(s).dim() and \
                _val(s).shape[0] == rows else None
        if not seeds[s] or _val(s).shape[0] != rows:
            raise PlanError(
                f"Plan.ep: a weight of the expert {module!r} is read by {s.name} ({s.target}, "
                f"module {s.meta.get(ir.MODULE, '')!r}), not on the expert's {rows} rows; "
                "split over ep ranks, each expert is on one rank only, read there by its own "
                "layers. Use ep=1 for this model.")
    terminals, dead = {}, set(n for n in paths if n.op != "placeholder")
    for p in weights.values():
        g = grads.get(p)
        while isinstance(g, torch.fx.Node) and g.target in _WEIGHT_PATH:
            dead.add(g)
            g = g.args[0]
        if g is None:
            continue
        terminals[g] = _weight_grad_rows(g, rows, module, p)
    given = {**seeds, **terminals}
    region = _between([(s, 0) for s in seeds],
                      [x for ins in given.values() for x in ins.items()], rows, given)
    region.update({s: 0 for s in seeds})
    region.update({t: None for t in terminals})
    for ins in terminals.values():
        for x, d in ins.items():
            if d == 1 and x not in region:  # (rows^T of a weight gradient)
                region[x] = 1
    region = dict(sorted(region.items(), key=lambda item: order[item[0]]))
    missing = [n for n in ops if n not in region and n not in paths and not (
        n.target is operator.getitem and n.args[0] in region)]
    if missing:  # (a forward op of the expert the region left out)
        n = min(missing, key=order.get)
        raise PlanError(f"Plan.ep: {n.name} ({n.target}) in the expert {module!r} does not "
                        "act row by row on the expert's rows; expert parallelism runs "
                        "experts whose ops keep each row apart (linear layers, activations). "
                        "Use ep=1 for this model.")
    entering, leaving = [], []
    for n, r in region.items():
        ins = given[n] if n in given else _row_inputs(n, r, rows) or {}
        for x, d in ins.items():
            if x not in region and x not in entering:
                if d != 0:
                    raise PlanError(f"Plan.ep: {x.name} enters the expert {module!r} with its "
                                    f"rows on dim {d}; expert parallelism moves rows on dim 0.")
                entering.append(x)
        if r is not None and any(u not in region for u in n.users):
            if r != 0:
                raise PlanError(f"Plan.ep: {n.name} leaves the expert {module!r} with its rows "
                                f"on dim {r}; expert parallelism moves rows on dim 0.")
            leaving.append(n)
    dead |= set(region)
    return Expert(module, rows, weights, region, entering, leaving, dead)


def _weight_grad_rows(g, rows: int, module: str, p) -> dict:
    """{row input: dim} of the op making an expert weight's gradient: rows^T x rows (a
    weight), or a sum over the rows (a bias)."""
    if g.target is aten.mm.default:
        a, b = g.args
        if _val(a).shape[1] == rows and _val(b).shape[0] == rows:
            return {a: 1, b: 0}
    if g.target is aten.sum.dim_IntList and list(g.args[1]) == [0] and \
            _val(g.args[0]).shape[0] == rows:
        return {g.args[0]: 0}
    raise PlanError(f"Plan.ep: the gradient of the expert weight {p.meta[ir.FQN]} of "
                    f"{module!r} is made by {g.name} ({g.target}), not by a sum over the "
                    "expert's rows; expert parallelism over nn.ModuleList experts needs each "
                    "weight read once per row. Use ep=1 for this model.")


def _rewrite_list(gm: torch.fx.GraphModule, lst: ExpertList, ep: int, group: str,
                  index: dict) -> list:
    """Slot j runs expert j's region on this rank's expert's rows; returns each slot
    parameter's program indices (`index`: parameter placeholder -> its index) per ep rank
    ([[index on rank 0, on rank 1, ...], ...])."""
    graph, experts, rows = gm.graph, lst.experts, lst.rows
    per_rank = len(experts) // ep
    out = next(n for n in graph.nodes if n.op == "output")
    vals = list(out.args[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    slots = []
    for j in range(per_rank):
        mine = [experts[r * per_rank + j] for r in range(ep)]
        t = mine[0]
        for e, x in enumerate(t.entering):
            users = [u for u in x.users if u in t.region]
            with graph.inserting_before(min(users, key=order.get)):
                picked = _emit(graph, torch.ops.fxpar.expert_pick.default,
                               ([m.entering[e] for m in mine], group), users[0])
            _in_first_part(picked, users)
            for u in users:
                u.replace_input_with(x, picked)
        for i, y in enumerate(t.leaving):
            outside = [[u for u in m.leaving[i].users if u not in m.region] for m in mine]
            with graph.inserting_after(y):
                started = _emit(graph, c10d.all_gather_into_tensor.default, (y, ep, group), y,
                                region=ir.COMM)
            with graph.inserting_after(started):
                whole = _emit(graph, c10d.wait_tensor.default, (started,), y, region=ir.COMM)
            anchor = whole
            for r, m in enumerate(mine):
                with graph.inserting_after(anchor):
                    piece = _emit(graph, aten.slice.Tensor, (whole, 0, r * rows, (r + 1) * rows),
                                  y)
                anchor = piece
                for u in outside[r]:
                    u.replace_input_with(m.leaving[i], piece)
        for name in t.params:
            slots.append([index[m.params[name]] for m in mine])
        for m in mine[1:] if out.meta.get(ir.N_GRADS) else ():
            for p in m.params.values():
                vals[1 + index[p]] = None
    out.args = (type(out.args[0])(vals),)
    gone, erased = set().union(*(e.dead for e in experts[per_rank:])), set()
    for n in reversed(list(graph.nodes)):
        if n in gone and not n.users:
            graph.erase_node(n)
            erased.add(n)
    left = [n for n in gone - erased if n.op != "placeholder"]
    if left:  # (read by something the rewrite did not reach: the expert's weights would be
        # another rank's there)
        n = min(left, key=order.get)
        raise PlanError(f"Plan.ep: {n.name} ({n.target}) of an expert of {lst.module!r} is "
                        f"also read by {sorted(u.name for u in n.users)} outside the expert; "
                        "expert parallelism runs each expert on one rank only. Use ep=1 for "
                        "this model.")
    deps = networkx.DiGraph((x, n) for n in graph.nodes for x in n.all_input_nodes)
    if not networkx.is_directed_acyclic_graph(deps):
        raise PlanError(f"Plan.ep: the experts of {lst.module!r} read each other's results "
                        "(no order runs each slot after the rows of all its experts); expert "
                        "parallelism runs experts side by side. Use ep=1 for this model.")
    stable_topological_sort(graph)
    return slots

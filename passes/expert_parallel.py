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

Other MoE forms (an experts loop over nn.ModuleList, batched matmuls over gathered
weights) are refused by name: their experts are not one parameter to split.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

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
_PHASES = ("F", "B", "I", "W", "R")  # a pipeline's parts of a stage, in the order they run


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
    provides=frozenset({ir.EXPERT_PARAMS, ir.EP_REPORT, ir.DYNAMIC_ROWS}),
    # the data-parallel pass shards the rewritten graph: its engine carries the ep group's
    # collectives as another mesh axis's
    before=frozenset({"data_parallel", "overlap", "fusion"}),
    after=frozenset({"precision", "remat"}),
    applies=lambda o: (o.ep or 1) > 1,
    values_fresh=True)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    ep = options.ep
    group = ctx.group_names["ep"]
    layers = find_layers(gm)
    if not layers:
        raise PlanError(
            f"Plan.ep={ep}: no MoE layer of grouped matmuls found on the graph. Expert "
            "parallelism splits experts stored as one parameter [experts, ...] and run by "
            "aten._grouped_mm (Hugging Face's experts by default, "
            "config._experts_implementation='grouped_mm'); an experts loop over "
            "nn.ModuleList or 'batched_mm' experts cannot be split. Use ep=1 (ZeRO or tp "
            "shard such experts like any weight).")
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "param"]
    index = {n: i for i, n in enumerate(params)}
    split, report = set(), []
    # the layers whose dispatch the dp pass runs on each rank's own rows: their rows go to
    # their experts' ranks and back by all-to-all; the others' rows are every dp rank's
    local = batch_local_dispatch(gm, options.dp or 1)
    for layer in layers:
        e = layer.offs.meta[ir.VAL].numel()
        if e % ep:
            raise PlanError(f"Plan.ep={ep}: the MoE layer {layer.module!r} has {e} experts, "
                            f"which do not split evenly over {ep} ranks. Use an ep that "
                            f"divides {e}.")
        tp_split = [w.meta[ir.FQN] for w in layer.weights
                    if (gm.meta.get(ir.TP_LAYOUTS) or [None] * len(params))[index[w]]]
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
    gm.graph.lint()
    gm.recompile()
    fake_propagate(gm, check=False)
    gm.meta[ir.EXPERT_PARAMS] = sorted(index[w] for w in split)
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


def _layer(offs, mms, every: set) -> Layer:
    """`every`: the graph's grouped matmuls (remat's recomputed copy of a layer has offs of
    its own, and reads the same weights)."""
    module = next((m.meta.get(ir.MODULE, "") for m in mms if m.meta.get(ir.MODULE)), "")
    rows = next(_val(a).shape[d] for m in mms for a, d in _roles(m))
    # forward from every matmul's rows out, backward from every matmul's rows in, through
    # row-wise ops: the region is what lies on both (the ops between grouped matmuls)
    fwd: dict = {}
    todo = [(m, 0) for m in mms if _val(m).dim() == 2]
    while todo:
        n, r = todo.pop()
        if fwd.get(n) == r:
            continue
        fwd[n] = r
        for u in n.users:
            c = _out_row(u, n, r, rows)
            if c is not None:
                todo.append((u, c))
    bwd: dict = {}
    todo = [x for m in mms for x in _roles(m)]
    while todo:
        n, r = todo.pop()
        if bwd.get(n) == r:
            continue
        bwd[n] = r
        ins = _row_inputs(n, r, rows)
        todo.extend((ins or {}).items())
    region = {n: r for n, r in fwd.items() if bwd.get(n) == r}
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
        phases = [u.meta[ir.PHASE] for u in users if ir.PHASE in u.meta]
        if phases:  # (a pipeline part: the first of its readers' to run)
            moved.meta[ir.PHASE] = min(phases, key=_PHASES.index)
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
        phases = [u.meta[ir.PHASE] for u in users if ir.PHASE in u.meta]
        if phases:  # (a pipeline part: the first of its readers' to run)
            sent.meta[ir.PHASE] = min(phases, key=_PHASES.index)
        for u in users:
            u.replace_input_with(x, sent)
    for y in layer.leaving:
        users = [u for u in y.users if u not in layer.region]
        with graph.inserting_after(y):
            back = _emit(graph, torch.ops.fxpar.ep_combine.default, (y, route, group), y)
        for u in users:
            u.replace_input_with(y, back)

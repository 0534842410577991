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
  (fxpar::ep_combine). Each all-to-all is followed by its `wait_tensor`, as a functional
  collective is: the overlap pass moves them (the runtime issues them asynchronously). The
  expert gradients are the ep group's rows' for this rank's experts: partial over the
  groups, summed over "edp" by the dp pass.
- gathered rows, where the dispatch reads every row (a capacity over the sorted rows) and
  the dp pass makes the rows whole on every dp rank: this rank's run of the sorted rows is
  moved to the front of each row tensor entering the region (a gather by `idx = arange(S)
  + start`; fxpar::expert_window reads the rank's start and local offs from the global
  offs: one graph for every rank), the grouped matmuls run on it (rows past the local offs
  are never computed), and where a row tensor leaves the region its run is put back in
  place, zeros elsewhere, and all-reduced over the ep group: every row is made by exactly
  one rank. The expert gradients are then complete (every token's), reduced by nobody.

Experts kept as an nn.ModuleList (an experts loop, each expert run on the rows routing picks
for it) run grouped where passes/grouped_experts could group them: each grouped matmul reads
a stack of the experts' matrices, of which a rank keeps the first E/ep, slots bound to its
own experts (`_split_stacks`), its rows moved as above; else they run in slots as traced
(see "experts written as nn.ModuleList" below). Experts stacked in one parameter and read
one at a time by a loop (Hugging Face's eager experts; DBRX's [E * out, in] viewed as the
stack) run grouped reading the parameter itself, split along dim 0 as Hugging Face's
grouped experts are; where they could not be grouped they are refused by name, as are
batched matmuls over gathered weights: their experts are not one parameter to split.
"""
from __future__ import annotations

import dataclasses

import networkx
import torch
import torch.fx
from torch._inductor.pattern_matcher import stable_topological_sort

from fxpar.core import experts as _experts  # noqa: F401  (registers fxpar::expert_window)
from fxpar.core import sharding as _sharding  # noqa: F401  (registers fxpar::local_chunk)
from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.expert_lists import GROUPED_MM as _GROUPED_MM, TRANSPOSES as _TRANSPOSES
from fxpar.core.expert_lists import WEIGHT_PATH as _WEIGHT_PATH, ExpertList, find_expert_lists
from fxpar.core.expert_lists import between as _between, check_one_stage, param_behind
from fxpar.core.expert_lists import roles as _roles
from fxpar.core.expert_lists import row_inputs as _row_inputs, val as _val
from fxpar.core.graphs import fake_propagate
from fxpar.core.sharding import batch_local_dispatch

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    ep: int = 1
    dp: int | None = 1


CONTRACT = ir.PassContract(
    "expert_parallel", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.MODULE, ir.ROLE, ir.FQN}),
    # the nodes it adds join their neighbours' pipeline part; tp's layouts of the weights it
    # splits (a slot's experts split alike)
    reads=frozenset({ir.STAGE, ir.PHASE, ir.TP_LAYOUTS}),
    provides=frozenset({ir.EXPERT_PARAMS, ir.EXPERT_SLOTS, ir.EP_REPORT, ir.DYNAMIC_ROWS,
                        ir.EP_TOKENS}),
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
    dense = find_dense_layers(gm)
    if not layers and not lists and not dense:
        batched = [f"{r['module']!r}: {r['why']}" for r in
                   gm.meta.get(ir.BATCHED_EXPERTS) or () if not r["grouped"]]
        raise PlanError(
            f"Plan.ep={ep}: no MoE layer found on the graph. Expert parallelism splits experts "
            "stored as one parameter [experts, ...] and run by aten._grouped_mm (Hugging "
            "Face's experts by default, config._experts_implementation='grouped_mm', and its "
            "'batched_mm' experts, which fxpar runs grouped), or "
            "kept as an nn.ModuleList of identical experts each run on the rows routed to it, "
            "or stacked and read one expert at a time by a loop (Hugging Face's 'eager' "
            "experts), or run on every token by batched matmuls with parameters [experts, "
            "...] (Llama 4's). Use ep=1 (ZeRO or tp shard such "
            "experts like any weight)." + (" Lists of identical modules that are not experts: " +
                                   "; ".join(skipped) + "." if skipped else "") +
            (" Experts picking their weights per row left as traced: " + "; ".join(batched) +
             "." if batched else ""))
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "param"]
    index = {n: i for i, n in enumerate(params)}
    layouts = gm.meta.get(ir.TP_LAYOUTS) or [None] * len(params)
    split, report = set(), []
    # the layers whose dispatch the dp pass runs on each rank's own rows: their rows go to
    # their experts' ranks and back by all-to-all; the others' rows are every dp rank's
    local = batch_local_dispatch(gm, options.dp or 1) if layers else {}
    slots, unread = [], set()  # (unread: the other ranks' experts' matrices)
    for layer in layers:
        e = layer.offs.meta[ir.VAL].numel()
        _check_divides(layer.module, e, ep)
        all_to_all = all(m in local for m in layer.matmuls)
        if any(w.target is aten.stack.default for w in layer.weights):  # (listed experts,
            # grouped: passes/grouped_experts)
            if not all(w.target is aten.stack.default for w in layer.weights):
                raise PlanError(f"Plan.ep: the MoE layer {layer.module!r} multiplies both "
                                "stacked and stored expert weights; report it to fxpar.")
            mine, others = _split_stacks(gm, layer, e // ep, ep, index)
            unread |= others
            _check_split_alike(mine, layouts, params, layer.module, ep)
            if all_to_all:
                _rewrite_all_to_all(gm.graph, layer, e // ep, group, ep)
            else:
                _rewrite(gm.graph, layer, e // ep, group)
            slots += [m for m in mine if m not in slots]  # (a layer's recomputed copy)
            report.append({"module": layer.module, "experts": e, "per_rank": e // ep,
                           "rows": layer.rows, "weights": [params[k].meta[ir.FQN]
                                                           for s in mine for k in s],
                           "region": len(layer.region), "entering": len(layer.entering),
                           "leaving": len(layer.leaving),
                           "dispatch": ("all-to-all" if all_to_all else "gathered rows")
                           + ", grouped slots"})
            continue
        # (tp may split the stacks along their features, each expert's matrix alike: ep
        # takes dim 0, runtime/trainer.splits_of applies both)
        _check_not_tp_split(layer.weights, layouts, index, ep)
        if all_to_all:
            _rewrite_all_to_all(gm.graph, layer, e // ep, group, ep)
        else:
            _rewrite(gm.graph, layer, e // ep, group)
        _split_along_experts(layer.weights, split, ep)
        report.append(_entry(layer, e, ep, layer.rows,
                             "all-to-all" if all_to_all else "gathered rows"))
    every = {m for layer in dense for m in layer.matmuls}
    for layer in dense:
        _check_divides(layer.module, layer.experts, ep)
        _check_not_tp_split(layer.weights, layouts, index, ep)
        for w in layer.weights:
            _only_experts_read(w, every, layer.experts, layer.module)
        stages = sorted({n.meta[ir.STAGE] for n in layer.region if ir.STAGE in n.meta})
        if len(stages) > 1:  # (a stage transfer inside would carry a value ep resizes)
            raise PlanError(f"Plan.ep: a pipeline stage boundary falls inside the MoE layer "
                            f"{layer.module!r} (its experts' values span stages {stages}); "
                            "expert parallelism runs a layer's experts within one stage. Use "
                            "another pp, or ep=1.")
    for layer in dense:  # (after every check: a layer's recomputed copy reads its weights)
        _rewrite_dense(gm.graph, layer, ep, group)
        _split_along_experts(layer.weights, split, ep)
        report.append(_entry(layer, layer.experts, ep, layer.tokens, "all-to-all, every token"))
    read = sorted(p.meta[ir.FQN] for p in unread if p.users)
    if read:  # (after every layer's stacks are cut: a recomputed copy reads them too)
        raise PlanError(f"Plan.ep: the expert weights {read[:4]} are also read outside the "
                        "experts' grouped matmuls; expert parallelism runs each expert on one "
                        "rank only. Use ep=1 for this model.")
    for lst in lists:
        e = len(lst.experts)
        if lst.stacks:  # (grouped by passes/grouped_experts where they can be: a layer above)
            why = next((r["why"] for r in gm.meta.get(ir.GROUPED_EXPERTS) or ()
                        if r["module"] == lst.module and r["why"]), None) or \
                "they were not run grouped"
            raise PlanError(f"Plan.ep={ep}: the experts of {lst.module!r} are stacked weights "
                            "[experts, ...] a loop reads one expert at a time (Hugging Face's "
                            "'eager' experts); expert parallelism splits them where they "
                            f"run as one grouped matmul, and here they do not: {why}. Use ep=1 "
                            "(ZeRO or tp shard them like any weight), or "
                            "config._experts_implementation='grouped_mm'.")
        _check_divides(lst.module, e, ep)
        check_one_stage(lst.module, lst.experts)
        mine = _rewrite_list(gm, lst, ep, group, index)
        _check_split_alike(mine, layouts, params, lst.module, ep)
        slots += mine
        first = lst.experts[0]
        report.append({"module": lst.module, "experts": e, "per_rank": e // ep,
                       "rows": lst.rows, "weights": [p.meta[ir.FQN] for x in lst.experts
                                                     for p in x.params.values()],
                       "region": len(first.region), "entering": len(first.entering),
                       "leaving": len(first.leaving), "dispatch": "expert slots"})
    # (a dispatch sits before its rows' first reader, the route after the counts: where remat
    # recomputes the counts after that reader, the dispatch and what reads it follow them)
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    fake_propagate(gm, check=False)
    gm.meta[ir.EXPERT_PARAMS] = sorted(index[w] for w in split)
    gm.meta[ir.EXPERT_SLOTS] = slots
    gm.meta[ir.EP_REPORT] = report
    return gm


def _check_divides(module: str, experts: int, ep: int) -> None:
    if experts % ep:
        raise PlanError(f"Plan.ep={ep}: the MoE layer {module!r} has {experts} experts, "
                        f"which do not split evenly over {ep} ranks. Use an ep that divides "
                        f"{experts}.")


def _check_not_tp_split(weights, layouts, index, ep) -> None:
    """ep splits the experts' weights along dim 0: tp must not split them there too."""
    tp_split = [w.meta[ir.FQN] for w in weights
                if layouts[index[w]] and 0 in (layouts[index[w]][0], layouts[index[w]][1])]
    if tp_split:
        raise PlanError(f"Plan.ep={ep}: tensor parallelism splits the expert weights "
                        f"{tp_split} along their experts (dim 0), which ep splits; one dim "
                        "takes one split. Use ep=1 or tp=1.")


def _split_along_experts(weights, split: set, ep: int) -> None:
    """Each weight's value becomes this rank's E/ep experts (once: layers share weights)."""
    for w in weights:
        if w not in split:
            v = w.meta[ir.VAL]
            w.meta[ir.VAL] = v.new_empty((v.shape[0] // ep, *v.shape[1:]))
            split.add(w)


def _entry(layer, experts: int, ep: int, rows: int, dispatch: str) -> dict:
    """A layer's line of the ep report."""
    return {"module": layer.module, "experts": experts, "per_rank": experts // ep,
            "rows": rows, "weights": [w.meta[ir.FQN] for w in layer.weights],
            "region": len(layer.region), "entering": len(layer.entering),
            "leaving": len(layer.leaving), "dispatch": dispatch}


def _check_split_alike(slots, layouts, params, module, ep) -> None:
    """A slot's weight is each ep rank's expert: tp must split them alike."""
    for slot in slots:
        if len({layouts[k] for k in slot}) > 1:
            names = [params[k].meta[ir.FQN] for k in slot]
            raise PlanError(f"Plan.ep={ep}: tensor parallelism splits the experts' weights "
                            f"{names} of {module!r} differently "
                            f"({[layouts[k] for k in slot]}); a slot runs each ep rank's "
                            "expert on the same split. Use ep=1 or tp=1.")


# --- finding the layers ---------------------------------------------------------------------

@dataclasses.dataclass
class Layer:
    """One MoE layer: its offs, grouped matmuls, row-wise region (node -> row dim), the
    weights it splits (parameters [experts, ...], or stacks of one matrix per listed expert),
    the row tensors entering the region and the region's nodes whose rows leave it."""
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


def _layer(offs, mms, every: set) -> Layer:
    """`every`: the graph's grouped matmuls (remat's recomputed copy of a layer has offs of
    its own, and reads the same weights)."""
    module = next((m.meta.get(ir.MODULE, "") for m in mms if m.meta.get(ir.MODULE)), "")
    rows = next(_val(a).shape[d] for m in mms for a, d in _roles(m))
    # forward from every matmul's rows out, backward from every matmul's rows in, through
    # row-wise ops: the region is what lies on both (the ops between grouped matmuls)
    region = _between([(m, 0) for m in mms if _val(m).dim() == 2],
                      [x for m in mms for x in _roles(m)], rows)
    _with_matmuls(region, {m: (0 if _val(m).dim() == 2 else None, _roles(m)) for m in mms})
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
    experts = _val(offs).numel()
    for m in mms:
        if _val(m).dim() == 2:
            w = _stack_of(m.args[1], experts) or _weight_of(m.args[1], m, module)
            if w not in weights:
                weights.append(w)
    for w in weights:
        if w.target is not aten.stack.default:
            _only_experts_read(w, every, experts, module)
    return Layer(offs, rows, mms, region, weights, list(entering), leaving, module)


def _with_matmuls(region: dict, roles: dict) -> None:
    """Adds to `region` its matmuls (matmul -> (its own rows dim, None for a weight gradient
    in expert space; its (operand, rows dim) pairs)), their transposed operands (rows^T of a
    weight gradient) and a split's pieces."""
    for m, (r, operands) in roles.items():
        region[m] = r
        for a, d in operands:
            if a.target in _TRANSPOSES and a not in region:
                region[a] = d
    for n in list(region):
        if isinstance(_val(n), (tuple, list)):
            for u in n.users:
                region.setdefault(u, region[n])


def _only_experts_read(w, mms: set, experts: int, module: str) -> None:
    """Split along dim 0, an expert weight must be read only by grouped matmuls (`mms`: each
    rewritten with its layer's local offs), as their experts operand, through casts, views
    and transposes that keep dim 0 the experts; and dim 0 must be the experts: any other
    reader would compute on this rank's slice alone."""
    viewed = _val(w).dim() != 3 and _val(w).shape[0] % experts == 0 and all(
        u.target in ir.RESHAPES and _val(u).dim() == 3 and _val(u).shape[0] == experts and
        u.args[1][0] == -1 for u in w.users)  # (a parameter [E * out, in] viewed [-1, out, in]
    # as DBRX's: split along dim 0 it holds this rank's experts, the view follows)
    if not viewed and (_val(w).dim() != 3 or _val(w).shape[0] != experts):
        raise PlanError(f"Plan.ep: the weight {w.meta.get(ir.FQN, w.name)} of the MoE layer "
                        f"{module!r} is {tuple(_val(w).shape)}, not [{experts} experts, ...]; "
                        "expert parallelism splits a 3-D weight along its experts.")
    todo = [w]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in mms and n in u.args[:2]:  # (an experts operand: grouped matmuls' second,
                # either of a batched matmul's)
                continue
            v = _val(u)
            keeps = (_keeps_experts(u) or _tp_chunk(u)) and isinstance(v, torch.Tensor) and \
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


def _keeps_experts(n) -> bool:
    """A cast, view or transpose on a weight's way to a grouped matmul (a permute that keeps
    dim 0 first: `W.T` of each expert's matrix)."""
    return n.target in _WEIGHT_PATH or (n.target is aten.permute.default and
                                        n.args[1][0] % len(n.args[1]) == 0)


def _stack_of(x, experts: int):
    """The stack of one matrix per expert that `x` is (passes/grouped_experts: listed experts
    run grouped), else None (through tp's chunk of it along the features, as _weight_of)."""
    while x.op == "call_function" and (x.target in _WEIGHT_PATH or _tp_chunk(x)):
        x = x.args[0]
    if x.target is aten.stack.default and len(x.args[0]) == experts and \
            (len(x.args) < 2 or x.args[1] == 0):
        return x
    return None


def _split_stacks(gm: torch.fx.GraphModule, layer: Layer, per_rank: int, ep: int,
                  index: dict) -> list:
    """Listed experts run grouped: each stack of their matrices keeps its first E/ep, which
    are slots (each ep rank binds its own experts to them, as `_rewrite_list`'s); the other
    experts' matrices and gradients leave the graph. Returns the slots' parameter indices
    per ep rank, and the other experts' parameters (read by nothing once every layer's
    stacks are cut)."""
    graph, module = gm.graph, layer.module
    experts = per_rank * ep
    out = next(n for n in graph.nodes if n.op == "output")
    vals = list(out.args[0])
    held: list[dict] = [{} for _ in range(experts)]  # expert -> its matrices, in stack order
    gone = set()
    for st in layer.weights:
        elems = list(st.args[0])
        if len(elems) != experts:  # (a stack two layers share: cut for the first)
            raise PlanError(f"Plan.ep: the stacked expert weights {st.name} of {module!r} "
                            "are read by two MoE layers; report this model to fxpar.")
        for j, x in enumerate(elems):
            held[j].setdefault(_weight_of(x, st, module, leaf=True), None)
        st.args = (elems[:per_rank], *st.args[1:])
        gone.update(elems[per_rank:])
    roles = [list(h) for h in held]
    if len({len(r) for r in roles}) != 1:
        raise PlanError(f"Plan.ep: the experts of {module!r} stack different numbers of "
                        "matrices; expert parallelism binds each rank's experts to slots of "
                        "one shape. Use ep=1 for this model.")
    others = {p for r in roles[per_rank:] for p in r}
    if out.meta.get(ir.N_GRADS):  # (another rank's expert: no gradient here)
        for p in others:
            g, vals[1 + index[p]] = vals[1 + index[p]], None
            if isinstance(g, torch.fx.Node):
                gone.add(g)
        out.args = (type(out.args[0])(vals),)
    for n in reversed(list(graph.nodes)):  # (the other experts' views and gradient picks)
        if n in gone and not n.users and n.op == "call_function":
            gone.update(n.all_input_nodes)
            graph.erase_node(n)
    return [[index[roles[r * per_rank + j][k]] for r in range(ep)]
            for j in range(per_rank) for k in range(len(roles[0]))], others


def _tp_chunk(n) -> bool:
    """A tp rank's chunk of an expert weight along its features (DTensor's grouped-matmul
    rule picks it where the rows arrive split on features): it reads this rank's E/ep experts
    as well as all E."""
    return n.op == "call_function" and n.target is torch.ops.fxpar.local_chunk.default and \
        n.args[1] % _val(n).dim() != 0


def _weight_of(x, mm, module, leaf: bool = False):
    """The parameter `x` (an operand of grouped matmul or stack `mm`) views. `leaf`: x is one
    expert's matrix in a stack (a tp chunk of it on any dim keeps the expert whole)."""
    n = x
    while n.op == "call_function" and (_keeps_experts(n) or _tp_chunk(n) or (
            leaf and n.target is torch.ops.fxpar.local_chunk.default)):
        n = n.args[0]
    if n.op == "call_function" and n.target is torch.ops.fxpar.local_chunk.default:
        raise PlanError(f"Plan.ep: tensor parallelism splits the experts of {module!r} "
                        f"along their experts (a local_chunk of their weight on dim 0 feeds "
                        f"{mm.name}); one dim takes one split. Use ep=1 (experts split over "
                        "tp) or tp=1.")
    if n.op != "placeholder" or n.meta.get(ir.ROLE) != "param":
        raise PlanError(f"Plan.ep: the experts' weight of the grouped matmul {mm.name} "
                        f"(module {module!r}) is computed by {n.name} ({n.target}), not a "
                        "parameter; expert parallelism splits parameters [experts, ...].")
    return n


# --- experts that run every token -----------------------------------------------------------

@dataclasses.dataclass
class DenseLayer:
    """An MoE layer whose experts all run every token (Llama 4's: `bmm` of the routed inputs
    viewed [experts, tokens, ...] by parameters [experts, ...], the routing scores zeroing
    the rest), forward and backward. `region`: node -> its tokens dim (None: a weight
    gradient, summed over the tokens); `entering` / `leaving`: (node, tokens dim) where the
    tokens come in and go out."""
    module: str
    experts: int
    tokens: int
    matmuls: list
    region: dict
    weights: list
    entering: list
    leaving: list


def _expert_weight(x, experts: int):
    """The parameter [experts, ...] operand `x` of a batched matmul reads through casts,
    views and transposes that keep dim 0 its experts, else None."""
    while x.op == "call_function" and _keeps_experts(x):
        v = _val(x)
        if not isinstance(v, torch.Tensor) or v.dim() != 3 or v.shape[0] != experts or (
                x.target is aten.transpose.int and 0 in {d % 3 for d in x.args[1:3]}):
            return None
        x = x.args[0]
    w = param_behind(x)
    return w if w is x and _val(w).dim() == 3 and _val(w).shape[0] == experts else None


def find_dense_layers(gm: torch.fx.GraphModule) -> list[DenseLayer]:
    """Every MoE layer whose experts run every token: batched matmuls by a parameter
    [experts, ...] (a reader: the tokens its other operand's dim 1, or dim 2 where the
    weight comes first), the weight gradients (`bmm` summing over the tokens) and the
    token-wise ops between them; one layer per connected region."""
    graph = gm.graph
    params = [n for n in graph.nodes if n.op == "placeholder" and n.meta.get(ir.ROLE) == "param"]
    out = next(n for n in graph.nodes if n.op == "output")
    n_grads = out.meta.get(ir.N_GRADS) or 0
    grads = dict(zip(params, out.args[0][1:1 + n_grads])) if n_grads else {}
    roles, weight = {}, {}  # matmul -> ({operand: tokens dim}, its own tokens dim)
    for n in graph.nodes:
        if n.target is not aten.bmm.default:
            continue
        a, b = n.args[:2]
        e = _val(n).shape[0]
        if e < 2:  # (one expert, nothing to split: Inkling's one shared expert, stacked)
            continue
        for w_arg, x, d in ((b, a, 1), (a, b, 2)):
            w = _expert_weight(w_arg, e)
            if w is not None:
                roles[n], weight[n] = ({x: d}, d), w
                break
    for w in set(weight.values()):  # its gradient: bmm(x^T [E, K, tokens], g [E, tokens, N])
        g = grads.get(w)
        while isinstance(g, torch.fx.Node) and g.op == "call_function" and _keeps_experts(g):
            g = g.args[0]
        if isinstance(g, torch.fx.Node) and g.target is aten.bmm.default and g not in roles:
            roles[g], weight[g] = ({g.args[0]: 2, g.args[1]: 1}, None), w
    by_tokens: dict[int, list] = {}
    for m, (ins, d) in roles.items():
        if d is not None:
            x, xd = next(iter(ins.items()))
            by_tokens.setdefault(_val(x).shape[xd], []).append(m)
    for m, (ins, d) in roles.items():  # (a weight gradient joins its readers' tokens)
        if d is None:
            t = _val(m.args[1]).shape[1]
            by_tokens.setdefault(t, []).append(m)
    layers = []
    for tokens, mms in by_tokens.items():
        given = {m: roles[m][0] for m in mms}
        region = _between([(m, roles[m][1]) for m in mms if roles[m][1] is not None],
                          [x for m in mms for x in roles[m][0].items()], tokens, given)
        _with_matmuls(region, {m: (roles[m][1], roles[m][0].items()) for m in mms})
        parts = networkx.Graph()
        parts.add_nodes_from(region)
        parts.add_edges_from((x, n) for n in region for x in n.all_input_nodes if x in region)
        for nodes in networkx.connected_components(parts):
            layers.append(_dense_layer({n: region[n] for n in region if n in nodes},
                                       [m for m in mms if m in nodes], given, weight, tokens))
    return sorted(layers, key=lambda layer: layer.module)


def _dense_layer(region: dict, mms: list, given: dict, weight: dict, tokens: int) -> DenseLayer:
    """One connected region, checked: each value's dim 0 its experts, no op moving values
    between experts (a transpose, split or concatenation along dim 0)."""
    params = [n for n in mms[0].graph.nodes if n.op == "placeholder"]
    weights = sorted({weight[m] for m in mms}, key=params.index)
    names = [w.meta.get(ir.FQN, w.name) for w in weights]
    module = ".".join(names[0].split(".")[:-1]) if all(
        n.rsplit(".", 1)[0] == names[0].rsplit(".", 1)[0] and "." in n for n in names) \
        else ", ".join(names)  # (the experts' module, else their weights)
    experts = _val(mms[0]).shape[0]
    for n in region:
        v = _val(n)
        v = v[0] if isinstance(v, (tuple, list)) else v
        at = 2 if n.target in (aten.split.Tensor, aten.split_with_sizes.default) else \
            1 if n.target in (aten.cat.default, aten.slice.Tensor) else None
        dim = None if at is None else n.args[at] if len(n.args) > at else n.kwargs.get("dim", 0)
        moves = (n.target is aten.transpose.int and 0 in {d % v.dim() for d in n.args[1:3]}) \
            or n.target is aten.t.default or (n.target is aten.permute.default and
                                              n.args[1][0] % v.dim() != 0)
        if not isinstance(v, torch.Tensor) or v.dim() < 2 or v.shape[0] != experts or moves \
                or (dim is not None and dim % v.dim() == 0):
            raise PlanError(f"Plan.ep: {n.name} ({n.target}) in the MoE layer {module!r}, "
                            "whose experts run every token, does not keep dim 0 its experts; "
                            "expert parallelism splits that dim over the ep ranks. Use ep=1 "
                            "for this model.")
    entering: dict = {}
    for n, r in region.items():
        for x, d in (given[n] if n in given else _row_inputs(n, r, tokens) or {}).items():
            if x in region:
                continue
            if _val(x).shape[0] != experts:
                raise PlanError(f"Plan.ep: {x.name} ({x.target}) enters the MoE layer "
                                f"{module!r}, whose experts run every token, as "
                                f"{list(_val(x).shape)}, not [{experts} experts, ...]: a value "
                                "made from every expert's, which expert parallelism holds on "
                                "different ranks. Use ep=1 for this model.")
            if entering.setdefault(x, d) != d:
                raise PlanError(f"Plan.ep: {x.name} enters the MoE layer {module!r} with its "
                                f"tokens on dims {entering[x]} and {d}; report this model to "
                                "fxpar, and use ep=1 for it.")
    leaving = [(n, r) for n, r in region.items() if r is not None and not isinstance(
        _val(n), (tuple, list)) and any(u not in region for u in n.users)]
    return DenseLayer(module, experts, tokens, mms, region, weights, list(entering.items()),
                      leaving)


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
    for n in [n for n, r in layer.region.items()
              if n.target is aten.slice_backward.default and r is not None]:
        _unsized_slice_backward(graph, layer, n, layer.region[n])
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
            sent = _emit(graph, torch.ops.fxpar.ep_dispatch.default, (x, route, group), first,
                         region=ir.COMM)
            got = _emit(graph, c10d.wait_tensor.default, (sent,), first, region=ir.COMM)
        for n in (sent, got):
            n.meta[ir.DYNAMIC_ROWS] = True
            _in_first_part(n, users)
        for u in users:
            u.replace_input_with(x, got)
    for y in layer.leaving:
        users = [u for u in y.users if u not in layer.region]
        with graph.inserting_after(y):
            sent = _emit(graph, torch.ops.fxpar.ep_combine.default, (y, route, group), y,
                         region=ir.COMM)
        with graph.inserting_after(sent):
            back = _emit(graph, c10d.wait_tensor.default, (sent,), y, region=ir.COMM)
        for u in users:
            u.replace_input_with(y, back)


def _rewrite_dense(graph: torch.fx.Graph, layer: DenseLayer, ep: int, group: str) -> None:
    """Each rank runs its E/ep experts on the ep group's tokens: every value entering the
    layer [E, ..., tokens, ...] is sent by an all-to-all of equal parts (experts r E/ep ..
    to rank r) and its parts laid side by side along the tokens ([E/ep, ..., tokens x ep,
    ...], each token's ep parts together: data parallelism's split of the tokens stays a
    plain shard); every value leaving goes back the same way. No sizes depend on data.
    The weights' gradients are the group's tokens' for this rank's experts: partial over the
    groups, summed over "edp" by the dp pass."""
    per, tokens = layer.experts // ep, layer.tokens
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n, r in layer.region.items():  # a size argument of the node's own shape (a slice's
        # gradient): this rank's experts, the group's tokens
        shape = list(_val(n).shape) if isinstance(_val(n), torch.Tensor) else None
        for i, a in enumerate(n.args):
            if shape is not None and isinstance(a, (list, tuple)) and list(a) == shape:
                a = [per, *shape[1:]]
                if r is not None:
                    a[r] = tokens * ep
                n.update_arg(i, a)

    def emit(target, args, like, region=None, kwargs=None):
        return _emit(graph, target, args, like, region=region, kwargs=kwargs)

    for x, d in layer.entering:
        users = [u for u in x.users if u in layer.region]
        shape = list(_val(x).shape)
        with graph.inserting_before(min(users, key=order.__getitem__)):
            sent = emit(c10d.all_to_all_single.default, (x, [per] * ep, [per] * ep, group),
                        users[0], region=ir.COMM)
            sent.meta[ir.EP_TOKENS] = (d, "send")
            got = emit(c10d.wait_tensor.default, (sent,), users[0], region=ir.COMM)
            parts = emit(aten.view.default, (got, [ep, per, *shape[1:]]), users[0])
            side = emit(aten.permute.default, (parts, [*range(1, d + 2), 0,
                                                       *range(d + 2, len(shape) + 1)]), users[0])
            dense = emit(aten.clone.default, (side,), users[0],
                         kwargs={"memory_format": torch.contiguous_format})
            mine = emit(aten.view.default, (dense, [per, *shape[1:d], tokens * ep,
                                                    *shape[d + 1:]]), users[0])
        for n in (sent, got, parts, side, dense, mine):
            _in_first_part(n, users)
        for u in users:
            u.replace_input_with(x, mine)
    for y, r in layer.leaving:
        users = [u for u in y.users if u not in layer.region]
        shape = list(_val(y).shape)
        with graph.inserting_after(y):
            parts = emit(aten.view.default, (y, [per, *shape[1:r], tokens, ep, *shape[r + 1:]]),
                         y)
        with graph.inserting_after(parts):
            ahead = emit(aten.permute.default, (parts, [r + 1, *range(r + 1),
                                                        *range(r + 2, len(shape) + 1)]), y)
        with graph.inserting_after(ahead):
            dense = emit(aten.clone.default, (ahead,), y,
                         kwargs={"memory_format": torch.contiguous_format})
        with graph.inserting_after(dense):
            sent = emit(c10d.all_to_all_single.default, (dense, [1] * ep, [1] * ep, group), y,
                        region=ir.COMM)
            sent.meta[ir.EP_TOKENS] = (r + 1, "return")
        with graph.inserting_after(sent):
            back = emit(c10d.wait_tensor.default, (sent,), y, region=ir.COMM)
        with graph.inserting_after(back):
            whole = emit(aten.view.default, (back, shape), y)
        for u in users:
            u.replace_input_with(y, whole)


def _unsized_slice_backward(graph, layer: Layer, n: torch.fx.Node, r: int) -> None:
    """slice_backward(g, sizes, d, start, end, step) (a slice's gradient along a feature dim:
    GPT-OSS's gate and up, every other feature) written without the rows' count, which its
    `sizes` fixes and the received rows do not have: g padded with zeros along d, or for a
    step, `g.unsqueeze(d + 1)` padded to [.., N / step, step, ..] and viewed [.., N, ..]."""
    g, sizes, d, start, end, step = n.args
    nd = len(sizes)
    d, full = d % nd, sizes[d]
    start = start + full if start < 0 else start
    count = _val(g).shape[d]
    if step == 1:
        pad = [0] * (2 * nd)  # (constant_pad_nd's pairs run from the last dim)
        pad[2 * (nd - 1 - d)], pad[2 * (nd - 1 - d) + 1] = start, full - start - count
        with graph.inserting_before(n):
            out = [_emit(graph, aten.constant_pad_nd.default, (g, pad, 0.0), n)]
    elif full % step == 0 and 0 <= start < step and count <= full // step:
        pad = [0] * (2 * (nd + 1))
        pad[2 * (nd - 1 - d)], pad[2 * (nd - 1 - d) + 1] = start, step - 1 - start  # (d + 1)
        pad[2 * (nd - d) + 1] = full // step - count  # (dim d: slots past the slice's end)
        size = list(sizes)
        size[r] = -1
        with graph.inserting_before(n):
            out = [_emit(graph, aten.unsqueeze.default, (g, d + 1), n)]
            out.append(_emit(graph, aten.constant_pad_nd.default, (out[-1], pad, 0.0), n))
            out.append(_emit(graph, aten.view.default, (out[-1], size), n))
    else:
        raise PlanError(f"Plan.ep: {n.name} in the MoE layer {layer.module!r} is the gradient "
                        f"of a slice [{start}:{end}:{step}] of {full} features, which expert "
                        "parallelism cannot size by the rows received. Use ep=1 for this "
                        "model.")
    for m in out:  # (the row dim moves past the new dim until the view takes it away)
        m.meta[ir.DYNAMIC_ROWS] = True
        layer.region[m] = r + (m.target is not aten.view.default and step > 1 and r > d)
    n.replace_all_uses_with(out[-1])
    if n in layer.leaving:
        layer.leaving[layer.leaving.index(n)] = out[-1]
    del layer.region[n]
    graph.erase_node(n)


# --- experts written as nn.ModuleList -------------------------------------------------------
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

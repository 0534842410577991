"""Experts routed by torch.where and run one by one, run once, grouped.

compiler/padded_nonzero.py traces each expert of a list - an nn.ModuleList (litgpt's
Mixtral, Mistral's and DeepSeek's reference code), or parameters [E, ...] a loop reads
expert by expert (transformers' eager experts, DBRX) - over `mask.numel()` rows - every
(token, k) position, the ones not routed to it as zero rows - so E experts compute E times
the rows eager computes. Their masks partition the positions (each is `indices == j` of
the same top-k indices, a fact read off the graph: `_partition`), so all experts' true rows
together are exactly `mask.numel()`. This pass sorts the positions by expert once (a stable
sort of each position's expert), gathers the rows entering the experts once (expert 0's
gathers again with the positions any expert owns), runs the experts' row-wise region -
forward and backward, as core/expert_lists finds it on the joint graph - once over the
sorted rows, each matmul with an expert weight as `aten._grouped_mm` over the experts'
weights stacked (`offs`: each expert's end row; a weight gradient grouped the same way;
parameters [E, ...] read as they are, their gradient the grouped one: Hugging Face's
grouped experts' form, which tp and ep split), and hands each expert's readers its rows
back in position order, zeros at the positions not routed to it (the padded trace only
ever writes those to its dropped padding row). Each true row meets its expert's weights in
one matmul, as in eager: eager's FLOPs.

Not applied (the padded trace runs as it is) where it cannot be shown exact or run: masks
that are not one index tensor compared with distinct experts, a region op it has no
grouped form for, feature sizes `_grouped_mm` cannot take (16-byte strides), each reason
logged and kept in gm.meta[ir.GROUPED_EXPERTS]. Under expert parallelism the stacks of
matrices are split by rank (passes/expert_parallel); the experts' biases are looked up by
each row's expert before the rows leave for their experts' ranks (Hugging Face's grouped
form), and stay whole. Under tensor
parallelism the tp pass splits each stack's experts' weights alike
(passes/tensor_parallel.find_linears); listed experts whose matmul output is split into
pieces (a fused gate/up, stored interleaved per expert by the tp pass) run as traced
there.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._inductor.pattern_matcher import stable_topological_sort

from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.experts import GROUPED_MM as _GROUPED_MM, why_not_grouped_on
from fxpar.core.expert_lists import ExpertList, find_expert_lists
from fxpar.core.graphs import copy_graph, fake_propagate

aten = torch.ops.aten
log = logging.getLogger("fxpar.grouped_experts")


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    ep: int | None = 1
    tp: int | None = 1
    precision: str = "fp32"


CONTRACT = ir.PassContract(
    "grouped_experts", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.MODULE, ir.ROLE, ir.FQN}),
    provides=frozenset({ir.GROUPED_EXPERTS}),
    # on the graph as captured: every later pass sees grouped matmuls (priced, split into
    # stages, recomputed, cast) as it sees Hugging Face's grouped experts
    before=frozenset({"pipeline_split", "precision", "remat", "tensor_parallel",
                      "expert_parallel", "data_parallel"}),
    applies=lambda o: _GROUPED_MM is not None,
    finds=lambda gm: any(_is_padded_positions(n) is not None for n in gm.graph.nodes),
    values_fresh=True)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    why = why_not_grouped_on(getattr(ctx, "device", None), options.precision)
    if why:
        return _left(gm, "", why)
    work = torch.fx.GraphModule(gm, copy_graph(gm.graph))  # (gm stays whole if this fails)
    try:
        lists = find_expert_lists(work)
    except PlanError as e:  # (the lists ep could not split: the experts run as traced)
        return _left(gm, "", f"the lists of experts were not read: {e}")
    report = []
    try:
        for lst in lists:
            why = tp_why(lst) if (options.tp or 1) > 1 else None
            why = why or _rewrite(work.graph, lst)
            report.append({"module": lst.module, "experts": len(lst.experts),
                           "rows": lst.rows, "grouped": why is None, "why": why})
            if why:
                log.info("grouped_experts: %r runs each expert on every routed position "
                         "(%d x eager's expert FLOPs): %s", lst.module, len(lst.experts), why)
        if any(r["grouped"] for r in report):
            stable_topological_sort(work.graph)  # (each expert's readers after its rows)
            work.graph.eliminate_dead_code()
            work.recompile()
            fake_propagate(work, check=False)
    except Exception as e:  # noqa: BLE001 - fxpar's own rewrite failed: run as traced
        log.warning("grouped_experts: grouping the experts failed (%s: %s); they run as "
                    "traced (each over every routed position). Please report this model to "
                    "fxpar.", type(e).__name__, e)
        return _left(gm, ", ".join(lst.module for lst in lists), f"{type(e).__name__}: {e}")
    if not any(r["grouped"] for r in report):
        gm.meta[ir.GROUPED_EXPERTS] = report
        return gm
    work.meta[ir.GROUPED_EXPERTS] = report
    return work


def tp_why(lst: ExpertList) -> str | None:
    """Why `lst`'s experts do not run grouped under tensor parallelism (None: they do, each
    stack's experts split alike by passes/tensor_parallel): an expert's matmul output split
    into pieces (a fused gate/up) is stored interleaved per expert by the tp pass, which it
    does for an expert's own linear only; such experts run as traced, each split over tp.
    Experts stacked in one parameter run grouped reading it, as Hugging Face's grouped
    experts do: the tp pass splits them as it splits those."""
    if lst.stacks:
        return None
    x = lst.experts[0]
    for n in x.region:
        if n.meta.get(ir.REGION) == ir.FORWARD and n.target in (aten.mm.default,
                                                                 aten.addmm.default) and \
                any(u.target in (aten.split.Tensor, aten.split_with_sizes.default,
                                 aten.chunk.default)
                    for v in (n, *(u for u in n.users if u.target in ir.RESHAPES))
                    for u in v.users):
            return ("under tp, an expert's output split into pieces (a fused projection, "
                    f"{n.meta.get(ir.MODULE, '')!r}) runs as traced, split over tp")
    return None


def _left(gm, module: str, why: str) -> torch.fx.GraphModule:
    """`gm` as traced, and why (gm.meta[ir.GROUPED_EXPERTS], logged)."""
    log.info("grouped_experts: experts left as traced: %s", why)
    gm.meta[ir.GROUPED_EXPERTS] = [{"module": module, "experts": 0, "rows": 0,
                                    "grouped": False, "why": why}]
    return gm


# --- which positions each expert owns ----------------------------------------------------

def _is_padded_positions(n) -> torch.fx.Node | None:
    """The mask of compiler/padded_nonzero's `where(mask.reshape(-1, 1), positions, -1)`
    (the mask permuted first where its positions are listed in another dim order)."""
    if n.op != "call_function" or n.target is not aten.where.ScalarOther or n.args[2] != -1:
        return None
    flat = n.args[0]
    if flat.target is aten.ne.Scalar and flat.args[1] == 0:
        flat = flat.args[0]
    if flat.target is aten.reshape.default and list(flat.args[1]) == [-1, 1]:
        mask = flat.args[0]
        return mask.args[0] if _listing(n) else mask
    return None


def _listing(n) -> tuple:
    """The dim order padded positions `n` list their mask's positions in (() for row-major):
    the permute padded_nonzero put before flattening the mask."""
    flat = n.args[0]
    flat = flat.args[0] if flat.target is aten.ne.Scalar else flat
    mask = flat.args[0]
    if mask.target is aten.permute.default and len(mask.users) == 1:
        return tuple(mask.args[1])
    return ()


_SAME_ROWS = {aten._to_copy.default, aten.clone.default, aten.expand.default}
_RESHAPES = ir.RESHAPES | {aten.unsqueeze.default, aten.squeeze.dim}
# ops between padded_nonzero's positions and one column of them (an index tensor)
_COLUMN_OPS = ir.RESHAPES | {operator.getitem, aten.unbind.int, aten.select.int,
                             aten.squeeze.dim}


def _row_input_dim(a, n, row: int, rows: int) -> int | None:
    """The dim of input `a` holding the rows of `n`'s dim `row`, in the same order (None:
    `a` does not carry them: broadcast, or reordered)."""
    out, v = n.meta[ir.VAL], a.meta.get(ir.VAL)
    if not isinstance(v, torch.Tensor):
        return None
    if n.target in _RESHAPES:  # the rows and everything before them keep their order
        outer = math.prod(out.shape[:row])
        d = next((d for d in range(v.dim()) if v.shape[d] == rows
                  and math.prod(v.shape[:d]) == outer), None)
        return d
    d = row - (out.dim() - v.dim())  # (same rows, or pointwise: broadcast from the right)
    return d if 0 <= d < v.dim() and v.shape[d] == rows else None


def _positions_of(idx) -> torch.fx.Node | None:
    """The padded positions node an index tensor is a column of (through views)."""
    for _ in range(6):
        if not isinstance(idx, torch.fx.Node):
            return None
        if _is_padded_positions(idx) is not None:
            return idx
        idx = idx.args[0] if idx.target in _COLUMN_OPS else None
    return None


def _mask_of(expert) -> tuple | str:
    """The one routing mask whose positions order the rows of every row tensor entering
    `expert` (and its padded_nonzero positions nodes): followed back through ops that keep
    the rows in order to the index ops gathering them, each of whose indices is a column of
    those positions; or why there is not one."""
    rows, masks, positions = expert.rows, set(), set()
    for x in expert.entering:
        seen, todo = set(), [(x, 0)]
        while todo:
            n, row = todo.pop()
            if (n, row) in seen:
                continue
            seen.add((n, row))
            if n.op == "call_function" and n.target is aten.index.Tensor:
                picks = [(k, i) for k, i in enumerate(n.args[1]) if i is not None]
                at = [k for k, _ in picks]
                pos = {_positions_of(i) for _, i in picks}
                if at != list(range(at[0], at[0] + len(at))) or row != at[0] or \
                        len(pos) != 1 or None in pos:
                    return f"{n.name} picks rows entering {expert.module!r} by another index"
                at_pos = pos.pop()
                masks.add(_is_padded_positions(at_pos))
                positions.add(at_pos)
                continue
            pointwise = isinstance(n.target, torch._ops.OpOverload) and \
                torch.Tag.pointwise in n.target.tags
            if n.op != "call_function" or not (
                    pointwise or n.target in _SAME_ROWS or n.target in _RESHAPES):
                return (f"{x.name} entering {expert.module!r} is made by {n.name} "
                        f"({n.target}), not row by row from rows routing picks")
            ins = [(a, d) for a in n.all_input_nodes
                   if (d := _row_input_dim(a, n, row, rows)) is not None]
            if not ins:
                return (f"{x.name} entering {expert.module!r}: the rows of {n.name} "
                        f"({n.target}) come from no rows routing picks")
            todo.extend(ins)
    if len(masks) != 1:
        return f"the rows entering {expert.module!r} are picked by {len(masks)} masks"
    return masks.pop(), positions


def _partition(masks: list) -> str | None:
    """None if the masks provably partition their positions (at most one expert each): the
    same index tensor compared with distinct experts, as `indices == j` (one mask per
    expert), or as one comparison with an arange whose expert dim is unbound / selected
    (litgpt's masks; `F.one_hot(indices, E).permute(2, 1, 0)[j]`, older Hugging Face
    Mixtral blocks)."""
    if len({tuple(m.meta[ir.VAL].shape) for m in masks}) != 1:
        return "the experts' masks differ in shape"
    if all(m.target is aten.eq.Scalar for m in masks):
        xs, cs = {m.args[0] for m in masks}, [m.args[1] for m in masks]
        if len(xs) == 1 and all(isinstance(c, int) for c in cs) and len(set(cs)) == len(cs):
            return None
        return "the masks compare different tensors, or with equal or non-integer experts"
    picks = []
    for m in masks:
        if m.target is operator.getitem and m.args[0].target is aten.unbind.int:
            src, dim, j = m.args[0].args[0], (list(m.args[0].args[1:]) or [0])[0], m.args[1]
        elif m.target is aten.select.int:
            src, dim, j = m.args[0], m.args[1], m.args[2]
        else:
            return f"mask {m.name} ({m.target}) is not a comparison with the expert's index"
        picks.append((src, dim, j))
    if len({(s, d) for s, d, _ in picks}) != 1 or len({j for *_, j in picks}) != len(picks):
        return "the masks are not distinct experts of one comparison"
    src, dim, _ = picks[0]
    nd = src.meta[ir.VAL].dim()
    if src.target is aten.permute.default and dim % nd == 0:
        perm = [p % nd for p in src.args[1]]
        eq, dim = src.args[0], perm[0]
    else:
        eq = src
    while eq.target in (aten._to_copy.default, aten.clone.default, aten.alias.default):
        eq = eq.args[0]  # (one_hot: the comparison cast to int64)
    if eq.target is not aten.eq.Tensor or dim % nd != nd - 1:
        return "the masks are not a comparison picked along its last (experts) dim"
    a, b = eq.args
    if b.target not in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        a, b = b, a
    if b.target not in (aten.arange.default, aten.arange.start, aten.arange.start_step) or \
            a.meta[ir.VAL].shape[-1] != 1 or b.meta[ir.VAL].dim() != 1:
        return "the masks compare the indices with something other than an arange of experts"
    return None


# --- the rewrite -------------------------------------------------------------------------

def _aligned(lst: ExpertList) -> str | None:
    """aten._grouped_mm reads operands whose strides are multiples of 16 bytes: feature sizes
    that are multiples of 8 (16 bytes in bf16 / fp16, which Plan.precision may cast them to
    after this pass)."""
    e = lst.experts[0]
    for n in e.region:
        if n.target in (aten.mm.default, aten.addmm.default):
            for a in n.args:
                v = a.meta.get(ir.VAL) if isinstance(a, torch.fx.Node) else None
                if isinstance(v, torch.Tensor) and v.dim() == 2 and any(
                        s * min(v.element_size(), 2) % 16 for s in v.shape if s != lst.rows):
                    return (f"{n.name} multiplies {tuple(v.shape)}: a grouped matmul needs "
                            "feature sizes that are multiples of 8 (16 bytes in bf16)")
    return None


def _weights(expert) -> set:
    """The expert's parameters and the views and casts they reach its region through."""
    return set(expert.dead) - set(expert.region) | set(expert.params.values())


def _op_why(expert, rows: int) -> str | None:
    """Why a node of the expert's region has no grouped form here (None: each has)."""
    weights = _weights(expert)
    for n in expert.region:
        leaves = pytree.tree_leaves((n.args, n.kwargs))
        wk = [k for k, a in enumerate(leaves) if isinstance(a, torch.fx.Node) and a in weights]
        for a in leaves:
            v = a.meta.get(ir.VAL) if isinstance(a, torch.fx.Node) else None
            if a not in expert.region and a not in expert.entering and a not in weights and \
                    isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows:
                return (f"{n.name} in {expert.module!r} reads {a.name}, a tensor of as many "
                        "rows that is not the expert's")
        if expert.region[n] is None:  # a weight gradient: summed over the rows
            if wk or not (n.target is aten.mm.default or (
                    n.target is aten.sum.dim_IntList and list(n.args[1]) == [0])):
                return f"{n.name} ({n.target}) makes a weight gradient fxpar cannot group"
        elif wk and not (
                (n.target is aten.mm.default and wk == [1]) or
                (n.target is aten.addmm.default and len(n.args) == 3 and not n.kwargs
                 and 2 in wk) or
                (isinstance(n.target, torch._ops.OpOverload) and
                 torch.Tag.pointwise in n.target.tags and
                 all(leaves[k].meta[ir.VAL].dim() == n.meta[ir.VAL].dim() - 1 for k in wk))):
            return (f"{n.name} ({n.target}) in {expert.module!r} reads an expert weight in a "
                    "way fxpar cannot group")
    return None


def why_not(lst: ExpertList) -> str | None:
    """Why `lst`'s experts cannot run grouped (None: they can): their routing masks, their
    ops, their feature sizes (the planner asks too, to price ep=1)."""
    found = _routing(lst)
    return found if isinstance(found, str) else None


def _routing(lst: ExpertList) -> tuple | str:
    """Each expert's routing mask and positions nodes, where the experts can run grouped;
    else why not."""
    experts, rows = lst.experts, lst.rows
    found = [_mask_of(e) for e in experts]
    bad = next((m for m in found if isinstance(m, str)), None)
    if bad:
        return bad
    masks = [m for m, _ in found]
    if any(m.meta[ir.VAL].numel() != rows for m in masks):
        return "the masks do not have one position per row"
    if len({_listing(p) for _, ps in found for p in ps}) != 1:
        return "the experts' positions are listed in different dim orders"
    why = _partition(masks) or _aligned(lst) or _op_why(experts[0], rows)
    return why or tuple(zip(*found))


def _entering_path(x, rows: int, positions: set, order: dict) -> list:
    """The ops `_mask_of` followed from `x` back to its gathers, and their indices' way from
    the `positions` (what they gather from is not on it), in graph order."""
    path, todo, seen = set(), [(x, 0)], set()
    while todo:
        n, row = todo.pop()
        if (n, row) in seen:
            continue
        seen.add((n, row))
        path.add(n)
        if n.target is aten.index.Tensor:
            for i in n.args[1]:
                while isinstance(i, torch.fx.Node) and i not in positions:
                    path.add(i)
                    i = i.args[0]
            continue
        todo.extend((a, d) for a in n.all_input_nodes
                    if (d := _row_input_dim(a, n, row, rows)) is not None)
    return sorted(path, key=order.__getitem__)


def _path_key(path: list, positions: set) -> list:
    """`path` as one expert's copy of it reads: each op with its arguments, a node of the
    path by its place, the positions as such, anything else as itself."""
    at = {n: i for i, n in enumerate(path)}

    def role(a):
        if not isinstance(a, torch.fx.Node):
            return a
        return ("path", at[a]) if a in at else "positions" if a in positions else a
    return [(n.target, pytree.tree_map(role, (n.args, n.kwargs))) for n in path]


def _regathered(graph, path: list, union: dict, before) -> torch.fx.Node:
    """The last node of `path` made again, before `before`, with the positions replaced as
    `union` says (positions node -> its replacement)."""
    env = dict(union)
    with graph.inserting_before(before):
        for n in path:
            env[n] = graph.node_copy(n, lambda a: env.get(a, a))
    return env[path[-1]]


def _rewrite(graph: torch.fx.Graph, lst: ExpertList) -> str | None:
    """Run `lst`'s experts grouped (see the module docstring); None, or why it was not."""
    found = _routing(lst)
    if isinstance(found, str):
        return found
    masks, positions = found
    experts, rows = lst.experts, lst.rows
    regions = [set(e.region) for e in experts]
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes = [sorted(e.region, key=order.get) for e in experts]
    n_exp = len(experts)
    out_node = next(n for n in graph.nodes if n.op == "output")

    def emit(target, *args, region=ir.FORWARD, **kwargs):
        with graph.inserting_before(out_node):
            n = graph.call_function(target, args, kwargs)
        n.meta[ir.REGION], n.meta[ir.MODULE] = region, lst.module
        return n

    # each position's expert (n_exp: none), the positions sorted by it, each expert's end row
    # (each mask as its positions list it, true where nonzero, as padded_nonzero reads it)
    flat = [emit(aten.reshape.default, next(iter(p)).args[0], [-1]) for p in positions]
    key = emit(aten.full.default, [rows], n_exp, dtype=torch.int64,
               device=masks[0].meta[ir.VAL].device)
    for j in reversed(range(n_exp)):
        key = emit(aten.where.ScalarSelf, flat[j], j, key)
    srt = emit(aten.sort.stable, key, stable=True)
    key_s, perm = emit(operator.getitem, srt, 0), emit(operator.getitem, srt, 1)
    inv = emit(operator.getitem, emit(aten.sort.stable, perm, stable=True), 1)
    # each expert's row count: a histogram of the key (a position no expert owns, key n_exp,
    # falls outside it), as Hugging Face's grouped dispatch counts (exact below 2^24 rows)
    counts = emit(aten.histc.default, emit(aten._to_copy.default, key, dtype=torch.float32),
                  n_exp, 0, n_exp - 1)
    offs = emit(aten._to_copy.default, emit(aten.cumsum.default, counts, 0), dtype=torch.int32)
    expert_of_row = emit(aten.clamp.default, key_s, None, n_exp - 1)

    def as_rows(j, x):  # expert j's flat mask, broadcast over x's other dims
        return emit(aten.reshape.default, flat[j], [rows] + [1] * (x.meta[ir.VAL].dim() - 1),
                    region=x.meta.get(ir.REGION, ir.FORWARD))

    # the rows entering the experts, every position's from its own expert: where every
    # expert gathers them alike (the same ops, reading the same tensors), expert 0's gathers
    # again with the positions any expert owns (a position's row is the one its expert's
    # gather makes; the others' are padding); else each expert's own, picked per position
    owned = emit(aten.reshape.default, emit(aten.lt.Scalar, key, n_exp), [-1, 1])
    union = {p: emit(aten.where.ScalarOther, owned, p.args[1], -1) for p in positions[0]}
    new: dict = {}  # expert 0's region node -> its grouped node (rows sorted by expert)
    for i, x0 in enumerate(experts[0].entering):
        region = x0.meta.get(ir.REGION, ir.FORWARD)
        paths = [_entering_path(e.entering[i], rows, positions[j], order)
                 for j, e in enumerate(experts)]
        keys = [_path_key(path, positions[j]) for j, path in enumerate(paths)]
        if all(k == keys[0] for k in keys[1:]):
            u = _regathered(graph, paths[0], union, out_node)
        else:
            u = x0
            for j in range(1, n_exp):
                x = experts[j].entering[i]
                u = emit(aten.where.self, as_rows(j, x), x, u, region=region)
        new[x0] = emit(aten.index_select.default, u, 0, perm, region=region)

    def stacked(q, k):  # leaf k of position q's node, across experts, stacked (where each
        # is the same view of its expert's select of one stack: that view of the stack)
        leaves = [pytree.tree_leaves((ns[q].args, ns[q].kwargs))[k] for ns in nodes]
        region = nodes[0][q].meta.get(ir.REGION)
        return _unstacked(leaves, lambda *a, **kw: emit(*a, region=region, **kw)) or \
            emit(aten.stack.default, leaves, region=region)

    weights0 = _weights(experts[0])
    terminals = {}  # expert 0's weight-gradient node -> its grouped node [experts, ...]
    for q, n0 in enumerate(nodes[0]):  # (each has a grouped form: _op_why)
        region = n0.meta.get(ir.REGION, ir.FORWARD)
        leaves, spec = pytree.tree_flatten((n0.args, n0.kwargs))
        wk = [k for k, a in enumerate(leaves) if isinstance(a, torch.fx.Node) and a in weights0]
        mapped = [new.get(a, a) if isinstance(a, torch.fx.Node) else a for a in leaves]
        if experts[0].region[n0] is None and n0.target is aten.mm.default:  # rows^T x rows
            terminals[n0] = emit(_GROUPED_MM.default, *mapped, offs, region=region)
            v = n0.meta[ir.VAL]  # (its value: a stack's gradient is a view of it)
            terminals[n0].meta[ir.VAL] = v.new_empty((n_exp, *v.shape))
        elif experts[0].region[n0] is None:  # a bias's gradient: each expert's rows summed
            shape = list(n0.args[0].meta[ir.VAL].shape[1:])
            zeros = emit(aten.zeros.default, [n_exp + 1] + shape, dtype=n0.meta[ir.VAL].dtype,
                         device=n0.meta[ir.VAL].device, region=region)
            sums = emit(aten.index_add.default, zeros, 0, key_s, mapped[0], region=region)
            terminals[n0] = emit(aten.slice.Tensor, sums, 0, 0, n_exp, region=region)
            terminals[n0].meta[ir.VAL] = n0.meta[ir.VAL].new_empty([n_exp] + shape)
        elif n0.target is aten.mm.default and wk:
            new[n0] = emit(_GROUPED_MM.default, mapped[0], stacked(q, 1), offs, region=region)
        elif n0.target is aten.addmm.default and wk:
            y = emit(_GROUPED_MM.default, mapped[1], stacked(q, 2), offs, region=region)
            bias = emit(aten.index_select.default, stacked(q, 0), 0, expert_of_row,
                        region=region) if 0 in wk else mapped[0]
            new[n0] = emit(aten.add.Tensor, y, bias, region=region)
        else:
            for k in wk:  # a per-expert vector (a bias): each row gets its expert's
                mapped[k] = emit(aten.index_select.default, stacked(q, k), 0, expert_of_row,
                                 region=region)
            args, kwargs = pytree.tree_unflatten(mapped, spec)
            new[n0] = emit(n0.target, *args, region=region, **kwargs)

    # each expert's readers: its rows back in position order (zeros where not routed to it)
    # and its slice of each grouped weight gradient
    back = {}
    for j, e in enumerate(experts):
        for q, n in enumerate(nodes[j]):
            n0 = nodes[0][q]
            if n0 in terminals:
                g = emit(aten.select.int, terminals[n0], 0, j, region=n.meta.get(ir.REGION))
                repl = g if n0.target is aten.mm.default else emit(
                    aten.reshape.default, g, list(n.meta[ir.VAL].shape),
                    region=n.meta.get(ir.REGION))  # (a bias's keepdim sum: [1, d])
            elif n in e.leaving:
                if n0 not in back:
                    back[n0] = emit(aten.index_select.default, new[n0], 0, inv,
                                    region=n0.meta.get(ir.REGION))
                repl = emit(aten.where.ScalarOther, as_rows(j, n), back[n0], 0.0,
                            region=n.meta.get(ir.REGION))
            else:
                continue
            for u in list(n.users):
                if u not in regions[j]:
                    u.replace_input_with(n, repl)
    for stack, total in lst.stacks.values():  # a stack's gradient: the sum of its experts'
        # select_backwards is their grouped gradient, viewed as each expert's was
        if total is not None:
            parts = [None] * n_exp
            for leaf in _summands(total):
                parts[leaf.args[3]] = leaf.args[0]
            region = total.meta.get(ir.REGION)
            grad = _unstacked(parts, lambda *a, **kw: emit(*a, region=region, **kw)) or \
                emit(aten.stack.default, parts, region=region)
            shape = list(total.meta[ir.VAL].shape)
            if shape != list(stack.meta[ir.VAL].shape):  # (a parameter viewed as the stack;
                # -1: the experts a rank holds, where expert parallelism splits it)
                grad = emit(aten.reshape.default, grad, [-1, *shape[1:]], region=region)
            total.replace_all_uses_with(grad)
    return None


def _summands(total: torch.fx.Node) -> list:
    """The select_backwards an add tree (core/expert_lists._select_sum) sums."""
    if total.target is aten.add.Tensor:
        return [leaf for a in total.args for leaf in _summands(a)]
    if total.target in ir.RESHAPES:
        return _summands(total.args[0])
    return [total]


def _same_view(x):
    """x, or for a view the view it is (a loop views its stack once per iteration)."""
    if x.op == "call_function" and x.target in ir.RESHAPES:
        return (x.target, x.args[0], repr(x.args[1:]))
    return x


_PER_EXPERT_VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default,
                     aten._to_copy.default, aten.clone.default, aten.alias.default,
                     aten.unsqueeze.default, aten.squeeze.dim, *ir.RESHAPES}


def _unstacked(leaves: list, emit) -> torch.fx.Node | None:
    """`stack(leaves)` as views of one tensor, where leaf j is the same chain of views and
    casts of `select(x, 0, j)` for every j (a loop's read of a stack of experts' weights, or
    of their grouped gradient): that chain over x, its dims past the experts' (None where
    the leaves are not so)."""
    chains = []
    for j, a in enumerate(leaves):
        chain = []
        while isinstance(a, torch.fx.Node) and a.target in _PER_EXPERT_VIEWS:
            chain.append(a)
            a = a.args[0]
        if not (isinstance(a, torch.fx.Node) and a.target is aten.select.int and
                a.args[1] == 0 and a.args[2] == j):
            return None
        chains.append((a.args[0], [(n.target, n.args[1:], n.kwargs) for n in chain]))
    x, chain = chains[0]
    if any(c[1] != chain or _same_view(c[0]) != _same_view(x) for c in chains[1:]) or \
            x.meta[ir.VAL].shape[0] != len(leaves):
        return None
    out, nd = x, x.meta[ir.VAL].dim() - 1  # (nd: an expert's dims, as the chain goes)
    for target, args, kwargs in reversed(chain):
        if target is aten.t.default and nd < 2:
            continue  # (t of a vector: itself)
        if target is aten.t.default:
            target, args = aten.transpose.int, (1, 2)
        elif target is aten.transpose.int:
            args = tuple(d % nd + 1 for d in args)
        elif target is aten.permute.default:
            args = ([0] + [d % nd + 1 for d in args[0]],)
        elif target is aten.unsqueeze.default:
            args, nd = (args[0] % (nd + 1) + 1,), nd + 1
        elif target is aten.squeeze.dim:
            args, nd = (args[0] % nd + 1,), nd - 1
        elif target in ir.RESHAPES:
            # (-1: the experts a rank holds, where expert parallelism splits the stack)
            args, nd = ([len(leaves) if -1 in args[0] else -1, *args[0]],), len(args[0])
        out = emit(target, out, *args, **kwargs)
    return out

"""Where an MoE's experts are on the joint graph: their row-wise regions.

An expert is a run of row-wise ops (linear layers, activations) between the row tensors
routing picks for it and the ones going back, forward and backward. Two forms are found:
the grouped matmuls of one MoE layer (Hugging Face's and torchtitan's experts: `row_inputs`,
`between`, read by passes/expert_parallel), and a list of identical expert modules each run
on the rows routing picks for it (`find_expert_lists`: litgpt's Mixtral, Mistral's and
DeepSeek's reference code), which passes/expert_parallel runs in slots and
passes/grouped_experts runs grouped.
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxpar.core import ir
from fxpar.core.experts import GROUPED_MM
from fxpar.core import sharding as _sharding  # noqa: F401  (fxpar::partial_from_replicate)
from fxpar.core.errors import PlanError

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

TRANSPOSES = {aten.t.default, aten.transpose.int}
# ops a weight passes through on its way to a matmul (a cast under bf16, a transpose for
# W.T); the weight is the parameter they start from
WEIGHT_PATH = {aten.t.default, aten.transpose.int, aten._to_copy.default, aten.clone.default,
               aten.alias.default, *ir.RESHAPES}
# and tp's moves of an expert's weight among the tp ranks, which hold the same expert: a split
# weight's gather (DTensor's choice in evaluate()'s forward), a row split's bias kept by one
# rank of the partial sum
_EXPERT_WEIGHT_PATH = WEIGHT_PATH | {aten.permute.default, c10d.all_gather_into_tensor.default,
                                     c10d.wait_tensor.default,
                                     torch.ops.fxpar.partial_from_replicate.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
_LIST_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.)")  # (a lookahead: nested lists' indices too)
_MATMULS = {aten.mm.default: 0, aten.addmm.default: 1}  # op -> its rows operand


def val(n):
    return n.meta.get(ir.VAL) if isinstance(n, torch.fx.Node) else None


def _first_tensor(v):
    return v[0] if isinstance(v, (tuple, list)) else v


def roles(mm) -> list[tuple[torch.fx.Node, int]]:
    """A grouped matmul's row-space operands (node, row dim): rows x W -> rows (forward, and
    the backward's input gradient), or rows^T x rows -> [E, ...] (a weight gradient)."""
    a, b = mm.args[0], mm.args[1]
    if val(a).dim() == 2 and val(b).dim() == 3:
        return [(a, 0)]
    if val(a).dim() == 2 and val(b).dim() == 2 and val(mm).dim() == 3:
        return [(a, 1), (b, 0)]
    raise PlanError(f"Plan.ep: the grouped matmul {mm.name} (module "
                    f"{mm.meta.get(ir.MODULE, '')!r}) multiplies {tuple(val(a).shape)} by "
                    f"{tuple(val(b).shape)}; expert parallelism knows a 2-D rows operand "
                    "with 3-D expert weights, and the weight gradient it makes.")


def row_inputs(node, row: int, rows: int) -> dict | None:
    """{input: its row dim} for the inputs of `node` that carry its rows (row dim `row` of
    its output, `rows` long), or None if `node` is not row-wise (it mixes or reorders rows)."""
    op = node.target
    if node.op != "call_function":
        return None
    if op is operator.getitem or op is c10d.wait_tensor.default or (
            op is c10d.all_reduce.default and node.args[2] == ir.GROUPS["tp"]) or (
            op in (aten._to_copy.default, aten.alias.default) and set(node.kwargs) <= {"dtype"}):
        # (tp's partial sums inside an expert: element by element over ranks holding the
        # same rows; a cast to another dtype, element by element)
        return {node.args[0]: row}
    if GROUPED_MM is not None and op is GROUPED_MM.default:
        return dict(roles(node))
    out = _first_tensor(val(node))
    if not isinstance(out, torch.Tensor):
        return None
    if op in TRANSPOSES:
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
    if op is aten.slice_backward.default:  # (a slice's gradient along another dim: GPT-OSS's
        # gate and up, every other feature)
        return {node.args[0]: row} if node.args[2] % out.dim() != row else None
    if op in ir.RESHAPES:  # (the dims up to the rows' kept: each row's elements stay its own)
        x = node.args[0]
        shape = val(x).shape
        ok = row < min(len(shape), out.dim()) and shape[row] == rows and \
            shape[:row + 1] == out.shape[:row + 1]
        return {x: row} if ok else None
    if op in _UNIT_DIMS:  # (a unit dim added or dropped elsewhere: the rows' dim shifts)
        d = _unit_dim(node)
        if d is None or d == row:
            return None
        x = node.args[0]
        r = row + (1 if op is not aten.unsqueeze.default and d <= row else
                   -1 if op is aten.unsqueeze.default and d < row else 0)
        return {x: r} if val(x).shape[r] == rows else None
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        found = {}
        for x in node.all_input_nodes:
            v = val(x)
            if isinstance(v, torch.Tensor):
                d = row - (out.dim() - v.dim())
                if d >= 0 and v.shape[d] == rows:
                    found[x] = d
        return found
    return None


_UNIT_DIMS = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}


def _unit_dim(n) -> int | None:
    """The dim `n` (unsqueeze, squeeze) adds (in its output) or drops (in its input), or
    None where a squeeze keeps a dim that is not of size 1."""
    if n.target is aten.unsqueeze.default:
        return n.args[1] % val(n).dim()
    x, dims = val(n.args[0]), n.args[1]
    if isinstance(dims, (list, tuple)):
        if len(dims) != 1:
            return None
        dims = dims[0]
    d = dims % x.dim()
    return d if x.shape[d] == 1 else None


def _out_row(user, node, row: int, rows: int) -> int | None:
    """The row dim of `user`'s output if `user` is row-wise in `node`'s rows, else None."""
    out = _first_tensor(val(user))
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
        cand = row + (out.dim() - val(node).dim()) if not isinstance(val(node), (
            tuple, list)) else row
    elif user.target in _UNIT_DIMS:
        d = _unit_dim(user)
        cand = None if d is None else row + (1 if user.target is aten.unsqueeze.default and
                                              d <= row else -1 if d < row else 0)
    else:
        cand = row
    if cand is None or not 0 <= cand < out.dim() or out.shape[cand] != rows:
        return None
    ins = row_inputs(user, cand, rows)
    return cand if ins is not None and ins.get(node) == row else None


def between(outs, ins, rows: int, given: dict | None = None) -> dict:
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
        todo.extend(((given[n] if n in given else row_inputs(n, r, rows)) or {}).items())
    return {n: r for n, r in fwd.items() if bwd.get(n) == r}


# --- experts written as nn.ModuleList -----------------------------------------------------

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
    """`stacks`: where the experts are one stack of weights a loop reads expert by expert
    (Hugging Face's eager experts, DBRX: compiler/padded_nonzero's `select(W, 0, j)`), each
    weight's name -> (the stack [E, ...] the selects read, the node its gradient is the sum
    of the experts' `select_backward`s at, or None); empty for an nn.ModuleList."""
    module: str
    rows: int
    experts: list
    stacks: dict = dataclasses.field(default_factory=dict)


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
                (val(m[k]).shape, val(m[k]).dtype) != (val(first[k]).shape, val(first[k]).dtype)
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
            check_one_stage(prefix, experts)  # (a stage's transfer inside one expert)
            raise PlanError(f"Plan.ep: the experts of {prefix!r} do not run the same graph "
                            "(their ops, arguments or row counts differ, or they read tensors "
                            "of their own besides their parameters); expert parallelism runs "
                            "one expert's graph for each. Use ep=1 for this model.")
        out.append(ExpertList(prefix, rows.pop(), experts))
    out += _stacked_lists(gm, params, grads, order, skipped)
    return out


def check_one_stage(module: str, experts: list) -> None:
    """Refuse experts that a pipeline stage boundary falls among (an ep slot runs experts of
    one stage, after all their rows are picked)."""
    stages = sorted({n.meta[ir.STAGE] for x in experts for n in (*x.region, *x.entering)
                     if ir.STAGE in n.meta})
    if len(stages) > 1:
        raise PlanError(f"Plan.ep: a pipeline stage boundary falls among the experts of "
                        f"{module!r} (they span stages {stages}); a slot runs experts of one "
                        "stage. Use another pp, or ep=1.")


def param_behind(x) -> torch.fx.Node | None:
    """The parameter placeholder `x` is (through casts, views and transposes), else None."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target in WEIGHT_PATH:
        x = x.args[0]
    return x if isinstance(x, torch.fx.Node) and x.op == "placeholder" and \
        x.meta.get(ir.ROLE) == "param" else None


def weight_fqn(p: torch.fx.Node) -> str | None:
    """The parameter name of an expert's weight: its placeholder's, or for a select of a
    stack (an expert of a stacked list) the stack's parameter's."""
    while p.op == "call_function" and p.args and isinstance(p.args[0], torch.fx.Node):
        p = p.args[0]
    return p.meta.get(ir.FQN)


def _stacked_lists(gm, params, grads: dict, order: dict, skipped: list | None) -> list:
    """The lists of experts whose weights are stacks [E, ...] (a parameter, through views)
    read only by `select(stack, 0, j)`, once for each expert j (a loop over the experts,
    compiler/padded_nonzero), grouped by module: expert j's weights are the selects j."""
    by_module: dict[str, dict] = {}
    for p in params:
        views = [p]  # (the stack: the parameter, or one view of it - made once per
        # iteration by a loop that views it there, DBRX's)
        if p.users and all(u.target in ir.RESHAPES and u.args[1:] == next(iter(
                p.users)).args[1:] for u in p.users):
            views = list(p.users)
        x = views[0]
        sel = [u for v in views for u in v.users
               if u.target is aten.select.int and u.args[1] == 0]
        n_exp = val(x).shape[0] if val(x).dim() else 0
        if len(sel) < 2 or len(sel) != sum(len(v.users) for v in views) or \
                sorted(u.args[2] for u in sel) != list(range(n_exp)):
            continue
        module, _, name = p.meta[ir.FQN].rpartition(".")
        by_module.setdefault(module, {})[name] = (x, sorted(sel, key=lambda u: u.args[2]),
                                                  _select_sum(grads.get(p), x, n_exp))
    out = []
    for module, found in by_module.items():
        if len({len(sel) for _, sel, _ in found.values()}) != 1:
            if skipped is not None:
                skipped.append(f"{module!r}: its stacks hold different numbers of experts")
            continue
        why = next((f"the gradient of {name} is not a sum over its experts" for name, (
            _, _, g) in found.items() if g is not None and isinstance(g, str)), None)
        if why:
            if skipped is not None:
                skipped.append(f"{module!r}: {why}")
            continue
        n_exp = len(next(iter(found.values()))[1])
        experts = []
        for j in range(n_exp):
            weights = {name: sel[j] for name, (_, sel, _) in found.items()}
            parts = {sel[j]: g[1][j] for _, sel, g in found.values() if g is not None}
            try:  # (a parameter read one slice at a time that is no expert: an RNN's)
                experts.append(_expert(f"{module}[{j}]", weights, parts, order, []))
            except PlanError as e:
                if skipped is not None:
                    skipped.append(f"{module!r}: {e}")
                break
        if len(experts) < n_exp:
            continue
        rows = {e.rows for e in experts}
        canon = [_canonical(e, order) for e in experts]
        why = "its slices do not run the same graph" if any(
            c != canon[0] for c in canon[1:]) or len(rows) > 1 or len(
            {(len(e.entering), len(e.leaving)) for e in experts}) > 1 else None
        why = why or _reads_another(gm, experts, order)
        if why:
            if skipped is not None:
                skipped.append(f"{module!r}: {why}")
            continue
        out.append(ExpertList(module, rows.pop(), experts, {
            name: (x, g[0] if g is not None else None) for name, (x, _, g) in found.items()}))
    return out


def _select_sum(g, x, n_exp: int):
    """(the gradient of stack `x`'s parameter, [g_j by j]) where it is the sum of the
    experts' `select_backward(g_j, shape, 0, j)` (each viewed as the parameter, where `x`
    is a view of it); None without gradients (a forward-only graph); a string where the
    gradient is not that sum."""
    if g is None:
        return None
    parts, todo = {}, [g]
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node):
            return "not a node"
        if n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs:
            todo.extend(n.args)
        elif n.target in ir.RESHAPES:  # (a stack viewed from a parameter: viewed back)
            todo.append(n.args[0])
        elif n.target is aten.select_backward.default and n.args[2] == 0 and \
                list(n.args[1]) == list(val(x).shape) and n.args[3] not in parts:
            parts[n.args[3]] = n.args[0]
        else:
            return f"{n.name} ({n.target})"
    if sorted(parts) != list(range(n_exp)):
        return "not one part per expert"
    return g, [parts[j] for j in range(n_exp)]


def _reads_another(gm, experts, order: dict) -> str | None:
    """Why the experts are not side by side (None: they are): the rows entering one in the
    forward are computed from another's results (one sweep over the nodes between the
    first expert's region and the last entering rows: what any forward region reaches)."""
    regions = {n for e in experts for n in e.region if n.meta.get(ir.REGION) == ir.FORWARD}
    entering = [x for e in experts for x in e.entering if x.meta.get(ir.REGION) == ir.FORWARD]
    if not regions or not entering:
        return None
    last = max(order[x] for x in entering)
    reached, n = set(), min(regions, key=order.get)
    while n.op != "output" and order[n] <= last:
        if n in regions or any(a in reached for a in n.all_input_nodes):
            reached.add(n)
        n = n.next
    for e in experts:
        x = next((x for x in e.entering if x in reached), None)
        if x is not None:
            return f"{x.name} entering {e.module!r} is computed from another expert's rows"
    return None


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
        if _constant(a):  # (each expert's own copy of a constant: a where's scalar_tensor)
            return ("constant", a.target, a.args, tuple(sorted(a.kwargs.items(), key=str)))
        return ("shared", a)
    return [(n.target, e.region[n], pytree.tree_map(role, (n.args, n.kwargs)), n in e.leaving)
            for n in nodes]


def _constant(a: torch.fx.Node) -> bool:
    """`a` is made from its arguments alone, the same every time (a factory, not random)."""
    return a.op == "call_function" and not a.all_input_nodes and isinstance(
        a.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded not in a.target.tags


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
    while x.op == "call_function" and x.target in WEIGHT_PATH | {aten.expand.default}:
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
            if u.op == "call_function" and u.target in _EXPERT_WEIGHT_PATH and u not in paths:
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
    rows = val(mms[0]).shape[0]
    for s in seeds:
        if seeds[s] is None:
            seeds[s] = row_inputs(s, 0, rows) if val(s).dim() and \
                val(s).shape[0] == rows else None
        if not seeds[s] or val(s).shape[0] != rows:
            raise PlanError(
                f"Plan.ep: a weight of the expert {module!r} is read by {s.name} ({s.target}, "
                f"module {s.meta.get(ir.MODULE, '')!r}), not on the expert's {rows} rows; "
                "split over ep ranks, each expert is on one rank only, read there by its own "
                "layers. Use ep=1 for this model.")
    terminals, dead = {}, set(n for n in paths if n.op != "placeholder")
    for p in weights.values():
        g = grads.get(p)
        while isinstance(g, torch.fx.Node) and (g.target in WEIGHT_PATH or
                                                 g.target is aten.permute.default):  # (W.T)
            dead.add(g)
            g = g.args[0]
        if g is None:
            continue
        terminals[g] = _weight_grad_rows(g, rows, module, p)
    given = {**seeds, **terminals}
    region = between([(s, 0) for s in seeds],
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
        ins = given[n] if n in given else row_inputs(n, r, rows) or {}
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
        if val(a).shape[1] == rows and val(b).shape[0] == rows:
            return {a: 1, b: 0}
    if g.target is aten.sum.dim_IntList and list(g.args[1]) == [0] and \
            val(g.args[0]).shape[0] == rows:
        return {g.args[0]: 0}
    raise PlanError(f"Plan.ep: the gradient of the expert weight "
                    f"{p.meta.get(ir.FQN, p.name)} of {module!r} is made by {g.name} "
                    f"({g.target}), not by a sum over the expert's rows; expert parallelism "
                    "over a list of experts needs each weight read once per row. Use ep=1 "
                    "for this model.")

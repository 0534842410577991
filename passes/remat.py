"""Rematerialization: choose which forward values the backward keeps and which it recomputes.

Every mode ends in the same two steps, as in PyTorch's AOTAutograd partitioner:
  1. a min-cut on the forward graph (networkx max-flow): each forward value costs its bytes to
     save; values the backward reads must be saved or recomputed from saved ones; ops that may
     not be recomputed (collectives, mutations, and -- per mode -- expensive ops) are pinned to
     the forward. The cut is the cheapest saved set; everything behind it is recomputed. This is
     what makes views and cheap pointwise ops recompute instead of being saved when that is
     smaller (e.g. keep x, not gelu(x) and x).
  2. the rewrite: each recomputed node is copied once into the backward, just before its first
     use there (meta["recompute"] = True), so a segment is rebuilt only when its backward runs.

The modes differ only in what the min-cut may recompute:
  "sqrt"  Chen et al. 2016. Checkpoint candidates are the cut vertices of the forward graph on
          the path from the input to the loss (found with networkx's biconnected components,
          not module names): values every path from input to loss goes through. Chen's greedy
          walks them keeping one whenever the bytes since the last kept one exceed b; the few
          best thresholds by Chen's estimate (kept bytes + largest segment) are rewritten and
          simulated, and the lowest simulated peak wins -- about every sqrt(N)-th layer
          boundary for N uniform layers. Kept checkpoints are forced saved; everything else may
          be recomputed.
  budget  (bytes per device, or "auto" = what fits the device): the least recompute time whose
          *simulated* peak fits (the budget is enforced on the simulator, which matches real
          runs, not on an estimate). Candidate plans come from two knapsacks:
          - over Chen's segments (for 5 segment sizes b): each segment is stored (only cheap
            ops recomputed) or recomputed whole from its checkpoint; segments are stored in
            order of recompute time saved per byte, and a binary search finds the longest
            prefix that fits;
          - over single expensive ops, as PyTorch's memory-budget partitioner does: ops are
            freed for recompute cheapest-per-byte first, and the fewest that fit win;
          plus every segment recomputed for the finest segmentations that fit (Chen's, and
          every k-th boundary, which finds per-block checkpointing), plus the "sqrt" plan
          (the lowest peak). A knapsack rather than an exact ILP because
          on a chain segments are independent, each candidate is checked exactly by the
          simulator, and it solves in about a second for small models (an ILP solver is not
          a dependency). Recompute time is the roofline estimate of core/cost.py.
          Below the lowest peak any plan reaches: a PlanError that says the floor.

Under data parallelism, reductions over the batch (BatchNorm statistics, a mean loss) are
never recomputed: they become all-reduces, and recomputing them would communicate again.

Random ops (dropout) are recomputable: the forward op is wrapped in torch's
`run_and_save_rng_state` and the recompute in `run_with_rng_state`, so the mask is replayed
bit for bit (the saved RNG state is a few KB).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from fxpar.core import cost, ir
from fxpar.core.errors import PlanError
from fxpar.core.graphs import copy_graph

aten = torch.ops.aten
SAVED = "saved"  # node.meta key: forward value kept for the backward (set on remat'd graphs)
_PIN = "remat_pinned"  # transient: never recompute this node (removed before the pass returns)


@dataclasses.dataclass
class Decision:
    """What the pass decided; stored on gm.meta[ir.REMAT_REPORT] for tests, viz and reports."""
    mode: str
    checkpoints: list[str]
    saved: list[str]
    recomputed: list[str]
    recompute_flops: int
    peak_before: int          # simulated activation peak, bytes
    peak_after: int
    budget: int | None = None


# --- graph facts --------------------------------------------------------------------------

def _region(n):
    return n.meta.get(ir.REGION)


def _forward_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and _region(n) == ir.FORWARD]


def _needed_by_backward(fwd):
    return {n for n in fwd if any(_region(u) == ir.BACKWARD for u in n.users)}


def _is_random(n) -> bool:
    """Draws random numbers (so a recompute must replay the RNG). Attention kernels carry the
    seeded tag for their dropout_p argument: with dropout_p == 0 they are deterministic."""
    t = n.target
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags):
        return False
    for i, arg in enumerate(t._schema.arguments):
        if arg.name == "dropout_p":
            p = n.kwargs.get("dropout_p", n.args[i] if i < len(n.args) else arg.default_value)
            return p != 0
    return True


def _recomputable(n) -> bool:
    t = n.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable:
        return False
    if _is_random(n) and _device_type(n) not in _RNG_REPLAY_DEVICES:
        return False  # torch's RNG replay ops exist for these devices only
    # (no collective, and none of fxpar's own ops: its all-to-alls and ring exchanges
    # communicate, and the others - rank-dependent slices, dropout masks, fused kernels -
    # are left where the passes put them)
    return t.namespace not in ir.COMMUNICATION_NAMESPACES and t.namespace != "fxpar"


_RNG_REPLAY_DEVICES = ("cpu", "cuda")


def _device_type(n) -> str:
    vals = [v for v in torch.utils._pytree.tree_leaves(n.meta.get(ir.VAL))
            if isinstance(v, torch.Tensor)]
    return vals[0].device.type if vals else "cpu"


def _cheap(n) -> bool:
    """Cheap to recompute: views, getitems, pointwise ops, input-free factories, dtype casts."""
    t = n.target
    if t is operator.getitem or cost.is_view(n) or _is_cast(n):
        return True
    if _is_random(n):  # dropout, rand_like: cheap; attention with dropout: not
        return cost.node_flops(n) == 0
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in t.tags or not n.all_input_nodes


def _is_cast(n) -> bool:
    """A widening float cast on the same device (`x.float()` of a bf16 x): pointwise, but
    ATen does not tag `_to_copy` so (it also moves between devices, which is not cheap).
    Pinned as expensive, the precision pass's casts made remat save a bf16 GELU's fp32 tanh
    (4 bytes an element) where recomputing from the bf16 input saves 2, as torch.compile's
    partitioner does. Exact wherever it runs; a narrowing cast is not recomputed: inside a
    fused kernel Inductor may skip its rounding (`emulate_precision_casts` is off), and the
    backward would read other values than the forward made."""
    if n.target is not aten._to_copy.default or set(n.kwargs) - {"dtype", "device", "layout"}:
        return False
    src = n.args[0].meta.get(ir.VAL) if isinstance(n.args[0], torch.fx.Node) else None
    dev, dtype = n.kwargs.get("device"), n.kwargs.get("dtype")
    if not isinstance(src, torch.Tensor) or (dev is not None and torch.device(dev) != src.device):
        return False
    return dtype is None or dtype == src.dtype or dtype in _WIDER.get(src.dtype, ())


# exact widenings: every value of the source is a value of the target (more bits alone is
# not enough: float8_e8m0fnu's range is wider than fp16's)
_WIDER = {torch.bfloat16: (torch.float32, torch.float64),
          torch.float16: (torch.float32, torch.float64),
          torch.float32: (torch.float64,)}


def _owns_storage(n) -> bool:
    if n.target is operator.getitem:
        return not cost.is_view(n.args[0]) and isinstance(n.args[0].meta.get(ir.VAL), (tuple, list))
    return not cost.is_view(n) and isinstance(n.meta.get(ir.VAL), torch.Tensor)


def _view_of_placeholder(n) -> bool:
    while cost.is_view(n) and n.all_input_nodes:
        n = n.args[0] if isinstance(n.args[0], torch.fx.Node) else n.all_input_nodes[0]
    return n.op == "placeholder"


def _loss_node(gm):
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return out.args[0][0]


def _batch_dependent(gm, fwd) -> set:
    """Forward nodes that depend on the batch (the activation chain)."""
    batch = {n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(ir.ROLE) == "batch"}
    data = set()
    for n in fwd:
        if any(a in batch or a in data for a in n.all_input_nodes):
            data.add(n)
    return data


_REDUCTIONS = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.prod,
               aten.var_mean, aten.std_mean, aten.logsumexp, aten.max, aten.min}


# losses that reduce over the batch unless reduction is "none" (0): where their reduction is
_LOSSES = {aten.nll_loss_forward: 3, aten.nll_loss2d_forward: 3, aten.mse_loss: 2,
           aten.l1_loss: 2, aten.smooth_l1_loss: 2, aten.huber_loss: 2,
           aten.binary_cross_entropy: 3, aten.binary_cross_entropy_with_logits: 4}


def _reduces_over_batch(n) -> bool:
    """A reduction that includes dim 0 (or all dims), or a loss that averages or sums over the
    batch: under data parallelism it becomes an all-reduce, so recomputing it would
    communicate again in the backward."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if t.overloadpacket in _LOSSES:
        i = _LOSSES[t.overloadpacket]
        return (n.args[i] if len(n.args) > i else n.kwargs.get("reduction", 1)) != 0
    if t.overloadpacket not in _REDUCTIONS:
        return False
    dims = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    if dims is None or dims == [] or dims == ():
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    ndim = n.args[0].meta[ir.VAL].dim() if isinstance(n.args[0], torch.fx.Node) else 1
    return any(d % max(ndim, 1) == 0 for d in dims if isinstance(d, int))


def chain_candidates(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Forward values every input->loss path goes through (cut vertices), in forward order."""
    fwd = _forward_nodes(gm)
    fwd_set = set(fwd)
    batch = {n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(ir.ROLE) == "batch"}
    data = _batch_dependent(gm, fwd)
    loss = _loss_node(gm)
    if loss not in data:
        return []
    U = nx.Graph()
    U.add_nodes_from(data)
    U.add_edges_from((a, n) for n in data for a in n.all_input_nodes if a in data)
    comp = U.subgraph(nx.node_connected_component(U, loss))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    src = min(comp, key=order.__getitem__)
    arts = set(nx.articulation_points(comp))
    tree = nx.Graph()  # block-cut tree
    block_of = {}
    for i, block in enumerate(nx.biconnected_components(comp)):
        tree.add_node(("block", i))
        for v in block:
            block_of.setdefault(v, ("block", i))
            if v in arts:
                tree.add_edge(("block", i), v)
    if len(comp) == 1:
        path = [loss]
    else:
        a = src if src in arts else block_of[src]
        b = loss if loss in arts else block_of[loss]
        path = [src, *nx.shortest_path(tree, a, b), loss]
    cands = {v for v in path if isinstance(v, torch.fx.Node) and v in fwd_set and _owns_storage(v)}
    return sorted(cands, key=order.__getitem__)


# --- min-cut --------------------------------------------------------------------------------

def min_cut_saved(gm, *, pinned: set, forced: set) -> tuple[set, set]:
    """(saved, recomputed) forward nodes: the cheapest saved set (bytes) given that `pinned`
    nodes must run in the forward and `forced` nodes must be saved."""
    fwd = _forward_nodes(gm)
    fwd_set = set(fwd)
    needed = _needed_by_backward(fwd)
    G = nx.DiGraph()
    for n in fwd:
        if cost.is_view(n) and not _owns_storage(n):
            # saving a view keeps its base alive: cut at the base instead (free if a param)
            cap = 0 if _view_of_placeholder(n) else None
        elif not _owns_storage(n):
            cap = None  # tuples: save their elements
        else:
            cap = cost.tensor_bytes(n.meta.get(ir.VAL)) + (0 if n in needed else 1)
        if cap is None:
            G.add_edge((n, "in"), (n, "out"))
        else:
            G.add_edge((n, "in"), (n, "out"), capacity=cap)
        for a in n.all_input_nodes:  # placeholders are free on both sides: no edge
            if a in fwd_set:
                G.add_edge((a, "out"), (n, "in"))
        if n in pinned or n in forced or not _recomputable(n) or n.meta.get(_PIN):
            G.add_edge("source", (n, "in"))
        if n in needed or n in forced:
            G.add_edge((n, "out"), "sink")
    if "sink" not in G or "source" not in G:
        return set(), set()
    try:
        _, (reach, _) = nx.minimum_cut(G, "source", "sink",
                                       flow_func=nx.algorithms.flow.boykov_kolmogorov)
    except nx.NetworkXUnbounded as e:
        raise PlanError("remat: a value the backward needs can neither be saved nor "
                        "recomputed (infinite cut); please report this graph to fxpar.") from e
    saved = {n for n in fwd if (n, "in") in reach and (n, "out") not in reach}
    recompute_side = {n for n in fwd if (n, "in") not in reach}
    # only what the backward actually reaches is recomputed
    recomputed, stack = set(), [n for n in needed if n in recompute_side]
    while stack:
        n = stack.pop()
        if n in recomputed:
            continue
        recomputed.add(n)
        stack.extend(a for a in n.all_input_nodes if a in recompute_side)
    return saved, recomputed


# --- rewrite --------------------------------------------------------------------------------

def rewrite(gm: torch.fx.GraphModule, recomputed: set) -> list[torch.fx.Node]:
    """Copy each recomputed node into the backward just before its first use there."""
    graph = gm.graph
    recomputed = set(recomputed)
    # random ops: run_and_save_rng_state in the forward, run_with_rng_state in the backward
    rng_state = {}
    for n in [n for n in graph.nodes if n in recomputed and _is_random(n)]:
        with graph.inserting_before(n):
            wrapped = graph.call_function(run_and_save_rng_state, (n.target, *n.args), n.kwargs)
            state = graph.call_function(operator.getitem, (wrapped, 0))
            out = graph.call_function(operator.getitem, (wrapped, 1))
        st_val = _rng_state_like(n)
        for new, val in ((wrapped, (st_val, n.meta[ir.VAL])), (state, st_val),
                         (out, n.meta[ir.VAL])):
            new.meta.update({k: v for k, v in n.meta.items() if k != ir.VAL})
            new.meta[ir.VAL] = val
        n.replace_all_uses_with(out)
        graph.erase_node(n)
        recomputed.discard(n)
        recomputed.add(out)
        rng_state[out] = state

    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def ensure(n, before):
        if n not in recomputed:
            return n
        if n not in copies:
            with graph.inserting_before(before):
                if n in rng_state:
                    src = n.args[0]  # the run_and_save_rng_state node
                    args = tuple(ensure(a, before) if isinstance(a, torch.fx.Node) else a
                                 for a in src.args[1:])
                    kwargs = {k: ensure(v, before) if isinstance(v, torch.fx.Node) else v
                              for k, v in src.kwargs.items()}
                    new = graph.call_function(run_with_rng_state,
                                              (rng_state[n], src.args[0], *args), kwargs)
                else:
                    new = graph.node_copy(n, lambda a: ensure(a, before))
            new.meta = dict(n.meta)
            new.meta[ir.RECOMPUTE] = True
            new.meta[ir.REGION] = ir.BACKWARD
            copies[n] = new
        return copies[n]

    for b in [n for n in graph.nodes if _region(n) == ir.BACKWARD]:
        if b.meta.get(ir.RECOMPUTE) or b.op == "output":
            continue  # the step's outputs (loss, buffer updates) are the forward's own values
        if any(a in recomputed for a in b.all_input_nodes):
            b.args, b.kwargs = torch.fx.node.map_arg((b.args, b.kwargs),
                                                     lambda a: ensure(a, b))
    graph.eliminate_dead_code()
    return list(copies.values())


def _rng_state_like(n):
    """The saved RNG state's value (shape and dtype only): philox seed+offset on CUDA, the
    mt19937 state on CPU."""
    n_bytes = 16 if _device_type(n) == "cuda" else torch.get_rng_state().numel()
    return torch.empty(n_bytes, dtype=torch.uint8, device="meta")


# --- policies -------------------------------------------------------------------------------

def _segments(gm, cands):
    """Per candidate: saved bytes of the forward span ending at it (without remat)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed = sorted((n for n in _needed_by_backward(_forward_nodes(gm)) if _owns_storage(n)),
                    key=order.__getitem__)
    seg, j = [0] * len(cands), 0
    for n in needed:
        while j < len(cands) - 1 and order[n] > order[cands[j]]:
            j += 1
        seg[j] += cost.tensor_bytes(n.meta[ir.VAL])
    return seg


def chen_checkpoints(cands, seg, b) -> list[int]:
    """Chen's greedy: keep a candidate whenever the bytes since the last kept one exceed b."""
    kept, acc = [], 0
    for j in range(len(cands)):
        acc += seg[j]
        if acc > b:
            kept.append(j)
            acc = 0
    return kept


def _thresholds(seg, k=12):
    total = sum(seg) or 1
    lo = max(min(s for s in seg if s) if any(seg) else 1, 1)
    return sorted({lo * (total / lo) ** (i / (k - 1)) for i in range(k)})


def _chen_estimate(cands, seg, kept) -> int:
    """Chen's cost of a checkpoint set: kept bytes + the largest segment between them."""
    groups, acc = [], 0
    for j in range(len(cands)):
        acc += seg[j]
        if j in kept:
            groups.append(acc)
            acc = 0
    groups.append(acc)
    return sum(cost.tensor_bytes(cands[j].meta[ir.VAL]) for j in kept) + max(groups)


def sqrt_checkpoints(gm, cands, seg, tries: int = 6, cache=None):
    """Chen et al.'s greedy over thresholds b; the few best by Chen's estimate are rewritten
    and simulated, and the lowest simulated peak wins (fewest recompute FLOPs on ties): the
    estimate ignores what a segment's backward holds, e.g. attention's T x T scores."""
    options = {}
    for b in _thresholds(seg, 24):
        kept = tuple(chen_checkpoints(cands, seg, b))
        options.setdefault(kept, _chen_estimate(cands, seg, kept))
    best = None
    for kept in sorted(options, key=options.__getitem__)[:tries]:
        draft, saved, copies = _apply(gm, set(), {cands[j] for j in kept}, cache)
        key = (_activation_peak(draft), sum(cost.node_flops(c) for c in copies))
        if best is None or key < best[0]:
            best = (key, [cands[j] for j in kept], (draft, saved, copies))
    return best[1], best[2]


def _activation_peak(gm) -> int:
    return cost.simulate_liveness(gm, count_inputs=False).peak["activations"]


def _apply(gm, pinned, forced, cache=None):
    """Min-cut on `gm`, then the rewrite on a copy (reused when the cut was seen before:
    different pinned sets often give the same cut)."""
    saved, recomputed = min_cut_saved(gm, pinned=pinned, forced=forced)
    key = (frozenset(saved), frozenset(recomputed))
    if cache is not None and key in cache:
        return cache[key]
    g = _copy(gm)
    m = {a: b for a, b in zip(gm.graph.nodes, g.graph.nodes)}
    copies = rewrite(g, {m[n] for n in recomputed})
    out = (g, {m[n] for n in saved}, copies)
    if cache is not None:
        cache[key] = out
    return out


class _Draft:
    """A graph being tried (no GraphModule: no code generation until one is chosen)."""
    def __init__(self, graph):
        self.graph = graph


def _copy(gm):
    return _Draft(copy_graph(gm.graph))


def _recompute_time(nodes, profile) -> float:
    return sum(cost.node_time(n, profile) for n in nodes)


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    remat: Any = "none"
    dp: int | None = 1


CONTRACT = ir.PassContract(
    "remat", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.ROLE}),
    provides=frozenset({ir.RECOMPUTE, ir.REMAT_REPORT}),
    # it rewrites the joint graph the split cuts: a recomputed copy goes with the stage of
    # the backward that uses it
    before=frozenset({"pipeline_split"}),
    applies=lambda o: o.remat != "none")


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    mode = options.remat
    if mode == "none" or not any(_region(n) == ir.BACKWARD for n in gm.graph.nodes
                                 if n.op == "call_function"):  # forward-only: nothing to do
        return gm
    dp = max(options.dp or 1, 1)
    fwd = _forward_nodes(gm)
    if dp > 1:  # batch statistics (BatchNorm, a mean loss) would be all-reduced again
        for n in _batch_dependent(gm, fwd):
            if _reduces_over_batch(n):
                n.meta[_PIN] = True
    expensive = {n for n in fwd if not _cheap(n)}
    cands = chain_candidates(gm)
    seg = _segments(gm, cands) if cands else []
    peak_before = _activation_peak(gm)
    profile = ctx.profile or cost.DeviceProfile.for_device(_device_of(gm))

    if mode == "sqrt":
        if cands:
            kept, (new, saved, copies) = sqrt_checkpoints(gm, cands, seg)
        else:
            kept, (new, saved, copies) = [], _apply(gm, pinned=set(), forced=set())
        budget = None
    else:
        budget = ctx.memory_budget if mode == "auto" else int(mode)
        if budget is None:
            raise PlanError("remat='auto' needs the device memory, which is unknown here; "
                            "give Plan.remat a budget in bytes.")
        new, saved, copies, kept = _solve_budget(gm, cands, seg, expensive, budget * dp,
                                                 profile, ranks=dp)
    new = torch.fx.GraphModule(gm, new.graph)
    for n in (*gm.graph.nodes, *new.graph.nodes):
        n.meta.pop(_PIN, None)
    peak_after = _activation_peak(new)
    live = set(new.graph.nodes)
    for n in saved:
        if n in live:
            n.meta[SAVED] = True
    names = {n.name for n in saved if n in live}
    new.meta[ir.REMAT_REPORT] = Decision(
        mode=str(mode), checkpoints=[c.name for c in kept], saved=sorted(names),
        recomputed=[c.name for c in copies],
        recompute_flops=sum(cost.node_flops(c) for c in copies),
        peak_before=peak_before // dp, peak_after=peak_after // dp, budget=budget)
    return new


def _solve_budget(gm, cands, seg, expensive, budget, profile, ranks=1):
    """The cheapest candidate plan whose simulated peak fits `budget` (module docstring). The
    graph holds the whole batch of `ranks` data-parallel ranks; errors speak per device."""
    tried = []

    lowest, cache = [], {}

    def attempt(pinned, forced):
        new, saved, copies = _apply(gm, pinned, forced, cache)
        peak = _activation_peak(new)
        lowest.append(peak)
        return peak, _recompute_time(copies, profile), new, saved, copies

    # no recompute of expensive ops at all: the min-cut only recomputes cheap ones
    base = attempt(expensive, set())
    if base[0] <= budget:
        return base[2], base[3], base[4], []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen = set()
    for b in _thresholds(seg, 5) if cands else []:
        kept = chen_checkpoints(cands, seg, b)
        if tuple(kept) in seen:
            continue
        seen.add(tuple(kept))
        bounds = [-1, *kept, len(cands) - 1] if (not kept or kept[-1] != len(cands) - 1) \
            else [-1, *kept]
        groups = []  # (expensive nodes of the segment, its saved bytes, its recompute time)
        for lo, hi in zip(bounds, bounds[1:]):
            lo_i = order[cands[lo]] if lo >= 0 else -1
            hi_i = order[cands[hi]]
            nodes = {n for n in expensive if lo_i < order[n] <= hi_i}
            groups.append((nodes, sum(seg[lo + 1:hi + 1]) or 1, _recompute_time(nodes, profile)))
        ranked = sorted(groups, key=lambda g: -g[2] / g[1])
        forced = {cands[j] for j in kept}
        lo, hi = 0, len(ranked)  # store the first k ranked segments; find the largest that fits
        best_k = None
        while lo <= hi:
            k = (lo + hi) // 2
            pinned = set().union(*(g[0] for g in ranked[:k])) if k else set()
            res = attempt(pinned, forced)
            if res[0] <= budget:
                best_k, lo = res, k + 1
            else:
                hi = k - 1
        if best_k is not None:
            tried.append((best_k[1], best_k, kept))
    # op-level knapsack (PyTorch's memory-budget formulation): free the expensive ops that
    # cost least recompute time per byte first; the fewest that fit wins
    per_byte = sorted(expensive, key=lambda n: _recompute_time([n], profile)
                      / max(cost.tensor_bytes(n.meta.get(ir.VAL)), 1))
    lo, hi, best_k = 1, len(per_byte), None
    while lo <= hi:
        k = (lo + hi) // 2
        res = attempt(set(per_byte[k:]), set())
        if res[0] <= budget:
            best_k, hi = res, k - 1
        else:
            lo = k + 1
    if best_k is not None:
        tried.append((best_k[1], best_k, []))
    if cands:  # every segment recomputed, for the finer segmentations Chen's estimate says fit
        options = {}
        strided = [tuple(range(o, len(cands), k)) for k in (2, 3) for o in range(k)]
        for kept in [tuple(chen_checkpoints(cands, seg, b)) for b in _thresholds(seg, 24)] \
                + strided:  # strides: every k-th boundary (e.g. block inputs, not mid-block)
            options.setdefault(kept, _chen_estimate(cands, seg, kept))
        fitting = sorted((k for k, est in options.items() if est <= budget),
                         key=lambda k: -len(k))[:6]  # finest first: least recompute per segment
        for kept in fitting:
            res = attempt(set(), {cands[j] for j in kept})
            if res[0] <= budget:
                tried.append((res[1], res, list(kept)))
    if cands:  # Chen's sqrt checkpoints: the lowest peak, at up to one forward of recompute
        kept, (new, saved, copies) = sqrt_checkpoints(gm, cands, seg, cache=cache)
        peak = _activation_peak(new)
        lowest.append(peak)
        if peak <= budget:
            tried.append((_recompute_time(copies, profile), (peak, 0, new, saved, copies),
                          [j for j, c in enumerate(cands) if c in kept]))
    if not tried:
        floor = min(lowest)
        raise PlanError(
            f"remat budget {budget // ranks} bytes of activations per device is below what fxpar "
            f"can reach for this model and batch (smallest simulated activation peak: "
            f"{floor // ranks} bytes per device). Fix: raise "
            "the budget, use more devices (dp/pp) or a smaller batch.")
    _, res, kept = min(tried, key=lambda t: t[0])
    return res[2], res[3], res[4], [cands[j] for j in kept]


def _device_of(gm):
    return next((_device_type(n) for n in gm.graph.nodes if n.op == "placeholder"), "cpu")

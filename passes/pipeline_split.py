"""Pipeline split: cut the joint graph into `n_stages` balanced stages, automatically.

The forward nodes, in graph (topological) order, are cut into contiguous ranges (a view or a
weight's transpose sits with its first forward user). Each backward node goes with the
forward work it differentiates: the forward op of its autograd seq_nr or the latest forward
value (or parameter) it reads, but never later than the backward values it reads (gradients
flow from the last stage to the first), so every backward edge points from a stage to an
earlier one. A stage's cost is its forward and backward compute (cost.node_time) plus the
point-to-point time of every value crossing its two cuts per microbatch, both directions
(activations forward; their gradients and any other backward value back;
cost.DeviceProfile's alpha-beta link): exactly what the inserted transfers send. The cuts
minimise the slowest stage: a dynamic program over cut positions (the positions whose
crossing bytes are at most twice the smallest, e.g. between blocks where only the residual
stream and its gradient cross), so stages also cut where little has to be sent.

Every node gets meta["stage"] and meta["pipe_phase"]: "F", "B" (or, for the zero-bubble
schedule, "I" = what the input gradients sent to the previous stage need, "W" = the rest:
weight gradients). Every edge between stages gets an explicit transfer node (an `aten.alias`
with meta["transfer"] = (src stage, dst stage), placed in the consuming stage): activations
forward, gradients backward, and values that skip stages (residual streams). The runtime
turns these into send/recv between the stages' ranks. A tied weight's gradient parts are
summed once a step (phase "R"), so its transfer is once a step too. `gm.meta[ir.PIPELINE]`
records cuts, stage costs and bytes sent.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import warnings

import torch
import torch.fx

from fxpar.core import cost, ir
from fxpar.core.errors import PlanError
from fxpar.core.graphs import grad_sum_trees

aten = torch.ops.aten
PHASE, TRANSFER = ir.PHASE, ir.TRANSFER


@dataclasses.dataclass
class Split:
    n_stages: int
    cuts: list[str]               # the last forward node of every stage but the last
    stage_costs: list[float]      # seconds per microbatch (compute + send/recv), by the model
    compute: list[float]          # the compute part
    cut_bytes: list[int]          # bytes crossing each cut per microbatch, both directions
    transfers: list[tuple[str, int, int]]  # (transfer node, src stage, dst stage)

    @property
    def imbalance(self) -> float:
        """slowest stage / mean stage."""
        return max(self.stage_costs) / (sum(self.stage_costs) / len(self.stage_costs))


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    pp: int | None = 1
    schedule: str = "1f1b"


CONTRACT = ir.PassContract(
    "pipeline_split", Options,
    requires=frozenset({ir.VAL, ir.REGION, ir.ROLE, ir.MODULE, ir.SEQ_NR}),
    provides=frozenset({ir.STAGE, ir.PHASE, ir.TRANSFER, ir.PIPELINE}),
    applies=lambda o: (o.pp or 1) > 1)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    n_stages = options.pp * ctx.virtual_stages
    if n_stages == 1:
        return gm
    split = partition(gm, n_stages, ctx.device, split_weight_grads=options.schedule == "zero-bubble",
                      profile=ctx.profile)
    idle = [s for s, c in enumerate(split.compute) if c < 0.01 * max(split.compute)]
    if idle:  # (the cheapest split by the cost model, but not what pp was asked for)
        warnings.warn(
            f"pp={options.pp}: the pipeline split leaves stage(s) {idle} of {n_stages} with "
            "(almost) no compute - at this size a microbatch's work costs less than sending "
            "its activations between stages, so the cost model keeps it together; those ranks "
            "mostly wait. Use a smaller pp or fewer microbatches (more work per microbatch), "
            "or dp for this model.")
    gm.meta[ir.PIPELINE] = split
    return gm


def _device(gm):
    return next(n.meta[ir.VAL].device for n in gm.graph.nodes if n.op == "placeholder")


def partition(gm: torch.fx.GraphModule, n_stages: int, device=None,
              split_weight_grads: bool = False, profile=None) -> Split:
    graph = gm.graph
    profile = profile or cost.DeviceProfile.for_device(device or _device(gm))
    nodes = list(graph.nodes)
    fwd = [n for n in nodes if n.op == "call_function" and n.meta.get(ir.REGION) != ir.BACKWARD]
    bwd = [n for n in nodes if n.op == "call_function" and n.meta.get(ir.REGION) == ir.BACKWARD]
    if len(fwd) < n_stages:
        raise _error(f"the forward has only {len(fwd)} operations, fewer than the {n_stages} "
                     "pipeline stages asked for. Use a smaller pp.")
    # a forward node's index: its place in graph order, except that work on parameters alone
    # (a weight's transpose) and a view sit with their first forward user. Neither is worth
    # a cut of its own (a view crosses as its base does, a weight is held where it is read),
    # and the backward that reads them belongs with that user: a tied LM head's transpose is
    # traced next to the embedding, and anchoring the head's input gradient there sent the
    # vocabulary-wide logits' gradient back across stages every microbatch.
    fidx = {n: i for i, n in enumerate(fwd)}
    weight_only = set()
    for n in fwd:
        if all(a.op == "placeholder" and a.meta.get(ir.ROLE) in ("param", "buffer")
               or a in weight_only for a in n.all_input_nodes):
            weight_only.add(n)
    for n in reversed(fwd):
        if n in weight_only or (cost.is_view(n) and n.target is not operator.getitem
                                and isinstance(n.meta.get(ir.VAL), torch.Tensor)):
            users = [fidx[u] for u in n.users if u in fidx]
            if users:
                fidx[n] = min(users)
    for n in fwd:  # one output of a multi-output op goes where the op does
        if n.target is operator.getitem and n.args[0] in fidx:
            fidx[n] = fidx[n.args[0]]
    param_anchor = {}
    for n in nodes:
        if n.op == "placeholder":
            users = [fidx[u] for u in n.users if u in fidx]
            if users:
                param_anchor[n] = min(users)

    # each backward node's anchor: the forward index whose stage it joins. It reads the
    # forward op it differentiates (autograd's seq_nr) as well as the values it reads: a
    # weight gradient x^T dy reads only the op's input x, and anchored there, the head's
    # weight gradient ran a stage early, with the logits' gradient sent to it.
    last_of_seq: dict[int, int] = {}
    for n in fwd:
        if n.meta.get(ir.SEQ_NR) is not None:
            last_of_seq[n.meta[ir.SEQ_NR]] = max(last_of_seq.get(n.meta[ir.SEQ_NR], 0), fidx[n])
    anchor: dict[torch.fx.Node, int] = {}
    for b in bwd:
        reads = [fidx[a] for a in b.all_input_nodes if a in fidx]
        if b.meta.get(ir.SEQ_NR) in last_of_seq:
            reads.append(last_of_seq[b.meta[ir.SEQ_NR]])
        reads += [param_anchor[a] for a in b.all_input_nodes if a in param_anchor]
        grads_in = [anchor[a] for a in b.all_input_nodes if a in anchor]
        a = max(reads) if reads else (min(grads_in) if grads_in else len(fwd) - 1)
        anchor[b] = min([a] + grads_in)

    # work per forward index (its forward op and the backward anchored to it)
    work = [0.0] * len(fwd)
    for n in fwd:
        work[fidx[n]] += cost.node_time(n, profile)
    for b, a in anchor.items():
        work[a] += cost.node_time(b, profile)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)

    # bytes crossing the cut after forward index i, both directions: forward values read
    # later (by forward or backward work), and backward values read by earlier stages'
    # backward (an activation's gradient, but also any other gradient the anchors send
    # back). A tied weight's gradient parts are summed once a step, not counted here.
    once_a_step = {n for _, tree, _ in grad_sum_trees(graph) for n in tree}

    def reads_of(n):  # where n is read, through the views re-made from it
        for u in n.users:
            if _crosses_as_its_base(u):
                yield from reads_of(u)
            elif (u in fidx or u in anchor) and u not in once_a_step:
                yield fidx[u] if u in fidx else anchor[u]

    delta = [0] * (len(fwd) + 1)  # cross as differences: a value adds to [lo, hi)
    for n in fwd + bwd:
        if _crosses_as_its_base(n):
            continue
        at = [fidx[n] if n in fidx else anchor[n]]
        uses = list(reads_of(n))
        size = cost.tensor_bytes(n.meta.get(ir.VAL))
        delta[min(uses + at)] += size
        delta[max(uses + at)] -= size
    cross = list(itertools.accumulate(delta))[:len(fwd)]

    cuts = _min_max_cuts(prefix, cross, n_stages, profile)
    stage_of_index = []
    for s, (lo, hi) in enumerate(zip([0] + [c + 1 for c in cuts], cuts + [len(fwd) - 1])):
        stage_of_index += [s] * (hi - lo + 1)

    def p2p(c):
        return 2 * profile.alpha + cross[c] / profile.link_bandwidth

    compute = [prefix[hi + 1] - prefix[lo] for lo, hi in
               zip([0] + [c + 1 for c in cuts], cuts + [len(fwd) - 1])]
    costs = [compute[s] + (p2p(cuts[s - 1]) if s else 0) + (p2p(cuts[s]) if s < n_stages - 1
                                                              else 0) for s in range(n_stages)]

    for n in fwd:
        n.meta[ir.STAGE], n.meta[PHASE] = stage_of_index[fidx[n]], "F"
    for b in bwd:
        b.meta[ir.STAGE], b.meta[PHASE] = stage_of_index[anchor[b]], "B"
    _getitems_follow_producer(fwd + bwd)
    if split_weight_grads:
        _split_input_and_weight_grads(bwd)
        _getitems_follow_producer(bwd)
    _sum_shared_grads_once(graph)
    transfers = _insert_transfers(graph)
    return Split(n_stages, [fwd[c].name for c in cuts], costs, compute,
                 [cross[c] for c in cuts], transfers)


def _min_max_cuts(prefix, cross, n_stages, profile) -> list[int]:
    """Cut positions (last forward index of each stage but the last) minimising the slowest
    stage; among candidates whose crossing bytes are <= 2x the smallest (all if too few)."""
    n = len(prefix) - 1
    inner = range(n - 1)
    floor = min(cross[i] for i in inner)
    cand = [i for i in inner if cross[i] <= 2 * floor]
    if len(cand) < 4 * n_stages:
        cand = list(inner)
    if len(cand) > 600:
        cand = sorted(sorted(cand, key=lambda i: cross[i])[:600])

    def p2p(i):
        return 2 * profile.alpha + cross[i] / profile.link_bandwidth

    # best[k][j]: slowest stage when the first k+1 stages end at candidate j
    inf = float("inf")
    best = [[inf] * len(cand) for _ in range(n_stages - 1)]
    back = [[-1] * len(cand) for _ in range(n_stages - 1)]
    for j, c in enumerate(cand):
        best[0][j] = prefix[c + 1] + p2p(c)
    for k in range(1, n_stages - 1):
        for j, c in enumerate(cand):
            for i in range(j):
                b = cand[i]
                t = max(best[k - 1][i], prefix[c + 1] - prefix[b + 1] + p2p(b) + p2p(c))
                if t < best[k][j]:
                    best[k][j], back[k][j] = t, i
    last = n_stages - 2
    total = [max(best[last][j], prefix[n] - prefix[c + 1] + p2p(c)) for j, c in enumerate(cand)]
    j = min(range(len(cand)), key=total.__getitem__)
    if total[j] == inf:
        raise _error(f"cannot cut the forward into {n_stages} stages; use a smaller pp.")
    cuts = []
    for k in range(last, -1, -1):
        cuts.append(cand[j])
        j = back[k][j]
    return cuts[::-1]


def _getitems_follow_producer(nodes):
    for n in nodes:
        if n.target is operator.getitem:
            src = n.args[0]
            n.meta[ir.STAGE], n.meta[PHASE] = src.meta[ir.STAGE], src.meta[PHASE]


def _split_input_and_weight_grads(bwd):
    """Zero-bubble: in each stage's backward, the nodes that the gradients sent to earlier
    stages need form "I"; the rest (weight gradients) "W", run later to fill bubbles."""
    need_i = set()
    for b in reversed(bwd):
        s = b.meta[ir.STAGE]
        sends_down = any(u.meta.get(ir.STAGE, s) < s for u in b.users if u.op == "call_function")
        if sends_down or any(u in need_i for u in b.users if u.meta.get(ir.STAGE) == s):
            need_i.add(b)
            if b.target is operator.getitem:  # the whole multi-output op goes with it
                need_i.add(b.args[0])
    for b in bwd:
        b.meta[PHASE] = "I" if b in need_i else "W"


def _sum_shared_grads_once(graph) -> None:
    """A weight read on several stages (a tied embedding and LM head) gets its gradient as
    the sum (add) of each stage's part. A sum is linear, so the add runs once a step on the
    parts summed over the microbatches: it joins its stage's "R" part (the one the runtime
    runs after the last microbatch), and the other stage's part crosses once a step instead
    of once per microbatch, which had the sender hold one copy per microbatch until the
    step ended (a 150k x 896 head's partial gradient is 270 MB in bf16)."""
    for root, tree, leaves in grad_sum_trees(graph):
        if len({a.meta[ir.STAGE] for a in leaves}) < 2:
            continue
        for n in tree:
            n.meta[ir.STAGE], n.meta[PHASE] = root.meta[ir.STAGE], "R"


def _insert_transfers(graph) -> list[tuple[str, int, int]]:
    """One transfer node per (value, consuming stage) for every edge between stages. A view
    (a slice of q/k/v, a transpose) is not sent as such: its base is, and the view ops are
    re-made in the consuming stage, so every value there has the layout the graph was traced
    with (later views and kernels depend on strides)."""
    transfers = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    sent: dict[tuple, torch.fx.Node] = {}
    for n in list(graph.nodes):
        if n.op != "call_function" or ir.STAGE not in n.meta:
            continue
        by_stage: dict[int, list] = {}
        for u in list(n.users):
            s = u.meta.get(ir.STAGE)
            if u.op == "call_function" and s is not None and s != n.meta[ir.STAGE] \
                    and TRANSFER not in u.meta:
                by_stage.setdefault(s, []).append(u)
        for s, users in sorted(by_stage.items()):
            first = min(users, key=order.__getitem__)
            # (with the first of its readers' parts to run: zero-bubble's input-gradient part
            # (I) before its weight-gradient part (W), whatever the graph order)
            phase = ir.first_phase(users)
            chain = _view_chain(n)
            base = chain[0]
            if (base, s) not in sent:
                with graph.inserting_before(first):
                    t = graph.call_function(aten.alias.default, (base,))
                t.meta.update({ir.VAL: base.meta[ir.VAL], ir.MODULE: base.meta.get(ir.MODULE, ""),
                               ir.REGION: first.meta.get(ir.REGION), ir.STAGE: s,
                               PHASE: phase, TRANSFER: (base.meta[ir.STAGE], s)})
                sent[(base, s)] = t
                order[t] = order[first] - 0.5
                transfers.append((t.name, base.meta[ir.STAGE], s))
            else:  # (sent for another base's readers: the earlier of the two parts)
                sent[(base, s)].meta[PHASE] = ir.first_phase([sent[(base, s)]] + users)
            value = sent[(base, s)]
            if order.get(value, -1) > order[first] or value not in order:
                first.prepend(value)  # an earlier user of the same base in this stage
                order[value] = order[first] - 0.5
            env = {base: value}
            for v in chain[1:]:
                with graph.inserting_before(first):
                    copy = graph.node_copy(v, lambda a: env.get(a, a))
                copy.meta.update({ir.STAGE: s, PHASE: phase,
                                  ir.REGION: first.meta.get(ir.REGION)})
                env[v] = copy
                value = copy
            for u in users:
                u.replace_input_with(n, value)
    return transfers


def _crosses_as_its_base(n) -> bool:
    """A view of a computed value is not sent: its base is, and the view re-made."""
    return (cost.is_view(n) and n.target is not operator.getitem and bool(n.args)
            and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "call_function"
            and isinstance(n.args[0].meta.get(ir.VAL), torch.Tensor))


def _view_chain(n) -> list:
    """[base, view, view, ..., n]: n's chain of view ops back to the value owning its memory,
    within n's stage (just [n] if n is not a view)."""
    chain = [n]
    while (_crosses_as_its_base(chain[0])
           and chain[0].args[0].meta.get(ir.STAGE) == n.meta[ir.STAGE]):
        chain.insert(0, chain[0].args[0])
    return chain


def _error(msg):
    return PlanError(msg)

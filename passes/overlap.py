"""Communication/computation overlap: start each collective early, wait for it late.

Earlier passes emit every collective as a start (`_c10d_functional.*`, expert parallelism's
`fxpar::ep_dispatch` / `ep_combine`) immediately followed by its `wait_tensor`: correct,
but the compute thread idles while the bytes move. This pass reorders the graph so that
  - the compute of an expert all-to-all's layer that does not read its rows moves above
    the all-to-all's first reader (DeepSeek's shared experts beside the dispatch),
  - each wait sinks to just before the first node that reads its result (gradient buckets:
    to the end of the backward, so they travel while the rest of the backward computes), and
  - each start rises to just after the nodes that produce its input (ZeRO-3 parameter
    all-gathers: prefetched while the previous layer computes),
under a memory limit: the step's peak (cost.simulate_liveness) may grow by at most `slack`
bytes, and at each node the reordered graph may hold beyond the blocking schedule the slack
plus what the live set there is below that peak. A hoisted start holds its output buffer
earlier; a sunk wait holds the input of an all-gather / reduce-scatter longer (the backend
reads it until done). By default `slack` is zero when ZeRO-3 gathers parameters (one
collective per layer: module path up to its first numeric index, e.g. `transformer.h.3`), two
gradient buckets otherwise (default_slack). Starts of one kind keep their
relative order, so the backend's first-in-first-out channel serves them in the order they are
needed; a parameter all-gather may move ahead of a gradient reduce-scatter (the compute waits
on the first, nothing soon on the second), and a reduce-scatter is waited on at the latest
where the next one starts (one in flight, as FSDP2).

The runtime (runtime/comm.py) runs starts and waits on real work handles, so the reordering is
what makes communication and computation overlap. `gm.meta[ir.OVERLAP_REPORT]` records what moved.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from fxpar.core import cost, experts, ir
from fxpar.core.graphs import packing

c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class Decision:
    slack: int                        # bytes the reordered graph may hold beyond the blocking one
    hoisted: dict[str, int]           # start node -> nodes it moved above
    sunk: dict[str, int]              # wait node -> nodes it moved below
    limited: list[str]                # collectives the memory limit stopped short
    why: str = ""                     # nothing moved: the reason, for the report and console
    # expert all-to-all wait -> compute nodes moved above its first reader
    pulled: dict[str, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """One line for the console and the pass report."""
        line = (f"{len(self.hoisted)} collectives started earlier, {len(self.sunk)} waits "
                "moved later")
        if self.pulled:
            line += (f", {sum(self.pulled.values())} compute nodes run beside "
                     f"{len(self.pulled)} expert all-to-alls")
        line += f" (memory limit {self.slack / 1024:.0f} KiB)"
        return line + (f". Nothing moved: {self.why}." if self.why else "")


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    overlap: bool = True
    dp: int | None = 1
    tp: int | None = 1
    pp: int | None = 1


CONTRACT = ir.PassContract(
    "overlap", Options,
    requires=frozenset({ir.VAL, ir.REGION}),
    reads=frozenset({ir.BUCKET, ir.PACK, ir.TRANSFER, ir.SHARD}),
    provides=frozenset({ir.MOVED, ir.OVERLAP_REPORT}),
    # it moves every collective: the ones these insert too
    after=frozenset({"pipeline_split", "tensor_parallel", "data_parallel"}),
    applies=lambda o: o.overlap and (o.dp or 1) * (o.tp or 1) * (o.pp or 1) > 1,
    # it only reorders nodes: every value stays what it was (the manager's lint still checks
    # that each node follows its inputs)
    values_fresh=True)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    graph = gm.graph
    pairs = collective_pairs(graph)
    if not pairs:
        return gm
    slack = ctx.overlap_memory_bytes
    if slack is None:
        slack = default_slack(pairs)
    order = list(graph.nodes)
    extra = dict.fromkeys(order, 0)
    # what each node may hold beyond the blocking schedule: the slack, plus how far below the
    # blocking schedule's peak the live bytes are there (by cost.simulate_liveness). The step's
    # peak grows by at most the slack, and where the live set is small (early in the forward,
    # late in the backward: activations not yet saved / already freed) prefetching is deeper
    timeline = cost.simulate_liveness(gm)
    room = {n: slack + timeline.peak_total - timeline.during[i] for i, n in enumerate(order)}
    n_inputs = sum(1 for n in order if n.op == "placeholder")
    hoisted, sunk, limited = {}, {}, []

    # 0. an expert all-to-all is waited on inside its layer's compute (the grouped matmuls
    #    read the rows it brings): the layer's compute that does not need them (DeepSeek's
    #    shared experts, the router's gradient) moves above the wait's first reader, so step 1
    #    sinks the wait below it and the all-to-all travels while it runs (torchtitan orders
    #    its shared experts by hand for the same)
    pulled = {}
    for start, wait in pairs:
        if start.target in experts.ASYNC:
            moved = _pull_independent(order, wait, extra, room)
            if moved:
                pulled[wait.name] = moved

    # 1. waits sink to their first use (latest collectives first: they have the least backward
    #    left to hide behind, and the memory they hold is the shortest). A collective that
    #    holds its input until done (a reduce-scatter) is waited at the latest where the next
    #    one of its kind starts: the backend serves them in order, so waiting later gains
    #    nothing but holds a layer's gradients longer (FSDP2 likewise keeps one in flight),
    #    slack the parameter prefetch of step 2 needs
    next_of_kind = {}
    for i, (start, _) in enumerate(pairs):
        next_of_kind[start] = next((s for s, _ in pairs[i + 1:] if s.target is start.target),
                                   None)
    for start, wait in reversed(pairs):
        held = _input_bytes_held(start)
        pos = order.index(wait)
        first_use = min(order.index(u) for u in wait.users)
        if held and next_of_kind[start] is not None:
            first_use = min(first_use, max(pos + 1, order.index(next_of_kind[start])))
        new = pos
        for k in range(pos + 1, first_use):
            if extra[order[k]] + held > room[order[k]]:
                limited.append(wait.name)
                break
            new = k
        for k in range(pos + 1, new + 1):
            extra[order[k]] += held
        if new != pos:
            order.insert(new, order.pop(pos))
            sunk[wait.name] = new - pos
            wait.meta[ir.MOVED] = f"waited {new - pos} nodes later"

    # 2. starts rise to just after their inputs (and after the previous start of their kind:
    #    a parameter all-gather may pass a gradient reduce-scatter, which nothing waits on
    #    soon); a packing copy of several parameter shards into one all-gather's input
    #    (ZeRO-3, ir.PACK) rises with its collective
    floors: dict = {}  # per kind, the node the next start of that kind stays after
    for start, wait in pairs:
        floor = order.index(floors[start.target]) if start.target in floors else n_inputs - 1
        pos = order.index(start)
        packs, inputs = packing(start)
        lo = max([floor] + [order.index(a) for a in inputs])
        direct = [a for a in start.all_input_nodes if a in packs]
        size = sum(cost.tensor_bytes(n.meta.get(ir.VAL)) for n in (start, *direct))
        # the packing's own temporaries (a quantization's fp32 copies) live where it runs
        # now: for a moment, beside what the move holds
        working = max((cost.tensor_bytes(n.meta.get(ir.VAL)) for n in packs
                       if n not in direct), default=0)
        new = pos
        for k in range(pos - 1, lo, -1):
            if extra[order[k]] + size + working > room[order[k]]:
                limited.append(start.name)
                break
            new = k
        for k in range(new, pos):
            extra[order[k]] += size
        if new != pos:
            order.insert(new, order.pop(pos))
            hoisted[start.name] = pos - new
            start.meta[ir.MOVED] = f"started {pos - new} nodes earlier"
        # the packing copies go right before their collective, wherever it now starts: above
        # its old place, or still below a copy (a wait sunk in step 1 can sit between copy and
        # collective, and the memory limit can stop the start right there); each copy is
        # taken out before the start's place is looked up, so that place is its final one
        for pk in sorted(packs, key=order.index):
            order.remove(pk)
            order.insert(order.index(start), pk)
        # (a reduce-scatter, or qgZ's all-to-all, after the previous one's wait: step 1 keeps
        # one in flight)
        floors[start.target] = wait if start.target in (
            c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default) else start

    for prev, n in zip(order, order[1:]):
        if prev.next is not n:
            prev.append(n)
    why = "" if hoisted or sunk or pulled else _why_nothing_moved(pairs, limited)
    gm.meta[ir.OVERLAP_REPORT] = Decision(slack, hoisted, sunk, sorted(set(limited)), why,
                                          pulled)
    return gm


def _pull_independent(order: list, wait: torch.fx.Node, extra: dict, room: dict) -> int:
    """Move the compute of the wait's layer that follows its first reader but reads nothing
    computed from the wait's result (nor from a node that stays) right above that reader,
    within the memory room (each moved result is held from there to its old place); how
    many nodes moved."""
    first = min(order.index(u) for u in wait.users)
    reader = order[first]
    layer = ir.layer_of(reader.meta.get(ir.MODULE, ""))
    place = (reader.meta.get(ir.REGION), reader.meta.get(ir.STAGE), reader.meta.get(ir.PHASE))
    stay, moved = {wait}, []
    head = float("inf")  # the least room left over order[first:k] (a move holds its bytes
    # over all of it)
    for k in range(first, len(order)):
        n = order[k]
        if k > first:
            prev = order[k - 1]
            head = min(head, room[prev] - extra[prev])
        if n.op != "call_function" or ir.layer_of(n.meta.get(ir.MODULE, "")) != layer or \
                (n.meta.get(ir.REGION), n.meta.get(ir.STAGE), n.meta.get(ir.PHASE)) != place:
            if n.meta.get(ir.MODULE) and ir.layer_of(n.meta[ir.MODULE]) != layer:
                break  # (the layer's compute ends)
            stay.add(n)
            continue
        size = cost.tensor_bytes(n.meta.get(ir.VAL))
        if not _movable(n) or any(a in stay for a in n.all_input_nodes) or size > head:
            stay.add(n)
            continue
        for j in range(first, k):
            extra[order[j]] += size
        head -= size
        moved.append(n)
        n.meta[ir.MOVED] = f"run beside {wait.name}"
    if not moved:
        return 0
    gone = set(moved)
    order[first:] = moved + [n for n in order[first:] if n not in gone]
    return len(moved)


def _movable(n: torch.fx.Node) -> bool:
    """Compute the pass may run earlier: no communication, no random op (their order is the
    random stream's), nothing impure, no gradient packing."""
    t = n.target
    if t is operator.getitem:
        return True  # (goes with what it takes apart)
    return isinstance(t, torch._ops.OpOverload) and \
        t.namespace not in ir.COMMUNICATION_NAMESPACES and t.namespace != "fxpar" and \
        torch.Tag.nondeterministic_seeded not in t.tags and not n.is_impure() and \
        ir.PACK not in n.meta and ir.BUCKET not in n.meta


def _why_nothing_moved(pairs, limited) -> str:
    """Every collective already starts right after its input and is waited right before its
    first use: say so, and what would give it room (the usual case: one gradient bucket)."""
    if limited:
        return (f"the memory limit stopped all {len(limited)} moves: each would have raised "
                "the step's peak memory (the pass moves collectives only where the live set "
                "is below the peak, plus a slack of two gradient buckets, none with ZeRO-3)")
    grads = [s for s, _ in pairs if s.meta.get(ir.BUCKET)]
    why = (f"each of the {len(pairs)} collectives is already issued right after its input "
           "is made and waited right before its first use")
    if len(grads) == 1:
        why += ("; the gradients form one bucket, which is complete only at the end of the "
                "backward (data_parallel's alpha-beta sizing found one bucket cheapest at this "
                "size; a smaller Plan.bucket_mb splits them so early buckets travel while the "
                "backward computes)")
    return why


def collective_pairs(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(start, wait) of every collective whose result only its wait reads, in graph order."""
    pairs = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target in cost.COLLECTIVES:
            users = list(n.users)
            if len(users) == 1 and users[0].target is c10d.wait_tensor.default:
                pairs.append((n, users[0]))
    return pairs


def _input_bytes_held(start: torch.fx.Node) -> int:
    """Bytes a later wait keeps alive: the input of a collective that reads it asynchronously
    (parameters are alive anyway)."""
    if start.target not in cost.ASYNC_INPUT_COLLECTIVES:
        return 0
    x = start.args[0]
    return 0 if x.op == "placeholder" else cost.tensor_bytes(x.meta.get(ir.VAL))


def default_slack(pairs) -> int:
    """How much the step's peak may grow. With parameter all-gathers (ZeRO-3): nothing; they
    are prefetched where the live set is below the step's peak (run's room), which measured
    as fast as a layer of slack at a 2.5% lower peak (benchmarks/zero_vs_fsdp.py; a fixed
    slack of two layers, or of two of a model's one-off giants such as an LLM's LM head, cost
    up to 10% of a ZeRO-3 rank's peak). Gradient buckets only: two of the largest (an
    all-reduce's buffer, a reduce-scatter's input), so one may overlap while the next fills."""
    if any(start.target is c10d.all_gather_into_tensor.default for start, _ in pairs):
        return 0
    # (not expert all-to-alls': their graph values bound the rows a rank may receive, ep x
    # its own, far above what they hold)
    return 2 * max((_input_bytes_held(start) if start.target in cost.ASYNC_INPUT_COLLECTIVES
                    else cost.tensor_bytes(start.meta.get(ir.VAL)) for start, _ in pairs
                    if start.target not in experts.ASYNC), default=0)

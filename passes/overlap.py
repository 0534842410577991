"""Communication/computation overlap: start each collective early, wait for it late.

Earlier passes emit every collective as a start (`_c10d_functional.*`) immediately followed
by its `wait_tensor`: correct, but the compute thread idles while the bytes move. This pass
reorders the graph so that
  - each wait sinks to just before the first node that reads its result (gradient buckets:
    to the end of the backward, so they travel while the rest of the backward computes), and
  - each start rises to just after the nodes that produce its input (ZeRO-3 parameter
    all-gathers: prefetched while the previous layer computes),
under a memory limit: at no point may the reordered graph hold more than `slack` bytes beyond
the blocking schedule. A hoisted start holds its output buffer earlier; a sunk wait holds the
input of an all-gather / reduce-scatter longer (the backend reads it until done). By default
`slack` is two "units" (FSDP's prefetch of one to two layers): a unit is the parameters
of one layer (module path up to its first numeric index, e.g. `transformer.h.3`) for
all-gathers, or one gradient bucket for reduce-scatters. Starts keep their relative order, so
the backend's first-in-first-out channel serves collectives in the order they are needed.

The runtime (runtime/comm.py) runs starts and waits on real work handles, so the reordering is
what makes communication and computation overlap. `gm.meta["overlap"]` records what moved.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fxpar.compiler import cost, ir

c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class Decision:
    slack: int                        # bytes the reordered graph may hold beyond the blocking one
    hoisted: dict[str, int]           # start node -> nodes it moved above
    sunk: dict[str, int]              # wait node -> nodes it moved below
    limited: list[str]                # collectives the memory limit stopped short
    why: str = ""                     # nothing moved: the reason, for the report and console


def run(gm: torch.fx.GraphModule, plan, ctx) -> torch.fx.GraphModule:
    graph = gm.graph
    pairs = collective_pairs(graph)
    if not pairs:
        return gm
    slack = ctx.overlap_memory_bytes
    if slack is None:
        slack = default_slack(pairs)
    order = list(graph.nodes)
    extra = dict.fromkeys(order, 0)
    n_inputs = sum(1 for n in order if n.op == "placeholder")
    hoisted, sunk, limited = {}, {}, []

    # 1. waits sink to their first use (latest collectives first: they have the least backward
    #    left to hide behind, and the memory they hold is the shortest)
    for start, wait in reversed(pairs):
        held = _input_bytes_held(start)
        pos = order.index(wait)
        first_use = min(order.index(u) for u in wait.users)
        new = pos
        for k in range(pos + 1, first_use):
            if extra[order[k]] + held > slack:
                limited.append(wait.name)
                break
            new = k
        for k in range(pos + 1, new + 1):
            extra[order[k]] += held
        if new != pos:
            order.insert(new, order.pop(pos))
            sunk[wait.name] = new - pos
            wait.meta["moved"] = f"waited {new - pos} nodes later"

    # 2. starts rise to just after their inputs (and after the previous start); a packing
    #    copy of several parameter shards into one all-gather's input (ZeRO-3, ir.PACK) rises
    #    with its collective
    floor = n_inputs - 1
    for start, _ in pairs:
        pos = order.index(start)
        packs = [a for a in start.all_input_nodes if a.meta.get(ir.PACK)]
        inputs = [b for a in start.all_input_nodes
                  for b in (a.all_input_nodes if a in packs else [a])]
        lo = max([floor] + [order.index(a) for a in inputs])
        size = sum(cost.tensor_bytes(n.meta.get(ir.VAL)) for n in (start, *packs))
        new = pos
        for k in range(pos - 1, lo, -1):
            if extra[order[k]] + size > slack:
                limited.append(start.name)
                break
            new = k
        for k in range(new, pos):
            extra[order[k]] += size
        if new != pos:
            order.insert(new, order.pop(pos))
            for pk in packs:
                order.insert(order.index(start), order.pop(order.index(pk)))
            hoisted[start.name] = pos - new
            start.meta["moved"] = f"started {pos - new} nodes earlier"
        floor = order.index(start)

    for prev, n in zip(order, order[1:]):
        if prev.next is not n:
            prev.append(n)
    why = "" if hoisted or sunk else _why_nothing_moved(pairs, limited)
    gm.meta["overlap"] = Decision(slack, hoisted, sunk, sorted(set(limited)), why)
    return gm


def _why_nothing_moved(pairs, limited) -> str:
    """Every collective already starts right after its input and is waited right before its
    first use: say so, and what would give it room (the usual case: one gradient bucket)."""
    if limited:
        return (f"the memory limit stopped all {len(limited)} moves (Plan overlap memory: "
                "raise it to let collectives start earlier / wait later)")
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
    """Units: the all-gathered bytes of one layer, a reduce-scatter's input, an all-reduce's
    buffer. The slack is two units of the repeated layers (numbered module paths: ZeRO-3's
    per-layer gathers) and at least the largest unit (one collective of it may always
    overlap); without repeated layers (gradient buckets only), two of the largest. A model's
    one-off giants (an LLM's embedding and LM head: a third of a 150M Llama's weights) would
    otherwise set the prefetch depth of every layer: two of them held ahead cost 10% of a
    ZeRO-3 rank's peak (benchmarks/meta_memory.py)."""
    units: dict[tuple, int] = {}
    for start, wait in pairs:
        if start.target is c10d.all_gather_into_tensor.default:
            key = ("gather", wait.meta.get(ir.REGION), ir.layer_of(wait.meta.get(ir.MODULE, "")))
            units[key] = units.get(key, 0) + cost.tensor_bytes(start.meta.get(ir.VAL))
        elif start.target is c10d.reduce_scatter_tensor.default:
            units[("bucket", start.name, start.meta.get(ir.MODULE, ""))] = \
                _input_bytes_held(start)
        else:  # an all-reduce: its buffer, held from the start
            units[("bucket", start.name, start.meta.get(ir.MODULE, ""))] = cost.tensor_bytes(
                start.meta.get(ir.VAL))
    repeated = [b for k, b in units.items() if any(p.isdigit() for p in k[2].split("."))]
    largest = max(units.values(), default=0)
    return max(2 * max(repeated), largest) if repeated else 2 * largest

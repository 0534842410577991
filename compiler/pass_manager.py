"""The pass list, ordered and checked from the passes' contracts, and the checks run after
every pass.

Each pass is `run(gm, options, ctx) -> gm` beside its CONTRACT (core/ir.PassContract): the
plan decides which passes run (`applies`), their contracts decide the order - a provider
before the passes that require or read its keys, and the few constraints no key names
(`before`, `after`) - and a pass whose required key neither capture nor an earlier pass
provides is refused before anything runs. After every pass: `graph.lint()`, a fake-tensor
re-propagation that checks every node's meta["val"] (shape, dtype) unless the pass has just
recomputed them itself, a snapshot for `pm.stage_graphs`, and one log line (DEBUG:
FXPAR_LOGS=+passes; INFO when over 2 s).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import networkx as nx
import torch
import torch.fx

from fxpar.core import cost, ir
from fxpar.core.errors import PassError
from fxpar.core.graphs import snapshot, verify
from fxpar.core.logs import announce, phase_done
from fxpar.core.plan import pass_options
from fxpar.kernels.jit import unavailable_reason
from fxpar.passes import (batched_experts, context_parallel, data_parallel, expert_parallel,
                          fusion, grouped_experts, overlap, pipeline_split, precision, remat,
                          tensor_parallel)

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the graph (read-only): the signature, the symbolic group
    names, and the inputs of remat, overlap, pipeline_split and the cost model. What a pass
    decides goes into the graph, node.meta, or gm.meta under the names core/ir.py
    declares."""
    signature: ir.GraphSignature
    group_names: dict[str, str] = dataclasses.field(
        default_factory=lambda: {k: v for k, v in ir.GROUPS.items()})  # mesh dim -> group
    memory_budget: int | None = None  # activation bytes per device for remat="auto"
    overlap_memory_bytes: int | None = None  # overlap: extra bytes allowed (None: 2 layers)
    virtual_stages: int = 1  # pipeline stages per rank (interleaved schedule: 2)
    device: Any = None       # the rank's device
    # the cost model every pass prices with (compile makes it once for the device; None:
    # a pass run alone takes its device's default profile)
    profile: cost.DeviceProfile | None = None
    codegen: str = "eager"   # Plan.codegen resolved (compiler/codegen.decide): the fuser
    # tensor_parallel: the parameter layouts to keep (ir.TP_LAYOUTS of the training graph,
    # for evaluate's forward-only graph: the runtime holds those shards); None: decide
    tp_layouts: list | None = None
    # False: the caller only counts what the pass adds (the planner's probes), so a pass may
    # skip re-propagating meta["val"] after its rewrite (data_parallel does)
    fresh_values: bool = True


# every pass fxpar has; which run, and in what order, follows from their contracts
PASSES = (batched_experts, grouped_experts, precision, remat, pipeline_split, tensor_parallel,
          expert_parallel, context_parallel, data_parallel, overlap, fusion)


def order(contracts: list[ir.PassContract]) -> list[ir.PassContract]:
    """`contracts` in an order their declarations allow (the given order where they leave it
    free); a PassError names a required key nobody provides before its pass, or a cycle."""
    by_name = {c.name: c for c in contracts}
    g = nx.DiGraph()
    g.add_nodes_from(by_name)
    for c in contracts:
        for key in (c.requires | c.reads) - ir.CAPTURED:
            for p in contracts:
                if p is not c and key in p.provides:
                    g.add_edge(p.name, c.name, why=key)
        g.add_edges_from(((c.name, n) for n in c.before if n in by_name), why="before")
        g.add_edges_from(((n, c.name) for n in c.after if n in by_name), why="after")
    rank = {c.name: i for i, c in enumerate(contracts)}
    try:
        names = list(nx.lexicographical_topological_sort(g, key=rank.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(g)
        raise PassError("the passes' contracts contradict each other: " + ", ".join(
            f"{a} before {b} ({g.edges[a, b]['why']})" for a, b, *_ in cycle)) from None
    provided = set(ir.CAPTURED)
    for name in names:
        c = by_name[name]
        missing = sorted(c.requires - provided)
        if missing:
            raise PassError(
                f"pass {name} requires the graph keys {missing}, which neither capture nor a "
                f"pass before it provides (passes in this plan: {names}); run the pass that "
                "provides them (its CONTRACT.provides) or drop the requirement")
        provided |= c.provides
    return [by_name[n] for n in names]


def _pass_list(plan, device=None, codegen: str = "eager", passes=PASSES
               ) -> tuple[list[tuple[ir.PassContract, Callable, Any]], str | None]:
    """The passes `plan` runs, ordered by their contracts, as (contract, run, options); and, if
    Plan.fuse asked for fusion that cannot run on this device, why."""
    chosen = {}
    for module in passes:
        c = module.CONTRACT
        options = pass_options(c.options, plan)
        if c.applies(options):
            chosen[c.name] = (c, module.run, options)
    fusion_skipped = None
    if "fusion" in chosen and codegen != "inductor":
        # (with Inductor as the fuser the pass runs anywhere: it shapes Inductor's input)
        fusion_skipped = unavailable_reason(device if device is not None else "cpu")
        if fusion_skipped is not None:  # e.g. CPU without the interpreter: the unfused ops
            log.debug("fusion left out: %s", fusion_skipped)  # run (and we say why)
            del chosen["fusion"]
    ordered = order([c for c, _, _ in chosen.values()])
    return [chosen[c.name] for c in ordered], fusion_skipped


def _count(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def run_passes(gm: torch.fx.GraphModule, plan, ctx: PassContext, role: str,
               snapshots: dict[str, dict[str, torch.fx.GraphModule]]) -> torch.fx.GraphModule:
    """Run the pass list in order, verifying and snapshotting after each. The result's
    gm.meta holds every pass's decisions (core/ir.py), the pass times
    (ir.PASS_TIMES) and, if Plan.fuse could not run here, why (ir.FUSION_SKIPPED)."""
    t0 = time.perf_counter()
    verify(gm)
    snapshots["capture"] = {"joint": snapshot(gm)}
    times = [("verify capture", time.perf_counter() - t0, _count(gm))]
    phase_done(log, "verify capture", times[0][1])
    passes, fusion_skipped = _pass_list(plan, ctx.device, ctx.codegen)
    for contract, fn, options in passes:
        name = contract.name
        if contract.finds is not None and not contract.finds(gm):
            continue
        before = _count(gm)
        t0 = time.perf_counter()
        with announce(log, f"pass {name} on {before} nodes"):
            out = fn(gm, options, ctx)
        if out is not gm:  # a pass that built a new module keeps the decisions made so far
            out.meta = {**gm.meta, **out.meta}
        gm = out
        gm.recompile()
        verify(gm, values=not contract.values_fresh)
        dt = time.perf_counter() - t0
        times.append((name, dt, _count(gm)))
        snapshots[name] = {role: snapshot(gm)}
        phase_done(log, f"pass {name}", dt, f"nodes {before} -> {_count(gm)}")
    gm.meta[ir.PASS_TIMES] = times
    gm.meta[ir.FUSION_SKIPPED] = fusion_skipped
    return gm

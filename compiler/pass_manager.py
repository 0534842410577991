"""The ordered pass list and the checks run after every pass.

Each pass is `run(gm, plan, ctx) -> gm`. After every pass: `graph.lint()`, a fake-tensor
re-propagation that checks every node's meta["val"] (shape, dtype) unless the pass has just
recomputed them itself, a snapshot for `pm.stage_graphs`, and one log line (DEBUG:
FXPAR_LOGS=+passes; INFO when over 2 s).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
import torch.fx

from fxpar.compiler import cost, ir
from fxpar.compiler.graphs import snapshot, verify
from fxpar.compiler.logs import announce, phase_done
from fxpar.kernels.jit import unavailable_reason
from fxpar.passes import (data_parallel, fusion, overlap, pipeline_split, precision, remat,
                          tensor_parallel)

log = logging.getLogger(__name__)

# passes whose run() ends with graphs.fake_propagate(check=False): every meta["val"] was just
# computed from the graph, so the re-propagation after them would compare it with itself
# (a fake-tensor run of the whole graph, ~0.5 ms a node); lint and the meta check still run
FRESH_VALUES = frozenset({"tensor_parallel"})


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the graph (read-only): the signature, the symbolic group
    names, and the inputs of remat, overlap, pipeline_split and the cost model. What a pass
    decides goes into the graph, node.meta, or gm.meta under the names compiler/ir.py
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
    # False: the caller only counts what the pass adds (the planner's probes), so a pass may
    # skip re-propagating meta["val"] after its rewrite (data_parallel does)
    fresh_values: bool = True


def _pass_list(plan, device=None, codegen: str = "eager"
               ) -> tuple[list[tuple[str, Callable]], str | None]:
    # DESIGN.md section 4 order: remat, pipeline_split, tensor_parallel, data_parallel,
    # overlap, fusion; precision (mixed precision) before them all, so every later pass
    # sees the half-precision dtypes and sizes.
    # A pass the plan switches off is left out (no empty snapshot for it). Returns the list
    # and, if Plan.fuse asked for fusion that cannot run on this device, why.
    passes = []
    if plan.precision != "fp32":
        passes.append(("precision", precision.run))
    if plan.remat != "none":
        passes.append(("remat", remat.run))
    if plan.pp > 1:
        passes.append(("pipeline_split", pipeline_split.run))
    if plan.tp > 1:
        passes.append(("tensor_parallel", tensor_parallel.run))
    passes.append(("data_parallel", data_parallel.run))
    if plan.overlap and plan.dp * plan.tp * plan.pp > 1:
        passes.append(("overlap", overlap.run))
    fusion_skipped = None
    if plan.fuse:
        # (with Inductor as the fuser the pass runs anywhere: it shapes Inductor's input)
        fusion_skipped = None if codegen == "inductor" else unavailable_reason(
            device if device is not None else "cpu")
        if fusion_skipped is None:
            passes.append(("fusion", fusion.run))
        else:  # e.g. CPU without the interpreter: the unfused ops run (and we say why)
            log.debug("fusion left out: %s", fusion_skipped)
    return passes, fusion_skipped


def _count(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def run_passes(gm: torch.fx.GraphModule, plan, ctx: PassContext, role: str,
               snapshots: dict[str, dict[str, torch.fx.GraphModule]]) -> torch.fx.GraphModule:
    """Run the pass list in order, verifying and snapshotting after each. The result's
    gm.meta holds every pass's decisions (compiler/ir.py), the pass times
    (ir.PASS_TIMES) and, if Plan.fuse could not run here, why (ir.FUSION_SKIPPED)."""
    t0 = time.perf_counter()
    verify(gm)
    snapshots["capture"] = {"joint": snapshot(gm)}
    times = [("verify capture", time.perf_counter() - t0, _count(gm))]
    phase_done(log, "verify capture", times[0][1])
    passes, fusion_skipped = _pass_list(plan, ctx.device, ctx.codegen)
    for name, fn in passes:
        before = _count(gm)
        t0 = time.perf_counter()
        with announce(log, f"pass {name} on {before} nodes"):
            out = fn(gm, plan, ctx)
        if out is not gm:  # a pass that built a new module keeps the decisions made so far
            out.meta = {**gm.meta, **out.meta}
        gm = out
        gm.recompile()
        verify(gm, values=name not in FRESH_VALUES)
        dt = time.perf_counter() - t0
        times.append((name, dt, _count(gm)))
        snapshots[name] = {role: snapshot(gm)}
        phase_done(log, f"pass {name}", dt, f"nodes {before} -> {_count(gm)}")
    gm.meta[ir.PASS_TIMES] = times
    gm.meta[ir.FUSION_SKIPPED] = fusion_skipped
    return gm

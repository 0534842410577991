"""The ordered pass list and the checks run after every pass.

Each pass is `run(gm, plan, ctx) -> gm`. After every pass: `graph.lint()`, a fake-tensor
re-propagation that checks every node's meta["val"] (shape, dtype), a snapshot for
`pm.stage_graphs`, and one log line (set FXPAR_DEBUG=1 to see them).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.compiler import ir
from fxpar.compiler.errors import FxparError

log = logging.getLogger("fxpar.passes")
if os.environ.get("FXPAR_DEBUG"):
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("fxpar").setLevel(logging.DEBUG)


class PassError(FxparError):
    """A pass produced an inconsistent graph (a bug in fxpar: please report it)."""


@dataclasses.dataclass
class PassContext:
    """What passes may know besides the graph: the signature and the process-group names."""
    signature: ir.GraphSignature
    group_names: dict[str, str] = dataclasses.field(default_factory=dict)  # mesh dim -> group
    batch_shard_dims: list[int | None] = dataclasses.field(default_factory=list)
    timings: list[tuple[str, float, int]] = dataclasses.field(default_factory=list)
    memory_budget: int | None = None  # activation bytes per device for remat="auto"
    zero_buckets: list[list[int]] = dataclasses.field(default_factory=list)  # set by DP (ZeRO)
    params_sharded: bool = False  # ZeRO-3: parameter placeholders are flat 1/dp shards
    overlap_memory_bytes: int | None = None  # overlap: extra bytes allowed (None: 2 layers)
    virtual_stages: int = 1  # pipeline stages per rank (interleaved schedule: 2)
    device: Any = None       # the rank's device (cost model profile)
    tp_layouts: list | None = None  # set by tensor_parallel: per parameter, see runtime/tp.py
    fusion_skipped: str | None = None  # Plan.fuse but no Triton on this device: why
    loss_scale: bool = False  # set by precision (fp16): the last batch input is the loss scale
    # set by data_parallel with microbatches and a mean cross-entropy: (microbatch batch
    # leaves) -> its target count; the graph's last batch input is then the step's count / m
    loss_count: Any = None


def _pass_list(plan, device=None) -> tuple[list[tuple[str, Callable]], str | None]:
    # DESIGN.md section 4 order: remat, pipeline_split, tensor_parallel, data_parallel,
    # overlap, fusion; precision (mixed precision) before them all, so every later pass
    # sees the half-precision dtypes and sizes.
    # A pass the plan switches off is left out (no empty snapshot for it). Returns the list
    # and, if Plan.fuse asked for fusion that cannot run on this device, why.
    from fxpar.passes import (data_parallel, fusion, overlap, pipeline_split, precision,
                              remat, tensor_parallel)
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
        from fxpar.kernels.jit import unavailable_reason
        fusion_skipped = unavailable_reason(device if device is not None else "cpu")
        if fusion_skipped is None:
            passes.append(("fusion", fusion.run))
        else:  # e.g. CPU without the interpreter: the unfused ops run (and we say why)
            log.info("fusion left out: %s", fusion_skipped)
    return passes, fusion_skipped


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of a graph, output node meta included (node meta dicts are copied shallowly)."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(graph, {}))
    old_out = next(n for n in reversed(graph.nodes) if n.op == "output")
    next(n for n in reversed(g.nodes) if n.op == "output").meta = dict(old_out.meta)
    return g


def snapshot(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A cheap copy of a graph module, for pm.stage_graphs."""
    new = torch.fx.GraphModule(gm, copy_graph(gm.graph))
    new.meta = dict(gm.meta)
    return new


def fake_inputs(gm: torch.fx.GraphModule, mode: FakeTensorMode) -> list:
    vals = []
    with mode:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta[ir.VAL]
                vals.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                                device=v.device))
    return vals


def fake_propagate(gm: torch.fx.GraphModule, *, check: bool) -> None:
    """Re-run the graph on fake tensors. check=True: every meta["val"] must match (shape,
    dtype); check=False: store the fresh values (used by passes that change shapes)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = fake_inputs(gm, mode)

    class Prop(torch.fx.Interpreter):
        def run_node(self, n):
            with mode:
                try:
                    res = super().run_node(n)
                except (RuntimeError, ValueError):  # a view's stride error: repaired or raised
                    dense = None if check else _densify_view_input(n)
                    if dense is None:
                        raise
                    self.env[dense] = super().run_node(dense)
                    dense.meta[ir.VAL] = self.env[dense]
                    res = super().run_node(n)
            if n.op == "get_attr" and isinstance(res, torch.Tensor):
                # a constant baked into the graph (e.g. a lifted tensor literal) enters as a
                # fake tensor too: fake mode would otherwise run ops on it for real, custom
                # collectives included
                res = mode.from_tensor(res)
            if n.op in ("placeholder", "output"):
                return res
            if check:
                old = n.meta.get(ir.VAL)
                _compare(n, old, res)
            else:
                n.meta[ir.VAL] = res
            return res

    Prop(gm).run(*args)


def _densify_view_input(n: torch.fx.Node) -> torch.fx.Node | None:
    """A view the traced layout allowed (e.g. of a transposed matmul result) that a pass made
    impossible by giving its input another layout (a collective's dense result): the input is
    made dense first. Returns the dense copy's node (None: `n` is no such view)."""
    if n.target is not torch.ops.aten.view.default or not isinstance(n.args[0], torch.fx.Node):
        return None
    with n.graph.inserting_before(n):
        dense = n.graph.call_function(torch.ops.aten.clone.default, (n.args[0],),
                                      {"memory_format": torch.contiguous_format})
    dense.meta.update({k: n.meta[k] for k in (ir.REGION, ir.MODULE, ir.STAGE, ir.PHASE,
                                               ir.RECOMPUTE) if k in n.meta})
    if ir.SHARD in n.args[0].meta:  # a copy is placed like what it copies
        dense.meta[ir.SHARD] = n.args[0].meta[ir.SHARD]
    n.replace_input_with(n.args[0], dense)
    return dense


def _compare(n, old, new):
    if isinstance(new, torch.Tensor):
        if not isinstance(old, torch.Tensor) or old.shape != new.shape or old.dtype != new.dtype:
            raise PassError(f"node {n.name} ({n.target}): meta['val'] says "
                            f"{getattr(old, 'shape', old)}/{getattr(old, 'dtype', '')} but the "
                            f"graph computes {tuple(new.shape)}/{new.dtype}")
    elif isinstance(new, (tuple, list)) and isinstance(old, (tuple, list)):
        for o, v in zip(old, new):
            _compare(n, o, v)


def verify(gm: torch.fx.GraphModule) -> None:
    gm.graph.lint()
    for n in gm.graph.nodes:
        if n.op == "call_function" and (ir.REGION not in n.meta or ir.MODULE not in n.meta):
            raise PassError(f"node {n.name} ({n.target}) lacks meta['region'] or meta['module']")
    fake_propagate(gm, check=True)


def _count(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def run_passes(gm: torch.fx.GraphModule, plan, ctx: PassContext, role: str,
               snapshots: dict[str, dict[str, torch.fx.GraphModule]]) -> torch.fx.GraphModule:
    """Run the pass list in order, verifying and snapshotting after each."""
    verify(gm)
    snapshots["capture"] = {"joint": snapshot(gm)}
    passes, ctx.fusion_skipped = _pass_list(plan, ctx.device)
    for name, fn in passes:
        before = _count(gm)
        t0 = time.perf_counter()
        gm = fn(gm, plan, ctx)
        gm.recompile()
        verify(gm)
        dt = time.perf_counter() - t0
        ctx.timings.append((name, dt, _count(gm)))
        snapshots[name] = {role: snapshot(gm)}
        log.debug("pass %-15s %7.1f ms  nodes %d -> %d", name, dt * 1e3, before, _count(gm))
    return gm


def count_ops(gm: torch.fx.GraphModule, target: Any) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)

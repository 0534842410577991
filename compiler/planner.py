"""Plan search for plan="auto": dp x tp x pp, microbatches, schedule, remat and ZeRO.

The joint graph is captured once (on fake tensors for big models) and reduced to per-layer
statistics (compiler/graphstats.py); every candidate plan is then priced analytically, never
by running the passes:
  compute   per stage and microbatch: matmul FLOPs at the device's achievable rate, the other
            ops' bytes at its memory bandwidth, and a dispatch overhead per graph node
            (core/cost.Hardware; the CPU's numbers are measured at start-up);
  tp        Megatron's all-reduces (per block 2 forward + 2 backward of b*s*h) with the
            alpha-beta ring model of the link the tp group spans;
  pp        the schedule's makespan from core/schedules.simulate_schedule with those stage times and
            the p2p time of the cut activations (the best candidates are simulated; the rest
            priced by the closed form (m + pp - 1) x slowest stage first);
  dp        gradient all-reduce or ZeRO's reduce-scatter + all-gather (ZeRO-3 also gathers the
            parameters per microbatch), overlapped with the last backward when Plan.overlap;
  optimizer the bytes the update reads and writes;
  memory    compiler/memory_model.py; a plan that does not fit is pruned (remat budgets are tried
            before a plan is given up).
The best plan wins; `PlanResult.table` has the runner-ups and `explain()` says why.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import operator
import time
import types
import warnings
from typing import NamedTuple

import sympy
import torch
from torch.fx.operator_schemas import normalize_function

from fxpar.compiler import codegen
from fxpar.core import cost, ir
from fxpar.core import quantized_comm as qcomm
from fxpar.core.sharding import batch_local_dispatch, quiet as quiet_probe
from fxpar.core.errors import PlanError
from fxpar.core.graphs import fake_propagate, param_grads, summed_buffer_updates
from fxpar.compiler.graphstats import (FIELDS, CpProbe, GraphStats, Segment, analyze,
                                       layer_key, saved_bytes, saved_values,
                                       storage_base)
from fxpar.core.logs import Clock, Ticker, phase_done
from fxpar.core.logs import rank as log_rank
from fxpar.compiler.memory_model import (DTYPE_BYTES, OPTIMIZER_STATES, MemoryEstimate,
                                         optimizer_kind, stage_state, state_bytes_per_param,
                                         with_activations)
from fxpar.compiler.pass_manager import PassContext
from fxpar.core.plan import (SEARCHED, Plan, cp_misfit, ep_misfit, hpz_misfit,  # noqa: F401
                             dp_stride, hsdp_misfit, node_shard, plan_dict, quantization_misfit,
                             replays_step, resolve)
from fxpar.core.expert_lists import find_expert_lists, weight_fqn
from fxpar.passes import (batched_experts, context_parallel, data_parallel, expert_parallel,
                          fusion, grouped_experts, pipeline_split, remat, tensor_parallel)
from fxpar.passes import precision as precision_pass
from fxpar.core import schedules

log = logging.getLogger(__name__)
aten = torch.ops.aten

GiB = 2 ** 30
SIMULATE_TOP = 12
# bytes a send completes with on its own (a socket buffer's worth): it rides with the
# other values of its transfer group (planner._price)
SMALL_TRANSFER = 64 * 2 ** 10
# the rows an ep rank receives for its experts, in units of the rows it routes (as many
# where the routing is balanced): a router's imbalance priced at up to 2x (MoE training's
# usual capacity factors are 1.25-2; the runtime holds exactly what arrives)
EP_RECEIVED = 2.0
# the Segment statistics the tp probe reads off the tp pass's graph (each as its `_split`
# part); the last two only where the statistics are the traced graph's (count_pass_extras)
TP_SPLIT = ("flops_f", "flops_b", "bytes_f", "bytes_b", "saved", "transient")


class Transfer(NamedTuple):
    """A value pipeline_split sends between two stages (GraphStats.transfers)."""
    src: int
    dst: int
    nbytes: int
    per_row: bool       # an activation: scales with the microbatch's rows
    backward: bool
    weight_view: bool   # a view of a weight (a transposed expert weight a cut layer's
    #                     backward reads): its send holds no memory of its own
    once: bool          # once a step (phase R: a tied weight's summed gradient part), not
    #                     per microbatch


@dataclasses.dataclass
class Candidate:
    plan: Plan
    step_s: float
    memory: MemoryEstimate
    mfu: float | None      # model FLOPs / (step x devices x data-sheet peak); None on CPUs
    bubble: float
    parts: dict            # seconds per component: compute, tp, pipeline bubble, dp, optimizer
    simulated: bool = False
    recompute: float = 0.0
    ctx: tuple = ()        # (stage forward times, backward times, p2p, closed-form pipe, v)

    def row(self) -> str:
        return (f"{plan_str(self.plan)} "
                f"{self.step_s * 1e3:10.2f} ms  {_bytes(self.memory.total):>11s}  "
                + (f"MFU {self.mfu * 100:5.1f}%" if self.mfu is not None else "MFU     - ")
                + f"  bubble {self.bubble * 100:5.1f}%")


def plan_str(p: Plan) -> str:
    """The searched fields of a plan, in the table's columns."""
    sched = p.schedule if p.pp > 1 else "-"
    return (f"dp={p.dp:<4d} tp={p.tp:<3d} pp={p.pp:<3d} m={p.microbatches:<4d} "
            f"{sched:<11s} zero={p.zero} remat={_remat_str(p.remat):<8s}"
            + (f" hsdp={p.dp_shard}" if p.hsdp else "") + (f" hpz={p.hpz}" if p.hpz else "")
            + (f" ep={p.ep}" if p.ep > 1 else "")
            + (f" cp={p.cp} ({p.cp_attention})" if p.cp > 1 else "")
            + (" pp outer" if p.pp_outer else "")
            + (" optimizer on host" if p.offload_optimizer else ""))


def _bytes(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 4 else f"{b / 2 ** 20:.2f} MiB"


def _remat_str(r):
    if isinstance(r, (int, float)) and not isinstance(r, bool):
        return _bytes(r).replace(" ", "")
    return r


@dataclasses.dataclass
class PlanResult:
    best: Candidate
    table: list            # best first
    n_legal: int
    n_fit: int
    hardware: cost.Hardware
    note: str
    seconds: float
    devices: int
    inputs: dict = dataclasses.field(default_factory=dict, repr=False)  # search()'s arguments
    start_up: "PlanResult | None" = None   # before `recalibrate`: the start-up prediction
    refit: str = ""                        # what `recalibrate` fitted, in words
    # planning's phases [(name, seconds, None)] for pm.compile_times (measure, trace,
    # calibrate, search)
    times: list = dataclasses.field(default_factory=list, repr=False)
    plain_dp_note: str = ""  # why plain dp over every device is not in the table

    def format(self, top: int = 10) -> str:
        lines = [f"{self.n_legal} legal plans for {self.devices} x {self.hardware.name} "
                 f"({self.hardware.memory / GiB:.0f} GiB each, {self.hardware.calibrated}); "
                 f"{self.n_fit} fit in memory; searched in {self.seconds:.1f} s"]
        if self.note:
            lines.append(self.note)
        lines.append("rank  plan" + " " * 66 + "step time    memory")
        lines += [f"{i + 1:4d}  {c.row()}" for i, c in enumerate(self.table[:top])]
        if len(self.table) > top:
            lines.append(f"      ... and {len(self.table) - top} more ranked plans "
                         f"(.format(top={len(self.table)}) lists every one)")
        if self.hardware.name == "cpu":
            lines.append("      (MFU: GPUs only; a CPU has no data-sheet peak to measure it "
                         "against)")
        return "\n".join(lines)

    def __str__(self) -> str:
        """print(pm.plan_report): the ranked plans and why the chosen one won (the dataclass's
        repr was one line of every candidate's fields)."""
        return f"{self.format()}\n{self.explain()}"

    def __repr__(self) -> str:
        return (f"<PlanResult: {' '.join(plan_str(self.best.plan).split())}, "
                f"{self.best.step_s * 1e3:.2f} ms/step predicted; {self.n_legal} legal plans, "
                f"{self.n_fit} fit; print() it for the table>")

    def explain(self) -> str:
        b = self.best
        ms = {k: v * 1e3 for k, v in b.parts.items()}
        out = [f"chosen: {b.row()}",
               "  step time = " + " + ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
               f"  memory per device: {b.memory.describe()}"]
        if b.memory.formula():
            out.append(f"  {b.memory.formula()}")
        if self.refit:
            out.append(f"  priced {self.refit}")
        if b.plan.offload_optimizer:
            key = (b.plan.dp, b.plan.tp, b.plan.pp, b.plan.microbatches, b.plan.schedule,
                   b.plan.zero)
            twin = next((c for c in self.table if not c.plan.offload_optimizer and key == (
                c.plan.dp, c.plan.tp, c.plan.pp, c.plan.microbatches, c.plan.schedule,
                c.plan.zero)), None)
            why = ("as given" if "offload_optimizer" in self.inputs.get("constraints", {}) else
                   f"faster than the plan on the device, which recomputes "
                   f"{twin.recompute:.0%} of the forward to fit" if twin is not None else
                   "no plan fits with the optimizer's state on the device")
            out.append(f"  the optimizer steps host copies, its state in host memory "
                       f"(offload_optimizer: {why}); it costs "
                       f"{b.parts.get('optimizer offload', 0.0) * 1e3:.2f} ms of copies")
        if b.recompute:
            why = (f"(remat={_remat_str(b.plan.remat)} as given)"
                   if "remat" in self.inputs.get("constraints", {}) else "to fit")
            out.append(f"  remat recomputes {b.recompute * 100:.0f}% of the forward {why}")
        if len(self.table) > 1:
            out.append(f"  runner-up {self.table[1].row()}\n  is {self._why()}")
            out.append(f"  {self.plain_dp()}")
        if self.n_fit < self.n_legal:
            out.append(f"  {self.n_legal - self.n_fit} legal plans were pruned: they do not "
                       f"fit in {self.hardware.memory / GiB:.1f} GiB per device")
        return "\n".join(out)

    def _why(self, other: "Candidate | None" = None) -> str:
        """Why the best plan beat `other` (default the runner-up): the two parts that cost
        `other` most, or that it is a tie the simpler plan wins."""
        b, r = self.best, other if other is not None else self.table[1]
        diffs = sorted(((r.parts.get(k, 0) - b.parts.get(k, 0), k)
                        for k in set(b.parts) | set(r.parts)), reverse=True)
        why = ", ".join(f"{k} {d * 1e3:+.2f} ms" for d, k in diffs[:2] if d > 0)
        pct = (r.step_s / b.step_s - 1) * 100
        if pct <= self.hardware.noise * 100:  # rank()'s tie: the simpler plan wins
            return (f"{pct:+.1f}%, within the prediction's resolution "
                    f"({self.hardware.noise:.0%}): the simpler plan wins (less tp, fewer "
                    "pipeline stages and microbatches, fewer axes, less ZeRO, gathered cp "
                    "attention, dp outside pp, 1F1B, no remat)")
        return f"{pct:.1f}% slower: {why or 'the sum of small differences'}"

    def plain_dp(self) -> str:
        """Where plain data parallelism over every device ranks, and why the choice beats it:
        the baseline every user knows, so the report always says it."""
        def remat(c):
            return (f", remat={_remat_str(c.plan.remat)} to fit" if c.plan.remat != "none"
                    else "") + (", the optimizer on the host" if c.plan.offload_optimizer else "")
        if self.best.plan.dp == self.devices and self.best.plan.zero == 0 and \
                self.best.plan.microbatches == 1 and self.best.plan.cp == 1:
            return f"plain data parallelism (dp={self.devices}{remat(self.best)}) is the choice"
        i, c = next(((i, c) for i, c in enumerate(self.table)
                     if c.plan.dp == self.devices and c.plan.zero == 0
                     and c.plan.microbatches == 1 and c.plan.cp == 1), (None, None))
        if c is None:
            return (f"plain data parallelism (dp={self.devices}) is not in the table: "
                    f"{self.plain_dp_note}")
        return (f"plain data parallelism (dp={self.devices}{remat(c)}) ranks #{i + 1}, "
                f"{self._why(c)}")

    def summary(self) -> str:
        """The chosen plan and the runner-up with their predicted step time and memory, and
        why the one won (the INFO lines of plan="auto")."""
        def short(c):
            p = c.plan
            pipe = f" m={p.microbatches} {p.schedule}" if p.microbatched else ""
            return (f"dp={p.dp} tp={p.tp} pp={p.pp}{pipe} zero={p.zero} "
                    f"remat={_remat_str(p.remat)}"
                    f"{f' hsdp={p.dp_shard}' if p.hsdp else ''}"
                    f"{f' hpz={p.hpz}' if p.hpz else ''}{f' ep={p.ep}' if p.ep > 1 else ''}"
                    f"{f' cp={p.cp} ({p.cp_attention})' if p.cp > 1 else ''}"
                    f"{' pp outer' if p.pp_outer else ''}"
                    f"{' optimizer on host' if p.offload_optimizer else ''}: "
                    f"{c.step_s * 1e3:.2f} ms/step, "
                    f"{_bytes(c.memory.total)}/device")
        out = [f"plan chosen: {short(self.best)}"]
        if len(self.table) > 1:
            out.append(f"  runner-up {short(self.table[1])}, {self._why()}")
            out.append(f"  {self.plain_dp()}")
        else:
            out.append("  the only legal plan that fits in memory")
        out.append(f"  ({self.n_legal} legal plans, {self.n_fit} fit; "
                   "pm.plan_report.explain() has the breakdown)")
        return "\n".join(out)


# --- the model's layers and the stages -------------------------------------------------------

def _seg_time(s: Segment, stats, rows, tp, hw, precision, part, dp=1):
    """Seconds of one segment's forward ("f") or backward ("b") for `rows` rows of a rank
    in a dp group of `dp` (the work the dp pass runs on the gathered batch: dp x the rows)."""
    f = rows / stats.rows
    flops = getattr(s, f"flops_{part}") + (dp - 1) * getattr(s, f"flops_{part}_whole")
    fs = getattr(s, f"flops_{part}_split")
    by = getattr(s, f"bytes_{part}") + (dp - 1) * getattr(s, f"bytes_{part}_whole")
    bs = getattr(s, f"bytes_{part}_split")
    compute = ((flops - fs) + fs / tp) * f / (hw.flops(precision) * hw.matmul_efficiency)
    memory = ((by - bs) + bs / tp) * f / hw.mem_bandwidth
    compute, memory = compute * hw.roofline_scale, memory * hw.roofline_scale
    host = getattr(s, f"nodes_{part}") * hw.node_overhead
    return max(compute + memory, host) if hw.async_launch else compute + memory + host


def partition(weights: list[float], k: int) -> list[int]:
    """Contiguous split of `weights` into k parts minimising the largest part: the start index
    of every part (binary search on the answer with a greedy fill). Only for statistics with
    no whole graph to cut (a model traced a few blocks deep and scaled, GraphStats.with_depth);
    otherwise the stages are pipeline_split's own (`pass_stages`)."""
    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        parts, acc = 1, 0.0
        for w in weights:
            if acc + w > mid:
                parts, acc = parts + 1, w
            else:
                acc += w
        lo, hi = (mid, hi) if parts > k else (lo, mid)
    starts, acc = [0], 0.0
    for i, w in enumerate(weights):
        if acc + w > hi and len(starts) < k:
            starts.append(i)
            acc = w
        else:
            acc += w
    while len(starts) < k:  # too few parts: split the largest (needs len(weights) >= k)
        starts.append(next(i for i in range(1, len(weights)) if i not in starts))
        starts.sort()
    return starts


def pass_stages(stats: GraphStats, n: int, device_type: str) -> dict | None:
    """Where pipeline_split cuts the captured graph into n stages: the pass's own partition
    run on a copy of the graph (so the planner prices the stages the job will run), as each
    segment's share of its work on each stage (`_stage_shares`), with what crosses between
    the stages and what each saves. Cached on the statistics (it outlives the graph, which
    compile takes); None where there is no graph of the whole model or the pass cannot cut
    it."""
    key = (n, device_type)
    if key in stats.stage_shares:
        return stats.stage_shares[key]
    if stats.graph is None:
        return None
    gm, _ = stats.graph
    copy_ = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    try:
        pipeline_split.partition(copy_, n, split_weight_grads=True,
                                 profile=cost.DeviceProfile.for_device(torch.device(device_type)))
    except PlanError:
        stats.stage_shares[key] = None
        return None
    # what crosses between the stages, as the pass inserted it
    weight_shapes = {tuple(p.meta[ir.VAL].shape) for p in copy_.graph.nodes
                     if p.op == "placeholder" and p.meta.get(ir.ROLE) == "param"}

    def per_row(val):  # an activation (rows first, or rows x positions flattened), not a
        shape = tuple(getattr(val, "shape", ()))  # weight's (partial) gradient
        return bool(shape) and shape not in weight_shapes and shape[0] % stats.rows == 0

    def a_weight(n):
        return storage_base(n).meta.get(ir.ROLE) == "param"
    stats.transfers[key] = [
        Transfer(src, dst, cost.tensor_bytes(t.meta.get(ir.VAL)), per_row(t.meta.get(ir.VAL)),
                 t.meta.get(ir.REGION) == ir.BACKWARD, a_weight(t.args[0]),
                 t.meta.get(ir.PHASE) == "R")
        for t in copy_.graph.nodes if ir.TRANSFER in t.meta
        for src, dst in [t.meta[ir.TRANSFER]]]
    # a weight read by layers of several stages (a tied embedding and head): its gradient
    # is summed on one stage and sent to the others once a step, and every rank holding a
    # copy steps it (runtime/pipeline._share_grads): (bytes, its stages, the summing stage)
    stats.shared_weights[key] = [
        (cost.tensor_bytes(p.meta.get(ir.VAL)), sorted(stages),
         g.meta.get(ir.STAGE, min(stages)) if g is not None else min(stages))
        for p, g in param_grads(copy_)
        for stages in [{u.meta[ir.STAGE] for u in p.users
                        if u.meta.get(ir.STAGE) is not None}] if len(stages) > 1]
    # the saved activations of each stage of the cut (a value received from another stage
    # on the stage that keeps it): the layers a stage is priced with can differ from what
    # it runs where the pass cuts inside a layer (the MoE's pp=2 m=4 was priced 1.6x)
    fwd = [x for x in copy_.graph.nodes if x.meta.get(ir.REGION) == ir.FORWARD
           and x.meta.get(ir.STAGE) is not None]
    stats.stage_saved[key] = [sum(saved_bytes(k) for k in saved_values(
        [x for x in fwd if x.meta[ir.STAGE] == s])) for s in range(n)]
    # each stage's backward in all and its weight-gradient part ("W", zero-bubble's deferred
    # work: a conv's or a fused op's weight gradient comes out of the op that makes the input
    # gradient, so a conv net defers almost nothing)
    wgrad = [[0.0] * 6 for _ in range(n)]
    for x in copy_.graph.nodes:
        if x.op != "call_function" or x.meta.get(ir.REGION) != ir.BACKWARD or \
                x.meta.get(ir.STAGE) is None:
            continue
        f, (r, w) = cost.node_flops(x), cost.node_bytes(x)
        row = wgrad[x.meta[ir.STAGE]]
        for k in ((0, 3) if x.meta.get(ir.PHASE) == "W" else (0,)):
            row[k] += f
            row[k + 1] += 0 if f else r + w
            row[k + 2] += 1
    stats.stage_wgrad[key] = wgrad
    stats.stage_shares[key] = _stage_shares(copy_, stats, n)
    return stats.stage_shares[key]


# which share of a segment's work each field follows (stages_of); fields not named follow
# its forward nodes
_SHARE_OF = {"flops_f": "f", "flops_f_split": "f", "flops_f_whole": "f", "tp_comm_f": "f",
             "tp_calls_extra": "f", "flops_b": "b", "flops_b_split": "b",
             "flops_b_whole": "b", "tp_comm_b": "b", "bytes_f": "bf", "bytes_f_split": "bf",
             "bytes_f_whole": "bf", "bytes_b": "bb", "bytes_b_split": "bb",
             "bytes_b_whole": "bb", "nodes_f": "nf", "nodes_b": "nb", "saved": "saved",
             "saved_split": "saved", "saved_whole": "saved", "params": "p",
             "params_split": "p", "n_row": "f", "n_param_tensors": "p",
             "expert_params": "p", "expert_flops_f": "f", "expert_flops_b": "b",
             "ep_comm_f": "f", "ep_comm_b": "b", "ep_bytes_f": "bf", "ep_bytes_b": "bb",
             "ep_saved": "saved", "n_moe": "f", "grouped_saved_f": "f", "grouped_saved_b": "b",
             "expert_flops_f_split": "f", "expert_flops_b_split": "b",
             "grouped_bytes_f": "bf", "grouped_bytes_b": "bb", "grouped_stack_bytes": "p",
             "dp_gathers": "f", "dp_gather_bytes": "bf", "attn_flops_f": "f", "sdpa_flops_f": "f",
             "attn_flops_b": "b", "sdpa_flops_b": "b", "kv_bytes": "f", "qo_bytes": "f",
             "n_attn": "f"}


def _stage_shares(gm, stats: GraphStats, n: int) -> dict[str, dict[str, list[float]]]:
    """{segment: {share kind: its fraction on each of the n stages}} of a graph the pipeline
    pass has cut: the forward and backward FLOPs, bytes and nodes, saved activations and
    parameters of each segment, split as the cut splits its nodes. A cut inside a layer (an
    MoE's experts, a conv net's stem alone on a stage) is priced so, where a mapping of
    whole layers to stages could not say what each stage runs."""
    acc: dict[str, dict[str, list[float]]] = {}

    def add(seg, kind, stage, x):
        acc.setdefault(seg, {}).setdefault(kind, [0.0] * n)[stage] += x
    seg_of = stats.node_segment
    fwd = []
    for node in gm.graph.nodes:
        seg, stage = seg_of.get(node.name), node.meta.get(ir.STAGE)
        if node.op != "call_function" or seg is None or stage is None:
            continue
        f, (r, w) = cost.node_flops(node), cost.node_bytes(node)
        side = "f" if node.meta.get(ir.REGION) == ir.FORWARD else "b"
        add(seg, side, stage, f)
        add(seg, "b" + side, stage, 0 if f else r + w)  # (as graphstats.analyze counts)
        add(seg, "n" + side, stage, 1)
        if side == "f":
            fwd.append(node)
    for base, idx in saved_values(fwd):
        if base.name in seg_of:
            add(seg_of[base.name], "saved", base.meta[ir.STAGE], saved_bytes((base, idx)))
    # a parameter (its gradient and optimizer state): on the stage that makes its gradient
    # (Mixtral's pp=2 cut reads expert weights on one stage and makes their gradients on
    # the other; priced where first read, its step memory came out 0.80x), in the segment of
    # its first forward use
    for ph, g in param_grads(gm):
        first = next((u for u in ph.users if u.meta.get(ir.REGION) == ir.FORWARD
                      and u.name in seg_of and u.meta.get(ir.STAGE) is not None), None)
        if first is None:
            continue
        stage = g.meta.get(ir.STAGE) if g is not None else None
        add(seg_of[first.name], "p", first.meta[ir.STAGE] if stage is None else stage,
            ph.meta[ir.VAL].numel())
    out = {}
    for seg, kinds in acc.items():
        nodes = [a + b for a, b in zip(kinds.get("nf", [0.0] * n), kinds.get("nb", [0.0] * n))]
        out[seg] = {k: [x / sum(v) for x in v] for k, v in kinds.items() if sum(v) > 0}
        out[seg]["all"] = [x / sum(nodes) for x in nodes] if sum(nodes) else [1.0 / n] * n
    return out


def _stage_segments(stats: GraphStats, shares: dict, n: int) -> list[list[Segment]]:
    """The model's segments on each of n stages, each scaled to the share of its work the
    stage runs (`_stage_shares`)."""
    out = [[] for _ in range(n)]
    for seg in stats.segments:
        sh = shares.get(seg.name)
        if sh is None:  # no node of it in the cut (an empty segment): with its neighbours
            out[0 if seg.name == "pre" else n - 1].append(seg)
            continue
        col = max(range(n), key=lambda k: sh.get("b", sh["all"])[k])  # (its column linears)
        for k in range(n):
            if sh["all"][k] == 0 and not any(v[k] for v in sh.values()):
                continue
            part = dataclasses.replace(seg, column_out=seg.column_out if k == col else [])
            for f in tuple(FIELDS) + ("n_row", "n_param_tensors", "n_moe"):
                # (its working memory: the share of its ops, so a sliver of the LM head on
                # the embedding's stage - the tied weight's gradient sum - is not priced
                # with the logits)
                frac = sh["all"][k] if f in ("transient", "transient_split") \
                    else sh.get(_SHARE_OF.get(f, "nf"), sh["all"])[k]
                setattr(part, f, getattr(seg, f) * frac)
            out[k].append(part)
    return out


def stages_of(stats: GraphStats, pp: int, v: int = 1,
              device_type: str = "cpu") -> list[list[Segment]]:
    """The model's segments on pp*v stages where pipeline_split cuts them (`pass_stages`):
    each segment's share of its work on each stage. Statistics with no graph to cut (a model
    traced a few blocks deep and scaled): whole layers balanced by compute, pre joining the
    first stage and post the last."""
    n = pp * v
    segs = stats.segments
    layers = segs[1:-1]
    if n == 1:
        return [segs]
    shares = pass_stages(stats, n, device_type)
    if shares:  # the pass's own cut, each stage as it runs
        return _stage_segments(stats, shares, n)
    w = [s.flops_f + s.flops_b + 1e3 * (s.nodes_f + s.nodes_b) for s in layers]
    w[0] += segs[0].flops_f + segs[0].flops_b
    w[-1] += segs[-1].flops_f + segs[-1].flops_b
    starts = partition(w, n) + [len(layers)]
    out = [layers[a:b] for a, b in zip(starts, starts[1:])]
    out[0] = [segs[0]] + out[0]
    out[-1] = out[-1] + [segs[-1]]
    return out


def in_flight(schedule: str, pp: int, m: int, v: int = 1) -> list[int]:
    """Peak microbatches whose activations rank r holds, in units of its whole stage, by the
    schedules' construction (core/schedules.py; equal to its simulator's peak_in_flight,
    tested): GPipe m; 1F1B min(pp - r, m); ZB-H1 min(pp, m) (its W's wait r steps);
    interleaved: Megatron's warmup 2(pp - r - 1) + (v - 1)pp chunk forwards plus one, in
    chunks of 1/v of the stage."""
    if schedule == "gpipe":
        return [m] * pp
    if schedule == "1f1b":
        return [min(pp - r, m) for r in range(pp)]
    if schedule == "zero-bubble":
        return [min(pp, m) if m > r else m for r in range(pp)]
    return [math.ceil(min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) / v) for r in range(pp)]


def _wgrad_share(stats: GraphStats, key: tuple, stage: int, rows: int, hw: cost.Hardware,
                 precision: str) -> float:
    """The share of a stage's backward that zero-bubble defers to its W part, priced as the
    planner prices work (roofline and dispatch per node) from pipeline_split's own split
    (`pass_stages`: its I/W labels); half where there is no graph to ask. On a conv net the
    weight gradients come out of the ops that make the input gradients, so the share is near
    0 and zero-bubble prices as 1F1B; on a transformer's linears about half (the measured
    schedule pairs: docs/benchmarks.md, "Regret")."""
    per_stage = stats.stage_wgrad.get(key)
    if not per_stage:
        return 0.5
    fl, by, nodes, w_fl, w_by, w_nodes = per_stage[stage]
    scale = rows / stats.rows * hw.roofline_scale

    def seconds(f, b, n):
        roof = (f / (hw.flops(precision) * hw.matmul_efficiency) + b / hw.mem_bandwidth) * scale
        host = n * hw.node_overhead
        return max(roof, host) if hw.async_launch else roof + host
    total = seconds(fl, by, nodes)
    return seconds(w_fl, w_by, w_nodes) / total if total > 0 else 0.0


@functools.lru_cache(maxsize=64)
def _actions(schedule, pp, m, v):
    """schedules.build, once per shape: the search simulates one shape for many plans (the
    simulation only reads the lists)."""
    return schedules.build(schedule, pp, m, v)


def _makespan(schedule, pp, m, v, fwd, bwd, p2p, wgrad=None) -> float:
    """Pipeline makespan by simulation; for m > 4pp the steady state is extrapolated linearly
    from two simulations (every extra microbatch adds the same period). `wgrad`: the seconds
    of each rank's backward that a split backward's W part takes (None: half)."""
    wgrad = wgrad or [b / 2 for b in bwd]

    def run(mm):
        def dur(a):
            r = a.stage % pp
            if a.kind in ("I", "W"):
                return (bwd[r] - wgrad[r] if a.kind == "I" else wgrad[r]) / v
            return (fwd if a.kind == "F" else bwd)[r] / v
        # (unchecked: the builder's lists are checked by tests/test_schedules.py; checking
        # a 1T-parameter pipeline's ~10^5 actions at each search was a third of it)
        return schedules.simulate_schedule(_actions(schedule, pp, mm, v), dur,
                                           p2p_latency=p2p, validate=False).makespan
    cap = 4 * pp
    if m <= cap + pp:
        return run(m)
    a, b = run(cap), run(cap + pp)
    return a + (m - cap) * (b - a) / pp


def _senders(r: int, pp: int, v: int) -> tuple[int, int]:
    """How many of rank r's stages (r, r + pp, ...) send forward and send backward: all but
    the last stage send their activations on, all but the first their input gradients."""
    return (sum(k * pp + r < pp * v - 1 for k in range(v)),
            sum(k * pp + r > 0 for k in range(v)))


def _makespan_on_shared_cores(schedule, pp, m, v, fwd, bwd, p2p, waiting, world,
                              core_share, sends=None, wgrad=None) -> float:
    """Pipeline makespan where CPU ranks oversubscribe the cores (`Hardware.core_share` < 1),
    by a simulation on one clock: the ranks computing at an instant share the machine's
    cores, each at min(1, cores / computing ranks) of one (the stage times were measured
    with every rank computing, each at `core_share` of a core), and the part of each action
    spent waiting on communication (`waiting`) takes its time however many compute. The
    dp x tp ranks of a stage compute in step. A closed form (the larger of the critical
    path at a whole core and the work spread over all cores) priced pp=4 m=4 on 4 ranks
    over 2 cores at 0.65-0.75x its step: the fill and drain run at a whole core, the steady
    state at half of one.

    `sends` (per rank: the part of fwd / bwd its SEND_F / SEND_B take) runs as a SEND of its
    own, during which the data travels: the receiver's share of a transfer (in its fwd / bwd)
    follows on the critical path, not the sender's too (priced by both ranks one after the
    other, a pipeline of many transfers costs well over its measured step).

    `wgrad` (per rank: the part of bwd a split backward's W takes; None: half) runs while
    the other ranks compute as any work does: zero-bubble's deferred weight gradients fill a
    bubble only where a core would otherwise idle (docs/benchmarks.md, "Regret": the
    4-rank MoE row)."""
    acts = _actions(schedule, pp, m, v)
    wgrad = wgrad or [b / 2 for b in bwd]
    send_f, send_b = sends or ([0.0] * pp, [0.0] * pp)
    # the SEND actions of a rank (its stages that send on): each takes an equal share
    counts = [_senders(r, pp, v) for r in range(pp)]
    n_send = {"SEND_F": [max(1, f) for f, _ in counts], "SEND_B": [max(1, b) for _, b in counts]}
    per_action = world // pp
    cores = world * core_share
    pos, now, arrive = [0] * pp, 0.0, {}
    state: list[list[float] | None] = [None] * pp  # [core-seconds left, waiting left]
    while True:
        moved = True
        while moved:  # issue sends, take arrived receives, start computes
            moved = False
            for r in range(pp):
                if state[r] is not None or pos[r] >= len(acts[r]):
                    continue
                a = acts[r][pos[r]]
                if a.kind in ("SEND_F", "SEND_B"):
                    arrive[(a.kind[-1], a.stage, a.microbatch)] = now + p2p
                    t = (send_f if a.kind == "SEND_F" else send_b)[r] / n_send[a.kind][r]
                    if t > 0:  # (compute-like: see the planner's comm_s)
                        state[r] = [t * core_share, 0.0]
                elif a.kind in ("RECV_F", "RECV_B"):
                    src = a.stage - 1 if a.kind == "RECV_F" else a.stage + 1
                    if arrive.get((a.kind[-1], src, a.microbatch), math.inf) > now:
                        continue
                else:
                    f = a.kind == "F"
                    if a.kind == "W":
                        t = wgrad[r] / v
                    else:
                        t = ((fwd if f else bwd)[r] - (send_f if f else send_b)[r]) / v
                        t = t - wgrad[r] / v if a.kind == "I" else t
                    state[r] = [t * (1 - waiting) * core_share, t * waiting]
                pos[r] += 1
                moved = True
        running = [r for r in range(pp) if state[r] is not None]
        if not running:
            if all(pos[r] >= len(acts[r]) for r in range(pp)):
                return now
            later = [t for t in arrive.values() if t > now]
            if not later:
                raise PlanError(f"fxpar bug: the {schedule} schedule deadlocks in the "
                                "planner's simulation; please report it")
            now = min(later)
            continue
        computing = sum(state[r][0] > 0 for r in running)
        speed = min(1.0, cores / (computing * per_action)) if computing else 1.0
        dt = min(state[r][0] / speed if state[r][0] > 0 else state[r][1] for r in running)
        dt = min([dt] + [t - now for t in arrive.values() if t > now])
        now += dt
        for r in running:
            left = state[r]
            if left[0] > 0:
                left[0] = max(left[0] - dt * speed, 0.0) if left[0] > dt * speed * (1 + 1e-9) \
                    else 0.0
            else:
                left[1] = left[1] - dt if left[1] > dt * (1 + 1e-9) else 0.0
            if left[0] <= 0 and left[1] <= 0:
                state[r] = None


# --- search ------------------------------------------------------------------------------------

def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(world):
    return [(dp, tp, world // (dp * tp)) for dp in _divisors(world)
            for tp in _divisors(world // dp)]


def _misfit(fixed: dict, world: int) -> str | None:
    """Why degrees the user fixed match no factorization of `world` (None: some do)."""
    bad = [f"{k}={v!r}" for k, v in fixed.items()
           if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        return f"{', '.join(bad)}: parallel degrees must be positive integers (or \"auto\")"
    if any(all(fixed.get(k, v) == v for k, v in zip(("dp", "tp", "pp"), f))
           for f in _factorizations(world)):
        return None
    names = " x ".join(f"{k}={v}" for k, v in fixed.items())
    prod = math.prod(fixed.values())
    if world % prod:
        return (f"{names}{f' (= {prod})' if len(fixed) > 1 else ''} does not divide {world} "
                f"devices; choose degrees whose product divides {world}")
    return (f"{names} = {prod} devices, not {world}: with dp, tp and pp all fixed their "
            f"product must be {world}")


def search(stats: GraphStats, world: int, hw: cost.Hardware, *, batch_rows: int,
           precision: str = "fp32", optimizer: str = "adamw", constraints: dict | None = None,
           executable: bool = True, schedules_: tuple = ("1f1b", "gpipe", "interleaved",
                                                          "zero-bubble"),
           memory_fraction: float = 0.9, simulate_also: Plan | None = None) -> PlanResult:
    """Every legal plan for `world` devices, pruned by memory, ranked by predicted step time.

    constraints: Plan fields fixed by the user (e.g. {"pp": 2}). executable: only plans this
    fxpar version runs (Plan.validate); False for what-if planning at scale (e.g. bf16).
    """
    t0 = time.perf_counter()
    constraints = {k: v for k, v in (constraints or {}).items() if v is not None}
    misfit = _misfit({k: constraints[k] for k in ("dp", "tp", "pp") if k in constraints}, world)
    if misfit:
        raise PlanError(misfit + ".")
    budget = hw.memory * memory_fraction
    reasons: dict[str, str] = {}
    legal: list[tuple] = []
    n_layers = len(stats.layers)
    cols = sorted({c for s in stats.segments for c in s.column_out})
    by_tp = {}  # tp -> the statistics as the tp pass splits at that degree (GraphStats.at_tp)
    for dp, tp, pp in _factorizations(world):
        if any(constraints.get(k, v) != v for k, v in (("dp", dp), ("tp", tp), ("pp", pp))):
            continue
        if not _context_degrees(stats, dp, tp, pp, batch_rows, constraints):
            reasons.setdefault("dp", f"the batch of {batch_rows} rows does not split over "
                                     f"dp={dp}" + (f" (nor over dp/cp: {stats.cp_refusal})"
                                                   if stats.cp_refusal else ""))
            continue
        if tp > 1 and stats.tp_refusal:
            reasons.setdefault("tp", stats.tp_refusal)
            continue
        if tp > 1 and stats.heads and stats.heads % tp:
            reasons.setdefault("tp", f"tp={tp} does not divide the {stats.heads} attention "
                                     "heads")
            continue
        # a segment whose column linears tp does not all divide stays whole (priced so:
        # at_tp); tp is legal where it splits at least the repeated blocks
        if tp > 1 and (not cols or any(c % tp for s in stats.layers for c in s.column_out)
                       or not any(s.column_out for s in
                                  by_tp.setdefault(tp, stats.at_tp(tp)).segments)):
            reasons.setdefault("tp", f"tp={tp}: " + (
                "the graph has no column/row linear pairs to split" if not cols else
                f"does not divide the split linears' {sorted(set(c for c in cols if c % tp))} "
                "output features"))
            continue
        if pp > 1 and pp > n_layers:
            reasons.setdefault("pp", f"pp={pp} is more than the {n_layers} repeated blocks "
                                     "found in the graph" if n_layers else
                               f"pp={pp}: no repeated blocks (layers) found to cut into stages")
            continue
        legal.append((dp, tp, pp))
    if not legal:
        raise PlanError(
            f"no legal factorization of {world} devices into dp x tp x pp for this model"
            + (f" with {constraints}" if constraints else "") + ": " +
            "; ".join(reasons.values()) + ". Use a device count whose factors fit (e.g. a "
            "multiple of the batch's divisors, tp dividing the heads), or change the batch.")

    cands: list[Candidate] = []
    n_legal = 0
    fixed_off = {k: v for k, v in constraints.items() if k in ("dp", "tp", "pp",
                 "microbatches", "zero") and v != {"dp": world}.get(k, 1 if k != "zero" else 0)}
    plain_note = (f"the fields fixed for this job ({fixed_off}) rule it out" if fixed_off else
                  f"the batch of {batch_rows} rows does not split over dp={world}"
                  if batch_rows % world else "this fxpar cannot run it for this model")
    smallest: tuple[float, Candidate] | None = None
    # Plan.offload_optimizer: as the user fixed it, else tried where a plan does not fit
    # (where there is a host apart from the device: on a CPU it saves nothing)
    offloads = [constraints["offload_optimizer"]] if "offload_optimizer" in constraints else \
        [False, True] if hw.host_link else [False]
    stage_cache = {}
    ticker = Ticker(log)
    for dp, tp, pp, cp, cpa in [(*f, c, a) for f in legal
                                for c in _context_degrees(stats, *f, batch_rows, constraints,
                                                          hw)
                                for a in _context_attentions(stats, c, constraints)]:
        st = by_tp.get(tp, stats)  # (tp = 1: the statistics as traced)
        rows_dp = batch_rows // (dp // cp)  # (a cp group's ranks share their rows)
        mbs_opts = [d for d in _divisors(rows_dp) if d <= 16 or d == rows_dp]
        if "microbatches" in constraints:
            m = constraints["microbatches"]
            if rows_dp % m:
                continue
            mbs_opts = [rows_dp // m]
        for mbs_rows in mbs_opts:
            m = rows_dp // mbs_rows
            mbs = mbs_rows if cp == 1 else mbs_rows / cp  # (cp: a rank's tokens, in rows of
            # the whole sequence)
            if m > 1 and not microbatches_allowed(stats, constraints):
                continue
            scheds = [constraints["schedule"]] if "schedule" in constraints else (
                list(schedules_) if pp > 1 else ["1f1b"])
            built = []
            for sched in scheds:
                v = 2 if sched == "interleaved" else 1
                if sched == "interleaved" and (m % pp or n_layers < pp * v):
                    continue
                if m == 1 and pp > 1:  # one program, one plan: at one microbatch GPipe and
                    # 1F1B run the same actions (the first name kept); measured as two
                    # plans, they came out 1.0-1.25x apart (the timing's noise, as regret)
                    acts = _actions(sched, pp, m, v)
                    if acts in built:
                        continue
                    built.append(acts)
                zeros = [constraints["zero"]] if "zero" in constraints else (
                    [0, 1, 2, 3] if dp > 1 else [0])
                for zero, (shard, hpz), ep, outer in [
                        (z, g, e, o) for o in _mesh_orders(dp, tp, pp, hw, constraints)
                        for z in zeros
                        for g in _node_groupings(dp, tp, pp, m, z, hw, constraints, o)
                        for e in _expert_degrees(stats, dp, tp, pp, m, z, g, constraints)
                        if cp == 1 or (e == 1 or not st.moe_cp_whole) and not cp_misfit(Plan(
                            dp=dp, tp=tp, pp=pp, zero=z, dp_shard=g[0], hpz=g[1], cp=cp, ep=e,
                            ps=constraints.get("ps", 0), grad_compression=constraints.get(
                                "grad_compression", "none")))]:
                    key = (pp, v, tp)
                    if key not in stage_cache:
                        aggs = _rank_aggregates(
                            stages_of(st, pp, v, "cpu" if hw.name == "cpu" else "cuda"), pp, v)
                        stage_cache[key] = (aggs, _twins(aggs))
                    for offload in offloads:  # (with the state on the host where it does
                        # not fit on the device, or fits only by recomputing: offloading
                        # may cost less than the recompute)
                        n_legal += 1  # (each variant priced: the count of fits never passes it)
                        ticker.tick("planner search: %d plans priced", n_legal)
                        c = _price(st, hw, *stage_cache[key], dp, tp, pp, v, m, mbs, sched,
                                   zero, precision, optimizer, constraints, budget, offload,
                                   shard, hpz, ep, cp, cpa, outer)
                        if c is None:
                            break
                        if executable:
                            try:
                                c.plan.validate(world)
                            except PlanError:
                                break
                        if c.memory.total <= budget:
                            cands.append(c)
                            if not c.recompute or "remat" in constraints:
                                break
                            continue
                        if (dp, m, zero, offload, cp) == (world, 1, 0, False, 1):
                            plain_note = (f"it needs {_bytes(c.memory.total)} per device, "
                                          f"over the {_bytes(budget)} usable")
                        elif smallest is None or c.memory.total < smallest[0]:
                            smallest = (c.memory.total, c)
    if not cands:
        if smallest is None:
            raise PlanError(f"no plan could be priced for {world} devices with {constraints}.")
        need, near = smallest
        raise PlanError(
            f"the model fits no legal plan on {world} x {hw.name} with "
            f"{hw.memory / GiB:.1f} GiB each ({memory_fraction:.0%} usable): the smallest "
            f"need is {need / GiB:.2f} GiB per device, by the nearest plan {near.row()} "
            f"({near.memory.describe()}). Use devices with at least "
            f"{need / memory_fraction / GiB:.1f} "
            f"GiB, more devices, or a smaller batch / model.")
    cands.sort(key=lambda c: c.step_s)
    # simulate the pipeline schedules of the best candidates (and of `simulate_also`, the
    # plan a job runs, so its price is comparable with its measurement) and re-rank
    also = plan_dict(simulate_also) if simulate_also is not None else None
    simulated = 0
    for i, c in enumerate(cands):
        if i < SIMULATE_TOP or plan_dict(c.plan) == also:
            _simulate(c, stats, hw, stage_cache, precision)
            simulated += 1
    cands = rank(cands, hw.noise)
    note = stats.note
    inputs = dict(stats=stats, world=world, batch_rows=batch_rows, precision=precision,
                  optimizer=optimizer, constraints=constraints, executable=executable,
                  schedules_=schedules_, memory_fraction=memory_fraction)  # to search again
    seconds = time.perf_counter() - t0
    phase_done(log, "planner search", seconds, f"{n_legal} plans priced, {len(cands)} fit, "
               f"{simulated} schedules simulated")
    return PlanResult(cands[0], cands, n_legal, len(cands), hw, note, seconds, world, inputs,
                      times=[("planner: search", seconds, None)], plain_dp_note=plain_note)


def _compute_scaled(hw: cost.Hardware, k: float) -> cost.Hardware:
    """`hw` with every compute time (matmuls, memory-bound ops, per-node dispatch, the
    optimizer step) k times longer. On GPUs the links keep their prices (NCCL runs on its own
    engines and links). Where collectives are host work on the same cores (CPU ranks, gloo:
    `async_launch` False) they are scaled alike: the start-up table was measured in the same
    second as the compute calibration and is as far off it (4 ranks, every plan measured
    interleaved: re-fit median error 15.7% with compute alone, tensor-parallel plans -42%;
    9.0% and -10% scaled together)."""
    out = dataclasses.replace(hw, matmul_efficiency=hw.matmul_efficiency / k,
                              mem_bandwidth=hw.mem_bandwidth / k,
                              node_overhead=hw.node_overhead * k,
                              optimizer_s=hw.optimizer_s * k if hw.optimizer_s else None)
    if not hw.async_launch:
        out.intra = cost.Link(hw.intra.alpha * k, hw.intra.bandwidth / k)
        out.inter = cost.Link(hw.inter.alpha * k, hw.inter.bandwidth / k)
        if hw.collectives:
            out.collectives = {key: (a * k, b * k) for key, (a, b) in hw.collectives.items()}
    return out


def recalibrate(result: PlanResult, plan: Plan, measured_s: float,
                measured: str = "a measured step") -> PlanResult:
    """Re-price every plan after `plan` (one of result.table) ran at `measured_s` seconds
    a step: the compute time is scaled by the one factor that makes `plan`'s prediction
    equal the measurement (on CPU ranks the gloo collectives with it, see `_compute_scaled`;
    on GPUs communication keeps its data-sheet prices), and the search runs again (the
    ranking can change: plans heavy in compute move against plans heavy in communication).

    Why: the start-up calibration times the model's graph once, in under a second; on a
    shared or throttling machine (CPU ranks oversubscribing the cores, a VM's speed
    drifting) that timing varied 2x for the same graph, and every prediction followed it.
    A few real steps of the job are the better measurement (fxpar.parallelize does this
    after `ParallelModel.REFIT_AFTER` steps). On GPUs it fits the achieved fraction of the
    data sheet's rates."""
    inp = result.inputs
    # the plan's fields pinned; a remat budget the search derived (to fit) is derived again
    # alike -- pinned, it would be applied to every stage and price a different plan
    fixed = {**{k: getattr(plan, k) for k in SEARCHED if k != "remat"}, **inp["constraints"]}
    # (None is "not given" to the search: ZeRO over every dp rank and no hpZ pinned so)
    fixed.update({"dp_shard": fixed.get("dp_shard") or plan.dp, "hpz": fixed.get("hpz") or 0})

    def predicted(k):
        hw = _compute_scaled(result.hardware, k)
        return search(**{**inp, "hw": hw, "constraints": fixed}).best.step_s
    # the step time grows with k, nearly linearly (compute + fixed communication): regula
    # falsi with the Illinois fix converges in a few one-plan searches (a bisection took 20;
    # scipy's brentq would do the same, but scipy is not a dependency)
    lo, hi = 1 / 64, 64.0
    f_lo, f_hi = predicted(lo) - measured_s, predicted(hi) - measured_s
    if f_lo >= 0 or f_hi <= 0:
        k = lo if f_lo >= 0 else hi
    else:
        side = 0
        for _ in range(60):
            k = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
            f = predicted(k) - measured_s
            if abs(f) <= 1e-3 * measured_s:
                break
            if f < 0:
                lo, f_lo = k, f
                f_hi = f_hi / 2 if side == -1 else f_hi
                side = -1
            else:
                hi, f_hi = k, f
                f_lo = f_lo / 2 if side == 1 else f_lo
                side = 1
    hw = _compute_scaled(result.hardware, k)
    before = next((c.step_s for c in result.table if plan_dict(c.plan) == plan_dict(plan)),
                  None)
    hw.calibrated += f"; compute x{k:.2f} (re-fit to a measured step)"
    new = search(**{**inp, "hw": hw}, simulate_also=plan)
    new.start_up = result.start_up or result
    new.refit = (f"re-fit to {measured}, {measured_s * 1e3:.2f} ms, of "
                 f"{' '.join(plan_str(plan).split())}"
                 + (f" (predicted {before * 1e3:.2f} ms)" if before else "")
                 + f": compute x{k:.2f}"
                 + ("" if hw.async_launch else " (gloo collectives alike: the same cores)"))
    return new


def _rank_aggregates(stages, pp, v):
    """Per rank (its v chunks), its `pre` and `post` parts each summed into one segment and
    its layers into a stand-in for the largest and one for the rest, in the order they run
    (the memory model pairs each segment's working memory with the values saved before it),
    so pricing a plan costs O(pp), not O(layers)."""
    out = []
    for r in range(pp):
        segs = [s for k in range(v) for s in stages[k * pp + r]]
        layers = [s for s in segs if s.name not in ("pre", "post")]
        ends = []
        for name in ("pre", "post"):
            part = [s for s in segs if s.name == name]
            agg = Segment(name)
            for s in part:
                for f in FIELDS:
                    setattr(agg, f, getattr(agg, f) + getattr(s, f))
                agg.column_out = agg.column_out + s.column_out
                agg.n_row += s.n_row
                agg.n_moe += s.n_moe
                agg.n_param_tensors += s.n_param_tensors
                agg.largest_param = max(agg.largest_param, s.largest_param)
            agg.boundary = 0.0
            agg.transient, agg.transient_split = _most_working(part)
            ends.append(agg)
        group = []
        if layers:
            big = max(layers, key=lambda s: s.saved)
            rest = Segment("layers")
            for f in FIELDS:
                setattr(rest, f, sum(getattr(s, f) for s in layers) - getattr(big, f))
            rest.boundary = 0.0
            rest.transient, rest.transient_split = _most_working(layers)
            rest.n_row = sum(s.n_row for s in layers) - big.n_row
            rest.n_moe = sum(s.n_moe for s in layers) - big.n_moe
            rest.n_param_tensors = sum(s.n_param_tensors for s in layers) - big.n_param_tensors
            rest.largest_param = max(s.largest_param for s in layers)
            rest.column_out = [c for s in layers for c in s.column_out][len(big.column_out):]
            rest.layer_count = len(layers) - 1
            group = [big, rest]
        out.append([ends[0], *group, ends[1]])
    return out


def _twins(rank_segs) -> list[int]:
    """Per rank, the first rank whose aggregated segments are equal to its own (every
    attribute): a pipeline's middle ranks of identical layers are priced once (at 1T
    parameters on 3072 devices, 128 stages of 3-4 distinct kinds)."""
    def content(s):  # (a layer's name is not priced: only pre / post / ends are told apart)
        return {**vars(s), "name": s.name if s.name in ("pre", "post", "ends") else "layer"}
    seen: dict[str, int] = {}
    return [seen.setdefault(repr([content(s) for s in segs]), r)
            for r, segs in enumerate(rank_segs)]


def _most_working(segs) -> tuple[float, float]:
    """(transient, transient_split) of the segment with the most working memory (at tp=2:
    the degree the split was counted at)."""
    s = max(segs, key=lambda s: s.working(2), default=None)
    return (s.transient, s.transient_split) if s is not None else (0.0, 0.0)


def simplicity(p: Plan) -> tuple:
    """What wins a tie: less tensor parallelism, fewer pipeline stages, fewer microbatches -
    where a price is least certain (collective latency, the runtime's per-microbatch costs) -
    then fewer axes, less ZeRO, no HSDP, hpZ, ep or cp, gathered cp attention, dp outside
    pp, 1F1B, no remat. Plain dp wins every tie it is in. (Fewer axes first let 4 CPU ranks
    pick pp=4 m=8 over pp=2 x dp=2 m=1 in a 4% tie; it measured 1.5x.)"""
    axes = sum(d > 1 for d in (p.dp, p.tp, p.pp))
    return (p.tp, p.pp, p.microbatches, axes, p.zero, p.hsdp, bool(p.hpz), p.ep, p.cp,
            p.cp_attention == "ring", p.pp_outer, p.pp > 1 and p.schedule != "1f1b",
            p.remat != "none", p.offload_optimizer)


def rank(cands: list[Candidate], noise: float) -> list[Candidate]:
    """The chosen plan first -- the simplest (`simplicity`) of those predicted within `noise`
    of the fastest, since the prediction cannot tell them apart and a choice that flips
    between runs with the start-up timing's luck is worse than either -- then the rest,
    fastest first."""
    by_time = sorted(cands, key=lambda c: (c.step_s, simplicity(c.plan)))
    tied = [c for c in by_time if c.step_s <= by_time[0].step_s * (1 + noise)]
    best = min(tied, key=lambda c: (simplicity(c.plan), c.step_s))
    return [best] + [c for c in by_time if c is not best]


@functools.lru_cache(maxsize=None)
def _offloaded_state(state: tuple, precision: str, optimizer: str) -> tuple[float, tuple]:
    """(the share of the optimizer state that stays on the device, the state formula with
    the rest on the host) under Plan.offload_optimizer: in half precision the fp32 masters
    stay. Once per formula: sympy is slow per candidate."""
    master = sympy.Rational(4 if precision != "fp32" else 0,
                            state_bytes_per_param(optimizer, precision))
    return float(master), ((*state[:2], state[2] * master) if state else ())


def _node_groupings(dp, tp, pp, m, zero, hw, constraints, pp_outer=False) -> list[tuple]:
    """(Plan.dp_shard, Plan.hpz) pairs to price at this dp, tp, pp, microbatch count and ZeRO
    stage: as the user fixed them (where they fit), else (None, None) (ZeRO over every dp
    rank) and, where the dp group spans nodes, one node's dp ranks as HSDP's shard group
    (ZeRO's all-gathers and reduce-scatters on the node's links, one all-reduce of a 1/shard
    slice across nodes) and, at zero=3, pp=1 and m=1, as hpZ's secondary partition (the
    backward's gathers on the node's links). `pp_outer`: the mesh's order (Plan.pp_outer),
    which sets how many ranks apart neighbouring dp ranks are."""
    stride = dp_stride(tp, pp, pp_outer)
    node = hw.devices_per_node // stride if hw.devices_per_node % stride == 0 else 0
    spans = dp * stride > hw.devices_per_node and 1 < node < dp and dp % node == 0
    given = constraints.get("dp_shard")
    if given == "node":  # (the launcher's node size: Plan.dp_shard="node")
        try:
            given = node_shard(dp, stride)
        except PlanError:  # (nodes do not divide this dp: not a candidate)
            return []
    shards = [given] if "dp_shard" in constraints else [None, node] if spans else [None]
    hpzs = [constraints["hpz"]] if "hpz" in constraints else [None, node] if spans else [None]
    shards = [None if s == dp else s for s in shards]  # (a group of all dp ranks: none)
    return [(s, h or None)  # (hpz = 0: none)
            for s in shards if not hsdp_misfit(s, dp, zero)
            for h in hpzs if not hpz_misfit(h, dp, zero, pp, m, s)]


def _mesh_orders(dp, tp, pp, hw, constraints) -> list[bool]:
    """Plan.pp_outer values to price: as the user fixed it, else both orders where there is
    a pipeline and a dp group to order and the ranks span nodes (the stages outermost put
    the dp groups' collectives on neighbouring ranks, a node, and the pipeline's sends
    across nodes; within one node every order prices the same)."""
    if "pp_outer" in constraints:
        return [constraints["pp_outer"]] if not constraints["pp_outer"] or (
            pp > 1 and dp > 1) else []
    spans = dp * tp * pp > hw.devices_per_node
    return [False, True] if pp > 1 and dp > 1 and spans else [False]


def _expert_degrees(stats, dp, tp, pp, m, zero, grouping, constraints) -> list[int]:
    """Plan.ep degrees to price at these fields: as the user fixed it (where it fits), else 1
    and every divisor of dp > 1 that divides each MoE layer's experts, where the graph has
    MoE layers expert parallelism splits and ep_misfit (Plan.validate's rule) allows it."""
    shard, hpz = grouping
    probe = Plan(dp=dp, tp=tp, pp=pp, microbatches=m, zero=zero, dp_shard=shard, hpz=hpz,
                 ps=constraints.get("ps", 0),
                 grad_compression=constraints.get("grad_compression", "none"))
    if "ep" in constraints:
        eps = [constraints["ep"]]
        if eps[0] > 1 and stats.ep_refusal:
            raise PlanError(f"Plan.ep={eps[0]}: {stats.ep_refusal}")
    elif stats.expert_counts and not stats.ep_refusal:
        eps = [1] + [e for e in _divisors(dp) if e > 1
                     and all(n % e == 0 for n in stats.expert_counts)]
    else:
        eps = [1]
    return [e for e in eps if not ep_misfit(dataclasses.replace(probe, ep=e))]


def _context_degrees(stats, dp, tp, pp, batch_rows, constraints, hw=None) -> list[int]:
    """Plan.cp degrees to price at this factorization: as the user fixed it (where it fits),
    else 1 where the batch's rows split over dp, and where they do not (more ranks than
    rows) the smallest cp dividing dp and the sequence whose dp/cp the rows split over.
    At as many tokens per rank cp costs more than dp (every attention's keys and values
    gathered, and held whole for the backward), so it is searched where dp runs out of rows,
    and at its three smallest degrees where one sequence's layer inputs are large on `hw` (a
    microbatch of one row may not fit: cp's microbatches are a share of a row)."""
    if "cp" in constraints:
        cps = [constraints["cp"]]
        if cps[0] > 1 and stats.cp_refusal:
            raise PlanError(f"Plan.cp={cps[0]}: {stats.cp_refusal}")
        ep = constraints.get("ep", 1)
        if cps[0] > 1 and isinstance(ep, int) and ep > 1:  # (both fixed: say why not here)
            if max(cps[0], ep) % min(cps[0], ep):
                raise PlanError(cp_misfit(Plan(dp=cps[0] * ep, cp=cps[0], ep=ep)))
            if stats.moe_cp_whole:
                raise PlanError(
                    f"Plan.cp={cps[0]} with ep={ep}: this MoE's dispatch runs on the cp "
                    "group's whole tokens under cp (its tokens do not arrive as each rank's "
                    "sequence chunks: planner.cp_probe), so ep cannot send each "
                    "rank's own tokens to their experts. Use ep or cp alone for this model.")
    elif constraints.get("cp_attention", "auto") != "auto":  # (it asks for cp: every degree)
        if stats.cp_refusal:
            raise PlanError(f"Plan.cp_attention={constraints['cp_attention']!r}: "
                            f"{stats.cp_refusal}")
        cps = [c for c in _divisors(dp) if c > 1]
    elif stats.cp_refusal or not stats.seq:
        cps = [1] if batch_rows % dp == 0 else []
    else:
        cps = [c for c in _divisors(dp) if c > 1 and batch_rows % (dp // c) == 0]
        # what full recompute keeps of one sequence (each layer's input; a pipeline's first
        # stage holds about as much, its share for each microbatch in flight) over a quarter
        # of the device: a microbatch of one row may not fit where cp's share of a row would
        # (DeepSeek-V3 at 32k tokens: 28 GB on 80); the three smallest degrees (the
        # search's time grows with each)
        long_rows = hw is not None and sum(s.boundary for s in stats.layers) / max(
            stats.rows, 1) > hw.memory / 4
        cps = [c for c in cps if stats.seq % (2 * c) == 0]  # (2 chunks a rank)
        cps = ([1] + cps[:3] if long_rows else [1]) if batch_rows % dp == 0 else \
            cps[:3] if long_rows else cps[:1]
    probe = Plan(dp=dp, tp=tp, pp=pp, microbatches=constraints.get("microbatches", 1),
                 ep=constraints.get("ep", 1), ps=constraints.get("ps", 0),
                 grad_compression=constraints.get("grad_compression", "none"))
    return [c for c in cps if dp % c == 0 and batch_rows % (dp // c) == 0
            and (c == 1 or stats.seq and stats.seq % (2 * c) == 0)  # (2 chunks a rank)
            and not cp_misfit(dataclasses.replace(probe, cp=c))]


def _context_attentions(stats, cp: int, constraints) -> list[str]:
    """Plan.cp_attention values to price at this cp: as the user fixed it, else "gather" and
    (where every attention can go around the ring) "ring"; "auto" without cp."""
    fixed = constraints.get("cp_attention", "auto")
    if cp == 1:  # (a fixed way of cp's attention asks for cp: `_context_degrees`)
        return [] if fixed != "auto" else ["auto"]
    if fixed == "ring" and stats.ring_refusal:
        raise PlanError(f"Plan.cp_attention='ring': {stats.ring_refusal}. Use "
                        "cp_attention='gather' or 'auto'.")
    if fixed != "auto":
        return [fixed]
    return ["gather"] + ([] if stats.ring_refusal else ["ring"])


def _grouped(segs, tf, tb, g, rate, bw, ep: int, saved: str, tp: int = 1
             ) -> tuple[float, float]:
    """The forward and backward times with listed experts grouped (passes/grouped_experts),
    each rank holding 1/ep of them (and 1/tp of each where tp splits their linears): the
    FLOPs `saved` (the Segment fields' prefix) of their traced matmuls less, the bytes
    grouping moves more (the stacks of the rank's experts' weights; the rows, `g` x the
    traced rows, whole on each tp rank)."""
    share = ep * (tp if any(s.expert_flops_f_split for s in segs) else 1)
    stack = sum(s.grouped_stack_bytes for s in segs) / share / bw
    tf = max(tf - sum(getattr(s, f"{saved}_f") for s in segs) * g / share / rate, 0.0) + sum(
        s.grouped_bytes_f for s in segs) * g / bw + stack
    tb = max(tb - sum(getattr(s, f"{saved}_b") for s in segs) * g / share / rate, 0.0) + sum(
        s.grouped_bytes_b for s in segs) * g / bw + stack
    return tf, tb


def _expert_flops(segs, part: str, tp: int) -> float:
    """A rank's expert FLOPs of `part` ("f" / "b") before ep: the experts tp splits, 1/tp."""
    split = sum(getattr(s, f"expert_flops_{part}_split") for s in segs)
    return sum(getattr(s, f"expert_flops_{part}") for s in segs) - split * (1 - 1 / tp)


def _expert_share(segs, tp: int) -> float:
    """The fraction of a rank's parameter elements (its tp slices) that are experts."""
    local = sum(s.params - s.params_split * (1 - 1 / tp) for s in segs)
    return min(sum(s.expert_params for s in segs) / local, 1.0) if local > 0 else 0.0


def _price(stats, hw, stages, twins, dp, tp, pp, v, m, mbs, sched, zero, precision, optimizer,
           constraints, budget, offload=False, shard=None, hpz=None, ep=1, cp=1,
           cp_attention="auto", pp_outer=False) -> Candidate | None:
    """`shard`: Plan.dp_shard (HSDP: ZeRO over groups of `shard` dp ranks; None: all);
    `hpz`: Plan.hpz (the backward's gathers over groups of `hpz` ranks); `ep`: Plan.ep (each
    rank of a group of ep dp ranks holds and computes 1/ep of the experts, the layers' rows
    summed over the group); `cp`: Plan.cp (groups of cp dp ranks split the sequence; `mbs`
    is then a rank's tokens in whole-sequence rows, batch rows / dp); `cp_attention`:
    Plan.cp_attention, "gather" or "ring" where cp > 1; `pp_outer`: Plan.pp_outer (the dp
    groups and those carved from them on neighbouring tp x dp ranks, the stages outermost)."""
    quant = constraints.get("comm_quantization", "none")
    # how many ranks apart neighbouring dp ranks are (a group's span of consecutive ranks
    # sets the links it crosses: hw.comm)
    stride = dp_stride(tp, pp, pp_outer)
    # a pipeline runs at its slowest hop: its sends priced on the link its whole extent
    # crosses (pp stages, neighbours tp x dp ranks apart with the stages outermost, else tp)
    pipe_span = (tp * dp if pp_outer else tp) * pp
    sdp = shard if shard and shard < dp else dp  # ZeRO shards over sdp ranks, `reps` copies
    reps = dp // sdp
    if quantization_misfit(quant, zero, dp):
        return None  # (Plan.validate refuses it: what-if searches do not validate)
    onebit = constraints.get("grad_compression", "none") == "1bit-adam"
    # ep sends each rank's routed rows by all-to-all (not listed experts run in slots)
    all_to_all = ep > 1 and stats.moe_local and not stats.ep_slots
    if onebit and (dp == 1 or zero or pp > 1 or m > 1):
        return None  # (compression_misfit: 1-bit Adam runs on plain dp only)
    held = in_flight(sched, pp, m, v)
    n_st = len(stages)
    # a weight-shaped value a stage sends every microbatch: the sender holds one in flight
    # (the runtime releases a send as it completes), the receiver prefetches two; a tied
    # weight's gradient part goes once a step (`once`)
    dev = "cpu" if hw.name == "cpu" else "cuda"
    sent = stats.transfers.get((pp * v, dev)) if pp > 1 else None
    kept, at_end, copies = [0.0] * pp, [0.0] * pp, [0.0] * pp
    for t in sent or []:
        if t.per_row:
            continue
        if t.once:  # the sender's running sum of it, held over the step (also where both
            # stages are one rank's chunks: BERT-MLM's interleaved pp=2 was 0.77x without
            # it); at the end the receiver's buffer, and the sum its R part makes of that
            # and its own (a new tensor)
            kept[t.src % pp] += t.nbytes / tp
            at_end[t.dst % pp] += (1 if t.src % pp == t.dst % pp else 2) * t.nbytes / tp
        elif t.src % pp != t.dst % pp:  # (a weight's view: nothing on the sender; received
            # as it is read)
            kept[t.src % pp] += 0.0 if t.weight_view else t.nbytes / tp
            kept[t.dst % pp] += (1 if t.weight_view else 2) * t.nbytes / tp
    # a shared weight's copy on each other rank that reads it: a parameter there too, with
    # the summed gradient it receives and the optimizer state it steps it with (priced on
    # the summing stage alone, a tied LM head's rank came out at 0.5x what a step allocates)
    for nbytes, holders, made in (stats.shared_weights.get((pp * v, dev), [])
                                  if pp > 1 else []):
        for r in {s % pp for s in holders} - {made % pp}:
            copies[r] += nbytes / stats.param_bytes_per_elem / tp
    rank_segs = stages  # per rank: aggregated segments (see _rank_aggregates)
    # the activations of a rank's segments scaled to what the pass's cut saves on it
    by_cut = stats.stage_saved.get((pp * v, dev)) if pp > 1 else None
    saved_factor = [1.0] * pp
    for r in range(pp if by_cut else 0):
        mapped = sum(s.saved for s in rank_segs[r])
        if mapped > 0:
            saved_factor[r] = sum(by_cut[s] for s in range(r, pp * v, pp)) / mapped
    fwd, bwd, recs = [], [], []
    # per rank: the step's time waiting on communication that free cores do not speed up
    # (tp collectives: ranks arrive out of step). A pipeline transfer is not in it: gloo's
    # threads copy it on the cores the ranks share, faster while fewer ranks compute
    # (ResNet's pp=4 m=1 on 4 ranks over 2 cores, its stages taking turns: 7 transfers priced
    # at the all-ranks-busy latency as waiting made it 1.33x its step)
    comm_s = []
    remat = constraints.get("remat", "none")
    fixed_remat = "remat" in constraints and remat != "auto"  # "auto": the pass sizes it
    if remat == "auto":
        remat = "none"

    states: dict[tuple, tuple] = {}  # per kind of rank (`_twins`): its state, saved values

    def rank_memory(r, remat):
        mem, rec = with_activations(*rank_state(r, remat), held[r], remat)  # (a copy: told
        # its stage)
        mem.activations += axes_saved(r, remat, rec)
        return mem, rec

    def kind(r):  # what a rank's state is made of (`_twins`: its segments)
        return twins[r], kept[r], saved_factor[r], at_end[r], copies[r]

    def rank_state(r, remat):
        key = (*kind(r), remat == "none")
        if key not in states:
            mem, saved = stage_state(
                rank_segs[r], stats, tp=tp, dp=dp, shard_dp=sdp, zero=zero, rows=mbs,
                precision=precision, optimizer=optimizer, remat_none=remat == "none",
                transient=True, pp=pp, microbatches=m, sends_held=kept[r],
                saved_factor=saved_factor[r],
                received_at_end=at_end[r], weight_copies=copies[r],
                optimizer_foreach=dev == "cuda",
                bucket_bytes=stats.dp_bucket_bytes or 25 * 2 ** 20)
            if offload and hw.host_link:  # Plan.offload_optimizer: the state and the step's
                # temporaries on the host; in half precision the fp32 masters (the graph's
                # parameters) stay
                master, mem.state = _offloaded_state(mem.state, precision, optimizer)
                mem.optimizer, mem.optimizer_step = mem.optimizer * master, 0.0
            elif offload:  # a CPU device is the host: the state stays, and the host copies
                # and their gradient buffers (fp32, of what this rank steps) come on top
                stepped = mem.params / DTYPE_BYTES[precision] * (sdp if zero >= 3 else 1) / (
                    sdp if zero >= 1 else 1)
                mem.optimizer += 2 * 4 * stepped
            if ep > 1:  # its experts' weights, gradients and optimizer state: 1/ep, except
                # what ZeRO shards: the experts' then over the dp / ep ranks holding them
                # ("edp"), 1/ep of the experts over dp/ep ranks = 1/dp of them, as priced
                keep = 1 - _expert_share(rank_segs[r], tp) * (1 - 1 / ep)
                mem.params, mem.grads, mem.optimizer = (
                    mem.params * (1 if zero >= 3 else keep),
                    mem.grads * (1 if zero >= 2 else keep), mem.optimizer * (1 if zero else keep))
            if hpz:  # hpZ's secondary shards: 1/hpz of the (fp32 master) weights, cut from
                # the forward's gathered copy and held to the backward
                mem.buffers += mem.params * sdp / hpz * 4 / DTYPE_BYTES[precision]
            if onebit:  # 1-bit Adam's flat momentum and the error it carries, fp32 (the
                # server's error: 1/dp more)
                mem.optimizer += 4 * (2 + 1 / dp) * mem.params / DTYPE_BYTES[precision]
            states[key] = mem, saved
        return states[key]

    def axes_saved(r, remat, rec) -> float:
        """What ep and cp keep for the backward beyond the graph's saved values, over the
        rank's microbatches in flight (`rec`: the fraction of the forward remat recomputes).
        The remat pass runs before both and sizes its budget on the graph without them."""
        extra = 0.0
        if all_to_all:  # the rows a rank receives beyond the rows it routes (as many
            # where the routing is balanced), priced at up to EP_RECEIVED x them (the
            # routing's imbalance), of the MoE layers remat keeps (a layer it recomputes
            # sends its rows again and keeps none)
            extra += (min(ep, EP_RECEIVED) - 1) * (1 - rec) * sum(
                s.ep_saved for s in rank_segs[r])
        if cp > 1 and remat == "none" and cp_attention != "ring":  # the gathered keys and
            # values the backward reads: whole for the rank's rows, where its share of the
            # tokens was priced (with remat on, the backward gathers them again instead;
            # ring attention never holds them whole)
            extra += (cp - 1) * sum(s.kv_bytes for s in rank_segs[r])
        if cp > 1:  # and what else the cp pass keeps (its probe at cp=2, per token), of the
            # layers remat keeps
            probe = stats.cp_probe()
            beyond = probe.ring if cp_attention == "ring" else probe.gather
            extra += (1 - rec) * beyond * sum(s.saved for s in rank_segs[r]
                                              if s.name not in ("pre", "post"))
        return extra * held[r] * mbs / stats.rows

    def remat_budget(r, room) -> float:
        """The budget for the remat pass whose saved values and ep's received rows beside
        them (`axes_saved`, in proportion to the layers it keeps) fill `room`."""
        e = axes_saved(r, 1, 0.0)  # (everything kept)
        saved = rank_state(r, 1)[1]
        full, floor = saved.under("none", held[r])[0], saved.under(1.0, held[r])[0]
        if e <= 0 or full <= floor:
            return room
        # room = b + e (b - floor) / (full - floor), between the floor and everything
        return (room + e * floor / (full - floor)) / (1 + e / (full - floor))
    mems = [rank_memory(r, remat) for r in range(pp)]
    worst = max(range(pp), key=lambda r: mems[r][0].total)
    if mems[worst][0].total > budget and not fixed_remat:
        # the least recompute that fits: give each rank the activation budget that is left
        new = []
        for r in range(pp):
            mem, _ = mems[r]
            left = budget - (mem.params + mem.optimizer + mem.grads + mem.buffers)
            trans = max(s.working(tp) for s in rank_segs[r]) * mbs / stats.rows
            new.append(rank_memory(r, max(remat_budget(r, left - trans), 1.0)))
        mems = new
        worst = max(range(pp), key=lambda r: mems[r][0].total)
        # the pass's budget is the activation peak priced for the binding rank (its simulated
        # peak includes the backward's working memory, as `activations` does), never less
        # than the floor priced for it: what is left after the static state, at a peak the
        # step and the optimizer step do not share, was below the floor the pass can reach
        remat = int(max(mems[worst][0].activations - axes_saved(worst, 1, mems[worst][1]), 1))
    for r, (m_, _) in enumerate(mems):
        m_.stage = r
    mems[worst][0].per_stage = [m_ for m_, _ in mems]
    total_nodes = max(sum(s.nodes_f + s.nodes_b for s in stats.segments), 1)
    # on a GPU the step is replayed as CUDA graphs (Plan.cuda_graphs, runtime/cudagraph.py):
    # its graph nodes cost no host dispatch
    # (not ep's all-to-all dispatch: its counts are read on the host; nor ring attention:
    # its send/recv inside the op is not captured; runtime/cudagraph.uncapturable)
    graphed = hw.async_launch and replays_step(constraints.get("cuda_graphs", "auto"), pp, m) \
        and not all_to_all and not (cp > 1 and cp_attention == "ring")
    hw_graph = dataclasses.replace(hw, node_overhead=0.0) if graphed else hw
    if not graphed and hw.async_launch and stats.host_calls_compiled and \
            codegen.decide(constraints.get("codegen", "auto"), "cuda")[0] == "inductor":
        # Inductor's runs launch per run and per library kernel, not per graph node
        hw_graph = dataclasses.replace(hw, node_overhead=hw.node_overhead * min(
            stats.host_calls_compiled / total_nodes, 1.0))
    timed: dict[int, tuple] = {}
    wgrad = []  # zero-bubble: the seconds of each rank's backward its W part takes
    for r in range(pp):
        segs = rank_segs[r]
        rec = mems[r][1]
        if twins[r] not in timed:
            f = mbs / stats.rows
            timed[twins[r]] = (
                sum(_seg_time(s, stats, mbs, tp, hw_graph, precision, "f", dp) for s in segs),
                sum(_seg_time(s, stats, mbs, tp, hw_graph, precision, "b", dp) for s in segs),
                sum(hw.comm("all_reduce", s.tp_comm_f * f, tp, tp,
                            calls=s.n_row + int(s.tp_calls_extra)) for s in segs),
                sum(hw.comm("all_reduce", s.tp_comm_b * f, tp, tp, calls=len(s.column_out))
                    for s in segs),
                # the nodes the tp pass adds (redistributions, collectives), this rank's share
                sum(s.nodes_f + s.nodes_b for s in segs) / total_nodes)
        tf, tb, tpc_f, tpc_b, share = timed[twins[r]]
        tp_nodes = stats.tp_nodes_extra * share * hw_graph.node_overhead / 2 if tp > 1 \
            else 0.0
        if all_to_all:  # each rank's routed rows sent to their experts' ranks and back,
            # forward and backward (two each way), its experts run on as many rows as under
            # plain dp (routing balanced); the host reads each exchange's counts
            n_moe, f = sum(s.n_moe for s in segs), mbs / stats.rows
            calls = max(1, 2 * round(n_moe))
            epc_f = hw.comm("all_to_all", 2 * sum(s.ep_comm_f for s in segs) * f, ep,
                            stride * ep, calls=calls)
            epc_b = hw.comm("all_to_all", 2 * sum(s.ep_comm_b for s in segs) * f, ep,
                            stride * ep, calls=calls)
            nodes = 8 * n_moe * hw_graph.node_overhead  # (route, counts, dispatches, combines)
            tf, tb = tf + nodes, tb + nodes
            tpc_f, tpc_b = tpc_f + epc_f, tpc_b + epc_b
            if (precision == "bf16" or hw.name == "cpu") and any(
                    s.grouped_saved_f for s in segs):  # listed experts grouped: over the
                # rows the rank receives, as many as it routes (passes/grouped_experts)
                rate = hw.flops(precision) * hw.matmul_efficiency / hw.roofline_scale
                tf, tb = _grouped(segs, tf, tb, f, rate, hw.mem_bandwidth / hw.roofline_scale,
                                  1, "grouped_saved", tp)
        elif ep > 1:  # the expert matmuls over every dp rank's rows: 1/ep of them; the rows
            # leaving each MoE layer all-reduced over the ep group (neighbouring dp ranks)
            g = mbs * dp / stats.rows
            rate = hw.flops(precision) * hw.matmul_efficiency / hw.roofline_scale
            n_moe = sum(s.n_moe for s in segs)
            epc_f = hw.comm("all_reduce", sum(s.ep_comm_f for s in segs) * g, ep,
                            stride * ep, calls=max(1, round(n_moe)))
            epc_b = hw.comm("all_reduce", sum(s.ep_comm_b for s in segs) * g, ep,
                            stride * ep, calls=max(1, round(n_moe)))
            bw = hw.mem_bandwidth / hw.roofline_scale
            nodes = 12 * n_moe * hw_graph.node_overhead  # (the window, moves and masks)
            tf = max(tf + sum(s.ep_bytes_f for s in segs) * g / bw + nodes
                     - (1 - 1 / ep) * _expert_flops(segs, "f", tp) * g / rate, 0.0)
            tb = max(tb + sum(s.ep_bytes_b for s in segs) * g / bw + nodes
                     - (1 - 1 / ep) * _expert_flops(segs, "b", tp) * g / rate, 0.0)
            if (precision == "bf16" or hw.name == "cpu") and any(
                    s.grouped_saved_f for s in segs):  # listed experts grouped in
                # slots (passes/grouped_experts): each rank's 1/ep of them over its rows
                tf, tb = _grouped(segs, tf, tb, g, rate, bw, ep, "grouped_saved", tp)
            tpc_f, tpc_b = tpc_f + epc_f, tpc_b + epc_b  # (waiting, as tp's collectives)
        elif precision == "bf16" or hw.name == "cpu":  # listed experts run grouped
            # (passes/grouped_experts; on CUDA in bf16 only): over every dp rank's rows (the
            # rank's own where the routing runs on them; under cp the cp group's where it
            # runs them whole), 1/E of their traced matmuls
            g = mbs * ((cp if cp > 1 and stats.moe_cp_whole else 1) if stats.moe_local else dp) \
                / stats.rows
            rate = hw.flops(precision) * hw.matmul_efficiency / hw.roofline_scale
            bw = hw.mem_bandwidth / hw.roofline_scale
            tf, tb = _grouped(segs, tf, tb, g, rate, bw, 1, "grouped_saved", tp)
        if cp > 1:  # every attention's keys and values gathered over the cp group
            # (neighbouring dp ranks) forward, their gradients reduce-scattered backward: of
            # the rank's rows, whole (cp x its tokens in whole-sequence rows)
            g = mbs * cp / stats.rows
            if stats.moe_local and stats.moe_cp_whole:  # the experts run on the cp group's
                # whole tokens (planner.cp_probe), not the rank's share priced above
                rate = hw.flops(precision) * hw.matmul_efficiency / hw.roofline_scale
                tf += (cp - 1) * _expert_flops(segs, "f", tp) * mbs / stats.rows / rate
                tb += (cp - 1) * _expert_flops(segs, "b", tp) * mbs / stats.rows / rate
            calls = max(1, 2 * sum(s.n_attn for s in segs))
            kv = sum(s.kv_bytes for s in segs) * g
            if cp_attention == "ring":  # each block passed to the next rank beside the
                # blocks' kernels (cp - 1 steps; the backward also passes the blocks' fp32
                # gradients, the last hop after its kernels): what the kernels do not hide
                rate = hw.flops(precision) * hw.matmul_efficiency / hw.roofline_scale
                n_attn = sum(s.n_attn for s in segs)
                steps = max(1, round((cp - 1) * n_attn))
                acc = kv * 4 / min(DTYPE_BYTES[precision], 4)
                hidden_f = (1 - 1 / cp) * sum(s.attn_flops_f for s in segs) * mbs / stats.rows
                hidden_b = (1 - 1 / cp) * sum(s.attn_flops_b for s in segs) * mbs / stats.rows
                span = stride * cp
                own = steps * hw.link(span).alpha  # (each step's launches and merge, as
                # cost.ring_attention_time)
                cpc_f = max(hw.comm("p2p", kv * (1 - 1 / cp), 2, span, calls=steps)
                            - hidden_f / rate, 0.0) + own
                cpc_b = max(hw.comm("p2p", (kv + acc) * (1 - 1 / cp), 2, span,
                                    calls=2 * steps) - hidden_b / rate, 0.0) + own + \
                    hw.comm("p2p", acc / cp, 2, span, calls=max(1, round(n_attn)))
            else:
                cpc_f = hw.comm("all_gather", kv, cp, stride * cp, calls=calls)
                cpc_b = hw.comm("reduce_scatter", kv, cp, stride * cp, calls=calls)
                if remat != "none":  # (gathered again for the backward)
                    cpc_b += hw.comm("all_gather", kv, cp, stride * cp, calls=calls)
            if hw.name != "cpu" and any(s.sdpa_flops_f for s in segs):  # CUDA's kernels
                # the pass keeps whole (the memory-efficient and cuDNN ones, flash with
                # dropout: context_parallel.splits_attention): each rank runs its rows' whole
                # attention, cp x its share, with the queries gathered and the output's
                # gradient too (flash, and attention written out as matmuls, split)
                rate = hw.flops(precision) * hw.matmul_efficiency / hw.roofline_scale
                tf += (cp - 1) * sum(s.sdpa_flops_f for s in segs) * mbs / stats.rows / rate
                tb += (cp - 1) * sum(s.sdpa_flops_b for s in segs) * mbs / stats.rows / rate
                qo = sum(s.qo_bytes for s in segs) * g
                cpc_f += hw.comm("all_gather", qo / 2, cp, stride * cp, calls=calls // 2)
                cpc_b += hw.comm("all_gather", qo / 2, cp, stride * cp, calls=calls // 2)
            tpc_f, tpc_b = tpc_f + cpc_f, tpc_b + cpc_b
        fwd.append(tf + tpc_f + tp_nodes)
        # the recomputed forward runs its tp all-reduces again (remat runs before the tp
        # pass, which splits the recomputed copies as it splits the forward)
        bwd.append(tb + tpc_b + tp_nodes + rec * (tf + tpc_f))
        comm_s.append(m * ((1 + rec) * tpc_f + tpc_b))
        wgrad.append(tb * _wgrad_share(stats, (pp * v, dev), r, mbs, hw_graph, precision)
                     if sched == "zero-bubble" else 0.0)
    boundary = max((s.boundary for s in stats.layers), default=0.0) * mbs / stats.rows
    p2p = hw.comm("p2p", boundary, 2, pipe_span) if pp > 1 else 0.0
    tied_s = 0.0
    send_f, send_b = [0.0] * pp, [0.0] * pp  # the sender's share of fwd / bwd (its SENDs)
    if sent is not None:  # the pass's own transfers, per microbatch (a tp rank sends its
        # own copy). What one stage sends another for one action goes as one group: each
        # value over a socket buffer's size (SMALL_TRANSFER) costs a latency on both ranks
        # (Mixtral's 2-4 MB expert-weight views and activations: priced one latency a group,
        # its pipelines came out 0.75-0.85x their step), the small ones ride with the group
        # (ResNet's 32-byte BatchNorm statistics arrived with their activation; priced a
        # latency each, its pp=4 was 1.9x its step)
        moved: dict[tuple, list[float]] = {}
        for x in sent:
            if x.src % pp == x.dst % pp:
                continue  # two chunks of one rank (interleaved): no transfer
            nbytes = x.nbytes * (mbs / stats.rows if x.per_row else 1.0)
            if x.once:  # after the last microbatch, beside the tied gradients' exchange
                tied_s += hw.comm("p2p", nbytes, 2, pipe_span)
                continue
            # (by stage: an interleaved rank's two chunks send at different times)
            moved.setdefault((x.src, x.dst, x.backward), []).append(nbytes)
        for (src, dst, backward), sizes in moved.items():
            t = hw.comm("p2p", sum(sizes), 2, pipe_span,
                        calls=max(1, sum(b > SMALL_TRANSFER for b in sizes)))
            side = bwd if backward else fwd
            for r in (src % pp, dst % pp):
                side[r] += t * (1 - hw.overlap)
            if (src < dst) != backward:  # (a tied weight's part goes the other way)
                (send_b if backward else send_f)[src % pp] += t * (1 - hw.overlap)
        for nbytes, stages, _ in stats.shared_weights.get((pp * v, dev), []):
            if len({s % pp for s in stages}) > 1:
                tied_s += hw.comm("p2p", nbytes / tp, 2, pipe_span)
    if pp > 1 and sent is not None:
        p2p *= hw.overlap  # the fill / drain latency below: the rest is in the stages' times
    elif pp > 1:
        # a send / receive the device cannot overlap (gloo's threads share the CPU with the
        # compute: measured 1.5 ms per call on 2 ranks) is paid by every forward and
        # backward of a stage, once per neighbouring stage, not only filling the pipeline
        for r in range(pp):
            n_f, n_b = _senders(r, pp, v)
            fwd[r] += (n_f + n_b) * p2p * (1 - hw.overlap)  # (each link: a send, a receive)
            bwd[r] += (n_f + n_b) * p2p * (1 - hw.overlap)
            send_f[r], send_b[r] = n_f * p2p * (1 - hw.overlap), n_b * p2p * (1 - hw.overlap)
        p2p *= hw.overlap  # the fill / drain latency below: the rest is in the stages' times
    slow = max(f + b for f, b in zip(fwd, bwd))
    if pp == 1:
        pipe = m * (fwd[0] + bwd[0])
    elif sched == "interleaved":
        pipe = m * slow + (pp - 1) * slow / v + 2 * (pp - 1) * p2p
    elif sched == "zero-bubble":  # (the fill and drain: each stage's F and I)
        pipe = m * slow + (pp - 1) * max(f + b - w for f, b, w in zip(fwd, bwd, wgrad)) + \
            2 * (pp - 1) * p2p
    else:
        pipe = (m - 1) * slow + sum(fwd) + sum(bwd) + 2 * (pp - 1) * p2p

    def data_parallel_side(w):
        """(dp communication exposed, optimizer, offload copies, gradient accumulation)
        of rank `w`: each stage reduces, gathers and steps its own parameters, so the
        step waits on the rank with the most (a pipeline of unequal stages: DeepSeek-V3's
        first stage holds its embedding and dense layers, the others 20x the parameters
        in experts)."""
        mem = mems[w][0]
        elem = 4 if precision == "fp32" else 2
        n_elem = mem.params * (sdp if zero >= 3 else 1) / elem  # this rank's parameter elements
        share = _expert_share(rank_segs[w], tp)  # (of its elements before ep's split)
        if zero >= 3 and ep > 1:  # (ZeRO-3 priced every expert's shard: 1/ep of them are its)
            n_elem *= 1 - share * (1 - 1 / ep)
        # (an MoE's expert gradients computed from every dp rank's rows, gathered, are complete
        # on each rank: without ZeRO the dp pass reduces none of them. So under ep, and under
        # plain dp where the dispatch is not run on each rank's own rows)
        # With the all-to-all dispatch (ep over rows run on each rank) they are the ep group's
        # rows': summed over the dp ranks holding the same experts ("edp": dp / ep of them).
        # With ZeRO under ep the experts' are reduced and sharded over "edp" too, the rest over dp
        experts_elem = n_elem * share / ep / (1 - share * (1 - 1 / ep)) if share < 1 else n_elem
        n_reduced = n_elem - experts_elem if (zero == 0 and not stats.moe_local) or ep > 1 \
            else n_elem
        edp = dp // ep
        esdp = sdp // ep  # (ZeRO shards the experts over the "edp" ranks of a shard group)
        # the elements this rank's optimizer steps (ZeRO: its 1/dp shard of the others, 1/edp of
        # its experts; HSDP: 1/sdp and 1/esdp)
        stepped_elem = n_elem if not zero else (n_elem - experts_elem) / sdp + experts_elem / esdp \
            if ep > 1 else n_elem / sdp
        n_t = sum(s.n_param_tensors for s in rank_segs[w])
        dpc = dp_fixed = gather = 0.0
        if dp > 1:
            # as passes/data_parallel.py emits them: gradients in buckets of at least the cost
            # model's floor (ZeRO-3: one per layer); ZeRO-1 all-reduces each, ZeRO-2
            # reduce-scatters, and the runtime all-gathers the updated shards (exposed); ZeRO-3
            # gathers each layer's parameters before its forward and again before its backward
            grad_bytes = n_reduced * elem
            span = stride * dp  # (the dp group's ranks `stride` apart: core/plan.dp_stride)
            s_span = stride * sdp  # (HSDP's shard groups: neighbouring dp ranks)
            # Plan.comm_quantization (as the user gives it; a lossy choice the search never
            # makes): int8 + a 2-byte scale per block on the gathers, int4 + one on the
            # reduce-scatters' all-to-alls, and the (de)quantizing passes over the data
            # (the zero stage fits: above); under ep the experts' go over their own groups
            q_w, q_g = "weights" in quant, "gradients" in quant

            def wire(elems, nbytes, weights):
                if weights:
                    return elems * (1 + 2 / qcomm.BLOCK) if q_w else nbytes
                return elems * (0.5 + 2 / qcomm.GRAD_BLOCK) if q_g else nbytes
            wire_w, wire_g = wire(n_reduced, grad_bytes, True), wire(n_reduced, grad_bytes, False)
            buckets = (max(1, round(n_t * stats.zero3_reduce_scatters_per_param)) if zero >= 3
                       else max(1, min(n_t, int(grad_bytes // _bucket_floor(hw)))))
            if onebit:  # Plan.grad_compression after its warm-up (runtime/onebit_adam.py): no
                # gradient all-reduce; after the backward the momentum goes as signs + a 4-byte
                # scale per block, an all-to-all and an all-gather (each moving what a ring
                # all-gather moves), and ~12 memory-bound passes over it (fold, compress and
                # decompress twice, update)
                signs = n_elem * (1 / 8 + 4 / qcomm.ONEBIT_BLOCK)
                gather = 2 * hw.comm("all_gather", signs, dp, span) + \
                    12 * 4 * n_elem / hw.mem_bandwidth + 20 * n_t * hw_graph.node_overhead
            elif zero == 0 or zero == 1:
                dpc = hw.comm("all_reduce", grad_bytes, dp, span, calls=buckets)
            else:  # (qgZ: an all-to-all of the int4 parts)
                dpc = hw.comm("all_to_all" if q_g else "reduce_scatter", wire_g, sdp, s_span,
                              calls=buckets)
                # HSDP: each summed 1/sdp slice all-reduced across the replicas
                dpc += hw.comm("all_reduce", grad_bytes / sdp, reps, span, calls=buckets)
            if zero in (1, 2):  # after the optimizer: no backward left to hide it behind, and
                # each bucket copied back into its parameters (runtime/zero.py)
                gather = hw.comm("all_gather", grad_bytes, sdp, s_span, calls=buckets) + \
                    2 * grad_bytes / hw.mem_bandwidth
            if zero >= 3:  # (hpZ: the backward's from the secondary shards, within a node)
                gathers = round(n_t * stats.zero3_gathers_per_param / 2)
                dpc += m * hw.comm("all_gather", wire_w, sdp, s_span, calls=gathers)
                dpc += m * (hw.comm("all_gather", wire_w, hpz, stride * hpz, calls=gathers)
                            if hpz else hw.comm("all_gather", wire_w, sdp, s_span, calls=gathers))
            if ep > 1 and edp > 1 and (zero or all_to_all) and not onebit:
                # the experts' gradients over "edp" (all-reduced; ZeRO-2/3: reduce-scattered;
                # HSDP: over a shard group's "edp" ranks, then across the replicas), ZeRO-1/2's
                # gathers of their updated shards, ZeRO-3's of their weights
                e_bytes, e_calls = experts_elem * elem, max(1, round(sum(
                    s.n_moe for s in rank_segs[w])))
                if zero >= 2:  # (qgZ: an all-to-all of the int4 parts, as the dense ones')
                    dpc += hw.comm("all_to_all" if q_g else "reduce_scatter",
                                   wire(experts_elem, e_bytes, False), esdp, s_span,
                                   calls=e_calls) + \
                        hw.comm("all_reduce", e_bytes / esdp, reps, span, calls=e_calls)
                else:
                    dpc += hw.comm("all_reduce", e_bytes, edp, span, calls=e_calls)
                if zero in (1, 2):
                    gather += hw.comm("all_gather", e_bytes, esdp, s_span, calls=e_calls) + \
                        2 * e_bytes / hw.mem_bandwidth
                if zero >= 3:
                    dpc += 2 * m * hw.comm("all_gather", wire(experts_elem, e_bytes, True),
                                           esdp, s_span, calls=e_calls)
            # the loss (and the count of its targets), per microbatch
            dp_fixed = hw.comm("all_reduce", 4, dp, span, calls=m * stats.dp_loss_calls)
            # the activations gathered to every rank (ops with no split rule), per
            # microbatch: the whole microbatch's (mbs x dp of the traced rows), in the
            # activations' precision
            scale = mbs * dp / stats.rows * min(DTYPE_BYTES[precision], 4) / 4
            dp_fixed += m * hw.comm(
                "all_gather", sum(s.dp_gather_bytes for s in rank_segs[w]) * scale, dp, span,
                calls=round(sum(s.dp_gathers for s in rank_segs[w])))
            # quantizing: ~6 memory-bound passes over the fp32 values of what is sent and of
            # what arrives, and ~13 nodes each side of a collective
            if q_w:
                dp_fixed += 2 * m * (6 * 4 * n_elem * (1 + 1 / sdp) / hw.mem_bandwidth
                                     + 26 * gathers * hw_graph.node_overhead)
            if q_g:
                dp_fixed += 6 * 4 * 2 * n_elem / hw.mem_bandwidth + \
                    26 * buckets * hw_graph.node_overhead
            # the nodes the dp pass adds per parameter (packing, shard views; ZeRO-3's gathers
            # per microbatch): dispatch time, not hidden by the backward
            dp_fixed += n_t * stats.dp_nodes_per_param.get(3 if zero >= 3 else 0, 0.0) * (
                m if zero >= 3 else 1) * hw_graph.node_overhead
        # the backward hides the gradient reduction: one microbatch's (the joint graph's, or with
        # microbatches the last one's, which runs the "R" part inside it as its buckets fill:
        # runtime/pipeline.with_reductions). A pipeline stage's R runs after its last backward,
        # with nothing left to hide it behind (a ViT's dp=2 m=2 waited 26 ms on it where m=1
        # waited 6, before the reduction ran inside the last backward)
        window = bwd[0] * hw.overlap if constraints.get("overlap", True) and pp == 1 else 0.0
        dp_exposed = (max(dpc - window, dpc * 0.05) + gather + dp_fixed) if dp > 1 else 0.0
        k = OPTIMIZER_STATES.get(optimizer, 2)
        touched = stepped_elem * (3 + 2 * k) * 4
        n_tensors = sum(s.n_param_tensors for s in rank_segs[w])
        # CPU: one dispatch per op per tensor; CUDA: torch's multi-tensor (foreach / fused)
        # kernels, a few launches for all tensors (1.5 ms for GPT-2 small's AdamW on an H100)
        launches = (3 + 2 * k) * (1 if hw.async_launch else n_tensors)
        opt_t = touched / hw.mem_bandwidth + launches * hw.node_overhead
        if hw.optimizer_s is not None:  # measured on this machine for the whole model
            opt_t = hw.optimizer_s * stepped_elem / max(stats.total_params, 1)
        offload_s = 0.0
        if offload:  # Plan.offload_optimizer (runtime/host_optimizer.py): the stepped tensors'
            # fp32 gradients out and values back, not overlapped; on a GPU the step runs on the
            # host's CPU (torch's fused kernel: its memory bandwidth, shared by the node's ranks)
            stepped = stepped_elem * 4
            offload_s = 2 * stepped / (hw.host_link or hw.mem_bandwidth / 2)
            if hw.host_link:
                opt_t = touched / (hw.host_bandwidth or hw.mem_bandwidth) * min(
                    dp * tp * pp, hw.devices_per_node)
        # microbatches: every one after the first adds its gradients into the running sums
        # (runtime/pipeline.py: in the backward part's graph, one add per gradient)
        accumulate = (m - 1) * (3 * n_elem * elem / hw.mem_bandwidth
                                + n_tensors * hw_graph.node_overhead) if m > 1 else 0.0
        return dp_exposed, opt_t, offload_s, accumulate

    sides = {}  # per kind of rank (a shared weight's copy counts too)
    for r in range(pp):
        if kind(r) not in sides:
            sides[kind(r)] = data_parallel_side(r)
    dp_exposed, opt_t, offload_s, accumulate = max(sides.values(), key=sum)
    busy = m * sum(f + b for f, b in zip(fwd, bwd)) / pp
    waiting = min(sum(comm_s) / pp / busy, 1.0) if busy > 0 else 0.0
    if pp > 1:
        pipe = _on_shared_cores(pipe, busy, hw, waiting)
    step = pipe + dp_exposed + opt_t + offload_s + tied_s + accumulate + hw.step_overhead
    compute_only = m * max(f + b for f, b in zip(fwd, bwd))
    parts = {"compute": compute_only, "pipeline bubble": max(pipe - compute_only, 0.0),
             "dp communication": dp_exposed, "optimizer": opt_t}
    if tied_s:
        parts["tied weights' gradients"] = tied_s
    if accumulate:
        parts["gradient accumulation"] = accumulate
    if offload:
        parts["optimizer offload"] = offload_s
    model_flops = sum(s.flops_f + s.flops_b for s in stats.segments) * batch_scale(
        stats, mbs * m * dp)
    # MFU against a data sheet's peak only: a CPU's is a 512x512 matmul timed at start-up,
    # with the ranks sharing its cores - against it the demo printed 67% and 171%
    mfu = (None if hw.name == "cpu" else
           model_flops / (step * dp * tp * pp * hw.flops(precision)))
    plan = Plan(dp=dp, tp=tp, pp=pp, microbatches=m, schedule=sched, zero=zero,
                dp_shard=shard, hpz=hpz, ep=ep, cp=cp, cp_attention=cp_attention,
                pp_outer=pp_outer, remat="auto" if constraints.get("remat") == "auto" else remat,
                precision=precision, offload_optimizer=offload)
    for k2, given in constraints.items():  # every field the user fixed that is not searched
        if k2 not in SEARCHED:  # (e.g. codegen, max_grad_norm, offload, overlap)
            setattr(plan, k2, given)
    c = Candidate(plan, step, mems[worst][0], mfu, 1 - busy / pipe if pp > 1 else 0.0, parts,
                  recompute=max(r for _, r in mems))
    c.ctx = (fwd, bwd, p2p, pipe, v, waiting, (send_f, send_b), wgrad)
    return c


def _bucket_floor(hw) -> float:
    """The smallest gradient bucket passes/data_parallel.py makes on this device kind (it sizes
    buckets with core/cost.DeviceProfile, not the planner's calibrated numbers)."""
    return cost.min_bucket_bytes(cost.DeviceProfile.for_device(
        "cpu" if hw.name == "cpu" else "cuda"))


def batch_scale(stats, rows):
    return rows / stats.rows


def _on_shared_cores(makespan: float, busy: float, hw: cost.Hardware,
                     waiting: float = 0.0) -> float:
    """A pipeline's step where CPU ranks oversubscribe the cores (`Hardware.core_share` < 1):
    the stage times were measured with every rank busy, each at its share of the cores, but
    a rank waiting in a bubble hands its core to the others, so the step is the larger of
    the critical path at a whole core's speed and the ranks' mean compute time (all the work
    spread over all the cores). 4 ranks on 2 cores (benchmarks/planner_regret.py, Llama):
    pp=2 x dp=2 measured 0.74x dp=4's step, priced 1.30x by the makespan alone. `waiting`,
    the share of the ranks' busy time spent waiting on tp collectives (ranks arrive out of
    step; a pipeline transfer is work on the cores, not in it), is not faster for the free
    cores: ResNet's pp=2 x tp=2 on 4 ranks
    waited 1.5-4 ms per tp all-reduce with the other stage idle, and was priced 0.6x its
    step with that time halved too."""
    if hw.core_share >= 1:
        return makespan
    return max(busy * (1 - waiting),
               makespan * (1 - waiting) * hw.core_share + makespan * waiting)


def _alone_share(makespan: float, busy: float, world: int, hw: cost.Hardware) -> float:
    """A pipeline's step where a rank computes faster while fewer ranks are busy
    (`Hardware.alone_speedup`: one rank alone against all, CPU ranks on their own cores):
    the stage times are priced with every rank busy, so the makespan is scaled between the
    two by the ranks busy on average (world x the mean busy time / the makespan: the dp
    replicas for one microbatch, where the stages take turns; all with no bubble)."""
    if hw.alone_speedup <= 1 or world == 1 or makespan <= 0:
        return makespan
    together = min(max((world * busy / makespan - 1) / (world - 1), 0.0), 1.0)
    return makespan * (together + (1 - together) / hw.alone_speedup)


def _simulate(c: Candidate, stats, hw, stage_cache, precision):
    p = c.plan
    if p.pp == 1:
        c.simulated = True
        return
    fwd, bwd, p2p, pipe, v, waiting, sends, wgrad = c.ctx
    busy = p.microbatches * sum(f + b for f, b in zip(fwd, bwd)) / p.pp
    world = p.dp * p.tp * p.pp
    if hw.core_share < 1:
        # `waiting` is a share of all the busy time, the SENDs' included: of the rest's own
        sending = p.microbatches * sum(map(sum, sends)) / p.pp
        rest = min(waiting * busy / (busy - sending), 1.0) if busy > sending else waiting
        ms = _makespan_on_shared_cores(p.schedule, p.pp, p.microbatches, v, fwd, bwd, p2p,
                                       rest, world, hw.core_share, sends, wgrad)
    else:
        ms = _makespan(p.schedule, p.pp, p.microbatches, v, fwd, bwd, p2p, wgrad)
    ms = _alone_share(ms, busy, world, hw)
    c.step_s += ms - pipe
    c.bubble = 1 - busy / ms
    c.parts["pipeline bubble"] = max(ms - c.parts["compute"], 0.0)
    if c.mfu is not None:
        c.mfu *= (c.step_s - ms + pipe) / c.step_s
    c.simulated = True


# --- front doors ---------------------------------------------------------------------------------

def graph_stats(graph: tuple, rows: int, pass_extras: bool = False, precision: str = "fp32",
                kernel_cross_entropy: bool = False, heads: int | None = None) -> GraphStats:
    """The planner's statistics of a captured joint graph (`(gm, sig)`, from
    capture.capture_as_is: the planner captures nothing; compile's `planner_stats` does it for
    one) whose batch has `rows` rows. pass_extras: also count what the tp and dp passes add
    (`count_pass_extras`; a few seconds; CPU planning). precision "bf16"/"fp16": the
    segments are those of the graph after the precision pass (`_as_run`), whose saved values
    are not all half: halving the fp32 graph's put a GPT's bf16 step memory at 0.6x the CUDA
    allocator's peak. kernel_cross_entropy (a GPU job with the fusion pass,
    `kernel_cross_entropy`): the segments are those of the graph with fxpar's cross-entropy
    kernel in place, which saves the half logits and a row value rather than fp32
    log-probabilities (without it a GPT-2's bf16 step memory was priced 1.32x the H200's
    measured peak). Everything else (node_segment, the tp roles...) is the captured graph's,
    on which the probes run. heads: the model's attention heads (its config's), where known.
    """
    gm, sig = graph
    gm = _as_every_plan_runs(gm, precision)
    roles, refusal = tp_roles(gm, sig)
    stats = analyze(gm, rows, roles)
    stats.tp_refusal = refusal
    if refusal and log_rank() == 0:
        log.info("planner: no tensor-parallel plan: %s", refusal)
    if precision != "fp32" or kernel_cross_entropy:
        _as_run(stats, gm, sig, rows, precision, roles, kernel_cross_entropy)
    stats.mutated_buffers = not all(summed_buffer_updates(gm, sig))  # (sums: exact)
    stats.microbatch_refusal = data_parallel.microbatch_refusal(gm)
    stats.checkpoints_per_layer = checkpoints_per_layer(gm)
    stats.host_calls_compiled = codegen.host_calls(gm.graph)
    expert_stats(stats, gm)
    context_stats(stats, gm)
    stats.cp_probe = functools.cache(functools.partial(cp_probe, stats, gm, sig))
    stats.graph = (gm, sig)  # for the probes and the calibration
    if pass_extras:
        count_pass_extras(stats)
    if isinstance(heads, int):
        stats.heads = heads
    return stats


def _as_every_plan_runs(gm, precision: str):
    """The captured graph as the first pass makes it on every plan: experts that pick their
    weights per row run grouped (passes/batched_experts), and so are priced (and found by
    expert parallelism) as they run; the compile reusing the capture has nothing left to
    group."""
    if not batched_experts.CONTRACT.finds(gm):
        return gm
    device = next((n.meta[ir.VAL].device for n in gm.graph.nodes if n.op == "placeholder"
                   and isinstance(n.meta.get(ir.VAL), torch.Tensor)), None)
    return batched_experts.run(gm, batched_experts.Options(precision),
                               types.SimpleNamespace(device=device))


def expert_stats(stats: GraphStats, gm) -> None:
    """What Plan.ep changes, per segment, from the MoE layers expert parallelism finds on the
    captured graph (passes/expert_parallel.find_layers, find_dense_layers for experts that
    run every token, and find_expert_lists for experts kept as an nn.ModuleList): their
    expert weights, the FLOPs of their matmuls, the bytes of the rows moved over the ep
    group where they leave a layer; and each layer's expert count. A graph whose experts
    the pass cannot split gets the reason (no ep plan is priced)."""
    try:
        layers = expert_parallel.find_layers(gm)
        lists = find_expert_lists(gm)
        dense = expert_parallel.find_dense_layers(gm)
    except Exception as e:  # noqa: BLE001 - no ep plan is priced; the reason is kept
        stats.ep_refusal = f"{type(e).__name__}: {e}"
        return
    by_name = {s.name: s for s in stats.segments}
    counts = []
    for lst in lists:  # nn.ModuleList experts: each rank runs E/ep of them on every row (the
        # rows whole on every dp rank, as without ep), picking its experts' rows (a copy)
        # and all-gathering their results over the ep group (priced as the all-reduce of
        # the gathered-rows layers below: as many bytes leave)
        first = lst.experts[0]
        seg = by_name.get(stats.node_segment.get(next(iter(first.region)).name))
        if seg is None:
            continue
        counts.append(len(lst.experts))
        seg.n_moe += 1
        try:
            why = grouped_experts.why_not(lst)
            saved = 0.0 if why else 1 - 1 / len(lst.experts)
            stats.ep_slots = stats.ep_slots or not saved
            if lst.stacks and why:  # (passes/expert_parallel refuses them)
                stats.ep_refusal = stats.ep_refusal or (
                    f"the stacked experts of {lst.module!r} do not run grouped under ep: "
                    f"{why}")
        except Exception as e:  # noqa: BLE001 - priced as traced (the pass would fall back)
            log.debug("planner: could not tell whether %s runs grouped: %s", lst.module, e)
            saved = 0.0
            stats.ep_slots = True
        for x in lst.experts:
            seg.expert_params += sum(p.meta[ir.VAL].numel() for p in x.params.values())
            # (split by tp where the tp probe splits each of its matrices: tp=1 each a whole)
            split = all(stats.tp_roles.get(weight_fqn(p), "replicated") != "replicated"
                        for p in x.params.values() if p.meta[ir.VAL].dim() == 2)
            for n in x.region:
                if n.meta.get(ir.REGION) == ir.FORWARD:
                    seg.expert_flops_f += cost.node_flops(n)
                    seg.expert_flops_f_split += cost.node_flops(n) if split else 0.0
                    seg.grouped_saved_f += saved * cost.node_flops(n)
                else:
                    seg.expert_flops_b += cost.node_flops(n)
                    seg.expert_flops_b_split += cost.node_flops(n) if split else 0.0
                    seg.grouped_saved_b += saved * cost.node_flops(n)
            if saved and not lst.stacks:  # (grouped: each weight stacked forward and
                # backward, read + written; a stacked list's are read as they are)
                seg.grouped_stack_bytes += 2 * sum(cost.tensor_bytes(p.meta[ir.VAL])
                                                   for p in x.params.values())
            for y in x.leaving:
                fwd = y.meta.get(ir.REGION) == ir.FORWARD
                seg.ep_comm_f += cost.tensor_bytes(y.meta[ir.VAL]) if fwd else 0
                seg.ep_comm_b += 0 if fwd else cost.tensor_bytes(y.meta[ir.VAL])
            for y in x.entering:  # (the pick's copy: read + write)
                fwd = y.meta.get(ir.REGION) == ir.FORWARD
                seg.ep_bytes_f += 2 * cost.tensor_bytes(y.meta[ir.VAL]) if fwd else 0
                seg.ep_bytes_b += 0 if fwd else 2 * cost.tensor_bytes(y.meta[ir.VAL])
        moved = [(y, 2) for y in first.entering] + [(y, 2 + 2 * len(lst.experts))
                                                    for y in first.leaving]
        for y, passes in moved if saved else ():  # (the rows' gather in expert order; each
            # leaving value's gather back and its masked copy per expert)
            nbytes = passes * cost.tensor_bytes(y.meta[ir.VAL])
            if y.meta.get(ir.REGION) == ir.FORWARD:
                seg.grouped_bytes_f += nbytes
            else:
                seg.grouped_bytes_b += nbytes
    for layer in layers:
        seg = by_name.get(stats.node_segment.get(layer.offs.name) or
                          stats.node_segment.get(layer.matmuls[0].name))
        if seg is None:
            continue
        counts.append(layer.offs.meta[ir.VAL].numel())
        seg.n_moe += 1
        seg.expert_params += sum(w.meta[ir.VAL].numel() for w in layer.weights)
        # (split by tp where the tp probe splits every stack of the layer: expert tp)
        split = all(stats.tp_roles.get(w.meta.get(ir.FQN), "replicated") != "replicated"
                    for w in layer.weights)
        for m in layer.matmuls:
            if m.meta.get(ir.REGION) == ir.FORWARD:
                seg.expert_flops_f += cost.node_flops(m)
                seg.expert_flops_f_split += cost.node_flops(m) if split else 0.0
            else:
                seg.expert_flops_b += cost.node_flops(m)
                seg.expert_flops_b_split += cost.node_flops(m) if split else 0.0
        # what the rewrite adds: each entering row tensor gathered (read + write), each
        # leaving one gathered back and masked (4 passes), each grouped matmul's rows masked
        # (read + write)
        # (the rows entering the layer that the backward reads too: an ep rank keeps the
        # rows it received of them)
        seg.ep_saved += sum(cost.tensor_bytes(n.meta[ir.VAL]) for n, r in (
            *layer.region.items(), *((x, 0) for x in layer.entering))
                            if r is not None and n.meta.get(ir.REGION) == ir.FORWARD
                            and isinstance(n.meta.get(ir.VAL), torch.Tensor)
                            and any(u.meta.get(ir.REGION) == ir.BACKWARD for u in n.users))
        for nodes, passes in ((layer.entering, 2), (layer.leaving, 4),
                              ([m for m in layer.matmuls if layer.region[m] == 0], 2)):
            for y in nodes:
                nbytes = cost.tensor_bytes(y.meta[ir.VAL])
                fwd = y.meta.get(ir.REGION) == ir.FORWARD
                if nodes is layer.leaving:
                    if fwd:
                        seg.ep_comm_f += nbytes
                    else:
                        seg.ep_comm_b += nbytes
                if fwd:
                    seg.ep_bytes_f += passes * nbytes
                else:
                    seg.ep_bytes_b += passes * nbytes
    for layer in dense:  # experts that run every token: each rank's tokens sent to the
        # experts' ranks and back by equal all-to-alls (priced as the routed rows' are, none
        # received beyond those sent), a rank running its E/ep experts on ep x its tokens
        seg = by_name.get(stats.node_segment.get(layer.matmuls[0].name))
        if seg is None:
            continue
        counts.append(layer.experts)
        seg.n_moe += 1
        seg.expert_params += sum(w.meta[ir.VAL].numel() for w in layer.weights)
        split = all(stats.tp_roles.get(w.meta.get(ir.FQN), "replicated") != "replicated"
                    for w in layer.weights)
        for m in layer.matmuls:
            part = "f" if m.meta.get(ir.REGION) == ir.FORWARD else "b"
            setattr(seg, f"expert_flops_{part}",
                    getattr(seg, f"expert_flops_{part}") + cost.node_flops(m))
            if split:
                setattr(seg, f"expert_flops_{part}_split",
                        getattr(seg, f"expert_flops_{part}_split") + cost.node_flops(m))
        for y, _ in layer.leaving:
            if y.meta.get(ir.REGION) == ir.FORWARD:
                seg.ep_comm_f += cost.tensor_bytes(y.meta[ir.VAL])
            else:
                seg.ep_comm_b += cost.tensor_bytes(y.meta[ir.VAL])
    stats.expert_counts = tuple(counts)
    stats.moe_local = bool(layers or lists or dense) and (
        not (layers or lists) or _dispatch_is_local(gm, layers, lists))
    if stats.moe_local:
        return
    for seg in stats.segments:  # a dp rank runs the experts on every rank's rows (gathered):
        # work dp does not split, at least this much where no dp probe counted it
        seg.flops_f_whole = max(seg.flops_f_whole, seg.expert_flops_f)
        seg.flops_b_whole = max(seg.flops_b_whole, seg.expert_flops_b)


def _dispatch_is_local(gm, layers, lists=()) -> bool:
    """Whether the dp pass runs every MoE layer's dispatch on each rank's own rows (for
    experts kept as an nn.ModuleList: the rows each reads through its routing's padded
    positions, compiler/padded_nonzero's)."""
    try:
        found = batch_local_dispatch(gm, 2)
    except Exception as e:  # noqa: BLE001 - priced as gathered, as the pass would fall back
        log.debug("planner: the MoE dispatch could not be analysed: %s", e)
        return False
    return all(m in found for layer in layers for m in layer.matmuls) and all(
        y in found for lst in lists for x in lst.experts for y in x.entering
        if y.meta.get(ir.REGION) == ir.FORWARD)  # (the backward's: the same positions')


def context_stats(stats: GraphStats, gm) -> None:
    """What Plan.cp changes, per segment, from the captured graph: the sequence length it
    splits (passes/context_parallel.sequence_dims: why not, where it cannot), and each
    attention's FLOPs and the bytes of its keys/values (what the cp pass gathers) and of
    its queries/output."""
    leaves = [n for n in gm.graph.nodes
              if n.op == "placeholder" and n.meta.get(ir.ROLE) == "batch"]
    try:
        dims = context_parallel.sequence_dims(leaves, 1)
        stats.seq = next(n.meta[ir.VAL].shape[1] for n, d in zip(leaves, dims) if d is not None)
    except Exception as e:  # noqa: BLE001 - no cp plan is priced; the reason is kept
        stats.cp_refusal = f"{type(e).__name__}: {e}"
        return
    by_name = {s.name: s for s in stats.segments}
    for n in gm.graph.nodes:
        bwd = n.target in context_parallel.ATTENTION_BACKWARD
        if n.target not in context_parallel.ATTENTION and not bwd:
            continue
        seg = by_name.get(stats.node_segment.get(n.name))
        if seg is None:
            continue
        off = 1 if bwd else 0  # (the backward's first argument: the output's gradient)
        q, k, v = (a.meta[ir.VAL] for a in n.args[off:off + 3])
        whole = not context_parallel.splits_attention(n)  # (every rank runs it whole)
        if not bwd and stats.ring_refusal is None:  # (self-attention: q, k, v of the sequence)
            self_attention = q.shape[2] == k.shape[2] == v.shape[2] == stats.seq
            why = "it runs whole (no rule splits it)" if whole else context_parallel.ring_refusal(
                n, normalize_function(n.target, tuple(n.args), dict(n.kwargs),
                                      normalize_to_only_use_kwargs=True).kwargs, self_attention)
            if why:
                stats.ring_refusal = (f"the attention {n.name} (module "
                                      f"{n.meta.get(ir.MODULE, '')!r}) cannot go around the "
                                      f"ring: {why}")
        if bwd:
            seg.attn_flops_b += cost.node_flops(n)
            seg.sdpa_flops_b += cost.node_flops(n) * whole
            continue
        seg.n_attn += 1
        seg.attn_flops_f += cost.node_flops(n)
        seg.sdpa_flops_f += cost.node_flops(n) * whole
        seg.kv_bytes += cost.tensor_bytes(k) + cost.tensor_bytes(v)
        seg.qo_bytes += 2 * cost.tensor_bytes(q)
    for n in gm.graph.nodes:  # attention written out: scores = q @ k^T, softmax, @ v
        if n.target is aten._softmax.default and n.meta.get(ir.REGION) == ir.FORWARD and \
                n.meta[ir.VAL].shape[-1] == stats.seq:
            scores = _along(n, up=True)
            probs = _along(n, up=False)
            seg = by_name.get(stats.node_segment.get(n.name))
            if scores is None or probs is None or seg is None:
                continue
            seg.n_attn += 1
            stats.ring_refusal = stats.ring_refusal or (
                f"the attention of module {n.meta.get(ir.MODULE, '')!r} is written out as "
                "matmuls and a softmax (ring attention takes SDPA's kernels)")
            seg.attn_flops_f += cost.node_flops(scores) + cost.node_flops(probs)
            seg.attn_flops_b += 2 * (cost.node_flops(scores) + cost.node_flops(probs))
            seg.kv_bytes += cost.tensor_bytes(scores.args[-1].meta[ir.VAL]) + \
                cost.tensor_bytes(probs.args[-1].meta[ir.VAL])
            seg.qo_bytes += 2 * cost.tensor_bytes(scores.args[-2].meta[ir.VAL])


def cp_probe(stats: GraphStats, gm, sig) -> CpProbe:
    """The cp pass run at cp=2 on copies of the graph (listed experts grouped first, as
    passes/grouped_experts runs them), keys and values gathered and, where every attention
    can, as ring attention: where it runs the MoE layers' experts (their forward matmuls on
    fewer rows than traced: each rank's own tokens; else the cp group's whole tokens: cp
    splits none of their work), and what a rank keeps for the backward beyond its share
    of the layers' saved values (CpProbe; graph_stats defers this probe to the search's
    first cp plan). Both graphs are the fp32 capture's: in half precision the ratio prices
    the copies at fp32's share of the saved values (over, not under)."""
    if stats.cp_refusal or not stats.seq or stats.seq % 4:
        return CpProbe()
    lists = find_expert_lists(gm) if stats.expert_counts else []
    base = (_on_copy(grouped_experts, gm, sig, {}, 1) or gm) if lists else gm
    kv = sum(s.kv_bytes for s in stats.segments)
    runs = {}
    with quiet_probe(context_parallel.__name__):  # (the job's own pass warns, not a probe)
        for attention in ("gather",) + (() if stats.ring_refusal else ("ring",)):
            runs[attention] = _on_copy(context_parallel, base, sig,
                                       {"dp": 2, "cp": 2, "cp_attention": attention}, 2)
    beyond = {}
    try:
        whole = _layers_saved(analyze(base, stats.rows))
        for attention, g in runs.items():
            # a rank holds half the tokens at cp=2: half the traced saved values, the keys
            # and values whole where gathered (half of them beyond its share), and what is
            # left, per byte of its share (the layers' alone: an LM head's logits, a large
            # part of a shallow trace's saved values, keep none)
            left = (_layers_saved(analyze(g, stats.rows)) if g is not None else 0.0) \
                - whole / 2 - (kv / 2 if attention == "gather" else 0.0)
            beyond[attention] = max(left, 0.0) * 2 / whole if g is not None and whole else 0.0
    except Exception as e:  # noqa: BLE001 - priced as the whole keys and values alone
        log.debug("planner: the cp probe's statistics failed: %s", e)
    names = {n.name for lst in (lists if base is gm else find_expert_lists(base))
             for x in lst.experts for n in x.region}
    return CpProbe(moe_cp_whole=_experts_whole(stats, base, names, runs.get("gather")),
                   **beyond)


def _layers_saved(stats: GraphStats) -> float:
    return sum(s.saved for s in stats.layers)


def _experts_whole(stats: GraphStats, base, listed: set, split) -> bool:
    """Whether the cp pass's graph `split` runs some expert's forward matmuls (grouped, or
    those of the `listed` experts' nodes) on as many rows as the traced graph `base` does
    (None: the pass cannot split this graph)."""
    if not stats.expert_counts:
        return False
    fwd = {n.name: n.meta[ir.VAL].shape[0] for n in base.graph.nodes
           if n.meta.get(ir.REGION) == ir.FORWARD and (
               n.target is aten._grouped_mm.default and n.meta[ir.VAL].dim() == 2
               or n.name in listed and n.target in (aten.mm.default, aten.addmm.default))}
    return bool(fwd) and (split is None or any(
        n.meta[ir.VAL].shape[0] >= fwd[n.name] for n in split.graph.nodes if n.name in fwd))


_BMMS = {aten.bmm.default, aten.baddbmm.default}


def _along(n, up: bool, hops: int = 8):
    """The batched matmul a softmax reads (up: its scores, through a mask, a scale, views)
    or that reads it (down: probabilities @ v, through dropout and views); None if none."""
    for _ in range(hops):
        if up:
            ins = [a for a in n.all_input_nodes if isinstance(a.meta.get(ir.VAL), torch.Tensor)
                   and a.meta[ir.VAL].dim() >= 3]
            n = max(ins, key=lambda a: a.meta[ir.VAL].numel(), default=None)
        else:
            outs = [u for u in n.users if u.meta.get(ir.REGION) == ir.FORWARD]
            mm = next((u for u in outs if u.target is aten.bmm.default and u.args[0] is n),
                      None)
            if mm is not None:
                return mm
            first = [u for u in outs if u.target is operator.getitem and u.args[1] == 0]
            n = first[0] if first else outs[0] if len(outs) == 1 else None  # (dropout's mask)
        if n is None:
            return None
        if up and n.target in _BMMS:
            return n
    return None


def tp_roles(gm, sig) -> tuple[dict | None, str | None]:
    """Each linear weight's role under tensor parallelism, as the tensor_parallel pass decides
    it (at tp=2, on a copy): the split the planner prices; or (None, why) where the pass
    cannot decide on this graph (no tp plan is priced then: the search names why)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            roles = tensor_parallel.roles(gm, sig)
            roles.update(_grouped_stack_roles(gm, sig))
            return roles, None
    except Exception as e:  # noqa: BLE001 - the pass's own reason, shown by the search
        log.debug("planner: tensor_parallel.roles failed on this graph: %s", e)
        return None, f"the tensor_parallel pass cannot split this graph ({type(e).__name__}: " \
            f"{str(e).splitlines()[0][:200] if str(e) else ''})"


def _grouped_stack_roles(gm, sig) -> dict:
    """The tp roles of stacked experts read one by one (Hugging Face's eager experts, DBRX):
    tp splits them in the grouped form passes/grouped_experts makes of them before it, so
    their roles are decided on that form (on the traced one no linear reads the stack)."""
    stacks = {weight_fqn(stack) for lst in find_expert_lists(gm)
              for stack, _ in lst.stacks.values()}
    if not stacks:
        return {}
    grouped = _on_copy(grouped_experts, gm, sig, {}, 1)
    if grouped is None:
        return {}
    return {k: r for k, r in tensor_parallel.roles(grouped, sig).items() if k in stacks}


def checkpoints_per_layer(gm) -> int:
    """How many of remat="sqrt"'s checkpoint candidates (the forward's cut vertices on the
    input->loss path) lie in a typical layer: 2 in a pre-norm transformer block (after the
    attention's and after the MLP's residual add), so "sqrt" spaces checkpoints over 2n
    half-layers, not n layers (priced per layer it was 1.5x the measured memory)."""
    import statistics
    try:
        cands = remat.chain_candidates(gm)
    except Exception:  # noqa: BLE001 - no candidates: layer boundaries only
        return 1
    per = {}
    for n in cands:
        k = layer_key(n.meta.get(ir.MODULE, ""))
        if k is not None:
            per[k] = per.get(k, 0) + 1
    return max(1, round(statistics.median(per.values()))) if per else 1


def _on_copy(pass_, gm, sig, plan: dict, world: int, **ctx):
    """`pass_` run on a copy of the captured graph (the planner counts what a pass makes
    without compiling a job), or None where it cannot transform this model. The pass's
    warnings are the chosen plan's to give (the job's own passes repeat them), not a probe's."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pass_.run(torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)),
                             resolve(plan, world), PassContext(signature=sig, **ctx))
    except Exception as e:  # noqa: BLE001 - the pass itself reports it when the job runs
        log.debug("planner: %s on a copy of the graph failed: %s", pass_.__name__, e)
        return None


def kernel_cross_entropy(device, constraints: dict | None) -> bool:
    """Whether the job's fusion pass puts fxpar's cross-entropy kernel in the graph: on a GPU
    with Triton, unless Plan.fuse is off (under either codegen: Inductor calls the kernel)."""
    return torch.device(device).type == "cuda" and (constraints or {}).get("fuse", True) \
        is not False and fusion.unavailable_reason(device) is None


def _as_run(stats, gm, sig, rows, precision, roles, kernel_ce) -> None:
    """Replace the segments' activation and traffic statistics by those of the graph the
    passes make of `gm`: the precision pass's for bf16/fp16 (the residual stream, norms'
    statistics, softmax and the loss stay fp32; matmul inputs and outputs are half;
    parameters keep their traced fp32 master counts), then, `kernel_ce`, with the fusion
    pass's cross-entropy kernel in place (on a copy). A graph the precision pass cannot
    rewrite keeps the fp32 statistics, halved later."""
    g = gm
    if precision != "fp32":
        g = _on_copy(precision_pass, gm, sig, {"precision": precision}, 1)
        if g is None:  # the pass itself reports why when the job runs; fp32's halved here
            return
    if kernel_ce:
        g = torch.fx.GraphModule(g, copy.deepcopy(g.graph))
        fusion.cross_entropy_for_inductor(g, triton=True)
    ran = analyze(g, rows, roles)
    if [s.name for s in ran.segments] != [s.name for s in stats.segments]:
        return
    stats.segments, stats.transient = ran.segments, ran.transient
    if precision != "fp32":
        stats.activations_precision = precision


def count_pass_extras(stats: GraphStats, share=None) -> None:
    """What the passes add to the graph that the planner prices per plan, counted by running
    them once on copies of the graph: tensor_parallel at tp=2 (collectives beyond one per
    row/column linear -- a vocab-parallel loss's max, sum of exponentials, target logit --,
    the nodes it adds, and per segment the FLOPs and bytes it really splits, which replace
    the statistics' split parts, followed from the linears' roles), data_parallel at dp=2
    with ZeRO-0 and ZeRO-3 (nodes it adds per parameter: bucket packing, shard views,
    gathers). Neither count depends on the degree. On a small CPU job every collective
    costs a millisecond and every node tens of microseconds, so they matter; on GPUs they
    are noise. A pass that cannot run on the graph adds nothing here (the planner then
    keeps the statistics' counts).
    `share(jobs)`: runs some of the three probes on this rank and returns every probe's
    result (autoplan spreads them over the ranks, which would each run all three alike)."""
    gm, sig = stats.graph
    c10d = torch.ops._c10d_functional

    def calls(g):
        return [n for n in g.graph.nodes if n.op == "call_function"]

    def run(pass_, plan):
        return _on_copy(pass_, gm, sig, plan, 2, group_names={"tp": "tp", "dp": "dp"})
    base = len(calls(gm))
    n_params = max(sum(s.n_param_tensors for s in stats.segments), 1)

    def tp_probe():
        if not any(s.n_row or s.column_out for s in stats.segments):
            return {}
        g = run(tensor_parallel, {"tp": 2, "dp": 1})
        if g is None:
            return {}
        modeled = sum(s.n_row + len(s.column_out) for s in stats.segments)
        n = calls(g)
        # what the pass split, per segment: at tp=2 a split op does half its work, so the
        # split part is twice what the rank no longer does (a linear the pass keeps whole
        # -- a head tp does not divide, attention under dropout -- counts as whole). Also
        # the saved values and working memory, where the statistics are the traced graph's
        # as the probe's are (not the precision pass's): followed from the roles alone, a
        # vocab-parallel loss's working memory was left whole (tp=2 plans were priced
        # 1.15-1.31x what they allocate)
        at2 = {x.name: x for x in analyze(g, stats.rows).segments}
        fields = TP_SPLIT if not stats.activations_precision else TP_SPLIT[:4]
        split = {}
        for seg in stats.segments:
            x = at2.get(seg.name)
            if x is not None:
                split[seg.name] = tuple(
                    min(max(2 * (getattr(seg, f) - getattr(x, f)), 0.0), getattr(seg, f))
                    for f in fields)
        return {"tp_calls_extra": max(sum(1 for x in n if x.target in cost.COLLECTIVES)
                                      - modeled, 0),
                "tp_nodes_extra": max(len(n) - base, 0), "tp_split": split}

    def dp_probe(zero):  # (counts: the graph's meta["val"] is not refreshed by the pass)
        g = _on_copy(data_parallel, gm, sig, {"dp": 2, "zero": zero}, 2,
                     group_names={"tp": "tp", "dp": "dp"}, fresh_values=False)
        if g is None:
            return {}
        out = {"dp_nodes_per_param": (zero, max(len(calls(g)) - base, 0) / n_params)}
        if zero == 0:  # per-microbatch all-reduces: the loss (and its target count)
            out["dp_loss_calls"] = sum(1 for x in calls(g) if x.target is
                                       c10d.all_reduce.default and not x.meta.get(ir.BUCKET))
            try:  # (a rank's values: what the dp=2 graph really computes per op)
                fake_propagate(g, check=False)
                out["dp_whole"] = _unsplit_by_dp(gm, g, stats.node_segment)
                out["dp_bucket_bytes"] = max(
                    (cost.tensor_bytes(x.args[0].meta[ir.VAL]) for x in calls(g)
                     if x.target is c10d.all_reduce.default and x.meta.get(ir.BUCKET)),
                    default=None)
                gathered: dict = {}  # segment -> [calls, bytes]
                for x in calls(g):
                    if x.target is c10d.all_gather_into_tensor.default and \
                            not x.meta.get(ir.BUCKET):  # (in its first reader's segment)
                        seg = next((stats.node_segment[u.name] for w in x.users
                                    for u in (w, *w.users) if u.name in stats.node_segment),
                                   stats.segments[-1].name)
                        got = gathered.setdefault(seg, [0, 0.0])
                        got[0] += 1
                        got[1] += cost.tensor_bytes(x.meta[ir.VAL])
                out["dp_gathers"] = gathered
            except Exception as e:  # noqa: BLE001 - priced as halving, as before the probe
                log.debug("planner: the dp graph's values could not be propagated: %s", e)
        else:  # one collective per layer (and direction, for the gathers)
            out["zero3_gathers_per_param"] = sum(
                1 for x in calls(g) if x.target is c10d.all_gather_into_tensor.default
            ) / n_params
            out["zero3_reduce_scatters_per_param"] = sum(
                1 for x in calls(g) if x.target is c10d.reduce_scatter_tensor.default
            ) / n_params
        return out
    # heaviest first (runtime/machine.shared_over_ranks): the tp pass places every op; the two dp probes
    # ask DTensor the same batch-splitting questions, answered once (sharding's memo)
    jobs = [tp_probe, lambda: dp_probe(0), lambda: dp_probe(3)]
    results = share(jobs) if share is not None else [job() for job in jobs]
    for found in results:
        for k, v in found.items():
            if k == "tp_calls_extra":
                stats.segments[-1].tp_calls_extra = v
            elif k == "tp_split":  # the time statistics of what the pass really splits
                for seg in stats.segments:
                    if seg.name in v:
                        for f, x in zip(TP_SPLIT, v[seg.name]):
                            setattr(seg, f + "_split", x)
            elif k == "dp_whole":
                for seg in stats.segments:
                    if seg.name in v:
                        (seg.flops_f_whole, seg.flops_b_whole, seg.bytes_f_whole,
                         seg.bytes_b_whole, seg.saved_whole) = v[seg.name]
            elif k == "dp_nodes_per_param":
                stats.dp_nodes_per_param[v[0]] = v[1]
            elif k == "dp_gathers":
                for seg in stats.segments:
                    seg.dp_gathers, seg.dp_gather_bytes = v.get(seg.name, (0, 0.0))
            else:
                setattr(stats, k, v)


def _unsplit_by_dp(gm, g, node_segment: dict) -> dict:
    """Per segment, (forward FLOPs, backward FLOPs, forward bytes, backward bytes, saved
    bytes) of the captured graph `gm`'s ops that the dp pass's graph `g` (dp=2, its values
    propagated) does not halve: what a rank runs on the gathered batch (an MoE's routed
    expert matmuls when their routing is not batch-local) and keeps of it for the backward,
    and parameter-sized work (a dense embedding gradient). Each op counts its work beyond
    half: 2 x its dp=2 cost - its whole cost. The dp pass's own ops (gradient packing) are
    priced with it, per parameter, not here."""
    base = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    out: dict = {}
    mine = {(k[0].name, k[1]): saved_bytes(k) for k in saved_values(
        [n for n in g.graph.nodes if n.meta.get(ir.REGION) == ir.FORWARD])}
    for k in saved_values([n for n in gm.graph.nodes if n.meta.get(ir.REGION) == ir.FORWARD]):
        seg = node_segment.get(k[0].name)
        if seg is not None and (k[0].name, k[1]) in mine:
            whole, b = out.setdefault(seg, [0.0] * 5), saved_bytes(k)
            whole[4] += min(max(2 * mine[(k[0].name, k[1])] - b, 0), b)
    for n in g.graph.nodes:
        b = base.get(n.name)
        seg = node_segment.get(n.name)
        if b is None or seg is None or b.target is not n.target:
            continue
        fl, fw = cost.node_flops(n), cost.node_flops(b)
        by = 0 if fl else sum(cost.node_bytes(n))
        bw = 0 if fw else sum(cost.node_bytes(b))
        whole = out.setdefault(seg, [0.0] * 5)
        k = 0 if b.meta.get(ir.REGION) == ir.FORWARD else 1
        whole[k] += min(max(2 * fl - fw, 0), fw)
        whole[2 + k] += min(max(2 * by - bw, 0), bw)
    return {k: tuple(v) for k, v in out.items()}


def microbatches_allowed(stats: GraphStats, constraints: dict) -> bool:
    """Whether microbatches train as one step does: not where buffers update per microbatch
    (BatchNorm's statistics) or the loss's microbatch means cannot be weighted to the batch
    mean, unless the user asked for per-microbatch statistics (Plan.batch_stats)."""
    return constraints.get("batch_stats", "whole") != "whole" or not (
        stats.mutated_buffers or stats.microbatch_refusal)


def smallest_call_rows(stats: GraphStats, world: int, constraints: dict | None = None
                       ) -> int | None:
    """The fewest rows of the batch any plan the search considers runs the graph on: one (a
    microbatch of one row), or where microbatches are not allowed (`microbatches_allowed`)
    the batch over the world's dp ranks; None where every plan runs the whole batch."""
    rows = stats.rows
    if microbatches_allowed(stats, constraints or {}):
        return 1 if rows > 1 else None
    return rows // world if world > 1 and rows % world == 0 else None


def smallest_call_tokens(stats: GraphStats, world: int) -> int | None:
    """Where no plan calls the graph on fewer rows (`smallest_call_rows` None: one row, or
    rows dp cannot split), the fewest tokens of the sequence a plan runs it on: cp's share
    at the largest cp dividing the world (it divides dp) that splits the sequence; None
    where cp cannot split it."""
    if stats.seq is None or stats.cp_refusal is not None:
        return None
    cps = [c for c in range(2, world + 1) if world % c == 0 and stats.seq % (2 * c) == 0]
    return stats.seq // max(cps) if cps else None


def fit_to_timing(hw: cost.Hardware, stats: GraphStats, t_graph: float, spread: float,
                  optimizer_s: float | None, t_alone: float | None = None,
                  t_small: float | None = None, small_rows: int | None = None,
                  small_tokens: int | None = None) -> cost.Hardware:
    """CPU: the model's own joint graph timed on the example batch with every rank busy
    (t_graph seconds, varying by `spread`), on one rank alone (t_alone), on a smaller input
    (t_small: at `small_rows` rows, the fewest a plan runs it on, `smallest_call_rows`; or
    at `small_tokens` tokens of each sequence, `smallest_call_tokens`), and its optimizer
    step (runtime/machine.time_model).

    The two sizes split the graph's time into a part that scales with the work a plan gives
    a call (priced as the ops' roofline times `roofline_scale`, so it also shrinks with the
    tp and cp splits) and a part each call pays whatever its size (priced per node: dispatch,
    and ops whose cost does not follow their size, as an MoE's routing). One timing cannot
    tell them apart: all of it per node priced each of a pipeline's microbatches the whole
    graph again, all of it per row priced a microbatch of an MoE at a fraction of what it
    takes, and a one-row batch's tp and cp plans at what a whole call takes, per node
    (docs/benchmarks.md, "Regret"). The second size is the smallest a plan calls: the line
    between the two then prices every size by interpolation, and the per-call part, (R
    t_small - r t_graph) / (R - r) at r of R rows, carries the timings' noise scaled by
    R / (R - r) rather than 3x at half the rows (r = R / 2: the per-call part of the same
    model came out 7 us or 122 us a node from run to run). Fewer tokens shrink attention's
    FLOPs quadratically, the rest linearly (eager attention's score traffic too, an
    approximation): the line is drawn through the two sizes' rooflines.
    Without t_small it is all per node."""
    # plans predicted closer than the graph's own timing varies are a tie (planner.rank),
    # at most 5%: a tie costs at most that over the fastest prediction (half the 10% regret
    # target; a wider band lets a tie carry a plan well past the target)
    noise = min(max(spread, 0.03), 0.05)
    base = dataclasses.replace(hw, node_overhead=0.0, roofline_scale=1.0)
    roofline = sum(_seg_time(s, stats, stats.rows, 1, base, "fp32", part)
                   for s in stats.segments for part in ("f", "b"))
    nodes = max(sum(s.nodes_f + s.nodes_b for s in stats.segments), 1)
    hw = dataclasses.replace(hw, noise=noise)
    fixed = None  # seconds every call pays, at any size
    if small_tokens is not None and stats.seq:
        g = small_tokens / stats.seq
        attention = sum(s.attn_flops_f + s.attn_flops_b for s in stats.segments) / (
            base.flops("fp32") * base.matmul_efficiency)
        small_roofline = g * (roofline - attention) + g * g * attention
        at = f" at {stats.seq} tokens, {{:.1f}} ms at {small_tokens}"
    else:
        r = small_rows or stats.rows / 2
        small_roofline = roofline * r / stats.rows
        at = f" at {stats.rows} rows, {{:.1f}} ms at {r:g}"
    if t_small is not None and 0 < small_roofline < roofline:
        per_roofline = (t_graph - t_small) / (roofline - small_roofline)
        fixed = min(max(t_graph - per_roofline * roofline, nodes * hw.node_overhead), t_graph)
    if fixed is not None and fixed < t_graph:
        hw.node_overhead = fixed / nodes  # (at least the measured dispatch, above)
        hw.roofline_scale = (t_graph - fixed) / roofline
    else:  # the roofline's time per row, the rest per call
        hw.node_overhead = max(hw.node_overhead, (t_graph - roofline) / nodes)
    hw.optimizer_s = optimizer_s
    if t_alone and hw.core_share >= 1:  # (oversubscribed cores: _on_shared_cores)
        hw.alone_speedup = min(max(t_graph / t_alone, 1.0), 2.0)
    at = at.format(t_small * 1e3) if t_small is not None else ""
    hw.calibrated += (f"; graph {t_graph * 1e3:.1f} ms{at} -> {hw.roofline_scale:.2f}x roofline + "
                      f"{hw.node_overhead * 1e6:.1f} us/node, ties within {noise:.0%}"
                      + (f", {hw.alone_speedup:.2f}x alone" if hw.alone_speedup > 1 else ""))
    return hw


def auto_plan(stats: GraphStats, optimizer, world: int, device,
              constraints: dict | None = None, hw: cost.Hardware | None = None) -> PlanResult:
    """The best plans for `world` devices of `device`'s type for the graph `stats` describes
    (fxpar.compile's search; hw None: the data sheet's GPU, or this CPU's measured matmul and
    copy speed)."""
    clock = Clock(log)
    if hw is None:
        with clock("planner: measure machine"):
            if torch.device(device).type == "cuda":
                hw = cost.gpu_hardware(device)
            else:
                hw = cost.cpu_hardware()
                hw.memory = cost.device_memory(torch.device(device))
    result = search(stats, world, hw, batch_rows=stats.rows,
                    optimizer=optimizer_kind(optimizer), constraints=constraints,
                    executable=True, precision=(constraints or {}).get("precision") or "fp32")
    result.times = clock.rows(other=False) + result.times
    if log_rank() == 0:
        log.info("%s", result.summary())
    return result


def constraints_of(plan, optimizer=None) -> dict:
    """A plan given with "auto" parts -> the fields the search must keep (a Plan: those
    differing from the defaults; a dict: as given); "auto" degrees are searched. An
    optimizer instance (built over the whole parameters, not a factory) cannot step ZeRO's
    shards or host copies (runtime/trainer.py refuses those plans): zero=0 and
    offload_optimizer=False unless the plan says otherwise."""
    if isinstance(plan, Plan):
        constraints = {f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)
                       if getattr(plan, f.name) != getattr(Plan(), f.name)}
    elif isinstance(plan, dict):
        Plan.from_any(plan)  # unknown fields: a clear error before any work
        constraints = dict(plan)
    else:
        constraints = {}
    if isinstance(optimizer, torch.optim.Optimizer):
        constraints = {"zero": 0, "offload_optimizer": False, **constraints}
    return {k: v for k, v in constraints.items()
            if not (k in ("dp", "tp", "pp") and v == "auto")}



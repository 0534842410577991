"""Fusion: fxpar's hand-written Triton kernels where an op or pattern matches.

The last pass, on the partitioned, sharded and scheduled joint graph. With Plan.codegen
resolved to Inductor (ctx.codegen, the default where Triton or a C++ compiler is there),
Inductor is the fuser: this pass then swaps in only the cross-entropy kernel (measured 7x
eager and 1.12x torch.compile on an H100; docs/benchmarks.md), as a custom op
(`fxpar::cross_entropy`, kernels/library.py) that Inductor calls from inside its compiled
runs; where that kernel cannot run (CPU, shapes it does not take) the cross-entropy
pattern becomes the ATen ops of its closed form, which Inductor compiles into one pass over
the logits each way (`_cross_entropy_closed_form`).

With codegen="eager" (op by op) the hand-written kernels (fxpar/kernels/) replace what they
match: softmax and its backward, layer norm forward/backward, the RMSNorm forward,
log-softmax + nll-loss as one cross-entropy forward/backward (never materialising the
[N, V] log-probabilities), and CPU flash attention forward/backward (FlashAttention-2 in
Triton). fxpar once also generated Triton kernels for chains of pointwise ops and trailing
reductions; Inductor's code beat them on every GPU row measured (HF GPT-2 small bf16 on an
H200: 0.650x eager with them vs 0.396x with Inductor; docs/benchmarks.md), so there is one
generator: Inductor's (issue 27).

A single op is swapped only where its kernel pays: on a GPU each candidate is priced with
cost.KernelPrice - host seconds per ATen dispatch and per Triton launch, measured once on
the device, against the bytes it saves at the device's bandwidth - and left as it is where
one launch costs more than the op (`meta["fusion"].unpaid`). Where the step is replayed
from a CUDA graph (Plan.cuda_graphs: "auto" at pp=1 with one microbatch, True everywhere)
launches cost no host time and only the bytes count.

Triton compiles for GPUs; on CPU the kernels run only in Triton's interpreter
(TRITON_INTERPRET=1). Otherwise (and without Inductor) the pass changes nothing and says
why in the log and in `gm.meta[ir.FUSION_REPORT]`. `Plan.fuse=False` leaves the pass out.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.core import cost, ir
from fxpar.core.plan import replays_step
from fxpar.kernels import launch_cost, library
from fxpar.kernels.jit import unavailable_reason

log = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclasses.dataclass
class Group:
    """One fused node: what it replaced and the memory traffic before/after (bytes)."""
    name: str
    kind: str                    # the hand-written kernel's name, or INDUCTOR_CE
    ops: list[str]
    nodes: list[str]
    bytes_unfused: int           # sum over the replaced ops of (bytes read + bytes written)
    bytes_fused: int             # the fused kernel: inputs read once + outputs written once


@dataclasses.dataclass
class Decision:
    groups: list[Group]
    skipped: str | None = None   # why nothing was fused (no Triton on this device)
    unpaid: list[list[str]] = dataclasses.field(default_factory=list)  # groups left unfused:
    # one kernel launch would cost more than the ops it replaces (cost.KernelPrice)

    @property
    def bytes_unfused(self) -> int:
        return sum(g.bytes_unfused for g in self.groups)

    @property
    def bytes_fused(self) -> int:
        return sum(g.bytes_fused for g in self.groups)

    def describe(self) -> str:
        """One line for the console and the report."""
        if self.skipped:
            return f"not run: {self.skipped}"
        if not self.groups:
            return "nothing fused or rewritten"
        closed = sum(g.kind == INDUCTOR_CE for g in self.groups)
        kernels = len(self.groups) - closed
        parts = [f"{kernels} hand-written Triton kernels"] if kernels else []
        if closed:
            parts.append(f"{closed} cross-entropy in closed form for Inductor")
        return (", ".join(parts) + f"; bytes moved {self.bytes_unfused / 2**20:.2f} -> "
                f"{self.bytes_fused / 2**20:.2f} MiB")


INDUCTOR_CE = "cross_entropy for Inductor"  # Group.kind of _cross_entropy_closed_form's


@dataclasses.dataclass(frozen=True)
class Options:
    """The Plan fields this pass reads (core/plan.pass_options fills them from a Plan)."""
    fuse: bool = True
    cuda_graphs: Any = False
    pp: int | None = 1
    microbatches: int = 1


CONTRACT = ir.PassContract(
    "fusion", Options,
    requires=frozenset({ir.VAL, ir.REGION}),
    provides=frozenset({ir.FUSED_GROUP, ir.FUSION_REPORT}),
    # it fuses the graph the others leave: a pass after it would meet its kernel calls
    after=frozenset({"precision", "remat", "pipeline_split", "tensor_parallel",
                     "data_parallel", "overlap"}),
    applies=lambda o: o.fuse)


def run(gm: torch.fx.GraphModule, options: Options, ctx) -> torch.fx.GraphModule:
    reason = unavailable_reason(ctx.device if ctx.device is not None else "cpu")
    if ctx.codegen == "inductor":  # one fuser: Inductor's
        groups = cross_entropy_for_inductor(gm, triton=reason is None)
        gm.meta[ir.FUSION_REPORT] = Decision(groups)
        log.debug("fusion: Inductor generates the kernels; cross-entropy: %s",
                  [g.kind for g in groups])
        return gm
    if reason:
        log.info("fusion: keeping the unfused ops: %s", reason)
        gm.meta[ir.FUSION_REPORT] = Decision([], skipped=reason)
        return gm
    # a step replayed from a CUDA graph (runtime/cudagraph.py) pays no host cost per launch
    replayed = replays_step(options.cuda_graphs, options.pp, options.microbatches)
    price = launch_cost.kernel_price(ctx.device, replayed)
    unpaid: list[list[str]] = []
    groups = hand_written(gm, price, unpaid)
    _restore_topological_order(gm.graph)  # a kept RMSNorm multiply now reads the kernel
    gm.meta[ir.FUSION_REPORT] = Decision(groups, unpaid=unpaid)
    log.debug("fusion: %d hand-written kernels, bytes moved %d -> %d; %d ops left unfused "
              "(a launch would cost more than it saves)", len(groups),
              sum(g.bytes_unfused for g in groups), sum(g.bytes_fused for g in groups),
              len(unpaid))
    return gm


def _pays(price, nodes, fused_bytes, unpaid) -> bool:
    """The KernelPrice says one kernel beats `nodes` dispatched one by one (always True
    where there is no price: Triton's interpreter on CPU, for tests); else note the group."""
    if price is None:
        return True
    if price.pays(len(nodes), [sum(cost.node_bytes(n)) for n in nodes], fused_bytes):
        return True
    if unpaid is not None:
        unpaid.append([n.name for n in nodes])
    return False


# --- hand-written kernels ---------------------------------------------------------------------

def _traffic(nodes) -> int:
    return sum(sum(cost.node_bytes(n)) for n in nodes)


def _record(node, kind, ops, names, before, flops) -> Group:
    """meta["fused_group"] on the fused node (viz and the cost model read it)."""
    g = Group(node.name, kind, list(ops), list(names), before, sum(cost.node_bytes(node)))
    node.meta[ir.FUSED_GROUP] = dataclasses.asdict(g) | {"flops": flops}
    return g


def _op_name(n) -> str:
    return str(n.target).replace("aten.", "").replace(".default", "")


def hand_written(gm: torch.fx.GraphModule, price=None, unpaid=None) -> list[Group]:
    """Swap ops (and two patterns) for the kernels in fxpar/kernels/ where they apply (a
    single op only where `price` says the kernel launch pays; the cross-entropy and RMSNorm
    patterns replace several ops and the [N, V] log-probabilities: always)."""
    groups = []
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n._erased:  # erased by an earlier pattern rewrite
            continue
        if n.target in library.SINGLE_OP:
            call = library.SINGLE_OP[n.target]
            why = call.supports(*n.args, **n.kwargs)
            if why:
                log.debug("fusion: %s stays unfused: %s", n.name, why)
                continue
            before, flops, old = _traffic([n]), cost.node_flops(n), _op_name(n)
            if not _pays(price, [n], before, unpaid):
                continue
            n.target = call.for_node(n)
            groups.append(_record(n, call.name, [old], [n.name], before, flops))
        elif n.target is aten.nll_loss_forward.default:
            g = _cross_entropy(graph, n)
            groups += g
        elif n.target is aten.rsqrt.default:
            g = _rms_norm(graph, n)
            groups += g
    return groups


def _match_cross_entropy(nll, recomputed: bool = False):
    """nll_loss_forward(_log_softmax(logits, 1), target, None, reduction, ignore) and, if
    the graph has a backward, its nll_loss_backward -> _log_softmax_backward_data, with the
    log-probabilities read by nothing else -> (log_softmax, nll_bw or None, ls_bw or None,
    copies); else None. `recomputed`: also match remat's form (remat="sqrt" on HF models):
    the backward reads a recomputed copy of the targets, and a recomputed nll_loss_forward
    of the same log-probabilities for its count (and the seed's shape) - `copies`, each read
    only through getitems."""
    ls, weight = nll.args[0], nll.args[2]
    if not (isinstance(ls, torch.fx.Node) and ls.target is aten._log_softmax.default
            and weight is None and ls.args[1] in (1, -1) and not ls.args[2]):
        return None
    users = set(ls.users) - {nll}
    nll_bw = [u for u in users if u.target is aten.nll_loss_backward.default]
    ls_bw = [u for u in users if u.target is aten._log_softmax_backward_data.default]
    copies = [u for u in users if recomputed and u.target is aten.nll_loss_forward.default
              and list(u.args[2:5]) == list(nll.args[2:5]) and _same_values(u.args[1],
                                                                           nll.args[1])
              and all(r.target is operator.getitem for r in u.users)]
    if users != set(nll_bw) | set(ls_bw) | set(copies) or len(nll_bw) > 1 or \
            len(ls_bw) != len(nll_bw):
        return None
    same_targets = _same_values if recomputed else (lambda a, b: a is b)
    if nll_bw and (ls_bw[0].args[0] is not nll_bw[0] or len(nll_bw[0].users) != 1
                   or not same_targets(nll_bw[0].args[2], nll.args[1])  # the same targets,
                   or list(nll_bw[0].args[3:6]) != list(nll.args[2:5])):  # weight, reduction,
        return None                                                        # ignore_index
    return ls, (nll_bw or [None])[0], (ls_bw or [None])[0], copies


def _is_random(n) -> bool:
    """Draws from torch's generator: two such calls are never the same values."""
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return (torch.Tag.nondeterministic_seeded in t.tags
                or t.namespace == "fxpar" and "dropout" in t.name())  # split_random's draw
    return "rng" in getattr(t, "__name__", "")  # remat's run_and_save_rng_state / run_with_...


def _same_values(a, b) -> bool:
    """Whether nodes `a` and `b` compute the same values: the same node, or the same
    deterministic op on the same values (remat's recomputed copy of a chain). An op with no
    node input (a factory: `empty` has no defined values) or a tensor constant is not."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or \
            a.op != "call_function" or b.op != "call_function" or a.target is not b.target or \
            len(a.args) != len(b.args) or a.kwargs != b.kwargs or _is_random(a) or \
            not a.all_input_nodes:
        return False
    for x, y in zip(a.args, b.args):
        if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
            if not _same_values(x, y):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or \
                type(x) is not type(y) or x != y:  # (lists holding nodes compare by identity)
            return False
    return True


def _cross_entropy(graph, nll) -> list[Group]:
    """log_softmax -> nll_loss (forward) and nll_loss_backward -> log_softmax_backward
    become one kernel each; the backward reads the logits and the row logsumexp instead of
    the [N, V] log-probabilities."""
    ls, target, weight, reduction, ignore = nll.args[:5]
    match = _match_cross_entropy(nll, recomputed=True)
    if match is None:
        return []
    logits, copies = ls.args[0], match[3]
    recomputed_targets = _targets_read(copies, match[1])
    nll_bw, ls_bw = ([match[1]], [match[2]]) if match[1] is not None else ([], [])
    # the precision pass's fp32 copy of half-precision logits: the kernels read the half
    # ones (they compute in fp32 either way), and the [N, V] fp32 copy is never written
    upcast = _half_to_fp32(logits)
    src = logits.args[0] if upcast else logits
    why = library.cross_entropy_forward.supports(src, target, reduction, ignore)
    if why:
        log.debug("fusion: %s stays unfused: %s", nll.name, why)
        return []
    before = _traffic([ls, nll] + ([logits] if upcast and len(logits.users) == 1 else []))
    with graph.inserting_after(nll):
        fwd = graph.call_function(library.cross_entropy_op._opoverload,
                                  (src, target, reduction, ignore, upcast))
    fwd.meta = dict(nll.meta)
    lv, tw = nll.meta[ir.VAL]
    lse_val = logits.meta[ir.VAL].new_empty(logits.meta[ir.VAL].shape[:1], dtype=torch.float32)
    fwd.meta[ir.VAL] = (lv, tw, lse_val)
    for n in (nll, *copies):  # (remat's copies: the same values, read through getitems)
        n.replace_all_uses_with(fwd)
    groups = [_record(fwd, "cross_entropy", ["_log_softmax", "nll_loss_forward"],
                      [ls.name, nll.name], before, 0)]
    if nll_bw:
        nb, lb = nll_bw[0], ls_bw[0]
        grad_loss, total_weight = nb.args[0], nb.args[6]
        with graph.inserting_after(fwd):
            lse = graph.call_function(operator.getitem, (fwd, 2))
        lse.meta = {k: v for k, v in fwd.meta.items() if k != ir.FUSED_GROUP}
        lse.meta[ir.VAL] = lse_val
        # the gradient's one down-cast (precision pass) is the kernel's store: the fp32
        # gradient rounded once, without writing it in fp32
        down = [u for u in lb.users if upcast and u.target is aten._to_copy.default and
                u.kwargs == {"dtype": src.meta[ir.VAL].dtype}]
        down = down[0] if down and len(lb.users) == 1 else None
        before_b = _traffic([nb, lb] + ([down] if down else []))
        with graph.inserting_after(lb):
            bwd = graph.call_function(library.cross_entropy_backward_op._opoverload, (
                grad_loss, src, lse, target, reduction, ignore, total_weight, upcast,
                down.kwargs["dtype"] if down else None))
        bwd.meta = dict(lb.meta)
        bwd.meta[ir.SEQ_NR] = fwd.meta.get(ir.SEQ_NR)  # the backward of the kernel's forward
        if down:
            bwd.meta[ir.VAL] = down.meta[ir.VAL]
            down.replace_all_uses_with(bwd)
            graph.erase_node(down)
        lb.replace_all_uses_with(bwd)
        groups.append(_record(bwd, "cross_entropy_backward",
                              ["nll_loss_backward", "_log_softmax_backward_data"],
                              [nb.name, lb.name], before_b, 0))
        graph.erase_node(lb)
        graph.erase_node(nb)
    for n in (*copies, nll, ls):
        graph.erase_node(n)
    if upcast and not logits.users:
        graph.erase_node(logits)
    _erase_unread(recomputed_targets, keep=target)
    return groups


def _targets_read(copies, nll_bw) -> list:
    """The targets remat's copies and the backward read (taken before they are erased)."""
    return [c.args[1] for c in copies] + ([nll_bw.args[2]] if nll_bw is not None else [])


def _erase_unread(nodes, keep) -> None:
    """Remat's recomputed copies of the targets (and what only they read), now read by
    nothing: the backward reads the forward's targets."""
    todo, gone = [n for n in nodes if n is not keep], set()
    while todo:
        n = todo.pop()
        if n not in gone and isinstance(n, torch.fx.Node) and n.op == "call_function" \
                and not n.users:
            todo += n.all_input_nodes
            n.graph.erase_node(n)
            gone.add(n)


def _half_to_fp32(n) -> bool:
    """Whether `n` is a plain cast of a half-precision tensor to fp32."""
    if not (isinstance(n, torch.fx.Node) and n.op == "call_function"):
        return False
    if n.target is aten._to_copy.default:
        ok = n.kwargs == {"dtype": torch.float32}
    elif n.target is torch.ops.prims.convert_element_type.default:
        ok = n.args[1:] == (torch.float32,) and not n.kwargs
    else:
        return False
    src = n.args[0].meta.get(ir.VAL) if isinstance(n.args[0], torch.fx.Node) else None
    return ok and isinstance(src, torch.Tensor) and src.dtype in (torch.bfloat16, torch.float16)


def cross_entropy_for_inductor(gm: torch.fx.GraphModule, triton: bool) -> list[Group]:
    """Plan.codegen="inductor": the cross-entropy pattern becomes fxpar's Triton kernel
    where it runs (`triton`, and the kernel supports the shapes: measured faster than
    Inductor's code on an H100), else the closed form below, which Inductor compiles into
    one pass over the logits each way."""
    groups = []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is aten.nll_loss_forward.default:
            groups += (triton and _cross_entropy(gm.graph, n)) or \
                _cross_entropy_closed_form(gm.graph, n)
    return groups


def _cross_entropy_closed_form(graph, nll) -> list[Group]:
    """log_softmax + nll_loss and their backward as the ATen ops of the closed form:
        forward   m = max(x, 1), s = log(sum(exp(x - m), 1)); loss = sum over kept rows
                  of s - (x[target] - m)
        backward  dx = (exp((x - m) - s) - onehot(target)) * g (/ the kept rows for a mean)
    Why: from the ops autograd records, Inductor writes the [N, V] log-probabilities in the
    forward, reads them back in the backward and sums nll_loss_backward's one-hot rows over
    V; the closed form keeps the logits instead (same size) and two [N] row values, and
    Inductor makes one pass over the logits each way. Same values up to rounding; mean and
    sum reductions, 2-D logits (reduction "none" and other shapes stay as they are)."""
    match = _match_cross_entropy(nll, recomputed=True)
    _, target, _, reduction, ignore = nll.args[:5]
    if match is None or reduction not in (1, 2) or any(
            u.target is not operator.getitem for u in nll.users):
        return []
    ls, nb, lb, copies = match
    recomputed_targets = _targets_read(copies, nb)
    x = ls.args[0]
    xv = x.meta.get(ir.VAL)
    if not (isinstance(xv, torch.Tensor) and xv.dim() == 2 and isinstance(target, torch.fx.Node)
            and target.meta[ir.VAL].dim() == 1):
        return []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    before = _traffic([ls, nll] + ([nb, lb] if nb is not None else []))
    f32, convert = torch.float32, torch.ops.prims.convert_element_type.default

    def emit(like, op, *args, **kwargs):
        """op(*args, **kwargs) as a node just before `like` (whose meta it takes), its value
        computed on the inputs' fake values."""
        with graph.inserting_before(like):
            node = graph.call_function(op, args, kwargs)
        vals, kw = torch.fx.node.map_arg((args, kwargs), lambda a: mode.from_tensor(
            a.meta[ir.VAL]))  # (the graph's values may come from several fake modes)
        node.meta = {k: like.meta[k] for k in (ir.REGION, ir.MODULE, ir.STAGE, ir.PHASE,
                                               ir.RECOMPUTE) if k in like.meta}
        with mode:
            node.meta[ir.VAL] = op(*vals, **kw)
        return node

    def as_f32(like, v):
        return v if v.meta[ir.VAL].dtype == f32 else emit(like, convert, v, f32)

    # log-probabilities as ATen's log_softmax rounds them, (x - max) - log(sum(exp(x - max))):
    # x - logsumexp(x) would round lse at its own magnitude (1e-5 off for logits ~100)
    xf = as_f32(nll, x)
    top = emit(nll, aten.amax.default, xf, [1], True)
    log_sum = emit(nll, aten.log.default, emit(nll, aten.sum.dim_IntList, emit(
        nll, aten.exp.default, emit(nll, aten.sub.Tensor, xf, top)), [1], True))
    kept = emit(nll, aten.ne.Scalar, target, ignore)
    safe = emit(nll, aten.unsqueeze.default, emit(nll, aten.where.ScalarOther, kept, target, 0), 1)
    picked = emit(nll, aten.sub.Tensor, emit(nll, aten.gather.default, xf, 1, safe), top)
    per_row = emit(nll, aten.where.ScalarOther, kept, emit(nll, aten.squeeze.dim, emit(
        nll, aten.sub.Tensor, log_sum, picked), 1), 0.0)
    loss_v, tw_v = nll.meta[ir.VAL]
    tw = emit(nll, convert, emit(nll, aten.sum.default, kept), tw_v.dtype)
    loss = emit(nll, aten.sum.default, per_row)
    if reduction == 1:
        loss = emit(nll, aten.div.Tensor, loss, tw)
    if loss_v.dtype != f32:
        loss = emit(nll, convert, loss, loss_v.dtype)
    for u in [u for n in (nll, *copies) for u in n.users]:  # (remat's copies: the same
        u.replace_all_uses_with(loss if u.args[1] == 0 else tw)  # values, two scalars kept)
        graph.erase_node(u)
    names = [ls.name, nll.name]
    if nb is None:
        # (remat never recomputes them for the backward: its min-cut keeps the log-
        # probabilities, which the backward reads, over the logits, which it does not)
        log.debug("fusion: %s: no backward reads these log-probabilities (a forward-only "
                  "graph): the forward alone is rewritten", nll.name)
    after = cost.tensor_bytes(xv)  # the logits, read once
    if nb is not None:
        w = as_f32(lb, nb.args[0])
        if reduction == 1:  # by the backward's own total weight: data parallelism and
            # microbatches make it the whole batch's count (passes/data_parallel.py)
            w = emit(lb, aten.div.Tensor, w, nb.args[6])
        w = emit(lb, aten.unsqueeze.default, emit(lb, aten.where.ScalarOther, kept, w, 0.0), 1)
        p = emit(lb, aten.exp.default, emit(lb, aten.sub.Tensor, emit(
            lb, aten.sub.Tensor, as_f32(lb, x), top), log_sum))
        cols = emit(lb, aten.arange.start_step, 0, xv.shape[1], 1, dtype=torch.int64,
                    device=xv.device)
        hot = emit(lb, convert, emit(lb, aten.eq.Tensor, emit(lb, aten.unsqueeze.default,
                                                              target, 1), cols), f32)
        dx = emit(lb, aten.mul.Tensor, emit(lb, aten.sub.Tensor, p, hot), w)
        if lb.meta[ir.VAL].dtype != f32:
            dx = emit(lb, convert, dx, lb.meta[ir.VAL].dtype)
        lb.replace_all_uses_with(dx)
        names += [nb.name, lb.name]
        after += cost.tensor_bytes(xv) + cost.tensor_bytes(dx.meta[ir.VAL])  # x read, dx written
        graph.erase_node(lb)
        graph.erase_node(nb)
    for n in (*copies, nll, ls):
        graph.erase_node(n)
    _erase_unread(recomputed_targets, keep=target)
    return [Group(log_sum.name, INDUCTOR_CE,
                  ["_log_softmax", "nll_loss_forward"] + (
                      ["nll_loss_backward", "_log_softmax_backward_data"] if nb is not None
                      else []), names, before, after)]


def _rms_norm(graph, rs) -> list[Group]:
    """x * rsqrt(mean(x^2, -1) + eps) * w (Llama's RMSNorm in fp32) -> one kernel that also
    returns rsqrt(...) (the backward reads it)."""
    add = rs.args[0]
    if not (add.op == "call_function" and add.target in (aten.add.Tensor, aten.add.Scalar)
            and isinstance(add.args[1], float)):
        return []
    mean = add.args[0]
    if not (mean.op == "call_function" and mean.target is aten.mean.dim
            and isinstance(mean.args[1], (list, tuple))
            and list(mean.args[1]) in ([-1], [mean.args[0].meta[ir.VAL].dim() - 1])
            and (mean.args[2] if len(mean.args) > 2 else False)):
        return []
    pw = mean.args[0]
    if not (pw.op == "call_function" and pw.target is aten.pow.Tensor_Scalar and pw.args[1] == 2):
        return []
    x = pw.args[0]
    if any(len(n.users) != 1 for n in (pw, mean, add)) or rs.meta[ir.VAL].dtype != torch.float32:
        return []  # fp32 only: the kernel's rstd is fp32 (a bf16 graph would change dtype)
    norm = [u for u in rs.users if u.target is aten.mul.Tensor and x in u.args]
    if len(norm) != 1:
        return []
    norm = norm[0]
    xv = x.meta[ir.VAL]

    def weight_of(u):  # the multiply by a [C] weight (not the backward's use of norm)
        if u.target is not aten.mul.Tensor or u.meta.get(ir.REGION) != norm.meta.get(ir.REGION):
            return None
        w = u.args[0] if u.args[1] is norm else u.args[1]
        wv = w.meta.get(ir.VAL) if isinstance(w, torch.fx.Node) else None
        return w if isinstance(wv, torch.Tensor) and wv.shape == xv.shape[-1:] else None
    outs = [u for u in norm.users if weight_of(u) is not None]
    if len(outs) != 1:
        return []
    out = outs[0]
    w = weight_of(out)
    if library.rms_norm_forward.supports(x, w, add.args[1]):
        return []
    before = _traffic([pw, mean, add, rs, norm, out])
    with graph.inserting_after(out):
        k = graph.call_function(library.rms_norm_forward, (x, w, add.args[1]))
        y = graph.call_function(operator.getitem, (k, 0))
        r = graph.call_function(operator.getitem, (k, 1))
    k.meta = dict(out.meta)
    k.meta[ir.VAL] = (out.meta[ir.VAL], rs.meta[ir.VAL])
    y.meta, r.meta = dict(out.meta), dict(rs.meta)
    for old, new in ((out, y), (rs, r)):
        for key in (ir.STAGE, ir.PHASE, ir.REGION):
            if key in out.meta:
                new.meta[key] = out.meta[key]
        old.replace_all_uses_with(new)
    graph.erase_node(out)
    replaced = [pw, mean, add, rs, norm, out]
    if norm.users:  # read by the backward too: stays, fed by the kernel's rsqrt
        replaced.remove(norm)
        before -= sum(cost.node_bytes(norm))
    else:
        graph.erase_node(norm)
    for n in (rs, add, mean, pw):
        graph.erase_node(n)
    return [_record(k, "rms_norm", [_op_name(n) for n in replaced], [n.name for n in replaced],
                    before, 0)]


def _restore_topological_order(graph: torch.fx.Graph) -> None:
    """A fused node sits where its last member was; an outside user of an earlier member
    that ran in between moves after it. Stable: everything else keeps its place."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    if all(pos[a] < pos[n] for n in graph.nodes for a in n.all_input_nodes):
        return
    indeg = {n: len(set(n.all_input_nodes)) for n in graph.nodes}
    ready = [(pos[n], n.name, n) for n in graph.nodes if indeg[n] == 0]
    heapq.heapify(ready)
    new = []
    while ready:
        _, _, n = heapq.heappop(ready)
        new.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (pos[u], u.name, u))
    if len(new) != len(graph.nodes):
        raise RuntimeError("fusion made the graph cyclic (a bug in fxpar: please report it)")
    placeholders = [n for n in new if n.op == "placeholder"]
    rest = [n for n in new if n.op != "placeholder"]
    anchor = placeholders[-1]
    for n in rest:
        anchor.append(n)
        anchor = n

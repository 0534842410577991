"""Collectives with real work handles, and the lowering that makes a Program's graph use them.

Passes write communication as functional collectives (`_c10d_functional.all_reduce` ...;
expert parallelism's `fxpar::ep_dispatch` / `ep_combine`, all-to-alls whose splits are data)
followed by `wait_tensor`, placed where passes/overlap.py wants them. `lower` turns each
collective node into `start_*` (issues `torch.distributed.*(async_op=True)` and returns a
`Pending` holding the work handle) and each `wait_tensor` into `wait` (blocks on the handle),
so the collective runs in the backend (gloo's worker threads, NCCL's stream) while the
nodes between start and wait compute. Why not run the functional ops as they are: they are
asynchronous too, but hide their work handle, so the runtime could not timestamp completion
for the timeline nor reuse an owned buffer in place.

Every start/wait records on the current trace.Recorder: the collective's flight on the comm
track, and the time the compute thread was blocked (issue + wait) as exposed communication.
`lower` also puts a `mark` call where the nodes' meta["region"] changes (forward -> backward
-> packing ...), so the timeline's compute segments say which part of the step ran: a few
calls a step, ~1.5 us each. (A CUDA-graph replay runs the unlowered graph: no markers there,
host calls are not replayed.)
On CUDA, `wait` only orders the streams (the host does not block), so the exposed time it
records is host-side only.
"""
from __future__ import annotations

import atexit
import dataclasses
import queue
import threading
import time

import torch
import torch.distributed as dist
import torch.fx

from fxpar.core import cost, experts, graphs, ir
from fxpar.core.errors import FxparError, PlanError
from fxpar.runtime import calls, trace
from fxpar.runtime.trace import Recorder

c10d = torch.ops._c10d_functional
_recorder: Recorder | None = None
_groups: dict[str, dist.ProcessGroup] = {}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


@atexit.register
def _forget_groups() -> None:
    """(after runtime/dist destroyed the groups: their last references go now, while the
    interpreter is whole, not at its finalization)"""
    _groups.clear()


def set_recorder(rec: Recorder | None) -> None:
    global _recorder
    _recorder = rec


def _group(name: str) -> dist.ProcessGroup:
    """The process group a collective of the graph runs on, looked up as it is issued: the
    step's call check (runtime/calls.py) is settled first, so ranks that called different
    methods never pair their collectives."""
    calls.settle()
    pg = _groups.get(name)
    if pg is None:
        from torch.distributed.distributed_c10d import _resolve_process_group
        pg = _groups[name] = _resolve_process_group(name)
    return pg


def forget_group(name: str) -> None:
    """Drop a process group about to be destroyed from the lookup above
    (`measure_collectives` makes and destroys groups of its own)."""
    _groups.pop(name, None)


class Pending:
    """An issued collective: its work handle, output buffer, and what must stay alive."""
    __slots__ = ("work", "out", "keep", "divide", "finish", "name", "nbytes", "t_issue",
                 "t_done")

    def __init__(self, name, nbytes):
        self.name, self.nbytes = name, nbytes
        self.work = self.out = self.keep = self.divide = self.finish = self.t_done = None
        self.t_issue = time.perf_counter()

    def _finished(self, _fut):
        self.t_done = time.perf_counter()


def _reduce_op(op: str, group_size: int):
    if op == "avg":  # gloo has no AVG: sum, then divide at the wait
        return dist.ReduceOp.SUM, group_size
    return _OPS[op], None


class _Watcher:
    """One daemon thread that waits on works whose backend offers no future (`_Works`:
    gloo's in-place all-gather / reduce-scatter), in issue order, and stamps when each
    completed. Its wait is a second one (the compute thread's `wait` is the first): only for
    works whose wait() does nothing but wait (not gloo's reduce_scatter_single: see
    start_reduce_scatter)."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="fxpar-comm-watch").start()

    def _loop(self):
        while True:
            p, work = self.queue.get()
            try:
                work.wait()  # releases the GIL
            except Exception:  # the compute thread's own wait reports the error
                pass
            p.t_done = p.t_done or time.perf_counter()


_watcher: _Watcher | None = None


def _issued(p: Pending, work) -> Pending:
    """Completion time comes from the work's future where the backend has one (gloo's
    all-reduce, NCCL), else from the watcher thread."""
    global _watcher
    p.work = work
    rec = _recorder
    if rec is not None and rec.recording:
        try:
            work.get_future().then(p._finished)
        except RuntimeError:  # "Work::getFuture not implemented"
            if _watcher is None:
                _watcher = _Watcher()
            _watcher.queue.put((p, work))
        rec.blocked(p.t_issue, time.perf_counter(), "issue " + p.name)
    return p


def start_all_reduce(x: torch.Tensor, op: str, group_name: str, owned: bool,
                     name: str) -> Pending:
    """All-reduce, in place on `x` when the graph says nothing else reads it (owned)."""
    p = Pending(name, x.numel() * x.element_size())
    pg = _group(group_name)
    buf = x if owned and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    red, p.divide = _reduce_op(op, pg.size())
    p.out = buf
    return _issued(p, dist.all_reduce(buf, op=red, group=pg, async_op=True))


class _Works:
    """Several work handles waited on as one (gloo's in-place all-gather / reduce-scatter)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented")  # -> the watcher thread


# gloo's all_gather_single / reduce_scatter_single copy through a second full-size buffer of
# their own (measured: a 98 MB all-gather raised a rank's peak by 189 MB, its output 95 MB;
# a reduce-scatter by 119 MB for a 25 MB output) and ran ~2x slower than one broadcast per
# rank into the output's slices / one reduce per rank in place, which allocate nothing more.
# So on gloo fxpar issues those from these sizes up (below them gloo's own were as fast or
# faster: a 1 KB gather 0.27 vs 0.33 ms on 2 ranks, a 2.4 MB reduce-scatter 6 vs 11 ms on
# 4), the reduce-scatter only on a buffer nothing else reads. benchmarks/meta_memory.py.
GLOO_INPLACE_AG_BYTES = 64 * 2**10
GLOO_INPLACE_RS_BYTES = 4 * 2**20


def _is_gloo(pg) -> bool:
    return dist.get_backend(pg) == "gloo"


def start_all_gather(x: torch.Tensor, group_size: int, group_name: str, name: str) -> Pending:
    p = Pending(name, x.numel() * x.element_size() * group_size)
    x = x.contiguous()
    pg = _group(group_name)
    p.keep, p.out = x, x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    if _is_gloo(pg) and p.nbytes >= GLOO_INPLACE_AG_BYTES:
        parts = p.out.chunk(group_size)
        parts[pg.rank()].copy_(x)
        return _issued(p, _Works([dist.broadcast(t, src=dist.get_global_rank(pg, i), group=pg,
                                                 async_op=True)
                                  for i, t in enumerate(parts)]))
    return _issued(p, dist.all_gather_single(p.out, x, group=pg, async_op=True))


def start_reduce_scatter(x: torch.Tensor, op: str, group_size: int, group_name: str,
                         owned: bool, name: str) -> Pending:
    """Reduce-scatter; on gloo, in place on `x` when the graph says nothing else reads it
    (owned) and it is large (see GLOO_INPLACE_RS_BYTES), else an all-reduce of a copy."""
    p = Pending(name, x.numel() * x.element_size())
    pg = _group(group_name)
    red, p.divide = _reduce_op(op, group_size)
    if owned and x.is_contiguous() and _is_gloo(pg) and p.nbytes >= GLOO_INPLACE_RS_BYTES:
        parts = x.chunk(group_size)
        p.keep, p.out = x, parts[pg.rank()]  # (a view: `wait` copies it out, x dies)
        p.divide = (p.divide, "copy")
        return _issued(p, _Works([dist.reduce(t, dst=dist.get_global_rank(pg, i), op=red,
                                              group=pg, async_op=True)
                                  for i, t in enumerate(parts)]))
    if _is_gloo(pg):  # what gloo's reduce_scatter_single does, but its work copies the
        # slice out inside wait(), at every wait(): the watcher's (it has no future) re-copied
        # the sums over what the step wrote into the shard after this rank's wait (avg's
        # division, clipping, an fp16 overflow's inf). An all-reduce's work has a future.
        buf = x.clone(memory_format=torch.contiguous_format)
        p.keep, p.out = buf, buf.chunk(group_size)[pg.rank()]
        p.divide = (p.divide, "copy")
        return _issued(p, dist.all_reduce(buf, op=red, group=pg, async_op=True))
    x = x.contiguous()
    p.keep, p.out = x, x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    return _issued(p, dist.reduce_scatter_single(p.out, x, op=red, group=pg, async_op=True))


def start_all_to_all(x: torch.Tensor, output_splits, input_splits, group_name: str,
                     name: str) -> Pending:
    """All-to-all of x's rows (qgZ's quantized gradient parts, an MoE layer's routed rows):
    rows part r of `x` goes to rank r; part k of the result came from rank k."""
    x = x.contiguous()
    p = Pending(name, x.numel() * x.element_size())
    p.keep, p.out = x, x.new_empty((sum(output_splits), *x.shape[1:]))
    return _issued(p, dist.all_to_all_single(p.out, x, list(output_splits), list(input_splits),
                                             group=_group(group_name), async_op=True))


def start_ep_dispatch(x: torch.Tensor, route: torch.Tensor, group_name: str,
                      name: str) -> Pending:
    """fxpar::ep_dispatch issued: x's rows to their experts' ranks (the splits read on the
    host from the route); sorted by this rank's experts at the wait."""
    out_splits, in_splits = experts.dispatch_splits(route)
    p = start_all_to_all(x, out_splits, in_splits, group_name, name)
    p.finish = lambda got: experts.dispatched(got, route)
    return p


def start_ep_combine(y: torch.Tensor, route: torch.Tensor, group_name: str,
                     name: str) -> Pending:
    """fxpar::ep_combine issued: the experts' results back to the ranks whose rows they are."""
    back, out_splits, in_splits = experts.combine_send(y, route)
    return start_all_to_all(back, out_splits, in_splits, group_name, name)


def wait(p) -> torch.Tensor:
    """Block until the collective is done; its result."""
    if isinstance(p, torch.Tensor):  # a functional collective's result
        return c10d.wait_tensor(p)
    t0 = time.perf_counter()
    p.work.wait()
    t1 = time.perf_counter()
    out, divide = p.out, p.divide
    if isinstance(divide, tuple):  # a view of a buffer reduced in place: keep only it
        divide, out = divide[0], out.clone()
    if divide:
        out = out.div_(divide)
    if p.finish is not None:
        out = p.finish(out)
    rec = _recorder
    if rec is not None and rec.recording:
        rec.blocked(t0, t1, "wait " + p.name)
        rec.comm(p.name, p.t_issue, p.t_done or t1, p.nbytes)
    p.keep = p.out = p.work = p.finish = None
    return out


def timed(name: str, nbytes: int, fn):
    """Run a blocking collective outside the graph (e.g. the loss broadcast of a pipeline
    step) and record it as fully exposed communication."""
    calls.settle()
    t0 = time.perf_counter()
    res = fn()
    t1 = time.perf_counter()
    rec = _recorder
    if rec is not None and rec.recording:
        rec.blocked(t0, t1, name)
        rec.comm(name, t0, t1, nbytes)
    return res


# --- start-up measurements (compiler/planner prices plans with them) ----------------------


def _in_context(fn, reps: int, barrier) -> float:
    """Seconds one call of the collective `fn` adds to a step: timed between bursts of about
    a millisecond of compute, as collectives run inside a step, less the bursts alone (and
    never less than the calls back to back). On a
    host whose cores the ranks share, ranks reach a collective out of step and wait for each
    other; back-to-back calls hide that and measured about 1.45x less than the collectives
    inside real steps (GPT, 4 gloo ranks on 2 cores)."""
    a = torch.ones(96, 96)

    def burst():
        for _ in range(8):
            torch.mm(a, a)
    def loop(*body):  # every rank starts together
        barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for f in body:
                f()
        return time.perf_counter() - t0
    in_step = loop(burst, fn) - loop(burst)
    return max(in_step, loop(fn)) / reps  # noise can make the difference small; not below alone


def measure_collectives(reps: int = 8) -> dict:
    """Time every collective kind the runtime issues, as runtime/comm issues it (on gloo: an
    in-place all-reduce, a large all-gather as one broadcast per rank, a large reduce-scatter
    as one reduce per rank in place; an all-to-all, as qgZ's parts and ep's rows go), on
    groups of every size that divides the world
    (consecutive ranks, all groups of a size at once, as a plan's tp or dp groups run), at 4
    B per rank and at a 4 MiB buffer (where gloo takes those large-buffer paths), and the
    pipeline's send/recv between rank pairs. Returns {(kind, n): (seconds per call, seconds
    per byte of the full buffer)}, averaged over the ranks so every rank plans with the same
    numbers. Gloo on a shared CPU is far from the ring model (a 4-rank reduce-scatter of 16
    B took 4.9 ms on 2 cores, an all-reduce 2.2 ms), so the planner prices these measured
    costs, per call. Why the runtime's calls, and why 4 MiB: the functional collectives the
    graph holds ran 1.1-4x slower than the runtime's calls on gloo (2 ranks, 0.5-7 MB, two
    runs on shared cores), and per-byte costs extrapolated from a 512 KiB buffer came out
    erratic (the demo's 7.6 MB reduce-scatter priced at 0.8 ms, its all-reduce at 31 ms;
    measured 8-12 and 8-10 ms).
    Collective: every rank must call."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [n for n in range(2, world + 1) if world % n == 0]
    big = 2**20  # floats in the full buffer: 4 MiB (GLOO_INPLACE_RS_BYTES)
    rows = []
    for n in sizes:
        made = [dist.new_group(list(range(s, s + n))) for s in range(0, world, n)] \
            if n < world else []
        group = made[rank // n] if made else dist.group.WORLD
        name = group.group_name
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            ts = []
            for per_rank in (1, -(-big // n)):  # (at least 4 MiB for any n)
                x = torch.zeros(per_rank * n)
                start = {
                    "all_reduce": lambda: start_all_reduce(x, "sum", name, True, kind),
                    "all_gather": lambda: start_all_gather(x[:per_rank], n, name, kind),
                    "reduce_scatter": lambda: start_reduce_scatter(x, "sum", n, name,
                                                                        True, kind),
                    "all_to_all": lambda: start_all_to_all(x, [per_rank] * n, [per_rank] * n,
                                                           name, kind),
                }[kind]
                wait(start())
                ts.append((_in_context(lambda: wait(start()), reps,
                                       lambda: dist.barrier(group=group)), per_rank * n * 4))
            (t_small, b_small), (t_big, b_big) = ts
            rows.append((kind, n, t_small, max(t_big - t_small, 0.0) / (b_big - b_small)))
        for g in made:
            if isinstance(g, dist.ProcessGroup):  # (not a group this rank is outside of)
                forget_group(g.group_name)
            dist.destroy_process_group(g)
    if world % 2 == 0:  # one-way send/recv time between pairs (2i, 2i+1), by ping-pong, at
        # 4 B and 4 MiB as above (at 256 KiB the slope was the latency's noise: 4.8 ns/B
        # against 0.2-0.3 ns/B sending 4-16 MiB, and a pipeline's transfers priced 20x)
        peer = rank ^ 1
        ts = []
        for numel in (1, big):
            x = torch.ones(numel)

            def ping_pong():
                if rank % 2 == 0:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)
            ts.append((_in_context(ping_pong, reps, dist.barrier) / 2, numel * 4))
        (t_small, b_small), (t_big, b_big) = ts
        rows.append(("p2p", 2, t_small, max(t_big - t_small, 0.0) / (b_big - b_small)))
    v = torch.tensor([[t, b] for _, _, t, b in rows], dtype=torch.float64)
    dist.all_reduce(v)
    v /= world
    return {(k, n): (float(a), float(b)) for (k, n, _, _), (a, b) in zip(rows, v.tolist())}


_STARTS = {c10d.all_reduce.default: start_all_reduce,
           c10d.all_gather_into_tensor.default: start_all_gather,
           c10d.reduce_scatter_tensor.default: start_reduce_scatter,
           c10d.all_to_all_single.default: start_all_to_all,
           torch.ops.fxpar.ep_dispatch.default: start_ep_dispatch,
           torch.ops.fxpar.ep_combine.default: start_ep_combine}
_SHORT = {start_all_reduce: "all_reduce", start_all_gather: "all_gather",
          start_reduce_scatter: "reduce_scatter", start_all_to_all: "all_to_all",
          start_ep_dispatch: "ep dispatch", start_ep_combine: "ep combine"}


def is_start(target) -> bool:
    """Whether a lowered graph's node target issues a collective (`lower`'s start_*)."""
    return target in _SHORT


def bind_groups(program, names: dict[str, str]):
    """This rank's copy of `program` bound to its process groups: every string argument naming
    one of the compiler's symbolic groups (ir.GROUPS values, keys of `names`) becomes the real
    group's name, in copies of the joint graph, every pipeline part and the local-gradient
    graph (a graph naming no group is shared). The Program compile returned stays as it was:
    it can be saved, or bound again for another world."""
    if program.bound_groups is not None:
        if program.bound_groups != names:
            raise FxparError("this Program is already bound to other process groups; "
                             "bind the Program fxpar.compile returned instead.")
        return program
    symbolic = set(ir.GROUPS.values())

    def sub(a):
        if not (isinstance(a, str) and a in symbolic):
            return a
        if a not in names:
            raise PlanError(f"the Program communicates over {a!r} but this world has no such "
                            f"mesh dimension (it binds {sorted(names)}): compile for the plan "
                            "this world was set up with.")
        return names[a]

    def bound(gm):
        if gm is None or not any(
                n.op == "call_function" and any(
                    isinstance(a, str) and a in symbolic
                    for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)))
                for n in gm.graph.nodes):
            return gm
        g = graphs.copy_graph(gm.graph)  # (the output node's meta too: N_GRADS)
        for n in g.nodes:
            if n.op == "call_function":
                n.args = torch.fx.node.map_aggregate(n.args, sub)
                n.kwargs = torch.fx.node.map_aggregate(n.kwargs, sub)
        out = torch.fx.GraphModule(gm, g)
        out.meta = dict(gm.meta)
        return out
    pipeline = program.pipeline
    if pipeline is not None:
        pipeline = dataclasses.replace(pipeline, parts={
            k: dataclasses.replace(p, graph=bound(p.graph)) for k, p in pipeline.parts.items()})
    return dataclasses.replace(program, graph=bound(program.graph), pipeline=pipeline,
                               local_graph=bound(program.local_graph),
                               bound_groups=dict(names))


def mark(category: str) -> None:
    """A region change in a lowered graph: the compute segment from here on is `category`."""
    rec = _recorder
    if rec is not None:
        rec.segment(category)


def lower(gm: torch.fx.GraphModule, markers: bool = True) -> torch.fx.GraphModule:
    """A copy of `gm` whose collectives are start_*/wait calls on work handles; with
    `markers`, a `mark` call before each node whose region (trace.CATEGORY) differs from the
    last one's (a pipeline part keeps its action's label instead: markers=False). Collectives
    and waits take the region they sit in: their time is recorded as blocked already."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    last = None
    for n in list(g.nodes):
        if n.op not in ("call_function", "call_module"):  # (call_module: a compiled run)
            continue
        neutral = n.target in _STARTS or n.target is c10d.wait_tensor.default
        cat = last if neutral else trace.CATEGORY.get(n.meta.get(ir.REGION), last)
        if markers and cat != last:
            with g.inserting_before(n):
                g.call_function(mark, (cat,))
            last = cat
        if n.target in _STARTS:
            fn = _STARTS[n.target]
            name = f"{_SHORT[fn]} {n.meta.get('module') or n.name}"
            if fn in (start_all_reduce, start_reduce_scatter):
                owned = n.meta[ir.OWNED] if ir.OWNED in n.meta else cost.owned(n.args[0])
                n.args = (*n.args, owned, name)
            else:
                n.args = (*n.args, name)
            n.target = fn
        elif n.target is c10d.wait_tensor.default:
            n.target = wait
    g.lint()
    return torch.fx.GraphModule(gm, g)

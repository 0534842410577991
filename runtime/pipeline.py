"""Runs one rank's pipeline stages for one training step, in its schedule's order.

The schedule (core/schedules.py) gives this rank's compute actions: F / B (or I / W) of a
stage on a microbatch. For each, the executor gathers the part's inputs — parameters, the
microbatch's batch leaves, values this rank made earlier (a forward's stash waiting for its
backward), or values another stage made, received from its rank — runs the part's graph, and
hands each output to the parts that read it: kept locally, or sent (non-blocking `isend`) to
the rank of each other stage that reads it, skip connections included. A receive blocks only
when the value is needed, so sends never wait on receives and the schedule's order cannot
deadlock (the contract core/schedules.simulate_schedule checks). Gradients accumulate over
microbatches and are divided by their number (the loss of a microbatch is its mean); the
data-parallel reduction of a stage (its "R" part) runs once, on the accumulated gradients,
right after the stage's last backward - without a pipeline, inside it (`with_reductions`),
each bucket's collective started as its sums are final. A weight read by several stages
(tied embeddings) receives its summed gradient on every rank that holds it, so each copy
takes the same optimizer step. The next action's receives are posted before the current
action computes, so a transfer overlaps compute instead of starting when the value is
needed.
"""
from __future__ import annotations

import functools
import queue
import threading
import time
import weakref

import torch
import torch._prims_common
import torch.distributed as dist

from fxpar.core.errors import PlanError
from fxpar.runtime import calls, comm, cudagraph, faults, trace
from fxpar.core import schedules
from fxpar.runtime.offload import HostStash, OnHost
from fxpar.runtime.trace import Recorder

_GRAD_TAG = 1 << 24
_ONCE_TAG = 1 << 25  # (+ the value's tag: a once-a-step value, PipelineRunner._exchange_once)


def _wait(work) -> None:
    """work.wait(), after the step's call check (runtime/calls.py): a pipeline step settles
    it at the first transfer it waits on, so the first stage's forward runs while the
    fingerprints travel (settled as the step began, a 4-rank step waited 2-5 ms for them
    first). Posting a transfer before it is safe: nothing posted is read unless waited on,
    and a rank that made another call raises CollectiveMisuse here."""
    calls.settle()
    work.wait()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: a dense tensor's memory as one flat contiguous vector, so a value
    keeps the layout (strides) the graph was traced with (later views depend on it); anything
    else, contiguous."""
    if t.is_contiguous():
        return t
    if torch._prims_common.is_non_overlapping_and_dense_or_false(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset())
    return t.contiguous()


class _Sends:
    """A step's sends, each released as soon as it completes (its tensor with it), not when
    the step ends: held to the end, a stage kept every microbatch's sent activations and
    gradients (the tracker's pp=2 m=4 step 10-13% over the memory model). gloo's send
    cannot be polled (is_completed() is False until wait()), so a helper thread per
    destination waits on them in order (it holds only its queue and the count: it ends when
    this object goes); NCCL's can, and completed ones are dropped as new ones come."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self._works: list = []
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._state = _Pending()

    def add(self, work, dst: int) -> None:
        if not self.threaded:
            self._works = [w for w in self._works if not w.is_completed()] + [work]
            return
        if dst not in self._queues:
            q = self._queues[dst] = queue.SimpleQueue()
            threading.Thread(target=_wait_each, args=(q, self._state), daemon=True,
                             name=f"fxpar-sends-to-{dst}").start()
            weakref.finalize(self, q.put, None)  # (the thread's end)
        with self._state.cv:
            self._state.count += 1
        self._queues[dst].put(work)

    def __bool__(self) -> bool:
        return bool(self._works) or self._state.count > 0

    def wait_all(self) -> None:
        calls.settle()  # (see _wait)
        for w in self._works:
            w.wait()
        self._works = []
        st = self._state
        with st.cv:
            st.cv.wait_for(lambda: st.count == 0)
        if st.error is not None:
            e, st.error = st.error, None
            raise e


class _Pending:
    """Sends queued and not yet completed, and the first error one raised."""

    def __init__(self):
        self.cv = threading.Condition()
        self.count = 0
        self.error: BaseException | None = None


def _wait_each(q: queue.SimpleQueue, state: _Pending) -> None:
    while True:
        work = q.get()
        if work is None:
            return
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - raised on the step's thread
            state.error = state.error or e
        finally:
            del work
            with state.cv:
                state.count -= 1
                state.cv.notify_all()


def _sum_of_two(node, outs) -> torch.fx.Node | None:
    """For an output (of a graph being built: no output node yet) that is the sum (add) of
    two values of its own shape and dtype, read by nothing else - a weight's gradient summed
    from two uses (a tied embedding and head) - the one of them that it may sum into in
    place: made by an op that is not a view, read by the add alone. None otherwise."""
    if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.add.Tensor
            and len(node.args) == 2 and not node.kwargs and not node.users
            and sum(o is node for o in outs) == 1 and node.args[0] is not node.args[1]):
        return None
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor) or not all(
            isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            and a.meta["val"].shape == v.shape and a.meta["val"].dtype == v.dtype
            and a.meta["val"].stride() == v.stride() for a in node.args):
        return None
    return next((a for a in node.args if len(a.users) == 1
                 and isinstance(a.target, torch._ops.OpOverload) and not a.target.is_view
                 and not a.target._schema.is_mutable), None)


def with_reductions(acc: torch.fx.GraphModule, reductions: list, m: int,
                    hoist: bool = True) -> torch.fx.GraphModule:
    """A backward part's accumulating graph (`acc`: its running sums added in place) followed
    by once-a-step reduction parts that read those sums: `reductions` is [(R's graph, for
    each of its inputs the position of the sum among acc's outputs)]. Each sum is divided by
    the microbatches `m` in place (as `PipelineRunner._reduce` does) once it is final, and
    the result returns acc's outputs, then each R's. `hoist` (Plan.overlap): R's nodes but
    its waits move up to what they read (`_hoist`), so a bucket's reduction runs while the
    rest of the last microbatch's backward computes, as the overlap pass has it run in the
    joint graph of one microbatch (run after the backward, it was all exposed)."""
    g = torch.fx.Graph()
    root = torch.nn.Module()
    root.add_module("b", acc)
    outs = list(g.graph_copy(acc.graph, {}))
    _prefix_modules(g.nodes, "b")
    done = {id(n) for n in g.nodes}
    divided: dict[int, torch.fx.Node] = {}
    ends = []
    for j, (r_gm, positions) in enumerate(reductions):
        root.add_module(f"r{j}", r_gm)
        phs = [n for n in r_gm.graph.nodes if n.op == "placeholder"]
        env = {}
        for ph, pos in zip(phs, positions):
            if pos not in divided:
                with g.inserting_after(outs[pos]):
                    divided[pos] = g.call_function(torch.ops.aten.div_.Scalar, (outs[pos], m))
            env[ph] = divided[pos]
        r_out = g.graph_copy(r_gm.graph, env)  # (appended: no output node yet)
        new = [n for n in g.nodes if id(n) not in done]
        _prefix_modules(new, f"r{j}")
        done |= {id(n) for n in new}
        ends += list(r_out) if isinstance(r_out, (tuple, list)) else [r_out]
        if hoist:
            _hoist(g, new)
    g.output(tuple(outs + ends))
    g.lint()
    return torch.fx.GraphModule(root, g)


def _prefix_modules(nodes, prefix: str) -> None:
    for n in nodes:
        if n.op in ("call_module", "get_attr"):
            n.target = f"{prefix}.{n.target}"


def _hoist(g: torch.fx.Graph, nodes: list) -> None:
    """Move `nodes` (in their order) each to just after the last of what it reads - a
    collective's start also after the start before it, so the ranks issue them in one order
    - but for the waits on collectives and what reads them."""
    late = set()
    for n in nodes:
        if n.target is comm.wait or any(a in late for a in n.all_input_nodes):
            late.add(n)
    order = {n: i for i, n in enumerate(g.nodes)}
    prev = None  # the last collective started
    for n in nodes:
        if n in late:
            continue
        after = [*n.all_input_nodes, *([prev] if prev and comm.is_start(n.target) else [])]
        anchor = max(after, key=order.get, default=None)
        if anchor is not None and anchor.next is not n:
            anchor.append(n)
            order = {x: i for i, x in enumerate(g.nodes)}
        if comm.is_start(n.target):
            prev = n


def _shared_storages(outs, routes) -> set[int]:
    """Storages (data_ptr) that two outputs of a part alias, or that an output read by
    another part (kept locally or sent) aliases: an output there must not become a running
    sum that later microbatches add into."""
    seen, shared = {}, set()
    for (name, local, remote), t in zip(routes, outs):
        if not isinstance(t, torch.Tensor):
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or local or remote:
            shared.add(ptr)
        seen[ptr] = name
    return shared


class PipelineRunner:
    def __init__(self, program, pp_rank: int, pp_group_name: str | None,
                 graphs: dict[str, torch.fx.GraphModule] | None = None):
        """`graphs`: this rank's parts as they run (compiler/codegen.generate's), by key;
        None: the parts' own graphs, op by op."""
        self.p = program.pipeline
        self.pp, self.rank, self.m = program.pp, pp_rank, program.microbatches
        self.group = comm._group(pp_group_name) if pp_group_name else None
        self.global_rank = [dist.get_global_rank(self.group, r) if self.group else 0
                            for r in range(self.pp)]
        self.actions = [a for a in schedules.build(program.schedule, self.pp, self.m,
                                                   program.virtual)[pp_rank] if a.is_compute]
        self.parts = {k: part for k, part in self.p.parts.items() if self.rank_of(part.stage)
                      == pp_rank}
        # once-a-step parts (R: the gradient reduction, a shared weight's gradient sum): run
        # after the stage's last backward; one reading a value another rank makes (summed
        # there over the microbatches, sent once: `sent_once`) after this rank's last action,
        # so that no rank waits on one before every compute action has run
        last = {a.stage: i for i, a in enumerate(self.actions) if a.kind != "F"}
        self.reduce_after: dict[int, list[str]] = {}
        self.reduce_at_end: list[str] = []
        for k, part in sorted(self.parts.items()):
            if part.phase == "R":
                if any(kind == "value" and self._src_rank(ref) != pp_rank
                       for kind, ref in part.inputs):
                    self.reduce_at_end.append(k)
                else:
                    self.reduce_after.setdefault(last.get(part.stage, len(self.actions) - 1),
                                                 []).append(k)
        r_inputs = [(self.rank_of(part.stage), ref) for part in self.p.parts.values()
                    if part.phase == "R" for kind, ref in part.inputs if kind == "value"]
        self.sent_once = sorted({(ref, dst) for dst, ref in r_inputs
                                 if dst != pp_rank and self._src_rank(ref) == pp_rank})
        self.received_once = sorted({ref for dst, ref in r_inputs
                                     if dst == pp_rank and self._src_rank(ref) != pp_rank})
        self._local_r = {ref for dst, ref in r_inputs if dst == pp_rank}
        self.reduced_inputs = self._local_r | {ref for ref, _ in self.sent_once}
        # an action's compute segment keeps its name ("F3 s1"), its cat comes from its phase
        self.run_graphs = {k: (graphs or {}).get(k, part.graph) for k, part in self.parts.items()}
        self.lowered = {k: comm.lower(gm, markers=False) for k, gm in self.run_graphs.items()}
        self.tag = {name: i for i, name in enumerate(sorted(self.p.producer))}
        self.meta = {}  # value name -> (shape, dtype) for receives
        for part in self.p.parts.values():
            for (kind, ref), ph in zip(part.inputs, (n for n in part.graph.graph.nodes
                                                     if n.op == "placeholder")):
                if kind == "value":
                    v = ph.meta["val"]
                    dense = torch._prims_common.is_non_overlapping_and_dense_or_false(v)
                    self.meta[ref] = (tuple(v.shape), v.dtype,
                                      tuple(v.stride()) if dense else None)
        self.grad_of = {name: i for i, name in enumerate(self.p.grads) if name is not None}
        # gradients an R part makes: reduced from the microbatch mean already (not divided)
        self.grads_from_r = {self.grad_of[n] for part in self.parts.values()
                             if part.phase == "R" for n in part.outputs if n in self.grad_of}
        self.buffer_of = {name: j for j, name in enumerate(self.p.buffer_updates) if name}
        # with microbatches, a buffer update is written back as each microbatch makes it, so
        # the next microbatch's forward reads it: counters sum over the step, BatchNorm's
        # statistics move once per microbatch (compile refuses that unless the plan asks)
        sig = program.signature
        self.buffer_index = [sig.buffer_names.index(b) for b in sig.mutated_buffers]
        # a buffer updated on one stage that another rank's stage reads (or holds for saves:
        # the first stage where none reads it): that rank's copy is sent the new value after
        # the step (see sync_buffers); within a step, with microbatches, it cannot be
        self.buffer_sources: list[tuple[int, int]] = []  # (mutated buffer, pp rank making it)
        for j, name in enumerate(self.p.buffer_updates):
            if name is None or name not in self.p.producer:
                continue
            src = self.rank_of(self.p.parts[self.p.producer[name]].stage)
            readers = {self.rank_of(s) for s in self.p.buffer_stages.get(self.buffer_index[j],
                                                                         ())}
            holders = readers or {self.rank_of(0)}  # (read nowhere: saves ask stage 0)
            if holders - {src}:
                self.buffer_sources.append((j, src))
            if self.m > 1 and readers - {src}:
                raise PlanError(
                    f"microbatches={self.m}: the buffer {sig.mutated_buffers[j]!r} is updated "
                    f"by pipeline stage {self.p.parts[self.p.producer[name]].stage} and read by "
                    f"stages {sorted(self.p.buffer_stages[self.buffer_index[j]])} on other "
                    "ranks, which would read it before the earlier microbatches' updates "
                    "reach them. Use microbatches=1, or pp=1.")
        self._forward_only = False
        self.zero = program.zero  # ZeRO 1/2: the gradient outputs are flat bucket shards
        self.held_buckets = [k for k, name in enumerate(self.p.grads) if name and self.rank_of(
            self.p.parts[self.p.producer[name]].stage) == pp_rank] if self.zero else []
        self.held_params = sorted(i for i, st in self.p.param_stages.items()
                                  if any(self.rank_of(s) == pp_rank for s in st))
        # fixed per program, cached on first use: see _local_consumers, _routes, _prefetch
        self._local_count, self._route_cache, self._remote_inputs = {}, {}, {}
        self._acc_graphs: dict[str, torch.fx.GraphModule] = {}  # see _accumulating
        self._boxed_graphs: dict[tuple, torch.fx.GraphModule] = {}  # see _boxed
        # (key, R keys) -> the last backward with the reductions after it (`with_reductions`)
        self._fused_graphs: dict[tuple, torch.fx.GraphModule] = {}
        self.hoist = bool(getattr(program.plan, "overlap", True))  # Plan.overlap
        self.offload = getattr(program, "offload", False)  # Plan.offload: runtime/offload.py
        self.stash: HostStash | None = None
        self.graphs: dict[str, cudagraph.GraphedStep] | None = None  # Plan.cuda_graphs
        self._sends: _Sends | None = None  # (made on the first step: the group's backend)

    def use_cuda_graphs(self, device) -> None:
        """Replay each part as a CUDA graph (runtime/cudagraph.py) after the warm-up steps:
        parameters and buffers read in place, activations and batch copied in."""
        self.graphs = {
            key: cudagraph.GraphedStep(
                functools.partial(faults.run, self.run_graphs[key]),
                [kind in ("param", "buffer") for kind, _ in part.inputs], device,
                warmup=cudagraph.WARMUP_STEPS * (1 if part.phase == "R" else self.m))
            for key, part in self.parts.items()}

    def rank_of(self, stage: int) -> int:
        return schedules.stage_to_rank(stage, self.pp)

    def run(self, params, buffers, microbatches, device, rec: Recorder | None = None,
            forward_only: bool = False):
        """One step. Returns (mean loss or None on ranks without the loss's stage, grads per
        parameter (None where this rank holds no copy), buffer updates (None if not here)).
        forward_only: the forward parts alone, every microbatch (evaluation: same stages and
        weights as training, nothing kept for a backward)."""
        store, refs = {}, {}
        if self._sends is None:
            self._sends = _Sends(threaded=self.group is not None
                                 and dist.get_backend(self.group) == "gloo")
        sends = self._sends
        grads: list = [None] * len(self.p.grads)
        new_bufs: list = [None] * len(self.p.buffer_updates)
        losses, summed = [], {}  # summed: R inputs accumulated over microbatches
        self._pending = {}       # (value, microbatch) -> (buffer, work, posted at)
        actions = self.actions
        self._forward_only = forward_only
        if forward_only:
            mine = sorted({p.stage for p in self.parts.values() if p.phase == "F"})
            actions = [schedules.Action("F", s, mb) for s in mine for mb in range(self.m)]
        elif self.offload:
            if self.stash is None:
                self.stash = HostStash(device)
            self.stash.new_step()
            # values aliasing a weight or the batch stay: moving them frees nothing
            self._resident = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.
                              tree_leaves((params, buffers, microbatches))
                              if isinstance(t, torch.Tensor)}
        for n, a in enumerate(actions):
            key = f"{a.kind}{a.stage}"
            part = self.parts.get(key)
            if part is None:  # e.g. the first stage has no input-gradient (I) part
                continue
            mb = a.microbatch
            args = []
            for kind, ref in part.inputs:
                if kind == "param":
                    args.append(params[ref])
                elif kind == "buffer":
                    args.append(buffers[ref])
                elif kind == "batch":
                    args.append(microbatches[mb][ref])
                else:
                    if (ref, mb) not in store:
                        store[(ref, mb)] = self._recv(ref, mb, device, rec)
                        refs[(ref, mb)] = self._local_consumers(ref)
                    if isinstance(store[(ref, mb)], OnHost):  # offloaded: back on the device
                        store[(ref, mb)] = self.stash.back(store[(ref, mb)])
                    args.append(store[(ref, mb)])
                    refs[(ref, mb)] -= 1
                    if refs[(ref, mb)] == 0:
                        del store[(ref, mb)], refs[(ref, mb)]
            self._prefetch(actions[n + 1:n + 2], store, device)
            sums = None if forward_only else self._running_sums(key, grads, summed)
            if sums is not None:  # add into the sums inside the graph, as each is computed
                args += sums
            fused = self._fusable(n, key) if sums is not None else ()
            outs = self._compute(key, f"{a.kind}{mb} s{a.stage}" + "".join(
                f" + R s{self.parts[r].stage}" for r in fused), args, rec,
                accumulate=sums is not None, mb=mb, fused=fused)
            if fused:
                outs, reduced = outs[:len(part.outputs)], outs[len(part.outputs):]
            in_place = set(self._accumulated(key)) if sums is not None else set()
            # storages of this part's outputs that another output or a consumer shares
            storages = _shared_storages(outs, self._routes(key))
            for (name, local, remote), t in zip(self._routes(key), outs):
                if local:
                    store[(name, mb)], refs[(name, mb)] = t, local
                for r in remote:
                    sends.add(self._send(t, r, self.tag[name] * self.m + mb, name, rec), r)
                if name == self.p.loss:
                    losses.append(t)
                if forward_only:
                    continue
                if name in in_place:  # t is the running sum already
                    continue
                i = self.grad_of.get(name)
                if i is not None or name in self.reduced_inputs:
                    # the first microbatch's output becomes the sum, copied only where
                    # something else may read it (a value other parts take, an output
                    # sharing its storage with another, a name summed twice)
                    shared = t.untyped_storage().data_ptr() in storages or (
                        name in self.reduced_inputs and i is not None)
                if name in self.reduced_inputs:
                    summed[name] = (t.clone() if shared else t) \
                        if name not in summed else summed[name].add_(t)
                if i is not None:
                    grads[i] = (t.clone() if shared else t) \
                        if grads[i] is None else grads[i].add_(t)
                j = self.buffer_of.get(name)
                if j is not None:
                    new_bufs[j] = t
                    if self.m > 1:
                        buffers[self.buffer_index[j]].copy_(t)
            if forward_only:
                continue
            if self.stash is not None and a.kind == "F":
                self._offload(part, outs, mb, actions[n + 1] if n + 1 < len(actions) else None,
                              store)
            outs = t = args = None  # drop this action's references (offloaded values free)
            for rkey in fused:  # (ran inside the backward: its outputs follow the part's)
                rpart = self.parts[rkey]
                for _, ref in rpart.inputs:
                    summed.pop(ref)
                for name, t in zip(rpart.outputs, reduced[:len(rpart.outputs)]):
                    if name in self.grad_of:
                        grads[self.grad_of[name]] = t
                reduced = reduced[len(rpart.outputs):]
            for rkey in self.reduce_after.get(n, ()):
                if rkey not in fused:
                    self._reduce(rkey, summed, grads, rec)
        if rec is not None:  # what follows the last action is the runtime's, not that action's
            rec.segment(trace.RUNTIME)
        if not forward_only and (self.sent_once or self.reduce_at_end):
            self._exchange_once(summed, sends, device)
            for rkey in self.reduce_at_end:
                self._reduce(rkey, summed, grads, rec)
        t0 = time.perf_counter()
        waited = bool(sends)
        sends.wait_all()
        if rec is not None and rec.recording and waited:  # a receiver still busy: exposed
            rec.blocked(t0, time.perf_counter(), "wait sends", trace.RUNTIME, trace.PEER_WAIT)
        if forward_only:
            return (None if not losses else torch.stack(losses).mean()), None, None
        if self.m > 1:
            grads = [g if g is None or i in self.grads_from_r else g.div_(self.m)
                     for i, g in enumerate(grads)]
        if not self.zero:  # (under ZeRO, tied weights are synced after the step instead)
            grads = self._share_grads(grads, params, rec)
        loss = None
        if losses:
            loss = losses[0] if self.m == 1 else torch.stack(losses).mean()
        return loss, grads, new_bufs

    def _accumulated(self, key) -> list[str]:
        """Outputs of part `key` summed over microbatches (gradients, R inputs)."""
        return [n for n in self.parts[key].outputs
                if n in self.grad_of or n in self.reduced_inputs]

    def _running_sums(self, key, grads, summed) -> list | None:
        """The running sums of part `key`'s accumulated outputs, once every one exists (from
        the second microbatch on); None: run the part as it is."""
        names = self._accumulated(key)
        if self.m == 1 or not names or self.graphs is not None:
            return None
        routed = {name for name, local, remote in self._routes(key) if local or remote}
        if any(n in routed or (n in self.reduced_inputs and n in self.grad_of) for n in names):
            return None  # the output another part reads must be this microbatch's own
        sums = [summed.get(n) if n in self.reduced_inputs else grads[self.grad_of[n]]
                for n in names]
        if any(s is None for s in sums) or len(set(map(id, sums))) != len(sums):
            return None
        return sums

    def _fusable(self, n: int, key: str) -> tuple[str, ...]:
        """The reduction parts due after action `n` (part `key`, its running sums passed)
        that can run inside it (`with_reductions`): without a pipeline (a stage's backward
        returns before its outputs go to the previous stage: a reduction inside it would
        hold them back), each reading only this part's running sums."""
        rkeys = self.reduce_after.get(n, ())
        if self.pp > 1 or not rkeys or self.graphs is not None:
            return ()
        acc = set(self._accumulated(key))
        if all(kind == "value" and ref in acc and ref in self.reduced_inputs
               for r in rkeys for kind, ref in self.parts[r].inputs):
            return tuple(rkeys)
        return ()

    def _graph(self, key: str, accumulate: bool, fused: tuple = ()) -> torch.fx.GraphModule:
        """Part `key`'s graph as it runs: as lowered, accumulating into running sums, or that
        followed by the reduction parts `fused`."""
        if fused:
            if (key, fused) not in self._fused_graphs:
                outputs = self.parts[key].outputs
                self._fused_graphs[(key, fused)] = with_reductions(
                    self._accumulating(key),
                    [(self.lowered[r], [outputs.index(ref) for _, ref in self.parts[r].inputs])
                     for r in fused], self.m, hoist=self.hoist)
            return self._fused_graphs[(key, fused)]
        return self._accumulating(key) if accumulate else self.lowered[key]

    def _boxed(self, key: str, accumulate: bool, fused: tuple = ()) -> torch.fx.GraphModule:
        """Part `key`'s graph taking its inputs as one list that it empties (torch.fx's boxed
        calling convention, as AOTAutograd's compiled functions take theirs), so an input
        is freed right after the part's last read of it rather than when the part returns:
        a stage's backward frees the activations it was handed as it makes the gradients,
        as the joint graph's backward does (holding them, a one-microbatch stage of an MoE
        peaked at its activations plus its gradients)."""
        if (key, accumulate, fused) not in self._boxed_graphs:
            gm = self._graph(key, accumulate, fused)
            g = torch.fx.Graph()
            g.output(g.graph_copy(gm.graph, {}))
            g._codegen = torch.fx.graph._BoxedCodeGen()
            out = torch.fx.GraphModule(gm, g)
            out.meta = gm.meta
            self._boxed_graphs[(key, accumulate, fused)] = out
        return self._boxed_graphs[(key, accumulate, fused)]

    def _accumulating(self, key) -> torch.fx.GraphModule:
        """Part `key`'s graph taking the running sums of its accumulated outputs as extra
        inputs and adding each output into its sum in place right after computing it (it
        returns the sums): one microbatch's gradients never all exist next to the sums, so
        accumulating costs the sums, not twice them."""
        if key not in self._acc_graphs:
            gm = self.lowered[key]
            g = torch.fx.Graph()
            out = g.graph_copy(gm.graph, {})
            last = [n for n in g.nodes if n.op == "placeholder"][-1]
            names = self._accumulated(key)
            pos = [self.parts[key].outputs.index(n) for n in names]
            with g.inserting_after(last):
                phs = [g.placeholder(f"running_sum_{j}") for j in reversed(range(len(pos)))]
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            add_ = torch.ops.aten.add_.Tensor
            for j, ph in zip(pos, reversed(phs)):
                node = outs[j]
                own = _sum_of_two(node, outs)
                if own is not None:  # a tied weight's parts: one added into the other in
                    other = node.args[1 - node.args.index(own)]  # place, not a new tensor
                    with g.inserting_after(node):  # (a + b == b + a: the same bits)
                        both = g.call_function(add_, (own, other))
                    with g.inserting_after(both):
                        outs[j] = g.call_function(add_, (ph, both))
                    g.erase_node(node)
                    continue
                with g.inserting_after(node):
                    outs[j] = g.call_function(add_, (ph, node))
            g.output(tuple(outs))
            g.lint()
            self._acc_graphs[key] = torch.fx.GraphModule(gm, g)
        return self._acc_graphs[key]

    def _compute(self, key, label, args, rec, accumulate=False, mb=None, fused=()):
        if rec is not None:
            part = self.parts[key]
            info = {"stage": part.stage, "phase": part.phase}
            if mb is not None:
                info["microbatch"] = mb
            rec.segment(label, trace.CATEGORY[part.phase], info)
        try:
            with torch.no_grad():
                if self.graphs is not None:  # static outputs: the next microbatch's replay
                    return [t.clone() if isinstance(t, torch.Tensor) else t  # overwrites them
                            for t in self.graphs[key](args)]
                if faults.debug_nan():  # node by node
                    return faults.run(self._graph(key, accumulate, fused), *args)
                return self._boxed(key, accumulate, fused)(args)  # (empties `args`)
        except RuntimeError as e:
            part = self.parts[key]
            raise RuntimeError(f"pipeline stage {part.stage} ({label}) on pp rank {self.rank}: "
                               f"{e}") from e

    def _exchange_once(self, summed, sends, device) -> None:
        """The once-a-step values: this rank's sums that another rank's R part reads are
        sent (`sends`: waited on before the step ends), then the ones this rank's R parts read
        are received into `summed`. Each pair of ranks sends and receives them in name
        order (NCCL matches a pair's transfers by order, not tag)."""
        for ref, dst in self.sent_once:
            if ref not in summed:
                raise RuntimeError(f"fxpar bug: value {ref} is read once a step by pp rank "
                                   f"{dst}, but no backward on pp rank {self.rank} made it")
            # (a copy where an R part here reads the sum too: it divides it in place)
            t = summed[ref].clone() if ref in self._local_r else summed[ref]
            sends.add(self._send(t, dst, _ONCE_TAG + self.tag[ref], ref, None), dst)
        for ref in self.received_once:
            buf = self._buffer(ref, device)
            _wait(dist.irecv(_wire(buf), src=self.global_rank[self._src_rank(ref)],
                             tag=_ONCE_TAG + self.tag[ref]))
            summed[ref] = buf

    def _reduce(self, key, summed, grads, rec):
        """Run a stage's gradient reduction once, on the microbatch-mean gradients."""
        part = self.parts[key]
        args = []
        for kind, ref in part.inputs:
            if kind != "value" or ref not in summed:
                raise RuntimeError(f"fxpar bug: gradient reduction {key} reads {kind} {ref}, "
                                   "which no backward on this rank produced; please report it")
            g = summed.pop(ref)
            args.append(g.div_(self.m) if self.m > 1 else g)
        outs = self._compute(key, f"R s{part.stage}", args, rec)
        for name, t in zip(part.outputs, outs):
            i = self.grad_of.get(name)
            if i is not None:
                grads[i] = t

    def _prefetch(self, upcoming, store, device):
        """Post the receives of the next action now (non-blocking), so the transfer runs
        while this action computes."""
        for a in upcoming:
            key = f"{a.kind}{a.stage}"
            part = self.parts.get(key)
            if part is None:
                continue
            if self.stash is not None and self.stash.prefetches:
                for kind, ref in part.inputs:
                    if kind == "value" and isinstance(store.get((ref, a.microbatch)), OnHost):
                        self.stash.prefetch(store[(ref, a.microbatch)])  # start the copy back
            if key not in self._remote_inputs:
                self._remote_inputs[key] = [ref for kind, ref in part.inputs if kind == "value"
                                            and self._src_rank(ref) != self.rank]
            for ref in self._remote_inputs[key]:
                k = (ref, a.microbatch)
                if k not in store and k not in self._pending:
                    buf = self._buffer(ref, device)
                    src = self.global_rank[self._src_rank(ref)]
                    self._pending[k] = (buf, dist.irecv(_wire(buf), src=src,
                                        tag=self.tag[ref] * self.m + a.microbatch),
                                        time.perf_counter())

    def _offload(self, part, outs, mb, nxt, store):
        """Move the values this forward keeps for its own backward to host memory, unless
        the next action on this rank is that backward. A storage moves only if nothing else
        holds it: not a weight or the batch, not a value sent to another rank (the send holds
        it), not a value kept here for another forward; and only device values (a CUDA
        program can keep a host tensor too: moving it frees nothing)."""
        move = []
        for name in part.outputs:
            k = (name, mb)
            cs = self._consumers(name)
            local = [c for c in cs if self.rank_of(self.p.parts[c].stage) == self.rank]
            if k not in store or not isinstance(store[k], torch.Tensor) or not local or \
                    store[k].device.type != self.stash.device.type or \
                    len(local) < len(cs) or any(c[0] == "F" for c in local):
                continue
            if nxt is not None and nxt.microbatch == mb and f"{nxt.kind}{nxt.stage}" in local:
                continue
            move.append(k)
        moving = set(move)
        pinned = self._resident | {v.untyped_storage().data_ptr() for k, v in store.items()
                                   if isinstance(v, torch.Tensor) and k not in moving} | {
            t.untyped_storage().data_ptr() for name, t in zip(part.outputs, outs)
            if isinstance(t, torch.Tensor) and any(
                self.rank_of(self.p.parts[c].stage) != self.rank for c in self._consumers(name))}
        move = [k for k in move if store[k].untyped_storage().data_ptr() not in pinned]
        for k, v in zip(move, self.stash.out([store[k] for k in move])):
            store[k] = v

    def _consumers(self, name) -> list[str]:
        """Parts reading `name` per microbatch (R parts read the step's sum instead)."""
        cs = [c for c in self.p.consumers.get(name, []) if c[0] != "R"]
        return [c for c in cs if c[0] == "F"] if self._forward_only else cs

    def _src_rank(self, name) -> int:
        return self.rank_of(self.p.parts[self.p.producer[name]].stage)

    def _buffer(self, name, device):
        shape, dtype, stride = self.meta[name]
        return torch.empty(shape, dtype=dtype, device=device) if stride is None else \
            torch.empty_strided(shape, stride, dtype=dtype, device=device)

    def _local_consumers(self, name) -> int:
        key = (name, self._forward_only)
        if key not in self._local_count:
            self._local_count[key] = sum(1 for c in self._consumers(name)
                                         if self.rank_of(self.p.parts[c].stage) == self.rank)
        return self._local_count[key]

    def _routes(self, key) -> list[tuple[str, int, list[int]]]:
        """Per output of part `key`: (name, parts on this rank reading it, other pp ranks
        to send it to). Fixed for a program; computed once, not per microbatch."""
        ck = (key, self._forward_only)
        if ck not in self._route_cache:
            self._route_cache[ck] = [
                (name, self._local_consumers(name),
                 sorted({self.rank_of(self.p.parts[c].stage) for c in self._consumers(name)}
                        - {self.rank})) for name in self.parts[key].outputs]
        return self._route_cache[ck]

    def _send(self, t, rank, tag, name, rec):
        shape, dtype, stride = self.meta[name]
        if stride is not None and t.stride() != stride:
            t = torch.empty_strided(shape, stride, dtype=dtype, device=t.device).copy_(t)
        t0 = time.perf_counter()
        w = dist.isend(_wire(t), dst=self.global_rank[rank], tag=tag)
        if rec is not None and rec.recording:
            rec.blocked(t0, time.perf_counter(), f"send {name}", trace.RUNTIME,
                        trace.PEER_WAIT)
        return w

    def _recv(self, name, mb, device, rec):
        src = self._src_rank(name)
        if src == self.rank:
            raise RuntimeError(f"fxpar bug: value {name} (microbatch {mb}) is read on pp rank "
                               f"{self.rank} before the part making it ran; please report it")
        t0 = time.perf_counter()
        if (name, mb) in self._pending:
            buf, work, posted = self._pending.pop((name, mb))
        else:
            buf, posted = self._buffer(name, device), t0
            work = dist.irecv(_wire(buf), src=self.global_rank[src],
                              tag=self.tag[name] * self.m + mb)
        _wait(work)
        if rec is not None and rec.recording:
            t1 = time.perf_counter()
            rec.blocked(t0, t1, f"recv {name}", trace.RUNTIME, trace.PEER_WAIT)
            rec.comm(f"recv {name}", posted, t1, buf.numel() * buf.element_size())
        return buf

    def sync_buffers(self, mutated: list[torch.Tensor]) -> None:
        """After the step: each buffer updated on one stage and held by another rank's stage
        (`buffer_sources`) sent from the rank that updated it to the pp group (the other
        ranks' copies would stay stale: read by the next step, written by saves)."""
        for j, src in self.buffer_sources:
            dist.broadcast(mutated[j], src=self.global_rank[src], group=self.group)

    def sync_tied_params(self, params, buckets):
        """ZeRO: a weight is updated by the rank whose stage owns its gradient bucket, which
        is not always the (only) rank that reads it (a tied embedding; a bias whose gradient
        is computed past a cut): send the new value to every other rank holding a copy."""
        owner = {}
        for k, idx in enumerate(buckets):
            name = self.p.grads[k]
            if name:
                for i in idx:
                    owner[i] = self.rank_of(self.p.parts[self.p.producer[name]].stage)
        works = []
        with torch.no_grad():
            for i, stages in sorted(self.p.param_stages.items()):
                holders = {self.rank_of(s) for s in stages}
                if i not in owner or holders <= {owner[i]}:
                    continue
                src = owner[i]
                if self.rank == src:
                    works += [dist.isend(params[i].detach().contiguous(),
                                         dst=self.global_rank[r], tag=_GRAD_TAG + i)
                              for r in sorted(holders - {src})]
                elif self.rank in holders:
                    works.append(dist.irecv(params[i].data, src=self.global_rank[src],
                                            tag=_GRAD_TAG + i))
        for w in works:
            _wait(w)

    def _share_grads(self, grads, params, rec):
        """A weight several stages read: its summed gradient goes from the rank that made it
        to every other rank holding a copy."""
        works, nbytes, t0 = [], 0, time.perf_counter()
        for i, stages in sorted(self.p.param_stages.items()):
            name = self.p.grads[i] if i < len(self.p.grads) else None
            if name is None or name not in self.p.producer:
                continue
            src = self.rank_of(self.p.parts[self.p.producer[name]].stage)
            holders = {self.rank_of(s) for s in stages} - {src}
            if self.rank == src:
                for r in sorted(holders):
                    works.append(dist.isend(grads[i].contiguous(), dst=self.global_rank[r],
                                            tag=_GRAD_TAG + i))
            elif self.rank in holders:
                grads[i] = torch.empty_like(params[i])
                works.append(dist.irecv(grads[i], src=self.global_rank[src], tag=_GRAD_TAG + i))
                nbytes += grads[i].numel() * grads[i].element_size()
        for w in works:
            _wait(w)
        if works and rec is not None and rec.recording:  # waiting on the other stage
            t1 = time.perf_counter()
            rec.blocked(t0, t1, "share tied grads", trace.RUNTIME)
            if nbytes:
                rec.comm("recv tied grads", t0, t1, nbytes)
        held = set(self.held_params)
        return [g if i in held else None for i, g in enumerate(grads)]

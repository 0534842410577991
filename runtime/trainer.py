"""ParallelModel: one rank's training state built from a Program, and its step.

It runs Programs and nothing else (docs/design.md section 2): the Program from fxpar.compile is
bound to this rank's process groups (runtime/comm.bind_groups), the user's parameters become
this rank's tp / ZeRO shards, the optimizer is built over what this rank holds, and step()
runs the graph (runtime/executor) or the pipeline schedule (runtime/pipeline). It imports no
pass and not the planner; fxpar.parallelize (api/parallelize.py) wires the two together.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from fxpar.core import graphs, ir, schedules
from fxpar.core.errors import BatchIndexError, CodegenError, PlanError
from fxpar.core.logs import Clock
from fxpar.runtime import amp, bucket_updates, calls, comm, cudagraph, executor, faults, optim
from fxpar.runtime import index_check
from fxpar.runtime import verify
from fxpar.runtime import checkpoint as rckpt
from fxpar.runtime import model_state
from fxpar.runtime import dist as rdist
from fxpar.runtime import tp_slices as rtp
from fxpar.runtime import weights as rweights
from fxpar.runtime import trace as rtrace
from fxpar.runtime.host_optimizer import HostOptimizer
from fxpar.runtime.onebit_adam import OneBitAdam
from fxpar.runtime import param_server
from fxpar.runtime.pipeline import PipelineRunner
from fxpar.runtime.zero import ShardedOptimizer

log = logging.getLogger(__name__)


def to_device(batch, device):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


def _refuse(why: str):
    def refused(*args, **kwargs):
        raise PlanError(why)
    return refused


def held_names(program: ir.Program, ep_rank: int) -> list[str | None]:
    """Per parameter index, the name of the user's parameter this rank's program holds
    there: its own, except under ep for experts kept as an nn.ModuleList (a slot holds this
    ep rank's expert of the slot; another rank's expert is held by nobody here: None)."""
    names = list(program.signature.param_names)
    for slot in program.expert_slots:
        names[slot[0]] = program.signature.param_names[slot[ep_rank]]
        for k in slot[1:]:
            names[k] = None
    return names


def _tiled(leaves, shard_dims, dp):
    return [torch.cat([t] * dp, d) if d is not None else t for t, d in zip(leaves, shard_dims)]


class ParallelModel:
    """A model compiled for a Plan; `step(batch)` is one full training step.

    This rank's state, public for checkpointing (runtime/checkpoint.py) and tools: `params`
    (the parameter tensors in `program.signature` order: tp slices; with ZeRO-3 emptied,
    the shards live in the sharded optimizer; for a meta-device model, 0-element tensors
    where this rank's pipeline stages do not need the weight, see `needed_params`; under ep,
    a listed experts' slot holds this rank's expert: `held_names`, and another rank's
    expert a 0-element stand-in), `param_index_of` (id of each of the user's parameters ->
    its index), `buffers`, `sharded_optimizer` (ZeRO: runtime/zero.ShardedOptimizer, else
    None), `optimizer`, `pipeline_runner` (pp > 1 or microbatches:
    runtime/pipeline.PipelineRunner, else None), `tp_group`, `scaler`."""

    plan_report = None  # plan="auto": the planner's PlanResult (from program.plan_report)
    # plan="auto": after this many steps the planner's cost model is re-fitted to the
    # measured step time (api/parallelize._refit_planner, through `on_measured`)
    REFIT_AFTER = 8

    def __init__(self, model, world, program: ir.Program, optimizer=None,
                 on_measured: Callable[[float], None] | None = None,
                 weights: rweights.ModelWeights | None = None, batch: str = "global",
                 loss_of: Callable | None = None, generate: Callable | None = None,
                 ps_group=None):
        """`program` from fxpar.compile, bound here to `world`'s process groups; `model` is
        the user's module (its tensors become this rank's shards). `on_measured(step_s)` is
        called once, after REFIT_AFTER steps, with the median measured step time (the
        slowest rank's): fxpar.parallelize re-fits the planner with it. `weights`
        (runtime/weights.ModelWeights): where the tensors come from for a meta-device model
        or weights=PATH; each rank then reads and allocates only what it owns (None: the
        model's tensors are real and on this rank's device, and are sliced here).
        `loss_of(model, batch)`: the scalar loss in eager PyTorch, for Plan.verify's
        reference step (runtime/verify.py). `generate(gm, device, name, strict)`: the
        compiler's code generator (compiler/codegen.generate), handed in by fxpar.parallelize
        so the runtime imports no compiler: it runs this rank's graphs through it when
        program.codegen is "inductor". `ps_group`: with Plan.ps, the gloo group of the whole
        job the pushes and pulls go over (this rank is a worker: `world` spans the workers).
        self.compile_times: the program's rows, then this set-up's (lowering, weights,
        shards, optimizer)."""
        clock = Clock(log)
        plan = program.plan
        self.model, self.world, self.plan, self.program = model, world, plan, program
        # collective methods agree first on what is called (runtime/calls.py)
        self._call_id = calls.register(rdist.timeout())
        self.plan_report = program.plan_report
        self.stage_graphs = program.stage_graphs
        self.fusion_skipped = program.fusion_skipped
        self._on_measured = on_measured
        self._verify = (loss_of, optimizer) if plan.verify else None
        self.generate = generate
        self._verify_at = 1  # the step checked: the first (one fp16 skipped: the next)
        if batch not in ("global", "local"):
            raise PlanError(f"batch={batch!r}: use 'global' (every rank passes the same global "
                            "batch to step) or 'local' (each rank passes its 1/dp share).")
        self.batch = batch
        with clock("bind groups"):  # (a bound copy: the Program passed in stays as it was)
            self.program = program = comm.bind_groups(
                program, {ir.GROUPS[d]: world.group_name(d) for d in ir.GROUPS
                          if world.group_name(d) is not None})
        self._eval_program = None
        self._lowered: dict[int, torch.fx.GraphModule] = {}
        self.recorder = rtrace.Recorder(world.rank)
        sig = self.program.signature
        params = dict(model.named_parameters(remove_duplicate=False))  # tied weights: any name
        # the user's full shapes (checkpoints, save_pretrained: the rank holds slices)
        self.param_shapes = [torch.Size(params[n].shape) for n in sig.param_names]
        self.tp_group = world.mesh.get_group("tp") if plan.tp > 1 else None
        self.ep_group = world.mesh.get_group("ep") if program.ep > 1 else None
        # ep's expert weights: grouped experts' slices (splits_of), and the slots of experts
        # kept as an nn.ModuleList, each bound to this ep rank's expert (held_names); ZeRO
        # shards both over the ranks holding the same experts
        self._expert_slices = frozenset(program.expert_params)
        self._experts = self._expert_slices | {s[0] for s in program.expert_slots}
        self.held_names = held_names(program, world.coordinate("ep") if program.ep > 1 else 0)
        # each parameter's shape in this rank's program before ZeRO-3 (its tp slice, its
        # experts under ep; nothing for another rank's listed expert)
        self.local_shapes = [torch.Size(rweights.run_length(x) for x in rweights.split_runs(
            shape, self.splits_of(i))) if self.held_names[i] else
            torch.Size([0]) for i, shape in enumerate(self.param_shapes)]
        # a listed expert's index -> (the slot holding it, the ep rank whose slot it is)
        self._slot_of = {k: (s[0], r) for s in program.expert_slots for r, k in enumerate(s)}
        self.sharded_optimizer = None
        self.pipeline_runner = None
        # Plan.codegen: the graphs this rank runs, compiled (compiler/codegen.py)
        self._generated: dict[int, torch.fx.GraphModule] = {}
        if self.program.pipeline is not None:
            pp_rank = world.coordinate("pp")
            parts = {k: p.graph for k, p in self.program.pipeline.parts.items()
                     if schedules.stage_to_rank(p.stage, plan.pp) == pp_rank}
            generated = self._codegen(program, parts, clock)
            with clock("comm lowering"):  # (of each stage's graph)
                self.pipeline_runner = PipelineRunner(self.program, pp_rank,
                                                      world.group_name("pp"), generated)
        else:
            parts = {"joint": program.graph}
            generated = self._codegen(program, parts, clock)
            self._generated[id(program)] = generated["joint"]
        if program.codegen == "inductor" and generated is not parts:
            # (a ChainMap: a loaded Program's snapshots stay undecoded until read)
            self.stage_graphs = collections.ChainMap(
                {"codegen": _marked_runs(parts, generated)}, program.stage_graphs)
        zero3_shards = None
        if weights is not None:  # only this rank's part of each tensor is read and made
            with clock("materialise weights"):
                zero3_shards = self._materialize(weights)
            params = dict(model.named_parameters(remove_duplicate=False))
        self.params = [params[n] if n else torch.nn.Parameter(torch.empty(
            0, dtype=params[sig.param_names[i]].dtype, device=world.device), requires_grad=False)
            for i, n in enumerate(self.held_names)]
        # the parameter index of each of the user's parameters (by tensor: tied names share;
        # after materialising, which replaces a meta-device model's parameters)
        self.param_index_of = {id(params[n]): i for i, n in enumerate(sig.param_names)}
        if weights is None and program.expert_slots:  # (the other ep ranks' listed experts)
            with torch.no_grad():
                for n in set(sig.param_names) - set(self.held_names):
                    params[n].data = params[n].data.new_empty(0)
        if weights is None:
            with clock("shard parameters"), torch.no_grad():  # tp, ep: this rank's slices
                for i, p in enumerate(self.params):
                    splits = self.splits_of(i)
                    if splits:
                        p.data = rtp.local_of(p.data, splits)
        buffers = dict(model.named_buffers(remove_duplicate=False))
        t_opt = time.perf_counter()
        self.host_optimizer = None  # Plan.offload_optimizer: runtime/host_optimizer.py
        if plan.offload_optimizer and isinstance(optimizer, torch.optim.Optimizer):
            raise PlanError(
                "Plan.offload_optimizer builds the optimizer over host copies of this rank's "
                "tensors, so fxpar must build it: pass a factory, e.g. `optimizer=lambda ps: "
                "torch.optim.AdamW(ps, lr=1e-3)`, not an instance.")
        self.ps = None  # Plan.ps: this worker's side (runtime/param_server.py)
        if plan.ps:
            param_server.check_optimizer(optimizer)
            self.optimizer = None  # (the servers own it)
            servers = list(range(plan.dp, plan.dp + plan.ps))
            self.ps = param_server.Worker(
                self.params, [t and p.requires_grad for t, p in zip(param_server.trained(
                    program.graph, len(self.params)), self.params)],
                servers, plan.ps_staleness, ps_group)
            for name, why in param_server.UNSUPPORTED.items():  # (before any collective)
                setattr(self, name, _refuse(why))
        elif self.program.zero:
            if isinstance(optimizer, torch.optim.Optimizer):
                raise PlanError(
                    f"Plan.zero={plan.zero} shards the optimizer state, so fxpar must build the "
                    "optimizer over this rank's shards: pass a factory, e.g. "
                    "`optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)`, not an instance.")
            factory = optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3))
            buckets = self.program.zero_buckets if self.pipeline_runner is None else [
                self.program.zero_buckets[k] for k in self.pipeline_runner.held_buckets]
            self.sharded_optimizer = ShardedOptimizer(
                lambda ps: optim.build(factory, ps), self.params, buckets, plan.shard_ranks,
                world.coordinate(self.zero_axis), world.mesh.get_group(self.zero_axis),
                shard_params=self.program.params_sharded, param_shards=zero3_shards,
                shapes=self.local_shapes, offload_to_host=plan.offload_optimizer,
                experts=self._experts, expert_group=(
                    *self._zero_ranks(next(iter(self._experts))),
                    world.mesh.get_group(self._expert_zero_axis)) if self._experts else None)
            self.optimizer = self.sharded_optimizer.optimizer
            self.host_optimizer = self.sharded_optimizer.host
        elif self.pipeline_runner is not None:  # this rank's stages' parameters only
            held = [self.params[i] for i in self.pipeline_runner.held_params]
            self.optimizer = None if not held else self._optimizer_over(optimizer, held)
        else:  # (None above: a pipeline rank whose stages hold no weights)
            self.optimizer = self._optimizer_over(optimizer, list(model.parameters()))
        # Inductor compiles the graph, or the optimizer steps on the CPU: the update is
        # torch's fused kernel where the user let torch choose (runtime/optim.prefer_fused)
        self.optimizer_fused = (program.codegen == "inductor" or plan.offload_optimizer) \
            and optim.prefer_fused(self.optimizer)
        # Plan.grad_compression: 1-bit Adam's compressed phase (runtime/onebit_adam.py)
        self.onebit = OneBitAdam(self.optimizer, plan.compression_warmup, plan.dp,
                                 world.coordinate("dp"), world.group_name("dp")) \
            if plan.grad_compression == "1bit-adam" else None
        self._local_program = None  # its program (the graph without gradient all-reduces)
        clock.add("optimizer", time.perf_counter() - t_opt)
        self.buffers = [buffers[n] for n in sig.buffer_names]
        self._mutated_buffers = [buffers[n] for n in sig.mutated_buffers]
        # fp16: the dynamic loss scale (runtime/amp.py); None for fp32 / bf16
        self.scaler = amp.GradScaler() if self.program.loss_scale else None
        self.cuda_graphs = self._cuda_graph_decision()  # runtime/cudagraph.Decision
        # dp on CPU: each gradient bucket stepped while the later ones are still reduced
        self._bucket_updates: bucket_updates.BucketUpdates | None = None
        if self.pipeline_runner is None and self.ps is None and not self.cuda_graphs.capture:
            with clock("comm lowering"):  # now, not in the first step
                self._lowered[id(program)] = comm.lower(
                    self._updates_between_waits(self._generated[id(program)]))
        self._graphed: cudagraph.GraphedStep | None = None  # built at the first step
        self._norm_plan = None  # which gradient elements this rank counts (built on use)
        self.last_grad_norm = None  # the last step's global gradient norm (when computed)
        self.step_count = 0  # steps done = global batches consumed (saved by `save`)
        self._state_plain: bool | None = None  # (state_is_plain, found on first use)
        self._indices_checked: set[int] = set()  # programs whose batch indices were checked
        self.compile_times = [*program.compile_times, *clock.rows(other=False)]
        if self.ps is not None:  # its graph (without the gradient all-reduce): now
            self._local()

    def _optimizer_over(self, optimizer, tensors: list[torch.Tensor]):
        """The user's optimizer over `tensors` (an instance as given); with
        Plan.offload_optimizer over their host copies, which `self.host_optimizer` keeps and
        the step calls (runtime/host_optimizer.py; a frozen parameter is never stepped: no
        copy)."""
        if not self.plan.offload_optimizer:
            return optim.build(optimizer, tensors)
        self.host_optimizer = HostOptimizer(lambda ps: optim.build(optimizer, ps),
                                            [t for t in tensors if t.requires_grad],
                                            self.world.device)
        return self.host_optimizer.optimizer

    @property
    def _stepper(self):
        """What steps this rank's tensors from their `.grad`: the optimizer, or with
        Plan.offload_optimizer its host keeper (unless pm.optimizer was replaced)."""
        h = self.host_optimizer
        return h if h is not None and self.optimizer is h.optimizer else self.optimizer

    def _updates_between_waits(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Plain dp on CPU: the graph with an optimizer update after each gradient bucket's
        wait (runtime/bucket_updates.py), so a reduced bucket is stepped while the later
        buckets' all-reduces are still in flight - the tail of the step the compute thread
        otherwise spends waiting. Not with ZeRO (the shards' all-gather follows the step),
        gradient clipping or fp16's loss scale (both need every gradient first), an
        optimizer torch does not update per parameter, or on GPUs (not measured there)."""
        if self.program.dp == 1 or self.program.zero or self.world.device.type != "cpu" or \
                self.host_optimizer is not None or \
                self.plan.max_grad_norm is not None or self.scaler is not None or \
                bucket_updates.splittable(self.optimizer, self.params) is not None:
            return gm
        interleaved, buckets = bucket_updates.interleave(gm, len(self.params))
        if interleaved is None:
            return gm
        self._bucket_updates = bucket_updates.BucketUpdates(self.optimizer, self.params,
                                                            buckets)
        return interleaved

    def needed_params(self) -> set[int]:
        """Parameters whose values this rank needs: those its pipeline stages read or whose
        ZeRO bucket it steps; a parameter no stage reads lives on the first stage's ranks."""
        r = self.pipeline_runner
        n = len(self.param_shapes)
        if r is None or self.plan.pp == 1:
            return set(range(n))
        need = set(r.held_params) | {i for k in r.held_buckets
                                     for i in self.program.zero_buckets[k]}
        if r.rank_of(0) == r.rank:
            need |= set(range(n)) - set(r.p.param_stages)
        return need

    def _materialize(self, weights: rweights.ModelWeights) -> dict[int, torch.Tensor] | None:
        """A meta-device model (or weights=PATH): read this rank's tensor-parallel slice of
        each parameter it needs (with ZeRO-3 only its 1/dp flat shard of that slice) from
        `weights`, straight onto the device, then put them in the model; buffers whole.
        Nothing is made whole but a module being initialised (weights=None). Returns the
        ZeRO-3 shards by parameter index (None without ZeRO-3)."""
        sig, dev = self.program.signature, self.world.device
        model_params = dict(self.model.named_parameters(remove_duplicate=False))
        need = self.needed_params()
        local, shards = {}, {} if self.program.params_sharded else None
        for i, name in enumerate(self.held_names):
            if i not in need or name is None:
                continue
            p = model_params[name]
            runs = rweights.split_runs(tuple(p.shape), self.splits_of(i))
            src, key = weights.locate(name)
            if shards is not None:  # ZeRO-3: the rows covering this rank's flat slice only
                rows, off, n, size = rweights.flat_shard_rows(runs, *self._zero_ranks(i))
                shard = torch.zeros(size, dtype=p.dtype, device=dev)
                if n:
                    shard[:n] = src.read_runs(key, rows).reshape(-1)[off:off + n]
                shards[i] = shard
            else:
                local[i] = src.read_runs(key, runs).to(device=dev, dtype=p.dtype, copy=True)
        bufs = {}
        for name, b in self.model.named_buffers():  # (one name per tensor) whole
            src, key = weights.locate(name)
            bufs[name] = src.read(key, (...,)).to(device=dev, dtype=b.dtype, copy=True)
        weights.release()  # (the last module initialised or tensors converted whole)
        rweights.unmeta(self.model, dev)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        bound = {name: i for i, name in enumerate(self.held_names) if name}
        with torch.no_grad():
            for name in sig.param_names:
                p, i = params[name], bound.get(name)
                p.data = local[i] if i in local else torch.empty(0, dtype=p.dtype, device=dev)
            for name, t in bufs.items():
                buffers[name].data = t
        return shards

    def _codegen(self, program, graphs: dict[str, torch.fx.GraphModule], clock
                 ) -> dict[str, torch.fx.GraphModule]:
        """Plan.codegen: `graphs` (this rank's, by name) compiled by Inductor, one row per
        graph in the compile times. Ranks holding the same graphs compile in turn: the first
        of each pipeline stage (dp and tp coordinate 0) compiles, then the others load its
        compiled runs from the cache (compiler/codegen.cache_dir). A failure is raised on
        every rank."""
        if program.codegen != "inductor":
            return graphs
        if self.generate is None:
            raise PlanError("this Program's codegen is \"inductor\" but the ParallelModel was "
                            "given no code generator: build it with fxpar.parallelize, or pass "
                            "generate=fxpar.compiler.codegen.generate")
        if faults.debug_nan():
            log.info("codegen: FXPAR_DEBUG_NAN runs the graph node by node (no Inductor)")
            return graphs
        world = self.world
        first = world.coordinate("dp") == 0 and world.coordinate("tp") == 0
        out: dict[str, torch.fx.GraphModule] = {}

        def generate() -> BaseException | None:
            try:
                for name, gm in graphs.items():
                    t0 = time.perf_counter()
                    out[name] = self.generate(gm, world.device, name,
                                                 strict=program.plan.codegen == "inductor")
                    clock.add(f"codegen {name}", time.perf_counter() - t0, detail=out[
                        name].meta["codegen"].summary())
            except Exception as e:  # noqa: BLE001 - every rank raises it (below), none hangs
                return e
            return None

        def raise_on_every_rank(error: BaseException | None) -> None:
            """Every rank passes here: a failure on any rank is raised on all of them (a
            rank alone raising would leave the others waiting at their first collective)."""
            if world.size > 1:
                errors = [None] * world.size
                dist.all_gather_object(errors, None if error is None else
                                       f"{type(error).__name__}: {error}", group=world.group)
                failed = [(r, e) for r, e in enumerate(errors) if e]
                if failed and error is None:
                    r, e = failed[0]
                    raise CodegenError(f"rank {r}: {e}")
            if error is not None:
                raise error
        # the first ranks compile, the others then load their runs from the cache (the first
        # exchange is also the barrier for it); a rank that still fails (a strict codegen on
        # a node whose cache is not shared) is raised on every rank too
        raise_on_every_rank(generate() if first else None)
        if world.size > 1:
            raise_on_every_rank(None if first else generate())
        return out

    def _cuda_graph_decision(self) -> cudagraph.Decision:
        """Plan.cuda_graphs: whether this rank's step is replayed as a CUDA graph."""
        backend = dist.get_backend() if dist.is_initialized() else None
        d = cudagraph.decide(self.program, self.plan.cuda_graphs, self.world.device, backend,
                             faults.debug_nan())
        if not d.capture and self.plan.cuda_graphs is True:
            raise PlanError(f"Plan.cuda_graphs=True, but this rank's step cannot be captured as "
                            f"a CUDA graph: {d.reason}. Use cuda_graphs='auto' to run it "
                            "uncaptured (logged), or False.")
        if not d.capture and self.world.device.type == "cuda":
            log.info("the step runs without CUDA graphs: %s", d.reason)
        if d.capture and self.pipeline_runner is not None:
            self.pipeline_runner.use_cuda_graphs(self.world.device)
        return d

    def _uncaptured(self, e: Exception):
        """A capture that torch refused (an op that copies to or from the host inside a
        kernel call, which the graph's static check cannot see): under "auto" the step runs
        uncaptured from now on, logged; Plan.cuda_graphs=True raises."""
        reason = f"torch refused to capture the step: {e}"
        if self.plan.cuda_graphs is True:
            raise PlanError(f"Plan.cuda_graphs=True, but {reason}. Use cuda_graphs='auto' to "
                            "run it uncaptured (logged), or False.") from e
        log.warning("the step runs without CUDA graphs: %s", reason)
        self.cuda_graphs = cudagraph.Decision(False, reason)
        self._graphed = None

    # --- training ---------------------------------------------------------------------------
    def _leaves(self, tree, program) -> list[torch.Tensor]:
        """The batch's leaves on this rank's device, cut to this dp rank's share (with
        batch='local' the user gave that share)."""
        if self.batch == "local":
            leaves = ir.flatten_batch(tree, program.signature,
                                      local=(program.batch_shard_dims, program.rows))
            return [t.to(self.world.device, non_blocking=True) for t in leaves]
        return executor.local_batch(ir.flatten_batch(tree, program.signature), program,
                                    self.dp_rank, self.world.device)

    @property
    def ps_stats(self) -> dict | None:
        """Plan.ps: this worker's pushes and the steps it skipped (asynchronous: applied
        without it); else None."""
        return dict(self.ps.stats) if self.ps is not None else None

    @property
    def zero_axis(self) -> str:
        """The mesh dimension ZeRO shards over: "dp", or HSDP's shard group."""
        return "dp_shard" if self.plan.hsdp else "dp"

    @property
    def _expert_zero_axis(self) -> str:
        """The mesh dimension ZeRO shards expert weights over under ep: the ranks holding the
        same experts ("edp"), with HSDP those of this rank's shard group."""
        return "edp_shard" if self.plan.hsdp else "edp"

    def _zero_ranks(self, i: int) -> tuple[int, int]:
        """(ranks, this rank's index) ZeRO shards parameter i over: the zero axis, or for an
        expert weight under ep `_expert_zero_axis`."""
        if i in self._experts:
            return (self.plan.shard_ranks // self.program.ep,
                    self.world.coordinate(self._expert_zero_axis))
        return self.plan.shard_ranks, self.world.coordinate(self.zero_axis)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (for a DistributedSampler's `rank`); with
        Plan.cp, its cp group's (the group's ranks take the same rows)."""
        return self.world.coordinate("cdp" if self.plan.cp > 1 else "dp")

    @property
    def codegen_result(self) -> ir.Generated | None:
        """What code generation did for this rank's graphs so far (compiled runs, cache
        hits, ops left op by op); None when they run op by op."""
        graphs = [*self._generated.values(), *(self.pipeline_runner.run_graphs.values()
                                              if self.pipeline_runner else [])]
        done = [gm.meta["codegen"] for gm in graphs if "codegen" in gm.meta]
        return ir.Generated.combined(done) if done else None

    @property
    def codegen_summary(self) -> str:
        """What runs this rank's graphs (Plan.codegen), in one line."""
        done = self.codegen_result
        if done is None:
            return f"op by op ({self.program.codegen_why or 'FXPAR_DEBUG_NAN'})"
        line = f"Inductor: {done.summary()}, {done.seconds:.1f} s"
        if self.optimizer_fused:
            line += f"; optimizer: torch's fused {type(self.optimizer).__name__} kernel"
        return line

    @property
    def dp_size(self) -> int:
        """How many ways the batch's rows split (a DistributedSampler's `num_replicas`): the
        data-parallel degree, over cp with Plan.cp."""
        return self.plan.dp // self.plan.cp

    def _run(self, program, batch):
        local = self._leaves(batch, program)
        if program.loss_scale:
            local.append(self.scaler.scale_tensor(self.world.device))
        params = self.sharded_optimizer.param_shards if program.params_sharded else self.params
        if program is self.program and self.cuda_graphs.capture:
            calls.settle()  # the replay's collectives do not pass through runtime/comm
            # the unlowered graph, replayed: no region markers (host calls are not replayed)
            self.recorder.segment("forward+backward")
            if self._graphed is None:  # the graph's functional collectives are capturable
                gm = self._generated.get(id(program), program.graph)
                self._graphed = cudagraph.GraphedStep(
                    lambda *a: executor.run_graph(gm, a, (), ()),
                    [True] * (len(params) + len(self.buffers)) + [False] * len(local),
                    self.world.device)
            try:
                outs = list(self._graphed([*params, *self.buffers, *local]))
            except cudagraph.CaptureFailed as e:
                self._uncaptured(e)
                return self._run(program, batch)  # a failed capture ran nothing
            outs[0] = outs[0].clone()  # the static output is overwritten by the next replay
            return outs
        gm = self._lowered.get(id(program))
        if gm is None:
            gm = self._lowered[id(program)] = comm.lower(
                self._generated.get(id(program), program.graph))
        return executor.run_graph(gm, params, self.buffers, local)

    def _run_pipeline(self, program, runner, batch, rec=None, forward_only=False):
        """All microbatches through this rank's stages; the loss on every rank."""
        # (the step's call check is settled at its first communication: the loss count's
        # all-reduce below, a transfer waited on (runtime/pipeline._wait), a tp
        # collective, or after the run where this rank had none)
        batch = to_device(batch, self.world.device)
        local = self.batch == "local"
        trees = ir.microbatches(batch, program.microbatches, 1 if local else program.rows) \
            if program.microbatches > 1 else [batch]
        mbs = [self._leaves(t, program) for t in trees]
        if program.loss_scale:
            for leaves in mbs:
                leaves.append(self.scaler.scale_tensor(self.world.device))
        if program.loss_count is not None:  # the whole step's target count, shared out
            with torch.no_grad():
                if not local:
                    total = sum(program.loss_count(*ir.flatten_batch(t, program.signature))
                                for t in trees)  # int64
                else:  # the counter was traced at the global shape and counts row by row:
                    # this share tiled `rows` times counts `rows` times its targets
                    rows = program.rows
                    total = sum(program.loss_count(*_tiled(ir.flatten_batch(
                        t, program.signature, (program.batch_shard_dims, rows)),
                        program.batch_shard_dims, rows)) for t in trees) // rows
                    if rows > 1:  # the other row groups' targets count too (a cp group's
                        # ranks hold the same rows)
                        calls.settle()
                        dist.all_reduce(total, group=self.world.mesh.get_group(
                            "cdp" if program.cp > 1 else "dp"))
                share = (total / program.microbatches).to(program.loss_count.meta[ir.COUNTER_DTYPE])
            for leaves in mbs:
                leaves.append(share)
        params = self.sharded_optimizer.param_shards if program.params_sharded else self.params
        loss, grads, new_bufs = runner.run(params, self.buffers, mbs, self.world.device,
                                           rec, forward_only)
        calls.settle()
        if program.pp > 1:  # the loss's stage has it (the last, unless the split left the
            # stages after it empty): every rank returns it
            pipe = program.pipeline
            owner = runner.global_rank[runner.rank_of(pipe.parts[pipe.producer[pipe.loss]].stage)]
            if loss is None:
                loss = torch.empty((), device=self.world.device)
            comm.timed("broadcast loss", loss.element_size(),
                       lambda: dist.broadcast(loss, src=owner, group=runner.group))
        return loss, grads, new_bufs

    def step(self, batch) -> torch.Tensor:
        """One training step on the GLOBAL batch; returns its mean loss (same on every rank;
        an asynchronous Plan.ps worker: the loss of its own share, None for a step the
        servers applied without it).
        `pm.step_count` counts the steps done (restored by `load`). A rank that fails makes
        every rank raise (RankFailure naming the rank and the step); a NaN/inf loss raises
        NonFiniteLossError before the optimizer applies it (runtime/faults.py)."""
        n = getattr(self, "step_count", 0) + 1
        if self.ps is not None and self.ps.skips(n - 1):  # Plan.ps asynchronous: applied
            self.step_count = n  # without this worker
            return None
        with faults.step_context(self.world, n):
            # every rank steps now: checked (calls.settle) before the step's first collective
            # (not an asynchronous parameter-server job: its ranks do not step together)
            if self.ps is None or not self.ps.asynchronous:
                calls.begin(self._call_id, "step", raw_errors=True)
            with self._named_index_errors(self.program, batch, f"step {n}"):
                if self._verify is not None and n == self._verify_at:  # Plan.verify
                    loss, checked = verify.first_step(self, batch, *self._verify,
                                                      self._train_step)
                    if not checked:  # fp16: the update was skipped (inf gradients): the next
                        self._verify_at = n + 1
                else:
                    loss = self._train_step(batch)
            calls.settle()
        self.step_count = n
        if n == self.REFIT_AFTER and self._on_measured is not None \
                and self.plan_report is not None:  # a planned job: a collective, all ranks
            self._report_measured()
        return loss

    @contextlib.contextmanager
    def _named_index_errors(self, program, batch, when: str):
        """An embedding id or class target of `batch` out of its table's range raises
        BatchIndexError naming the op, its module and the cause (runtime/index_check.py),
        not ATen's bare IndexError or an Inductor kernel's bounds check. Checked before
        `program`'s first run (Inductor's CPU kernels may abort the process instead of
        raising) and after a run raised an index-type error: later runs pay nothing."""
        if id(program) not in self._indices_checked:
            self._indices_checked.add(id(program))
            self._raise_bad_index(program, batch, when)
        try:
            yield
        except (IndexError, RuntimeError) as e:
            if isinstance(e, BatchIndexError) or not index_check.is_index_error(e):
                raise
            self._raise_bad_index(program, batch, when, e)
            raise

    def _raise_bad_index(self, program, batch, when: str, error=None) -> None:
        """Raise BatchIndexError if an index op of this rank's graphs for `program` reads an
        out-of-range value of `batch` (the check is a diagnosis: its own failure is logged
        and the run goes on to raise whatever it raises)."""
        try:
            found = next(filter(None, (index_check.bad_index(gm, inputs) for gm, inputs
                                       in self._batch_inputs(program, batch))), None)
        except Exception:  # noqa: BLE001 - never in the way of the step or its own error
            log.debug("index check of %s failed", when, exc_info=True)
            return
        if found is not None:
            raise BatchIndexError(f"{when}: {found}") from error

    def _batch_inputs(self, program, batch):
        """(graph, {batch placeholder: (this rank's value, its path in the batch)}) for each
        graph this rank runs for `program` (each pipeline part, each microbatch)."""
        paths = [torch.utils._pytree.keystr(p) for p, v in
                 torch.utils._pytree.tree_flatten_with_path(batch)[0]
                 if isinstance(v, torch.Tensor)]
        if self.pipeline_runner is None or program is not self.program:
            sig = program.signature
            skip = len(sig.param_names) + len(sig.buffer_names)
            phs = [n for n in program.graph.graph.nodes if n.op == "placeholder"][skip:]
            yield program.graph, {ph: (v, p) for ph, v, p in
                                  zip(phs, self._leaves(batch, program), paths)}
            return
        trees = ir.microbatches(batch, program.microbatches, 1 if self.batch == "local" else
                                program.rows) if program.microbatches > 1 else [batch]
        for tree in trees:
            leaves = self._leaves(tree, program)
            for part in self.pipeline_runner.parts.values():
                phs = [n for n in part.graph.graph.nodes if n.op == "placeholder"]
                yield part.graph, {ph: (leaves[ref], paths[ref]) for (kind, ref), ph in
                                   zip(part.inputs, phs) if kind == "batch" and
                                   ref < len(leaves)}

    def _report_measured(self) -> None:
        """Hand the measured step time (median of the steps after the first two; a step
        lasts as long as its slowest rank) to `on_measured`."""
        times = sorted(s.time_s for s in list(self.recorder.stats)[2:])
        if not times:
            return
        t = torch.tensor([times[len(times) // 2]], dtype=torch.float64)
        if self.world.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world.group)
        self._on_measured(float(t))

    def _train_step(self, batch) -> torch.Tensor:
        if self.pipeline_runner is not None:  # (before the first action: splitting the batch)
            with executor.recording(self.recorder, rtrace.RUNTIME) as rec:
                loss, grads, new_bufs = self._run_pipeline(self.program,
                                                           self.pipeline_runner, batch,
                                                           rec)
                calls.settle()
                faults.check_loss(loss, self.plan)
                rec.segment("optimizer")
                held = self.pipeline_runner.held_params
                if self.sharded_optimizer is not None:
                    shards = [grads[k] for k in self.pipeline_runner.held_buckets]
                    if self._finish_grads(shards):
                        self.sharded_optimizer.step(shards)
                    self.pipeline_runner.sync_tied_params(  # ZeRO-3: the shards
                        self.sharded_optimizer.param_shards if self.program.params_sharded
                        else self.params, self.program.zero_buckets)
                elif not self._finish_grads(grads):
                    pass  # fp16 overflow on some rank: every rank skips this update
                elif self.optimizer is not None:
                    optim.apply_gradients(self._stepper, [self.params[i] for i in held],
                                          [grads[i] for i in held])
                self._update_buffers(new_bufs)
                self.pipeline_runner.sync_buffers(self._mutated_buffers)
            return loss.detach()
        n = self.step_count + 1
        if self.ps is not None:  # Plan.ps: the servers step the parameters
            program = self._local()
            with executor.recording(self.recorder) as rec:
                outs = self._run(program, batch)
                k = len(self.params)
                loss, grads, new_bufs = outs[0], outs[1:1 + k], outs[1 + k:]
                calls.settle()
                rec.segment("parameter server")
                self.ps.exchange(n - 1, grads, loss)  # (a non-finite loss: pushed, the
                faults.check_loss(loss, self.plan)   # servers raise too)
                self._update_buffers(new_bufs)
            return loss.detach()
        # Plan.grad_compression past its warm-up: 1-bit Adam steps (runtime/onebit_adam.py),
        # on the graph without gradient all-reduces except at a refresh
        onebit = self.onebit is not None and n > self.onebit.warmup
        program = self._local() if onebit and self.onebit.compressing(n) else self.program
        # checked each step: a step hook registered (or pm.optimizer replaced by one over
        # other tensors) since parallelize makes this step one step() after the graph
        updates = self._bucket_updates if self._bucket_updates is not None and \
            not onebit and self._bucket_updates.usable(self.optimizer) else None
        with executor.recording(self.recorder) as rec:
            with updates or contextlib.nullcontext():
                outs = self._run(program, batch)
            n_g = len(self.program.zero_buckets) if self.sharded_optimizer else len(self.params)
            loss, grads, new_bufs = outs[0], outs[1:1 + n_g], outs[1 + n_g:]
            calls.settle()
            faults.check_loss(loss, self.plan)
            rec.segment("optimizer")
            if updates is not None:  # the buckets were stepped in the graph: the rest now
                if rest := [i for i in updates.rest() if grads[i] is not None]:
                    optim.apply_gradients(self.optimizer, [self.params[i] for i in rest],
                                          [grads[i] for i in rest])
            elif not self._finish_grads(grads):
                pass  # fp16 overflow on some rank: every rank skips this update
            elif self.sharded_optimizer:
                self.sharded_optimizer.step(grads)
            elif onebit:
                self.onebit.step(self.optimizer, self.params, grads, n,
                                 self.program.signature.param_names)
            else:
                optim.apply_gradients(self._stepper, self.params, grads)
            self._update_buffers(new_bufs)
        if self._graphed is not None:  # the last replay's GPU time (the loss check synced)
            self.recorder.stats[-1].device_s = self._graphed.last_device_s()
        return loss.detach()

    def _local(self) -> ir.Program:
        """Plan.grad_compression's and a Plan.ps worker's program: program.local_graph
        (without gradient all-reduces), compiled at its first use."""
        if self._local_program is None:
            local = dataclasses.replace(self.program, graph=self.program.local_graph,
                                        local_graph=None)
            clock = Clock(log)
            self._generated[id(local)] = self._codegen(local, {"local": local.graph},
                                                       clock)["local"]
            self.compile_times = [*self.compile_times, *clock.rows(other=False)]
            if self.world.device.type == "cuda" and self.cuda_graphs.capture:
                log.info("%s run without CUDA graphs", "the parameter-server worker's steps"
                         if self.ps is not None else "1-bit Adam: the steps after the warm-up")
            self._local_program = local
        return self._local_program

    @property
    def offload_stats(self) -> dict | None:
        """Plan.offload: this rank's last step - bytes_out (copied to host), host_peak (most
        bytes on host at once), copies (storages moved), values; None without offloading."""
        stash = self.pipeline_runner.stash if self.pipeline_runner is not None else None
        return dict(stash.stats) if stash is not None else None

    # --- loss scaling and gradient clipping (runtime/amp.py) --------------------------------
    def _finish_grads(self, grads) -> bool:
        """Plan.max_grad_norm: clip this rank's gradients (list of per-parameter gradients, or
        of ZeRO bucket shards) by the global norm over all ranks; fp16: check every rank's
        gradients for inf/NaN and update the loss scale. False = skip the optimizer step (the
        same answer on every rank: one all-reduce over the world)."""
        max_norm = self.plan.max_grad_norm
        if max_norm is None and self.scaler is None:
            return True
        if self._norm_plan is None:
            self._norm_plan = self._grad_norm_plan()
        norm, found_inf = amp.grad_stats(grads, self._norm_plan, max_norm is not None,
                                         device=self.world.device)
        self.last_grad_norm = norm
        if self.scaler is not None:
            self.scaler.update(found_inf)
            if found_inf:
                return False
        if max_norm is not None:
            amp.clip_(grads, norm, max_norm)
        return True

    def _grad_norm_plan(self) -> amp.GradNormPlan:
        """Which of this rank's gradients (or ZeRO shard elements) count toward the global
        norm, so that the sum over the world counts every element of the model once."""
        layouts = self.program.tp_layouts
        tp0 = self.world.coordinate("tp") == 0 if self.plan.tp > 1 else True
        r = self.pipeline_runner
        if self.sharded_optimizer is None:  # whole gradients, equal on every dp rank: dp
            # rank 0 counts (an expert's: the first rank of each ep group, which holds them)
            first = self.world.coordinate("dp") == 0
            first_ep = self.world.coordinate("edp") == 0

            def owner(i):  # a weight several pipeline stages hold: its first stage counts it
                return r is None or self.plan.pp == 1 or r.rank_of(
                    min(r.p.param_stages.get(i, {0}))) == r.rank
            return amp.GradNormPlan([
                (first_ep if i in self._experts else first) and owner(i) and (
                    layouts[i] is not None or tp0) for i in range(len(self.params))])
        counted = []
        # each rank counts its own shard (HSDP: the first replica's ranks; the others hold
        # the same shards; ep: every rank, each holding its own experts' shard)
        replica0 = not self.plan.hsdp or self.world.coordinate("dp_rep") == 0
        z = self.sharded_optimizer
        for k, shard in enumerate(z.shards):
            if not replica0:
                counted.append(False)
                continue
            dp, dp_r, _ = z.group_of(z.bucket_indices[k][0])
            mask = torch.zeros(shard.numel() * dp, device=shard.device)
            for i, off, n in z.bucket_layout(k):
                mask[off:off + n] = 1.0 if (layouts[i] is not None or tp0) else 0.0
            mask = mask[dp_r * shard.numel():(dp_r + 1) * shard.numel()]
            counted.append(True if bool(mask.all()) else (False if not mask.any() else mask))
        return amp.GradNormPlan(counted)

    # --- timeline -------------------------------------------------------------------------
    @property
    def step_stats(self) -> list[rtrace.StepStats]:
        """The last steps' time, communication time and exposed (non-overlapped) communication
        time on this rank, oldest first (up to 20)."""
        return list(self.recorder.stats)

    @calls.collective
    def trace(self, path: str) -> str | None:
        """Write the last steps' timeline of ALL ranks as one Chrome-trace JSON (open it in
        https://ui.perfetto.dev): per rank a compute and a comm track. Collective: call it on
        every rank; rank 0 writes the file and returns its path (other ranks return None)."""
        if self.world.size == 1 and self.ps is None:
            rtrace.write_chrome_trace(path, self.recorder.events())
            return path
        gathered = [None] * dist.get_world_size()  # (Plan.ps: the servers' ranks too)
        dist.all_gather_object(gathered, self.recorder.events())
        if self.world.rank != 0:
            return None
        rtrace.write_chrome_trace(path, [e for ev in gathered for e in ev])
        return path

    def _update_buffers(self, new_bufs):
        """The step's new buffer values (BatchNorm statistics...) into the model's buffers;
        None: a pipeline rank whose stages do not compute that buffer."""
        with torch.no_grad():
            for buf, val in zip(self._mutated_buffers, new_bufs):
                if val is not None:
                    buf.copy_(val)

    @calls.collective
    def evaluate(self, batch) -> torch.Tensor:
        """Forward only, no parameter or buffer update: the mean loss of the global batch."""
        if self.pipeline_runner is not None:
            # the training program's forward parts: the same stages hold the same weights
            with self._named_index_errors(self.program, batch, "evaluate"):
                return self._run_pipeline(self.program, self.pipeline_runner, batch,
                                          forward_only=True)[0].detach()
        if self.ps is not None and self.ps.asynchronous:  # the servers' newest parameters
            self.ps.pull()
        if self._eval_program is None:  # compiled from the stand-ins compile kept: the
            # model's own tensors (shards by now) are never traced
            self._eval_program = comm.bind_groups(self.program.build_eval(),
                                                  self.program.bound_groups)
            clock = Clock(log)
            self._generated[id(self._eval_program)] = self._codegen(
                self._eval_program, {"evaluate": self._eval_program.graph}, clock)["evaluate"]
            self.compile_times = [*self.compile_times, *clock.rows(other=False)]
            ev, tr = self._eval_program, self.program
            if (ev.tp_layouts, ev.expert_params, ev.expert_slots) != (
                    tr.tp_layouts, tr.expert_params, tr.expert_slots):
                raise PlanError(
                    "evaluate() under tensor or expert parallelism: the forward-only graph was "
                    f"sharded differently from the training graph (tp layouts {ev.tp_layouts} "
                    f"vs {tr.tp_layouts}, expert weights {ev.expert_params} vs "
                    f"{tr.expert_params}, expert slots {ev.expert_slots} vs "
                    f"{tr.expert_slots}); please report this model to fxpar.")
        with self._named_index_errors(self._eval_program, batch, "evaluate"):
            outs = self._run(self._eval_program, batch)
        return outs[0].detach()

    # --- full tensors from this rank's shards ---------------------------------------------
    def _program_param(self, i: int) -> torch.Tensor:
        """Parameter i as this rank's program sees it whole: its tp slice (with ZeRO-3
        all-gathered over the dp group: a collective there)."""
        z = self.sharded_optimizer
        if z is not None and z.shard_params:
            return z.full_param(i)
        return self.params[i].data

    def splits_of(self, i: int) -> tuple:
        """How this rank's program holds parameter i when it holds a slice of it: the
        splits runtime/tp_slices.local_of applies, each (layout, ranks, this rank's index,
        group): the ep group's split of an expert stack along its experts, then its tp
        layout. () when whole (or held by another ep rank: a listed expert's 0-element
        stand-in)."""
        if self.held_names[i] is None:
            return ()
        out = []
        if i in self._expert_slices:
            out.append(((0, None, 1), self.program.ep, self.world.coordinate("ep"),
                        self.ep_group))
        layout = self.program.tp_layouts[i]
        if layout is not None:
            out.append((layout, self.plan.tp, self.world.coordinate("tp"), self.tp_group))
        return tuple(out)

    def _full_param(self, i: int) -> torch.Tensor:
        """The user's whole parameter i from this rank's shards (collective over the tp, ep
        and dp groups where it is sharded there)."""
        splits, local = self.splits_of(i), self._program_param(i)
        return rtp.full_of(local, splits) if splits else local

    @calls.collective
    def full_params(self, every_expert: bool = True) -> dict[int, torch.Tensor]:
        """id(parameter) -> the user's full weight, for every parameter this rank's stages
        hold in shards (tp slices, ZeRO-3 shards, ep's expert slices) and, with
        `every_expert`, every listed expert (ep's slots all-gathered; else this rank's own
        only: a checkpoint's ranks each write theirs). Collective over the tp, dp and ep
        groups."""
        z3 = self.sharded_optimizer is not None and self.sharded_optimizer.shard_params
        if self.tp_group is None and self.ep_group is None and not z3:
            return {}
        need = self.needed_params()
        slots = {s[0]: s for s in self.program.expert_slots}
        named = dict(self.model.named_parameters(remove_duplicate=False))
        out = {}
        for i, p in enumerate(self.params):
            split = self.splits_of(i)
            if i not in need or (not split and not z3 and i not in slots):
                continue
            full = self._full_param(i)
            if i in slots and not every_expert:  # (this rank's expert, under its own name)
                out[id(p)] = full.clone()
                continue
            if i in slots:  # a listed experts' slot: each ep rank's expert to its own name
                parts = [torch.empty_like(full) for _ in slots[i]]
                dist.all_gather(parts, full.contiguous(), group=self.ep_group)
                for k, part in zip(slots[i], parts):
                    out[id(named[self.program.signature.param_names[k]])] = part
                continue
            out[id(p)] = full if split else full.clone()
        return out

    # --- state ------------------------------------------------------------------------------
    @calls.collective
    def whole_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model under each of its names, whole and up to
        date, on every rank (fresh tensors: nothing aliases the rank's own). Collective over
        the tp / dp groups (shards) and the pp group (other stages' weights)."""
        if self.ps is not None and self.ps.asynchronous:  # the servers' newest parameters
            self.ps.pull()
        own = model_state.own_tensors(self.model)
        full = self.full_params()  # id -> the user's whole weight where this rank holds shards
        first = {}  # id -> the first name of each tensor (tied names share it)
        for name, t in own.items():
            first.setdefault(id(t), name)
        if self.pipeline_runner is None or self.plan.pp == 1:
            made = {i: (full[i] if i in full else own[n].detach().clone())
                    for i, n in first.items()}
            return {name: made[id(t)] for name, t in own.items()}
        r = self.pipeline_runner
        stages = self.state_stages({n: own[n] for n in first.values()})
        owned = {n: full.get(id(own[n]), own[n].detach()).cpu().clone()
                 for n, st in stages.items() if r.rank_of(min(st)) == r.rank}
        gathered = [None] * self.plan.pp  # each tensor from the first stage that holds it
        dist.all_gather_object(gathered, owned, group=r.group)
        merged = {n: v.to(self.world.device) for d in gathered for n, v in d.items()}
        return {name: merged[first[id(t)]] for name, t in own.items()}

    def whole_meta(self) -> dict[str, torch.Tensor]:
        """Meta-device stand-ins of the model's tensors in their whole (user's) shapes."""
        pidx = self.param_index_of
        return {n: torch.empty(self.param_shapes[pidx[id(t)]] if id(t) in pidx else t.shape,
                               dtype=t.dtype, device="meta")
                for n, t in model_state.own_tensors(self.model).items()}

    def state_is_plain(self) -> bool:
        """Whether the model's state dict is its own tensors (runtime/model_state.is_plain):
        then saves gather it tensor by tensor; otherwise its hooks run on whole tensors."""
        if self._state_plain is None:
            self._state_plain = model_state.is_plain(self.model, self.whole_meta())
        return self._state_plain

    def stand_in_state(self) -> dict[str, torch.Tensor]:
        """The keys, whole shapes and dtypes of `model.state_dict()`, computed by the model's
        own code on meta-device stand-ins (no data, no collective)."""
        with model_state.holding(self.model, self.whole_meta()):
            return dict(self.model.state_dict())

    @calls.collective
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """`model.state_dict()` of the model single-process training would hold: keys and
        values as the model's own state-dict code makes them (its hooks run on the whole
        tensors), on every rank. Collective: with ZeRO-3, tensor parallelism or pipeline
        stages this gathers, so call it on every rank."""
        return model_state.state_dict_of(self.model, self.whole_tensors())

    def state_stages(self, state) -> dict[str, set[int]]:
        """Pipeline: the stages holding each entry of `state` (the model's own tensors by
        name: parameters and buffers by the stage split; anything else: stage 0)."""
        r = self.pipeline_runner
        # (a listed expert under ep: the stages of the slot holding it)
        ids = {t: self._slot_of.get(i, (i, 0))[0] for t, i in self.param_index_of.items()}
        bids = {id(b): j for j, b in enumerate(self.buffers)}
        return {k: r.p.param_stages.get(ids[id(v)], {0}) if id(v) in ids else
                r.p.buffer_stages.get(bids[id(v)], {0}) if id(v) in bids else {0}
                for k, v in state.items()}

    # --- checkpoints (runtime/checkpoint.py) -----------------------------------------------
    @calls.collective
    def save(self, path: str, extra: dict | None = None) -> str:
        """Write a plan-independent checkpoint directory (torch DCP): model, optimizer state,
        fp16 loss scaler, `step_count`, every rank's RNG state and `extra` (a dict of tensors
        and JSON values, e.g. your data loader's position). Collective: call on every rank."""
        if self.ps is not None:  # Plan.ps: the optimizer state is the servers'
            if self.ps.asynchronous:
                self.ps.pull()
            return param_server.save(self, path, extra)
        return rckpt.save(self, path, extra)

    @calls.collective
    def load(self, path: str, allow_changed_settings: bool = False) -> dict:
        """Restore a checkpoint written by `save` under any plan (same model and optimizer
        type); returns its `extra`. The optimizer's hyperparameters (lr, betas, ...) and the
        loss scaler come from the checkpoint; the settings compiled into the plan that change
        the numbers (max_grad_norm, precision, batch_stats) must equal the checkpoint's, else
        CheckpointError (allow_changed_settings=True: a warning). An LR scheduler is yours:
        save its state_dict() in `extra`. Collective: call on every rank. Never unpickles."""
        if self.ps is not None:  # Plan.ps: the servers load the optimizer state
            return param_server.load(self, path, allow_changed_settings)
        return rckpt.load(self, path, allow_changed_settings)

    @calls.collective
    def save_pretrained(self, directory: str, max_shard_size: int = rweights.SHARD_BYTES) -> str:
        """Write the model's full weights as Hugging Face safetensors (sharded files of at most
        `max_shard_size` bytes + model.safetensors.index.json, and config.json for an HF
        model; in the Hub's layout where transformers' own save writes that):
        `from_pretrained(directory)` reads it, and so does parallelize(...,
        weights=directory). One tensor is gathered at a time, to the rank writing its file.
        Collective: call on every rank."""
        if not self.state_is_plain():  # hooks make its entries: they run on whole tensors
            return self._save_pretrained_whole(directory, max_shard_size)
        state = self.model.state_dict(keep_vars=True)
        pidx = self.param_index_of
        shapes = {k: tuple(self.param_shapes[pidx[id(v)]]) if id(v) in pidx else tuple(v.shape)
                  for k, v in state.items()}
        stages = self.state_stages(state) if self.pipeline_runner is not None \
            and self.plan.pp > 1 else {}
        keys = rweights.hf_keys(self.model, state)

        def full_tensor(key, dst):
            return self._full_tensor(state[key], pidx.get(id(state[key])),
                                     min(stages.get(key, {0})), dst)
        return rweights.save_pretrained(self.model, directory, keys, shapes,
                                        {k: v.dtype for k, v in state.items()}, full_tensor,
                                        self.world.rank, self.world.size, max_shard_size)

    def _save_pretrained_whole(self, directory, max_shard_size):
        """save_pretrained of a model whose state dict its own code computes: that code runs
        on the whole tensors on every rank, and each file's rank writes its entries."""
        whole = self.whole_tensors()
        state = model_state.state_dict_of(self.model, whole)
        with model_state.holding(self.model, whole):  # (tied names found on whole tensors)
            keys = rweights.hf_keys(self.model, state)

        def full_tensor(key, dst):
            return state[key].cpu() if self.world.rank == dst else None
        return rweights.save_pretrained(
            self.model, directory, keys,
            {k: tuple(v.shape) for k, v in state.items()}, {k: v.dtype for k, v in state.items()},
            full_tensor, self.world.rank, self.world.size, max_shard_size)

    def _full_tensor(self, t, i: int | None, stage: int, dst: int) -> torch.Tensor | None:
        """One state tensor (parameter index i, or a buffer) whole on global rank `dst`, on
        CPU; None elsewhere. Collective: the ranks of the stage holding it gather it over
        their tp / dp groups, its (dp 0, tp 0) rank sends it to dst."""
        r = self.pipeline_runner
        mine = r is None or self.plan.pp == 1 or r.rank_of(stage) == r.rank
        held, owner = (i, 0) if i is None else self._slot_of.get(i, (i, 0))
        full = None
        if mine:  # (a listed expert: every rank its own of the slot; its owner's is sent)
            full = t.detach() if i is None else self._full_param(held)
        if self.world.size == 1:
            return full.cpu()
        mesh = self.world.mesh
        coord = dict.fromkeys(mesh.mesh_dim_names, 0)  # (index 0 on every dim but the stage's)
        coord["pp"] = r.rank_of(stage) if r is not None and self.plan.pp > 1 else 0
        if "ep" in coord:
            coord["ep"] = owner
        src = int(mesh.mesh[tuple(coord[d] for d in mesh.mesh_dim_names)])
        if src == dst:
            return full.cpu() if self.world.rank == dst else None
        if self.world.rank == src:
            dist.send(full.contiguous(), dst=dst)
        elif self.world.rank == dst:
            shape = self.param_shapes[i] if i is not None else t.shape
            buf = torch.empty(shape, dtype=t.dtype, device=self.world.device)
            dist.recv(buf, src=src)
            return buf.cpu()
        return None

    def __repr__(self):
        return f"ParallelModel(plan={self.plan}, world={self.world.size})"


def _marked_runs(sources: dict, generated: dict) -> dict:
    """pm.stage_graphs["codegen"]: a copy of each graph this rank runs, every node Inductor
    compiled marked with its run's name (ir.CODEGEN_RUN), for the pictures; its meta
    ["codegen"] is what the code generator did (ir.Generated: runs, reuses, ops left op by
    op)."""
    out = {}
    for name, gm in sources.items():
        gen = generated[name]
        done = gen.meta.get("codegen")
        run_of = {o: r.name for r in (done.runs if done is not None else ()) for o in r.origin}
        snap = graphs.snapshot(gm)
        for n in snap.graph.nodes:
            if n.name in run_of:
                n.meta[ir.CODEGEN_RUN] = run_of[n.name]
        snap.meta["codegen"] = gen.meta.get("codegen")
        out[name] = snap
    return out

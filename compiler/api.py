"""fxpar.parallelize and ParallelModel: capture -> passes -> Program -> runtime."""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpar.compiler import capture as cap
from fxpar.compiler import ir, stages
from fxpar.compiler.passes import PassContext, run_passes
from fxpar.compiler.errors import BatchError, PlanError
from fxpar.compiler.plan import Plan, resolve
from fxpar.runtime import dist as rdist
from fxpar.runtime import amp, comm, cudagraph, executor, optim, schedules
from fxpar.runtime import checkpoint as rckpt
from fxpar.runtime import faults
from fxpar.runtime import tp as rtp
from fxpar.runtime import trace as rtrace
from fxpar.runtime.pipeline import PipelineRunner
from fxpar.runtime.zero import ShardedOptimizer

log = logging.getLogger("fxpar")


def parallelize(model: torch.nn.Module, devices, *, example_batch, loss_fn: Callable | None = None,
                optimizer: Callable | None = None, plan: Any = "auto") -> "ParallelModel":
    """Compile `model` + `loss_fn` into a training step that runs across `devices`.

    See DESIGN.md section 1. Every rank calls this with the same arguments.
    """
    world_size = devices.size() if hasattr(devices, "get_group") else (
        devices if isinstance(devices, int) else len(devices))
    plan_report = None
    if world_size > 1 and _needs_search(plan):  # plan="auto" / unset degrees: the planner
        from fxpar.compiler import planner
        plan, plan_report = planner.for_parallelize(model, devices, world_size, plan,
                                                    example_batch, loss_fn, optimizer)
    resolved = resolve(plan, world_size)
    dims = [("dp", resolved.dp)] + ([("pp", resolved.pp)] if resolved.pp > 1 else []) + (
        [("tp", resolved.tp)] if resolved.tp > 1 else [])  # tp innermost: neighbouring ranks
    world = rdist.setup(devices, dims=dims)
    if resolved.offload and world.device.type == "cpu":
        warnings.warn("Plan.offload on a CPU device copies saved activations between two "
                      "buffers of the same host memory: it saves nothing there (it is meant "
                      "for GPUs; on CPU it only exercises the schedule).", stacklevel=2)
    model.to(world.device)
    if world.size > 1:  # start from rank 0's weights, as DDP does
        with torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                dist.broadcast(t.data, src=0)
    example_batch = _to_device(example_batch, world.device)
    pm = ParallelModel(model, world, resolved, example_batch, loss_fn, optimizer)
    pm.plan_report = plan_report  # planner.PlanResult (ranked plans, explain()) or None
    return pm


def _needs_search(plan) -> bool:
    """plan="auto" (or None), or a dict / Plan with "auto" as a parallel degree (e.g.
    {"pp": 2, "dp": "auto", "tp": "auto"}): the planner searches, the fields given (not "auto")
    constrain it. Any other dict / Plan is taken as written (unset degrees: tp = pp = 1, dp =
    the rest), so a plan never changes with the machine it is compiled on. One device has
    nothing to search."""
    if plan is None or plan == "auto":
        return True
    if isinstance(plan, dict):
        return any(plan.get(k) == "auto" for k in ("dp", "tp", "pp"))
    if isinstance(plan, Plan):
        return any(getattr(plan, k) == "auto" for k in ("dp", "tp", "pp"))
    return False


def _to_device(batch, device):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


def _check_microbatches(n_rows, m, dp, where):
    if n_rows % (m * dp):
        raise BatchError(
            f"the global batch does not split into {m} microbatches over dp={dp}: {where} has "
            f"{n_rows} rows on dim 0, not a multiple of microbatches*dp = {m * dp}. Use a "
            f"global batch that is a multiple of {m * dp}, or fewer microbatches.")


def _microbatches(batch, m, dp):
    """The global batch as m microbatches along dim 0 of every tensor leaf (0-dim leaves
    repeat)."""
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            _check_microbatches(x.shape[0], m, dp, f"a batch tensor of shape {tuple(x.shape)}")
    return [torch.utils._pytree.tree_unflatten(
        [x.chunk(m, 0)[j] if isinstance(x, torch.Tensor) and x.dim() > 0 else x
         for x in leaves], spec) for j in range(m)]


class ParallelModel:
    """A model compiled for a Plan; `step(batch)` is one full training step."""

    plan_report = None  # plan="auto": the planner's PlanResult (set by parallelize)
    # plan="auto": after this many steps the planner's cost model is re-fitted to the
    # measured step time (`_refit_planner`); 0 turns it off
    REFIT_AFTER = 8

    def __init__(self, model, world, plan: Plan, example_batch, loss_fn, optimizer):
        self.model, self.world, self.plan = model, world, plan
        self.loss_fn = loss_fn
        self.stage_graphs: dict[str, dict[str, torch.fx.GraphModule]] = {}
        t0 = time.perf_counter()
        self.program, self.compile_times = self._compile(example_batch, joint=True,
                                                         snapshots=self.stage_graphs)
        log.info("compiled in %.2f s", time.perf_counter() - t0)
        self._eval_program = None
        self._lowered: dict[int, torch.fx.GraphModule] = {}
        self.recorder = rtrace.Recorder(world.rank)
        self._example_batch = example_batch
        params = dict(model.named_parameters(remove_duplicate=False))  # tied weights: any name
        buffers = dict(model.named_buffers(remove_duplicate=False))
        sig = self.program.signature
        self._params = [params[n] for n in sig.param_names]
        self._tp_group = world.mesh.get_group("tp") if plan.tp > 1 else None
        with torch.no_grad():  # tp: each parameter becomes this rank's slice of it
            for p, layout in zip(self._params, self.program.tp_layouts):
                if layout is not None:
                    p.data = rtp.local_param(p.data, layout, plan.tp, world.coordinate("tp"))
        self._zero = None
        self._runner = None
        if self.program.pipeline is not None:
            self._runner = PipelineRunner(self.program, world.coordinate("pp"),
                                          self.program.pp_group_name)
        if self.program.zero:
            if isinstance(optimizer, torch.optim.Optimizer):
                raise PlanError(
                    f"Plan.zero={plan.zero} shards the optimizer state, so fxpar must build the "
                    "optimizer over this rank's shards: pass a factory, e.g. "
                    "`optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)`, not an instance.")
            factory = optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3))
            buckets = self.program.zero_buckets if self._runner is None else [
                self.program.zero_buckets[k] for k in self._runner.held_buckets]
            self._zero = ShardedOptimizer(lambda ps: optim.build(factory, ps), self._params,
                                          buckets, plan.dp,
                                          world.coordinate("dp"), world.mesh.get_group("dp"),
                                          shard_params=self.program.params_sharded)
            self.optimizer = self._zero.optimizer
        elif self._runner is not None:  # this rank's stages' parameters only
            held = [self._params[i] for i in self._runner.held_params]
            self.optimizer = None if not held else optim.build(optimizer, held if not isinstance(
                optimizer, torch.optim.Optimizer) else model)  # None: stages without weights
        else:
            self.optimizer = optim.build(optimizer, model)
        self._buffers = [buffers[n] for n in sig.buffer_names]
        self._mutated_buffers = [buffers[n] for n in sig.mutated_buffers]
        # fp16: the dynamic loss scale (runtime/amp.py); None for fp32 / bf16
        self.scaler = amp.GradScaler() if self.program.loss_scale else None
        self.cuda_graphs = self._cuda_graph_decision()  # runtime/cudagraph.Decision
        self._graphed: cudagraph.GraphedStep | None = None  # built at the first step
        self._norm_plan = None  # which gradient elements this rank counts (built on use)
        self.last_grad_norm = None  # the last step's global gradient norm (when computed)
        self.step_count = 0  # steps done = global batches consumed (saved by `save`)

    def _compile(self, example_batch, joint, snapshots):
        plan = self.plan
        m = plan.microbatches if joint else 1
        t0 = time.perf_counter()
        example = _microbatches(example_batch, m, plan.dp)[0] if m > 1 else example_batch
        gm, sig = cap.capture(self.model, example, self.loss_fn, joint=joint)
        capture_time = time.perf_counter() - t0
        virtual = 2 if plan.schedule == "interleaved" else 1
        ctx = PassContext(signature=sig, group_names={"dp": self.world.group_name("dp") or "dp",
                                                      "tp": self.world.group_name("tp") or "tp"},
                          memory_budget=self._activation_budget() if joint else None,
                          virtual_stages=virtual, device=self.world.device)
        if m > 1 and sig.mutated_buffers:
            raise PlanError(
                f"microbatches={m} would update the buffers {sig.mutated_buffers[:3]} once per "
                "microbatch (e.g. BatchNorm running statistics), which is not what one step on "
                "the whole batch does. Use microbatches=1, or a model without batch-statistics "
                "buffers (LayerNorm/GroupNorm).")
        gm = run_passes(gm, plan, ctx, role="dp", snapshots=snapshots)
        if joint:
            self.fusion_skipped = ctx.fusion_skipped  # why Plan.fuse fused nothing, if so
        program = ir.Program(graph=gm, signature=sig, dp=plan.dp,
                             batch_shard_dims=ctx.batch_shard_dims,
                             group_name=ctx.group_names["dp"],
                             zero=plan.zero if ctx.zero_buckets else 0,
                             zero_buckets=ctx.zero_buckets, params_sharded=ctx.params_sharded,
                             tp=plan.tp, tp_layouts=ctx.tp_layouts or [None] * sig.num_params,
                             tp_group_name=self.world.group_name("tp"),
                             loss_scale=ctx.loss_scale, loss_count=ctx.loss_count)
        if plan.pp > 1 or m > 1:
            t1 = time.perf_counter()
            program.pipeline = stages.split(gm, sig, plan.pp * virtual)
            program.pp, program.microbatches = plan.pp, m
            program.schedule = plan.schedule if joint else "gpipe"
            program.virtual = virtual
            program.offload = plan.offload and joint
            program.pp_group_name = self.world.group_name("pp") if plan.pp > 1 else None
            ctx.timings.append(("stages", time.perf_counter() - t1, len(program.pipeline.parts)))
        return program, [("capture", capture_time, None), *ctx.timings]

    def _activation_budget(self) -> int | None:
        """For remat="auto": device memory (90%) less parameters, gradients and optimizer
        state (Adam's two moments assumed: the optimizer is built after compiling)."""
        if self.plan.remat != "auto":
            return None
        total = int(0.9 * rdist.device_memory(self.world.device))
        p_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        fixed = 4 * p_bytes  # params + grads + 2 Adam moments
        if fixed >= total:
            raise PlanError(
                f"the model does not fit: parameters, gradients and optimizer state need "
                f"{fixed / 2**30:.2f} GiB per device but {total / 2**30:.2f} GiB is available. "
                "Fix: more devices with tensor/pipeline parallelism or ZeRO (when available), "
                "or a smaller model.")
        return total - fixed

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
            log.info("fxpar: the step runs without CUDA graphs: %s", d.reason)
        if d.capture and self._runner is not None:
            self._runner.use_cuda_graphs(self.world.device)
        return d

    # --- training ---------------------------------------------------------------------------
    def _run(self, program, batch):
        leaves = cap.flatten_batch(batch, program.signature)  # local_batch moves them
        local = executor.local_batch(leaves, program, self.world.coordinate("dp"),
                                     self.world.device)
        if program.loss_scale:
            local.append(self.scaler.scale_tensor(self.world.device))
        params = self._zero.param_shards if program.params_sharded else self._params
        if program is self.program and self.cuda_graphs.capture:
            if self._graphed is None:  # the graph's functional collectives are capturable
                self._graphed = cudagraph.GraphedStep(
                    lambda *a: executor.run_graph(program.graph, a, (), ()),
                    [True] * (len(params) + len(self._buffers)) + [False] * len(local),
                    self.world.device)
            outs = list(self._graphed([*params, *self._buffers, *local]))
            outs[0] = outs[0].clone()  # the static output is overwritten by the next replay
            return outs
        gm = self._lowered.get(id(program))
        if gm is None:
            gm = self._lowered[id(program)] = comm.lower(program.graph)
        return executor.run_graph(gm, params, self._buffers, local)

    def _run_pipeline(self, program, runner, batch, rec=None, forward_only=False):
        """All microbatches through this rank's stages; the loss on every rank."""
        batch = _to_device(batch, self.world.device)
        trees = _microbatches(batch, program.microbatches, program.dp) \
            if program.microbatches > 1 else [batch]
        mbs = [executor.local_batch(cap.flatten_batch(t, program.signature), program,
                                    self.world.coordinate("dp"), self.world.device)
               for t in trees]
        if program.loss_scale:
            for leaves in mbs:
                leaves.append(self.scaler.scale_tensor(self.world.device))
        if program.loss_count is not None:  # the whole step's target count, shared out
            with torch.no_grad():
                total = sum(program.loss_count(*cap.flatten_batch(t, program.signature))
                            for t in trees)  # int64
                share = (total / program.microbatches).to(program.loss_count.meta["dtype"])
            for leaves in mbs:
                leaves.append(share)
        loss, grads, new_bufs = runner.run(self._params, self._buffers, mbs, self.world.device,
                                           rec, forward_only)
        if program.pp > 1:  # the last stage has the loss: every rank returns it
            last = runner.global_rank[runner.rank_of(program.pipeline.n_stages - 1)]
            if loss is None:
                loss = torch.empty((), device=self.world.device)
            dist.broadcast(loss, src=last, group=runner.group)
        return loss, grads, new_bufs

    def step(self, batch) -> torch.Tensor:
        """One training step on the GLOBAL batch; returns its mean loss (same on every rank).
        `pm.step_count` counts the steps done (restored by `load`). A rank that fails makes
        every rank raise (RankFailure naming the rank and the step); a NaN/inf loss raises
        NonFiniteLossError before the optimizer applies it (runtime/faults.py)."""
        n = getattr(self, "step_count", 0) + 1
        with faults.step_context(self.world, n):
            loss = self._train_step(batch)
        self.step_count = n
        if n == self.REFIT_AFTER and self.plan_report is not None:
            self._refit_planner()
        return loss

    def _refit_planner(self) -> None:
        """plan="auto": re-price every plan with the compute speed these steps measured
        (planner.recalibrate: the start-up calibration times one graph in under a second and
        can be off 2x on a shared machine). pm.plan_report becomes the re-fitted result (its
        .start_up keeps the first); where another plan is now predicted clearly faster, a
        warning names it (the job keeps its plan: changing it needs a new parallelize)."""
        from fxpar.compiler import planner
        times = sorted(s.time_s for s in list(self.recorder.stats)[2:])
        if not times:
            return
        t = torch.tensor([times[len(times) // 2]], dtype=torch.float64)
        if self.world.size > 1:  # a step lasts as long as its slowest rank
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        try:
            new = planner.recalibrate(self.plan_report, self.plan, float(t))
        except PlanError as e:  # e.g. a plan given by hand that the planner cannot price
            log.warning("fxpar: the planner could not be re-fitted to the measured steps: %s",
                        e)
            return
        self.plan_report = new
        ran = planner.plan_dict(self.plan)
        now = next((c for c in new.table if planner.plan_dict(c.plan) == ran), None)
        log.info("fxpar planner %s", new.refit)
        if now is not None and new.best.step_s < 0.9 * now.step_s \
                and self.world.rank == 0:
            warnings.warn(
                f"fxpar: after {self.step_count} steps the planner, re-fitted to the measured "
                f"step time ({new.refit}), predicts plan {planner.plan_dict(new.best.plan)} "
                f"at {new.best.step_s * 1e3:.2f} ms a step against {now.step_s * 1e3:.2f} ms "
                f"for the running plan: pass it as plan= to fxpar.parallelize to use it.",
                stacklevel=3)

    def _train_step(self, batch) -> torch.Tensor:
        if self._runner is not None:
            with executor.recording(self.recorder) as rec:
                loss, grads, new_bufs = self._run_pipeline(self.program, self._runner, batch,
                                                           rec)
                faults.check_loss(loss, self.plan)
                rec.segment("optimizer")
                held = self._runner.held_params
                if self._zero is not None:
                    shards = [grads[k] for k in self._runner.held_buckets]
                    if self._finish_grads(shards):
                        self._zero.step(shards)
                    self._runner.sync_tied_params(self._params, self.program.zero_buckets)
                elif not self._finish_grads(grads):
                    pass  # fp16 overflow on some rank: every rank skips this update
                elif self.optimizer is not None:
                    optim.apply_gradients(self.optimizer, [self._params[i] for i in held],
                                          [grads[i] for i in held])
                with torch.no_grad():
                    for buf, val in zip(self._mutated_buffers, new_bufs):
                        if val is not None:
                            buf.copy_(val)
            return loss.detach()
        with executor.recording(self.recorder) as rec:
            outs = self._run(self.program, batch)
            n_g = len(self.program.zero_buckets) if self._zero else len(self._params)
            loss, grads, new_bufs = outs[0], outs[1:1 + n_g], outs[1 + n_g:]
            faults.check_loss(loss, self.plan)
            rec.segment("optimizer")
            if not self._finish_grads(grads):
                pass  # fp16 overflow on some rank: every rank skips this update
            elif self._zero:
                self._zero.step(grads)
            else:
                optim.apply_gradients(self.optimizer, self._params, grads)
            self._update_buffers(new_bufs)
        if self._graphed is not None:  # the last replay's GPU time (the loss check synced)
            self.recorder.stats[-1].device_s = self._graphed.last_device_s()
        return loss.detach()

    @property
    def offload_stats(self) -> dict | None:
        """Plan.offload: this rank's last step - bytes_out (copied to host), host_peak (most
        bytes on host at once), copies (storages moved), values; None without offloading."""
        stash = self._runner.stash if self._runner is not None else None
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
        norm, found_inf = amp.grad_stats(grads, self._norm_plan, max_norm is not None)
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
        r = self._runner
        if self._zero is None:  # whole gradients, equal on every dp rank: dp rank 0 counts
            first = self.world.coordinate("dp") == 0

            def owner(i):  # a weight several pipeline stages hold: its first stage counts it
                return r is None or self.plan.pp == 1 or r.rank_of(
                    min(r.p.param_stages.get(i, {0}))) == r.rank
            return amp.GradNormPlan([first and owner(i) and (layouts[i] is not None or tp0)
                                     for i in range(len(self._params))])
        buckets = self.program.zero_buckets if r is None else [
            self.program.zero_buckets[k] for k in r.held_buckets]
        dp, dp_r = self.plan.dp, self.world.coordinate("dp")
        counted = []
        for idx, shard in zip(buckets, self._zero.shards):  # each rank counts its own shard
            mask = torch.zeros(shard.numel() * dp, device=shard.device)
            off = 0
            for i in idx:
                n = self._zero.shapes[i].numel()
                mask[off:off + n] = 1.0 if (layouts[i] is not None or tp0) else 0.0
                off += n
            mask = mask[dp_r * shard.numel():(dp_r + 1) * shard.numel()]
            counted.append(True if bool(mask.all()) else (False if not mask.any() else mask))
        return amp.GradNormPlan(counted)

    # --- timeline -------------------------------------------------------------------------
    @property
    def step_stats(self) -> list[rtrace.StepStats]:
        """The last steps' time, communication time and exposed (non-overlapped) communication
        time on this rank, oldest first (up to 20)."""
        return list(self.recorder.stats)

    def trace(self, path: str) -> str | None:
        """Write the last steps' timeline of ALL ranks as one Chrome-trace JSON (open it in
        https://ui.perfetto.dev): per rank a compute and a comm track. Collective: call it on
        every rank; rank 0 writes the file and returns its path (other ranks return None)."""
        if self.world.size == 1:
            rtrace.write_chrome_trace(path, self.recorder.events())
            return path
        gathered = [None] * self.world.size
        dist.all_gather_object(gathered, self.recorder.events())
        if self.world.rank != 0:
            return None
        rtrace.write_chrome_trace(path, [e for ev in gathered for e in ev])
        return path

    def _update_buffers(self, new_bufs):
        with torch.no_grad():
            for buf, val in zip(self._mutated_buffers, new_bufs):
                buf.copy_(val)

    def evaluate(self, batch) -> torch.Tensor:
        """Forward only, no parameter or buffer update: the mean loss of the global batch."""
        if self._runner is not None:
            # the training program's forward parts: the same stages hold the same weights
            return self._run_pipeline(self.program, self._runner, batch,
                                      forward_only=True)[0].detach()
        if self._eval_program is None:
            if self._zero is not None and self._zero.shard_params:  # tracing needs the weights
                with torch.no_grad():
                    for p, full in zip(self._params, self._zero.full_params()):
                        p.data = full
            local = self._tp_unshard()
            self._eval_program, _ = self._compile(self._example_batch, joint=False, snapshots={})
            self._tp_reshard(local)
            if self._eval_program.tp_layouts != self.program.tp_layouts:
                raise PlanError(
                    "evaluate() under tensor parallelism: the forward-only graph was sharded "
                    f"differently from the training graph ({self._eval_program.tp_layouts} vs "
                    f"{self.program.tp_layouts}); please report this model to fxpar.")
            if self._zero is not None and self._zero.shard_params:
                for p in self._params:
                    p.data = p.data.new_empty(0)
        outs = self._run(self._eval_program, batch)
        return outs[0].detach()

    # --- tensor-parallel shards ------------------------------------------------------------
    def _tp_full(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> the user's full weight, for every tp-sharded one (collective)."""
        if self._tp_group is None:
            return {}
        return {id(p): rtp.full_param(p.data, layout, self.plan.tp, self._tp_group)
                for p, layout in zip(self._params, self.program.tp_layouts)
                if layout is not None}

    def _tp_unshard(self) -> dict[int, torch.Tensor]:
        """Put the full weights back into the model (for tracing); returns the shards."""
        full = self._tp_full()
        local = {}
        with torch.no_grad():
            for p in self._params:
                if id(p) in full:
                    local[id(p)], p.data = p.data, full[id(p)]
        return local

    def _tp_reshard(self, local):
        for p in self._params:
            if id(p) in local:
                p.data = local[id(p)]

    # --- state ------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers, keys as in model.state_dict(), on every rank
        (with ZeRO-3, tensor parallelism or pipeline stages this gathers: call it on every
        rank)."""
        state = self.model.state_dict(keep_vars=True)
        tp_full = self._tp_full()
        if self._runner is not None and self.plan.pp > 1:
            return self._gather_stages(state, tp_full)
        if tp_full:
            return {k: tp_full[id(v)] if id(v) in tp_full else v.detach().clone()
                    for k, v in state.items()}
        if self._zero is not None and self._zero.shard_params:
            full = dict(zip(map(id, self._params), self._zero.full_params()))
            return {k: full[id(v)] if id(v) in full else v.detach().clone()
                    for k, v in state.items()}
        return {k: v.detach().clone() for k, v in state.items()}

    def _state_stages(self, state) -> dict[str, set[int]]:
        """Pipeline: the stages holding each model.state_dict() entry (parameters and buffers
        by the stage split; anything else: stage 0)."""
        r = self._runner
        ids = {id(p): i for i, p in enumerate(self._params)}
        bids = {id(b): j for j, b in enumerate(self._buffers)}
        return {k: r.p.param_stages.get(ids[id(v)], {0}) if id(v) in ids else
                r.p.buffer_stages.get(bids[id(v)], {0}) if id(v) in bids else {0}
                for k, v in state.items()}

    def _gather_stages(self, state, tp_full=None):
        """Each weight from the first stage that holds it (copies on other stages are equal);
        `tp_full`: id -> full weight where this rank holds a tp shard."""
        tp_full = tp_full or {}
        r = self._runner
        owned = {}
        for k, stages_ in self._state_stages(state).items():
            if r.rank_of(min(stages_)) == r.rank:
                owned[k] = tp_full.get(id(state[k]), state[k].detach()).cpu().clone()
        gathered = [None] * self.plan.pp
        dist.all_gather_object(gathered, owned, group=r.group)
        merged = {k: v for d in gathered for k, v in d.items()}
        return {k: merged[k].to(v.device) for k, v in state.items()}

    # --- checkpoints (runtime/checkpoint.py) -----------------------------------------------
    def save(self, path: str, extra: dict | None = None) -> str:
        """Write a plan-independent checkpoint directory (torch DCP): model, optimizer state,
        fp16 loss scaler, `step_count`, every rank's RNG state and `extra` (a dict of tensors
        and JSON values, e.g. your data loader's position). Collective: call on every rank."""
        return rckpt.save(self, path, extra)

    def load(self, path: str) -> dict:
        """Restore a checkpoint written by `save` under any plan (same model and optimizer
        type); returns its `extra`. Collective: call on every rank. Loading never unpickles."""
        return rckpt.load(self, path)

    def __repr__(self):
        return f"ParallelModel(plan={self.plan}, world={self.world.size})"

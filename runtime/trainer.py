"""ParallelModel: one rank's training state built from a Program, and its step.

It runs Programs and nothing else (DESIGN.md section 2): the Program from fxpar.compile is
bound to this rank's process groups (runtime/comm.bind_groups), the user's parameters become
this rank's tp / ZeRO shards, the optimizer is built over what this rank holds, and step()
runs the graph (runtime/executor) or the pipeline schedule (runtime/pipeline). It imports no
pass and not the planner; fxpar.parallelize (compiler/api.py) wires the two together.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist

from fxpar.compiler import ir
from fxpar.compiler.errors import PlanError
from fxpar.runtime import amp, comm, cudagraph, executor, faults, optim
from fxpar.runtime import checkpoint as rckpt
from fxpar.runtime import tp_slices as rtp
from fxpar.runtime import trace as rtrace
from fxpar.runtime.pipeline import PipelineRunner
from fxpar.runtime.zero import ShardedOptimizer

log = logging.getLogger("fxpar")


def to_device(batch, device):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


class ParallelModel:
    """A model compiled for a Plan; `step(batch)` is one full training step.

    This rank's state, public for checkpointing (runtime/checkpoint.py) and tools: `params`
    (the parameter tensors in `program.signature` order: tp slices; with ZeRO-3 emptied,
    the shards live in the sharded optimizer), `buffers`, `sharded_optimizer` (ZeRO:
    runtime/zero.ShardedOptimizer, else None), `optimizer`, `pipeline_runner` (pp > 1 or
    microbatches: runtime/pipeline.PipelineRunner, else None), `tp_group`, `scaler`."""

    plan_report = None  # plan="auto": the planner's PlanResult (from program.plan_report)
    # plan="auto": after this many steps the planner's cost model is re-fitted to the
    # measured step time (compiler/api._refit_planner, through `on_measured`)
    REFIT_AFTER = 8

    def __init__(self, model, world, program: ir.Program, optimizer=None,
                 on_measured: Callable[[float], None] | None = None):
        """`program` from fxpar.compile, bound here to `world`'s process groups; `model` is
        the user's module (its tensors become this rank's shards). `on_measured(step_s)` is
        called once, after REFIT_AFTER steps, with the median measured step time (the
        slowest rank's): fxpar.parallelize re-fits the planner with it."""
        plan = program.plan
        self.model, self.world, self.plan, self.program = model, world, plan, program
        self.plan_report = program.plan_report
        self.stage_graphs = program.stage_graphs
        self.compile_times = program.compile_times
        self.fusion_skipped = program.fusion_skipped
        self._on_measured = on_measured
        comm.bind_groups(program, {ir.GROUPS[d]: world.group_name(d) for d in ir.GROUPS
                                   if world.group_name(d) is not None})
        self._eval_program = None
        self._lowered: dict[int, torch.fx.GraphModule] = {}
        self.recorder = rtrace.Recorder(world.rank)
        params = dict(model.named_parameters(remove_duplicate=False))  # tied weights: any name
        buffers = dict(model.named_buffers(remove_duplicate=False))
        sig = self.program.signature
        self.params = [params[n] for n in sig.param_names]
        self.tp_group = world.mesh.get_group("tp") if plan.tp > 1 else None
        with torch.no_grad():  # tp: each parameter becomes this rank's slice of it
            for p, layout in zip(self.params, self.program.tp_layouts):
                if layout is not None:
                    p.data = rtp.local_param(p.data, layout, plan.tp, world.coordinate("tp"))
        self.sharded_optimizer = None
        self.pipeline_runner = None
        if self.program.pipeline is not None:
            self.pipeline_runner = PipelineRunner(self.program, world.coordinate("pp"),
                                                  world.group_name("pp"))
        if self.program.zero:
            if isinstance(optimizer, torch.optim.Optimizer):
                raise PlanError(
                    f"Plan.zero={plan.zero} shards the optimizer state, so fxpar must build the "
                    "optimizer over this rank's shards: pass a factory, e.g. "
                    "`optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)`, not an instance.")
            factory = optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3))
            buckets = self.program.zero_buckets if self.pipeline_runner is None else [
                self.program.zero_buckets[k] for k in self.pipeline_runner.held_buckets]
            self.sharded_optimizer = ShardedOptimizer(
                lambda ps: optim.build(factory, ps), self.params, buckets, plan.dp,
                world.coordinate("dp"), world.mesh.get_group("dp"),
                shard_params=self.program.params_sharded)
            self.optimizer = self.sharded_optimizer.optimizer
        elif self.pipeline_runner is not None:  # this rank's stages' parameters only
            held = [self.params[i] for i in self.pipeline_runner.held_params]
            self.optimizer = None if not held else optim.build(optimizer, held if not isinstance(
                optimizer, torch.optim.Optimizer) else model)  # None: stages without weights
        else:
            self.optimizer = optim.build(optimizer, model)
        self.buffers = [buffers[n] for n in sig.buffer_names]
        self._mutated_buffers = [buffers[n] for n in sig.mutated_buffers]
        # fp16: the dynamic loss scale (runtime/amp.py); None for fp32 / bf16
        self.scaler = amp.GradScaler() if self.program.loss_scale else None
        self.cuda_graphs = self._cuda_graph_decision()  # runtime/cudagraph.Decision
        self._graphed: cudagraph.GraphedStep | None = None  # built at the first step
        self._norm_plan = None  # which gradient elements this rank counts (built on use)
        self.last_grad_norm = None  # the last step's global gradient norm (when computed)
        self.step_count = 0  # steps done = global batches consumed (saved by `save`)

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
        if d.capture and self.pipeline_runner is not None:
            self.pipeline_runner.use_cuda_graphs(self.world.device)
        return d

    # --- training ---------------------------------------------------------------------------
    def _run(self, program, batch):
        leaves = ir.flatten_batch(batch, program.signature)  # local_batch moves them
        local = executor.local_batch(leaves, program, self.world.coordinate("dp"),
                                     self.world.device)
        if program.loss_scale:
            local.append(self.scaler.scale_tensor(self.world.device))
        params = self.sharded_optimizer.param_shards if program.params_sharded else self.params
        if program is self.program and self.cuda_graphs.capture:
            if self._graphed is None:  # the graph's functional collectives are capturable
                self._graphed = cudagraph.GraphedStep(
                    lambda *a: executor.run_graph(program.graph, a, (), ()),
                    [True] * (len(params) + len(self.buffers)) + [False] * len(local),
                    self.world.device)
            outs = list(self._graphed([*params, *self.buffers, *local]))
            outs[0] = outs[0].clone()  # the static output is overwritten by the next replay
            return outs
        gm = self._lowered.get(id(program))
        if gm is None:
            gm = self._lowered[id(program)] = comm.lower(program.graph)
        return executor.run_graph(gm, params, self.buffers, local)

    def _run_pipeline(self, program, runner, batch, rec=None, forward_only=False):
        """All microbatches through this rank's stages; the loss on every rank."""
        batch = to_device(batch, self.world.device)
        trees = ir.microbatches(batch, program.microbatches, program.dp) \
            if program.microbatches > 1 else [batch]
        mbs = [executor.local_batch(ir.flatten_batch(t, program.signature), program,
                                    self.world.coordinate("dp"), self.world.device)
               for t in trees]
        if program.loss_scale:
            for leaves in mbs:
                leaves.append(self.scaler.scale_tensor(self.world.device))
        if program.loss_count is not None:  # the whole step's target count, shared out
            with torch.no_grad():
                total = sum(program.loss_count(*ir.flatten_batch(t, program.signature))
                            for t in trees)  # int64
                share = (total / program.microbatches).to(program.loss_count.meta["dtype"])
            for leaves in mbs:
                leaves.append(share)
        loss, grads, new_bufs = runner.run(self.params, self.buffers, mbs, self.world.device,
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
        if n == self.REFIT_AFTER and self._on_measured is not None \
                and self.plan_report is not None:  # a planned job: a collective, all ranks
            self._report_measured()
        return loss

    def _report_measured(self) -> None:
        """Hand the measured step time (median of the steps after the first two; a step
        lasts as long as its slowest rank) to `on_measured`."""
        times = sorted(s.time_s for s in list(self.recorder.stats)[2:])
        if not times:
            return
        t = torch.tensor([times[len(times) // 2]], dtype=torch.float64)
        if self.world.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self._on_measured(float(t))

    def _train_step(self, batch) -> torch.Tensor:
        if self.pipeline_runner is not None:
            with executor.recording(self.recorder) as rec:
                loss, grads, new_bufs = self._run_pipeline(self.program,
                                                           self.pipeline_runner, batch,
                                                           rec)
                faults.check_loss(loss, self.plan)
                rec.segment("optimizer")
                held = self.pipeline_runner.held_params
                if self.sharded_optimizer is not None:
                    shards = [grads[k] for k in self.pipeline_runner.held_buckets]
                    if self._finish_grads(shards):
                        self.sharded_optimizer.step(shards)
                    self.pipeline_runner.sync_tied_params(self.params, self.program.zero_buckets)
                elif not self._finish_grads(grads):
                    pass  # fp16 overflow on some rank: every rank skips this update
                elif self.optimizer is not None:
                    optim.apply_gradients(self.optimizer, [self.params[i] for i in held],
                                          [grads[i] for i in held])
                with torch.no_grad():
                    for buf, val in zip(self._mutated_buffers, new_bufs):
                        if val is not None:
                            buf.copy_(val)
            return loss.detach()
        with executor.recording(self.recorder) as rec:
            outs = self._run(self.program, batch)
            n_g = len(self.program.zero_buckets) if self.sharded_optimizer else len(self.params)
            loss, grads, new_bufs = outs[0], outs[1:1 + n_g], outs[1 + n_g:]
            faults.check_loss(loss, self.plan)
            rec.segment("optimizer")
            if not self._finish_grads(grads):
                pass  # fp16 overflow on some rank: every rank skips this update
            elif self.sharded_optimizer:
                self.sharded_optimizer.step(grads)
            else:
                optim.apply_gradients(self.optimizer, self.params, grads)
            self._update_buffers(new_bufs)
        if self._graphed is not None:  # the last replay's GPU time (the loss check synced)
            self.recorder.stats[-1].device_s = self._graphed.last_device_s()
        return loss.detach()

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
        r = self.pipeline_runner
        if self.sharded_optimizer is None:  # whole gradients, equal on every dp rank: dp
            # rank 0 counts
            first = self.world.coordinate("dp") == 0

            def owner(i):  # a weight several pipeline stages hold: its first stage counts it
                return r is None or self.plan.pp == 1 or r.rank_of(
                    min(r.p.param_stages.get(i, {0}))) == r.rank
            return amp.GradNormPlan([first and owner(i) and (layouts[i] is not None or tp0)
                                     for i in range(len(self.params))])
        buckets = self.program.zero_buckets if r is None else [
            self.program.zero_buckets[k] for k in r.held_buckets]
        dp, dp_r = self.plan.dp, self.world.coordinate("dp")
        counted = []
        # each rank counts its own shard
        for idx, shard in zip(buckets, self.sharded_optimizer.shards):
            mask = torch.zeros(shard.numel() * dp, device=shard.device)
            off = 0
            for i in idx:
                n = self.sharded_optimizer.shapes[i].numel()
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
        if self.pipeline_runner is not None:
            # the training program's forward parts: the same stages hold the same weights
            return self._run_pipeline(self.program, self.pipeline_runner, batch,
                                      forward_only=True)[0].detach()
        if self._eval_program is None:  # compiled from the stand-ins compile kept: the
            # model's own tensors (shards by now) are never traced
            self._eval_program = self.program.build_eval()
            comm.bind_groups(self._eval_program, self.program.bound_groups)
            if self._eval_program.tp_layouts != self.program.tp_layouts:
                raise PlanError(
                    "evaluate() under tensor parallelism: the forward-only graph was sharded "
                    f"differently from the training graph ({self._eval_program.tp_layouts} vs "
                    f"{self.program.tp_layouts}); please report this model to fxpar.")
        outs = self._run(self._eval_program, batch)
        return outs[0].detach()

    # --- tensor-parallel shards ------------------------------------------------------------
    def tp_full_params(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> the user's full weight, for every tp-sharded one (collective)."""
        if self.tp_group is None:
            return {}
        return {id(p): rtp.full_param(p.data, layout, self.plan.tp, self.tp_group)
                for p, layout in zip(self.params, self.program.tp_layouts)
                if layout is not None}

    # --- state ------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers, keys as in model.state_dict(), on every rank
        (with ZeRO-3, tensor parallelism or pipeline stages this gathers: call it on every
        rank)."""
        state = self.model.state_dict(keep_vars=True)
        tp_full = self.tp_full_params()
        if self.pipeline_runner is not None and self.plan.pp > 1:
            return self._gather_stages(state, tp_full)
        if tp_full:
            return {k: tp_full[id(v)] if id(v) in tp_full else v.detach().clone()
                    for k, v in state.items()}
        if self.sharded_optimizer is not None and self.sharded_optimizer.shard_params:
            full = dict(zip(map(id, self.params), self.sharded_optimizer.full_params()))
            return {k: full[id(v)] if id(v) in full else v.detach().clone()
                    for k, v in state.items()}
        return {k: v.detach().clone() for k, v in state.items()}

    def state_stages(self, state) -> dict[str, set[int]]:
        """Pipeline: the stages holding each model.state_dict() entry (parameters and buffers
        by the stage split; anything else: stage 0)."""
        r = self.pipeline_runner
        ids = {id(p): i for i, p in enumerate(self.params)}
        bids = {id(b): j for j, b in enumerate(self.buffers)}
        return {k: r.p.param_stages.get(ids[id(v)], {0}) if id(v) in ids else
                r.p.buffer_stages.get(bids[id(v)], {0}) if id(v) in bids else {0}
                for k, v in state.items()}

    def _gather_stages(self, state, tp_full=None):
        """Each weight from the first stage that holds it (copies on other stages are equal);
        `tp_full`: id -> full weight where this rank holds a tp shard."""
        tp_full = tp_full or {}
        r = self.pipeline_runner
        owned = {}
        for k, stages_ in self.state_stages(state).items():
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

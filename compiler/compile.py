"""fxpar.compile: model + loss + example batch + plan -> Program, with no process group.

Pure (docs/design.md section 1): it opens no process group, allocates no device memory and reads
no weight values, so a model whose parameters are on the meta device compiles (they are
traced as fake stand-ins on the target device type; the model is left as it was). It owns
capture -> every pass -> the stage split, and returns the Program the runtime runs: the
graph(s), the decisions every pass recorded (core/ir.py), the schedule, the snapshots
for pictures and the compile times (program.compile_times: one row per phase, "other" for
the rest, adding up to compile's wall time). Collectives name the symbolic groups of ir.GROUPS; the
runtime binds them to its process groups. fxpar.parallelize = compile + runtime/trainer.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.compiler import capture as cap
from fxpar.compiler import codegen, planner, stages
from fxpar.core import cost, ir
from fxpar.core.cost import device_memory
from fxpar.core.errors import PlanError
from fxpar.core.graphs import snapshot, summed_buffer_updates, verify
from fxpar.core.logs import Clock, announce, configure
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.passes import data_parallel
from fxpar.core.plan import Plan, needs_search, resolve, world_of

log = logging.getLogger(__name__)


def compile(model: torch.nn.Module, devices, *, example_batch, loss_fn: Callable | None = None,
            plan: Any = "auto") -> ir.Program:
    """Compile `model` + `loss_fn` for `devices` (int | device strings | DeviceMesh) into the
    Program every rank runs (one graph for all ranks: a rank's coordinates are read from its
    groups at run time). plan="auto" (or "auto" degrees) asks the planner, pricing with the
    device type's data-sheet figures (on CPU: this machine's measured matmul and copy
    speed; `fxpar.parallelize` also times the model and the collectives)."""
    configure()
    clock = Clock(log)
    world_size, dev_type = world_of(devices)
    if dev_type == "cuda" and not torch.cuda.is_available():  # (tracing CUDA fakes aborts
        raise PlanError(  # the process in a CPU build of torch)
            f"devices={devices!r} are CUDA devices but this torch sees no CUDA GPU (torch "
            f"{torch.__version__}); compile on a machine with one, or for CPU devices "
            "(an int world size, or ['cpu', ...]).")
    report = captured = None
    if world_size > 1 and needs_search(plan):  # (a meta model: priced from its shapes)
        constraints = planner.constraints_of(plan)
        with clock("planner: trace model"):
            stats = planner_stats(model, example_batch, loss_fn, dev_type, constraints)
        report = planner.auto_plan(stats, None, world_size, dev_type, constraints=constraints)
        plan = report.best.plan
        clock.extend(report.times)
        captured, stats.graph = stats.graph, None  # (the report keeps no graph)
    resolved = resolve(plan, world_size)
    captured = reusable(captured, resolved, torch.device(dev_type))  # (else let go of it)
    program = build(model, example_batch, loss_fn, resolved, torch.device(dev_type),
                    captured=captured)
    del captured
    clock.extend(program.compile_times)
    return dataclasses.replace(program, plan_report=report, compile_times=clock.finish())


def planner_stats(model, example_batch, loss_fn=None, device="cpu",
                  constraints: dict | None = None, *, precision: str | None = None,
                  pass_extras: bool = False, kernel_cross_entropy: bool | None = None
                  ) -> planner.GraphStats:
    """Capture the model as it is (its weights where they are; a meta model on fake
    stand-ins) and reduce the graph to the planner's statistics (planner.graph_stats), at
    the precision the constraints fix and with fxpar's cross-entropy kernel where the job on
    `device` would run it (GraphStats.graph holds the capture: the calibration times it and
    the compile of a plan that runs the whole batch per call reuses it, `reusable`)."""
    constraints = constraints or {}
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if kernel_cross_entropy is None:
        kernel_cross_entropy = planner.kernel_cross_entropy(device, constraints)
    return planner.graph_stats(
        cap.capture_as_is(model, example_batch, loss_fn, torch.device(device).type),
        cap.batch_rows(example_batch),
        pass_extras=pass_extras, kernel_cross_entropy=kernel_cross_entropy,
        precision=precision or constraints.get("precision") or "fp32",
        heads=heads if isinstance(heads, int) else None)


def reusable(captured: tuple | None, plan: Plan, device: torch.device) -> tuple | None:
    """The planner's capture (`planner_stats`) where `build` would capture the same graph
    again (a plan of one microbatch on more than one device: the whole example batch, with
    BatchNorm decomposed; traced on this device type), else None. Handed over, not shared:
    the passes rewrite it in place."""
    if captured is None or plan.microbatches != 1 or plan.dp * plan.tp * plan.pp == 1:
        return None
    vals = [n.meta.get(ir.VAL) for n in captured[0].graph.nodes if n.op == "placeholder"]
    if any(isinstance(v, torch.Tensor) and v.device.type != device.type for v in vals):
        return None
    return captured


def eval_builder(model, example_batch, loss_fn, plan: Plan, device: torch.device,
                 tp_layouts: list | None) -> Callable[[], ir.Program]:
    """evaluate()'s forward-only program, compiled on first use from stand-ins made now (the
    runtime shards the model's own tensors later), so it never needs the full weights back in
    the model. It keeps the training program's tp layouts (`tp_layouts`; the forward-only
    graph alone could decide other splits), whose shards the runtime holds."""
    stand_ins = cap.fake_weights(model, device, everything=True)
    return lambda: build(model, example_batch, loss_fn, plan, device, joint=False,
                         stand_ins=stand_ins, tp_layouts=tp_layouts)


def build(model, example_batch, loss_fn, plan: Plan, device: torch.device, *,
          joint: bool = True, stand_ins: dict | None = None,
          captured: tuple | None = None, plan_report=None,
          tp_layouts: list | None = None) -> ir.Program:
    """capture -> passes -> stage split for one resolved Plan. joint=False: the forward-only
    program of `evaluate`. `stand_ins`: fake weights to trace with (default: for those on
    the meta device or another device type than `device`). `captured`: the (graph,
    signature) the planner captured of this model and batch (`reusable`),
    used instead of capturing again. `tp_layouts`: the training program's parameter layouts,
    which evaluate's forward-only program keeps. program.compile_times: one row
    per phase of the build (capture, each pass, the stage split, evaluate's stand-ins)."""
    m = plan.microbatches if joint else 1
    t0 = time.perf_counter()
    example = ir.microbatches(example_batch, m, plan.dp // plan.cp)[0] if m > 1 else \
        example_batch  # (the batch's rows split dp/cp ways: cp ranks share theirs)
    if stand_ins is None:  # meta weights, or weights on another device type than `device`
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        stand_ins = cap.fake_weights(model, device, mode=mode)
    else:
        mode = detect_fake_mode(tuple(stand_ins.values())) or \
            FakeTensorMode(allow_non_fake_inputs=True)
    example = cap.fake_batch(example, device, mode)
    # BatchNorm as ATen's own kernels (eager's numerics) when one device runs the whole
    # batch at once; decomposed into sums where the batch is split (dp all-reduces them;
    # microbatching's row-coupling check reads them): compiler/capture.py's docstring
    whole_batch = plan.dp * plan.tp * plan.pp == 1 and m == 1
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if captured is not None and joint and m == 1 and not whole_batch:
        gm, sig = captured
        how = "the planner's capture"
    else:
        with announce(log, f"capturing {type(model).__name__}'s forward"
                      + (" + backward" if joint else "") + f" ({n_params / 1e6:.1f}M parameters)"):
            gm, sig = cap.capture(model, example, loss_fn, joint=joint, stand_ins=stand_ins,
                                  decompose_batch_norm=not whole_batch)
        how = "captured"
    clock = Clock(log)
    clock.add("capture", time.perf_counter() - t0,
              detail=f"{len(gm.graph.nodes)} nodes, {how}")
    moving = [b for b, summed in zip(sig.mutated_buffers, summed_buffer_updates(gm, sig))
              if not summed]  # (a buffer that only adds is summed over the microbatches)
    if m > 1 and moving and plan.batch_stats == "whole":
        raise PlanError(
            f"microbatches={m} would update the buffers {moving[:3]} once per microbatch "
            "(e.g. BatchNorm running statistics), which is not what one step on the whole "
            "batch does. Use microbatches=1; or plan batch_stats='microbatch' to train as "
            "gradient accumulation in eager PyTorch does (each microbatch normalised by its "
            "own statistics, the running buffers updated once per microbatch); or a model "
            "without batch-statistics buffers (LayerNorm/GroupNorm).")
    virtual = 2 if plan.schedule == "interleaved" else 1
    gen, gen_why = codegen.decide(plan.codegen, device)
    ctx = PassContext(signature=sig, virtual_stages=virtual, device=device, codegen=gen,
                      profile=cost.DeviceProfile.for_device(device), tp_layouts=tp_layouts,
                      memory_budget=activation_budget(model, plan, device) if joint else None)
    snapshots: dict[str, dict[str, torch.fx.GraphModule]] = {}
    gm = run_passes(gm, plan, ctx, role="dp", snapshots=snapshots)
    if torch.device(device).type == "cpu":
        codegen.cpu_indexed_adds(gm)
    d = gm.meta
    for row in d[ir.PASS_TIMES]:  # (each logged by the pass manager)
        clock.add(*row, quiet=True)
    pipeline = None
    if plan.pp > 1 or m > 1:
        t1 = time.perf_counter()
        pipeline = stages.split(gm, sig, plan.pp * virtual)
        for part in pipeline.parts.values():  # checked like every pass's result
            verify(part.graph)
        snapshots["stages"] = {k: snapshot(p.graph) for k, p in pipeline.parts.items()}
        clock.add("stages", time.perf_counter() - t1, len(pipeline.parts))
    local_graph = None
    if joint and plan.ps and plan.ps_staleness:  # an asynchronous parameter-server worker:
        # its share of the batch alone (no collective: it never waits for another worker)
        with clock("worker's own graph"):
            local_graph = build(model, _share(example_batch, d[ir.BATCH_SHARD_DIMS], plan.dp),
                                loss_fn, dataclasses.replace(plan, dp=1, ps=0, ps_staleness=0),
                                device, stand_ins=stand_ins).graph
        snapshots["worker"] = {"joint": snapshot(local_graph)}
    elif joint and (plan.grad_compression != "none" or plan.ps):  # 1-bit Adam's compressed
        # phase; a synchronous parameter-server worker (the servers sum the gradients)
        with clock("local gradients"):
            local_graph = data_parallel.without_gradient_reduction(gm, sig.num_params)
            verify(local_graph)
        snapshots["local gradients"] = {"joint": snapshot(local_graph)}
    build_eval = None
    if joint:
        with clock("evaluate stand-ins"):
            build_eval = eval_builder(model, example_batch, loss_fn, plan, device,
                                      d.get(ir.TP_LAYOUTS))
    piped = pipeline is not None
    return ir.Program(
        graph=gm, signature=sig, dp=plan.dp, batch_shard_dims=d[ir.BATCH_SHARD_DIMS],
        cp=plan.cp if d.get(ir.SEQUENCE_SPLIT) else 1,
        zero=plan.zero if d.get(ir.ZERO_BUCKETS) else 0,
        zero_buckets=d.get(ir.ZERO_BUCKETS, []), params_sharded=d.get(ir.PARAMS_SHARDED, False),
        pipeline=pipeline, pp=plan.pp if piped else 1, microbatches=m if piped else 1,
        schedule=(plan.schedule if joint else "gpipe") if piped else "1f1b",
        virtual=virtual if piped else 1, offload=bool(plan.offload and joint) if piped else False,
        tp=plan.tp, tp_layouts=d.get(ir.TP_LAYOUTS) or [None] * sig.num_params,
        ep=plan.ep if d.get(ir.EXPERT_PARAMS) or d.get(ir.EXPERT_SLOTS) else 1,
        expert_params=d.get(ir.EXPERT_PARAMS, []), expert_slots=d.get(ir.EXPERT_SLOTS, []),
        loss_scale=d.get(ir.LOSS_SCALE, False), loss_count=d.get(ir.LOSS_COUNT),
        plan=plan, plan_report=plan_report, stage_graphs=snapshots,
        compile_times=clock.rows(other=False), fusion_skipped=d.get(ir.FUSION_SKIPPED),
        codegen=gen, codegen_why=gen_why, build_eval=build_eval, local_graph=local_graph)


def _share(batch, shard_dims: list, dp: int):
    """The first dp rank's share of the global `batch` (each tensor leaf cut along the dim
    the data_parallel pass split it on)."""
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    dims = iter(shard_dims)
    cut = [x.chunk(dp, d)[0] if isinstance(x, torch.Tensor) and (d := next(dims)) is not None
           else x for x in leaves]
    return torch.utils._pytree.tree_unflatten(cut, spec)


def model_state_bytes(model, plan: Plan, device: torch.device, states: int = 2) -> int:
    """This rank's parameters, and for the trainable ones their gradients and the
    optimizer's `states` parameter-sized tensors (tp / pp split the weights, ZeRO the rest
    over dp: roughly; compiler/memory_model.py prices it per stage). With
    Plan.offload_optimizer the states are in host memory; on a CPU device that is this
    memory, and the host copies and their gradient buffers add two more."""
    split = plan.tp * plan.pp
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / split
    trained = sum(p.numel() * p.element_size() for p in model.parameters()
                  if p.requires_grad) / split
    n = plan.shard_ranks  # (HSDP: its shard group)
    per_state = trained / (n if plan.zero >= 1 else 1)
    if plan.offload_optimizer:
        states = states + 2 if device.type == "cpu" else 0
    secondary = params / plan.hpz if plan.hpz else 0.0  # (hpZ's, forward to backward)
    return int(params / (n if plan.zero >= 3 else 1) + secondary
               + trained / (n if plan.zero >= 2 else 1) + states * per_state)


def activation_budget(model, plan: Plan, device: torch.device) -> int | None:
    """For remat="auto": device memory (90%) less this rank's parameters, gradients and
    optimizer state (Adam's two moments assumed: the optimizer is built after compiling;
    none on a GPU with Plan.offload_optimizer)."""
    if plan.remat != "auto":
        return None
    total = int(0.9 * device_memory(device))
    fixed = model_state_bytes(model, plan, device)
    if fixed >= total:
        raise PlanError(
            f"the model does not fit: parameters, gradients and optimizer state need "
            f"{fixed / 2**30:.2f} GiB per device but {total / 2**30:.2f} GiB is available. "
            "Fix: more devices with tensor/pipeline parallelism or ZeRO, "
            + ("" if plan.offload_optimizer or device.type == "cpu" else
               "the optimizer's state in host memory (Plan.offload_optimizer), ")
            + "or a smaller model.")
    return total - fixed

"""fxpar.parallelize: plan (when "auto") -> fxpar.compile -> this rank's runtime.

The one place where the compiler and the runtime meet: the runtime measures this machine and
the planner prices the plans with it (api/autoplan.for_parallelize), compiler/compile.py
turns the model into a Program with no process group, and runtime/trainer.ParallelModel
runs it on this rank (with the compiler's code generator handed in). After REFIT_AFTER steps the
trainer hands back the measured step time and the planner is re-fitted with it here.
pm.compile_times itemises every second of parallelize (planning, process groups, capture,
each pass, the runtime's set-up, "other" for the rest); phases over 2 s print a line.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpar.api import autoplan
from fxpar.compiler import capture, codegen, planner
from fxpar.compiler.capture import meta_tensors
from fxpar.compiler.compile import build, eval_builder, model_state_bytes, reusable
from fxpar.compiler.memory_model import OPTIMIZER_STATES, optimizer_kind
from fxpar.core import ir, program_io
from fxpar.core.cost import device_memory
from fxpar.core.errors import OWN_CODE, PlanError
from fxpar.core.logs import Clock, configure
from fxpar.core.plan import Plan, needs_search, resolve, world_of
from fxpar.runtime import dist as rdist
from fxpar.runtime import param_server
from fxpar.runtime import verify as rverify
from fxpar.runtime import weights as rweights
from fxpar.runtime.trainer import ParallelModel, to_device

log = logging.getLogger(__name__)


def parallelize(model: torch.nn.Module, devices, *, example_batch, loss_fn: Callable | None = None,
                optimizer: Callable | None = None, plan: Any = "auto", weights=None,
                batch: str = "global") -> ParallelModel:
    """Compile `model` + `loss_fn` into a training step that runs across `devices`.

    See docs/design.md section 1. Every rank calls this with the same arguments.
    `weights`: None, or a path (a .safetensors file, a Hugging Face save_pretrained
    directory, a torch state-dict file, an fxpar checkpoint) each rank reads only its
    slices from. A model on the meta device (all or some of its tensors) is never made
    whole: each rank allocates only what its Program owns, read from `weights` or, with
    weights=None, made by the modules' own init (runtime/weights.py).
    `batch`: "global" (every rank passes the same global batch to step/evaluate) or
    "local" (each rank passes its 1/dp share: pm.dp_rank, pm.dp_size; example_batch is
    still one global batch).

    A failed parallelize leaves nothing behind (`_release_after_failure`): the process group
    it opened is closed, and its graphs and tensors are freed even while the caller (or a
    notebook) keeps the exception.
    """
    opened_group = not (dist.is_available() and dist.is_initialized())
    try:
        return _parallelize(model, devices, example_batch, loss_fn, optimizer, plan, weights,
                            batch)
    except BaseException as e:
        _release_after_failure(e, opened_group)
        raise


def _release_after_failure(e: BaseException, opened_group: bool) -> None:
    """What a failed parallelize made is released: the frames of fxpar and torch in the
    exception's traceback (and its causes') let go of their locals - captured graphs, fake
    and real tensors, compiled code - which an exception kept by the caller or a notebook
    (sys.last_value) would otherwise hold, with the device memory under them (the user's own
    frames keep theirs, for a debugger); the process group parallelize opened is destroyed
    (its peers fail at their next collective instead of waiting for the timeout); an
    out-of-memory error says in which phase it happened and what to try."""
    import gc
    chain, err = [], e
    while err is not None and all(err is not c for c in chain):
        chain.append(err)
        err = err.__cause__ or err.__context__
    oom = next((c for c in chain if isinstance(c, torch.OutOfMemoryError)), None)
    if oom is not None and not any(n.startswith("fxpar:") for n in getattr(oom, "__notes__", [])):
        oom.add_note(
            f"fxpar: the device ran out of memory in parallelize, {_phase_of(e)}. "
            "Try remat='auto' (recompute activations instead of keeping them), a smaller "
            "example batch, ZeRO (plan={'zero': 3}) or more devices; a model built on the "
            "meta device with weights=PATH puts only each rank's shards on the device.")
    ours = (*OWN_CODE, os.path.dirname(torch.__file__) + os.sep)
    for c in chain:
        for frame, _ in traceback.walk_tb(c.__traceback__):
            if frame.f_code.co_filename.startswith(ours):
                try:
                    frame.clear()
                except RuntimeError:  # still running: parallelize itself
                    pass
    if opened_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PHASES = (("compiler/capture", "while capturing the model"),
           ("compiler/planner", "while planning"), ("api/autoplan", "while planning"),
           ("runtime/machine", "while measuring the machine for the planner"),
           ("compiler/codegen", "while generating code (Inductor)"),
           ("kernels/", "while compiling kernels"),
           ("runtime/weights", "while loading the weights"),
           ("runtime/dist", "on rank 0, while compiling (its error sent to every rank)"),
           ("runtime/", "while setting up the runtime (parameters, optimizer state)"),
           ("passes/", "in pass"), ("compiler/pass_manager", "while running the passes"))


def _phase_of(e: BaseException) -> str:
    """The phase of parallelize that raised `e`: its innermost frame in fxpar's own code."""
    inside = [f.f_code.co_filename[len(_ROOT):].replace(os.sep, "/")
              for f, _ in traceback.walk_tb(e.__traceback__)
              if f.f_code.co_filename.startswith(OWN_CODE)
              and not f.f_code.co_filename.startswith(_ROOT + "api" + os.sep)]
    for prefix, said in _PHASES:
        if inside and inside[-1].startswith(prefix):
            return f"{said} {inside[-1][len(prefix):-3]}" if said == "in pass" else said
    return "while compiling"


def _parallelize(model, devices, example_batch, loss_fn, optimizer, plan, weights, batch):
    configure()
    clock = Clock(log)
    world_size, _ = world_of(devices)
    meta = meta_tensors(model)
    source = None
    if meta or weights is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            raise PlanError(
                "optimizer is an instance built over the model's parameters, but with "
                + ("a model on the meta device" if meta else "weights=") + " fxpar makes "
                "each rank's parameters itself (only its shards), so that instance would "
                "step tensors the model no longer uses. Pass a factory, e.g. "
                "`optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)`.")
        with clock("open weights"):  # opened and checked before anything
            source = rweights.ModelWeights(model, weights)
            source.check()  # every key there, in its shape: before minutes of compiling
    if world_size > 1:
        with clock("process group start"):
            rdist.setup(devices)  # the default group (the mesh comes once the plan is known)
        _same_arguments_on_every_rank(plan, example_batch, batch)
    plan = _plan_of_mesh(plan, devices)  # (a user's mesh: its shard groups, its order)
    plan_report = captured = None
    if world_size > 1 and needs_search(plan):  # plan="auto" / unset degrees: the planner
        plan, plan_report, captured = autoplan.for_parallelize(
            model, devices, world_size, plan, example_batch, loss_fn, optimizer)
        clock.extend(plan_report.times)  # (each logged where it was measured)
    resolved = resolve(plan, world_size)
    if os.environ.get("FXPAR_VERIFY", "").strip().lower() in ("1", "true", "yes"):
        resolved.verify = True
        resolved.validate(world_size)  # (what verify cannot check: a lossy plan)
    if resolved.verify:
        rverify.check_optimizer(optimizer)
        if batch != "global":
            raise PlanError("Plan.verify compares the first step with one process on the whole "
                            "batch: use batch='global' (or verify=False).")
    if resolved.ps:
        param_server.check_optimizer(optimizer)
    dims = mesh_dims(resolved)
    with clock("device mesh"):  # (Plan.ps: over the workers, the first dp ranks)
        world = rdist.setup(devices, dims=dims)
        ps_group = dist.new_group(backend="gloo", timeout=rdist.timeout()) \
            if resolved.ps else None
    server = resolved.ps and world.rank >= resolved.dp  # a Plan.ps server rank
    if world_size == 1 and needs_search(plan) and \
            optimizer_state_needs_host(model, optimizer, world.device):
        resolved.offload_optimizer = True
    if resolved.offload and world.device.type == "cpu":
        warnings.warn("Plan.offload on a CPU device copies saved activations between two "
                      "buffers of the same host memory: it saves nothing there (it is meant "
                      "for GPUs; on CPU it only exercises the schedule).", stacklevel=2)
    if resolved.offload_optimizer and world.device.type == "cpu":
        warnings.warn("Plan.offload_optimizer on a CPU device keeps the optimizer's state where "
                      "it was (host and device are one memory) and adds a copy of the "
                      "parameters: it saves nothing there (it is meant for GPUs; on CPU it only "
                      "exercises the path).", stacklevel=2)
    if source is None and not server:  # (a server moves only its share to the device)
        _check_whole_model_fits(model, world.device)
        with clock("model to device"):
            model.to(world.device)
    if world.size > 1 and weights is None:  # start from rank 0's weights, as DDP does
        with clock("broadcast weights"), torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                if not t.is_meta:  # (a partly-meta model's real tensors: on the host)
                    buf = t.data.to(world.device)
                    dist.broadcast(buf, src=0)
                    if buf is not t.data:
                        t.data.copy_(buf)
        if source is not None:  # a meta model's init: every rank seeded as rank 0 is
            seed = torch.tensor([source.init.seed], dtype=torch.int64, device=world.device)
            dist.broadcast(seed, src=0)
            source.init.seed = int(seed)
    example_batch = to_device(example_batch, world.device)
    captured = reusable(captured, resolved, world.device) if world.rank == 0 else None

    def compile_here():  # plan_report: planner.PlanResult or None
        return build(model, example_batch, loss_fn, resolved, world.device,
                     captured=captured, plan_report=plan_report)

    def evaluate_builder(p):  # (as compile.build makes it: the training tp layouts kept)
        return eval_builder(model, example_batch, loss_fn, resolved, world.device,
                            p.tp_layouts if p.tp > 1 else None)
    program, shared = _compiled_once(
        world, compile_here, plan_report, evaluate_builder,
        eval_group=world.mesh.get_group("dp") if resolved.ps and not server else None)
    del captured
    if shared is not None and world.rank != 0:
        clock.add(*shared)  # (its wait for rank 0: before the rows of its own compile)
    clock.extend(program.compile_times)
    if shared is not None and world.rank == 0:
        clock.add(*shared)
    if server:
        pm = param_server.ServerRank(model, world, program, optimizer,
                                     list(range(resolved.dp)), ps_group, weights=source)
        pm.compile_times = clock.finish()
        return pm
    if resolved.ps:  # a worker's World: the workers alone
        world = dataclasses.replace(world, size=resolved.dp, group=world.mesh.get_group("dp"))
    pm = ParallelModel(model, world, program, optimizer,
                       on_measured=lambda step_s: _refit_planner(pm, step_s),
                       weights=source, batch=batch,
                       loss_of=_eager_loss(loss_fn) if resolved.verify else None,
                       generate=codegen.generate, ps_group=ps_group)
    clock.extend(pm.compile_times[len(program.compile_times):])  # the runtime's set-up
    pm.compile_times = clock.finish()
    return pm


def _compiled_once(world, compile_here: Callable[[], ir.Program], plan_report,
                   evaluate_builder: Callable[[ir.Program], Callable[[], ir.Program]], *,
                   eval_group=None) -> tuple[ir.Program, tuple[str, float] | None]:
    """Rank 0 compiles; every other rank loads its Program (core/program_io, the passes'
    reports kept), and evaluate()'s program likewise when first asked (over `eval_group`:
    Plan.ps's workers). So every rank runs one Program, whatever in its process could make
    a compile differ; the compile's CPU time is spent once per job, not once per rank (eight
    times on an 8-GPU node's host, whose ranks share its cores); and a compile error is
    raised on every rank. A Program that does not pickle (a graph calling a function made at
    compile time), or does not load, is compiled by every rank, as rank 0 did.
    `evaluate_builder(program)`: a builder of evaluate()'s program like the compile's own
    (its stand-ins, the training program's tp layouts), for a rank that loaded the Program
    (in case evaluate()'s does not pickle). Returns the Program and the compile_times row of
    its sending or of the wait for it (None on one rank)."""
    if world.size == 1:
        return compile_here(), None
    t = time.perf_counter()
    mine = []

    def make():
        nonlocal t
        mine.append(compile_here())
        t = time.perf_counter()  # (rank 0: the compile has its own rows)
        return _sendable(mine[0]), mine[0].build_eval is not None
    data, has_eval = rdist.from_rank_0(make)
    row = ("program from rank 0" if not mine else "program to the ranks" if data is not None
           else "program not sent", time.perf_counter() - t)
    if data is None:  # (why: logged on rank 0) every rank compiles, evaluate()'s too
        return (mine[0] if mine else compile_here()), row
    if mine:
        program = mine[0]
    else:  # (this rank's own planner report: a planned job's ranks all re-fit it)
        program = _loaded(data, world)
        program = compile_here() if program is None else dataclasses.replace(
            program, plan_report=plan_report, compile_times=[])
    if has_eval:  # (a loaded Program has no builder: this rank makes its own)
        build_eval = program.build_eval or evaluate_builder(program)
        program = dataclasses.replace(program, build_eval=_evaluate_compiled_once(
            world, build_eval, eval_group))
    return program, row


def _sendable(program: ir.Program) -> bytes | None:
    """The Program as bytes for the other ranks, or None where it does not pickle."""
    try:
        return program_io.dumps(program, evaluate=False, reports=True)
    except Exception as e:  # noqa: BLE001 - any reason: each rank compiles its own instead
        log.info("the Program cannot be sent to the other ranks (%s: %s): each compiles its "
                 "own", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _loaded(data: bytes, world) -> ir.Program | None:
    """Rank 0's Program on this rank's device, or None where it does not load."""
    try:
        return program_io.loads(data, device=world.device, source="rank 0's Program")
    except Exception as e:  # noqa: BLE001 - any reason: this rank compiles its own instead
        log.warning("rank %d could not load rank 0's Program (%s: %s): it compiles its own",
                    world.rank, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _evaluate_compiled_once(world, build_eval, group) -> Callable[[], ir.Program]:
    """build_eval on rank 0, its Program loaded on the others (evaluate() is collective: every
    rank asks at once); where it does not pickle or load, each rank's own build_eval."""
    def shared():
        mine = []

        def make():  # (no snapshots: no one draws evaluate()'s program)
            mine.append(build_eval())
            return _sendable(dataclasses.replace(mine[0], stage_graphs={}))
        data = rdist.from_rank_0(make, group)
        if mine:
            return mine[0]
        got = _loaded(data, world) if data is not None else None
        return build_eval() if got is None else got
    return shared


# the mesh dims fxpar's dp group is made of (api/parallelize.mesh_dims)
DP_DIMS = ("dp", "dp_rep", "dp_shard", "edp", "edp_shard", "ep", "cdp", "cdp_shard", "cp",
           "ecp", "cep")


def _plan_of_mesh(plan, devices):
    """What a DeviceMesh the user passes says of the plan (runtime/dist.setup runs on the
    user's mesh where its dims and their order are the plan's, api/parallelize.mesh_dims):
    with HSDP's dims ("dp_rep", "dp_shard"[, "pp"][, "tp"]) its shard groups
    (Plan.dp_shard); with "pp" of more than one stage ahead of its dp dims the stages
    outermost (Plan.pp_outer) and that many stages. Each is the plan's unless the plan names
    its own: a different dp_shard, or pp_outer=False in a dict, is refused (a Plan object's
    pp_outer, False by default, is the mesh's)."""
    names = getattr(devices, "mesh_dim_names", None) or ()
    says = {}
    if "dp_shard" in names:
        says["dp_shard"] = devices.size(names.index("dp_shard"))
    dps = [i for i, d in enumerate(names) if d in DP_DIMS]
    dp = math.prod(devices.size(i) for i in dps)
    if "pp" in names and dps and names.index("pp") < min(dps) and dp > 1 and \
            devices.size(names.index("pp")) > 1:
        says["pp_outer"] = True
        says["pp"] = devices.size(names.index("pp"))
    if not says:
        return plan
    if plan is None or plan == "auto":  # (the planner searches the rest)
        return {"dp": "auto", "tp": "auto", "pp": "auto", **says}
    p = dict(plan) if isinstance(plan, dict) else Plan.from_any(plan)
    get = p.get if isinstance(p, dict) else (lambda k: getattr(p, k))
    put = p.__setitem__ if isinstance(p, dict) else (lambda k, v: setattr(p, k, v))
    if "pp" in says and get("pp") in (None, "auto"):  # (a plan's own pp: as it says)
        put("pp", says["pp"])
    if "dp_shard" in says:
        s = says["dp_shard"]
        if get("dp_shard") is None and get("hpz") is None:
            put("dp_shard", s)
        elif s not in (get("dp_shard"), get("hpz")):
            raise PlanError(
                f"the DeviceMesh passed as devices shards over groups of {s} ranks (its "
                f"'dp_shard' dim) but the plan says dp_shard={get('dp_shard')}, "
                f"hpz={get('hpz')}: leave them unset (the mesh decides) or match it.")
    if says.get("pp_outer"):
        given = get("pp_outer") if isinstance(p, Plan) or "pp_outer" in p else None
        if given is False and isinstance(p, dict):
            raise PlanError(
                f"the DeviceMesh passed as devices puts 'pp' outside its dp dims "
                f"({names}) but the plan says pp_outer=False: leave it unset (the mesh "
                "decides) or pass a mesh with pp inside dp.")
        put("pp_outer", True)
    return p


def mesh_dims(plan) -> list[tuple[str, int]]:
    """The device mesh's (name, degree) dims, outermost first: tp innermost (neighbouring
    ranks), then pp, then dp (Plan.pp_outer: then dp, then pp; core/plan.dp_stride); with
    HSDP (hpZ) dp as (replicas, shard group (secondary partition)), that group the inner
    one (neighbouring ranks: one node when it is the GPUs per node); with ep as (across
    expert groups, expert group), that group the inner one, and with cp likewise (across
    sequence groups, sequence group). HSDP with ep: (replicas,
    the shard group's ranks holding the same experts, expert group), which runtime/dist.setup
    flattens into "dp_shard" (the last two) and "edp" (the first two); with cp likewise
    ("cdp_shard", "cp"; "dp_shard" and "cdp"). ep with cp: (across the larger group, the
    larger group's inner groups, the smaller group), which runtime/dist.setup flattens into
    the larger group (the last two), the dp groups across each ("edp", "cdp") and dp."""
    s = plan.node_group  # (HSDP's shard group, hpZ's secondary partition)
    carved = ("ep", "edp", plan.ep) if plan.ep > 1 else ("cp", "cdp", plan.cp) \
        if plan.cp > 1 else None
    inner, outer = sorted((plan.ep, plan.cp))  # (ep with cp: the smaller group inside)
    dp = [("cdp" if plan.cp > plan.ep else "edp", plan.dp // outer),
          ("cep" if plan.cp > plan.ep else "ecp", outer // inner),
          ("ep" if plan.cp > plan.ep else "cp", inner)] if inner > 1 else \
        [("dp_rep", plan.dp // s), (f"{carved[1]}_shard", s // carved[2]),
         (carved[0], carved[2])] if s and carved else \
        [("dp_rep", plan.dp // s), ("dp_shard", s)] if s else \
        [("edp", plan.dp // plan.ep), ("ep", plan.ep)] if plan.ep > 1 else \
        [("cdp", plan.dp // plan.cp), ("cp", plan.cp)] if plan.cp > 1 else [("dp", plan.dp)]
    pp = [("pp", plan.pp)] if plan.pp > 1 else []
    tp = [("tp", plan.tp)] if plan.tp > 1 else []
    return pp + dp + tp if plan.pp_outer else dp + pp + tp


def _same_arguments_on_every_rank(plan, example_batch, batch: str) -> None:
    """Every rank must pass the same plan and example batch shapes: ranks that plan or
    compile differently issue different collectives and would hang in the first one. One
    small all-gather turns that into a PlanError on every rank naming the difference."""
    shapes = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
              for t in torch.utils._pytree.tree_leaves(example_batch)]
    mine = {"plan": repr(plan), "example_batch": repr(shapes), "batch": batch}
    asked = plan.get("dp_shard") if isinstance(plan, dict) else getattr(plan, "dp_shard", None)
    if asked == "node":  # (resolved from each rank's own node size)
        mine["LOCAL_WORLD_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", "unset")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for r, theirs in enumerate(every):
        diff = [k for k in mine if theirs[k] != every[0][k]]
        if diff:
            k = diff[0]
            raise PlanError(
                f"rank 0 and rank {r} called fxpar.parallelize with different {k}: "
                f"{every[0][k][:200]} vs {theirs[k][:200]}. Every rank must pass the same "
                "arguments (each rank compiles the same program); a per-rank batch goes "
                "through batch='local', with the global example_batch on every rank.")


def _eager_loss(loss_fn: Callable | None) -> Callable:
    """(model, batch) -> the scalar loss as the captured graph computes it (the user's
    loss_fn or the default; a `.loss` attribute taken): Plan.verify's eager reference."""
    fn = loss_fn or capture.default_loss_fn
    return lambda model, batch: capture._as_scalar_loss(fn(model, batch))


def optimizer_state_needs_host(model, optimizer, device) -> bool:
    """One device, plan="auto" (nothing to search, so no planner): the optimizer's state
    goes to host memory (Plan.offload_optimizer) where the parameters, their gradients and
    the state would take over 90% of a GPU's memory and the parameters and gradients alone
    would not - the single-GPU fine-tuning DeepSpeed's ZeRO-Offload is for. Logged.
    Not with an optimizer instance (fxpar cannot build it over host copies)."""
    device = torch.device(device)
    if device.type != "cuda" or isinstance(optimizer, torch.optim.Optimizer):
        return False
    try:
        states = OPTIMIZER_STATES.get(optimizer_kind(optimizer), 2)
    except Exception:  # noqa: BLE001 - a factory that will not take a stand-in: as Adam
        states = 2
    plan = Plan(dp=1, tp=1, pp=1)
    usable = 0.9 * device_memory(device)
    here = model_state_bytes(model, plan, device, states)
    hosted = model_state_bytes(model, dataclasses.replace(plan, offload_optimizer=True),
                               device, states)
    if here <= usable or hosted >= usable:
        return False
    log.info("the optimizer's state (%.1f GiB) does not fit beside the parameters and their "
             "gradients (%.1f GiB) on this device's %.1f GiB: it goes to host memory "
             "(Plan.offload_optimizer; give a plan to choose otherwise)",
             (here - hosted) / 2**30, hosted / 2**30, usable / 2**30)
    return True


def _check_whole_model_fits(model, device) -> None:
    """A model built with real weights is moved whole onto each rank's device before it is
    sharded: say so before an out-of-memory error does (a meta-device model never is)."""
    if device.type != "cuda":  # host memory: the model is there already
        return
    whole = sum(t.numel() * t.element_size() for t in {id(t): t for t in (
        *model.parameters(), *model.buffers())}.values())
    free = device_memory(device)
    if whole > 0.9 * free:
        raise PlanError(
            f"the model's weights take {whole / 2**30:.1f} GiB and this device has "
            f"{free / 2**30:.1f} GiB: a model built with real weights is moved whole onto "
            "every device before sharding. Build it on the meta device (`with "
            "torch.device('meta'): model = ...`) and pass weights=PATH (safetensors / a "
            "save_pretrained directory): each rank then reads only its shards.")


def _refit_planner(pm: ParallelModel, step_s: float) -> None:
    """plan="auto": re-price every plan with the compute speed the first steps measured
    (planner.recalibrate: the start-up calibration times one graph in under a second and
    can be off 2x on a shared machine). pm.plan_report becomes the re-fitted result (its
    .start_up keeps the first); where another plan is now predicted clearly faster, a
    warning names it (the job keeps its plan: changing it needs a new parallelize).
    Nothing without a planner's report (a plan given in full)."""
    if pm.plan_report is None:
        return
    try:
        new = planner.recalibrate(pm.plan_report, pm.plan, step_s,
                                  f"steps 3-{pm.REFIT_AFTER} (median, slowest rank)")
    except PlanError as e:  # e.g. a plan given by hand that the planner cannot price
        log.warning("the planner could not be re-fitted to the measured steps: %s", e)
        return
    pm.plan_report = new
    ran = planner.plan_dict(pm.plan)
    now = next((c for c in new.table if planner.plan_dict(c.plan) == ran), None)
    log.info("planner %s", new.refit)
    if now is not None and new.best.step_s < 0.9 * now.step_s and pm.world.rank == 0:
        warnings.warn(
            f"fxpar: after {pm.step_count} steps the planner, re-fitted to the measured "
            f"step time ({new.refit}), predicts plan {planner.plan_dict(new.best.plan)} "
            f"at {new.best.step_s * 1e3:.2f} ms a step against {now.step_s * 1e3:.2f} ms "
            f"for the running plan: pass it as plan= to fxpar.parallelize to use it.",
            stacklevel=4)

"""plan="auto" for a job: the runtime measures the machine (runtime/machine.py), the planner
prices the plans on the one captured graph (compiler/planner.py), and every rank must
choose the same plan.

The planner's functions take the machine as values and open no process group; what needs
the job's ranks (timing in lock step, sharing the pass probes, agreeing on the choice) is
done here, through the runtime.
"""
from __future__ import annotations

import logging

import torch

from fxpar.compiler import capture as cap
from fxpar.compiler import codegen, planner
from fxpar.compiler.compile import planner_stats
from fxpar.core import ir
from fxpar.core.errors import FxparError, PlanError
from fxpar.core.logs import Clock, announce
from fxpar.runtime import dist as rdist
from fxpar.runtime import machine

log = logging.getLogger("fxpar.compiler.planner")


def _smaller(model, example_batch, loss_fn, parts: int, tokens: tuple[int, int] | None = None):
    """(the model's graph on a smaller input, its real inputs), or None (a model that cannot
    run it): 1 / `parts` of the example batch's rows, or (`tokens` = (t, seq)) each
    sequence's first t tokens (every leaf [batch, seq, ...] cut, as Plan.cp splits them). The
    second timing that tells the graph's time per row or token from its time per call
    (planner.fit_to_timing)."""
    try:
        if tokens is None:
            part = ir.microbatches(example_batch, parts, 1)[0]
        else:
            t, seq = tokens
            part = torch.utils._pytree.tree_map(
                lambda x: x[:, :t].contiguous() if isinstance(x, torch.Tensor) and x.dim() >= 2
                and x.shape[1] == seq else x, example_batch)
        graph = cap.capture(model, part, loss_fn)
    except FxparError:  # (e.g. a shape the model needs whole): timed at one size only
        return None
    return graph[0], calibration_inputs(graph, model, part)[0]


def calibration_inputs(graph, model, example_batch) -> tuple[list, list]:
    """A captured graph's (`(gm, sig)`, e.g. GraphStats.graph) real inputs (the model's
    parameters and buffers, the batch, in the graph's order) and the parameters, for timing
    it (runtime/machine)."""
    gm, sig = graph
    params = dict(model.named_parameters(remove_duplicate=False))
    bufs = dict(model.named_buffers(remove_duplicate=False))
    ps = [params[n] for n in sig.param_names]
    return ps + [bufs[n] for n in sig.buffer_names] + list(
        cap.flatten_batch(example_batch, sig)), ps


def _remembered_probes(jobs, stats, constraints) -> list:
    """The passes' probes (planner.count_pass_extras), shared over the ranks, remembered per
    graph: its code, its inputs' shapes and dtypes, the precision whose figures the tp probe
    compares against (planner.graph_stats), fxpar's code and torch."""
    graph = stats.graph[0]
    key = [graph.code, str(constraints.get("precision") or "fp32"), machine.code_version(),
           torch.__version__, *(f"{tuple(v.shape)}{v.dtype}" for n in graph.graph.nodes
                                if n.op == "placeholder"
                                and isinstance(v := n.meta.get("val"), torch.Tensor))]
    return machine.remembered("probes", key, lambda: machine.shared_over_ranks(jobs))[0]


def _timing_key(graph, args, optimizer, gen: str) -> list[str]:
    """What the model's timing depends on besides the machine: the graph's code, its inputs'
    shapes, strides and dtypes, the optimizer (its class and settings) and the codegen
    (fused optimizer or not)."""
    return [graph.code, *(f"{tuple(a.shape)}{a.stride()}{a.dtype}" if isinstance(
        a, torch.Tensor) else repr(a) for a in args), _optimizer_key(optimizer), gen]


def _optimizer_key(optimizer) -> str:
    """The optimizer's class and the settings that change its step's time (a factory is
    built on one stand-in parameter to look; one that will not take it, by its name)."""
    if optimizer is None:
        return "none"
    opt = optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        try:
            opt = optimizer([torch.nn.Parameter(torch.zeros(1, 1))])
        except Exception:  # noqa: BLE001 - e.g. a factory that filters the parameters
            return getattr(optimizer, "__qualname__", type(optimizer).__name__)
    return type(opt).__name__ + repr({k: opt.defaults.get(k) for k in (
        "foreach", "fused", "momentum", "amsgrad")}) + (" instance" if opt is optimizer else "")


def for_parallelize(model, devices, world: int, plan, example_batch, loss_fn, optimizer):
    """fxpar.parallelize's planning step: every rank plans alike (the machine's figures are
    rank 0's, broadcast; the search is deterministic) and gets the same Plan. Returns
    (Plan, planner.PlanResult, the captured (graph, signature) it priced)."""
    constraints = planner.constraints_of(plan, optimizer)
    clock = Clock(log)
    device = rdist.setup(devices).device  # (parallelize started the default process group)
    with clock("planner: measure machine"):
        hw = machine.measure(device)
    with clock("planner: trace model"):
        stats = planner_stats(model, example_batch, loss_fn, device, constraints)
    if device.type == "cpu":
        with clock("planner: count pass extras"):
            planner.count_pass_extras(stats, share=lambda jobs: _remembered_probes(
                jobs, stats, constraints))
    with clock("planner: calibrate"):
        if cap.meta_tensors(model):  # nothing to time: the re-fit after the first steps
            log.info("planner: the model is on the meta device; plans are priced with "
                     "the measured machine, re-fitted to the first steps' time")
        elif device.type == "cpu":
            gen, _ = codegen.decide(constraints.get("codegen", "auto"), device)
            args, params = calibration_inputs(stats.graph, model, example_batch)
            small_rows = planner.smallest_call_rows(stats, world, constraints)
            small_tokens = None if small_rows else planner.smallest_call_tokens(stats, world)

            def time_it():
                small = _smaller(model, example_batch, loss_fn, stats.rows // small_rows) \
                    if small_rows else _smaller(model, example_batch, loss_fn, 1, (
                        small_tokens, stats.seq)) if small_tokens else None
                with announce(log, "planner: timing the model's graph and optimizer step "
                              "on this machine"):
                    return machine.time_model(stats.graph[0], args, params, optimizer,
                                              fused=gen == "inductor", small=small,
                                              alone=hw.core_share >= 1)
            timing, cached = machine.remembered(
                "model", machine.machine_key() + _timing_key(stats.graph[0], args, optimizer,
                                                             gen) + [
                    f"small {small_rows} rows {small_tokens} tokens"], time_it)
            hw = planner.fit_to_timing(hw, stats, *timing, small_rows=small_rows,
                                       small_tokens=small_tokens)
            if cached:
                hw.calibrated += " (the model's timing remembered)"
    result = planner.auto_plan(stats, optimizer, world, device, constraints=constraints, hw=hw)
    result.times = clock.rows(other=False) + result.times
    every = machine.every_rank(planner.plan_dict(result.best.plan))
    odd = next((r for r, p in enumerate(every) if p != every[0]), None)
    if odd is not None:  # one program for every rank, or the job would hang
        raise PlanError(
            f"the ranks' planners chose different plans (rank 0 {every[0]}, rank {odd} "
            f"{every[odd]}): their inputs differ (the model, example batch or optimizer "
            "each rank passed, or the machines' figures). Pass the same arguments on "
            f"every rank, or fix the plan: plan={every[0]}.")
    captured, stats.graph = stats.graph, None  # (compile.reusable; the report keeps none)
    return result.best.plan, result, captured

"""plan="auto" for a job: the runtime measures the machine (runtime/machine.py), the planner
prices the plans on the one captured graph (compiler/planner.py), and every rank must
choose the same plan.

The planner's functions take the machine as values and open no process group; what needs
the job's ranks (timing in lock step, sharing the pass probes, agreeing on the choice) is
done here, through the runtime.
"""
from __future__ import annotations

import logging

from fxpar.compiler import capture as cap
from fxpar.compiler import codegen, ir, planner
from fxpar.compiler.errors import BatchError, FxparError, PlanError
from fxpar.compiler.logs import Clock, announce
from fxpar.runtime import dist as rdist
from fxpar.runtime import machine

log = logging.getLogger("fxpar.compiler.planner")


def _at_half_rows(model, example_batch, loss_fn):
    """(the model's graph at half the example batch's rows, its real inputs), or None where
    the batch does not halve: the second timing that tells the graph's time per row from its
    time per call (planner.fit_to_timing)."""
    try:
        half = ir.microbatches(example_batch, 2, 1)[0]
    except BatchError:
        return None
    try:
        graph = cap.capture(model, half, loss_fn)
    except FxparError:  # (e.g. a shape the model needs whole): timed at one size only
        return None
    return graph[0], planner.calibration_inputs(graph, model, half)[0]


def for_parallelize(model, devices, world: int, plan, example_batch, loss_fn, optimizer):
    """fxpar.parallelize's planning step: every rank plans alike (the machine's figures are
    rank 0's, broadcast; the search is deterministic) and gets the same Plan. Returns
    (Plan, planner.PlanResult)."""
    constraints = planner.constraints_of(plan)
    clock = Clock(log)
    device = rdist.setup(devices).device  # (parallelize started the default process group)
    with clock("planner: measure machine"):
        hw = machine.measure(device)
    with clock("planner: trace model"):
        stats = planner.graph_stats(model, example_batch, loss_fn,
                                    precision=constraints.get("precision") or "fp32")
    if device.type == "cpu":
        with clock("planner: count pass extras"):
            planner.count_pass_extras(stats, share=machine.shared_over_ranks)
    with clock("planner: calibrate"):
        if cap.meta_tensors(model):  # nothing to time: the re-fit after the first steps
            log.info("planner: the model is on the meta device; plans are priced with "
                     "the measured machine, re-fitted to the first steps' time")
        elif device.type == "cpu":
            gen, _ = codegen.decide(constraints.get("codegen", "auto"), device)
            args, params = planner.calibration_inputs(stats.graph, model, example_batch)
            half = _at_half_rows(model, example_batch, loss_fn)
            with announce(log, "planner: timing the model's graph and optimizer step on "
                          "this machine"):
                timing = machine.time_model(stats.graph[0], args, params, optimizer,
                                            fused=gen == "inductor", half=half)
            hw = planner.fit_to_timing(hw, stats, *timing)
    result = planner.auto_plan(model, example_batch, loss_fn, optimizer, world, device,
                               constraints=constraints, hw=hw, stats=stats)
    result.times = clock.rows(other=False) + result.times
    every = machine.every_rank(planner.plan_dict(result.best.plan))
    odd = next((r for r, p in enumerate(every) if p != every[0]), None)
    if odd is not None:  # one program for every rank, or the job would hang
        raise PlanError(
            f"the ranks' planners chose different plans (rank 0 {every[0]}, rank {odd} "
            f"{every[odd]}): their inputs differ (the model, example batch or optimizer "
            "each rank passed, or the machines' figures). Pass the same arguments on "
            f"every rank, or fix the plan: plan={every[0]}.")
    return result.best.plan, result

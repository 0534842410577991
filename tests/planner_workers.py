"""Rank functions for the planner's multi-process tests (importable by spawned ranks)."""
from __future__ import annotations

import dataclasses

import torch

import fxpar
from fxpar.examples import models as M

MEM_CFG = M.GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
MEM_ROWS = 16


def memory_rank(plans: list[dict]):
    """Per plan: (this rank's measured peak allocated by one step, the estimator's number for
    this rank's stage)."""
    from fxpar.compiler import planner
    from fxpar.core import cost
    from fxpar.compiler.compile import planner_stats
    from fxpar.runtime.memtrack import measure
    batch = M.gpt_batch(MEM_CFG, MEM_ROWS)
    torch.manual_seed(0)
    stats = planner_stats(M.GPT(MEM_CFG), batch)
    planner.count_pass_extras(stats)  # (as plan="auto" does: the dp pass's bucket sizes)
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=64 * 2 ** 30)
    out = []
    for p in plans:
        world = p["dp"] * p["tp"] * p["pp"]
        torch.manual_seed(0)
        pm = fxpar.parallelize(M.GPT(MEM_CFG), world, example_batch=batch, plan=p)
        for _ in range(2):
            pm.step(batch)
        _, peak = measure(lambda: pm.step(batch))
        r = planner.search(stats, world, hw, batch_rows=MEM_ROWS, optimizer="sgd",
                           constraints={**p, "remat": "none"})
        c = r.table[0]
        est = c.memory.per_stage[pm.world.coordinate("pp")]
        out.append((peak, est.step_allocated))
    return out


CHOICE_CFG = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
CHOICE_ROWS = 8


def choice_rank(per_class: int = 2, rounds: int = 16):
    """The planner's choice on this job, and the measured step times of it and of the
    `per_class` best-predicted plans of every dp x tp x pp factorization (every legal degree
    split is represented). All plans are compiled first, then timed in `rounds` interleaved
    rounds of one step each (the first round warms up): each step's time is its slowest
    rank's, and a round runs every plan once, so a load change on the shared host hits every
    plan of the round alike (the test compares plans round by round). Returns (choice row,
    {row: (predicted s, [measured s per round])})."""
    import os
    import time

    import torch.distributed as dist
    from fxpar.compiler import planner
    from fxpar.api import autoplan
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    data = M.gpt_batch(CHOICE_CFG, CHOICE_ROWS)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    _, result, _ = autoplan.for_parallelize(M.GPT(CHOICE_CFG), world, world, "auto", data, None,
                                        opt)
    picked, seen = [result.best], {}
    for c in result.table:
        key = (c.plan.dp, c.plan.tp, c.plan.pp)
        if seen.get(key, 0) < per_class and c is not result.best:
            picked.append(c)
        seen[key] = seen.get(key, 0) + (c is not result.best)
    models = []
    for c in picked:
        torch.manual_seed(0)
        models.append(fxpar.parallelize(M.GPT(CHOICE_CFG), world, example_batch=data,
                                        optimizer=opt, plan=c.plan))
    times = torch.zeros(rounds, len(models), dtype=torch.float64)
    for r in range(rounds):
        for i, pm in enumerate(models):
            dist.barrier()
            t0 = time.perf_counter()
            pm.step(data)
            times[r, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    return picked[0].row(), {c.row(): (c.step_s, times[1:, i].tolist())
                             for i, c in enumerate(picked)}


def collectives_rank():
    """The measured collective table on this rank (needs a process group), and the sizes
    (bytes) each of the runtime's collective calls was timed at."""
    import torch.distributed as dist
    from fxpar.runtime import comm
    dist.init_process_group("gloo")
    timed = {}
    for name in ("start_all_reduce", "start_all_gather", "start_reduce_scatter",
                 "start_all_to_all"):
        def spy(*a, _real=getattr(comm, name), _name=name, **k):
            p = _real(*a, **k)
            timed.setdefault(_name, set()).add(p.nbytes)
            return p
        setattr(comm, name, spy)
    return comm.measure_collectives(reps=3), timed


def refit_rank(steps: int = 8):
    """plan="auto" on this world: train `steps` steps; the planner's state after them."""
    import os
    batch = M.gpt_batch(CHOICE_CFG, 8)
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(CHOICE_CFG), int(os.environ["WORLD_SIZE"]),
                           example_batch=batch,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    losses = [pm.step(batch).item() for _ in range(steps)]
    from fxpar.compiler.planner import plan_dict
    r = pm.plan_report
    running = [c.step_s for c in r.table if plan_dict(c.plan) == plan_dict(pm.plan)]
    return (r.refit, r.start_up is not None, [c.step_s for c in r.table[:5]], running,
            losses[-1] < losses[0])


def limited_rank():
    """plan="auto" under FXPAR_MEMORY_PER_DEVICE: (the chosen plan, this rank's measured
    peak allocated by one step, the estimate of it, the estimated total, the plain-dp line)."""
    from fxpar.compiler import planner
    from fxpar.runtime.memtrack import measure
    batch = M.gpt_batch(MEM_CFG, MEM_ROWS)
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(MEM_CFG), 2, example_batch=batch,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    for _ in range(2):
        pm.step(batch)
    _, peak = measure(lambda: pm.step(batch))
    best = pm.plan_report.best
    est = (best.memory.per_stage[pm.world.coordinate("pp")] if best.memory.per_stage
           else best.memory)
    return (planner.plan_dict(pm.plan), peak, est.step_allocated, est.total,
            pm.plan_report.plain_dp())


def plan_twice(cache_dir: str):
    """plan="auto"'s planning step twice in one job with the planner's disk cache on in
    `cache_dir`: for each, the plan, the prices, the calibration line and the phase times."""
    import os
    from fxpar.compiler import planner
    from fxpar.api import autoplan
    os.environ.update(FXPAR_CACHE_DIR=cache_dir, FXPAR_PLAN_CACHE="1")
    batch = M.gpt_batch(CHOICE_CFG, 8)
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        world = int(os.environ["WORLD_SIZE"])
        _, r, _ = autoplan.for_parallelize(M.GPT(CHOICE_CFG), world, world, "auto", batch, None,
                                        lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        out.append({"plan": planner.plan_dict(r.best.plan),
                    "prices": [round(c.step_s, 9) for c in r.table],
                    "calibrated": r.hardware.calibrated,
                    "times": {name: t for name, t, *_ in r.times}})
    return out

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
    from fxpar.compiler import cost, planner
    from fxpar.runtime.memtrack import measure
    batch = M.gpt_batch(MEM_CFG, MEM_ROWS)
    torch.manual_seed(0)
    stats = planner.graph_stats(M.GPT(MEM_CFG), batch)
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

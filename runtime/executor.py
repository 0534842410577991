"""Runs one rank's Program: slice the global batch to this rank's shard, run the graph.

The graph holds every collective as a node; runtime/comm.lower turns them into calls that
issue the collective on a work handle and block only at the matching wait, so a bucket's
all-reduce runs while later backward nodes compute. A trace.Recorder (always on, cheap)
timestamps compute segments and collectives for `pm.trace` and per-step statistics; the
lowered graph's markers name each compute segment by its nodes' region (forward, backward,
packing), the trainer the optimizer's.

Memory: FX's generated code drops every value right after its last use (`x = None`), so a
forward-only program (`pm.evaluate`) holds only the values still needed: a chain of N blocks
runs in constant activation memory (measured in tests/test_remat.py), and a remat'd joint
graph frees recomputed segments as its backward consumes them. core/cost.simulate_liveness models
exactly this order.
"""
from __future__ import annotations

import contextlib

import torch

from fxpar.core.ir import Program
from fxpar.runtime import comm, faults
from fxpar.runtime.trace import Recorder


def local_batch(leaves: list[torch.Tensor], program: Program, row_rank: int,
                device: torch.device) -> list[torch.Tensor]:
    """This rank's rows of the batch (`row_rank` of program.rows)."""
    out = []
    for leaf, dim in zip(leaves, program.batch_shard_dims):
        if dim is not None:
            leaf = leaf.chunk(program.rows, dim)[row_rank]
        out.append(leaf.to(device, non_blocking=True))
    return out


def run_graph(gm: torch.fx.GraphModule, params, buffers, batch):
    """Run the rank's (comm.lower'ed) graph once; returns its outputs (loss, grads...,
    updated buffers...). Collectives record on the recorder set by `recording`."""
    with torch.no_grad():
        return faults.run(gm, *params, *buffers, *batch)  # FXPAR_DEBUG_NAN: node by node


@contextlib.contextmanager
def recording(recorder: Recorder, first_segment: str = "forward"):
    """Record one step: compute segments (the first named `first_segment`, until the graph's
    first marker) and collectives, then its StepStats."""
    recorder.begin_step(first_segment)
    comm.set_recorder(recorder)
    try:
        yield recorder
    finally:
        comm.set_recorder(None)
        recorder.end_step()

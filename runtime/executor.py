"""Runs one rank's Program: slice the global batch to this rank's shard, run the graph.

The graph holds every collective as a node; functional collectives return at once and
`wait_tensor` blocks, so a bucket's all-reduce runs while later backward nodes compute.

Memory: FX's generated code drops every value right after its last use (`x = None`), so a
forward-only program (`pm.evaluate`) holds only the values still needed: a chain of N blocks
runs in constant activation memory (measured in tests/test_remat.py), and a remat'd joint
graph frees recomputed segments as its backward consumes them. compiler/cost.simulate models
exactly this order.
"""
from __future__ import annotations

import torch

from fxpar.compiler.ir import Program


def local_batch(leaves: list[torch.Tensor], program: Program, dp_rank: int,
                device: torch.device) -> list[torch.Tensor]:
    out = []
    for leaf, dim in zip(leaves, program.batch_shard_dims):
        if dim is not None:
            leaf = leaf.chunk(program.dp, dim)[dp_rank]
        out.append(leaf.to(device, non_blocking=True))
    return out


def run_graph(gm: torch.fx.GraphModule, params, buffers, batch):
    """Run the rank's graph once; returns its outputs (loss, grads..., updated buffers...)."""
    with torch.no_grad():
        return gm(*params, *buffers, *batch)

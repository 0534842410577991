"""Dropout on a split tensor: every rank draws the WHOLE mask and keeps its slice.

Under tensor parallelism all tp ranks share the RNG state. A dropout on a replicated value
then draws the same mask on every rank (as it must: the copies stay equal). On a split value
(attention probabilities with the heads split, a split MLP hidden layer) drawing a mask of the
local shape would give every rank the same pattern for different heads. Megatron switches
to a second, per-rank RNG stream there; we instead draw the mask of the global shape on every
rank (same numbers everywhere, the same RNG consumption as one process) and keep this rank's
slice: each region gets its own part of one global mask, exactly what single-process training
draws, at the cost of tp x the random numbers for those dropouts.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from fxpar.compiler import ir

aten = torch.ops.aten


@torch.library.custom_op("fxpar::dropout_with_mask", mutates_args=())
def dropout_with_mask(x: torch.Tensor, keep: torch.Tensor, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout's (output, mask) given the keep-mask (0./1.) to use; both laid out
    like `x`, as the fake says (compiled code asserts it)."""
    out, mask = torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
    torch.mul(x, keep.to(x.dtype), out=out).mul_(scale)
    return out, mask.copy_(keep)


@dropout_with_mask.register_fake
def _(x, keep, scale):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def rule(sh, node):
    """native_dropout on a split input -> (global mask drawn, this rank's chunk kept); the
    output spec, or None when the rule does not apply."""
    if node.target is not aten.native_dropout.default or len(sh.mesh_sizes) != 1:
        return None
    x, p = node.args[0], node.args[1]
    train = node.args[2] if len(node.args) > 2 else True
    pl = sh.specs[x].placements[0]
    if not isinstance(pl, Shard) or not train or p <= 0:
        return None
    val = x.meta[ir.VAL]  # global shape (meta values stay global while propagating)
    meta = {ir.MODULE: node.meta.get(ir.MODULE, ""), ir.REGION: node.meta.get(ir.REGION)}

    def emit(target, *args, **kwargs):
        with sh.graph.inserting_before(node):
            new = sh.graph.call_function(target, args, kwargs)
        new.meta.update(meta)
        return new

    base = emit(aten.empty.memory_format, list(val.shape), dtype=val.dtype, device=val.device)
    keep = emit(aten.bernoulli.p, base, 1 - p)
    keep = emit(torch.ops.fxpar.local_chunk.default, keep, pl.dim, sh.mesh_sizes[0],
                sh.group_names[0])
    node.target, node.args, node.kwargs = torch.ops.fxpar.dropout_with_mask.default, \
        (x, keep, 1.0 / (1 - p)), {}
    return sh.out_spec((pl,), node.meta.get(ir.VAL))

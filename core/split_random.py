"""Random ops on a split tensor: every rank draws the WHOLE random tensor and keeps its slice.

Under tensor parallelism all tp ranks share the RNG state. A dropout on a replicated value
then draws the same mask on every rank (as it must: the copies stay equal). On a split value
(attention probabilities with the heads split, a split MLP hidden layer) drawing a mask of the
local shape would give every rank the same pattern for different heads. Megatron switches
to a second, per-rank RNG stream there; we instead draw the mask of the global shape on every
rank (same numbers everywhere, the same RNG consumption as one process) and keep this rank's
slice: each region gets its own part of one global mask, exactly what single-process training
draws, at the cost of tp x the random numbers for those dropouts.

The same holds for the random ops whose numbers depend only on their input's shape
(`bernoulli.p`, `rand_like`, `randn_like`: a hand-written dropout's mask), and inside remat's
RNG replay (passes/remat.py wraps a recomputed random op in `run_and_save_rng_state` in the
forward and `run_with_rng_state` in the backward): there only the whole draw is wrapped, so
the recompute replays the whole mask and keeps the same slice.
"""
from __future__ import annotations

import operator

import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.distributed.tensor import Replicate, Shard

from fxpar.core import ir

aten = torch.ops.aten

# random ops whose numbers depend on their input's shape, strides and dtype only
SHAPE_ONLY = {aten.bernoulli.p, aten.rand_like.default, aten.randn_like.default}


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
    """A random op on a split input -> (global tensor drawn, this rank's chunk kept); the
    output spec, or None when the rule does not apply.

    `sh.replay` says whether `node` is the op wrapped by remat's RNG replay: None (a plain
    op), ("save",) (the forward's run_and_save_rng_state, whose target and args are the
    wrapped op's while it is propagated) or ("replay", state) (the backward's
    run_with_rng_state). Either way `node` leaves as a plain op (dropout_with_mask or
    local_chunk) and only the whole draw is wrapped; a saved state's readers read the new
    wrapper's."""
    op = node.target
    if len(sh.mesh_sizes) != 1 or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    x = node.args[0]
    pl = sh.specs[x].placements[0]
    if not isinstance(pl, Shard):
        return None
    if op is aten.native_dropout.default:
        p = node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if not train or p <= 0:
            return None
    elif op not in SHAPE_ONLY:
        return None
    val = x.meta[ir.VAL]  # global shape (meta values stay global while propagating)
    meta = {ir.MODULE: node.meta.get(ir.MODULE, ""), ir.REGION: node.meta.get(ir.REGION)}
    if ir.RECOMPUTE in node.meta:
        meta[ir.RECOMPUTE] = node.meta[ir.RECOMPUTE]
    rep = (Replicate(),)

    def emit(target, args, kwargs=None, placements=rep):
        with sh.graph.inserting_before(node):
            new = sh.graph.call_function(target, tuple(args), kwargs or {})
        new.meta.update(meta)
        spec = sh.out_spec(placements, None)
        sh.specs[new] = (sh.out_spec(rep, None), spec) if target is run_and_save_rng_state \
            else spec
        return new

    def draw(target, args, kwargs=None):
        """target(*args) on every rank, whole, wrapped as `node` was."""
        if sh.replay is None:
            return emit(target, args, kwargs)
        if sh.replay[0] == "replay":
            return emit(run_with_rng_state, (sh.replay[1], target, *args), kwargs)
        saved = emit(run_and_save_rng_state, (target, *args), kwargs)
        state = emit(operator.getitem, (saved, 0))
        for g in [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]:
            g.replace_all_uses_with(state)  # the backward's replay reads the new state
            sh.graph.erase_node(g)
        return emit(operator.getitem, (saved, 1))

    n, group = sh.mesh_sizes[0], sh.group_names[0]
    if op is aten.native_dropout.default:
        # the mask as native_dropout draws it on CPU: bernoulli(1 - p) into a contiguous tensor
        base = emit(aten.empty.memory_format, (list(val.shape),),
                    {"dtype": val.dtype, "device": val.device})
        keep = emit(torch.ops.fxpar.local_chunk.default,
                    (draw(aten.bernoulli.p, (base, 1 - p)), pl.dim, n, group), placements=(pl,))
        scale = 0.0 if p >= 1 else 1.0 / (1 - p)
        node.target, node.args, node.kwargs = torch.ops.fxpar.dropout_with_mask.default, \
            (x, keep, scale), {}
    else:
        base = emit(aten.empty_strided.default, (list(val.shape), list(val.stride())),
                    {"dtype": val.dtype, "device": val.device})
        whole = draw(op, (base, *node.args[1:]), dict(node.kwargs))
        node.target, node.args, node.kwargs = torch.ops.fxpar.local_chunk.default, \
            (whole, pl.dim, n, group), {}
    if sh.replay is not None and sh.replay[0] == "save":
        # node's value was (state, output): its readers of the output now read node itself
        for g in [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]:
            if node.target is torch.ops.fxpar.local_chunk.default:
                g.replace_all_uses_with(node)
            else:
                for u in list(g.users):
                    u.args = (node, *u.args[1:])
            sh.graph.erase_node(g)
    out = node.meta.get(ir.VAL)
    return sh.out_spec((pl,), out)

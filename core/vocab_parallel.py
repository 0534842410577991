"""Vocabulary-parallel embedding and cross-entropy: sharding rules DTensor does not give us.

With the embedding / LM-head weight split over the vocabulary (Shard(0)) on a 1-D mesh, the
logits come out split over the vocabulary. DTensor's own rules would gather them before the
log-softmax (and its embedding rule keeps a mask inside a placement object, which cannot
live in a graph). These rules emit the Megatron computations as explicit ATen ops and
functional collectives instead, so the loss is exact and no rank ever holds all logits:

- embedding(W[V/n], idx): look up the ids in this rank's range (others masked to 0) ->
  Partial(sum); its backward accumulates only this rank's rows -> Shard(0). A padding_idx
  (BERT's and RoBERTa's tables) changes only the backward: the positions holding it add
  nothing, so they are masked with the ids other ranks hold (the global id is compared, no
  rank-dependent argument is needed).
- log_softmax over the split dim: max (all-reduce MAX), exp, sum (all-reduce SUM).
- nll_loss: each rank picks the target logit if it holds it, an all-reduce SUM of [N] gives
  every rank the picked value, and torch's own nll_loss runs on that [N, 1] column (same
  reduction, ignore_index and total_weight); its backward scatters into this rank's columns.
- log_softmax backward: grad - exp(out) * sum(grad) with the sum all-reduced.

`localize` (a custom op: ids - rank * rows per rank) is the one rank-dependent step.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.core import ir

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@torch.library.custom_op("fxpar::localize", mutates_args=())
def localize(ids: torch.Tensor, rows: int, group_name: str, ignore_index: int) -> torch.Tensor:
    """ids relative to this rank's slice of the vocabulary (rank r holds rows r*rows...).

    Checks first that every id (but `ignore_index`, a class target's "no label") is in the
    whole vocabulary, as eager's embedding and nll_loss do: split by vocabulary, an id out of
    range is out of every rank's slice and would be masked to zero on all of them - a loss
    computed silently without it. On CPU an IndexError; on GPUs a device-side assert (what
    eager's kernels raise there, without a host sync)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    group = _resolve_process_group(group_name)
    vocab = rows * group.size()
    bad = ((ids < 0) | (ids >= vocab)) & (ids != ignore_index)
    what = (f"fxpar: an id or class target out of the vocabulary's range [0, {vocab}) under "
            "tensor parallelism (the embedding / LM head split by vocabulary). Check the batch "
            "against the model's vocabulary size (a tokenizer with more tokens than the "
            "model's embedding, a label id past the head's classes)")
    if ids.device.type == "cuda":
        torch._assert_async(~bad.any(), what)
    elif bool(bad.any()):
        raise IndexError(f"{what}; first bad value {int(ids[bad][0])}.")
    return ids - group.rank() * rows


@localize.register_fake
def _(ids, rows, group_name, ignore_index):
    return torch.empty_like(ids)


def rule(sh, node):
    """The vocab-parallel rewrite of `node` if it applies (returns its output spec), else
    None. `sh` is the sharder (core/sharding._Sharder) of a 1-D mesh."""
    if len(sh.mesh_sizes) != 1:
        return None
    op = node.target
    if op is aten.embedding.default and _shard_dim(sh, node.args[0]) == 0:
        return _embedding(sh, node)
    if op is aten.embedding_dense_backward.default and node.meta.get(ir.VOCAB_SHARD):
        return _embedding_backward(sh, node)
    if op is aten._log_softmax.default and _is_split_on(sh, node.args[0], node.args[1]):
        return _log_softmax(sh, node)
    if op is aten.nll_loss_forward.default and _shard_dim(sh, node.args[0]) == 1:
        return _nll_loss(sh, node)
    if op is aten.nll_loss_backward.default and _shard_dim(sh, node.args[1]) == 1:
        return _nll_loss_backward(sh, node)
    if op is aten._log_softmax_backward_data.default and \
            _is_split_on(sh, node.args[1], node.args[2]):
        return _log_softmax_backward(sh, node)
    return None


def _shard_dim(sh, x):
    pl = sh.specs[x].placements[0] if isinstance(x, torch.fx.Node) and x in sh.specs else None
    return pl.dim if isinstance(pl, Shard) else None


def _is_split_on(sh, x, dim) -> bool:
    d = _shard_dim(sh, x)
    return d is not None and d == dim % x.meta[ir.VAL].dim()


class _Emitter:
    def __init__(self, sh, node):
        self.sh, self.node, self.graph = sh, node, sh.graph
        self.meta = {ir.MODULE: node.meta.get(ir.MODULE, ""), ir.REGION: node.meta.get(ir.REGION)}
        self.group, self.n = sh.group_names[0], sh.mesh_sizes[0]

    def __call__(self, target, *args, comm=False):
        with self.graph.inserting_before(self.node):
            new = self.graph.call_function(target, args)
        new.meta.update(self.meta)
        if comm:
            new.meta[ir.REGION] = ir.COMM
        return new

    def all_reduce(self, x, op):
        return self(c10d.wait_tensor.default, self(c10d.all_reduce.default, x, op, self.group,
                                                   comm=True), comm=True)

    def local_ids(self, ids, rows, ignore_index=None):
        """(ids in this rank's rows, masked to 0; mask of ids it does not hold). Every id but
        ignore_index must be in the whole vocabulary (`localize` checks)."""
        # (no ignore_index: one no id can hold - the whole range is checked)
        ignore = -2 ** 62 if ignore_index is None else int(ignore_index)
        local = self(torch.ops.fxpar.localize.default, ids, rows, self.group, ignore)
        mask = self(aten.logical_or.default, self(aten.lt.Scalar, local, 0),
                    self(aten.ge.Scalar, local, rows))
        return self(aten.masked_fill.Scalar, local, mask, 0), mask


def _set(sh, node, target, args, placements):
    node.target, node.args, node.kwargs = target, tuple(args), {}
    return _spec(sh, placements, node)


def _spec(sh, placements, node):
    return sh.out_spec((placements,), node.meta.get(ir.VAL))


def _embedding(sh, node):
    w, ids = node.args[0], node.args[1]
    # (padding_idx, scale_grad_by_freq and sparse change only the backward: the lookup is
    # the same with or without them)
    ids = sh.to(node, ids, (Replicate(),))
    e = _Emitter(sh, node)
    rows = w.meta[ir.VAL].shape[0] // e.n
    safe, mask = e.local_ids(ids, rows)
    looked = e(aten.embedding.default, w, safe)
    return _set(sh, node, aten.masked_fill.Scalar,
                (looked, e(aten.unsqueeze.default, mask, -1), 0.0), Partial("sum"))


def _embedding_backward(sh, node):
    grad, ids, num_weights, padding_idx, scale = node.args
    if scale:
        return None
    grad = sh.to(node, grad, (Replicate(),))
    ids = sh.to(node, ids, (Replicate(),))
    e = _Emitter(sh, node)
    rows = num_weights // e.n
    safe, mask = e.local_ids(ids, rows)
    if padding_idx >= 0:  # the padding row gets no gradient: its positions add nothing
        mask = e(aten.logical_or.default, mask, e(aten.eq.Scalar, ids, padding_idx))
    g = e(aten.masked_fill.Scalar, grad, e(aten.unsqueeze.default, mask, -1), 0.0)
    # done: a later mesh (data parallelism) must see a plain lookup backward here (batch-split
    # gradient -> Partial(sum) table gradient), not split the table again over its own ranks
    # (which gathered the batch to every rank: 3 all-gathers + 1 reduce-scatter per step)
    node.meta.pop(ir.VOCAB_SHARD, None)
    return _set(sh, node, aten.embedding_dense_backward.default,
                (g, safe, rows, -1, scale), Shard(0))


def _log_softmax(sh, node):
    x, dim = node.args[0], node.args[1]
    e = _Emitter(sh, node)
    m = e.all_reduce(e(aten.amax.default, x, [dim], True), "max")
    shifted = e(aten.sub.Tensor, x, m)
    s = e.all_reduce(e(aten.sum.dim_IntList, e(aten.exp.default, shifted), [dim], True), "sum")
    return _set(sh, node, aten.sub.Tensor, (shifted, e(aten.log.default, s)),
                Shard(dim % x.meta[ir.VAL].dim()))


def _picked_column(e, logp, target, ignore_index):
    """[N, 1] log-prob of each row's target (summed over ranks: only its holder picks it)."""
    rows = logp.meta[ir.VAL].shape[1] // e.n
    safe, mask = e.local_ids(target, rows, ignore_index)
    picked = e(aten.masked_fill.Scalar, e(aten.gather.default, logp, 1,
                                          e(aten.unsqueeze.default, safe, 1)),
               e(aten.unsqueeze.default, mask, 1), 0.0)
    return e.all_reduce(picked, "sum")


def _column_target(e, target, ignore_index):
    """The target for the [N, 1] column: 0, or ignore_index where the row is ignored."""
    ignored = e(aten.eq.Scalar, target, ignore_index)
    return e(aten.masked_fill.Scalar, e(aten.mul.Scalar, target, 0), ignored, ignore_index)


def _nll_loss(sh, node):
    logp, target, weight, reduction, ignore_index = node.args
    if weight is not None or logp.meta[ir.VAL].dim() != 2:
        return None
    target = sh.to(node, target, (Replicate(),))
    e = _Emitter(sh, node)
    node.args = (_picked_column(e, logp, target, ignore_index),
                 _column_target(e, target, ignore_index), None, reduction, ignore_index)
    return _spec(sh, Replicate(), node)


def _nll_loss_backward(sh, node):
    grad, logp, target, weight, reduction, ignore_index, total = node.args
    if weight is not None or logp.meta[ir.VAL].dim() != 2:
        return None
    target = sh.to(node, target, (Replicate(),))
    grad = sh.to(node, grad, (Replicate(),))
    total = sh.to(node, total, (Replicate(),))
    e = _Emitter(sh, node)
    rows = logp.meta[ir.VAL].shape[1] // e.n
    safe, mask = e.local_ids(target, rows, ignore_index)
    column = e(aten.slice.Tensor, logp, 1, 0, 1)
    g1 = e(aten.nll_loss_backward.default, grad, column, _column_target(e, target, ignore_index),
           None, reduction, ignore_index, total)
    g1 = e(aten.masked_fill.Scalar, g1, e(aten.unsqueeze.default, mask, 1), 0.0)
    return _set(sh, node, aten.scatter.src,
                (e(aten.zeros_like.default, logp), 1, e(aten.unsqueeze.default, safe, 1), g1),
                Shard(1))


def _log_softmax_backward(sh, node):
    grad, out, dim, _dtype = node.args
    d = dim % out.meta[ir.VAL].dim()
    grad = sh.to(node, grad, (Shard(d),))
    e = _Emitter(sh, node)
    s = e.all_reduce(e(aten.sum.dim_IntList, grad, [dim], True), "sum")
    return _set(sh, node, aten.sub.Tensor,
                (grad, e(aten.mul.Tensor, e(aten.exp.default, out), s)), Shard(d))

"""Sharding propagation: placements per value, op by op, with explicit collectives.

The graph is written in *global* semantics (traced on the global batch). Given placements
for the placeholders (Replicate / Shard(d) / Partial, one per mesh dim), we walk the graph
in order and ask DTensor's own per-op sharding rules (`ShardingPropagator`) what each op
produces and what it needs of its inputs. Where an input's placement differs from what the
op needs, we insert the redistribution as explicit graph nodes (functional collectives, or
a local slice), and rewrite shape arguments (view/expand/...) to local sizes. The result is
an SPMD graph in local semantics: the same graph runs on every rank of the mesh.

DTensor's rules are reused rather than re-written: they cover ~all ATen ops and are what
PyTorch's own tensor parallelism uses. We only need a mesh object for them, which we build
without a process group (`_init_backend=False`): placement decisions need no communication.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops import _pointwise_ops
from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo
from torch.distributed.tensor.placement_types import Placement, _MaskPartial, _StridedShard

from fxpar.core import experts as _experts  # noqa: F401  (fxpar::check_unrouted)
from fxpar.core import ir
from fxpar.core.ir import ancestors
from fxpar.core import local_dispatch as _local_dispatch
from fxpar.core.errors import ShardingError

__all__ = ["Replicate", "Shard", "Partial", "make_mesh", "shard_graph", "redistribute",
           "local_shape", "is_split"]

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
log = logging.getLogger(__name__)


# --- custom ops for the rank-dependent pieces, so one graph serves every rank -------------

def _group_rank_size(group_name: str) -> tuple[int, int]:
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name)
    return pg.rank(), pg.size()


@torch.library.custom_op("fxpar::local_chunk", mutates_args=())
def local_chunk(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """This rank's chunk of a replicated tensor (Replicate -> Shard(dim)); no communication."""
    rank, _ = _group_rank_size(group_name)
    # contiguous, as the fake says: Inductor's code asserts a fallback's output strides (a
    # chunk of a transposed tensor cloned as it lies crashed T5's tp=2 step when compiled)
    return x.chunk(group_size, dim)[rank].clone(memory_format=torch.contiguous_format)


@local_chunk.register_fake
def _(x, dim, group_size, group_name):
    shape = list(x.shape)
    shape[dim] = -(-shape[dim] // group_size)
    return x.new_empty(shape)


@torch.library.custom_op("fxpar::partial_from_replicate", mutates_args=())
def partial_from_replicate(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Replicate -> Partial(sum): rank 0 keeps the value, the others contribute zeros."""
    rank, _ = _group_rank_size(group_name)
    return x.clone() if rank == 0 else torch.zeros_like(x)


@partial_from_replicate.register_fake
def _(x, group_name):
    return torch.empty_like(x)


# --- mesh and specs -----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_mesh(size: int, device_type: str = "cpu"):
    """A DeviceMesh used only to ask DTensor's rules; it owns no process group. One per
    (size, device type) in a process, so DTensor's answers can be kept across passes."""
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh(device_type, torch.arange(size), _init_backend=False, _rank=0)


def _spec(mesh, placements, val) -> DTensorSpec:
    meta = TensorMeta(val.shape, val.stride(), val.dtype) if isinstance(val, torch.Tensor) else None
    return DTensorSpec(mesh, tuple(placements), meta)


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_sizes: Sequence[int]):
    shape = list(shape)
    for p, n in zip(placements, mesh_sizes):
        if isinstance(p, Shard):
            if shape[p.dim] % n:
                raise ShardingError(f"dimension {p.dim} of size {shape[p.dim]} cannot be split "
                                    f"evenly over {n} ranks")
            shape[p.dim] //= n
    return shape


# --- redistribution as graph nodes --------------------------------------------------------

def redistribute(graph: torch.fx.Graph, x: torch.fx.Node, src: Sequence[Placement],
                 dst: Sequence[Placement], group_names: Sequence[str],
                 mesh_sizes: Sequence[int], meta: dict) -> torch.fx.Node:
    """Insert nodes turning `x` (placed `src`) into `dst`; returns the new value.

    One mesh dim at a time. gloo has no AVG reduction, so avg = sum then divide.
    """
    cur = x
    placements = list(src)
    for d, (s, t) in enumerate(zip(src, dst)):
        if s == t:
            continue
        group, n = group_names[d], mesh_sizes[d]

        def emit(target, args, region=ir.COMM):
            node = graph.call_function(target, args)
            node.meta.update(meta)
            node.meta[ir.REGION] = region
            return node

        if _strided(s) or _strided(t):  # heads split inside a batch*heads dim: see _strided
            if _strided(s):
                cur = _strided_gather(emit, cur, x.meta[ir.VAL], s, d, placements, mesh_sizes,
                                      group, meta)
                s = placements[d] = Replicate()
            if _strided(t):
                if isinstance(s, Partial):
                    cur = redistribute(graph, cur, (s,), (Replicate(),), [group], [n], meta)
                elif isinstance(s, Shard):
                    cur = _all_gather(emit, cur, s.dim, n, group, meta)
                placements[d] = Replicate()
                cur = _strided_chunk(emit, cur, x.meta[ir.VAL], t, d, placements, mesh_sizes,
                                     group, meta)
                placements[d] = t
                continue
            if s == t:
                continue
        if isinstance(s, Partial) and isinstance(t, Shard) and s.reduce_op == "sum":
            # reduce-scatter: each rank receives only its summed slice (half an all-reduce)
            cur = _reduce_scatter(emit, cur, t.dim, n, group, meta)
            placements[d] = t
            continue
        if isinstance(s, Partial):
            op = "sum" if s.reduce_op in ("sum", "avg") else s.reduce_op
            cur = emit(c10d.wait_tensor.default, (emit(c10d.all_reduce.default, (cur, op, group)),))
            if s.reduce_op == "avg":
                cur = emit(aten.div.Scalar, (cur, n), meta.get(ir.REGION, ir.FORWARD))
            s = Replicate()
        if isinstance(s, Shard) and not isinstance(t, Shard) or (
                isinstance(s, Shard) and isinstance(t, Shard) and s.dim != t.dim):
            cur, s = _all_gather(emit, cur, s.dim, n, group, meta), Replicate()
        if isinstance(s, Replicate) and isinstance(t, Shard):
            cur = emit(_chunk_op(group, x.meta.get(ir.VAL), t.dim, n), (cur, t.dim, n, group),
                       meta.get(ir.REGION))
        elif isinstance(s, Replicate) and isinstance(t, Partial):
            if t.reduce_op not in ("sum", "avg"):
                raise ShardingError(f"cannot create Partial({t.reduce_op}) from a replicated value")
            cur = emit(torch.ops.fxpar.partial_from_replicate.default, (cur, group),
                       meta.get(ir.REGION))
            if t.reduce_op == "avg":  # avg over n of (x, 0, ..., 0) must equal x
                cur = emit(aten.mul.Scalar, (cur, n), meta.get(ir.REGION))
        placements[d] = t
    if cur is not x:  # meta["val"] holds global shapes until the caller re-propagates
        cur.meta.setdefault(ir.VAL, x.meta.get(ir.VAL))
    return cur


def is_split(p) -> bool:
    """Whether placement `p` splits a dim over its mesh dim (a shard, strided or not)."""
    return isinstance(p, (Shard, _StridedShard))


def _strided(p) -> bool:
    """A strided shard: DTensor's placement of a dim merged from [k, m] with the m part split
    (`_StridedShard(dim, split_factor=k)`): each rank holds its 1/n of every one of the k
    blocks. Attention's batched matmuls flatten [batch, heads] into one dim, heads split."""
    return isinstance(p, _StridedShard)


def _local_sizes(shape, placements, mesh_sizes) -> list[int]:
    shape = list(shape)
    for p, n in zip(placements, mesh_sizes):
        if isinstance(p, Shard) or _strided(p):
            shape[p.dim] //= n
    return shape


def _blocked(emit, x, gval, p, placements, mesh_sizes, region):
    """x (local) with its strided dim viewed as [split_factor, rest]: the split part becomes
    dim p.dim + 1, a plain dim that the ordinary gathers and chunks handle."""
    local = _local_sizes(gval.shape, placements, mesh_sizes)
    k = p.split_factor
    blocked = emit(aten.view.default,
                   (x, local[:p.dim] + [k, local[p.dim] // k] + local[p.dim + 1:]), region)
    whole = list(gval.shape)
    blocked.meta[ir.VAL] = gval.new_empty(whole[:p.dim] + [k, whole[p.dim] // k]
                                          + whole[p.dim + 1:])
    return blocked


def _strided_gather(emit, x, gval, p, d, placements, mesh_sizes, group, meta):
    """Strided shard -> Replicate: gather the split part of each block, then merge back."""
    region = meta.get(ir.REGION, ir.FORWARD)
    blocked = _blocked(emit, x, gval, p, placements, mesh_sizes, region)
    out = _all_gather(emit, blocked, p.dim + 1, mesh_sizes[d], group, meta)
    after = list(placements)
    after[d] = Replicate()
    return emit(aten.view.default, (out, _local_sizes(gval.shape, after, mesh_sizes)), region)


def _strided_chunk(emit, x, gval, p, d, placements, mesh_sizes, group, meta):
    """Replicate -> strided shard: this rank's chunk of each block (no communication)."""
    region = meta.get(ir.REGION, ir.FORWARD)
    blocked = _blocked(emit, x, gval, p, placements, mesh_sizes, region)
    mine = emit(_chunk_op(group, blocked.meta.get(ir.VAL), p.dim + 1, mesh_sizes[d]),
                (blocked, p.dim + 1, mesh_sizes[d], group), region)
    after = list(placements)
    after[d] = p
    return emit(aten.view.default, (mine, _local_sizes(gval.shape, after, mesh_sizes)), region)


def _moved_to_front(emit, x, dim, region):
    """(x with `dim` moved to the front, made contiguous; the permutation back)."""
    ndim = x.meta[ir.VAL].dim()
    perm = [dim] + [i for i in range(ndim) if i != dim]
    y = _contiguous(emit, emit(aten.permute.default, (x, perm), region), region)
    return y, [perm.index(i) for i in range(ndim)]


def _chunk_op(group: str, val, dim: int, n: int):
    """The op cutting a whole value into this rank's piece along `dim`: its contiguous 1/n,
    or over the cp group context parallelism's load-balanced pair of chunks."""
    if group != ir.GROUPS["cp"]:
        return torch.ops.fxpar.local_chunk.default
    if isinstance(val, torch.Tensor) and val.shape[dim] % (2 * n):
        raise ShardingError(
            f"context parallelism splits dim {dim} of a {tuple(val.shape)} value into 2 x "
            f"cp={n} chunks (each rank a front and a back one), which its size does not "
            f"divide. Use a sequence length that is a multiple of {2 * n}.")
    return torch.ops.fxpar.zigzag_chunk.default


def _zigzag(emit, x, n, group, region, to_ranks):
    """Over the cp group: dim 0 of `x` reordered between the natural and the ranks' order
    (core/context_attention.py); unchanged over any other group."""
    if group != ir.GROUPS["cp"]:
        return x
    return emit(torch.ops.fxpar.zigzag_order.default, (x, 0, n, group, to_ranks), region)


def _all_gather(emit, x, dim, n, group, meta):
    """Shard(dim) -> Replicate. all_gather_into_tensor concatenates along dim 0, so another
    dim is moved there and back: the gathered dim is never dim 0 unless it is the split one
    (a batch dim split by another mesh dimension stays out of the way)."""
    region = meta.get(ir.REGION, ir.FORWARD)
    dim %= x.meta[ir.VAL].dim()
    if dim == 0:
        return _zigzag(emit, emit(c10d.wait_tensor.default,
                                  (emit(c10d.all_gather_into_tensor.default, (x, n, group)),)),
                       n, group, region, to_ranks=False)
    y, inv = _moved_to_front(emit, x, dim, region)
    out = _zigzag(emit, emit(c10d.wait_tensor.default,
                             (emit(c10d.all_gather_into_tensor.default, (y, n, group)),)),
                  n, group, region, to_ranks=False)
    return _contiguous(emit, emit(aten.permute.default, (out, inv), region), region)


def _contiguous(emit, x, region):
    """A dense copy: later views in the graph expect the layout the value was traced with."""
    y = emit(aten.clone.default, (x,), region)
    y.kwargs = {"memory_format": torch.contiguous_format}
    return y


def _reduce_scatter(emit, x, dim, n, group, meta):
    """Partial(sum) -> Shard(dim): reduce_scatter_tensor splits dim 0, so move `dim` there
    and back (a copy only when dim != 0)."""
    region = meta.get(ir.REGION, ir.FORWARD)
    dim %= x.meta[ir.VAL].dim()
    if dim != 0:
        x, inv = _moved_to_front(emit, x, dim, region)
        x = _zigzag(emit, x, n, group, region, to_ranks=True)
        out = emit(c10d.wait_tensor.default,
                   (emit(c10d.reduce_scatter_tensor.default, (x, "sum", n, group)),))
        return _contiguous(emit, emit(aten.permute.default, (out, inv), region), region)
    x = _zigzag(emit, x, n, group, region, to_ranks=True)
    return emit(c10d.wait_tensor.default,
                (emit(c10d.reduce_scatter_tensor.default, (x, "sum", n, group)),))


# --- propagation --------------------------------------------------------------------------

from fxpar.core import split_random  # noqa: E402  (registers fxpar::dropout_with_mask)
from fxpar.core import vocab_parallel  # noqa: E402  (registers fxpar::localize)
from fxpar.core import experts  # noqa: E402,F401  (registers fxpar::expert_window)
from fxpar.core import context_attention  # noqa: E402  (fxpar::causal_chunk_attention)

_POINTWISE_BINARY = {aten.add.Tensor, aten.sub.Tensor}

# ops that act over a process group: the position of the group-name argument, and where the
# dim they gather/scatter/chunk along is (0 = always dim 0; an int > 0 = that argument)
_GROUP_ARG = {
    torch.ops.fxpar.localize.default: 2,
    torch.ops.fxpar.expert_window.default: 2,
    torch.ops.fxpar.expert_pick.default: 1,
    c10d.all_reduce.default: 2,
    c10d.all_gather_into_tensor.default: 2,
    c10d.reduce_scatter_tensor.default: 3,
    torch.ops.fxpar.local_chunk.default: 3,
    torch.ops.fxpar.partial_from_replicate.default: 1,
    torch.ops.fxpar.causal_chunk_attention.default: 5,
    torch.ops.fxpar.causal_chunk_attention_backward.default: 8,
    torch.ops.fxpar.ring_attention.default: 6,
    torch.ops.fxpar.ring_attention_backward.default: 9,
    torch.ops.fxpar.zigzag_chunk.default: 3,
    torch.ops.fxpar.zigzag_order.default: 3,
}
# those of them a sum over this mesh's ranks commutes with (a partial sum stays one;
# _Sharder._sum_commutes)
_SUM_COMMUTES = {c10d.all_reduce.default, c10d.all_gather_into_tensor.default,
                 c10d.reduce_scatter_tensor.default, torch.ops.fxpar.local_chunk.default,
                 torch.ops.fxpar.partial_from_replicate.default,
                 torch.ops.fxpar.zigzag_chunk.default, torch.ops.fxpar.zigzag_order.default}
_AXIS_DIM = {
    c10d.all_gather_into_tensor.default: 0,
    c10d.reduce_scatter_tensor.default: 0,
    torch.ops.fxpar.local_chunk.default: 1,
    torch.ops.fxpar.zigzag_chunk.default: 1,
    torch.ops.fxpar.zigzag_order.default: 1,
}

# --- rules DTensor lacks --------------------------------------------------------------------
# Attention kernels whose tensors are all (batch, heads, ...): any placement that splits the
# batch or the heads of q/k/v splits every other operand and result the same way.
_ATTENTION_BACKWARD = {aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                       torch.ops.fxpar.flash_attention_backward.default}
# Ops through which a strided shard is carried: how a batched matmul over [batch, heads] is
# written in ATen (torch.matmul's and SDPA's math path: flatten batch*heads, bmm, unflatten;
# its backward the same with transposes; ALiBi's baddbmm), heads split by tensor
# parallelism. Views follow _view_placement (DTensor's view rule mislabels some strided
# results: [4*4] split as _S(0, 4) viewed as [2, 8] came back _S(1, 4), which is _S(1, 2));
# DTensor's rules answer the others (a batch dim moved or matched, elementwise ops). Any
# other op reading a strided shard gets it whole.
_VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_STRIDED_DTENSOR = {aten.transpose.int, aten.permute.default, aten.bmm.default,
                    aten.baddbmm.default,
                    # elementwise (a scale, a mask): every element by itself
                    aten.mul.Scalar, aten.div.Scalar, aten.mul.Tensor, aten.div.Tensor,
                    aten.add.Tensor, aten.sub.Tensor, aten.neg.default}
_STRIDED_OPS = {*_VIEW_OPS, *_STRIDED_DTENSOR, aten.clone.default}
# A sequence split (Plan.cp) flattened behind the batch ([B, S/cp, H] -> [B*S/cp, H]) is a
# strided shard on the rows of every linear, its gradient and the loss; DTensor's rules for
# these keep a strided row split right (rows in, rows out; both operands' rows contracted:
# a partial sum), so a sequence split carries it through them as well (not views other
# than _VIEW_OPS: DTensor's view rules mislabel some strided results)
_SEQUENCE_STRIDED = {aten.mm.default, aten.addmm.default, aten.t.default,
                     aten.sum.dim_IntList, aten.mean.dim, aten._to_copy.default,
                     aten._log_softmax.default, aten._log_softmax_backward_data.default,
                     aten.nll_loss_forward.default, aten.nll_loss_backward.default,
                     aten.where.ScalarSelf, aten.where.ScalarOther, aten.zeros_like.default,
                     aten.unsqueeze.default, aten.select.int, aten.unbind.int,
                     aten.gather.default, aten.scatter.value,
                     # an MoE router's, token by token over the experts
                     aten._softmax.default, aten._softmax_backward_data.default,
                     # a norm on flattened tokens (OPT's decoder layer), token by token: its
                     # weights' gradients partial sums over the rows
                     aten.native_layer_norm.default, aten.native_layer_norm_backward.default}


def _sequence_carried(op) -> bool:
    """Whether a sequence split flattened behind the batch (a strided row shard) passes
    through `op` as DTensor's rule places it: the ops above, any elementwise op (ATen's
    pointwise tag, DTensor's own list: each element by itself, broadcast operands placed to
    match) that neither mutates nor draws random numbers (split_random places those under
    tp), and dropout, whose mask each rank draws for its own tokens from its own random
    state, as on a sequence split not flattened and as dp's ranks do for their rows (ranks
    seeded alike draw the same pattern)."""
    return op in _SEQUENCE_STRIDED or op is aten.native_dropout.default or isinstance(
        op, torch._ops.OpOverload) and (
        torch.Tag.pointwise in op.tags and torch.Tag.nondeterministic_seeded not in op.tags
        and not op._schema.is_mutable)


# ops along one dim (argument index, default), row by row over the others, whose DTensor
# rules list plain shards only (a strided one would be gathered): _strided_rows carries it
# (an MoE router's top-k, and its backward's scatter into zeros, under cp)
_ALONG_ONE_DIM = {aten.topk.default: (2, -1), aten.sort.default: (1, -1),
                  aten.scatter.src: (1, None), aten.scatter.value: (1, None),
                  aten.gather.default: (1, None), aten.expand.default: (None, None)}
# factories reading their input's dtype and device only
_NEW_FACTORIES = {aten.new_zeros.default, aten.new_empty.default, aten.new_full.default,
                  aten.new_ones.default}

_BATCH_HEAD_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default,
                   torch.ops.fxpar.flash_attention.default, *_ATTENTION_BACKWARD}


def _batch_head_rule(node, specs, replicate):
    """-> (wanted placements per tensor arg, output placements: one per output).

    Split heads: q's heads split contiguously; k/v with as many heads, or fewer heads that
    divide over the ranks (grouped-query attention: each rank keeps the kv heads of its q
    heads), are split alike. k/v with ONE head (multi-query attention) stay whole on every
    rank, as Megatron does with fewer kv heads than ranks; their gradients are then partial
    sums (each rank's q heads contribute theirs). Any other kv head count cannot be split
    consistently: everything is made whole."""
    tensors = [a for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
               if isinstance(a, torch.fx.Node)]
    first = specs[tensors[0]]
    lead = first.placements[0] if len(first.placements) == 1 else None
    want_p = lead if isinstance(lead, Shard) and lead.dim in (0, 1) else Replicate()
    ref_shape = max((a.meta[ir.VAL].shape for a in tensors if a.meta[ir.VAL].dim() == 4),
                    key=lambda s: s[1], default=tensors[0].meta[ir.VAL].shape)  # q's heads
    n = _mesh_size(specs[tensors[0]])
    wanted = {}
    for a in tensors:
        shape = a.meta[ir.VAL].shape
        if not isinstance(want_p, Shard) or len(shape) <= want_p.dim:
            wanted[a] = replicate
        elif shape[want_p.dim] == ref_shape[want_p.dim] or (
                want_p.dim == 1 and shape[1] % n == 0 and ref_shape[1] % shape[1] == 0):
            wanted[a] = (want_p,)  # logsumexp (batch, heads, L) lines up with q too
        elif want_p.dim == 1 and shape[1] == 1 and len(shape) == 4:
            wanted[a] = replicate  # the one kv head of multi-query attention
        elif want_p.dim == 1 and len(shape) == 4 and ref_shape[1] % shape[1] == 0:
            want_p = Replicate()  # see the docstring
            return {a: replicate for a in tensors}, [want_p] * _n_outputs(node)
        else:
            wanted[a] = replicate  # e.g. a mask broadcast over the batch
    if node.target in _ATTENTION_BACKWARD:  # (grad_q, grad_k, grad_v) for args 1, 2, 3
        outs = []
        for a in node.args[1:4]:
            outs.append(want_p if wanted[a] == (want_p,) else
                        Partial() if isinstance(want_p, Shard) and want_p.dim == 1 else
                        Replicate())
        return wanted, outs
    return wanted, [want_p] * _n_outputs(node)


def _sequence_rule(sh, node):
    """Attention with q split along its sequence dim (Plan.cp): -> its output specs, or None
    where q is not so split. k/v (and a mask's key dim) are made whole, a mask keeps the
    rows of its queries; out and logsumexp are split like q; in the backward grad_q is too,
    grad_k/grad_v are partial sums (every chunk of queries reads every key), reduce-scattered
    right away. A causal one becomes fxpar::causal_chunk_attention(_backward): SDPA's
    is_causal would mask as if the chunk started the sequence."""
    bwd = node.target in _ATTENTION_BACKWARD
    a = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                           normalize_to_only_use_kwargs=True).kwargs
    q = a["query"]
    if sh.specs[q].placements != (Shard(2),):
        return None
    split, whole = (Shard(2),), sh.replicate
    if sh.ring is not None and sh.ring(node, a, all(sh.specs[a[x]].placements == split
                                                    for x in ("key", "value"))):
        return _ring_rule(sh, node, a, bwd)
    want = {q: split, a["key"]: whole, a["value"]: whole}
    mask = a.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        m = mask.meta[ir.VAL]
        want[mask] = split if m.dim() == 4 and m.shape[2] == q.meta[ir.VAL].shape[2] > 1 \
            else whole
    if bwd:
        want.update({a[k]: split for k in ("grad_out", "out", "logsumexp")})
        if sh.regather:  # gathered again here: the forward's whole copy is not held
            for k in (a["key"], a["value"]):
                sh.made.pop((k, whole), None)
    sh.place(node, want)
    causal, group = a.get("is_causal", False), sh.group_names[0]
    if causal:
        if isinstance(mask, torch.fx.Node):
            raise ShardingError(f"attention {node.name} has both a mask and is_causal; "
                                "context parallelism takes one or the other.")
        args = [*node.args[:6], a.get("dropout_p", 0.0)] if bwd else [*node.args[:3],
                                                                       a.get("dropout_p", 0.0)]
        node.target = (torch.ops.fxpar.causal_chunk_attention_backward.default if bwd else
                       torch.ops.fxpar.causal_chunk_attention.default)
        node.args, node.kwargs = (*args, a.get("scale"), group), {}
    vals = node.meta[ir.VAL]
    if bwd:
        for u in node.users:  # grad_k, grad_v: summed over the chunks into k/v's split
            if u.target is operator.getitem and u.args[1] in (1, 2):
                sh.prefer[u] = split
        pl = [split, (Partial(),), (Partial(),)]
    else:
        pl = [split] * len(vals)
    return tuple(_spec(sh.mesh, p, v) if isinstance(v, torch.Tensor) else None
                 for p, v in zip(pl, vals))


def _strided_dim_moved(sh, node):
    """unsqueeze, or select / unbind along another dim, of a strided shard (a cp rank's
    tokens flattened behind the batch): the same split on the dim it moves to (DTensor's
    rules would gather it); a select or unbind along the split dim gets it whole."""
    x = node.args[0]
    d = node.args[1] if len(node.args) > 1 else 0  # (unbind's default dim)
    pl = _placements(sh.specs.get(x)) or ()
    if len(pl) != 1 or not _strided(pl[0]):
        return None
    grows = node.target is aten.unsqueeze.default
    nd = x.meta[ir.VAL].dim() + grows
    d = d + nd if d < 0 else d
    if not grows and d == pl[0].dim:
        sh.place(node, {x: sh.replicate})
        return None
    dim = pl[0].dim + (d <= pl[0].dim if grows else -(d < pl[0].dim))
    moved = (_StridedShard(dim, split_factor=pl[0].split_factor),)
    val = node.meta.get(ir.VAL)
    if node.target is aten.unbind.int:
        return tuple(_out_spec(sh.mesh, moved, v) for v in val)
    return _out_spec(sh.mesh, moved, val)


def _strided_rows(sh, node):
    """An op along one dim (a sort, top-k, scatter or gather; an expand of other dims) of
    values whose rows another dim holds as a strided shard (cp: an MoE router's scores, the
    sequence split flattened behind the batch): each row by itself, so the results keep
    the inputs' placement; None where it is not so (the rule then asks DTensor)."""
    at, default = _ALONG_ONE_DIM[node.target]
    val = node.meta.get(ir.VAL)
    ins = [a for a in node.all_input_nodes if isinstance(a.meta.get(ir.VAL), torch.Tensor)]
    pls = {a: tuple(getattr(sh.specs.get(a), "placements", ())) for a in ins}
    split = {pl for pl in pls.values() if pl != sh.replicate}
    if len(split) != 1 or not _strided(next(iter(split))[0]):
        return None
    (p,) = split.pop()
    shape = next(a for a in ins if pls[a] == (p,)).meta[ir.VAL].shape
    outs = val if isinstance(val, (tuple, list)) else (val,)
    if any(a.meta[ir.VAL].dim() != len(shape) or a.meta[ir.VAL].shape[p.dim] != shape[p.dim]
           for a in ins) or any(not isinstance(v, torch.Tensor) or v.dim() != len(shape)
                                or v.shape[p.dim] != shape[p.dim] for v in outs):
        return None  # (every operand and result holds the rows on that dim)
    if at is not None:
        dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", default)
        if dim % len(shape) == p.dim:
            return None
    # (a whole operand - the zeros a scatter writes into - cut to the rank's rows)
    sh.place(node, {a: (p,) for a in ins if pls[a] == sh.replicate})
    if node.target is aten.expand.default and node.args[1][p.dim] != -1:
        size = list(node.args[1])  # (the rank's rows)
        size[p.dim] //= sh.mesh_sizes[0]
        node.args = (node.args[0], size, *node.args[2:])
    specs = tuple(_out_spec(sh.mesh, (p,), v) for v in outs)
    return specs if isinstance(val, (tuple, list)) else specs[0]


def _ring_rule(sh, node, a, bwd):
    """Attention as fxpar::ring_attention(_backward): every operand and result keeps the
    rank's chunks (the keys' and values' gradients complete, not partial)."""
    split = (Shard(2),)
    keys = ("query", "key", "value") + (("grad_out", "out", "logsumexp") if bwd else ())
    sh.place(node, {a[x]: split for x in keys})
    tensors = tuple(a[x] for x in (("grad_out",) if bwd else ()) + keys[:3] +
                    (("out", "logsumexp") if bwd else ()))
    node.target = (torch.ops.fxpar.ring_attention_backward.default if bwd else
                   torch.ops.fxpar.ring_attention.default)
    node.args = (*tensors, a.get("dropout_p", 0.0), a.get("is_causal", False), a.get("scale"),
                 sh.group_names[0])
    node.kwargs = {}
    return tuple(_spec(sh.mesh, split, v) if isinstance(v, torch.Tensor) else None
                 for v in node.meta[ir.VAL])


def _n_outputs(node) -> int:
    val = node.meta.get(ir.VAL)
    return len(val) if isinstance(val, (tuple, list)) else 1


def _mesh_size(spec) -> int:
    return int(spec.mesh.mesh.numel())


def has_sharding_rule(op) -> bool:
    return op in _BATCH_HEAD_OPS or _registered(DTensor._op_dispatcher.sharding_propagator, op)


_RUNTIME_CHECKS = {aten._assert_async.msg, aten._assert_async.default,
                   torch.ops.fxpar.check_unrouted.default}
_WARNED_NO_RULE: set = set()  # ops without a DTensor rule, warned about once per process


@contextlib.contextmanager
def quiet(*loggers: str):
    """A probe's run of the engine (a dry run, a pass on a copy): its warnings, and the ops it
    found without a DTensor rule, are left to the job's own run to give."""
    logs = [logging.getLogger(n) for n in (__name__, *loggers)]
    levels, warned = [q.level for q in logs], set(_WARNED_NO_RULE)
    for q in logs:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for q, level in zip(logs, levels):
            q.setLevel(level)
        _WARNED_NO_RULE.intersection_update(warned)


def _registered(prop, op) -> bool:
    return (op in prop.op_strategy_funcs or op in prop.op_to_rules
            or op in getattr(prop, "op_single_dim_strategy_funcs", {}))


# `torch.where(mask, x, 0.0)` traces to where's scalar overloads, which lack ATen's pointwise
# tag and so DTensor's rules (its where.self has one): without a rule each such op would run
# on whole inputs (an MoE's listed experts: every routed row gathered). They are pointwise;
# registered the way DTensor registers its own untagged pointwise ops (_extra_pointwise_ops).
for _op in (aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar):
    if not _registered(DTensor._op_dispatcher.sharding_propagator, _op):
        _pointwise_ops._register_single_dim_pointwise(_op)


def _placements(spec) -> tuple | None:
    return None if spec is None else tuple(spec.placements)


def shard_graph(gm: torch.fx.GraphModule, mesh, placeholder_placements: dict[str, tuple],
                group_names: Sequence[str], reduce_shared_partials: bool = False,
                prefer: dict[torch.fx.Node, tuple] | None = None,
                gather_first: dict | None = None, split_random_ops: bool = False,
                split_sequence: bool = False, regather: bool = False,
                ring: Callable | None = None,
                local_dispatch: bool = False,
                rows: dict[torch.fx.Node, int] | None = None) -> dict[torch.fx.Node, Any]:
    """Propagate placements through `gm` in place, inserting redistributions.

    `placeholder_placements` maps placeholder name -> placements (default Replicate).
    Sets node.meta["shard"] on every value (a tuple per output for multi-output ops) and
    returns {node: placements}. Outputs are left as they are: the caller decides what each
    output must be (e.g. the data-parallel pass all-reduces gradients in buckets).
    meta["val"] still holds GLOBAL shapes; refresh with fake propagation afterwards.
    reduce_shared_partials: a partial sum read by several ops is all-reduced once, right
    where it is made (Megatron's placement), instead of each reader's chain of linear ops
    carrying it on and reducing its own, smaller, results (more collectives).
    prefer: node -> placements it should have (sequence parallelism: the residual stream
    split over the sequence; the all-gather tp style: a column split's output, Replicate); a
    value there is redistributed right where it is made (a split value is only ever made
    whole, never re-split), and a partial input meeting a split one is reduce-scattered to
    match it instead of all-reduced. gather_first: node -> dim; inputs split on that dim are
    gathered (made whole) before the node runs (the sequence-parallel all-gather before a
    matmul). split_random_ops: a dropout on a split value draws the whole mask and keeps
    its slice (core/split_random.py), as tensor parallelism needs. split_sequence: the
    batch's sequence dim is split (context parallelism): attention reads the whole keys
    and values (_sequence_rule), and row-wise ops carry the split flattened behind the batch;
    regather: the backward's attention gathers them again instead of reading the forward's
    whole copy (held from forward to backward otherwise). ring(node, args, kv_split) -> bool:
    whether an attention with q split (and k and v too: kv_split) runs as ring attention
    instead (k and v stay split, passed around the group; the context-parallel pass
    decides, and refuses by name what it asks for but cannot have). local_dispatch (a 1-D mesh
    splitting the batch): an MoE's token dispatch runs on each rank's own rows
    (core/local_dispatch.py) instead of gathering them. rows: node -> the dim of its value
    that another mesh axis splits (row_dims: the batch rows data parallelism splits after
    this pass); a partial sum is never reduce-scattered onto that dim, but all-reduced.
    """
    sh = _Sharder(gm.graph, mesh, list(group_names))
    sh.rows = dict(rows or {})
    sh.prefer_split, sh.prefer = bool(prefer), dict(prefer or {})
    sh.split_random, sh.split_sequence, sh.regather = split_random_ops, split_sequence, regather
    sh.ring = ring
    sh.one_row = split_sequence and all(  # (its tokens flattened: a plain shard, not strided)
        n.meta[ir.VAL].shape[0] == 1 for n in gm.graph.nodes if n.op == "placeholder"
        and n.meta.get(ir.ROLE) == "batch" and n.meta[ir.VAL].dim() > 1)
    if local_dispatch and len(sh.mesh_sizes) == 1:
        sh.local = local_dispatch_nodes(gm, mesh, placeholder_placements, group_names,
                                        split_sequence)
        sh.local_components = _local_dispatch.components(sh.local)
        if split_sequence:
            _local_dispatch.defer_tokenless_nodes(gm.graph, sh.local)
        sh.local_only = True
    for node in list(gm.graph.nodes):
        if node._erased:  # (split_random's rule drops the getitems of a replay wrapper)
            continue
        if node.op == "placeholder":
            spec = _spec(mesh, placeholder_placements.get(node.name, sh.replicate),
                         node.meta[ir.VAL])
        elif node.op == "output":
            continue
        elif node.op == "get_attr":  # constants baked into the graph are the same everywhere
            spec = _spec(mesh, sh.replicate, getattr(gm, node.target))
        elif node.target is operator.getitem:
            src = sh.specs[node.args[0]]
            spec = src[node.args[1]] if isinstance(src, (tuple, list)) else src
        else:
            if gather_first and node in gather_first:
                sh.place(node, {a: sh.replicate for a in sh.inputs(node)
                                if isinstance(sh.specs[a], DTensorSpec) and any(
                                    p == Shard(gather_first[node]) for p in sh.specs[a].placements)})
            spec = sh.propagate(node)
        s = sh.specs[node] = _with_meta(spec, node.meta.get(ir.VAL), mesh)
        node.meta[ir.SHARD] = _placements_tree(s)
        want = sh.prefer.get(node)
        if want is not None and isinstance(s, DTensorSpec) and tuple(s.placements) != want \
                and (want == sh.replicate or not any(isinstance(p, Shard) for p in s.placements)):
            sh.reduce_now(node, want)
        elif reduce_shared_partials:
            sh.reduce_if_shared(node)
    return {n: n.meta[ir.SHARD] for n in gm.graph.nodes if ir.SHARD in n.meta}


def local_dispatch_nodes(gm, mesh, placeholder_placements, group_names,
                         split_sequence: bool = False) -> dict:
    """core/local_dispatch.analyze on `gm` split over a 1-D `mesh`: the MoE dispatch nodes
    that run on each rank's own rows, with counts made outside a dispatch placed by a dry
    run of DTensor's rules (and, splitting a sequence, context parallelism's: the tokens
    flattened behind the batch stay split, so each rank's counts are its own)."""
    def placed(nodes):
        with quiet():  # (the real run says what runs on whole inputs)
            specs, _ = dry_run(gm, mesh, placeholder_placements, group_names, region=None,
                               only=ancestors(nodes), split_sequence=split_sequence)
        return {a: _placements(specs[a]) for a in nodes if a in specs}
    return _local_dispatch.analyze(gm, mesh.mesh.shape[0], placed)


def batch_local_dispatch(gm, n: int) -> dict:
    """local_dispatch_nodes with the batch split over n ranks (the dp pass's placements):
    {} for n = 1."""
    if n <= 1:
        return {}
    placements = {p.name: (Shard(0),) for p in gm.graph.nodes if p.op == "placeholder"
                  and p.meta.get(ir.ROLE) == "batch" and p.meta[ir.VAL].dim() > 0}
    return local_dispatch_nodes(gm, make_mesh(n), placements, ["dp"])


def row_dims(gm) -> dict[torch.fx.Node, int]:
    """{node: the dim of its value holding the batch rows}: where data parallelism's split
    of the batch (dim 0 of each batch input) reaches, by DTensor's rules (a dry run)."""
    placements = {p.name: (Shard(0),) for p in gm.graph.nodes if p.op == "placeholder"
                  and p.meta.get(ir.ROLE) == "batch" and p.meta[ir.VAL].dim() > 0}
    specs, _ = dry_run(gm, make_mesh(2), placements, ["rows"], region=None)
    return {n: s.placements[0].dim for n, s in specs.items()
            if isinstance(s, DTensorSpec) and isinstance(s.placements[0], Shard)}


def _placements_tree(s):
    if isinstance(s, (tuple, list)):
        return tuple(_placements_tree(x) for x in s)
    return _placements(s)


def _is_partial(placements) -> bool:
    return any(isinstance(p, Partial) for p in placements)


def dry_run(gm: torch.fx.GraphModule, mesh, placeholder_placements: dict[str, tuple],
            group_names: Sequence[str], region: str | None = ir.FORWARD, decide=None,
            reduce_shared_partials: bool = False, split_random_ops: bool = False,
            only: set | None = None, split_sequence: bool = False):
    """What shard_graph would do, without changing `gm` (it shards a copy of the graph).

    Returns (specs, requests): the placements of every visited node of `gm`, and every
    redistribution the real run would insert, as (node, input, have, need) in `gm`'s nodes.
    Only nodes of `region` are visited (None: all). `decide(node, specs)` is called before
    each call node and may return {placeholder name: placements} to place values left
    pending (placeholders mapped to None in `placeholder_placements`): lazy decisions, e.g.
    a weight's placement chosen when its matmul sees how the activation arrives. A pending
    placeholder left undecided blocks the nodes that read it (they are not visited).
    split_random_ops: as shard_graph's (a dropout on a split value keeps it split). only: the
    nodes of `gm` to visit (None: all). split_sequence: as shard_graph's."""
    g2 = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    g2.output(g2.graph_copy(gm.graph, val_map))
    back = {v: k for k, v in val_map.items()}
    gm2 = torch.fx.GraphModule(gm, g2)
    sh = _Sharder(g2, mesh, list(group_names))
    sh.split_random, sh.split_sequence = split_random_ops, split_sequence
    phs = {n.name: n for n in g2.nodes if n.op == "placeholder"}
    pending = set()
    for n in phs.values():
        pl = placeholder_placements.get(n.name, sh.replicate)
        if pl is None:
            pending.add(n)
        else:
            sh.specs[n] = _spec(mesh, pl, n.meta[ir.VAL])
    specs_view = _Translated(sh.specs, val_map)

    def ready(a) -> bool:  # can `a` be placed now (no pending value upstream)?
        if a in sh.specs:
            return True
        if a in pending or a.op == "placeholder":
            return False
        return all(ready(b) for b in sh.inputs(a))

    def settle(a):
        for b in sh.inputs(a):
            if b not in sh.specs:
                settle(b)
        _visit(sh, gm2, a)
        if reduce_shared_partials:
            sh.reduce_if_shared(a)

    for node in list(g2.nodes):
        if node.op in ("placeholder", "output") or node not in back or node._erased:
            continue
        if (region is not None and node.meta.get(ir.REGION) != region) or (
                only is not None and back[node] not in only):
            continue
        if decide is not None and node.op == "call_function":
            for name, pl in (decide(back[node], specs_view) or {}).items():
                ph = phs[name]
                if ph in pending:
                    sh.specs[ph] = _spec(mesh, pl, ph.meta[ir.VAL])
                    pending.discard(ph)
        if ready(node):
            settle(node)
    specs = {back[n]: s for n, s in sh.specs.items() if n in back}
    requests = [(back.get(n), back.get(v), have, need) for n, v, have, need in sh.requests]
    return specs, requests


class _Translated:
    """Read-only view of a copy's specs keyed by the original graph's nodes."""

    def __init__(self, specs, val_map):
        self.specs, self.val_map = specs, val_map

    def get(self, node, default=None):
        return self.specs.get(self.val_map.get(node), default)

    def __contains__(self, node):
        return self.val_map.get(node) in self.specs

    def __getitem__(self, node):
        return self.specs[self.val_map[node]]


def _visit(sh, gm, node):
    if node in sh.specs:
        return
    if node.op == "get_attr":
        spec = _spec(sh.mesh, sh.replicate, getattr(gm, node.target))
    elif node.target is operator.getitem:
        src = sh.specs[node.args[0]]
        spec = src[node.args[1]] if isinstance(src, (tuple, list)) else src
    else:
        spec = sh.propagate(node)
    sh.specs[node] = _with_meta(spec, node.meta.get(ir.VAL), sh.mesh)


class _Sharder:
    """Per-graph propagation state: the specs so far, the redistributions already made, and
    the list of them (`requests`: (node, value, have, need))."""

    def __init__(self, graph: torch.fx.Graph, mesh, group_names: list[str]):
        self.graph, self.mesh, self.group_names = graph, mesh, group_names
        self.requests: list[tuple] = []
        self.prefer_split = False  # sequence parallelism: partial + split -> reduce-scatter
        self.split_random = False  # tensor parallelism: dropout masks drawn whole (split_random)
        self.split_sequence = self.regather = False  # context parallelism: see shard_graph
        self.ring = None
        self.prefer: dict = {}
        self.local: dict = {}      # an MoE dispatch run on local rows: see local_dispatch
        self.local_components: dict = {}  # ... node -> its dispatch, and how each
        self.row_blocks: dict = {}         # dispatch's rows are split (local_dispatch.rule)
        self.one_row = False  # splitting a sequence, the batch has one row
        self.local_only = False    # ... and expert parallelism's ops only there
        self.replay = None         # inside remat's RNG replay wrapper: see split_random.rule
        self.rows: dict = {}       # value -> its dim another mesh axis splits (shard_graph)
        self.mesh_sizes = list(mesh.mesh.shape)
        self.replicate = tuple(Replicate() for _ in self.mesh_sizes)
        self.prop = DTensor._op_dispatcher.sharding_propagator
        self.specs: dict[torch.fx.Node, Any] = {}
        self.made: dict[tuple, torch.fx.Node] = {}  # (value, placements) -> redistributed node
        # ask_dtensor's memo (see _rule_key), shared by every sharding on a mesh of this
        # shape in the process: the planner's probes, the job's passes and evaluate's
        # program ask the same questions of the same layers
        self.answers = _ANSWERS.setdefault((tuple(self.mesh_sizes), mesh.device_type), {})
        if len(self.answers) > 100_000:  # (a long-lived process compiling many models)
            self.answers.clear()

    def out_spec(self, placements, val):
        """The DTensor spec of a value placed `placements` on this mesh (for the rules of
        core/split_random.py and vocab_parallel.py)."""
        return _out_spec(self.mesh, placements, val)

    def reduce_if_shared(self, node) -> None:
        """A partial sum read by several ops: all-reduce it once, here."""
        s = self.specs[node]
        if isinstance(s, DTensorSpec) and _is_partial(s.placements) and len(node.users) > 1:
            self.reduce_now(node)

    def reduce_now(self, node, need=None) -> None:
        """Replace every use of `node` by its redistributed value (default: partial sums
        all-reduced), made right after it."""
        users = list(node.users)
        need = need or tuple(Replicate() if isinstance(p, Partial) else p
                             for p in self.specs[node].placements)
        with self.graph.inserting_before(node.next):
            meta = {ir.MODULE: node.meta.get(ir.MODULE, ""), ir.REGION: node.meta.get(ir.REGION)}
            new = redistribute(self.graph, node, self.specs[node].placements, need,
                               self.group_names, self.mesh_sizes, meta)
        self.requests.append((users[0], node, tuple(self.specs[node].placements), need))
        self.specs[new] = DTensorSpec(self.mesh, need, self.specs[node].tensor_meta)
        new.meta[ir.SHARD] = need
        new.meta.setdefault(ir.VAL, node.meta.get(ir.VAL))
        self.made[(node, need)] = new
        if node in self.rows:
            self.rows[new] = self.rows[node]
        for u in users:
            u.replace_input_with(node, new)

    # -- inputs ----------------------------------------------------------------------------
    def inputs(self, node) -> list[torch.fx.Node]:
        return [a for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
                if isinstance(a, torch.fx.Node)]

    def to(self, node, value, placements) -> torch.fx.Node:
        """`value` placed as `placements`, redistributed before `node` at most once."""
        have, need = _placements(self.specs[value]), tuple(placements)
        if have == need:
            return value
        self.requests.append((node, value, have, need))
        if (value, need) not in self.made:  # one collective per (value, placement)
            with self.graph.inserting_before(node):
                meta = {ir.MODULE: node.meta.get(ir.MODULE, ""),
                        ir.REGION: node.meta.get(ir.REGION)}
                new = redistribute(self.graph, value, have, need, self.group_names,
                                   self.mesh_sizes, meta)
            self.specs[new] = DTensorSpec(self.mesh, need, self.specs[value].tensor_meta)
            new.meta[ir.SHARD] = need
            new.meta.setdefault(ir.VAL, value.meta.get(ir.VAL))  # global shape, like the rest
            self.made[(value, need)] = new
            if value in self.rows:
                self.rows[new] = self.rows[value]
        return self.made[(value, need)]

    def place(self, node, want: dict[torch.fx.Node, tuple]) -> None:
        """Rewrite node's tensor inputs to the placements in `want` (others untouched)."""
        node.args, node.kwargs = torch.utils._pytree.tree_map_only(
            torch.fx.Node, lambda a: self.to(node, a, want[a]) if a in want else a,
            (node.args, node.kwargs))

    def ask_dtensor(self, node):
        op = node.target
        args, kwargs = torch.utils._pytree.tree_map_only(
            torch.fx.Node, self.specs.__getitem__, (tuple(node.args), dict(node.kwargs)))
        key = _rule_key(op, (args, kwargs))
        if key is not None and key in self.answers:
            return self.answers[key]
        schema = OpSchema(op, args, kwargs, schema_info=_schema_info(self.prop, op, node.args))
        try:
            # the cached entry point conflates view ops that differ only in their shape arg
            out = self.prop.propagate_op_sharding_non_cached(schema)
        except Exception as e:  # noqa: BLE001
            raise ShardingError(f"DTensor's sharding rule for {op} (node {node.name}, module "
                                f"'{node.meta.get(ir.MODULE, '')}') failed: {e}") from e
        if key is not None:
            self.answers[key] = out
        return out

    # -- one op ----------------------------------------------------------------------------
    def propagate(self, node):
        if node.target in (run_and_save_rng_state, run_with_rng_state):
            return self.propagate_rng_replay(node)
        if node in self.local and (not self.split_sequence
                                   or _local_dispatch.row_blocks(self, node) is not None):
            return _local_dispatch.rule(self, node, self.local[node])
        if ir.EP_TOKENS in node.meta:
            return self.propagate_expert_tokens(node, *node.meta[ir.EP_TOKENS])
        if node.target in _local_dispatch.RANK_ROWS_OPS and self.local_only:
            raise ShardingError(
                f"{node.target} (node {node.name}, module '{node.meta.get(ir.MODULE, '')}'): " + (
                    "expert parallelism with context parallelism sends each rank's own tokens "
                    "to their experts, but this MoE's dispatch does not run on a cp rank's "
                    "tokens (they do not arrive as the rank's sequence chunks: core/"
                    "local_dispatch.row_blocks); cp runs it on the cp group's whole tokens. "
                    "Use ep or cp alone for this model (ep with dp, or cp with dp)."
                    if self.split_sequence else
                    "expert parallelism's all-to-all dispatch reads each dp rank's own rows, "
                    "but the MoE dispatch around it could not run on them (core/local_dispatch"
                    "); report the model to fxpar."))
        op, val = node.target, node.meta.get(ir.VAL)
        if not isinstance(op, torch._ops.OpOverload):
            raise ShardingError(f"node {node.name} calls {op}, which is not an ATen op; fxpar "
                                "shards only ATen graphs.")
        if op in _NEW_FACTORIES and self.split_sequence:
            # (reads its input's dtype and device only: whole, with nothing gathered)
            return _out_spec(self.mesh, self.replicate, val)
        if self._sum_commutes(node):
            # (a partial sum over this mesh goes through as one: reduced before the gather, it
            # would be summed over this whole mesh where ep's expert gradients are summed
            # over their "edp" part of it, after)
            return self.propagate_other_axis(node)
        # Reduce a Partial before it is broadcast: all-reducing the small input is cheaper than
        # letting the partial sum flow into a bigger value (DTensor's rules decide op by op and
        # would keep it Partial through an expand, then gather activations to combine it).
        out_numel = max((v.numel() for v in torch.utils._pytree.tree_leaves(val)
                         if isinstance(v, torch.Tensor)), default=0)
        self.place(node, {a: tuple(Replicate() if isinstance(p, Partial) else p
                                   for p in self.specs[a].placements)
                          for a in self.inputs(node)
                          if _is_partial(self.specs[a].placements)
                          and isinstance(a.meta.get(ir.VAL), torch.Tensor)
                          and a.meta[ir.VAL].numel() < out_numel})

        # A strided shard (heads split inside attention's batch*heads dim) is carried only
        # through ops whose DTensor rules are known to keep it right; any other op gets it
        # whole (gathered)
        strided = {a: tuple(Replicate() if _strided(p) else p for p in self.specs[a].placements)
                   for a in self.inputs(node) if op not in _STRIDED_OPS
                   and not (self.split_sequence and (_sequence_carried(op)
                                                     or op in _ALONG_ONE_DIM))
                   and isinstance(self.specs.get(a), DTensorSpec)
                   and any(_strided(p) for p in self.specs[a].placements)}
        if strided:
            log.debug("%s (node %s, module '%s') reads a strided shard: gathered first", op,
                      node.name, node.meta.get(ir.MODULE, ""))
            self.place(node, strided)

        if op is c10d.wait_tensor.default or op is aten.clone.default:
            # identities: any placement passes through (DTensor's clone rule would reduce a
            # partial sum, e.g. at a dropout(p=0) between a row split and the residual add)
            return _out_spec(self.mesh, self.specs[node.args[0]].placements, val)
        if self._other_axis(node):
            return self.propagate_other_axis(node)
        spec = vocab_parallel.rule(self, node)
        if spec is None and op in _VIEW_OPS:
            spec = self.strided_view(node)
        if spec is None and op in (aten.unsqueeze.default, aten.select.int,
                                   aten.unbind.int) and self.split_sequence:
            spec = _strided_dim_moved(self, node)
        if spec is None and self.split_random:
            spec = split_random.rule(self, node)
        if spec is not None:
            return spec
        if op is torch.ops.fxpar.dropout_with_mask.default:  # elementwise, mask placed like x
            pl = self.specs[node.args[0]].placements
            self.place(node, {node.args[1]: tuple(pl)})
            return _out_spec(self.mesh, pl, val)
        if self.prefer_split and op in _POINTWISE_BINARY:
            # split full-size operands the way the result should be split (a partial one by
            # reduce-scatter) rather than making them whole
            ins = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)
                   and isinstance(a.meta.get(ir.VAL), torch.Tensor)]
            split = self.prefer.get(node) or next(
                (self.specs[a].placements for a in ins
                 if isinstance(self.specs[a].placements[0], Shard)), None)
            all_partial = all(_is_partial(self.specs[a].placements) for a in ins)
            if split is not None and not all_partial:  # partial + partial stays partial
                self.place(node, {a: split for a in ins if a.meta[ir.VAL].shape == val.shape
                                  and not isinstance(self.specs[a].placements[0], Shard)})
        if op in _BATCH_HEAD_OPS and self.split_sequence and (
                spec := _sequence_rule(self, node)) is not None:
            return spec
        if op in _ALONG_ONE_DIM and self.split_sequence and (
                spec := _strided_rows(self, node)) is not None:
            return spec
        if op in _BATCH_HEAD_OPS and len(self.mesh_sizes) == 1:
            wanted, out_pl = _batch_head_rule(node, self.specs, self.replicate)
            self.place(node, wanted)
            vals = val if isinstance(val, (tuple, list)) else [val]
            out = tuple(_spec(self.mesh, (p,), v) if isinstance(v, torch.Tensor) else None
                        for p, v in zip(out_pl, vals))
            return out if isinstance(val, (tuple, list)) else out[0]
        if op in _RUNTIME_CHECKS and all(
                not isinstance(p, Partial) or p.reduce_op in ("product", "min")
                for a in self.inputs(node) if isinstance(self.specs.get(a), DTensorSpec)
                for p in _placements(self.specs[a])):
            # a run-time check (an index's range assert): each rank checks its own part, as
            # exact as checking the whole for a split tensor or a partial `all` - no
            # collective for it
            return _out_spec(self.mesh, self.replicate, val)
        if not _registered(self.prop, op) or op._schema.is_mutable:
            ins = [a for a in self.inputs(node) if isinstance(self.specs.get(a), DTensorSpec)]
            split = {a: self.replicate for a in ins
                     if _placements(self.specs[a]) != self.replicate}
            if not split:
                return _out_spec(self.mesh, self.replicate, val)
            if not op._schema.is_mutable:
                # no rule (e.g. weight_norm's backward, reached by a partial gradient under
                # dp): the op runs on whole inputs, which is always valid for a functional
                # op - each split input gathered, each partial one reduced, once
                gathers = any(isinstance(p, Shard) for a in split
                              for p in _placements(self.specs[a]))
                # (a split input costs a gather: say so; not for a loss reduction's own
                # nodes, which data parallelism rebuilds over the rows: mean_loss)
                if op not in _WARNED_NO_RULE and not node.meta.get(ir.LOSS_REDUCTION):
                    _WARNED_NO_RULE.add(op)
                    log.log(logging.WARNING if gathers else logging.INFO,
                            "%s (module '%s') has no DTensor sharding rule: it runs on whole "
                            "inputs (%s gathered or reduced first)", op,
                            node.meta.get(ir.MODULE, ""),
                            [_placements(self.specs[a]) for a in split])
                self.place(node, split)
                return _out_spec(self.mesh, self.replicate, val)
            raise ShardingError(
                f"cannot decide the sharding of {op} (node {node.name}, module "
                f"'{node.meta.get(ir.MODULE, '')}'): it writes into its inputs, which are "
                f"sharded ({[_placements(self.specs[a]) for a in ins]}), and DTensor has no "
                "sharding rule for it. Fix: rewrite that code without the in-place op (most "
                "out-of-place ATen ops have rules), or report the op to fxpar.")
        try:
            out = self.ask_dtensor(node)
            strided = _unsupported_answer(out, op, self.split_sequence)
        except ShardingError:
            out, strided = None, False
        if out is None or strided:
            # Some rules refuse a placement instead of asking for a redistribution (a view
            # that would reshape a split dimension, e.g. one key/value head split over tp),
            # or answer with a strided shard (a split dim flattened behind another: ALiBi's
            # batch*heads), which later rules mishandle, or with a masked partial (see
            # _unsupported_answer): the op then runs on whole inputs,
            # always valid (the caller sees the gather as a request, as tensor parallelism's
            # column check does, and keeps such a weight whole).
            split = {a: self.replicate for a in self.inputs(node)
                     if isinstance(self.specs[a], DTensorSpec)
                     and _placements(self.specs[a]) != self.replicate}
            if split:
                log.debug("%s (node %s, module '%s'): DTensor's rule refused %s; run on whole "
                          "inputs", node.target, node.name, node.meta.get(ir.MODULE, ""),
                          [_placements(self.specs[a]) for a in split])
                self.place(node, split)
            if split or out is None:
                out = self.ask_dtensor(node)  # with nothing to gather: the rule's own error
        if self.split_sequence and self._zigzag_misfits(node, out):
            # a view cutting the split sequence into (chunks, chunk) (Mamba-2's chunked scan,
            # a linear attention's blocks): DTensor keeps the split on the chunks dim, but
            # cp's front-and-back layout cuts a split dim into 2 x cp pieces, which a dim
            # that 2 x cp does not divide cannot hold: the op runs on whole inputs
            log.debug("%s (node %s, module '%s'): a sequence split on a dim 2 x cp does not "
                      "divide; run on whole inputs", op, node.name,
                      node.meta.get(ir.MODULE, ""))
            self.place(node, {a: self.replicate for a in self.inputs(node)
                              if isinstance(self.specs[a], DTensorSpec)
                              and _placements(self.specs[a]) != self.replicate})
            out = self.ask_dtensor(node)
        resplit = self._resplits(node, out)
        if resplit:
            # Shard(a) -> Shard(b): redistribute carries a re-split out as a whole all-gather
            # and a local chunk, so it costs what making the input whole costs. DTensor's rules
            # price it as an all-to-all and prefer it, then split the op's work along b, often
            # a dim a later matmul contracts: that matmul's results become partial sums, and
            # in half precision each rank's share is rounded before the sum (under dp, rows
            # sorted over the whole batch - an MoE's token dispatch - re-split on features
            # ahead of bf16 experts: 1-28% of torchtitan Qwen3-MoE's first gradients). The
            # input is made whole instead (the same gather), and the rule asked again.
            log.debug("%s (node %s, module '%s'): re-split %s made whole instead", op,
                      node.name, node.meta.get(ir.MODULE, ""), [a.name for a in resplit])
            self.place(node, resplit)
            out = self.ask_dtensor(node)
        if self.rows and (whole := self._row_splits(node, out)):
            # DTensor's rules reduce-scatter a partial sum onto any dim the op keeps (an MoE
            # router's logits onto their token rows, ahead of topk); when another mesh axis
            # splits those rows (data parallelism), the two splits would nest, which fxpar
            # cannot compose: the partial sum is all-reduced instead (a row-wise op then runs
            # on the whole rows of this axis, as it would without the reduce-scatter)
            log.debug("%s (node %s, module '%s'): partial %s all-reduced, not split on its "
                      "rows", op, node.name, node.meta.get(ir.MODULE, ""),
                      [a.name for a in whole])
            self.place(node, whole)
            out = self.ask_dtensor(node)
        if out.redistribute_schema is not None and self._partializes_replicate(node, out):
            # Turning a replicated value into a partial one (e.g. running-stat updates mixing a
            # buffer with a batch statistic) is legal but odd; reduce the partial input instead.
            self.place(node, {a: self.replicate for a in self.inputs(node)
                              if _is_partial(self.specs[a].placements)})
            out = self.ask_dtensor(node)
        if out.output_spec is None and val is not None and not isinstance(val, (int, float)):
            raise ShardingError(f"DTensor's sharding rule for {op} gave no output placement "
                                f"(node {node.name}).")
        if out.redistribute_schema is not None:
            want = out.redistribute_schema
            kwargs = dict(node.kwargs)
            for k, v in want.kwargs_schema.items():
                if k in kwargs:
                    kwargs[k] = self.rewrite(node, kwargs[k], v)
            want_args = want.args_schema
            info = _schema_info(self.prop, op, node.args)
            if info is not None and info.needs_pytree:  # DTensor hands the leaves back flat
                want_args = torch.utils._pytree.tree_unflatten(
                    list(want_args), torch.utils._pytree.tree_structure(tuple(node.args)))
            node.args, node.kwargs = tuple(self.rewrite(node, node.args, want_args)), kwargs
            node.target = _overload_for(op, node.args, node.kwargs)
        return out.output_spec

    def _other_axis(self, node) -> bool:
        """A collective (or rank-dependent fxpar op) over a process group that is not one of
        this mesh's: inserted by an earlier pass for another mesh dimension (e.g. tensor
        parallelism's all-reduces, seen by the data-parallel pass)."""
        if node.target not in _GROUP_ARG:
            return False
        group = node.args[_GROUP_ARG[node.target]]
        return isinstance(group, str) and group not in self.group_names

    def _sum_commutes(self, node) -> bool:
        """An op over another axis's group that a sum over this mesh's ranks commutes with:
        a linear collective of tp's (not ep's: its ranks are this mesh's own), a sum if it
        reduces, reading no strided shard (those are gathered first, below)."""
        if node.target not in _SUM_COMMUTES or not self._other_axis(node):
            return False
        if node.args[_GROUP_ARG[node.target]] in (ir.GROUPS["ep"], ir.GROUPS["edp"]):
            return False
        if node.target is c10d.all_reduce.default and node.args[1] not in ("sum", "avg"):
            return False
        return not any(_strided(p) for a in self.inputs(node)
                       if isinstance(self.specs.get(a), DTensorSpec)
                       for p in self.specs[a].placements)

    def propagate_expert_tokens(self, node, dim: int, way: str):
        """Expert parallelism's all-to-all of experts that run every token (Llama 4's,
        passes/expert_parallel): each rank sends its own tokens (dim `dim` split over this
        mesh) to the ranks of their experts and gets its tokens' results back; the values
        between hold the ep group's tokens for this rank's experts, split the same way.
        Tokens whole on every rank would be sent ep times over, so they are split first; on
        the way back they must still be split (an op between that made them whole would
        have mixed the group's tokens)."""
        x, want = node.args[0], (Shard(dim),)
        have = _placements(self.specs.get(x))
        if len(self.mesh_sizes) != 1:
            raise ShardingError(
                f"expert parallelism's all-to-all {node.name} (module "
                f"'{node.meta.get(ir.MODULE, '')}') of experts that run every token meets a "
                f"{len(self.mesh_sizes)}-D mesh; it composes with data parallelism's 1-D "
                "split of the batch only. Use ep=1 for this model, and report it to fxpar.")
        if way == "return" and have != want:
            raise ShardingError(
                f"expert parallelism's all-to-all {node.name} (module "
                f"'{node.meta.get(ir.MODULE, '')}') returns the tokens of experts that run "
                f"every token placed {have} over {self.group_names}, not split along dim "
                f"{dim}: an op between its all-to-alls did not keep each rank's tokens apart. "
                "Use ep=1 for this model, and report it to fxpar.")
        self.place(node, {x: want})
        return _out_spec(self.mesh, want, node.meta.get(ir.VAL))

    def propagate_other_axis(self, node):
        """Such an op acts independently on each of this mesh's shards (sums, gathers and
        chunks along another axis), so its result is placed like its input, unless it
        gathers/scatters/chunks along the very dim this mesh shards."""
        if node.target is torch.ops.fxpar.expert_pick.default:
            # the ep group is carved out of this mesh's ranks: a rank picking its own expert's
            # rows out of a partial sum or a shard would drop what the other ranks hold of the
            # experts they do not pick, so the rows are made whole first
            self.place(node, {x: self.replicate for x in node.args[0]
                              if self.specs[x].placements != self.replicate})
            return _out_spec(self.mesh, self.replicate, node.meta.get(ir.VAL))
        x = node.args[0]
        pl = self.specs[x].placements
        dim = _AXIS_DIM.get(node.target)
        if dim is not None:
            d = node.args[dim] if isinstance(dim, int) and dim > 0 else 0
            if any(isinstance(p, Shard) and p.dim == d for p in pl):
                raise ShardingError(
                    f"{node.target} (node {node.name}, module "
                    f"'{node.meta.get(ir.MODULE, '')}') " + (
                        f"cuts dim {d} into context parallelism's chunks, a dim data "
                        f"parallelism splits too ({pl}): fxpar cannot compose these two "
                        "splits of one dimension (expert parallelism's all-to-all of experts "
                        "that run every token, Llama 4's, sends a cp rank's tokens in one dim "
                        "with the rows). Use ep or cp alone for this model, or ep with cp = dp "
                        "(no rows split beside the sequence)."
                        if node.target in context_attention.REORDERS else
                        f"gathers/splits dim {d} over another mesh dimension, which this mesh "
                        f"also shards ({pl}); fxpar cannot compose these two shardings of one "
                        "dimension (tensor parallelism splitting rows that data parallelism "
                        "splits too). Use one of the two axes for this model (tp alone, or "
                        "dp / ep without tp), and report the model to fxpar."))
        return _out_spec(self.mesh, pl, node.meta.get(ir.VAL))

    def _zigzag_misfits(self, node, out) -> bool:
        """Whether DTensor's answer splits (or asks to split) a dim that cp's layout cannot
        cut into 2 x cp pieces."""
        outs, vals = out.output_spec, node.meta.get(ir.VAL)
        pairs = list(zip(outs, vals) if isinstance(outs, (tuple, list))
                     and isinstance(vals, (tuple, list)) else [(outs, vals)])
        if out.redistribute_schema is not None:
            pairs += [(s, None) for s in torch.utils._pytree.tree_leaves(
                (out.redistribute_schema.args_schema, out.redistribute_schema.kwargs_schema))]
        for spec, val in pairs:
            if not isinstance(spec, DTensorSpec):
                continue
            shape = spec.tensor_meta.shape if spec.tensor_meta is not None else \
                val.shape if isinstance(val, torch.Tensor) else None
            if shape is not None and not all(_zigzag_fits(shape, p, n) for p, n in
                                             zip(spec.placements, self.mesh_sizes)):
                return True
        return False

    def strided_view(self, node):
        """A view of a split value whose result is a strided shard (heads split, flattened
        with the batch), or of a strided shard: the output spec by _view_placement, the
        shape argument made local; None where DTensor's own rule is left to answer (a plain
        shard in and out). A strided shard no placement describes after the view is made
        whole first."""
        x = node.args[0]
        spec = self.specs.get(x)
        if len(self.mesh_sizes) != 1 or not isinstance(spec, DTensorSpec) or \
                not isinstance(node.meta.get(ir.VAL), torch.Tensor):
            return None
        pl, n = spec.placements[0], self.mesh_sizes[0]
        if not (isinstance(pl, Shard) or _strided(pl)):
            return None
        out_shape = list(node.meta[ir.VAL].shape)
        new = _view_placement(list(x.meta[ir.VAL].shape), pl, out_shape, n)
        if new is None or (isinstance(new, Shard) and isinstance(pl, Shard)):
            if _strided(pl):
                self.place(node, {x: self.replicate})
            return None
        if self.split_sequence and not _zigzag_fits(out_shape, new, n):
            self.place(node, {x: self.replicate})  # (as in propagate: _zigzag_misfits)
            return None
        local = list(out_shape)
        local[new.dim] //= n
        node.args = (node.args[0], local, *node.args[2:])
        return _out_spec(self.mesh, (new,), node.meta[ir.VAL])

    def propagate_rng_replay(self, node):
        """remat's RNG replay wrappers shard like the random op they wrap; the saved RNG state
        is each rank's own (never communicated), marked Replicate. A random op on a split
        value is rewritten by split_random's rule: `node` then leaves as a plain op."""
        saving = node.target is run_and_save_rng_state
        hop, val = node.target, node.meta.get(ir.VAL)
        k = 0 if saving else 1                      # position of the wrapped op in args
        head = node.args[:k + 1]
        op = node.args[k]
        node.target, node.args = op, node.args[k + 1:]
        node.meta[ir.VAL] = val[1] if saving else val
        self.replay = ("save",) if saving else ("replay", head[0])
        try:
            spec = self.propagate(node)
        finally:
            self.replay = None
            rewritten = node.target is not op
            if not rewritten:
                node.target, node.args = hop, (*head, *node.args)
                node.meta[ir.VAL] = val
        if rewritten:
            return spec
        if saving:
            return (_spec(self.mesh, self.replicate, val[0]), spec)
        return spec

    def _wanted(self, node, out) -> list[tuple]:
        """(input, the spec DTensor's answer wants it in) for node's graph-value inputs."""
        if out is None or out.redistribute_schema is None:
            return []
        want = out.redistribute_schema
        want_args = want.args_schema
        info = _schema_info(self.prop, node.target, node.args)
        if info is not None and info.needs_pytree:  # (flat leaves, as in propagate)
            want_args = torch.utils._pytree.tree_unflatten(
                list(want_args), torch.utils._pytree.tree_structure(tuple(node.args)))
        pairs = list(_node_specs(tuple(node.args), tuple(want_args)))
        for k, v in want.kwargs_schema.items():
            pairs += list(_node_specs(node.kwargs.get(k), v))
        return pairs

    def _resplits(self, node, out) -> dict:
        """{input: placements} for the inputs DTensor's answer moves from one split dim to
        another (Shard(a) -> Shard(b) on a mesh dim): whole (Replicate) on those mesh dims."""
        out_pl = {}
        for a, w in self._wanted(node, out):
            have = self.specs.get(a)
            if not isinstance(have, DTensorSpec):
                continue
            pl = tuple(Replicate() if type(p) is Shard and type(q) is Shard and p.dim != q.dim
                       else p for p, q in zip(have.placements, w.placements))
            if pl != tuple(have.placements):
                out_pl[a] = pl
        return out_pl

    def _row_splits(self, node, out) -> dict:
        """{input: placements} for the partial sums DTensor's answer reduce-scatters onto
        their rows (`self.rows`: the dim another mesh axis splits): all-reduced instead."""
        out_pl = {}
        for a, w in self._wanted(node, out):
            d, have = self.rows.get(a), self.specs.get(a)
            if d is None or not isinstance(have, DTensorSpec) or not _is_partial(have.placements):
                continue
            if any(isinstance(q, Shard) and q.dim == d for q in w.placements):
                out_pl[a] = tuple(Replicate() if isinstance(p, Partial) else p
                                  for p in have.placements)
        return out_pl

    def _partializes_replicate(self, node, out) -> bool:
        pairs = [(a, w) for a, w in zip(node.args, out.redistribute_schema.args_schema)
                 if isinstance(a, torch.fx.Node) and isinstance(w, DTensorSpec)]
        return any(_is_partial(w.placements) and not _is_partial(self.specs[a].placements)
                   for a, w in pairs)

    def rewrite(self, node, orig, want):
        """Map node args to what DTensor's rule wants: redistribute tensors, take its local
        versions of non-tensor args (e.g. a view's local shape)."""
        if isinstance(orig, torch.fx.Node):
            return self.to(node, orig, want.placements) if isinstance(want, DTensorSpec) else orig
        if isinstance(orig, (list, tuple)) and isinstance(want, (list, tuple)) \
                and len(orig) == len(want):
            return type(orig)(self.rewrite(node, o, w) for o, w in zip(orig, want))
        if isinstance(orig, (list, tuple)) and isinstance(want, (list, tuple)) \
                and len(orig) < len(want) and not any(
                    isinstance(w, DTensorSpec) for w in want[len(orig):]):
            # arguments DTensor's rule adds for the local op (squeeze()'s dims, read off the
            # global shape: a local size of 1 is not always a global one)
            return type(orig)([*(self.rewrite(node, o, w) for o, w in zip(orig, want)),
                               *want[len(orig):]])
        return orig if isinstance(want, DTensorSpec) else want


def _zigzag_fits(shape, p, n: int) -> bool:
    """Whether a split `p` of a value of `shape` over a cp group of n ranks can hold cp's
    layout: its split part (of each block, for a strided shard) cut into 2n pieces."""
    if not (isinstance(p, Shard) or _strided(p)):
        return True
    size = shape[p.dim] // (p.split_factor if _strided(p) else 1)
    return size % (2 * n) == 0


def _view_placement(in_shape, pl, out_shape, n):
    """The placement of view(x, out_shape) where x (in_shape) is split `pl` over n ranks:
    Shard(e), _StridedShard(e, k), or None where no placement describes it.

    A view keeps the elements' row-major order. In that order a split is [outer blocks P,
    split part q, inner R]: each rank holds the same 1/n contiguous piece of q in every
    block (Shard(d): P = prod(in_shape[:d]), q = in_shape[d]; _StridedShard(d, k): P times
    k, q over k). The output dim e that starts the q part with P = prod(out_shape[:e]) * k
    carries it: Shard(e) for k = 1, else _StridedShard(e, k), if e holds whole q's
    (with some of R) or an outermost part of q that n divides."""
    d = pl.dim % len(in_shape)
    P, q = math.prod(in_shape[:d]), in_shape[d]
    if _strided(pl):
        P, q = P * pl.split_factor, q // pl.split_factor
    before = 1
    for e, size in enumerate(out_shape):
        if before > P:
            break
        if P % before == 0 and size % (P // before) == 0:
            k = P // before
            w = size // k
            if w > 1 and (w % q == 0 or (q % w == 0 and w % n == 0)):
                return Shard(e) if k == 1 else _StridedShard(e, split_factor=k)
        before *= size
    return None


def _unsupported_answer(out, op=None, sequence: bool = False) -> bool:
    """Whether DTensor's answer places a value in a way this graph cannot carry: a strided
    shard from an op outside _STRIDED_OPS (and _SEQUENCE_STRIDED, with `sequence`), or a masked
    partial (_MaskPartial: DTensor's row-wise embedding, and gather along a split dim, keep the
    ids' out-of-range mask inside the placement object and localize the ids in the dispatcher;
    in a graph the ids would reach the op unlocalized and the partial would be summed unmasked -
    an index error, or a silently wrong value)."""
    specs = list(torch.utils._pytree.tree_leaves(out.output_spec))
    if out.redistribute_schema is not None:
        specs += torch.utils._pytree.tree_leaves(
            (out.redistribute_schema.args_schema, out.redistribute_schema.kwargs_schema))
    carried = op in _STRIDED_DTENSOR or (sequence and _sequence_carried(op))
    bad = _MaskPartial if carried else (_StridedShard, _MaskPartial)
    return any(isinstance(p, bad)
               for spec in specs if isinstance(spec, DTensorSpec) for p in spec.placements)


def _node_specs(orig, want):
    """(node, the spec DTensor wants for it) for every graph value in an op's arguments."""
    if isinstance(orig, torch.fx.Node):
        if isinstance(want, DTensorSpec):
            yield orig, want
    elif isinstance(orig, (list, tuple)) and isinstance(want, (list, tuple)) \
            and len(orig) == len(want):
        for o, w in zip(orig, want):
            yield from _node_specs(o, w)


_ANSWERS: dict[tuple, dict[tuple, Any]] = {}  # (mesh shape, device type) -> _rule_key -> answer


def _rule_key(op, args) -> tuple | None:
    """What a DTensor rule's answer depends on: the op, each input's placements and tensor
    meta (shape, stride, dtype), and every other argument by value. The layers of a model
    ask the same questions, and a rule costs ~5 ms in Python: answering repeats from a memo
    keeps the pass's time flat in depth. None (not memoised) where an argument is not
    hashable. DTensor's own cache keys on its OpSchema, which conflates view ops that differ
    only in their shape argument; this key holds every argument."""
    def leaf(a):
        if isinstance(a, DTensorSpec):
            m = a.tensor_meta
            return ("spec", tuple(a.placements), None if m is None else
                    (tuple(m.shape), tuple(m.stride), m.dtype))
        return (type(a).__name__, a)
    flat, tree = torch.utils._pytree.tree_flatten(args)
    key = (op, str(tree), tuple(leaf(a) for a in flat))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _schema_info(prop, op, args) -> RuntimeSchemaInfo | None:
    """The schema info DTensor's dispatcher would give the rule: the op's registered one, with
    needs_pytree set when a list argument holds tensors (aten.index's indices, aten.cat's
    inputs), as the dispatcher detects; without it the rule cannot see those tensors."""
    info = prop.op_to_schema_info.get(op) or getattr(
        prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
    in_list = any(isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a)
                  for a in args)
    if in_list and not (info is not None and info.needs_pytree):
        info = RuntimeSchemaInfo(static_argnum=info.static_argnum if info else 100,
                                 static_kwargkey=info.static_kwargkey if info else None,
                                 needs_pytree=True)
    return info


def _overload_for(op, args, kwargs):
    """`op`, or the overload of its packet whose schema takes `args`: DTensor's rules hand back
    normalised arguments (squeeze.dim's int dim as a tuple of dims, which is squeeze.dims)."""
    if _schema_takes(op._schema, args, kwargs):
        return op
    packet = op.overloadpacket
    for name in packet.overloads():
        other = getattr(packet, name)
        if other is not op and _schema_takes(other._schema, args, kwargs):
            return other
    raise ShardingError(f"after sharding, the arguments of {op} ({args}) fit none of the "
                        f"overloads of {packet}; please report this to fxpar.")


def _schema_takes(schema, args, kwargs) -> bool:
    """Whether `schema` accepts these arguments: arity, and no list where it wants one value
    (or one value where it wants a list) -- the differences between an op's overloads that
    sharding rewrites can introduce."""
    params = schema.arguments
    if len(args) > len(params) or any(k not in {a.name for a in params} for k in kwargs):
        return False
    given = {**{a.name: v for a, v in zip(params, args)}, **kwargs}
    for a in params:
        if a.name not in given:
            if not a.has_default_value() and not a.kwarg_only:
                return False
            continue
        v = given[a.name]
        if isinstance(v, torch.fx.Node) or v is None:
            continue
        wants_list = isinstance(a.real_type, torch.ListType) or (
            isinstance(a.real_type, torch.OptionalType)
            and isinstance(a.real_type.getElementType(), torch.ListType))
        if isinstance(v, (list, tuple)) != wants_list and not (
                wants_list and isinstance(v, int) and a.N is not None):
            return False
    return True


def _with_meta(spec, val, mesh):
    """Pin each spec's tensor meta to the traced (global) value: rules may leave it unset."""
    if isinstance(spec, (tuple, list)):
        vals = val if isinstance(val, (tuple, list)) else [None] * len(spec)
        return tuple(_with_meta(s, v, mesh) for s, v in zip(spec, vals))
    if isinstance(spec, DTensorSpec) and isinstance(val, torch.Tensor):
        return _spec(mesh, spec.placements, val)
    if spec is None and isinstance(val, torch.Tensor) and val.dim() == 0:
        # a scalar a rule gave no placement (CUDA's memory-efficient attention's random
        # seed and offset): the same on every rank
        return _spec(mesh, (Replicate(),) * mesh.ndim, val)
    return spec


def _out_spec(mesh, placements, val):
    if isinstance(val, (tuple, list)):
        return tuple(_spec(mesh, placements, v) if isinstance(v, torch.Tensor) else None
                     for v in val)
    return _spec(mesh, placements, val)

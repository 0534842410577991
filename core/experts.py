"""The rank-dependent step of expert parallelism, as a custom op so one graph serves every
rank (as core/vocab_parallel's `localize` does for a vocabulary split).

An MoE layer's rows are sorted by expert and `offs` holds each expert's end row (the
cumulative counts `aten._grouped_mm` takes). Rank r of the ep group holds experts
[r * E/ep, (r+1) * E/ep): their rows are one contiguous run of the sorted rows.
"""
from __future__ import annotations

import torch

# the grouped matmul of Hugging Face's and torchtitan's MoE experts (and of listed experts
# that passes/grouped_experts groups): the one name every module matches it by
GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)


def why_not_grouped_on(device, precision: str) -> str | None:
    """Why experts should not run as grouped matmuls on `device` at `precision`, or None: on
    CUDA torch runs a grouped matmul of other than bf16 operands group by group, reading the
    offsets on the host every step (no CUDA graph, a sync per matmul)."""
    if device is not None and torch.device(device).type == "cuda" and precision != "bf16":
        return f"on CUDA a grouped matmul runs in bf16 only (precision={precision})"
    return None


@torch.library.custom_op("fxpar::expert_window", mutates_args=())
def expert_window(offs: torch.Tensor, experts: int, group_name: str) -> torch.Tensor:
    """[start, local offs...] (int64, experts + 1 values): the first sorted row of this rank's
    `experts` experts, then their end rows counted from it (the offs a grouped matmul over
    this rank's experts and the rows moved to the front takes)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    rank = _resolve_process_group(group_name).rank()
    ends = offs.to(torch.int64)
    start = ends[rank * experts - 1] if rank else ends.new_zeros(())
    return torch.cat([start.reshape(1), ends[rank * experts:(rank + 1) * experts] - start])


@expert_window.register_fake
def _(offs, experts, group_name):
    return offs.new_empty(experts + 1, dtype=torch.int64)


# --- the all-to-all dispatch: each rank's own rows sent to their experts' ranks ------------
# Under data parallelism an MoE's dispatch runs on each rank's own rows (core/local_dispatch):
# its rows sorted by expert, `offs` its own counts. Expert parallelism then sends each run
# of rows to the rank holding its experts and brings the results back. The counts are data:
# the splits are read on the host (as torchtitan's and DeepSpeed's dispatch do), and a rank
# holds exactly the rows it receives: a shape that depends on the routing. The graph's
# fake value is the most any rank could receive (every rank's rows: ep x its own), an upper
# bound for shape propagation; the nodes between a dispatch and its combine are marked
# (ir.DYNAMIC_ROWS, passes/expert_parallel.py) and run op by op on the rows there are
# (compiler/codegen.py compiles no run over them).
# ep_dispatch and ep_combine are used as functional collectives are: each is followed by a
# `_c10d_functional.wait_tensor` of its result, so the overlap pass moves them as it moves
# the others, and the runtime (runtime/comm.lower) issues each as an asynchronous
# all-to-all (dispatch_splits / combine_send, then dispatched at the wait). Run as plain ops
# (one process, a test) they communicate synchronously and the wait returns their result.
# Not `_c10d_functional.all_to_all_single` itself: its split sizes are the graph's
# integers, these are data.

EMPTY_ROWS = 16  # what a rank that receives no rows holds instead (zeros past its offs)


def _a2a(out, x, out_splits, in_splits, pg):
    import torch.distributed as dist
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=pg)
    return out


@torch.library.custom_op("fxpar::ep_route", mutates_args=())
def ep_route(offs: torch.Tensor, experts: int, group_name: str) -> torch.Tensor:
    """[2, ep, experts] int64: the rows this rank sends to each rank's experts (its own
    counts), and the rows it receives from each rank for its `experts` experts (an
    all-to-all of the counts)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name)
    ends = offs.to(torch.int64)
    send = torch.cat([ends[:1], ends[1:] - ends[:-1]]).view(pg.size(), experts)
    recv = _a2a(torch.empty_like(send), send, None, None, pg)
    return torch.stack([send, recv])


@ep_route.register_fake
def _(offs, experts, group_name):
    return offs.new_empty((2, offs.numel() // experts, experts), dtype=torch.int64)


def dispatch_splits(route: torch.Tensor) -> tuple[list[int], list[int]]:
    """(rows received from each rank, rows sent to each rank) of ep_dispatch on `route`: the
    splits both the op and the runtime's asynchronous issue (runtime/comm) read, on the
    host."""
    return route[1].sum(1).tolist(), route[0].sum(1).tolist()


def dispatched(got: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """The rows the dispatch's all-to-all received (source by source), sorted by this rank's
    experts (each expert's rows from rank 0, 1, ...): a grouped matmul takes each expert's
    rows contiguous. After the exchange, so the runtime runs it at the wait."""
    recv = route[1]
    ep, experts = recv.shape
    if not len(got):  # (nothing for this rank's experts: zero rows past the offs, as a
        # grouped matmul's weight gradient over no rows at all is refused on CUDA)
        return got.new_zeros((EMPTY_ROWS, *got.shape[1:]))
    if experts == 1:  # (already in expert order)
        return got
    pieces = got.split(recv.flatten().tolist())  # (source, expert) blocks
    return torch.cat([pieces[s * experts + e] for e in range(experts) for s in range(ep)])


def combine_send(y: torch.Tensor, route: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], list[int]]:
    """What ep_combine's all-to-all sends: the experts' results on the received rows back in
    the order they came (source by source, the order each source expects them back in), and
    (rows received back from each rank, rows sent to each rank). Before the exchange, so the
    runtime runs it when it issues the combine."""
    send, recv = route[0], route[1]
    ep, experts = recv.shape
    n = int(recv.sum())
    if n == 0 and y.shape[0] == EMPTY_ROWS:  # (dispatched's stand-in rows: none came)
        y = y[:0]
    if y.shape[0] != n:
        raise RuntimeError(f"fxpar::ep_combine: {y.shape[0]} rows came back from the experts, "
                           f"but this rank received {n}: a node between the dispatch and the "
                           "combine changed the row count")
    if experts == 1:
        back = y
    else:
        pieces = y.split(recv.t().flatten().tolist())  # (expert, source)
        back = torch.cat([pieces[e * ep + s] for s in range(ep) for e in range(experts)])
    return back, send.sum(1).tolist(), recv.sum(1).tolist()


@torch.library.custom_op("fxpar::ep_dispatch", mutates_args=())
def ep_dispatch(x: torch.Tensor, route: torch.Tensor, group_name: str) -> torch.Tensor:
    """x's rows (sorted by expert) sent to their experts' ranks: the rows this rank
    receives (exactly those), sorted by its experts."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    out_splits, in_splits = dispatch_splits(route)
    got = _a2a(x.new_empty((sum(out_splits), *x.shape[1:])), x, out_splits, in_splits,
               _resolve_process_group(group_name))
    return dispatched(got, route)


@ep_dispatch.register_fake
def _(x, route, group_name):  # (the most it can be: see above)
    return x.new_empty((route.shape[1] * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("fxpar::ep_combine", mutates_args=())
def ep_combine(y: torch.Tensor, route: torch.Tensor, group_name: str) -> torch.Tensor:
    """ep_dispatch's inverse: the received rows' results sent back to the ranks whose rows
    they are, in their order (ep_dispatch's x)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    back, out_splits, in_splits = combine_send(y, route)
    return _a2a(y.new_empty((sum(out_splits), *y.shape[1:])), back, out_splits, in_splits,
                _resolve_process_group(group_name))


@ep_combine.register_fake
def _(y, route, group_name):
    return y.new_empty((y.shape[0] // route.shape[1], *y.shape[1:]))


# the ops above that communicate (run by every rank of the group together: never inside a
# compiled run, which is checked on one rank alone)
COMMUNICATING = frozenset({torch.ops.fxpar.ep_route.default, torch.ops.fxpar.ep_dispatch.default,
                           torch.ops.fxpar.ep_combine.default})
# those each waited on by a wait_tensor, as functional collectives are (see above)
ASYNC = frozenset({torch.ops.fxpar.ep_dispatch.default, torch.ops.fxpar.ep_combine.default})


# --- experts written as nn.ModuleList: the ep group's ranks each run their own ------------

@torch.library.custom_op("fxpar::expert_pick", mutates_args=())
def expert_pick(xs: list[torch.Tensor], group_name: str) -> torch.Tensor:
    """xs[rank in the ep group]: the rows of the expert this rank holds in one slot, out of
    the same rows of every rank's expert of that slot (one graph for every rank, as
    expert_window). The rows are whole on every rank: the sharding engine makes them so."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return xs[_resolve_process_group(group_name).rank()].clone()


@expert_pick.register_fake
def _(xs, group_name):
    return torch.empty_like(xs[0])


# --- a row of a loop over the experts hit that eager could not run ------------------------

@torch.library.custom_op("fxpar::check_unrouted", mutates_args=())
def check_unrouted(picks: torch.Tensor, message: str) -> None:
    """Raise where any of `picks` (one expert's row of a routing one_hot, non-negative) is
    nonzero: compiler/padded_nonzero removes a loop's iteration eager runs only where no
    token picked that expert (it indexes past a tensor's end otherwise). Each rank checks
    its own rows (core/sharding): no collective."""
    torch._assert_async(torch.logical_not(picks.any()), message)


@check_unrouted.register_fake
def _(picks, message):
    return None


torch.fx.node._side_effectful_functions.add(torch.ops.fxpar.check_unrouted.default)

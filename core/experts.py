"""The rank-dependent step of expert parallelism, as a custom op so one graph serves every
rank (as core/vocab_parallel's `localize` does for a vocabulary split).

An MoE layer's rows are sorted by expert and `offs` holds each expert's end row (the
cumulative counts `aten._grouped_mm` takes). Rank r of the ep group holds experts
[r * E/ep, (r+1) * E/ep): their rows are one contiguous run of the sorted rows.
"""
from __future__ import annotations

import torch


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
# the splits are read on the host (as torchtitan's and DeepSpeed's dispatch do), and the
# received rows are held in a buffer of the most any rank can receive (every rank's rows: ep
# x its own), static in shape, zero past the rows received (the grouped matmuls stop at
# their offs). Not functional collectives: their split sizes would be data-dependent shapes.

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


@torch.library.custom_op("fxpar::ep_dispatch", mutates_args=())
def ep_dispatch(x: torch.Tensor, route: torch.Tensor, group_name: str) -> torch.Tensor:
    """x's rows (sorted by expert) sent to their experts' ranks: the rows this rank
    receives, sorted by its experts (each expert's rows from rank 0, 1, ...), zero after
    them, in ep x len(x) rows."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name)
    send, recv = route[0], route[1]
    ep, experts = recv.shape
    got = _a2a(x.new_empty((int(recv.sum()), *x.shape[1:])), x,
               recv.sum(1).tolist(), send.sum(1).tolist(), pg)
    pieces = got.split(recv.flatten().tolist())  # (source, expert) blocks
    out = x.new_zeros((ep * x.shape[0], *x.shape[1:]))
    torch.cat([pieces[s * experts + e] for e in range(experts) for s in range(ep)],
              out=out[:got.shape[0]])
    return out


@ep_dispatch.register_fake
def _(x, route, group_name):
    return x.new_empty((route.shape[1] * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("fxpar::ep_combine", mutates_args=())
def ep_combine(y: torch.Tensor, route: torch.Tensor, group_name: str) -> torch.Tensor:
    """ep_dispatch's inverse: the received rows' results sent back to the ranks whose rows
    they are, in their order (ep_dispatch's x)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name)
    send, recv = route[0], route[1]
    ep, experts = recv.shape
    pieces = y[:int(recv.sum())].split(recv.t().flatten().tolist())  # (expert, source)
    back = torch.cat([pieces[e * ep + s] for s in range(ep) for e in range(experts)])
    return _a2a(y.new_empty((y.shape[0] // ep, *y.shape[1:])), back,
                send.sum(1).tolist(), recv.sum(1).tolist(), pg)


@ep_combine.register_fake
def _(y, route, group_name):
    return y.new_empty((y.shape[0] // route.shape[1], *y.shape[1:]))


@torch.library.custom_op("fxpar::ep_mask", mutates_args=())
def ep_mask(y: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """y with the rows past those received zeroed (a grouped matmul leaves them unwritten:
    every value is then defined, as Inductor's check of its code against the graph needs)."""
    out = y.clone()
    out[int(route[1].sum()):] = 0
    return out


@ep_mask.register_fake
def _(y, route):
    return torch.empty_like(y)


# the ops above that communicate (run by every rank of the group together: never inside a
# compiled run, which is checked on one rank alone)
COMMUNICATING = frozenset({torch.ops.fxpar.ep_route.default, torch.ops.fxpar.ep_dispatch.default,
                           torch.ops.fxpar.ep_combine.default})

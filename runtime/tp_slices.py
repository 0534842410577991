"""Tensor-parallel parameter layouts: a rank's shard of a full weight, and back.

A layout (from the tensor_parallel pass, Program.tp_layouts) is (shard_dim, interleave_dim, k):
the weight is split over the tp ranks along shard_dim (None: kept whole); k > 1 means its
interleave_dim holds k fused pieces (a fused QKV projection) stored interleaved, so that
each rank's contiguous slice holds its share of every piece: rank r gets [q_r; k_r; v_r].

A parameter may be split more than once (an expert stack: along its experts over the ep
group, then along its features over tp): `local_of` / `full_of` apply a chain of splits,
each (layout, ranks, this rank's index, group), on dims the others leave whole.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _interleave(t: torch.Tensor, dim: int, k: int, tp: int, inverse: bool = False):
    t = t.movedim(dim, 0)
    n, rest = t.shape[0], t.shape[1:]
    a, b = (tp, k) if inverse else (k, tp)
    t = t.reshape(a, b, n // (k * tp), *rest).transpose(0, 1).reshape(n, *rest)
    return t.movedim(0, dim)


def local_param(full: torch.Tensor, layout, tp: int, rank: int) -> torch.Tensor:
    """The tensor this tp rank's program reads for the user's full weight."""
    shard_dim, il_dim, k = layout
    t = full
    if k > 1:
        t = _interleave(t, il_dim, k, tp)
    if shard_dim is not None:
        t = t.chunk(tp, shard_dim)[rank]
    return t.contiguous().clone()


def full_param(local: torch.Tensor, layout, tp: int, group) -> torch.Tensor:
    """The user's full weight from every tp rank's tensor (collective over `group`)."""
    shard_dim, il_dim, k = layout
    t = local.detach()
    if shard_dim is not None:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        t = torch.cat(parts, shard_dim)
    if k > 1:
        t = _interleave(t, il_dim, k, tp, inverse=True)
    return t.clone()


def local_of(full: torch.Tensor, splits) -> torch.Tensor:
    """This rank's tensor of the user's full weight, after each split in turn."""
    for layout, ranks, rank, _ in splits:
        full = local_param(full, layout, ranks, rank)
    return full


def full_of(local: torch.Tensor, splits) -> torch.Tensor:
    """The user's full weight from every rank's tensor: the splits undone, last first
    (collective over each split's group)."""
    for layout, ranks, _, group in reversed(splits):
        local = full_param(local, layout, ranks, group)
    return local

"""Tensor-parallel parameter layouts: a rank's shard of a full weight, and back.

A layout (from the tensor_parallel pass, Program.tp_layouts) is (shard_dim, interleave_dim,
pieces): the weight is split over the tp ranks along shard_dim (None: kept whole); pieces > 1
(k equal pieces) or a tuple of piece sizes (a grouped-query QKV: q wider than k and v) means
its interleave_dim holds fused pieces stored interleaved, so that each rank's contiguous
slice holds its share of every piece: rank r gets [q_r; k_r; v_r].

A parameter may be split more than once (an expert stack: along its experts over the ep
group, then along its features over tp): `local_of` / `full_of` apply a chain of splits,
each (layout, ranks, this rank's index, group), on dims the others leave whole.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fxpar.core.ir import fused_pieces


def piece_sizes(n: int, pieces) -> list[int]:
    """The sizes of a layout's fused pieces along a dim of n elements ([n]: none)."""
    if isinstance(pieces, (tuple, list)):
        return list(pieces)
    return [n // pieces] * pieces


def _interleave(t: torch.Tensor, dim: int, pieces, tp: int, inverse: bool = False):
    """t with its fused pieces along `dim` stored rank-major ([q_0; k_0; v_0; q_1; ...]),
    or (inverse) back in the user's order ([q; k; v])."""
    t = t.movedim(dim, 0)
    shares = [s // tp for s in piece_sizes(t.shape[0], pieces)]
    if inverse:  # rank blocks, each [q_r; k_r; v_r] -> piece j's shares of every rank
        blocks = [b.split(shares) for b in t.split(sum(shares))]
        t = torch.cat([blocks[r][j] for j in range(len(shares)) for r in range(tp)])
    else:
        parts = [p.split(c) for p, c in zip(t.split([c * tp for c in shares]), shares)]
        t = torch.cat([parts[j][r] for r in range(tp) for j in range(len(shares))])
    return t.movedim(0, dim)


def local_param(full: torch.Tensor, layout, tp: int, rank: int) -> torch.Tensor:
    """The tensor this tp rank's program reads for the user's full weight."""
    shard_dim, il_dim, pieces = layout
    t = full
    if fused_pieces(pieces):
        t = _interleave(t, il_dim, pieces, tp)
    if shard_dim is not None:
        t = t.chunk(tp, shard_dim)[rank]
    return t.contiguous().clone()


def full_param(local: torch.Tensor, layout, tp: int, group) -> torch.Tensor:
    """The user's full weight from every tp rank's tensor (collective over `group`)."""
    shard_dim, il_dim, pieces = layout
    t = local.detach()
    if shard_dim is not None:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        t = torch.cat(parts, shard_dim)
    if fused_pieces(pieces):
        t = _interleave(t, il_dim, pieces, tp, inverse=True)
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

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

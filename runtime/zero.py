"""ZeRO stages 1 and 2 at run time: the user's optimizer steps only this rank's shard.

Each gradient bucket of the program is one flat vector (its parameters flattened in bucket
order, padded to a multiple of dp); this rank owns the r-th 1/dp slice. The optimizer (the
user's own torch.optim class, built by their factory) is given those slices as its parameters,
so its state (Adam's moments, momentum) takes 1/dp of the memory. After each step the updated
slices are all-gathered back into the full parameters, so forward and backward still see whole
weights (stage 3 would shard those too). Elementwise optimizers (SGD, Adam/AdamW, ...) give
exactly the unsharded result; optimizers that couple elements across a tensor (LAMB's trust
ratio, Adafactor's factored moments) would not, and are the user's responsibility to avoid.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist


class ShardedOptimizer:
    def __init__(self, factory: Callable, params: Sequence[torch.Tensor],
                 buckets: list[list[int]], dp: int, rank: int, group):
        self.dp, self.rank, self.group = dp, rank, group
        self.buckets = [[params[i] for i in idx] for idx in buckets]
        self.shards = []
        with torch.no_grad():
            for members in self.buckets:
                flat = self._flat(members)
                size = flat.numel() // dp
                self.shards.append(flat[rank * size:(rank + 1) * size].clone())
        self.optimizer = factory(self.shards)

    def _flat(self, members):
        flat = torch.cat([p.detach().reshape(-1) for p in members])
        pad = -flat.numel() % self.dp
        return torch.nn.functional.pad(flat, (0, pad)) if pad else flat

    def step(self, grad_shards: Sequence[torch.Tensor]) -> None:
        """Step the shards with this rank's gradient shards, then all-gather the parameters."""
        for s, g in zip(self.shards, grad_shards):
            s.grad = g.to(s.dtype)
        self.optimizer.step()
        with torch.no_grad():
            for members, s in zip(self.buckets, self.shards):
                s.grad = None
                full = torch.empty(s.numel() * self.dp, dtype=s.dtype, device=s.device)
                dist.all_gather_single(full, s, group=self.group)
                off = 0
                for p in members:
                    p.copy_(full[off:off + p.numel()].view_as(p))
                    off += p.numel()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (for memory reports and tests)."""
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))

"""ZeRO stages 1 and 2 at run time: the user's optimizer steps only this rank's shard.

Each gradient bucket of the program is one flat vector (its parameters flattened in bucket
order, padded to a multiple of dp); this rank owns the r-th 1/dp slice. The optimizer (the
user's own torch.optim class, built by their factory) is given those slices as its parameters,
so its state (Adam's moments, momentum) takes 1/dp of the memory. After each step the updated
slices are all-gathered back into the full parameters, so forward and backward still see whole
weights (stage 3 shards those too). The gathers go through runtime/comm (on gloo, large ones
as one broadcast per rank into the output: no second full-size buffer) and are on the
timeline. Elementwise optimizers (SGD, Adam/AdamW, ...) give exactly the unsharded result;
optimizers that couple elements across a tensor (LAMB's trust ratio, Adafactor's factored
moments) would not, and are the user's responsibility to avoid.

Under expert parallelism an expert weight is this ep rank's experts, shared only with the
ranks holding the same experts ("edp"): its buckets are sharded over that group instead.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fxpar.runtime import comm, optim
from fxpar.runtime.host_optimizer import HostOptimizer


class ShardedOptimizer:
    """shard_params=False: stages 1/2 (one shard per bucket; parameters stay whole).
    shard_params=True: stage 3 (one single-parameter bucket each; every parameter is replaced
    by its shard, which the graph all-gathers before use; the full tensors are freed)."""

    def __init__(self, factory: Callable, params: Sequence[torch.Tensor],
                 buckets: list[list[int]], dp: int, rank: int, group, shard_params=False,
                 param_shards: dict[int, torch.Tensor] | None = None,
                 shapes: Sequence[torch.Size] | None = None,
                 offload_to_host: bool = False, experts: frozenset = frozenset(),
                 expert_group: tuple | None = None):
        """`param_shards` (stage 3): the shards already made, by parameter index (a
        meta-device model: runtime/weights.py read only those; parameters this rank's
        stages do not need are absent); `shapes`: each parameter's shape in the program;
        `offload_to_host` (Plan.offload_optimizer): the optimizer steps host copies of the
        shards (`self.host`, runtime/host_optimizer.py); `experts` (Plan.ep): parameter
        indices sharded over `expert_group` = (ranks, this rank's index, group) instead."""
        self.dp, self.rank, self.group = dp, rank, group
        self.experts, self.expert_group = experts, expert_group
        self.shard_params = shard_params
        self.shapes = list(shapes) if shapes is not None else [p.shape for p in params]
        self.bucket_indices = [list(idx) for idx in buckets]  # (this rank's buckets)
        self.buckets = [[params[i] for i in idx] for idx in buckets]
        with torch.no_grad():
            if shard_params and param_shards is not None:
                self.param_shards = [param_shards.get(i, p.data.new_empty(0))
                                     for i, p in enumerate(params)]
                self.shards = [self.param_shards[idx[0]] for idx in buckets]
            elif shard_params:
                self.param_shards = [self.cut([p], i) for i, p in enumerate(params)]
                self.shards = [self.param_shards[idx[0]] for idx in buckets]
                for p in params:  # the graph gathers what it needs; keep only the shards
                    p.data = p.data.new_empty(0)
            else:
                self.shards = [self.cut(members, idx[0])
                               for members, idx in zip(self.buckets, buckets)]
        # a pipeline rank whose stages make no gradient (all weights elsewhere) steps nothing
        self.host = HostOptimizer(factory, self.shards, self.shards[0].device) \
            if offload_to_host and self.shards else None
        self.optimizer = self.host.optimizer if self.host is not None else \
            factory(self.shards) if self.shards else None

    def bucket_layout(self, k: int) -> list[tuple[int, int, int]]:
        """(parameter index, offset, numel) of each member of this rank's k-th bucket in
        its flat buffer: how every flat view of it (the gathered parameters, a checkpoint's
        shard, the gradient-norm mask) is taken apart."""
        out, off = [], 0
        for i in self.bucket_indices[k]:
            n = self.shapes[i].numel()
            out.append((i, off, n))
            off += n
        return out

    def group_of(self, i: int) -> tuple:
        """(ranks, this rank's index, group) parameter i (and its bucket) is sharded over."""
        if i in self.experts and self.expert_group is not None:
            return self.expert_group
        return self.dp, self.rank, self.group

    def cut(self, tensors, i: int) -> torch.Tensor:
        """This rank's shard of `tensors` flattened into one vector (padded to a multiple of
        the ranks parameter i's bucket is sharded over), a fresh tensor."""
        n, rank, _ = self.group_of(i)
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        pad = -flat.numel() % n
        flat = torch.nn.functional.pad(flat, (0, pad)) if pad else flat
        size = flat.numel() // n
        return flat[rank * size:(rank + 1) * size].clone()

    def gather(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """The whole flat vector whose shard this rank holds for parameter i's bucket
        (collective over its group)."""
        n, _, group = self.group_of(i)
        if n == 1:
            return shard
        # (runtime/comm's gather, as the step's: on gloo one broadcast per rank into the
        # output's slices rather than gloo's own copy through a second full-size buffer)
        return comm.wait(comm.start_all_gather(shard, n, group.group_name,
                                               "all_gather shards (ZeRO)"))

    def step(self, grad_shards: Sequence[torch.Tensor]) -> None:
        """Step the shards with this rank's gradient shards, then all-gather the parameters."""
        if self.optimizer is None:
            return
        for s, g in zip(self.shards, grad_shards):
            s.grad = optim.like_param(g, s)
        (self.host or self.optimizer).step()
        for s in self.shards:
            s.grad = None
        if self.shard_params:
            return
        with torch.no_grad():  # all buckets' gathers in flight at once, then unpacked
            groups = [self.group_of(idx[0]) for idx in self.bucket_indices]
            pending = [s if n == 1 else comm.start_all_gather(
                s, n, group.group_name, "all_gather params (ZeRO)")
                for s, (n, _, group) in zip(self.shards, groups)]
            for k, (members, p) in enumerate(zip(self.buckets, pending)):
                full = p if groups[k][0] == 1 else comm.wait(p)
                for (_, off, n), param in zip(self.bucket_layout(k), members):
                    param.copy_(full[off:off + n].view_as(param))

    def full_param(self, i: int) -> torch.Tensor:
        """Stage 3: parameter i all-gathered from its shards (collective over its group)."""
        shape = self.shapes[i]
        return self.gather(self.param_shards[i], i)[:shape.numel()].view(shape).clone()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (for memory reports and tests)."""
        if self.optimizer is None:
            return 0
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))

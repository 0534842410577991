"""Optimizer offload (Plan.offload_optimizer; DeepSpeed's ZeRO-Offload): the optimizer steps
host copies of this rank's tensors, so its state never takes device memory.

The tensors the optimizer updates on this rank (its parameters or tp slices, with ZeRO its
flat shards) each get a host copy, the master, and a host buffer for its gradient. The user's
optimizer is built over the masters, so its state (Adam's two moments: twice the parameters)
is made on the host at its first step. A step copies each gradient out, steps the masters
there, and copies each updated master back into its device tensor in place: the graphs (and a
captured CUDA graph) keep reading the same storage. The masters are the truth between steps:
whatever writes a device tensor from outside the step (a checkpoint's load) calls `pull`.

CUDA: masters and gradient buffers are pinned; the copies run on a side stream (`non_blocking`)
ordered against the compute stream by events, and the next step's compute waits for the copies
back. The step runs on the CPU, with torch's fused kernel where the user let torch choose
(runtime/optim.prefer_fused: one vectorised pass over each tensor). The copies are not yet
overlapped with the backward or the next forward: the step pays them whole.
CPU device: host and device are one memory; the copies still run (the path and its exactness
are tested on CPU) but nothing is saved and the masters are a second copy (parallelize warns).
Host tensors are made outside any TorchDispatchMode, so device-memory trackers
(runtime/memtrack.py) do not count them, as torch.cuda.max_memory_allocated does not.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fxpar.core.errors import PlanError


class HostOptimizer:
    """`optimizer`: the user's torch.optim optimizer over the masters (built by `factory`);
    `step()` reads each device tensor's `.grad`, as a torch optimizer reads `p.grad`."""

    def __init__(self, factory: Callable, tensors: Sequence[torch.Tensor],
                 device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.tensors = list(tensors)
        with torch.no_grad(), _disable_current_modes():
            self.masters = [self._host_like(t).copy_(t.detach()) for t in self.tensors]
            self.grads = [self._host_like(t) for t in self.tensors]
        self._master = {id(t): m for t, m in zip(self.tensors, self.masters)}
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.optimizer = factory(self.masters)
        self.stats = {"bytes_out": 0, "bytes_in": 0}  # the last step's copies

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)

    def master_of(self, t: torch.Tensor) -> torch.Tensor:
        """The host tensor the optimizer steps for device tensor `t` (its state is keyed by
        it); `t` itself where `t` is not one of this optimizer's."""
        return self._master.get(id(t), t)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (all on the host)."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))

    def host_bytes(self) -> int:
        """Host bytes this offload holds: masters, gradient buffers and the optimizer's state."""
        return sum(2 * t.numel() * t.element_size() for t in self.masters) + self.state_bytes()

    @torch.no_grad()
    def step(self) -> None:
        live = [k for k, t in enumerate(self.tensors) if t.grad is not None]
        if any(self.tensors[k].grad.layout != torch.strided for k in live):
            raise PlanError("Plan.offload_optimizer copies each gradient into a dense host "
                            "buffer; this model makes a sparse one (nn.Embedding(sparse=True)). "
                            "Use sparse=False, or keep the optimizer on the device.")
        with _disable_current_modes():
            self._copy([self.grads[k] for k in live], [self.tensors[k].grad for k in live],
                       to_host=True)
            for k in live:
                self.masters[k].grad = self.grads[k]
            try:
                self.optimizer.step()
            finally:
                for k in live:
                    self.masters[k].grad = None
            self._copy([self.tensors[k] for k in live], [self.masters[k] for k in live],
                       to_host=False)
        nbytes = sum(self.grads[k].numel() * self.grads[k].element_size() for k in live)
        self.stats = {"bytes_out": nbytes, "bytes_in": nbytes}

    def _copy(self, dsts, srcs, to_host: bool) -> None:
        if not self.cuda:
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the gradients are made / the step has read params
        with torch.cuda.stream(self.stream):
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
        if to_host:  # the CPU step reads them next (and the gradients may be freed)
            self.stream.synchronize()
        else:  # the next forward reads the new values; the next step's synchronize comes
            compute.wait_stream(self.stream)  # before the masters are written again

    @torch.no_grad()
    def pull(self) -> None:
        """Masters := device tensors (after something wrote the device tensors: a load)."""
        with _disable_current_modes():
            for m, t in zip(self.masters, self.tensors):
                m.copy_(t)

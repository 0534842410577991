"""Activation offloading for pipeline runs (Plan.offload; SageMaker-style).

Under a pipeline schedule a rank keeps the saved activations of several microbatches at once
(1F1B: up to pp - stage of them, GPipe: all m) although it works on one at a time. With
offloading, the values a forward part keeps for its own microbatch's backward (after remat:
only the checkpoints) move to host memory as soon as that forward is done, unless the rank's
very next action is that backward, and come back for the backward that reads them.

Copies are per storage, not per value: q, k and v are views of one projection's output, so the
whole storage goes out once and the views are re-made on it when it comes back (same strides
and offsets: the stage graphs were traced with them).

CUDA: copies run on a side stream into pinned host buffers (`non_blocking`), ordered against
the compute stream by events, and a storage is prefetched one action before the backward that
needs it, so the copy overlaps the current action's compute; the device memory of an
offloaded value returns to the caching allocator once the side stream's copy is done
(`record_stream`). CPU device: host and device are the same memory, copies are synchronous and
nothing is prefetched early (it would only hold memory sooner); the copies still run, so the
schedule and the bit-exact results are tested on CPU, but nothing is saved (parallelize warns).
Host buffers are allocated outside any TorchDispatchMode so device-memory trackers
(runtime/memtrack.py) do not count them, as torch.cuda.max_memory_allocated does not count
pinned host memory.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes


class _Block:
    """One storage on its way out and back: the host copy, (CUDA) the event its copy-out
    completes on, and the device copy once it is back (shared by all its views)."""
    __slots__ = ("host", "event", "device", "users")

    def __init__(self, host, event, users):
        self.host, self.event, self.users = host, event, users
        self.device = None


class OnHost:
    """An offloaded value: its block and how to re-make the view on it."""
    __slots__ = ("block", "size", "stride", "offset", "dtype")

    def __init__(self, block, t: torch.Tensor):
        self.block, self.dtype = block, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _bytes_of(storage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostStash:
    """Moves storages out to host memory and back; counts what it moved.

    stats (this step): bytes_out (copied out), host_peak (most bytes on host at once),
    copies (storages moved out), values (values offloaded)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.prefetches = self.cuda  # CPU copies are synchronous: fetch at the point of need
        self.new_step()

    def new_step(self):
        self._host_bytes = 0
        self.stats = {"bytes_out": 0, "host_peak": 0, "copies": 0, "values": 0}

    def out(self, values: list[torch.Tensor]) -> list[OnHost]:
        """Start copying the storages of `values` to host (one copy per storage); the caller
        drops its references, which frees the device memory."""
        blocks: dict[int, _Block] = {}
        for t in values:
            st = t.untyped_storage()
            b = blocks.get(st.data_ptr())
            if b is None:
                b = blocks[st.data_ptr()] = self._copy_out(st)
            b.users += 1
        self.stats["values"] += len(values)
        return [OnHost(blocks[t.untyped_storage().data_ptr()], t) for t in values]

    def _copy_out(self, st) -> _Block:
        nbytes = st.nbytes()
        with _disable_current_modes():
            host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.cuda)
            src = _bytes_of(st, self.device)
            event = None
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    host.copy_(src, non_blocking=True)
                    src.record_stream(self.stream)  # keep the memory until the copy is done
                    event = torch.cuda.Event()
                    event.record(self.stream)
            else:
                host.copy_(src)
        self._host_bytes += nbytes
        self.stats["bytes_out"] += nbytes
        self.stats["copies"] += 1
        self.stats["host_peak"] = max(self.stats["host_peak"], self._host_bytes)
        return _Block(host, event, 0)

    def prefetch(self, v: OnHost) -> None:
        """Start copying v's storage back (CUDA: on the side stream, returns at once)."""
        b = v.block
        if b.device is not None:
            return
        dev = torch.empty(b.host.numel(), dtype=torch.uint8, device=self.device)
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(b.event)
                dev.copy_(b.host, non_blocking=True)
                b.event = torch.cuda.Event()
                b.event.record(self.stream)
        else:
            dev.copy_(b.host)
        b.device = dev

    def back(self, v: OnHost) -> torch.Tensor:
        """The value on the device again, with its original size, strides and offset."""
        b = v.block
        self.prefetch(v)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(b.event)
            b.device.record_stream(torch.cuda.current_stream(self.device))
        t = torch.empty(0, dtype=v.dtype, device=self.device).set_(
            b.device.untyped_storage(), v.offset, v.size, v.stride)
        b.users -= 1
        if b.users == 0:  # every view is back: the host copy goes, the views keep the memory
            self._host_bytes -= b.host.numel()
            b.host = b.device = None
        return t

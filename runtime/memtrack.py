"""Measured memory: what a real run allocates, to check the simulator against reality.

On CPU a TorchDispatchMode sees every op's outputs; an output whose storage is not one of the
op's inputs' storages is a new allocation, and a weakref finalizer on that storage marks it
freed. Events are kept so peaks can be taken afterwards with some storages left out (e.g. the
gradients, to get activation memory alone). On CUDA, `torch.cuda.max_memory_allocated` is the
ground truth and `measure()` uses it.
"""
from __future__ import annotations

import gc
import weakref
from typing import Callable, Iterable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def _real_storage(t: torch.Tensor):
    """t's storage if it holds real memory; None for meta / fake tensors and for wrappers
    without a storage of their own."""
    if t.is_meta or isinstance(t, FakeTensor):  # (a fake storage has no data pointer)
        return None
    try:
        st = t.untyped_storage()
        st.nbytes()
        st.data_ptr()  # (a traced weight's stand-in, under fxpar's capture: a storage
        # without data, "invalid python storage")
    except (RuntimeError, NotImplementedError):
        return None
    return None if st.device.type == "meta" else st


def _real_storages(tree) -> list:
    """Real storages of the tensors in tree; tensor subclasses (DTensor) by their parts."""
    out = []
    for t in pytree.tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            out += _real_storages([getattr(t, a) for a in attrs])
        elif (st := _real_storage(t)) is not None:
            out.append(st)
    return out


class MemoryTracker(TorchDispatchMode):
    """Records every storage an op allocates and when it dies (a tensor subclass's - DTensor,
    FSDP2's shards - by its parts).

    with MemoryTracker() as mt:
        out = fn()
    mt.peak()                       # peak live bytes allocated inside the block
    mt.peak(exclude=[grads...])     # same, leaving out the storages of these tensors
    """

    supports_higher_order_operators = True  # rng replay ops (remat) pass through here

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int, int]] = []   # (+bytes | -bytes, storage key)
        self._live: dict[int, int] = {}
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {s.data_ptr() for s in _real_storages((args, kwargs))}
        for st in _real_storages(out):
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            self._register(st)
        return out

    def _register(self, st) -> None:
        if st in self._keys:
            return
        key = self._next
        self._next += 1
        self._keys[st] = key
        self._live[key] = st.nbytes()
        self.events.append((st.nbytes(), key))
        weakref.finalize(st, self._free, key)

    def _free(self, key):
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.events.append((-nbytes, key))

    def key(self, t: torch.Tensor) -> int | None:
        return self._keys.get(t.untyped_storage())

    def live_bytes(self) -> int:
        """Bytes allocated inside the block that are still alive."""
        return sum(self._live.values())

    def peak(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        skip = {self.key(t) for t in exclude}
        cur = best = 0
        for nbytes, key in self.events:
            if key in skip:
                continue
            cur += nbytes
            best = max(best, cur)
        return best


class StepMemory(MemoryTracker):
    """MemoryTracker that counts the tensors it starts with, and samples live bytes during a window: a peer's
    training step measured as fxpar's is (benchmarks/zero_vs_fsdp.py, fsdp_tp_2d.py).

    with StepMemory(initial_tensors) as sm:
        ... build, warm up ...
        with sm.window():
            step()
    sm.held, sm.peak_live
    """

    def __init__(self, initial: list[torch.Tensor]):
        super().__init__()
        for st in _real_storages(initial):
            self._register(st)
        self._sampling = False
        self.held = self.peak_live = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._sampling:
            self.peak_live = max(self.peak_live, self.live_bytes())
        return out

    def live_bytes(self) -> int:
        """Current bytes of every tracked storage still alive (resizes included)."""
        return sum(st.nbytes() for st in list(self._keys.keys()))

    def window(self):
        tracker = self

        class _Window:
            def __enter__(self):
                gc.collect()
                tracker.held = tracker.peak_live = tracker.live_bytes()
                tracker._sampling = True

            def __exit__(self, *exc):
                tracker._sampling = False
                tracker.peak_live = max(tracker.peak_live, tracker.live_bytes())

        return _Window()


def warm_steps_measured(step: Callable, batches: list, warmup: int,
                        held: list[torch.Tensor]) -> tuple[list[float], StepMemory]:
    """`warmup` steps, then one more tracked (a barrier before it on every rank): a peer or
    a plan measured alike by the benchmarks (benchmarks/ep_vs_zero.py, cp_vs_dp.py).
    `held`: the tensors the rank holds before its steps (weights, shards). Returns the
    losses and the tracker (`held`, `peak_live`)."""
    import torch.distributed as dist
    tracker = StepMemory(held)
    tracker.__enter__()
    losses = []
    try:
        for s in range(warmup + 1):
            if s < warmup:
                losses.append(step(batches[s % len(batches)]).item())
                continue
            dist.barrier()
            with tracker.window():
                losses.append(step(batches[s % len(batches)]).item())
    finally:
        tracker.__exit__(None, None, None)
    return losses, tracker


def measure(fn: Callable, *, exclude: Callable | None = None) -> tuple[object, int]:
    """Run fn(); return (its result, peak bytes it allocated). `exclude(result)` lists tensors
    whose storages are not counted (CPU only; on CUDA the allocator's peak is total)."""
    dev = torch.cuda.current_device() if torch.cuda.is_available() else None
    if dev is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if exclude is not None:
            peak -= sum(t.untyped_storage().nbytes() for t in exclude(out))
        return out, peak
    with MemoryTracker() as mt:
        out = fn()
    return out, mt.peak(exclude(out) if exclude is not None else ())

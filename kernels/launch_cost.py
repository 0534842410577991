"""What a launch costs on this device, measured: an ATen op against fxpar's hand-written
Triton kernel, for the fusion pass's KernelPrice (core/cost.py). Here, beside the kernels,
because it launches one of them; the price itself is the cost model's."""
from __future__ import annotations

import torch

from fxpar.core.cost import KernelPrice, gpu_hardware
from fxpar.kernels import library

aten = torch.ops.aten


_LAUNCH_CACHE: dict = {}


def launch_seconds(device) -> tuple[float, float]:
    """(ATen op, hand-written Triton kernel) host seconds per launch on a CUDA device,
    measured once per process (~10 ms): 200 launches each on a one-row tensor, the ATen op
    called as the executor calls it (an OpOverload from Python), the Triton kernel through
    the wrapper the fusion pass puts in the graph (kernels/library.KernelCall: the softmax
    kernel), no sync in between."""
    import time
    device = torch.device(device)
    key = str(device)
    if key not in _LAUNCH_CACHE:
        from torch.fx.experimental.proxy_tensor import make_fx
        x = torch.zeros(1, 8, device=device)
        gm = make_fx(lambda a: aten._softmax.default(a, -1, False))(x)
        node = next(n for n in gm.graph.nodes if n.target is aten._softmax.default)
        softmax = library.SINGLE_OP[aten._softmax.default].for_node(node)  # as in a graph
        add = aten.add.Tensor

        def per_launch(fn):
            for _ in range(20):  # compile, warm the caches
                fn()
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            for _ in range(200):
                fn()
            dt = (time.perf_counter() - t) / 200
            torch.cuda.synchronize(device)
            return dt
        triton_s = per_launch(lambda: softmax(x, -1, False))
        if softmax.fallback:  # it ran ATen's op: a kernel that cannot be built never pays
            triton_s = float("inf")
        _LAUNCH_CACHE[key] = (per_launch(lambda: add(x, x)), triton_s)
    return _LAUNCH_CACHE[key]


def kernel_price(device, replayed: bool) -> KernelPrice | None:
    """The fusion pass's KernelPrice on `device`; None where fused kernels are not compiled
    (CPU: Triton's interpreter runs them, for tests, not for speed)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    aten_s, triton_s = launch_seconds(device)
    return KernelPrice(aten_s, triton_s, gpu_hardware(device).mem_bandwidth, replayed=replayed)

"""Attention traced as a CUDA device would run it, while planning a GPU from a CPU.

`fxpar plan --hardware h100` (or any what-if for a GPU) captures the model on this machine's
CPU, where `F.scaled_dot_product_attention` dispatches to the CPU's kernels: flash attention
for CPU where the head dims match, else the math composite, which saves the whole
probability matrix (batch x heads x seq x seq) for the backward. On the GPU the same call
runs a fused kernel that saves only the output and its log-sum-exp. DeepSeek-V3's attention
(query/key head dim 192, value 128) takes the math path on a CPU: its what-if priced 17 GiB a
layer of probabilities that the H100 never holds, and every plan of it as memory-bound.

This mode records each call as the CUDA kernel op PyTorch's dispatcher would pick there
(torch/backends/cuda sdp_utils, in its order): flash attention where the dtype is half
precision, there is no mask and the head dims are equal and at most 256 (grouped-query
attention included); else the memory-efficient kernel (masks, fp32, a value head dim of its
own; as many key/value heads as query heads); else the call as it is.
The ops have meta kernels, so they trace on CPU fake tensors; they are only ever priced,
never run (a plan compiled for the GPU captures again on the GPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def kernel(q, k, v, attn_mask) -> str:
    """'flash', 'efficient' or 'math': what CUDA's SDPA runs for these operands (fewer key /
    value heads than query heads, grouped-query attention: flash or math only)."""
    if q.dim() != 4 or q.size(-1) != k.size(-1):
        return "math"
    if attn_mask is None and q.dtype in _HALF and q.size(-1) == v.size(-1) <= 256:
        return "flash"
    align = 8 if q.dtype in _HALF else 4  # (the kernel's alignment rule)
    if q.size(-1) % align == 0 and v.size(-1) % align == 0 and k.size(-3) == q.size(-3):
        return "efficient"
    return "math"


class CudaAttention(TorchFunctionMode):
    """While tracing on CPU tensors: each `F.scaled_dot_product_attention` as the CUDA kernel
    op it would run (`kernel`), with that op's saved values and FLOP count."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                 "enable_gqa")
        a = {**dict(zip(names, args)), **kwargs}
        q, k, v = a["query"], a["key"], a["value"]
        mask, p = a.get("attn_mask"), float(a.get("dropout_p", 0.0))
        causal, scale = bool(a.get("is_causal", False)), a.get("scale")
        which = kernel(q, k, v, mask)
        if which == "math":
            return func(*args, **kwargs)
        if which == "flash":  # (grouped-query attention: the kernel reads the shared heads)
            return aten._scaled_dot_product_flash_attention(
                q, k, v, p, causal, False, scale=scale)[0]
        if mask is not None:
            if mask.dtype == torch.bool:  # (True: attend, as SDPA reads a boolean mask)
                mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
            mask = mask.to(q.dtype).expand(q.size(0), q.size(1), q.size(2), k.size(2))
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, p, causal, scale=scale)[0]

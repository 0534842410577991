"""Softmax forward and backward over any dim, as one Triton kernel each.

ATen's softmax makes a pass for the max, one for the sum of exponentials and one to
normalise; here a program loads a block of whole rows once, keeps them in registers for all
three steps and writes the result once (the Triton fused-softmax tutorial, with rows of a
[outer, N, inner] view so that softmax over a middle dim needs no transposed copy).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fxpar.kernels.jit import kernel, row_blocks

MAX_N = 65536
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(x, dim) -> str | None:
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} (only float32/bfloat16/float16)"
    if x.dim() == 0 or x.numel() == 0:
        return "scalar or empty input"
    if x.shape[dim] > MAX_N:
        return f"softmax dim of {x.shape[dim]} elements is longer than one block ({MAX_N})"
    return None


def _launch(x, dim):
    """Rows of the [outer, N, inner] view of contiguous x; block shape and warps."""
    dim = dim % x.dim()
    n, inner = x.shape[dim], math.prod(x.shape[dim + 1:])
    rows = x.numel() // n
    block_m, block_n, warps = row_blocks(rows, n)
    return n, inner, rows, block_m, block_n, warps


@kernel
def _softmax_fwd(X, Y, rows, N, inner, SAFE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    base = (r // inner).to(tl.int64) * N * inner + r % inner
    offs = base[:, None] + c[None, :].to(tl.int64) * inner
    mask = (r[:, None] < rows) & (c[None, :] < N)
    x = tl.load(X + offs, mask=mask, other=-float("inf")).to(tl.float32)
    m = tl.max(x, 1)
    if SAFE:  # a row of -inf (everything masked) gives zeros, not 0/0
        m = tl.where(m == -float("inf"), 0.0, m)
    e = tl.exp(x - m[:, None])
    s = tl.sum(e, 1)
    y = e * (1.0 / s)[:, None]
    if SAFE:
        y = tl.where(s[:, None] == 0.0, 0.0, y)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@kernel
def _softmax_bwd(G, Y, DX, rows, N, inner, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    base = (r // inner).to(tl.int64) * N * inner + r % inner
    offs = base[:, None] + c[None, :].to(tl.int64) * inner
    mask = (r[:, None] < rows) & (c[None, :] < N)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    dx = y * (g - tl.sum(g * y, 1)[:, None])
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


def softmax_forward(x, dim, half_to_float=False, safe=False):
    """aten._softmax(x, dim, half_to_float); aten._safe_softmax(x, dim) with safe=True."""
    x = x.contiguous()
    y = torch.empty_like(x, dtype=torch.float32 if half_to_float else x.dtype)
    n, inner, rows, bm, bn, warps = _launch(x, dim)
    _softmax_fwd[(triton.cdiv(rows, bm),)](x, y, rows, n, inner, SAFE=safe,
                                            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return y


def softmax_backward(grad_output, output, dim, input_dtype):
    """aten._softmax_backward_data: output * (grad - sum(grad * output, dim)).

    The result has `input_dtype`, as on CUDA and in ATen's meta function (CPU ATen keeps
    grad_output's dtype when the two differ, i.e. after a half_to_float softmax)."""
    g, y = grad_output.contiguous(), output.contiguous()
    dx = torch.empty_like(y, dtype=input_dtype)
    n, inner, rows, bm, bn, warps = _launch(y, dim)
    _softmax_bwd[(triton.cdiv(rows, bm),)](g, y, dx, rows, n, inner,
                                            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return dx

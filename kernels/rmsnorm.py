"""Llama's RMSNorm, forward and backward, as one Triton kernel each.

    y = weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)

Unfused this is pow, mean, add, rsqrt, mul, cast and mul, each reading and writing a full
tensor; fused, the forward reads x once and writes y (and the per-row rstd the backward needs)
once, and the backward reads dy and x once, writes dx and sums dweight per program as in the
layer-norm kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxpar.kernels.jit import kernel, row_blocks

MAX_N = 65536
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_PROGRAMS = 512


def supports(x, weight=None) -> str | None:
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} (only float32/bfloat16/float16)"
    if x.dim() == 0 or x.numel() == 0:
        return "scalar or empty input"
    if weight is not None and (weight.dtype not in DTYPES or tuple(weight.shape) != x.shape[-1:]):
        return "weight is not a float vector over the last dim"
    if x.shape[-1] > MAX_N:
        return f"rows of {x.shape[-1]} elements are longer than one block ({MAX_N})"
    return None


@kernel
def _rms_fwd(X, W, Y, Rstd, rows, N, eps, HAS_W: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    rmask, cmask = r < rows, c < N
    mask = rmask[:, None] & cmask[None, :]
    offs = r[:, None].to(tl.int64) * N + c[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / N + eps)
    y = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)  # HF casts back first
    if HAS_W:
        y = y * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Rstd + r, rstd, mask=rmask)


@kernel
def _rms_bwd(DY, X, W, Rstd, DX, DW, rows, N, rows_per_program,
             HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_N)
    cmask = c < N
    w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32) if HAS_W else 1.0
    dw = tl.zeros([BLOCK_N], tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, rows)
    for r0 in range(start, end, BLOCK_M):
        r = r0 + tl.arange(0, BLOCK_M)
        rmask = r < end
        mask = rmask[:, None] & cmask[None, :]
        offs = r[:, None].to(tl.int64) * N + c[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + r, mask=rmask, other=0.0).to(tl.float32)
        xhat = x * rstd[:, None]
        wdy = dy * w
        dx = (wdy - xhat * (tl.sum(xhat * wdy, 1) / N)[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat.to(X.dtype.element_ty).to(tl.float32), 0)
    tl.store(DW + pid * N + c, dw, mask=cmask)


def rms_norm_forward(x, weight, eps):
    """-> (y, rstd): y in the promoted dtype of x and weight, rstd fp32 x.shape[:-1] + (1,)."""
    x = x.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty_like(x, dtype=dtype)
    rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
    bm, bn, warps = row_blocks(rows, n)
    _rms_fwd[(triton.cdiv(rows, bm),)](x, weight if weight is not None else x, y, rstd,
                                        rows, n, eps, HAS_W=weight is not None,
                                        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return y, rstd


def rms_norm_backward(grad_y, x, rstd, weight):
    """-> (dx in x's dtype, dweight in weight's dtype or None)."""
    x, dy = x.contiguous(), grad_y.contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    bm, bn, warps = row_blocks(rows, n)
    programs = min(triton.cdiv(rows, bm), MAX_PROGRAMS)
    per_program = triton.cdiv(triton.cdiv(rows, programs), bm) * bm
    programs = triton.cdiv(rows, per_program)
    dx = torch.empty_like(x)
    dw = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    _rms_bwd[(programs,)](dy, x, weight if weight is not None else x, rstd.contiguous(), dx, dw,
                          rows, n, per_program, HAS_W=weight is not None,
                          BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    dweight = None if weight is None else dw.sum(0).to(weight.dtype)
    return dx, dweight

"""LayerNorm forward and backward as one Triton kernel each (the Triton layer-norm tutorial).

The forward reads x once and writes y, mean and rstd once; the backward reads dy and x once
and writes dx, with each program also summing its rows' contributions to dweight/dbias into
one row of a small [programs, C] fp32 buffer (reduced by torch afterwards) instead of
materialising dy * x_hat for every row.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fxpar.kernels.jit import kernel, row_blocks

MAX_N = 65536
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_PROGRAMS = 512  # backward: rows are split over at most this many partial sums


def supports(x, normalized_shape) -> str | None:
    k = len(normalized_shape)
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} (only float32/bfloat16/float16)"
    if k == 0 or x.dim() < k or tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        return "normalized_shape is not the trailing shape of the input"
    if x.numel() == 0:
        return "empty input"
    if math.prod(normalized_shape) > MAX_N:
        return f"rows of {math.prod(normalized_shape)} elements are longer than one block ({MAX_N})"
    return None


@kernel
def _ln_fwd(X, W, B, Y, Mean, Rstd, rows, N, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    rmask, cmask = r < rows, c < N
    mask = rmask[:, None] & cmask[None, :]
    offs = r[:, None].to(tl.int64) * N + c[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + r, mean.to(Mean.dtype.element_ty), mask=rmask)
    tl.store(Rstd + r, rstd.to(Rstd.dtype.element_ty), mask=rmask)


@kernel
def _ln_bwd(DY, X, W, Mean, Rstd, DX, DW, DB, rows, N, rows_per_program,
            HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK_N)
    cmask = c < N
    w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32) if HAS_W else 1.0
    dw = tl.zeros([BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, rows)
    for r0 in range(start, end, BLOCK_M):
        r = r0 + tl.arange(0, BLOCK_M)
        rmask = r < end
        mask = rmask[:, None] & cmask[None, :]
        offs = r[:, None].to(tl.int64) * N + c[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + r, mask=rmask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + r, mask=rmask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w
        c1 = tl.sum(xhat * wdy, 1) / N
        c2 = tl.sum(wdy, 1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, 0)
        db += tl.sum(dy, 0)
    tl.store(DW + pid * N + c, dw, mask=cmask)
    tl.store(DB + pid * N + c, db, mask=cmask)


def _stat_dtype(x):
    # ATen keeps mean/rstd in the input dtype on CPU, in fp32 (acc type) on CUDA
    return x.dtype if x.device.type == "cpu" else torch.float32


def layer_norm_forward(x, normalized_shape, weight, bias, eps):
    """aten.native_layer_norm -> (out, mean, rstd); mean/rstd are x.shape[:-k] + (1,)*k."""
    k = len(normalized_shape)
    n = math.prod(normalized_shape)
    x = x.contiguous()
    rows = x.numel() // n
    y = torch.empty_like(x)
    stat_shape = tuple(x.shape[:x.dim() - k]) + (1,) * k
    mean = torch.empty(stat_shape, dtype=_stat_dtype(x), device=x.device)
    rstd = torch.empty_like(mean)
    bm, bn, warps = row_blocks(rows, n)
    _ln_fwd[(triton.cdiv(rows, bm),)](
        x, weight if weight is not None else x, bias if bias is not None else x, y, mean, rstd,
        rows, n, eps, HAS_W=weight is not None, HAS_B=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return y, mean, rstd


def layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """aten.native_layer_norm_backward -> (dx, dweight, dbias), None where not asked for."""
    n = math.prod(normalized_shape)
    x, dy = x.contiguous(), grad_out.contiguous()
    rows = x.numel() // n
    bm, bn, warps = row_blocks(rows, n)
    programs = min(triton.cdiv(rows, bm), MAX_PROGRAMS)
    per_program = triton.cdiv(triton.cdiv(rows, programs), bm) * bm
    programs = triton.cdiv(rows, per_program)
    dx = torch.empty_like(x)
    dw = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    db = torch.empty_like(dw)
    _ln_bwd[(programs,)](dy, x, weight if weight is not None else x, mean.contiguous(),
                         rstd.contiguous(), dx, dw, db, rows, n, per_program,
                         HAS_W=weight is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    dweight = dbias = None
    if output_mask[1] and weight is not None:
        dweight = dw.sum(0).view(weight.shape).to(weight.dtype)
    if output_mask[2] and bias is not None:
        dbias = db.sum(0).view(bias.shape).to(bias.dtype)
    return (dx if output_mask[0] else None), dweight, dbias

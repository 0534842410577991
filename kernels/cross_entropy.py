"""Cross-entropy (log_softmax + nll_loss) forward and backward, one Triton kernel each.

ATen writes the [N, V] log-probabilities and reads them back for the loss and again in the
backward; with a large vocabulary that tensor dominates the memory of a language model's
last layer. Here the forward reads each row of logits once and keeps only its logsumexp
(N floats); the backward reads the logits once more and writes the gradient once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxpar.kernels.jit import kernel, row_blocks

# columns per block: a whole 50k-wide row in one block spills its registers on an H100 (5x
# slower than ATen); the forward walks a row in blocks of this many columns (online logsumexp), the backward is
# one program per block
CHUNK = 4096
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(logits, target) -> str | None:
    if logits.dtype not in DTYPES:
        return f"dtype {logits.dtype} (only float32/bfloat16/float16)"
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        return "needs [N, V] logits and [N] targets"
    if target.dtype not in (torch.int64, torch.int32):
        return f"target dtype {target.dtype}"
    if logits.numel() == 0:
        return "empty input"
    return None


@kernel
def _ce_fwd(X, stride_x, T, Loss, Lse, rows, V, ignore_index, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < rows
    row = X + r[:, None].to(tl.int64) * stride_x
    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, V, BLOCK_N):  # online logsumexp: one read of the row
        c = start + tl.arange(0, BLOCK_N)
        x = tl.load(row + c[None, :], mask=rmask[:, None] & (c[None, :] < V),
                    other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), 1)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(T + r, mask=rmask, other=ignore_index)
    hit = rmask & (t >= 0) & (t < V)
    x_t = tl.load(X + r.to(tl.int64) * stride_x + tl.where(hit, t, 0), mask=hit, other=0.0)
    loss = tl.where(t != ignore_index, lse - x_t.to(tl.float32), 0.0)
    tl.store(Loss + r, loss, mask=rmask)
    tl.store(Lse + r, lse, mask=rmask)


@kernel
def _ce_bwd(X, stride_x, T, Lse, G, stride_g, DX, rows, V, ignore_index,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = r < rows
    mask = rmask[:, None] & (c[None, :] < V)
    x = tl.load(X + r[:, None].to(tl.int64) * stride_x + c[None, :], mask=mask,
                other=0.0).to(tl.float32)
    t = tl.load(T + r, mask=rmask, other=ignore_index)
    lse = tl.load(Lse + r, mask=rmask, other=0.0)
    g = tl.load(G + r * stride_g, mask=rmask, other=0.0)
    dx = (tl.exp(x - lse[:, None]) - tl.where(c[None, :] == t[:, None], 1.0, 0.0)) * g[:, None]
    dx = tl.where((t != ignore_index)[:, None], dx, 0.0)
    tl.store(DX + r[:, None].to(tl.int64) * V + c[None, :], dx.to(DX.dtype.element_ty),
             mask=mask)


def _rows(logits):
    """The logits as the kernels read them: elements of a row contiguous, rows at any
    stride (rows padded for aligned loads are read in place, not copied first)."""
    return logits if logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1] else \
        logits.contiguous()


def cross_entropy_forward(logits, target, reduction, ignore_index, upcast=False):
    """-> (loss, total_weight, lse) as aten.nll_loss_forward(aten._log_softmax(logits, 1),
    target, None, reduction, ignore_index) plus lse = logsumexp(logits, 1) in fp32.

    reduction: 0 none (loss [N]), 1 mean, 2 sum (0-d loss); total_weight is 0-d in the
    logits dtype: the number of targets != ignore_index, or 0 with reduction none.
    upcast: the cross-entropy of `logits.float()` (loss and total_weight in fp32), read
    from the half-precision logits (the kernel computes in fp32 either way: no fp32 copy of
    the [N, V] logits is written)."""
    x, t = _rows(logits), target.contiguous()
    n, v = x.shape
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    bm, bn, warps = row_blocks(n, min(v, CHUNK))
    _ce_fwd[(triton.cdiv(n, bm),)](x, x.stride(0), t, loss, lse, n, v, ignore_index,
                                   BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    out = torch.float32 if upcast else x.dtype
    if reduction == 0:
        return loss.to(out), x.new_zeros((), dtype=out), lse
    total_weight = (t != ignore_index).sum().to(torch.float32)
    loss = loss.sum()
    if reduction == 1:
        loss = loss / total_weight
    return loss.to(out), total_weight.to(out), lse


def cross_entropy_backward(grad_loss, logits, lse, target, reduction, ignore_index,
                           total_weight, upcast=False, grad_dtype=None):
    """-> grad_logits = (softmax - onehot(target)) * grad_loss (/ total_weight for mean),
    0 on ignored rows; in grad_dtype (default: the logits dtype, fp32 with `upcast`, the
    gradient of `logits.float()`). Computed in fp32 and rounded once on the store: fp32
    gradient then a cast, without writing the fp32 one."""
    x, t = _rows(logits), target.contiguous()
    n, v = x.shape
    g = grad_loss.float()
    if reduction == 1:
        g = g / total_weight.float()
    g = g.contiguous() if reduction == 0 else g.reshape(1)
    dx = torch.empty((n, v), dtype=grad_dtype or (torch.float32 if upcast else x.dtype),
                     device=x.device)
    bm, bn, warps = row_blocks(n, min(v, CHUNK))
    _ce_bwd[(triton.cdiv(n, bm), triton.cdiv(v, bn))](
        x, x.stride(0), t, lse.contiguous(), g, 1 if reduction == 0 else 0, dx, n, v,
        ignore_index, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return dx

"""FlashAttention-2 forward and backward in Triton (after the Triton fused-attention tutorial).

Plain attention writes the [Lq, Lk] score and probability matrices of every head to memory and
reads them back (twice more in the backward). Here each program keeps a block of queries
on chip and streams over the keys with an online softmax (running max m_i and sum l_i), so
only q, k, v, the output and one logsumexp per query touch memory. The backward recomputes
the probabilities from that logsumexp: a small pass for delta = rowsum(dO * O), one pass per
key block accumulating dK and dV over the query blocks, and one per query block for dQ.

Matches aten._scaled_dot_product_flash_attention_for_cpu(_backward) (no dropout, no mask),
output layouts included: out like q, lse [B, H, Lq] stored as [B, Lq, H], grads as
[B, L, H, D]. Causal masking is top-left aligned as in torch: key j is visible to query i
iff j <= i, also when Lq != Lk. Grouped-query attention as in torch: k and v may have
H / G heads, query head h reading kv head h // G.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fxpar.kernels.jit import interpreting, kernel, next_pow2

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_D = 256


def supports(q, k, v, is_causal=False) -> str | None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "needs [B, H, L, D] q, k and v"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (one of float32/bfloat16/float16)"
    if (q.shape[0] != k.shape[0] or k.shape != v.shape or q.shape[3] != k.shape[3]
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        return "q, k and v differ in batch or head dim, or q heads are no multiple of kv heads"
    if q.numel() == 0 or k.numel() == 0:
        return "empty input"
    if q.shape[3] > MAX_D:
        return f"head dim {q.shape[3]} > {MAX_D}"
    return None


def _config(q, k):
    lq, lk, block_d = q.shape[2], k.shape[2], max(16, next_pow2(q.shape[3]))
    block = 64 if block_d * q.element_size() <= 256 else 32  # tiles fit in shared memory
    return {
        "BLOCK_M": min(block, max(16, next_pow2(lq))),
        "BLOCK_N": min(block, max(16, next_pow2(lk))), "BLOCK_D": block_d,
        # the interpreter's numpy dot cannot multiply bf16; on GPUs fp32 inputs get IEEE
        # (not TF32) products so results match ATen's fp32 attention
        "DOT": tl.float32 if interpreting() else getattr(tl, str(q.dtype).split(".")[1]),
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32", "num_warps": 4}


@kernel
def _attn_fwd(Q, K, V, Out, LSE, scale,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
              sob, soh, som, sod, slb, slh, slm, H, G, Lq, Lk, D,
              CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    b, h = (tl.program_id(1) // H).to(tl.int64), (tl.program_id(1) % H).to(tl.int64)
    Q, K, V = Q + b * sqb + h * sqh, K + b * skb + (h // G) * skh, V + b * svb + (h // G) * svh
    m, d, dn = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    dmask = d < D
    q = tl.load(Q + m[:, None] * sqm + d[None, :] * sqd,
                mask=(m[:, None] < Lq) & dmask[None, :], other=0.0).to(DOT)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(Lk, start_m + BLOCK_M) if CAUSAL else Lk
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + dn
        kt = tl.load(K + n[None, :] * skn + d[:, None] * skd,
                     mask=(n[None, :] < Lk) & dmask[:, None], other=0.0).to(DOT)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        valid = n[None, :] < Lk
        if CAUSAL:
            valid = valid & (n[None, :] <= m[:, None])
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is in the first block
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + n[:, None] * svn + d[None, :] * svd,
                    mask=(n[:, None] < Lk) & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty).to(DOT), v.to(DOT),
                                            input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    Out += b * sob + h * soh
    tl.store(Out + m[:, None] * som + d[None, :] * sod, acc.to(Out.dtype.element_ty),
             mask=(m[:, None] < Lq) & dmask[None, :])
    tl.store(LSE + b * slb + h * slh + m * slm, m_i + tl.log(l_i), mask=m < Lq)


@kernel
def _attn_bwd_delta(Out, DO, Delta, sob, soh, som, sod, sgb, sgh, sgm, sgd, H, Lq, D,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    m, d = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    mask = (m[:, None] < Lq) & (d[None, :] < D)
    o = tl.load(Out + b * sob + h * soh + m[:, None] * som + d[None, :] * sod, mask=mask,
                other=0.0)
    do = tl.load(DO + b * sgb + h * sgh + m[:, None] * sgm + d[None, :] * sgd, mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * Lq + m, delta, mask=m < Lq)


@kernel
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, scale,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                   sgb, sgh, sgm, sgd, slb, slh, slm,
                   sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, H, G, Lq, Lk, D,
                   CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    hkv = H // G
    b, h = (tl.program_id(1) // hkv).to(tl.int64), (tl.program_id(1) % hkv).to(tl.int64)
    n, d, dm = start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_M)
    kv_mask = (n[:, None] < Lk) & (d[None, :] < D)
    k = tl.load(K + b * skb + h * skh + n[:, None] * skn + d[None, :] * skd, mask=kv_mask,
                other=0.0).to(DOT)
    v = tl.load(V + b * svb + h * svh + n[:, None] * svn + d[None, :] * svd, mask=kv_mask,
                other=0.0).to(DOT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    Q, DO, LSE, Delta = Q + b * sqb, DO + b * sgb, LSE + b * slb, Delta + b * H * Lq
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0  # earlier queries see none of these keys
    for hq in range(h * G, h * G + G):  # the query heads sharing this kv head
        for start_m in range(lo, Lq, BLOCK_M):
            m = start_m + dm
            q_mask = (m[:, None] < Lq) & (d[None, :] < D)
            q = tl.load(Q + hq * sqh + m[:, None] * sqm + d[None, :] * sqd, mask=q_mask,
                        other=0.0).to(DOT)
            do = tl.load(DO + hq * sgh + m[:, None] * sgm + d[None, :] * sgd, mask=q_mask,
                         other=0.0)
            lse = tl.load(LSE + hq * slh + m * slm, mask=m < Lq, other=0.0)
            delta = tl.load(Delta + hq * Lq + m, mask=m < Lq, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale  # [BLOCK_N, BLOCK_M]
            valid = (m[None, :] < Lq) & (n[:, None] < Lk)
            if CAUSAL:
                valid = valid & (n[:, None] <= m[None, :])
            pt = tl.where(valid, tl.exp(st - lse[None, :]), 0.0)
            dv += tl.dot(pt.to(DO.dtype.element_ty).to(DOT), do.to(DOT), input_precision=PRECISION)
            dpt = tl.dot(v, tl.trans(do.to(DOT)), input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(Q.dtype.element_ty).to(DOT), q, input_precision=PRECISION)
    dk *= scale
    tl.store(DK + b * sdkb + h * sdkh + n[:, None] * sdkn + d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + h * sdvh + n[:, None] * sdvn + d[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@kernel
def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ, scale,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                 sgb, sgh, sgm, sgd, slb, slh, slm, sdqb, sdqh, sdqm, sdqd, H, G, Lq, Lk, D,
                 CAUSAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    K, V = K + b * skb + (h // G) * skh, V + b * svb + (h // G) * svh
    m, d, dn = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    q_mask = (m[:, None] < Lq) & (d[None, :] < D)
    q = tl.load(Q + b * sqb + h * sqh + m[:, None] * sqm + d[None, :] * sqd, mask=q_mask,
                other=0.0).to(DOT)
    do = tl.load(DO + b * sgb + h * sgh + m[:, None] * sgm + d[None, :] * sgd, mask=q_mask,
                 other=0.0).to(DOT)
    lse = tl.load(LSE + b * slb + h * slh + m * slm, mask=m < Lq, other=0.0)
    delta = tl.load(Delta + bh.to(tl.int64) * Lq + m, mask=m < Lq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(Lk, start_m + BLOCK_M) if CAUSAL else Lk
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + dn
        kv_mask = (n[None, :] < Lk) & (d[:, None] < D)
        kt = tl.load(K + n[None, :] * skn + d[:, None] * skd, mask=kv_mask, other=0.0).to(DOT)
        vt = tl.load(V + n[None, :] * svn + d[:, None] * svd, mask=kv_mask, other=0.0).to(DOT)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        valid = (m[:, None] < Lq) & (n[None, :] < Lk)
        if CAUSAL:
            valid = valid & (n[None, :] <= m[:, None])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(Q.dtype.element_ty).to(DOT), tl.trans(kt), input_precision=PRECISION)
    dq *= scale
    tl.store(DQ + b * sdqb + h * sdqh + m[:, None] * sdqm + d[None, :] * sdqd,
             dq.to(DQ.dtype.element_ty), mask=q_mask)


def flash_attention_forward(q, k, v, is_causal, scale=None):
    """-> (out [B, H, Lq, D] in q's dtype, lse [B, H, Lq] fp32, natural log)."""
    B, H, Lq, D = q.shape
    Lk, G = k.shape[2], H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty((B, Lq, H), dtype=torch.float32, device=q.device).transpose(1, 2)
    cfg = _config(q, k)
    grid = (triton.cdiv(Lq, cfg["BLOCK_M"]), B * H)
    _attn_fwd[grid](q, k, v, out, lse, scale, *q.stride(), *k.stride(), *v.stride(),
                    *out.stride(), *lse.stride(), H, G, Lq, Lk, D, CAUSAL=bool(is_causal), **cfg)
    return out, lse


def flash_attention_backward(grad_out, q, k, v, out, lse, is_causal, scale=None):
    """-> (dq, dk, dv), shaped like q, k, v and laid out as [B, L, H, D] like ATen's CPU op."""
    B, H, Lq, D = q.shape
    Lk, G = k.shape[2], H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cfg = _config(q, k)
    bm, bn, bd = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"]
    delta = torch.empty((B * H, Lq), dtype=torch.float32, device=q.device)
    _attn_bwd_delta[(triton.cdiv(Lq, bm), B * H)](out, grad_out, delta, *out.stride(),
                                                  *grad_out.stride(), H, Lq, D,
                                                  BLOCK_M=bm, BLOCK_D=bd)
    dq, dk, dv = (torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device)
                  for t in (q, k, v))
    common = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *lse.stride())
    _attn_bwd_dkdv[(triton.cdiv(Lk, bn), B * (H // G))](
        q, k, v, grad_out, lse, delta, dk, dv, scale, *common, *dk.stride(), *dv.stride(),
        H, G, Lq, Lk, D, CAUSAL=bool(is_causal), **cfg)
    _attn_bwd_dq[(triton.cdiv(Lq, bm), B * H)](
        q, k, v, grad_out, lse, delta, dq, scale, *common, *dq.stride(), H, G, Lq, Lk, D,
        CAUSAL=bool(is_causal), **cfg)
    return dq, dk, dv

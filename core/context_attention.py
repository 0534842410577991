"""Causal attention of one rank's chunk of the sequence against the whole sequence (Plan.cp).

Under context parallelism rank r of the cp group holds queries [r L, (r+1) L) of a sequence
of cp * L tokens and the keys/values of all of it (all-gathered). SDPA's `is_causal` masks
as if the queries started at position 0, so the chunk needs its own mask: query i sees key
j <= r L + i. Keys past (r+1) L are masked for every query of the chunk, so they are left
out of the kernel (rank r computes r + 1 blocks of keys, not cp). One custom op for the
forward and one for the backward (the rank read from the group at run time), so one graph
serves every rank, as fxpar::local_chunk does.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _rank(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name).rank()


def _prefix_and_mask(q, k, group_name):
    """How many keys the chunk sees and its additive mask [L, that many] (q's dtype)."""
    L, rank = q.shape[2], _rank(group_name)
    start = rank * L
    keys = min(start + L, k.shape[2])
    seen = torch.arange(keys, device=q.device)[None, :] <= (
        start + torch.arange(L, device=q.device))[:, None]
    mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device)
    return keys, mask.masked_fill_(~seen, float("-inf"))


@torch.library.custom_op("fxpar::causal_chunk_attention", mutates_args=())
def causal_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                           scale: float | None, group_name: str
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of this rank's queries `q` [B, H, L, D] against the whole `k`, `v`
    [B, H, cp * L, D], causally (CPU's flash kernel, as the traced op)."""
    keys, mask = _prefix_and_mask(q, k, group_name)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k[:, :, :keys], v[:, :, :keys], dropout_p, False, attn_mask=mask, scale=scale)
    return out.contiguous(), lse.contiguous()


@causal_chunk_attention.register_fake
def _(q, k, v, dropout_p, scale, group_name):
    B, H, L, _ = q.shape
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty((B, H, L), dtype=torch.float32)


@torch.library.custom_op("fxpar::causal_chunk_attention_backward", mutates_args=())
def causal_chunk_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                    dropout_p: float, scale: float | None, group_name: str
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v): grad_k/grad_v cover the whole sequence (zero past the keys
    this chunk sees); each rank's are its share of a sum over the cp group."""
    keys, mask = _prefix_and_mask(q, k, group_name)
    gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k[:, :, :keys], v[:, :, :keys], out, lse, dropout_p, False,
        attn_mask=mask, scale=scale)
    pad = k.shape[2] - keys
    if pad:
        gk = torch.nn.functional.pad(gk, (0, 0, 0, pad))
        gv = torch.nn.functional.pad(gv, (0, 0, 0, pad))
    return gq.contiguous(), gk.contiguous(), gv.contiguous()


@causal_chunk_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, dropout_p, scale, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous

"""Context parallelism's rank-dependent ops (Plan.cp): its load-balanced layout of a split
dimension and causal attention of a rank's queries against the whole sequence.

Layout: a dim split over the cp group is cut into 2 cp chunks and rank r holds chunks r and
2cp-1-r (a front and a back one), so that under a causal mask every rank's queries read as
many keys (a contiguous split leaves the last rank the whole prefix). fxpar::zigzag_chunk
takes a rank's pair of a whole tensor, fxpar::zigzag_order reorders a whole dim between
that rank-major order (what gathering the ranks' pieces in rank order gives, and what a
reduce-scatter splits into contiguous pieces) and the natural one. Every split over the cp
group uses this layout (core/sharding.redistribute): ops that treat positions alike do not
see it, and the attention below reads its queries' positions from it.

Attention: rank r's queries are its two chunks; the keys/values are whole (all-gathered).
SDPA's `is_causal` masks as if the queries started at position 0, so each chunk (starting at
position p) runs as two blocks: the keys before p, unmasked, and its own keys, causal (they
start where its queries do), merged by their logsumexps as ring attention merges blocks;
the keys after it are never read. Every rank computes 1/cp of the causal attention.
Custom ops read the rank from the group at run time, so one graph serves every rank, as
fxpar::local_chunk does. Ring attention (below) reads the same chunks without gathering.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _rank(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name).rank()


def rank_major(n: int) -> list[int]:
    """The 2n chunks in the order the ranks hold them: 0, 2n-1, 1, 2n-2, ..."""
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


@torch.library.custom_op("fxpar::zigzag_chunk", mutates_args=())
def zigzag_chunk(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """This rank's two chunks (r and 2n-1-r of 2n) of a whole tensor along `dim`."""
    r, n = _rank(group_name), group_size
    parts = x.chunk(2 * n, dim)
    return torch.cat([parts[r], parts[2 * n - 1 - r]], dim).contiguous()


@zigzag_chunk.register_fake
def _(x, dim, group_size, group_name):
    shape = list(x.shape)
    shape[dim] //= group_size
    return x.new_empty(shape)


@torch.library.custom_op("fxpar::zigzag_order", mutates_args=())
def zigzag_order(x: torch.Tensor, dim: int, group_size: int, group_name: str,
                 to_ranks: bool) -> torch.Tensor:
    """`x` reordered along `dim` from the natural order to the ranks' (to_ranks) or back.
    (`group_name` names the group whose layout it is; the order needs only its size.)"""
    order = rank_major(group_size)
    if not to_ranks:
        order = [order.index(c) for c in range(len(order))]
    return torch.cat([x.chunk(len(order), dim)[c] for c in order], dim).contiguous()


@zigzag_order.register_fake
def _(x, dim, group_size, group_name, to_ranks):
    return x.new_empty(x.shape)


# the ops that cut a whole value into a rank's chunks or reorder a gathered one
REORDERS = frozenset({torch.ops.fxpar.zigzag_chunk.default,
                      torch.ops.fxpar.zigzag_order.default})


def _chunks(q, k, group_name):
    """[(query slice, first position)] of this rank's two chunks (q holds chunks r and
    2n-1-r of the 2n of k's length)."""
    C, r = q.shape[2] // 2, _rank(group_name)
    n = k.shape[2] // (2 * C)
    return [(slice(0, C), r * C), (slice(C, 2 * C), (2 * n - 1 - r) * C)]


def _flash(q, k, v, dropout_p, causal, scale):
    """(out, logsumexp) by the device's flash kernel (on CUDA without dropout: its random
    state is not kept for the backward)."""
    if q.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, causal,
                                                                scale=scale)
    _no_dropout(dropout_p)
    # (contiguous operands: torch's own ring attention found a strided key or logsumexp
    # slice gives wrong results in CUDA's kernels)
    q, k, v = (t.contiguous() for t in (q, k, v))
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                    scale=scale)[:2]


def _flash_backward(grad_out, q, k, v, out, lse, dropout_p, causal, scale):
    """(grad_q, grad_k, grad_v) by the device's flash kernel, from `out` and `lse` (the whole
    row's, where the block is one of several: its gradients are then the row's share)."""
    if q.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, dropout_p, causal, scale=scale)
    _no_dropout(dropout_p)
    # (no dense sequence offsets; the random state, read only with dropout, as the
    # forward's shapes; every operand contiguous, as in `_flash`: a chunk's slice of the
    # logsumexp is strided)
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    grad_out, q, k, v, out, lse = (t.contiguous() for t in (grad_out, q, k, v, out, lse))
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed,
        offset, scale=scale)


def _no_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError(
            f"fxpar's split flash attention on CUDA runs without dropout (dropout_p="
            f"{dropout_p}): the kernel's random state is not carried to the backward. Set "
            "the model's attention dropout to 0, or use cp=1.")


# (argument names as the kernels': the sharding rules read them by name)
@torch.library.custom_op("fxpar::flash_attention", mutates_args=())
def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    dropout_p: float, is_causal: bool, scale: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp): CUDA's flash attention as the context-parallel pass reads it, the
    same arguments and results as the CPU's kernel on either device
    (passes/context_parallel.portable_flash), so one rule splits both."""
    out, lse = _flash(query, key, value, dropout_p, is_causal, scale)
    return out.contiguous(), lse.contiguous()


@flash_attention.register_fake
def _(query, key, value, dropout_p, is_causal, scale):
    B, H, L, _ = query.shape
    return (query.new_empty((B, H, L, value.shape[3])),
            query.new_empty((B, H, L), dtype=_lse_dtype(query)))


@torch.library.custom_op("fxpar::flash_attention_backward", mutates_args=())
def flash_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                             dropout_p: float, is_causal: bool, scale: float | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fxpar::flash_attention's gradients (grad_q, grad_k, grad_v)."""
    return tuple(g.contiguous() for g in _flash_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale))


@flash_attention_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


@torch.library.custom_op("fxpar::causal_chunk_attention", mutates_args=())
def causal_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                           scale: float | None, group_name: str
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of this rank's queries `q` [B, H, 2C, D] (its chunks r and 2n-1-r)
    against the whole `k`, `v` [B, H, 2nC, D], causally. Per chunk starting at p: the
    keys before it unmasked, its own C keys causal (SDPA's mask is right there: they start
    where the queries do), merged by their logsumexps as ring attention merges blocks; so
    each rank computes 1/n of the sequence's causal attention (the device's flash kernel:
    the CPU's, or CUDA's without dropout)."""
    outs, lses = [], []
    for sl, p in _chunks(q, k, group_name):
        qc, C = q[:, :, sl], sl.stop - sl.start
        out, lse = _flash(qc, k[:, :, p:p + C], v[:, :, p:p + C], dropout_p, True, scale)
        if p:
            o1, l1 = _flash(qc, k[:, :, :p], v[:, :, :p], dropout_p, False, scale)
            out, lse = _merge(o1, l1, out, lse)
            out = out.to(q.dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2).contiguous(), torch.cat(lses, 2).contiguous()


@causal_chunk_attention.register_fake
def _(q, k, v, dropout_p, scale, group_name):
    B, H, L, _ = q.shape
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty((B, H, L), dtype=_lse_dtype(q))


@torch.library.custom_op("fxpar::causal_chunk_attention_backward", mutates_args=())
def causal_chunk_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                    dropout_p: float, scale: float | None, group_name: str
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v): grad_k/grad_v cover the whole sequence (zero past the keys
    this rank's chunks see); each rank's are its share of a sum over the cp group."""
    dqs = []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for sl, p in _chunks(q, k, group_name):
        qc, C = q[:, :, sl], sl.stop - sl.start
        # each block's backward with the merged output and logsumexp (its softmax is the
        # whole row's): the blocks' gradients are then the whole row's, summed
        args = (grad_out[:, :, sl], qc)
        rest = (out[:, :, sl], lse[:, :, sl], dropout_p)
        gq, gk, gv = _flash_backward(*args, k[:, :, p:p + C], v[:, :, p:p + C], *rest, True,
                                     scale)
        dk[:, :, p:p + C] += gk
        dv[:, :, p:p + C] += gv
        if p:
            g1, gk, gv = _flash_backward(*args, k[:, :, :p], v[:, :, :p], *rest, False, scale)
            gq = gq + g1
            dk[:, :, :p] += gk
            dv[:, :, :p] += gv
        dqs.append(gq)
    return torch.cat(dqs, 2).contiguous(), dk, dv


@causal_chunk_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, dropout_p, scale, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous


# --- ring attention: the keys and values passed around the group, never gathered ---------
# Rank r's queries (chunks r and 2n-1-r) meet every rank's keys/values (chunks s and 2n-1-s)
# as those go around the ring: n steps of kernels, the first on the rank's own block, and
# before each of the first n-1 the block in hand starts on its way to rank r+1 while rank
# r-1's comes in (torch.distributed's send/recv, beside the kernels); the blocks' results
# merged by their logsumexps. A rank holds its own block, the one it computes on and the
# one arriving: not the whole keys/values that ring attention exists to avoid at long
# sequences. In the backward the blocks go around again, each with its keys' and values'
# gradients accumulating as it travels (float32; float64 for float64 inputs); after the
# last step each reaches its owner complete. Every rank of the group must choose ring
# attention for the same attentions (a rank gathering while another sends would hang):
# the pass decides from global shapes and a fixed device profile, alike on every rank.
# Causal, the pairs balance as in the chunk attention above: the rank's own block is two
# causal pairs and a full one, every other block two full pairs (s < r: both query chunks
# against chunk s; s > r: the back query chunk against both), the rest never computed.

_RING_TAGS = {"k": 11, "v": 12, "dk": 13, "dv": 14}  # (gloo matches a receive by its tag)


def _ring(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name)
    return pg, pg.rank(), pg.size()


def _pass_on(tensors: dict, pg, r: int, n: int):
    """Start sending `tensors` to the next rank of the ring and receiving their likes from
    the previous one: -> (the receive buffers by name, what `_wait` takes: the works and
    the tensors sent, held until they are done)."""
    import torch.distributed as dist
    sent = {name: t.contiguous() for name, t in tensors.items()}
    got = {name: torch.empty_like(t) for name, t in sent.items()}
    nxt, prev = (dist.get_global_rank(pg, (r + d) % n) for d in (1, -1))
    ops = [dist.P2POp(dist.isend, t, nxt, pg, _RING_TAGS[name]) for name, t in sent.items()]
    ops += [dist.P2POp(dist.irecv, b, prev, pg, _RING_TAGS[name]) for name, b in got.items()]
    return got, (dist.batch_isend_irecv(ops), sent)


def _wait(pending) -> None:
    for w in pending[0] if pending else ():
        w.wait()


def _ring_pairs(r: int, s: int, n: int, C: int, causal: bool):
    """[(query slice, key slice, causal)] of rank r's queries against rank s's block (both
    a front and a back chunk of C positions; non-causal: the whole block at once)."""
    both = slice(0, 2 * C)
    if not causal:
        return [(both, both, False)]
    front, back = slice(0, C), slice(C, 2 * C)
    if s == r:  # its own chunks: each causal on itself, the back one reads the front whole
        return [(front, front, True), (back, front, False), (back, back, True)]
    if s < r:  # chunk s precedes both of r's; chunk 2n-1-s follows both
        return [(both, front, False)]
    return [(back, both, False)]  # chunks s and 2n-1-s both precede r's back chunk only


@torch.library.custom_op("fxpar::ring_attention", mutates_args=())
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   is_causal: bool, scale: float | None, group_name: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of this rank's queries `q` [B, H, 2C, D] against the whole
    sequence's keys/values, of which this rank holds `k`, `v` [B, H, 2C, D] (the same
    chunks as its queries); the others' pass by around the group."""
    pg, r, n = _ring(group_name)
    C, acc = q.shape[2] // 2, _lse_dtype(q)
    out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=acc)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)
    block = {"k": k, "v": v}
    for step in range(n):
        s = (r - step) % n
        nxt, pending = _pass_on(block, pg, r, n) if step < n - 1 else (None, None)
        for qs, ks, causal in _ring_pairs(r, s, n, C, is_causal):
            o, l = _flash(q[:, :, qs], block["k"][:, :, ks], block["v"][:, :, ks], dropout_p,
                          causal, scale)
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o, l)
        _wait(pending)
        block = nxt
    return out.to(q.dtype), lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Two attentions of the same queries over disjoint keys as one: each weighted by its
    share of the merged logsumexp, in the logsumexp's dtype (float32, float64 for float64
    queries). A block with no key yet (lse -inf, out 0) adds nothing."""
    merged = torch.logaddexp(lse_a, lse_b)
    out = (out_a.to(merged.dtype) * (lse_a - merged).exp()[..., None]
           + out_b.to(merged.dtype) * (lse_b - merged).exp()[..., None])
    return out, merged


def _lse_dtype(q):
    """The logsumexp's dtype (the flash kernels': float32, float64 for float64 queries),
    in which the blocks' results are merged."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@ring_attention.register_fake
def _(q, k, v, dropout_p, is_causal, scale, group_name):
    B, H, L, _ = q.shape
    return q.new_empty((B, H, L, v.shape[3])), q.new_empty((B, H, L), dtype=_lse_dtype(q))


@torch.library.custom_op("fxpar::ring_attention_backward", mutates_args=())
def ring_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            dropout_p: float, is_causal: bool, scale: float | None,
                            group_name: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v) of fxpar::ring_attention, each of this rank's chunks: the
    keys' and values' complete (every rank's queries' share summed on the way round)."""
    pg, r, n = _ring(group_name)
    C = q.shape[2] // 2
    acc_dtype = _lse_dtype(q)
    dq = torch.zeros_like(q, dtype=acc_dtype)
    block, acc, acc_pending = {"k": k, "v": v}, None, None
    for step in range(n):
        s = (r - step) % n
        nxt, pending = _pass_on(block, pg, r, n) if step < n - 1 else (None, None)
        dk = torch.zeros_like(block["k"], dtype=acc_dtype)
        dv = torch.zeros_like(block["v"], dtype=acc_dtype)
        for qs, ks, causal in _ring_pairs(r, s, n, C, is_causal):
            # (with the merged out and logsumexp: each block's gradients are its share of
            # the whole row's, as in the chunk attention's backward)
            gq, gk, gv = _flash_backward(grad_out[:, :, qs], q[:, :, qs], block["k"][:, :, ks],
                                         block["v"][:, :, ks], out[:, :, qs], lse[:, :, qs],
                                         dropout_p, causal, scale)
            dq[:, :, qs] += gq
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
        _wait(acc_pending)  # what the ranks before added to this block's gradients
        if acc is not None:
            dk, dv = dk + acc["dk"], dv + acc["dv"]
        # on to the next rank (after the last step: the block's owner, rank r + 1)
        acc, acc_pending = _pass_on({"dk": dk, "dv": dv}, pg, r, n)
        _wait(pending)
        block = nxt
    _wait(acc_pending)
    return dq.to(q.dtype), acc["dk"].to(k.dtype), acc["dv"].to(v.dtype)


@ring_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, dropout_p, is_causal, scale, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# the ops that exchange tensors with the group's other ranks inside (not graph collectives:
# codegen runs them outside compiled regions, a CUDA graph does not capture them)
RING = frozenset({torch.ops.fxpar.ring_attention.default,
                  torch.ops.fxpar.ring_attention_backward.default})
# the kernels `_flash` runs for a ring step, as the graph names them (CUDA's flash made
# fxpar::flash_attention first): one the cp pass leaves under "ring" was never split
RING_KERNELS = frozenset({torch.ops.fxpar.flash_attention.default} | (
    {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") else set()))

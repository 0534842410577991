"""1-bit Adam (Plan.grad_compression="1bit-adam"; Tang et al. 2021, DeepSpeed's OneBitAdam).

Adam's second moment settles early in training while its momentum keeps moving, so after
`warmup` steps of the user's own Adam (exact: the graph all-reduces the gradients) the
second moment is frozen and the ranks stop all-reducing gradients. Each rank then runs the
program's local graph (its own Partial sum g_r of the batch's gradient), folds dp * g_r into
its copy of the momentum, and the momenta are averaged over the dp group at one bit a value:
  1. each rank adds the error it carried from the last step to its momentum and sends the
     sign of each value plus one scale per block of BLOCK values, keeping what that lost as
     its next error;
  2. all-to-all: rank k receives every rank's bits for the k-th 1/dp of the blocks, averages
     them, adds its own carried server error and compresses the average the same way;
  3. all-gather: every rank receives every rank's compressed part of the average.
The result is bit for bit the same on every rank and becomes Adam's momentum; the update is
torch's Adam / AdamW formula with the frozen second moment (and its bias correction frozen
with it), so the parameters stay equal on every rank. One departure from DeepSpeed: what is
compressed is the momentum divided by Adam's (frozen, rank-independent) denominator, so each
value's compression error is on the scale of its own step; compressing the momentum itself,
a value whose second moment is tiny beside its block's (an attention key's bias, whose true
gradient is zero) takes steps of lr * block scale / eps, which diverged the example GPT.
On the wire: (1/8 + 4/BLOCK) bytes a value in each of the two collectives, against 2 * 4
for a ring all-reduce of fp32.

State: Adam's own (exp_avg, exp_avg_sq, step) lives in the user's optimizer, which
checkpoints save. The error buffers are not saved: as in DeepSpeed they restart at zero
after a load (a resumed run under another dp would cut them differently). A parameter whose
momentum is exactly zero for good is not representable by signs; parameters without a
gradient (frozen, unused) are left out, as torch's Adam leaves them.
"""
from __future__ import annotations

import math

import torch

from fxpar.core import quantized_comm as qcomm
from fxpar.core.errors import FxparError, PlanError
from fxpar.runtime import comm

BLOCK = qcomm.ONEBIT_BLOCK  # values sharing one scale (a multiple of 8: whole bytes of signs)
_ROW = BLOCK // 8 + 4  # one block on the wire: its sign bits, then its fp32 scale


def check_optimizer(opt) -> None:
    """1-bit Adam steps torch's Adam / AdamW formula itself: refuse anything else by name."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        raise PlanError(
            f"Plan.grad_compression='1bit-adam' compresses Adam's momentum and freezes its "
            f"second moment: the optimizer must be torch.optim.Adam or AdamW, got "
            f"{type(opt).__name__}. Pass e.g. `optimizer=lambda ps: torch.optim.AdamW(ps, "
            f"lr=1e-3)`, or use grad_compression='none'.")


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """(..., BLOCK) float -> (..., BLOCK/8) uint8: bit i of byte j is set where x[8j + i]
    is positive (its sign bit clear: +0.0 positive, -0.0 negative, as torch.copysign)."""
    bits = (~torch.signbit(x)).view(*x.shape[:-1], -1, 8).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(
        -1, dtype=torch.uint8)


def unpack_signs(b: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 8n) float32 of +1 / -1 (the inverse of pack_signs)."""
    bits = (b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=b.device)) & 1
    return bits.flatten(-2).to(torch.float32).mul_(2).sub_(1)


class Blocks:
    """Where a flat vector of blocks holds padding (the tail of a tensor's last block, whole
    blocks after the last tensor): `counts` (k,) real values per block; `padding` the flat
    positions of the rest (kept at zero); `rms` turns a block's norm into its root mean
    square over its real values."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts
        pos = torch.arange(BLOCK, device=counts.device)
        self.padding = (pos >= counts[:, None]).view(-1).nonzero().view(-1)
        self.rms = counts.clamp(min=1).rsqrt()[:, None]

    def part(self, i: int, n: int) -> "Blocks":
        """The blocks of the i-th of n equal parts (made once)."""
        if getattr(self, "_part", (None,))[0] != (i, n):
            self._part = ((i, n), Blocks(self.counts.view(n, -1)[i]))
        return self._part[1]


def compress(x: torch.Tensor, error: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """(k * BLOCK,) values -> (k, _ROW) uint8 rows (signs, then the block's scale). `error`
    (like x) holds what the last call lost: x is added to it, then it keeps what this call
    loses. The scale is the block's root mean square over its real values, as DeepSpeed's:
    it keeps the carried error bounded under a steady input, where the mean |x| (the
    least-squares scale) lets it grow as the square root of the steps."""
    v = error.add_(x).view(-1, BLOCK)
    scale = torch.linalg.vector_norm(v, dim=1, keepdim=True).mul_(blocks.rms)
    rows = torch.cat([pack_signs(v), scale.view(torch.uint8)], 1)
    v.sub_(torch.copysign(scale.expand_as(v), v))
    error[blocks.padding] = 0.0
    return rows


def decompress(rows: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """(..., k, _ROW) uint8 rows -> (..., k * BLOCK) float32: sign * scale, padding 0."""
    scale = rows[..., BLOCK // 8:].contiguous().view(torch.float32)
    out = unpack_signs(rows[..., :BLOCK // 8]).mul_(scale).flatten(-2)
    out[..., blocks.padding] = 0.0
    return out


def compressed_mean(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                    blocks: Blocks, dp: int, rank: int, group_name: str) -> torch.Tensor:
    """The mean over the dp group (this rank `rank` of it) of every rank's `x` ((k * BLOCK,)
    fp32, k a multiple of dp; `blocks` says where its padding is), sent at one bit a value
    with error feedback on both sides (`worker_error` like x, `server_error` 1/dp of it,
    updated in place); the same tensor on every rank."""
    k = x.numel() // BLOCK
    rows = compress(x, worker_error, blocks).view(-1)
    part = k // dp * _ROW
    got = comm.wait(comm.start_all_to_all(rows, [part] * dp, [part] * dp, group_name,
                                          "all_to_all momentum (1-bit Adam)"))
    mine = blocks.part(rank, dp)
    mean = decompress(got.view(dp, k // dp, _ROW), mine).mean(0)
    every = comm.wait(comm.start_all_gather(compress(mean, server_error, mine).view(-1), dp,
                                            group_name, "all_gather momentum (1-bit Adam)"))
    return decompress(every.view(k, _ROW), blocks)


class OneBitAdam:
    """1-bit Adam after the warm-up over the user's Adam / AdamW (`optimizer`, which steps
    the warm-up itself). `step(optimizer, params, grads, n)` is fxpar step n (> warmup): with
    this rank's local gradients (Partial sums over `dp` ranks) where `compressing(n)`, else
    (a refresh step) with the all-reduced gradients.

    The second moment is refreshed at steps warmup * 2, * 4, * 8, ... (0/1 Adam's policy,
    Lu et al. 2022): those steps all-reduce the gradients in full precision and update both
    moments exactly. A second moment frozen for good is too small once the gradients grow
    (a loss leaving a plateau): on the example GPT 4x256 at lr 3e-3 with a 40-step warm-up,
    Adam with the frozen second moment and the exact momentum mean rose from step 120 to
    1.31x AdamW's loss at step 200 (benchmarks/onebit_adam.py)."""

    def __init__(self, optimizer, warmup: int, dp: int, rank: int, group_name: str):
        check_optimizer(optimizer)
        self.warmup, self.dp, self.rank, self.group_name = warmup, dp, rank, group_name
        self._layout: tuple | None = None  # (ids of the tensors stepped, their offsets)
        self.worker_error = self.server_error = None
        self._denominators: dict = {}  # id(tensor) -> (what it was made from, Adam's denominator)

    def compressing(self, n: int) -> bool:
        """Whether fxpar step n (1-based) runs compressed (past the warm-up, not a refresh)."""
        return n > self.warmup and not self.refreshing(n)

    def refreshing(self, n: int) -> bool:
        """Whether step n refreshes the second moment: n = warmup * 2^j, j >= 1."""
        q, r = divmod(n, self.warmup)
        return r == 0 and q >= 2 and q & (q - 1) == 0

    def variance_steps(self, n: int) -> int:
        """Steps 1..n that updated the second moment: the warm-up's and the refreshes'."""
        q = n // self.warmup
        return min(n, self.warmup) + (q.bit_length() - 1 if q >= 2 else 0)

    def reset(self) -> None:
        """Forget the carried errors (after a checkpoint load)."""
        self._layout = None
        self.worker_error = self.server_error = None
        self._denominators = {}

    def _flat_layout(self, stepped: list[torch.Tensor]):
        """Each tensor's offset in the flat momentum, padded to whole blocks (no block spans
        two tensors: its scale fits one), the blocks padded to a multiple of dp; the error
        buffers (re)made when the set of tensors changes."""
        ids = tuple(id(p) for p in stepped)
        if self._layout is None or self._layout[0] != ids:
            offsets, n = [], 0
            for p in stepped:
                offsets.append(n)
                n += -(-p.numel() // BLOCK) * BLOCK
            n += -(n // BLOCK) % self.dp * BLOCK
            dev = stepped[0].device
            counts = torch.zeros(n // BLOCK, device=dev)
            for p, off in zip(stepped, offsets):
                full, rest = divmod(p.numel(), BLOCK)
                counts[off // BLOCK:off // BLOCK + full] = BLOCK
                if rest:
                    counts[off // BLOCK + full] = rest
            self.worker_error = torch.zeros(n, device=dev)
            self.server_error = torch.zeros(n // self.dp, device=dev)
            self._denominators = {}
            self._layout = (ids, offsets, n, Blocks(counts))
        return self._layout[1:]

    @torch.no_grad()
    def step(self, optimizer, params, grads, n: int, names=None) -> None:
        """`names`: each parameter's name (for errors)."""
        check_optimizer(optimizer)  # (pm.optimizer may have been replaced)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        keep = [i for i, (p, g) in enumerate(zip(params, grads))
                if g is not None and id(p) in group_of]
        for i in keep:
            if "exp_avg_sq" not in optimizer.state.get(params[i], {}):
                name = names[i] if names else f"a tensor of shape {tuple(params[i].shape)}"
                raise FxparError(
                    f"1-bit Adam at step {n}: {name} got its first gradient after the "
                    f"{self.warmup}-step warm-up, so it has no second moment to freeze. "
                    "Raise Plan.compression_warmup past the step where it starts training.")
        if not keep:
            return
        pairs = [(params[i], grads[i]) for i in keep]
        exact = not self.compressing(n)
        compressed_before = n - 1 - self.variance_steps(n - 1)
        moved = []  # (p, Adam's denominator, what the ranks average: the momentum over it)
        for p, g in pairs:
            group, state = group_of[id(p)], optimizer.state[p]
            beta1, beta2 = group["betas"]
            d = g.to(torch.float32) * (1 if exact else self.dp)  # (Partial sums: * dp, the
            if group["maximize"]:  # ranks' mean of these is the gradient)
                d = -d
            if group["weight_decay"] and type(optimizer) is torch.optim.Adam:  # L2
                d = d.add(p.to(torch.float32), alpha=group["weight_decay"])
            v_steps = float(state["step"]) - compressed_before  # steps that moved v
            if exact:
                state["exp_avg_sq"].mul_(beta2).addcmul_(d, d, value=1 - beta2)
                if group["amsgrad"]:
                    torch.maximum(state["max_exp_avg_sq"], state["exp_avg_sq"],
                                  out=state["max_exp_avg_sq"])
                v_steps += 1
            key = (v_steps, group["eps"], beta2)  # v and its bias correction are frozen
            denom = self._denominators.get(id(p))  # between refreshes: the same denominator
            if denom is None or denom[0] != key:
                v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
                denom = self._denominators[id(p)] = (
                    key, (v.sqrt() / math.sqrt(1 - beta2 ** max(v_steps, 1.0))).add_(
                        group["eps"]))
            # what is averaged is the momentum over Adam's denominator (the same on every
            # rank, so the mean commutes with it): one sign and block scale then err on the
            # scale of each value's step, not of its block's largest momenta - a value whose
            # v is tiny beside its neighbours' (an attention key's bias) would otherwise take
            # steps of lr * block scale / eps
            moved.append((p, denom[1], torch.lerp(d, state["exp_avg"].to(torch.float32),
                                                  beta1).div_(denom[1])))
        if exact:
            steps = [u for _, _, u in moved]
        else:
            stepped = [p for p, _ in pairs]
            offsets, size, blocks = self._flat_layout(stepped)
            flat = torch.zeros(size, device=stepped[0].device)
            for (p, _, u), off in zip(moved, offsets):
                flat[off:off + p.numel()] = u.view(-1)
            mean = compressed_mean(flat, self.worker_error, self.server_error, blocks,
                                   self.dp, self.rank, self.group_name)
            steps = [mean[off:off + p.numel()].view_as(p) for p, off in zip(stepped, offsets)]
        for (p, denom, _), step in zip(moved, steps):
            group, state = group_of[id(p)], optimizer.state[p]
            lr, wd = float(group["lr"]), group["weight_decay"]
            torch.mul(step, denom, out=state["exp_avg"])
            if isinstance(state["step"], torch.Tensor):
                state["step"].add_(1)
            else:
                state["step"] = float(state["step"]) + 1
            if wd and type(optimizer) is torch.optim.AdamW:
                p.mul_(1 - lr * wd)
            p.add_(step, alpha=-lr / (1 - group["betas"][0] ** float(state["step"])))

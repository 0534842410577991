"""1-bit Adam (Plan.grad_compression="1bit-adam"; Tang et al. 2021, DeepSpeed's OneBitAdam).

Adam's second moment settles early in training while its momentum keeps moving, so after
`warmup` steps of the user's own Adam (exact: the graph all-reduces the gradients) the
second moment is frozen and the ranks stop all-reducing gradients. Each rank then runs the
program's local graph (its own Partial sum g_r of the batch's gradient), folds dp * g_r into
its copy of the momentum, and the momenta are averaged over the dp group at one bit a value:
  1. each rank adds the error it carried from the last step to its momentum and sends the
     sign of each value plus one scale per block of BLOCK values (the block's mean |x|: the
     scale that minimises the squared error of scale * sign), keeping what that lost as its
     next error;
  2. all-to-all: rank k receives every rank's bits for the k-th 1/dp of the blocks, averages
     them, adds its own carried server error and compresses the average the same way;
  3. all-gather: every rank receives every rank's compressed part of the average.
The result is bit for bit the same on every rank and becomes Adam's momentum; the update is
torch's Adam / AdamW formula with the frozen second moment (and its bias correction frozen
with it), so the parameters stay equal on every rank. On the wire: (1/8 + 4/BLOCK) bytes a
value in each of the two collectives, against 2 * 4 for a ring all-reduce of fp32.

State: Adam's own (exp_avg, exp_avg_sq, step) lives in the user's optimizer, which
checkpoints save. The error buffers are not saved: as in DeepSpeed they restart at zero
after a load (a resumed run under another dp would cut them differently). A parameter whose
momentum is exactly zero for good is not representable by signs; parameters without a
gradient (frozen, unused) are left out, as torch's Adam leaves them.
"""
from __future__ import annotations

import logging
import math

import torch

from fxpar.compiler.errors import FxparError, PlanError
from fxpar.runtime import comm

log = logging.getLogger(__name__)

BLOCK = 256  # values sharing one scale (a multiple of 8: whole bytes of signs)
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
    """(..., BLOCK) float -> (..., BLOCK/8) uint8: bit i of byte j is x[8j + i] >= 0."""
    bits = (x >= 0).view(*x.shape[:-1], -1, 8).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(
        -1, dtype=torch.uint8)


def unpack_signs(b: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 8n) float32 of +1 / -1 (the inverse of pack_signs)."""
    bits = (b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=b.device)) & 1
    return bits.flatten(-2).to(torch.float32).mul_(2).sub_(1)


def _mask(valid: torch.Tensor) -> torch.Tensor:
    """(k,) counts of real values per block -> (k, BLOCK) 1.0 where a value is real."""
    return (torch.arange(BLOCK, device=valid.device) < valid[:, None]).to(torch.float32)


def compress(x: torch.Tensor, error: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(k * BLOCK,) values -> (k, _ROW) uint8 rows (signs, then the block's scale). `error`
    (like x) holds what the last call lost: it is added first, then replaced by what this
    one loses. `valid` (k,): how many values of each block are real (the rest is padding,
    kept at zero). The scale is the block's root mean square, as DeepSpeed's: it keeps the
    carried error bounded under a steady input, where the mean |x| (the least-squares
    scale) lets it grow as the square root of the steps."""
    x = x.add(error).view(-1, BLOCK)
    scale = (x.square().sum(1, keepdim=True) / valid[:, None].clamp(min=1)).sqrt()
    error.copy_((x - torch.where(x >= 0, scale, -scale) * _mask(valid)).view(-1))
    return torch.cat([pack_signs(x), scale.view(torch.uint8)], 1)


def decompress(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(..., k, _ROW) uint8 rows -> (..., k, BLOCK) float32: sign * scale (padding 0)."""
    scale = rows[..., BLOCK // 8:].contiguous().view(torch.float32)
    return unpack_signs(rows[..., :BLOCK // 8]).mul_(scale).mul_(_mask(valid))


def compressed_mean(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                    valid: torch.Tensor, dp: int, rank: int, group_name: str) -> torch.Tensor:
    """The mean over the dp group (this rank `rank` of it) of every rank's `x` ((k * BLOCK,) fp32, k a multiple of
    dp; `valid` (k,) its real values per block), sent at one bit a value with error
    feedback on both sides (`worker_error` like x, `server_error` 1/dp of it, updated in
    place); the same tensor on every rank."""
    k = x.numel() // BLOCK
    rows = compress(x, worker_error, valid).view(-1)
    part = k // dp * _ROW
    got = comm.wait(comm.start_all_to_all(rows, [part] * dp, [part] * dp, group_name,
                                          "all_to_all momentum (1-bit Adam)"))
    mine = valid.view(dp, -1)[rank]
    mean = decompress(got.view(dp, k // dp, _ROW), mine).mean(0).view(-1)
    every = comm.wait(comm.start_all_gather(compress(mean, server_error, mine).view(-1), dp,
                                            group_name, "all_gather momentum (1-bit Adam)"))
    return decompress(every.view(k, _ROW), valid).view(-1)


class OneBitAdam:
    """The compressed phase of 1-bit Adam over the user's Adam / AdamW (`optimizer`, which
    steps the warm-up itself). `step(optimizer, params, grads, n)` is fxpar step n (> warmup)
    with this rank's local gradients (Partial sums over `dp` ranks)."""

    def __init__(self, optimizer, warmup: int, dp: int, rank: int, group_name: str):
        check_optimizer(optimizer)
        self.warmup, self.dp, self.rank, self.group_name = warmup, dp, rank, group_name
        self._layout: tuple | None = None  # (ids of the tensors stepped, their offsets)
        self.worker_error = self.server_error = None

    def compressing(self, n: int) -> bool:
        """Whether fxpar step n (1-based) runs compressed."""
        return n > self.warmup

    def reset(self) -> None:
        """Forget the carried errors (after a checkpoint load)."""
        self._layout = None
        self.worker_error = self.server_error = None

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
            valid = torch.zeros(n // BLOCK, device=dev)
            for p, off in zip(stepped, offsets):
                full, rest = divmod(p.numel(), BLOCK)
                valid[off // BLOCK:off // BLOCK + full] = BLOCK
                if rest:
                    valid[off // BLOCK + full] = rest
            self.worker_error = torch.zeros(n, device=dev)
            self.server_error = torch.zeros(n // self.dp, device=dev)
            self._layout = (ids, offsets, n, valid)
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
        stepped = [p for p, _ in pairs]
        offsets, size, valid = self._flat_layout(stepped)
        flat = torch.zeros(size, device=stepped[0].device)
        for (p, g), off in zip(pairs, offsets):
            group, state = group_of[id(p)], optimizer.state[p]
            beta1 = group["betas"][0]
            d = g.to(torch.float32) * self.dp  # the ranks' mean of these is the gradient
            if group["maximize"]:
                d = -d
            if group["weight_decay"] and type(optimizer) is torch.optim.Adam:  # L2
                d = d.add(p.to(torch.float32), alpha=group["weight_decay"])
            flat[off:off + p.numel()] = torch.lerp(d.view(-1), state["exp_avg"].view(-1)
                                                   .to(torch.float32), beta1)
        mean = compressed_mean(flat, self.worker_error, self.server_error, valid, self.dp,
                               self.rank, self.group_name)
        done = n - 1 - self.warmup  # compressed steps before this one
        for (p, _), off in zip(pairs, offsets):
            group, state = group_of[id(p)], optimizer.state[p]
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            m = state["exp_avg"]
            m.copy_(mean[off:off + p.numel()].view_as(m))
            t_before = float(state["step"])
            frozen = min(max(t_before - done, 1.0), t_before)  # steps that moved v
            if isinstance(state["step"], torch.Tensor):
                state["step"].add_(1)
            else:
                state["step"] = t_before + 1
            t = t_before + 1
            if wd and type(optimizer) is torch.optim.AdamW:
                p.mul_(1 - lr * wd)
            v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** frozen)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))

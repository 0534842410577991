"""Loss scaling (fp16) and gradient clipping by global norm, across every shard of the model.

fp16 has 5 exponent bits: small gradients underflow to zero. As torch.amp.GradScaler does,
the backward runs on loss * scale (the graph's "loss_scale" input multiplies the backward's
seed; passes/precision.py), the gradients come out already divided by it in fp32, and
a step whose gradients hold an inf/NaN on ANY rank is skipped by every rank, the scale halved;
after `growth_interval` good steps in a row it doubles. The found-inf flag and the squared
gradient norm travel in one all-reduce over the whole world (dp, tp and pp ranks, ZeRO
shards), so every rank makes the same decision and clips by the same factor.

The global norm counts every gradient element of the model once: each rank sums the squares
of the gradient elements it is responsible for (`GradNormPlan`, built by the caller from the
plan: a tp-split weight's shard on every tp rank, a tp-replicated weight on tp rank 0 only, a
pipeline-tied weight on its first stage's rank only, whole gradients on dp rank 0 only, a ZeRO
shard on the rank that owns it), and the sum over the world is the single-process sum of
squares: torch.nn.utils.clip_grad_norm_'s norm, clipped with its formula
(max_norm / (norm + 1e-6), at most 1).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class GradScaler:
    """Dynamic loss scale with torch.amp.GradScaler's defaults and state_dict keys."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ValueError("GradScaler needs growth_factor > 1, 0 < backoff_factor < 1 and "
                             f"growth_interval >= 1; got {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}.")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0   # good steps in a row since the last change
        self.skipped_steps = 0    # steps skipped for inf/NaN gradients (all ranks alike)

    def scale_tensor(self, device) -> torch.Tensor:
        """The graph's loss_scale input for this step."""
        return torch.tensor(self.scale, dtype=torch.float32, device=device)

    def update(self, found_inf: bool) -> None:
        """After a step: back off (and count the skip) on inf/NaN, else maybe grow."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "_growth_tracker"} - set(state)
        if missing:
            raise KeyError(f"GradScaler state lacks {sorted(missing)}: pass a dict saved from "
                           "pm.scaler.state_dict() (or torch.amp.GradScaler.state_dict()).")
        self.scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.growth_tracker = int(state["_growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class GradNormPlan:
    """Which of this rank's gradient elements count toward the global norm: per local
    gradient True (all), False (none: another rank counts an identical copy) or a 0/1 mask
    of its shape (a ZeRO bucket shard mixing tp-split and tp-replicated weights)."""

    def __init__(self, counted: Sequence[bool | torch.Tensor]):
        self.counted = list(counted)


def grad_stats(grads: Sequence[torch.Tensor | None], norm_plan: GradNormPlan,
               need_norm: bool, group=None, device=None) -> tuple[torch.Tensor | None, bool]:
    """(global gradient norm or None, any inf/NaN on any rank): one all-reduce over `group`
    (None = the world) when there is more than one rank. `device`: where the sum lives when
    this rank has no gradient (a pipeline stage without weights): the backend's device."""
    dev = next((g.device for g in grads if g is not None), device or torch.device("cpu"))
    acc = torch.zeros(2, dtype=torch.float32, device=dev)  # [sum of squares, non-finite]
    for g, c in zip(grads, norm_plan.counted):
        if g is None:
            continue
        gf = g.float()
        acc[1] += (~torch.isfinite(gf)).sum()  # every copy: any rank's overflow counts
        if c is False or not need_norm:
            continue
        sq = gf * gf
        acc[0] += (sq if c is True else sq * c).sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(acc, group=group)
    found_inf = bool(acc[1].item() > 0)
    return (acc[0].sqrt() if need_norm else None), found_inf


def clip_(grads: Sequence[torch.Tensor | None], total_norm: torch.Tensor,
          max_norm: float) -> torch.Tensor:
    """Scale the gradients in place as torch.nn.utils.clip_grad_norm_ would; returns the
    factor used."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        if g is not None:
            g.mul_(coef.to(g.dtype))
    return coef

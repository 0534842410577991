"""Plan.verify: the first step checked against one plain process on the same batch.

fxpar promises that `pm.step` equals a step of single-process training. The passes are
tested on a zoo, but a user's model is new code: with `verify=True` (or FXPAR_VERIFY=1) the
first step also runs the user's model in plain eager PyTorch on rank 0 - the whole weights
before the step, the same global batch, the same RNG state, a fresh optimizer from the
user's factory, the plan's gradient clipping - and compares the loss and every parameter
and buffer after the step. A difference raises VerifyError on every rank, naming the first
tensor that differs. It costs one whole copy of the model's training state on rank 0 (for a
model that does not fit there, verify a copy with fewer layers: the same code).

Tolerances: a wrong shard, a missing collective or a wrong scale moves a parameter by about
its update; rounding (another order of the same sums) moves it by what rounding-sized
gradient noise does through the user's optimizer - little for SGD, up to lr for Adam on an
element whose gradient is near its eps. So the reference steps a second copy of the weights
with the gradients perturbed at rounding size (1e-4 of each element plus 1e-6 of the largest,
random signs), and each element may differ by 10x what that moved it, plus 1e-3 of the
tensor's largest update (5e-2 in bf16/fp16) and 1e-5 of its value.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fxpar.compiler.errors import PlanError, VerifyError
from fxpar.runtime import model_state, optim

NOISE_REL, NOISE_TOP, SLACK = 1e-4, 1e-6, 10.0  # the rounding-sized gradient perturbation
RTOL_UPDATE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
RTOL_LOSS = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}


def check_optimizer(optimizer) -> None:
    """The reference builds its own optimizer: it needs the factory (or None: SGD)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise PlanError("Plan.verify builds a fresh optimizer for the one-process reference "
                        "step: pass a factory, e.g. `optimizer=lambda ps: "
                        "torch.optim.AdamW(ps, lr=1e-3)`, not an instance.")


def first_step(pm, batch, loss_of, optimizer, train_step) -> torch.Tensor:
    """Run `train_step(batch)` (the plan's step) and the reference step; raise VerifyError
    where they differ. Collective: every rank calls it with the same global batch."""
    before = pm.whole_tensors()
    rank0 = pm.world.rank == 0
    rng = _rng(pm.world.device)
    loss = train_step(batch)
    after = pm.whole_tensors()
    ref = None
    if rank0:  # the reference draws the random numbers the plan's step drew
        rng_after = _rng(pm.world.device)
        _set_rng(pm.world.device, rng)
        ref = _reference(pm, before, batch, loss_of, optimizer)
        _set_rng(pm.world.device, rng_after)
    verdict = [_compare(pm.plan.precision, loss, after, *ref) if rank0 else None]
    if pm.world.size > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise VerifyError(
            f"Plan.verify: the first step under {_describe(pm.plan)} differs from one plain "
            f"process on the same batch: {verdict[0]}. This is a bug in fxpar: please report "
            "it with the model; meanwhile train this model under another plan (verify tells "
            "which plans agree), or with dropout off if the model draws random numbers "
            "(plans may draw different masks).")
    return loss


def _reference(pm, before, batch, loss_of, optimizer):
    """(loss, {name: tensor after the step}, {name: how far rounding-sized gradient noise
    moves it}, before) of one eager step of the user's model holding the whole weights
    `before`."""
    held = {n: t.detach().clone() for n, t in before.items()}
    with model_state.holding(pm.model, held) as module_tensors:
        params = {}  # each trainable tensor once (tied names share one)
        for n, t in module_tensors.items():
            if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                params.setdefault(id(t), (n, t))
        loss = loss_of(pm.model, _on(batch, pm.world.device))
        loss.backward()
        trained = [t for _, t in params.values()]
        if pm.plan.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, pm.plan.max_grad_norm)
        probes = _probe_grads(trained)
        with torch.no_grad():
            optim.build(optimizer, trained).step()
            optim.build(optimizer, probes).step()
        probe_of = {k: probe for k, probe in zip(params, probes)}
        moved = {n: (t.detach() - probe_of[id(t)].detach()).abs()  # under each tied name
                 for n, t in module_tensors.items() if id(t) in probe_of}
        after = {n: t.detach() for n, t in module_tensors.items()}
    return loss.detach(), after, moved, before


def _probe_grads(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Copies of `params` as they are before the step, each with its gradient perturbed at
    rounding size (a fixed seed: the global RNG is not touched)."""
    grads = [p.grad for p in params if p.grad is not None]
    top = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
    gen = torch.Generator(device=params[0].device if params else "cpu").manual_seed(0)
    probes = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        if p.grad is not None:
            sign = torch.randint(0, 2, p.grad.shape, generator=gen, device=p.grad.device) * 2 - 1
            q.grad = p.grad + sign * (NOISE_REL * p.grad.abs() + NOISE_TOP * top)
        probes.append(q)
    return probes


def _compare(precision, loss, after, ref_loss, ref_after, moved, before) -> str:
    """'' where the plan's step matches the reference, else what differs first."""
    rtol_loss, rtol_update = RTOL_LOSS.get(precision, 2e-2), RTOL_UPDATE.get(precision, 5e-2)
    if not torch.isclose(loss.float().cpu(), ref_loss.float().cpu(), rtol=rtol_loss, atol=1e-6):
        return f"loss {float(loss):.6g} vs {float(ref_loss):.6g}"
    for name, ref in ref_after.items():
        got = after[name].to(ref.device)
        if got.shape != ref.shape:
            return f"{name} has shape {tuple(got.shape)}, the reference's {tuple(ref.shape)}"
        if not ref.is_floating_point():
            if not torch.equal(got, ref):
                return f"{name} differs"
            continue
        got, ref, was = got.float(), ref.float(), before[name].to(ref.device).float()
        update = float((ref - was).abs().max()) if ref.numel() else 0.0
        diff = (got - ref).abs()
        allowed = 1e-6 + rtol_update * update + 1e-5 * ref.abs()
        if name in moved:
            allowed = allowed + SLACK * moved[name].float()
        bad = diff > allowed
        if bool(bad.any()):
            i = int(bad.flatten().nonzero()[0])
            return (f"{name} after the step: max |difference| {float(diff[bad].max()):.3g} "
                    f"where the reference's update is at most {update:.3g} (e.g. element "
                    f"{i}: {float(got.flatten()[i]):.6g} vs {float(ref.flatten()[i]):.6g})")
    return ""


def _rng(device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device)
                                   if device.type == "cuda" else None)


def _set_rng(device, state):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _on(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _on(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_on(v, device) for v in batch)
    return batch


def _describe(plan) -> str:
    return ", ".join(f"{k}={getattr(plan, k)}" for k in ("dp", "tp", "pp", "microbatches",
                                                          "zero", "remat", "precision")
                     if getattr(plan, k) not in (1, 0, "none", "fp32")) or "one device"

"""Plan.verify: the first step checked against one plain process on the same batch.

fxpar promises that `pm.step` equals a step of single-process training. The passes are
tested on a zoo, but a user's model is new code: with `verify=True` (or FXPAR_VERIFY=1) the
first step also runs the user's model in plain eager PyTorch on rank 0 - the whole weights
before the step, the same global batch, the same RNG state, a fresh optimizer from the
user's factory, the plan's gradient clipping - and compares the loss, every parameter and
buffer after the step, and the optimizer's state (Adam's first step moves an element by
about lr whatever its gradient's size, so the weights alone miss a gradient off by a
factor; its moments hold the gradient itself). Under fp16 a step skipped for inf
gradients is not compared: the next step is. With batch_stats='microbatch' the reference
is gradient accumulation over the plan's microbatches (each its own batch). A difference
raises VerifyError on every rank, naming the first tensor that differs. It costs a whole
copy of the model's weights on every rank, twice (before and after the step), and one of
its training state on rank 0 (for a model that does not fit there, verify a copy with fewer
layers: the same code).

Tolerances: a wrong shard, a missing collective or a wrong scale moves a parameter by about
its update; rounding (another order of the same sums) moves it by what rounding-sized
gradient noise does through the user's optimizer - little for SGD, up to lr for Adam on an
element whose gradient is near its eps. So the reference steps a second copy of the weights
with the gradients perturbed at rounding size (1e-4 of each element plus 1e-6 of the largest,
toward zero; in bf16 / fp16, whose products round at about 4e-3 / 5e-4, 1e-2 / 2e-3 of
each element plus 4e-3 / 5e-4 of the largest), and each element may differ by 10x what that
moved it, plus 1e-3 of the tensor's largest update (5e-2 in bf16/fp16) and 1e-5 of its value.
The optimizer's state is held to the same rule, its update being its value.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fxpar.core import ir
from fxpar.core.errors import CheckpointError, PlanError, VerifyError
from fxpar.runtime import checkpoint as rckpt
from fxpar.runtime import model_state, optim

# the rounding-sized gradient perturbation: (of each element, of the largest) per precision
NOISE = {"fp32": (1e-4, 1e-6), "bf16": (1e-2, 4e-3), "fp16": (2e-3, 5e-4)}
SLACK = 10.0
RTOL_UPDATE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
RTOL_LOSS = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}


def check_optimizer(optimizer) -> None:
    """The reference builds its own optimizer: it needs the factory (or None: SGD)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise PlanError("Plan.verify builds a fresh optimizer for the one-process reference "
                        "step: pass a factory, e.g. `optimizer=lambda ps: "
                        "torch.optim.AdamW(ps, lr=1e-3)`, not an instance.")


def first_step(pm, batch, loss_of, optimizer, train_step) -> tuple[torch.Tensor, bool]:
    """Run `train_step(batch)` (the plan's step) and the reference step; raise VerifyError
    where they differ. Returns (the step's loss, whether it was checked: False where fp16's
    loss scale skipped the update, so the next step is to be checked). Collective: every
    rank calls it with the same global batch."""
    before = pm.whole_tensors()
    rank0 = pm.world.rank == 0
    rng = _rng(pm.world.device)
    scaler = getattr(pm, "scaler", None)
    skipped = scaler.skipped_steps if scaler is not None else 0
    loss = train_step(batch)
    if scaler is not None and scaler.skipped_steps != skipped:  # (alike on every rank)
        return loss, False
    after = pm.whole_tensors()
    state = _optimizer_state(pm)  # (rank 0: {name: {key: whole tensor}}; None: not compared)
    ref = None
    if rank0:  # the reference draws the random numbers the plan's step drew
        rng_after = _rng(pm.world.device)
        _set_rng(pm.world.device, rng)
        ref = _reference(pm, before, batch, loss_of, optimizer)
        _set_rng(pm.world.device, rng_after)
    verdict = [_compare(pm.plan.precision, loss, after, state, *ref) if rank0 else None]
    if pm.world.size > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise VerifyError(
            f"Plan.verify: the first step under {_describe(pm.plan)} differs from one plain "
            f"process on the same batch: {verdict[0]}. This is a bug in fxpar: please report "
            "it with the model; meanwhile train this model under another plan (verify tells "
            "which plans agree), or with dropout off if the model draws random numbers "
            "(plans may draw different masks).")
    return loss, True


def _optimizer_state(pm) -> dict | None:
    """The plan's optimizer state after the step, whole, by parameter name, on rank 0
    ({name: {key: tensor}}; None elsewhere, or where the optimizer's state is not per
    element on some rank: then it is not compared). Collective."""
    opt = pm.optimizer
    try:
        elementwise = opt is None or all(
            not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape == t.shape
            for t, _, _ in rckpt._slots(pm) for v in opt.state.get(t, {}).values())
    except CheckpointError:  # (an optimizer over tensors that are not the model's)
        elementwise = False
    if pm.world.size > 1:  # every rank agrees before any gathers
        flag = torch.tensor(int(elementwise), device=pm.world.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        elementwise = bool(flag.item())
    if not elementwise:
        return None
    flat = rckpt._optim_state(pm)[0] if opt is not None else {}
    local = {k: v.detach().cpu() for k, v in flat.items()}
    if pm.world.size > 1:  # pipeline ranks hold their stages' state: all of it to rank 0
        parts = [None] * pm.world.size if pm.world.rank == 0 else None
        dist.gather_object(local, parts, dst=0)
        if pm.world.rank != 0:
            return None
        local = {k: v for part in reversed(parts) for k, v in part.items()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    prefix = "optim.state."
    for k, v in local.items():
        name, _, key = k[len(prefix):].rpartition(".")
        out.setdefault(name, {})[key] = v
    return out


def _reference(pm, before, batch, loss_of, optimizer):
    """(loss, {name: tensor after the step}, {name: how far rounding-sized gradient noise
    moves it}, {name: {key: optimizer state}}, {name: {key: how far the noise moves it}},
    before) of one eager step of the user's model holding the whole weights `before`."""
    held = {n: t.detach().clone() for n, t in before.items()}
    with model_state.holding(pm.model, held) as module_tensors:
        params = {}  # each trainable tensor once (tied names share one)
        for n, t in module_tensors.items():
            if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                params.setdefault(id(t), (n, t))
        loss = _loss_and_grads(pm, batch, loss_of)
        trained = [t for _, t in params.values()]
        if pm.plan.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, pm.plan.max_grad_norm)
        probes = _probe_grads(trained, pm.plan.precision)
        with torch.no_grad():
            opt = optim.build(optimizer, trained)
            opt.step()
            probe_opt = optim.build(optimizer, probes)
            probe_opt.step()
        probe_of = {k: probe for k, probe in zip(params, probes)}
        moved = {n: (t.detach() - probe_of[id(t)].detach()).abs()  # under each tied name
                 for n, t in module_tensors.items() if id(t) in probe_of}
        after = {n: t.detach() for n, t in module_tensors.items()}
        state, state_moved = {}, {}  # under each name of the tensor
        for n, t in module_tensors.items():
            if id(t) not in probe_of:
                continue
            mine, noisy = opt.state.get(t, {}), probe_opt.state.get(probe_of[id(t)], {})
            state[n] = {k: v.detach() for k, v in mine.items() if isinstance(v, torch.Tensor)}
            state_moved[n] = {k: (v.detach().float() - noisy[k].detach().float()).abs()
                              for k, v in state[n].items() if k in noisy}
    return loss.detach(), after, moved, state, state_moved, before


def _loss_and_grads(pm, batch, loss_of) -> torch.Tensor:
    """The eager loss of the step's batch, backward run: one forward on the whole batch; or,
    with batch_stats='microbatch' and microbatches, one per microbatch as the plan cuts them
    (each its own batch: gradient accumulation), weighted as the plan weights them (by
    target count for a mean cross-entropy, else equally)."""
    batch = _on(batch, pm.world.device)
    plan, program = pm.plan, pm.program
    m = program.microbatches
    if plan.batch_stats != "microbatch" or m == 1:
        loss = loss_of(pm.model, batch)
        loss.backward()
        return loss
    trees = ir.microbatches(batch, m, program.rows)
    if program.loss_count is not None:
        with torch.no_grad():
            counts = [program.loss_count(*ir.flatten_batch(t, program.signature)).double()
                      for t in trees]
        total = sum(counts)
        weights = [float(c / total) for c in counts]
    else:
        weights = [1.0 / m] * m
    loss = 0.0
    for w, tree in zip(weights, trees):
        part = loss_of(pm.model, tree) * w
        part.backward()
        loss = loss + part.detach()
    return loss


def _probe_grads(params: list[torch.Tensor], precision: str) -> list[torch.nn.Parameter]:
    """Copies of `params` as they are before the step, each with its gradient moved toward
    zero (and through it where the noise is larger) by the precision's rounding size: the
    direction that moves a sign-like update (Adam's first step) most; a linear one (SGD)
    moves as much either way."""
    rel, of_top = NOISE.get(precision, NOISE["bf16"])
    grads = [p.grad for p in params if p.grad is not None]
    top = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
    probes = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        if p.grad is not None:
            toward_zero = torch.where(p.grad < 0, 1.0, -1.0).to(p.grad.dtype)
            q.grad = p.grad + toward_zero * (rel * p.grad.abs() + of_top * top)
        probes.append(q)
    return probes


def _compare(precision, loss, after, state, ref_loss, ref_after, moved, ref_state,
             state_moved, before) -> str:
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
        was = before[name].to(ref.device).float()
        why = _differs(got, ref, ref.float() - was, moved.get(name), rtol_update, 1e-6)
        if why:
            return f"{name} after the step: {why}"
    if state is None:
        return ""
    for name, keys in ref_state.items():
        for key, ref in keys.items():
            got = state.get(name, {}).get(key)
            if got is None:
                if name in state:  # (a name the plan keeps no state under: a tied alias)
                    return f"the optimizer's {key!r} of {name} is missing"
                continue
            got = got.to(ref.device)
            if got.shape != ref.shape:
                return (f"the optimizer's {key!r} of {name} has shape {tuple(got.shape)}, "
                        f"the reference's {tuple(ref.shape)}")
            if not ref.is_floating_point():
                if not torch.equal(got, ref):
                    return f"the optimizer's {key!r} of {name} differs"
                continue
            why = _differs(got, ref, ref.float(), state_moved.get(name, {}).get(key),
                           rtol_update, 0.0)
            if why:
                return f"the optimizer's {key!r} of {name} after the step: {why}"
    return ""


def _differs(got, ref, update, moved, rtol_update, atol) -> str:
    """'' where `got` is within the rounding the reference allows, else how it differs:
    `update` what the step changed (its largest element scales the tolerance), `moved`
    what rounding-sized gradient noise changed (10x of it allowed elementwise)."""
    got, ref = got.float(), ref.float()
    top = float(update.abs().max()) if ref.numel() else 0.0
    diff = (got - ref).abs()
    allowed = atol + rtol_update * top + 1e-5 * ref.abs()
    if moved is not None:
        allowed = allowed + SLACK * moved.float()
    bad = diff > allowed
    if not bool(bad.any()):
        return ""
    i = int(bad.flatten().nonzero()[0])
    return (f"max |difference| {float(diff[bad].max()):.3g} where the reference's update is "
            f"at most {top:.3g} (e.g. element {i}: {float(got.flatten()[i]):.6g} vs "
            f"{float(ref.flatten()[i]):.6g})")


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

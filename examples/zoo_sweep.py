"""`fxpar zoo`: every zoo model under every plan, against plain single-process PyTorch.

A cell is one (model, plan): fxpar trains the model for STEPS AdamW steps on the zoo's
global batches and its losses and final parameters are compared with eager PyTorch's on
the same batches from the same initial weights. Its result is one of
- "exact":   losses and parameters within the parity tolerances (tests/test_parity.py);
- "refused": fxpar raised one of its own errors (PlanError, TraceError, ...) whose message
             names the cause; the table prints it;
- "mismatch": it trained but differs from eager (a bug);
- "crash":   anything else (a bug: an error from inside a pass or from ATen);
- "skipped": an external-zoo model whose library is not installed (examples/external_zoo.py);
- "n/a":     the column does not apply ("tp=2 dropout" to a model whose config has none);
- "rounding": it differed after STEPS AdamW steps by what rounding alone makes of this
             model, by one of two controls: (1) eager PyTorch trained from weights one ulp
             apart (`ulp_control`), or for a plan that splits the batch with each batch's
             halves run apart as plain DDP does (`split_control`), is as far from eager,
             CONTROL_SLACK times over, loss by loss and tensor by tensor (`within_control`)
             - a model whose training amplifies rounding (a
             BatchNorm behind a zero-initialised scale, an MoE router flipping near-tied
             experts, bf16 casts inside an fp32 model); or (2) the same cell under Plan.verify
             passes its first step (gradients and optimizer state within what rounding of fp32
             sums makes them, runtime/verify.py): a different order of float sums that Adam's
             per-element normalisation turns into lr-sized moves of small-gradient elements.
             The detail names the control. A mismatch both controls confirm stays a
             "mismatch".
"tp=2 dropout" builds the model with its library's default dropouts (`zoo.build(...,
dropout=True)`), eager's reference too: tensor parallelism draws the masks one process draws.
All two-rank plans of one model run in one `fxpar.launch` (one process group, compiled one
after another) to keep the sweep's time down. A model name is looked up in the zoo, then in
the external zoo (model code from torchtitan, timm, litgpt and nanoGPT).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
import traceback

import torch

import fxpar
from fxpar.compiler import planner
from fxpar.core import ir
from fxpar.examples import hf_causal_lms, zoo
from fxpar.runtime.dist import LaunchError

STEPS = 3
RTOL, LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-6, 1e-5  # tests/test_parity.py's AdamW tolerances
PLANS: dict[str, object] = {
    "1 device": None,
    "dp=2": {"dp": 2},
    "tp=2": {"tp": 2},
    "pp=2 m=2": {"pp": 2, "microbatches": 2},
    "dp=2 zero=3": {"dp": 2, "zero": 3},
    "auto (2)": "auto",
    "ps=1": {"ps": 1},  # one worker and one parameter server, synchronous
    "tp=2 dropout": {"tp": 2},
}
DROPOUT = {"tp=2 dropout"}  # columns whose model has its library's default dropouts


@dataclasses.dataclass
class Cell:
    model: str
    plan: str
    status: str  # exact | refused | mismatch | crash | skipped | n/a | rounding
    detail: str = ""
    seconds: float = 0.0
    chosen: dict | None = None  # the plan it ran (plan="auto": the planner's), as plan=


LR = 1e-3
# |gradient| at or below this fraction of the model's largest, in every eager step: zero
# up to float32 rounding of the sums that make it (~1e-7 relative, over many terms)
QUIET_GRAD = 1e-5
# how much farther from eager than eager from weights one ulp apart fxpar's result may be
CONTROL_SLACK = 4.0
CONTROLS = 3  # runs from weights one ulp apart (three draws)


def registry(name: str):
    """The module whose `models()` has `name` (the zoo, the external zoo, or Hugging Face's
    other causal LMs built generically): it has `models()`, `build(name)` and
    `loss_of(model, spec, batch)`."""
    if name in zoo.models():
        return zoo
    from fxpar.examples import external_zoo
    if name in external_zoo.models():
        return external_zoo
    if name in hf_causal_lms.models():
        return hf_causal_lms
    raise KeyError(f"{name!r} is in neither the zoo, the external zoo nor hf_causal_lms")


def optimizer(ps):
    # eps 1e-6: see tests/workers.py OPTIMIZERS (zero-gradient elements stay noise)
    return torch.optim.AdamW(ps, lr=LR, eps=1e-6)


def _build(name: str, dropout: bool):
    reg = registry(name)
    return reg.build(name, dropout=True) if dropout else reg.build(name)


def has_dropout(name: str) -> bool:
    return name in zoo.models() and zoo.has_default_dropout(name)


def eager_reference(name: str, steps: int = STEPS, dropout: bool = False):
    """(losses, final state dict, {name: elements whose gradient was numerically zero in
    every step}). Adam divides a gradient by its own running size, so on such elements (a
    key bias under softmax, a bias before a norm) any reordering of float sums moves the
    parameter by up to lr a step: they are compared at that bound, the rest at rtol 1e-5."""
    reg = registry(name)
    model, spec = _build(name, dropout)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses, peak = [], {}
    for s in range(steps):
        opt.zero_grad()
        loss = reg.loss_of(model, spec, spec.batch(s))
        loss.backward()
        for k, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().abs()
                peak[k] = g if k not in peak else torch.maximum(peak[k], g)
        opt.step()
        losses.append(loss.item())
    top = max((float(g.max()) for g in peak.values() if g.numel()), default=0.0)
    quiet = {k: g <= QUIET_GRAD * top for k, g in peak.items()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, quiet


def ulp_control(name: str, steps: int = STEPS, dropout: bool = False, seed: int = 0):
    """(losses, final state dict) of eager PyTorch trained as `eager_reference` is, from
    weights one float32 ulp apart (each element moved up or down at random, drawn from
    `seed`): how far rounding alone moves this model's training in STEPS steps. A router that
    flips a near-tied expert, a BatchNorm behind a zero-initialised scale, bf16 casts of
    values one ulp apart and Adam's normalisation of near-zero gradients make that far more
    than 1e-5 on some models; another order of the same float sums moves them as far."""
    def nudge(model):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    up = torch.rand(p.shape, generator=g) < 0.5
                    p.copy_(torch.where(up.to(p.device), torch.nextafter(p, p + 1),
                                        torch.nextafter(p, p - 1)))
    return _control(name, steps, dropout, nudge, 1)


def split_control(name: str, steps: int = STEPS):
    """(losses, final state dict) of eager PyTorch with each batch's two halves run apart
    and their gradients averaged: what plain DDP on 2 ranks (or gradient accumulation over
    2 microbatches) computes, the same sums in another order - for a plan that splits the
    batch, on a model whose rows are computed apart (no BatchNorm: `has_batch_norm`)."""
    return _control(name, steps, False, lambda model: None, 2)


@functools.lru_cache(maxsize=None)
def has_batch_norm(name: str) -> bool:
    model, _ = _build(name, False)
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _control(name, steps, dropout, nudge, parts):
    """eager_reference's training after `nudge(model)`, each batch run as `parts` parts whose
    mean losses' gradients are averaged."""
    reg = registry(name)
    model, spec = _build(name, dropout)
    nudge(model)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for s in range(steps):
        opt.zero_grad()
        total = 0.0
        for part in ir.microbatches(spec.batch(s), parts, 1):
            loss = reg.loss_of(model, spec, part) / parts
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def within_control(losses, state, ref_losses, ref_state, controls) -> str:
    """'' when fxpar's result is no farther from eager's than the farthest of `controls`
    (`ulp_control`, `split_control` runs) is, CONTROL_SLACK times over: each loss, and per
    tensor both its largest element difference and how many elements differ past the
    exact-match tolerance (so one chaotic element - a near-zero gradient Adam turns into an
    lr-sized move - does not excuse a wrong row elsewhere in the tensor); else the first
    that is farther. Several controls: where routing flips a token's expert or not, one run
    is a coin toss. Keys, shapes and dtypes must match (`compare` says where they do not)."""
    for i, (got, ref) in enumerate(zip(losses, ref_losses)):
        own = max(abs(c[0][i] - ref) for c in controls)
        if abs(got - ref) > CONTROL_SLACK * own + LOSS_ATOL + RTOL * abs(ref):
            return (f"loss {i}: {got} is {abs(got - ref):.3g} from eager's {ref}; the "
                    f"controls: {own:.3g}")
    if state.keys() != ref_state.keys():
        return "state keys differ"
    for k, ref in ref_state.items():
        got = state[k]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            return f"{k}: its shape or dtype differs"
        if not ref.is_floating_point():
            continue
        ref = ref.double()
        tol = PARAM_ATOL + RTOL * ref.abs()
        d = (got.double() - ref).abs()
        own = [(c[1][k].double() - ref).abs() for c in controls]
        far, own_far = d.max().item(), max(o.max().item() for o in own)
        n, own_n = int((d > tol).sum()), max(int((o > tol).sum()) for o in own)
        if far > CONTROL_SLACK * own_far + PARAM_ATOL + RTOL * ref.abs().max().item():
            return f"{k}: {far:.3g} from eager; the controls: {own_far:.3g}"
        if n > CONTROL_SLACK * max(own_n, 1):
            return (f"{k}: {n} elements past the tolerance; the controls: {own_n}")
    return ""


def train(name: str, devices: int, plan, steps: int = STEPS, dropout: bool = False,
          verify: bool = False):
    """fxpar's losses and full state dict (on every rank), and the plan it ran."""
    model, spec = _build(name, dropout)
    if verify:
        plan = {**(plan or {}), "verify": True}
    pm = fxpar.parallelize(model, devices, example_batch=spec.batch(0), loss_fn=spec.loss_fn,
                           optimizer=optimizer, plan="auto" if plan is None else plan)
    losses = [pm.step(spec.batch(s)).item() for s in range(steps)]
    return losses, pm.full_state_dict(), planner.plan_dict(pm.plan)


def _describe(plan: dict | None) -> str:
    d = {k: v for k, v in (plan or {}).items()
         if k in ("dp", "tp", "pp", "microbatches", "zero", "remat") and v not in (1, 0, "none")}
    return " ".join(f"{k}={v}" for k, v in d.items()) or "dp=1"


def _failure(e: BaseException) -> tuple[str, str]:
    if isinstance(e, fxpar.FxparError) and not isinstance(e, LaunchError):
        return "refused", f"{type(e).__name__}: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                  if "fxpar" in f.filename or "/work/" in f.filename), "")
    return "crash", f"{type(e).__name__}: {e} [{where}]"


def compare(losses, state, ref_losses, ref_state, quiet=None) -> str:
    """'' when fxpar matches eager, else what differs (`quiet`: see eager_reference)."""
    try:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL,
                                   atol=LOSS_ATOL)
    except AssertionError as e:
        return f"losses {losses} vs eager {ref_losses}: {str(e).splitlines()[-1]}"
    if state.keys() != ref_state.keys():
        return f"state keys differ: {sorted(set(state) ^ set(ref_state))[:4]}"
    for k, ref in ref_state.items():
        got = state[k]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            return f"{k}: {tuple(got.shape)} {got.dtype} vs eager {tuple(ref.shape)} {ref.dtype}"
        if ref.is_floating_point():
            close = torch.isclose(got, ref, rtol=RTOL, atol=PARAM_ATOL)
            if quiet is not None and k in quiet:  # Adam's steps on zero gradients: <= lr each
                close |= quiet[k] & ((got - ref).abs() <= 2 * LR * len(losses))
            if not bool(close.all()):
                return f"{k}: max |diff| {(got - ref)[~close].abs().max().item():.3g}"
        elif not torch.equal(got, ref):
            return f"{k}: differs from eager"
    return ""


def sweep_rank(name: str, plan_keys: list[str], verify: bool = False, plans=None):
    """Runs on each of 2 ranks: every plan of `plan_keys` for model `name`, one after another
    (`plans`: {key: plan} in place of PLANS[key]; `verify`: its first step under
    Plan.verify, all that verify checks). Rank 0 returns {plan: (status, detail,
    losses, state, chosen plan dict, seconds)}."""
    rank = int(os.environ.get("RANK", 0))
    out = {}
    for key in plan_keys:
        t0 = time.perf_counter()
        try:
            losses, state, chosen = train(name, 2, (plans or PLANS)[key],
                                          steps=1 if verify else STEPS,
                                          dropout=key in DROPOUT, verify=verify)
            out[key] = ("ran", "", losses, state if rank == 0 else None, chosen)
        except Exception as e:  # noqa: BLE001 - the sweep records every failure
            out[key] = (*_failure(e), None, None, None)
        out[key] = (*out[key], time.perf_counter() - t0)
    return out if rank == 0 else None


def skip_reason(name: str) -> str:
    """'' when `name` can be built here, else why not (an external model's library)."""
    reg = registry(name)
    return reg.missing(reg.models()[name]) if hasattr(reg, "missing") else ""


def sweep_model(name: str, plan_keys=tuple(PLANS)) -> list[Cell]:
    why = skip_reason(name)
    if why:
        return [Cell(name, key, "skipped", why) for key in plan_keys]
    columns = list(plan_keys)
    na = [k for k in columns if k in DROPOUT and not has_dropout(name)]
    plan_keys = [k for k in columns if k not in na]
    ref = eager_reference(name) if any(k not in DROPOUT for k in plan_keys) else None
    ref_dropout = eager_reference(name, dropout=True) if any(
        k in DROPOUT for k in plan_keys) else None
    results = {}
    if "1 device" in plan_keys:
        t0 = time.perf_counter()
        try:
            losses, state, chosen = train(name, 1, None)
            results["1 device"] = ("ran", "", losses, state, chosen)
        except Exception as e:  # noqa: BLE001
            results["1 device"] = (*_failure(e), None, None, None)
        results["1 device"] = (*results["1 device"], time.perf_counter() - t0)
    multi = [k for k in plan_keys if k != "1 device"]
    if multi:
        try:
            results.update(fxpar.launch(sweep_rank, 2, name, multi)[0])
        except Exception as e:  # noqa: BLE001 - a rank died: every cell of the launch
            status, detail = _failure(e)
            results.update({k: ("crash", detail, None, None, None, 0.0) for k in multi
                            if k not in results})
    cells, controls = [], {}
    for key in columns:
        if key in na:
            cells.append(Cell(name, key, "n/a", "its config has no dropout"))
            continue
        status, detail, losses, state, chosen, secs = results[key]
        if status == "ran":
            dropout = key in DROPOUT
            eager = ref_dropout if dropout else ref
            diff = compare(losses, state, *eager)
            status, detail = ("mismatch", diff) if diff else ("exact", "")
            if diff:
                status, detail = _judged(name, key, diff, losses, state, eager, chosen,
                                         controls)
        cells.append(Cell(name, key, status, detail, secs, chosen))
    return _verified(name, cells)


def _judged(name, key, diff, losses, state, eager, chosen, controls) -> tuple[str, str]:
    """(status, detail) of a cell that differs from eager by `diff`: "rounding" where the
    controls (`within_control`) move eager as far, naming them; else "mismatch"."""
    dropout = key in DROPOUT
    if dropout not in controls:
        controls[dropout] = [ulp_control(name, dropout=dropout, seed=i)
                             for i in range(CONTROLS)]
    used = list(controls[dropout])
    splits = not dropout and ((chosen or {}).get("dp", 1) > 1
                              or (chosen or {}).get("microbatches", 1) > 1)
    splits = splits and not has_batch_norm(name)
    if splits:
        if "split" not in controls:
            controls["split"] = split_control(name)
        # where rows are computed apart, the split changes only the order of sums: its first
        # loss (before any update) is eager's up to rounding. One farther off is a model
        # whose rows are computed together (Doge's router), which the split cannot excuse
        split, first = controls["split"], eager[0][0]
        splits = abs(split[0][0] - first) <= LOSS_ATOL + RTOL * abs(first)
        if splits:
            used.append(split)
    far = within_control(losses, state, eager[0], eager[1], used)
    if far:
        return "mismatch", f"{diff}; {far}"
    return "rounding", (f"{diff} after {STEPS} AdamW steps; eager from weights one ulp apart"
                        + (" or with each batch's halves run apart" if splits else "")
                        + f" differs from eager as much (within {CONTROL_SLACK:g}x)")


def _verified(name: str, cells: list[Cell]) -> list[Cell]:
    """Each mismatching cell run again under Plan.verify ("auto" with the plan the planner
    chose, which a second search on a busy machine could change): "rounding" where its first
    step passes, else it stays a mismatch with what verify found."""
    again = [c for c in cells if c.status == "mismatch"]
    found = {}
    for c in again:
        if c.plan == "1 device":
            try:
                train(name, 1, None, steps=1, verify=True)
                found[c.plan] = ""
            except Exception as e:  # noqa: BLE001 - what verify found, or why it could not
                found[c.plan] = f"{type(e).__name__}: {e}"
    multi = [c.plan for c in again if c.plan != "1 device"]
    if multi:
        try:
            plans = {c.plan: c.chosen if PLANS[c.plan] == "auto" else PLANS[c.plan]
                     for c in again if c.plan != "1 device"}
            got = fxpar.launch(sweep_rank, 2, name, multi, True, plans)[0]
            found.update({k: v[1] for k, v in got.items()})
        except Exception as e:  # noqa: BLE001
            found.update({k: f"{type(e).__name__}: {e}" for k in multi})
    for c in again:
        if found[c.plan] == "":
            c.status = "rounding"
            c.detail = (f"{c.detail} after {STEPS} AdamW steps; Plan.verify passes its first "
                        "step (gradients and optimizer state within rounding)")
        else:
            c.detail += f"; under Plan.verify: {found[c.plan][:300]}"
    return cells


def sweep(names=None, plan_keys=tuple(PLANS), log=print) -> list[Cell]:
    cells = []
    for name in names or zoo.models():
        t0 = time.perf_counter()
        got = sweep_model(name, plan_keys)
        cells += got
        log(f"{name:16s} " + "  ".join(f"{c.plan}: {c.status}" for c in got)
            + f"  ({time.perf_counter() - t0:.0f} s)")
        for c in got:
            if c.status not in ("exact", "n/a"):
                log(f"    {c.plan}: {c.detail[:400]}")
    return cells


# --- one model under a few plans of one axis (examples/zoo_ep.py, zoo_cp.py) -----------

def _plans_rank(name: str, plans: dict, keys: list) -> dict:
    out = {}
    for key in keys:
        world, plan = plans[key]
        try:
            losses, state, chosen = train(name, world, plan)
            out[key] = ("ran", losses, state if int(os.environ["RANK"]) == 0 else None, chosen)
        except Exception as e:  # noqa: BLE001 - every failure is a cell of the table
            out[key] = (*_failure(e), None, None)
    return out


def _plans_verify_rank(name: str, plans: dict, keys: list) -> dict:
    """Each plan's first step under Plan.verify: '' where it passes, else what it found."""
    out = {}
    for key in keys:
        world, plan = plans[key]
        try:
            train(name, world, plan, steps=1, verify=True)
            out[key] = ""
        except Exception as e:  # noqa: BLE001 - what verify found, or why it could not run
            out[key] = f"{type(e).__name__}: {e}"
    return out


def plan_cells(name: str, plans: dict) -> dict:
    """{plan key: cell text} for one model under `plans` ({key: (world, plan dict)}): each
    plan's training against eager, judged as the sweep judges (`_judged`), a mismatch
    checked again under Plan.verify; a failure is its cell."""
    why = skip_reason(name)
    if why:
        return {key: f"skipped: {why}" for key in plans}
    res = {}
    for key, (world, _) in plans.items():  # (one launch each: a process group opened again
        # after a refused parallelize can hang in gloo's connect)
        res.update(fxpar.launch(_plans_rank, world, name, plans, [key])[0])
    eager = eager_reference(name)
    out, controls = {}, {}
    for key in plans:
        status, *rest = res[key]
        if status != "ran":
            out[key] = f"{status}: {rest[0][:160]}"
            continue
        losses, state, chosen = rest
        diff = compare(losses, state, *eager)
        if not diff:
            out[key] = "exact"
            continue
        status, detail = _judged(name, key, diff, losses, state, eager, chosen, controls)
        out[key] = status if status == "rounding" else f"{status}: {detail[:160]}"
    # a mismatch the controls confirm, checked as the zoo sweep checks it: its first step
    # under Plan.verify (gradients and optimizer state within what rounding makes them)
    again = [k for k, v in out.items() if v.startswith("mismatch")]
    for k in again:
        found = fxpar.launch(_plans_verify_rank, plans[k][0], name, plans, [k])[0][k]
        out[k] = "rounding (Plan.verify)" if not found else \
            f"{out[k]}; under Plan.verify: {found[:300]}"
    return out


def plan_table(names, plans: dict, log=functools.partial(print, flush=True)) -> None:
    """A markdown table: a row per model, a column per plan of `plans` (plan_cells)."""
    log("| model | " + " | ".join(plans) + " |\n|---|" + "---|" * len(plans))
    for name in names:
        t0 = time.perf_counter()
        row = plan_cells(name, plans)
        log(f"| {name} | " + " | ".join(row[k] for k in plans) +
            f" |  <!-- {time.perf_counter() - t0:.0f} s -->")


def markdown(cells: list[Cell], plan_keys=tuple(PLANS)) -> str:
    """The zoo table: one row per model, one column per plan; refusals listed below."""
    by = {(c.model, c.plan): c for c in cells}
    names = list(dict.fromkeys(c.model for c in cells))
    mark = {"exact": "exact", "refused": "refused¹", "mismatch": "**MISMATCH**",
            "crash": "**CRASH**", "skipped": "skipped¹", "n/a": "-", "rounding": "rounding¹"}
    lines = ["| model | family | exercises | " + " | ".join(plan_keys) + " |",
             "|---|---|---|" + "---|" * len(plan_keys)]
    for n in names:
        row = []
        for k in plan_keys:
            c = by.get((n, k))
            row.append("" if c is None else mark[c.status] + (
                f" ({_describe(c.chosen)})" if c.status in ("exact", "rounding")
                and k.startswith("auto")
                else ""))
        spec = registry(n).models()[n]
        lines.append(f"| {n} | {spec.family} | {spec.note} | " + " | ".join(row) + " |")
    n_exact = sum(c.status == "exact" for c in cells)
    n_cells = sum(c.status != "n/a" for c in cells)
    lines += ["", f"{n_exact} of {n_cells} cells exact, "
              f"{sum(c.status == 'refused' for c in cells)} refused, "
              f"{sum(c.status == 'rounding' for c in cells)} rounding, "
              f"{sum(c.status in ('crash', 'mismatch') for c in cells)} crashed or mismatched"
              + (f", {n_skip} skipped." if (n_skip := sum(c.status == 'skipped' for c in cells))
                 else "."),
              "", "¹ Refusals and failures:", ""]
    for c in cells:
        if c.status not in ("exact", "n/a"):
            lines.append(f"- **{c.model}, {c.plan}** ({c.status}): {c.detail.splitlines()[0][:300]}")
    return "\n".join(lines) + "\n"

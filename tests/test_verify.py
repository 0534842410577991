"""Plan.verify (runtime/verify.py): the first step checked against one plain process.

A correct plan passes and trains exactly as without verify (the same RNG draws after the
check); a deliberately broken pass - a gradient halved after remat, a tensor-parallel
all-reduce dropped - raises VerifyError naming the tensor that differs, on every rank."""
import os

import pytest
import torch

import fxpar
from fxpar.passes import remat, tensor_parallel

from workers import build



def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def _steps(name, plan, n=3, devices=1, optimizer=sgd):
    model, batch_fn, loss_fn = build(name)
    pm = fxpar.parallelize(model, devices, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=optimizer, plan=plan)
    torch.manual_seed(5)
    return [pm.step(batch_fn(s)).item() for s in range(n)], pm


def halve_first_gradient(gm, plan, ctx):
    """A broken pass: remat, then the first parameter's gradient output times 0.5."""
    gm = REAL_REMAT(gm, plan, ctx)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = list(out.args[0])
    with gm.graph.inserting_before(out):
        half = gm.graph.call_function(torch.ops.aten.mul.Tensor, (vals[1], 0.5))
    half.meta = dict(vals[1].meta)
    vals[1] = half
    out.args = (tuple(vals),)
    gm.recompile()
    return gm


REAL_REMAT = remat.run


@pytest.mark.parametrize("name", ["convbn", "mlp_dropout"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in ("gpt", "hooked_gpt")])
def test_verified_first_step_passes_and_trains_as_without(name):
    """A correct plan (remat "sqrt", one device) passes verify, and the steps after it equal
    the steps of the same plan without verify (dropout masks included)."""
    plain, _ = _steps(name, {"remat": "sqrt"})
    checked, pm = _steps(name, {"remat": "sqrt", "verify": True})
    assert pm.plan.verify
    assert checked == plain


def test_a_broken_pass_is_caught_naming_the_parameter(monkeypatch):
    monkeypatch.setattr(remat, "run", halve_first_gradient)
    model, batch_fn, _ = build("mlp")
    first = next(n for n, _ in model.named_parameters())
    with pytest.raises(fxpar.VerifyError, match=f"{first}.*after the step"):
        _steps("mlp", {"remat": "sqrt", "verify": True})
    _steps("mlp", {"remat": "sqrt"})  # without verify the wrong answer goes unnoticed


def test_verify_from_the_environment_and_its_misuse(monkeypatch):
    monkeypatch.setenv("FXPAR_VERIFY", "1")
    monkeypatch.setattr(remat, "run", halve_first_gradient)
    with pytest.raises(fxpar.VerifyError):
        _steps("mlp", {"remat": "sqrt"}, n=1)
    monkeypatch.delenv("FXPAR_VERIFY")
    model, batch_fn, _ = build("mlp")
    with pytest.raises(fxpar.PlanError, match="factory"):
        fxpar.parallelize(model, 1, example_batch=batch_fn(0), plan={"verify": True},
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def drop_row_all_reduce(gm, plan, ctx):
    """A broken tensor-parallel pass: the first all-reduce of a row-split output skipped
    (its input used in its place)."""
    gm = REAL_TP(gm, plan, ctx)
    for n in gm.graph.nodes:
        if n.op == "call_function" and "all_reduce" in str(n.target):
            for w in [u for u in n.users if "wait_tensor" in str(u.target)]:
                w.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(w)
            gm.graph.erase_node(n)
            break
    gm.recompile()
    return gm


REAL_TP = tensor_parallel.run


def verify_rank(broken):
    if broken:
        tensor_parallel.run = drop_row_all_reduce
    try:
        _steps("gpt", {"tp": 2, "verify": True}, n=2, devices=2)
        return "passed"
    except fxpar.VerifyError as e:
        return str(e)


@pytest.mark.slow
def test_verify_on_two_ranks_catches_a_dropped_all_reduce():
    """tp=2 on 2 ranks: the correct plan passes; with one all-reduce dropped every rank
    raises VerifyError (the same message)."""
    assert fxpar.launch(verify_rank, 2, False) == {0: "passed", 1: "passed"}
    got = fxpar.launch(verify_rank, 2, True)
    assert got[0] == got[1] and "differs from one plain process" in got[0], got


def halve_every_gradient(gm, plan, ctx):
    """A broken pass: remat, then every gradient output times 0.5."""
    gm = REAL_REMAT(gm, plan, ctx)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = list(out.args[0])
    with gm.graph.inserting_before(out):
        for i in range(1, 1 + out.meta["n_grads"]):
            if vals[i] is not None:
                half = gm.graph.call_function(torch.ops.aten.mul.Tensor, (vals[i], 0.5))
                half.meta = dict(vals[i].meta)
                vals[i] = half
    out.args = (tuple(vals),)
    gm.recompile()
    return gm


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def test_adam_is_checked_through_its_moments(monkeypatch):
    """Adam's first step moves each element by about lr whatever its gradient's size, so
    weights alone do not show gradients off by a factor; its first moment does."""
    monkeypatch.setattr(remat, "run", halve_every_gradient)
    with pytest.raises(fxpar.VerifyError, match="optimizer's 'exp_avg' of fc1.weight"):
        _steps("mlp", {"remat": "sqrt", "verify": True}, n=1, optimizer=adamw)


def test_bf16_with_adam_passes():
    """bf16 gradients differ from fp32 ones by bf16's rounding, enough to flip the sign of
    small ones (Adam then moves them by 2 lr): honest rounding, not a VerifyError."""
    _steps("gpt", {"precision": "bf16", "verify": True}, n=1, optimizer=adamw)


def test_batch_stats_microbatch_is_checked_against_accumulation():
    """batch_stats='microbatch' trains as eager gradient accumulation: so is the reference
    (each microbatch's BatchNorm statistics its own)."""
    _steps("convbn", {"microbatches": 2, "batch_stats": "microbatch", "verify": True}, n=1,
           optimizer=adamw)


def test_an_fp16_step_skipped_for_inf_is_not_compared_the_next_is():
    """fp16's loss scale starts at 2**16: a large loss overflows the first steps, which
    skip their update; verify checks the first step that updates."""
    model, batch_fn, _ = build("mlp")
    pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0),
                           loss_fn=lambda m, b: m(b) * 1e3, optimizer=adamw,
                           plan={"precision": "fp16", "verify": True})
    for s in range(12):
        pm.step(batch_fn(s))
    skipped = pm.scaler.skipped_steps
    assert 0 < skipped < 11 and pm._verify_at == skipped + 1

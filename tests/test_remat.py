"""The remat pass on small graphs: checkpoints, recomputed nodes, budgets, RNG replay, and the
sqrt(N) memory law measured with the tracker."""
import math

import pytest
import torch

import fxpar
from fxpar.compiler import capture as cap
from fxpar.core import cost, ir
from fxpar.core.errors import PlanError
from fxpar.compiler.pass_manager import PassContext
from fxpar.core.graphs import verify
from fxpar.examples import models as M
from fxpar.passes import remat
from fxpar.runtime.memtrack import measure
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

aten = torch.ops.aten


def _deep_mlp(n, width=64, batch=32):
    torch.manual_seed(0)
    return M.DeepMLP(n, width), (torch.randn(batch, 16), torch.randn(batch, 4))


def _gpt(n_layer, dropout=0.0, n_embd=32, batch=8):
    torch.manual_seed(0)
    cfg = M.GPTConfig(n_layer=n_layer, dropout=dropout, n_embd=n_embd)
    return M.GPT(cfg), M.gpt_batch(cfg, batch, seed=0)


def _capture(model, batch):
    gm, sig = cap.capture(model, batch)
    params = dict(model.named_parameters(remove_duplicate=False))
    bufs = dict(model.named_buffers(remove_duplicate=False))
    args = ([params[n] for n in sig.param_names] + [bufs[n] for n in sig.buffer_names]
            + list(cap.flatten_batch(batch, sig)))
    return gm, sig, args


def _remat(gm, sig, mode):
    new = remat.run(gm, remat.Options(remat=mode, dp=1), PassContext(signature=sig))
    new.recompile()
    verify(new)
    return new


def _run(gm, args, n_params, seed=7):
    torch.manual_seed(seed)
    with torch.no_grad():
        return measure(lambda: gm(*args), exclude=lambda o: o[1:1 + n_params])


def test_chain_candidates_are_the_residual_stream():
    model, batch = _deep_mlp(4)
    gm, sig, _ = _capture(model, batch)
    cands = remat.chain_candidates(gm)
    modules = {c.meta[ir.MODULE] for c in cands}
    # every block's output (h + blk(h), an add outside any block) is a cut vertex ...
    adds = [c for c in cands if c.target == aten.add.Tensor]
    assert len(adds) == 4
    # ... and nothing inside a block's branch is (the residual edge bypasses it)
    assert not any(m.startswith("blocks.") for m in modules), modules
    assert all(c.meta[ir.REGION] == ir.FORWARD for c in cands)


def test_sqrt_checkpoints_and_recompute_placement():
    model, batch = _deep_mlp(16)
    gm, sig, args = _capture(model, batch)
    new = _remat(gm, sig, "sqrt")
    d = new.meta["remat"]
    cand_names = {c.name for c in remat.chain_candidates(gm)}
    assert set(d.checkpoints) <= cand_names
    assert 2 <= len(d.checkpoints) <= 8            # about sqrt(16) of the 16 block outputs
    nodes = list(new.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    last_fwd = max(index[n] for n in nodes if n.meta.get(ir.REGION) == ir.FORWARD)
    copies = [n for n in nodes if n.meta.get(ir.RECOMPUTE)]
    assert len(copies) == len(d.recomputed) > 0
    for c in copies:  # in the backward, each before all of its users
        assert c.meta[ir.REGION] == ir.BACKWARD and index[c] > last_fwd
        assert all(index[u] > index[c] for u in c.users)
    # expensive ops are recomputed only inside segments, never the checkpoints themselves
    assert not any(c.name in d.checkpoints for c in copies)
    assert {n.name for n in nodes if n.meta.get("saved")} >= set(d.checkpoints)
    # same values, bit for bit
    ref, _ = _run(gm, args, len(sig.param_names))
    out, _ = _run(new, args, len(sig.param_names))
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_cheap_ops_recomputed_not_saved():
    """With a budget that fits everything, no matmul is recomputed, but GELU is (saving its
    input alone is smaller than saving input and output)."""
    model, batch = _deep_mlp(4)
    gm, sig, args = _capture(model, batch)
    new = _remat(gm, sig, 10**12)
    copies = [n for n in new.graph.nodes if n.meta.get(ir.RECOMPUTE)]
    targets = {c.target for c in copies}
    assert aten.gelu.default in targets
    assert not targets & {aten.mm.default, aten.addmm.default}
    assert new.meta["remat"].recompute_flops == 0
    assert new.meta["remat"].peak_after < new.meta["remat"].peak_before


class _HalfGelu(torch.nn.Module):
    """A GELU computed in fp32 from bf16 values between two bf16 matmuls, as the precision
    pass leaves HF GPT-2's (autocast runs pow and tanh in fp32)."""
    def __init__(self):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(16, 64), torch.nn.Linear(64, 4)

    def forward(self, batch):
        x, y = batch
        h = self.fc(x).to(torch.bfloat16)
        t = torch.tanh(h.float() * 0.8 + 0.04 * h.float() ** 3)
        g = (h * 0.5).float() * (1 + t)
        return torch.nn.functional.mse_loss(self.proj(g.to(torch.bfloat16).float()), y)


def test_dtype_casts_are_recomputed_like_pointwise_ops():
    """Memory to spare (torch.compile's default): the fp32 values of the GELU are recomputed
    from its bf16 input, casts included, rather than saved (the H200's profile: remat="auto"
    still wrote the fp32 tanh, as `_to_copy` counted as expensive); bit for bit the same."""
    torch.manual_seed(0)
    model, batch = _HalfGelu(), (torch.randn(32, 16), torch.randn(32, 4))
    gm, sig, args = _capture(model, batch)
    new = _remat(gm, sig, 10**12)
    fwd_fp32 = [n for n in new.graph.nodes if n.meta.get(ir.REGION) == ir.FORWARD and any(
        u.meta.get(ir.REGION) == ir.BACKWARD for u in n.users) and getattr(
        n.meta.get(ir.VAL), "dtype", None) == torch.float32 and n.op == "call_function"
        and n.meta[ir.VAL].shape == (32, 64)]
    assert not fwd_fp32, fwd_fp32  # no [32, 64] fp32 value saved for the backward
    copies = [n for n in new.graph.nodes if n.meta.get(ir.RECOMPUTE)]
    assert {aten._to_copy.default, aten.tanh.default} <= {n.target for n in copies}
    # widening casts only: a narrowing one Inductor may fuse without its rounding
    assert all(n.meta[ir.VAL].dtype == torch.float32 for n in copies
               if n.target is aten._to_copy.default)
    assert not {n.target for n in copies} & {aten.mm.default, aten.addmm.default}
    ref, _ = _run(gm, args, len(sig.param_names))
    out, _ = _run(new, args, len(sig.param_names))
    assert all(torch.equal(a, b) for a, b in zip(ref, out))


def test_a_device_move_or_a_narrowing_cast_is_not_a_cheap_cast():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta[ir.VAL] = torch.empty(4)
    to_half = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    to_meta = g.call_function(aten._to_copy.default, (x,), {"device": torch.device("meta")})
    to_double = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.float64})
    assert remat._cheap(to_double) and not remat._cheap(to_meta)
    assert not remat._cheap(to_half)  # narrowing: its rounding must not be fused away
    e8 = g.placeholder("e8")  # 8 bits to 16, and still not exact: e8m0's range is wider
    e8.meta[ir.VAL] = torch.empty(4, dtype=torch.float8_e8m0fnu)
    assert not remat._cheap(g.call_function(aten._to_copy.default, (e8,),
                                            {"dtype": torch.float16}))


@pytest.mark.slow  # (make test's 6 minutes)
def test_budget_respected_and_monotone():
    model, batch = _gpt(4)
    gm, sig, args = _capture(model, batch)
    full = cost.simulate_liveness(gm, count_inputs=False).peak["activations"]
    floor = _remat(gm, sig, "sqrt").meta["remat"].peak_after
    flops = []
    for frac in (0.95, 0.8, 0.65):
        budget = int(floor + frac * (full - floor))
        new = _remat(gm, sig, budget)
        d = new.meta["remat"]
        assert d.peak_after <= budget
        _, measured = _run(new, args, len(sig.param_names))
        assert measured <= budget  # the tracker agrees
        flops.append(d.recompute_flops)
    assert flops == sorted(flops)  # less memory -> no less recompute


def test_budget_below_floor_is_a_clear_error():
    model, batch = _gpt(2)
    gm, sig, _ = _capture(model, batch)
    with pytest.raises(PlanError, match="remat budget 1000 bytes.*smallest simulated"):
        _remat(gm, sig, 1000)


@pytest.mark.slow  # (make test's 6 minutes)
def test_dropout_mask_replayed_bit_for_bit():
    model, batch = _gpt(4, dropout=0.1)
    gm, sig, args = _capture(model, batch)
    new = _remat(gm, sig, "sqrt")
    targets = [n.target for n in new.graph.nodes]
    assert run_and_save_rng_state in targets and run_with_rng_state in targets
    ref, _ = _run(gm, args, len(sig.param_names))
    out, _ = _run(new, args, len(sig.param_names))
    assert all(torch.equal(a, b) for a, b in zip(ref, out))  # loss and every gradient
    # and the RNG stream after the step is where it would be without remat
    torch.manual_seed(3)
    with torch.no_grad():
        gm(*args)
    after_ref = torch.rand(4)
    torch.manual_seed(3)
    with torch.no_grad():
        new(*args)
    assert torch.equal(torch.rand(4), after_ref)


def test_collectives_and_mutations_are_never_recomputed():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "g"))
    add_ = g.call_function(aten.add_.Tensor, (x, x))
    relu = g.call_function(aten.relu.default, (x,))
    assert not remat._recomputable(ar)
    assert not remat._recomputable(add_)
    assert remat._recomputable(relu) and remat._cheap(relu)
    # dropout replays its mask on CPU/CUDA; elsewhere torch has no RNG replay: never recompute
    drop = g.call_function(aten.native_dropout.default, (x, 0.1, True))
    drop.meta[ir.VAL] = (torch.empty(2, device="meta"), torch.empty(2, device="meta"))
    assert not remat._recomputable(drop)
    drop.meta[ir.VAL] = (torch.empty(2), torch.empty(2, dtype=torch.bool))
    assert remat._recomputable(drop) and remat._is_random(drop)


def _fit_exponent(ns, ys):
    lx = [math.log(n) for n in ns]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _law(make, ns):
    none, sqrt, extra = [], [], []
    for n in ns:
        model, batch = make(n)
        gm, sig, args = _capture(model, batch)
        new = _remat(gm, sig, "sqrt")
        none.append(_run(gm, args, len(sig.param_names))[1])
        sqrt.append(_run(new, args, len(sig.param_names))[1])
        fwd_flops = sum(cost.node_flops(x) for x in gm.graph.nodes
                        if x.meta.get(ir.REGION) == ir.FORWARD)
        extra.append(new.meta["remat"].recompute_flops / fwd_flops)
    return _fit_exponent(ns, none), _fit_exponent(ns, sqrt), max(extra)


@pytest.mark.slow  # (12 s)
def test_sqrt_law_deep_mlp():
    a_none, a_sqrt, extra = _law(lambda n: _deep_mlp(n, width=128, batch=64), [4, 8, 16, 32, 64])
    assert a_none > 0.9, a_none
    assert a_sqrt <= 0.6, a_sqrt
    assert extra <= 1.0, extra  # at most one extra forward


@pytest.mark.slow
def test_sqrt_law_gpt():
    # 4..32 blocks (an 8x range; 64 doubled the test's time for the same fit: suite time)
    a_none, a_sqrt, extra = _law(lambda n: _gpt(n, n_embd=64, batch=8), [4, 8, 16, 32])
    assert a_none > 0.8, a_none
    assert a_sqrt <= 0.6, a_sqrt
    assert extra <= 1.0, extra


@pytest.mark.slow  # (9 s)
def test_evaluate_runs_in_constant_memory():
    """pm.evaluate frees every value at its last use: flat in depth (within 10%)."""
    peaks = []
    for n in (4, 16, 64):
        model, batch = _deep_mlp(n, width=128, batch=64)
        pm = fxpar.parallelize(model, 1, example_batch=batch, plan={"dp": 1})
        pm.evaluate(batch)  # compile first
        _, peak = measure(lambda: pm.evaluate(batch))
        peaks.append(peak)
    assert max(peaks) <= 1.10 * min(peaks), peaks


def test_plan_remat_runs_end_to_end_and_snapshots():
    model, batch = _gpt(2, dropout=0.1)
    pm = fxpar.parallelize(model, 1, example_batch=batch, plan={"remat": "sqrt"})
    assert list(pm.stage_graphs) == ["capture", "remat", "data_parallel"]
    g = pm.stage_graphs["remat"]["dp"]
    assert g.meta["remat"].mode == "sqrt"
    assert any(n.meta.get(ir.RECOMPUTE) for n in g.graph.nodes)
    loss = pm.step(batch)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", ["mlp", "sum_loss", "gpt", "convbn", "hf_gpt2",
                                  pytest.param("hf_llama", marks=pytest.mark.slow),
                                  "gpt_dropout"])
@pytest.mark.slow  # (make test's 6 minutes)
def test_every_zoo_model_trains_identically_with_remat(name):
    """In-process training, 2 steps: remat "sqrt" and a tight budget change no bit."""
    from workers import fxpar_train
    ref = fxpar_train(name, "adamw", 1, steps=2, plan={"dp": 1})
    info = {}
    got = fxpar_train(name, "adamw", 1, steps=2, plan={"dp": 1, "remat": "sqrt"}, info=info)
    if name.startswith(("gpt", "hf_")):  # tiny MLPs: recomputing would not lower the peak
        assert info["recomputed"] > 0
    assert got[0] == ref[0]
    assert all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])


def test_batch_statistics_are_not_recomputed_under_dp():
    """Recomputing BatchNorm's batch sums at dp > 1 would all-reduce them again in the
    backward; remat keeps them (they are tiny), so remat adds no collective."""
    from fxpar.compiler.pass_manager import run_passes
    from fxpar.core.plan import resolve

    def all_reduces(remat_mode):
        torch.manual_seed(0)
        gm, sig = cap.capture(M.ConvBN(), (torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))))
        ctx = PassContext(signature=sig, group_names={"dp": "g"})
        gm = run_passes(gm, resolve({"dp": 2, "remat": remat_mode}, 2), ctx, "dp", {})
        n_rec = sum(1 for n in gm.graph.nodes if n.meta.get(ir.RECOMPUTE))
        n_ar = sum(1 for n in gm.graph.nodes
                   if n.target == torch.ops._c10d_functional.all_reduce.default)
        return n_ar, n_rec

    base, _ = all_reduces("none")
    n_ar, n_rec = all_reduces("sqrt")
    assert n_rec > 0 and n_ar == base


def test_the_loss_is_not_recomputed_under_dp():
    """A mean loss reduces over the batch: under dp its value and target count are all-reduced
    in the forward, so remat saves them instead of recomputing the loss in the backward."""
    from fxpar.compiler.pass_manager import run_passes
    from fxpar.core.plan import resolve
    torch.manual_seed(0)
    gm, sig = cap.capture(M.ConvBN(), (torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))))
    ctx = PassContext(signature=sig, group_names={"dp": "g"})
    gm = run_passes(gm, resolve({"dp": 2, "remat": "sqrt"}, 2), ctx, "dp", {})
    assert gm.meta["remat"].recomputed  # remat did act
    losses = [n for n in gm.graph.nodes if n.target is torch.ops.aten.nll_loss_forward.default]
    assert len(losses) == 1 and not losses[0].meta.get(ir.RECOMPUTE)

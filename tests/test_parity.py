"""End-to-end parity: fxpar data parallelism on real gloo processes == single-process eager."""
import pytest
import torch

import fxpar
from workers import (OPTIMIZERS, eager_reference, fusion_rank, fxpar_train, parity_rank,
                     plans_rank, zoo)

CASES = [(m, o) for m in zoo() for o in OPTIMIZERS]
RTOL, ATOL = 1e-5, 1e-6
# Adam's update is m / (sqrt(v) + eps): elements whose gradient is near zero (tokens rare in
# the batch, biases the loss barely sees) turn summation-order differences of 1e-9 into
# relative changes of their step. We observed at most 2e-6 after 5 steps at lr 1e-3, so the
# AdamW *parameters* are held to atol 1e-5; losses keep rtol 1e-5 / atol 1e-6.
PARAM_ATOL = {"sgd": ATOL, "adamw": 1e-5}


def tiers(label, world, cases, ci):
    """A sweep's cases as two parameters: `ci` (those CI runs: one of each kind the sweep
    covers) and the rest, marked full (`make test-full`), so every case still runs there."""
    assert all(c in cases for c in ci), [c for c in ci if c not in cases]
    rest = [c for c in cases if c not in ci]
    return ([pytest.param(world, ci, id=f"{label}-ci")] if ci else []) + \
        ([pytest.param(world, rest, id=f"{label}-full", marks=pytest.mark.full)] if rest else [])


def _check(name, opt_name, losses, state):
    ref_losses, ref_state = eager_reference(name, opt_name)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{name}/{opt_name} losses: {m}")
    assert state.keys() == ref_state.keys()
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=PARAM_ATOL[opt_name],
                                   msg=lambda m: f"{name}/{opt_name} {k}: {m}")


@pytest.mark.parametrize("name,opt_name", CASES)
@pytest.mark.slow  # (make test's 6 minutes)
def test_dp1_single_process(name, opt_name):
    losses, state = fxpar_train(name, opt_name, 1)
    _check(name, opt_name, losses, state)


DP2_CASES = [c for c in CASES if c[1] == "adamw" or c[0] in ("mlp", "convbn", "gpt")]
DP4_CASES = [c for c in CASES if c[1] == "adamw" and c[0] in ("gpt", "convbn", "hf_llama")]


@pytest.mark.slow
@pytest.mark.parametrize("dp,cases", [
    *tiers("dp2", 2, DP2_CASES, [("gpt", "adamw"), ("gpt", "sgd"), ("convbn", "adamw"),
                                 ("hf_llama", "adamw")]),
    *tiers("dp4", 4, DP4_CASES, [])])
def test_dp_multiprocess(dp, cases):
    """Every zoo model at dp=2 with AdamW, and with SGD (momentum) those whose buffers or
    losses differ in kind (a plain MLP, BatchNorm, the GPT); dp=4 repeats a GPT, BatchNorm's
    statistics over 4 ranks and HF Llama with AdamW (the rest adds nothing at 4 ranks that 2
    do not show, at twice the time on CI's 2 cores)."""
    results = fxpar.launch(parity_rank, dp, cases, dp)
    for (name, opt_name), (losses, state) in results[0].items():
        for r in range(1, dp):  # every rank reports the same global loss
            assert results[r][(name, opt_name)][0] == losses
        _check(name, opt_name, losses, state)


REMAT_PLANS = [{"remat": "sqrt"}, {"remat": 400_000}, {"remat": "auto"}]


# the fixed budget on the GPT only (its search is the slow one; suite time); the reference is
# plain dp=2 as written ({}), not "auto" (the planner may pick ZeRO)
REMAT_CASES = [(m, "adamw", p) for m in ("gpt", "hf_llama", "gpt_dropout")
               for p in REMAT_PLANS if m == "gpt" or p["remat"] != 400_000]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", tiers("dp2", 2, REMAT_CASES, []))  # (CI: test_remat)
def test_remat_dp2_equals_no_remat(world, cases):
    """dp=2 training with each remat mode equals training without remat: bit for bit here
    (recompute replays the same ops on the same inputs, dropout masks included)."""
    refs = [(m, "adamw", {}) for m in dict.fromkeys(m for m, _, _ in cases)]
    res = fxpar.launch(plans_rank, world, refs + cases)[0]
    for m, _, p in cases:
        ref_losses, ref_state, _ = res[(m, "adamw", repr({}))]
        losses, state, info = res[(m, "adamw", repr(p))]
        if p["remat"] != "auto":  # auto fits this RAM: only cheap ops may be recomputed
            assert info["recomputed"] > 0, (m, p)
        assert losses == ref_losses, (m, p)
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), (m, p, k)


def _eager_eval(name, state):
    """Loss of the trained weights on batch 0, in plain PyTorch (what pm.evaluate must give)."""
    from workers import build
    model, batch_fn, loss_fn = build(name)
    model.load_state_dict(state)
    with torch.no_grad():
        b = batch_fn(0)
        out = loss_fn(model, b) if loss_fn else (model(**b) if isinstance(b, dict) else model(b))
    return (out.loss if hasattr(out, "loss") else out).item()


ZERO_PLANS = [{"zero": 1}, {"zero": 2}, {"zero": 2, "remat": "sqrt"}, {"zero": 3},
              {"zero": 3, "remat": "sqrt"}]


# dp=4 repeats the stages on HF Llama without remat (remat x ZeRO and the GPT are dp=2's)
ZERO2_CASES = [(m, "adamw", p) for m in ("gpt", "hf_llama") for p in ZERO_PLANS]
ZERO4_CASES = [("hf_llama", "adamw", p) for p in ZERO_PLANS if "remat" not in p]


@pytest.mark.slow
@pytest.mark.parametrize("dp,cases", [
    *tiers("dp2", 2, ZERO2_CASES, [("gpt", "adamw", {"zero": 1}), ("gpt", "adamw", {"zero": 2}),
                                   ("hf_llama", "adamw", {"zero": 3, "remat": "sqrt"})]),
    *tiers("dp4", 4, ZERO4_CASES, [])])
def test_zero_equals_single_process(dp, cases):
    """ZeRO-1/2/3 (optimizer state; + gradients reduce-scattered; + parameters sharded and
    gathered before use) with AdamW, also combined with remat: equal to single-process eager
    training. Memory held per rank at dp=4: Adam state, and at zero=3 params + grads + Adam
    state, <= 30% of unsharded (ideal 25%; the rest is padding to a multiple of dp)."""
    results = fxpar.launch(plans_rank, dp, cases)
    for m, _, p in cases:
        losses, state, info = results[0][(m, "adamw", repr(p))]
        for r in range(1, dp):
            assert results[r][(m, "adamw", repr(p))][0] == losses
        _check(m, "adamw", losses, state)
        torch.testing.assert_close(info["eval"], _eager_eval(m, state), rtol=RTOL, atol=ATOL)
        if dp == 4:  # each rank keeps a quarter (+ padding)
            assert info["opt_state_fraction"] <= 0.30, info
            if p["zero"] == 3:
                assert info["model_state_fraction"] <= 0.30, info


@pytest.mark.slow
@pytest.mark.full
def test_zero3_with_microbatches_equals_single_process():
    """ZeRO-3 at pp=1 with microbatches (forward and backward run as parts, each layer
    gathered again for the backward; + remat on HF Llama): equal to eager training."""
    _check_plans(2, [("gpt", "adamw", {"dp": 2, "zero": 3, "microbatches": 2}),
                     ("hf_llama", "adamw", {"dp": 2, "zero": 3, "microbatches": 2,
                                            "remat": "sqrt"})])


@pytest.mark.slow
@pytest.mark.full  # (4 ranks on CI's 2 cores)
def test_zero3_with_gathers_stopped_by_the_memory_limit_equals_single_process():
    """ZeRO-3 at dp=4 on an HF Llama whose layers outweigh its activations (workers'
    hf_llama_3x64), as a 12 x 1024 Llama's do: per-layer gathers and reduce-scatters, the
    overlap pass's backward prefetch stopped by the memory limit right below packing copies
    (the graph: tests/test_overlap.py): equal to eager training."""
    _check_plans(4, [("hf_llama_3x64", "adamw", {"dp": 4, "zero": 3})])


def _check_plans(world, cases):
    """Train every (model, optimizer, plan) case on `world` ranks: every rank's losses agree
    and equal eager training, final parameters too; evaluate() equals eager. Returns rank
    0's info per case."""
    results = fxpar.launch(plans_rank, world, cases)
    infos = []
    for name, opt_name, plan in cases:
        losses, state, info = results[0][(name, opt_name, repr(plan))]
        for r in range(1, world):
            assert results[r][(name, opt_name, repr(plan))][0] == losses, (name, plan)
        _check(name, opt_name, losses, state)
        torch.testing.assert_close(info["eval"], _eager_eval(name, state), rtol=RTOL, atol=ATOL)
        infos.append(info)
    return infos


OFFLOAD_CASES = [("gpt", "adamw", {**p, "offload_optimizer": True}) for p in
                 ({"dp": 2}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3}, {"pp": 2, "microbatches": 2},
                  {"tp": 2})]


@pytest.mark.slow
def test_offload_optimizer_equals_single_process():
    """Plan.offload_optimizer (runtime/host_optimizer.py) under dp, ZeRO-2 and -3 (the host
    copies are the flat shards), a pipeline (each rank its stage's parameters) and tp (the
    slices): equal to eager training, the optimizer stepping host copies that hold its state
    and taking each step's gradients from the device tensors."""
    results = fxpar.launch(plans_rank, 2, OFFLOAD_CASES)
    for name, opt_name, plan in OFFLOAD_CASES:
        losses, state, info = results[0][(name, opt_name, repr(plan))]
        assert results[1][(name, opt_name, repr(plan))][0] == losses, plan
        _check(name, opt_name, losses, state)
        off = info["offloaded"]
        assert off["steps_masters"] and off["state_bytes"] > 0 and off["bytes_out"] > 0, plan


UNEVEN_CASES = [("gpt_padded", "sgd", p) for p in
                ({"dp": 2}, {"dp": 2, "zero": 2}, {"dp": 2, "remat": "sqrt"})]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", tiers("dp2", 2, UNEVEN_CASES, []))
def test_mean_loss_over_uneven_targets_is_exact_under_dp(world, cases):
    """gpt_padded: the first rows' targets are mostly ignored (-100), so the two dp ranks count
    different targets. Losses, evaluate() and parameters equal single-process training only
    if the mean divides the global sum by the global count (not a mean of per-rank means)."""
    _check_plans(world, cases)


def _pp_cases(models, schedules, microbatches, extra=None):
    cases = []
    for m in models:
        for s in schedules:
            for mb in microbatches:
                if s == "interleaved" and mb % 2:
                    continue
                cases.append((m, "adamw", {"schedule": s, "microbatches": mb, **(extra or {})}))
    return cases


# each schedule at two microbatch counts, together 1, 2, 4 and 8 (every count under every
# schedule: make test-full's sweep is the zoo's; tests/test_schedules.py checks the orders)
PP2_CASES = (_pp_cases(["gpt"], ["gpipe", "zero-bubble"], [1, 4], {"pp": 2})
             + _pp_cases(["gpt"], ["1f1b", "interleaved"], [2, 8], {"pp": 2})
             + _pp_cases(["hf_gpt2", "hf_llama"], ["1f1b", "zero-bubble"], [4], {"pp": 2})
             + [("gpt", "adamw", {"pp": 2, "microbatches": 2, "remat": "sqrt"}),
                ("gpt", "sgd", {"pp": 1, "microbatches": 4}),           # gradient accumulation
                ("gpt", "adamw", {"dp": 2, "microbatches": 4}),  # ... reduced once over dp,
                # inside the last backward (pipeline.with_reductions); and reduce-scattered
                ("gpt", "adamw", {"dp": 2, "microbatches": 4, "zero": 2}),
                ("hf_llama", "adamw", {"dp": 2, "microbatches": 2, "zero": 1}),
                ("gpt", "adamw", {"dp": 2, "microbatches": 2, "overlap": False})])
PP4_CASES = (_pp_cases(["gpt"], ["gpipe", "1f1b", "interleaved", "zero-bubble"], [4],
                       {"pp": 4})
             + _pp_cases(["gpt"], ["interleaved"], [8], {"pp": 4})
             + _pp_cases(["hf_llama"], ["1f1b"], [4], {"pp": 4})
             + _pp_cases(["gpt", "hf_llama"], ["1f1b"], [2], {"pp": 2, "dp": 2})
             + _pp_cases(["hf_gpt2"], ["zero-bubble"], [2], {"pp": 2, "dp": 2})
             + [("gpt", "adamw", {"pp": 2, "dp": 2, "zero": 1, "microbatches": 2}),  # ZeRO x pp
                # the stages outermost on the mesh: each stage's dp group neighbouring ranks
                ("gpt", "adamw", {"pp": 2, "dp": 2, "zero": 1, "microbatches": 2,
                                  "pp_outer": True}),
                ("hf_llama", "adamw", {"pp": 2, "dp": 2, "zero": 2, "microbatches": 2,
                                       "schedule": "zero-bubble"})])


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [
    *tiers("pp2", 2, PP2_CASES, [
        ("gpt", "adamw", {"schedule": "gpipe", "microbatches": 4, "pp": 2}),
        ("gpt", "adamw", {"schedule": "interleaved", "microbatches": 2, "pp": 2}),
        ("hf_llama", "adamw", {"schedule": "1f1b", "microbatches": 4, "pp": 2}),
        ("hf_gpt2", "adamw", {"schedule": "zero-bubble", "microbatches": 4, "pp": 2}),
        ("gpt", "adamw", {"dp": 2, "microbatches": 4}),
        ("gpt", "adamw", {"dp": 2, "microbatches": 4, "zero": 2})]),
    *tiers("pp4", 4, PP4_CASES, [])])
def test_pipeline_equals_single_process(world, cases):
    """Every schedule, microbatches 1..8, pp = 2 and 4, pp=2 x dp=2 (also with ZeRO 1 and 2,
    and with the stages outermost on the mesh), with remat; small GPT,
    HF GPT-2 and HF Llama: loss per step and final parameters equal single-process eager
    training (rtol 1e-5), on every rank; evaluate() too."""
    _check_plans(world, cases)


TP2_CASES = ([("gpt", "adamw", {"tp": 2, **sp}) for sp in (
    {}, {"sequence_parallel": True}, {"tp_style": "all-gather"})]
    + [("hf_gpt2", "adamw", {"tp": 2}), ("hf_gpt2", "adamw", {"tp": 2, "tp_style": "all-gather"}),
       ("hf_llama", "adamw", {"tp": 2}), ("hf_llama", "adamw", {"tp": 2, "sequence_parallel": True}),
       ("gpt", "adamw", {"tp": 2, "remat": "sqrt"}),       # recomputed fused QKV split
       ("hf_llama", "adamw", {"tp": 2, "remat": "sqrt", "sequence_parallel": True})])
TP4_CASES = [("gpt", "adamw", {"tp": 4}),
             ("hf_llama", "adamw", {"dp": 2, "tp": 2}),
             ("gpt", "adamw", {"dp": 2, "tp": 2, "zero": 1}),
             ("gpt", "adamw", {"dp": 2, "tp": 2, "sequence_parallel": True}),
             ("gpt", "adamw", {"pp": 2, "tp": 2, "microbatches": 2}),
             ("hf_llama", "adamw", {"pp": 2, "tp": 2, "microbatches": 2,
                                    "schedule": "zero-bubble"})]
TP8_CASES = [("gpt", "adamw", {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2})]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [
    *tiers("tp2", 2, TP2_CASES, [
        ("gpt", "adamw", {"tp": 2, "sequence_parallel": True}),
        ("hf_gpt2", "adamw", {"tp": 2, "tp_style": "all-gather"}),
        ("hf_llama", "adamw", {"tp": 2})]),
    *tiers("tp4-dp-pp", 4, TP4_CASES, [
        ("hf_llama", "adamw", {"dp": 2, "tp": 2}),
        ("gpt", "adamw", {"pp": 2, "tp": 2, "microbatches": 2})]),
    *tiers("dp2-pp2-tp2", 8, TP8_CASES, [])])
def test_tensor_parallel_equals_single_process(world, cases):
    """tp = 2 and 4 (small GPT, HF GPT-2 with fused QKV, HF Llama with GQA; all-reduce form,
    with sequence parallelism, and the all-gather form; with remat), dp=2 x tp=2 (also ZeRO-1, also sequence-parallel), pp=2 x tp=2, and
    dp=2 x pp=2 x tp=2 on 8 CPU ranks: loss per step and final
    parameters (full_state_dict gathers the tp shards and undoes the fused-QKV interleave)
    equal single-process eager training (rtol 1e-5); evaluate() too."""
    _check_plans(world, cases)


@pytest.mark.slow
def test_tensor_parallel_dropout_draws_the_single_process_masks():
    """Dropout 0.1 (embeddings, attention probabilities with the heads split, residuals):
    at tp=2 a split dropout draws the whole mask and keeps its slice, a replicated one the
    same mask on both ranks, so training equals single-process fxpar training with the same
    seed (same masks), step for step."""
    ref, _ = fxpar_train("gpt_dropout", "adamw", 1)
    res = fxpar.launch(plans_rank, 2, [("gpt_dropout", "adamw", {"tp": 2})])
    got = res[0][("gpt_dropout", "adamw", repr({"tp": 2}))][0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=ATOL)


GPT_KERNELS = {"layer_norm", "layer_norm_backward", "flash_attention",
               "flash_attention_backward", "cross_entropy", "cross_entropy_backward"}
FUSION_CASES = [("gpt", "adamw", {"dp": 2}, GPT_KERNELS),
                ("gpt", "adamw", {"pp": 2, "microbatches": 2}, GPT_KERNELS),
                # tp: vocab-parallel cross-entropy stays as its sharded ops; GQA attention
                ("hf_llama", "adamw", {"tp": 2}, {"rms_norm", "flash_attention",
                                                  "flash_attention_backward"})]


@pytest.mark.slow
def test_fusion_equals_unfused_training():
    """dp=2 and pp=2 training of the small GPT (and HF Llama at tp=2) with the fusion pass on
    (Triton interpreter on CPU) equals the same plans with fusion off (rtol 1e-5), and the
    fused program really runs the hand-written kernels."""
    res = fxpar.launch(fusion_rank, 2, [case[:3] for case in FUSION_CASES])[0]
    for m, o, p, kernels in FUSION_CASES:
        (ref_losses, ref_state, ref_info), (losses, state, info) = res[(m, o, repr(p))]
        assert "fused_kernels" not in ref_info
        assert set(info["fused_kernels"]) == kernels, (m, p, set(info["fused_kernels"]))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL,
                                   atol=ATOL)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=PARAM_ATOL[o])

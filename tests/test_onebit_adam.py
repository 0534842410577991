"""1-bit Adam (Plan.grad_compression="1bit-adam", runtime/onebit_adam.py): the sign packing
and error feedback on tensors, the graph without gradient all-reduces its compressed phase
runs (passes/data_parallel.without_gradient_reduction), the update with the frozen second
moment against a single-process reference, the plan errors; multi-process: the compressed
mean is the same on every rank and tracks the true mean over steps, training follows the
uncompressed plan on a fraction of the bytes, and a checkpoint resumes it."""
import math

import pytest
import torch

import fxpar
from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.graphs import count_ops
from fxpar.examples import models as M
from fxpar.passes.data_parallel import without_gradient_reduction
from fxpar.runtime import onebit_adam as ob

from test_data_parallel import compile_dp

c10d = torch.ops._c10d_functional


def test_signs_pack_eight_to_a_byte_and_unpack_as_plus_minus_one():
    x = torch.randn(3, ob.BLOCK)
    x[0, :5], x[1, :3] = 0.0, -0.0  # signed zeros: as torch.copysign reads them
    packed = ob.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, ob.BLOCK // 8)
    assert torch.equal(ob.unpack_signs(packed), torch.copysign(torch.ones_like(x), x))


def test_compression_keeps_what_it_loses_as_the_next_error():
    """decompress(compress(x, e)) + e' == x + e: nothing is lost over steps, only delayed;
    each block's scale is the root mean square of its real values, and padding stays 0."""
    torch.manual_seed(0)
    x = torch.randn(4 * ob.BLOCK) * torch.logspace(-4, 0, 4).repeat_interleave(ob.BLOCK)
    blocks = ob.Blocks(torch.tensor([256.0, 256, 256, 100]))
    x[-156:] = 0.0
    e = torch.randn_like(x) * 1e-3
    e[-156:] = 0.0
    before = x + e
    rows = ob.compress(x, e, blocks)
    assert rows.dtype == torch.uint8 and rows.shape == (4, ob.BLOCK // 8 + 4)
    got = ob.decompress(rows, blocks)
    torch.testing.assert_close(got + e, before, rtol=0, atol=1e-6)
    assert not got[-156:].any() and not e[-156:].any()
    rms = torch.stack([b[:int(n)].square().mean().sqrt() for b, n in
                       zip(before.view(4, -1), blocks.counts)])
    torch.testing.assert_close(got.view(4, -1).abs().amax(1), rms)
    assert rows.numel() / (4 * x.numel()) < 0.036  # vs fp32


def test_the_local_graph_drops_the_gradient_all_reduces_and_keeps_the_loss():
    """dp=2 MLP: one gradient bucket all-reduce + the loss's; the local graph keeps only the
    loss's, and its gradient outputs are the Partial sums the bucket all-reduce read."""
    gm, sig, _, _ = compile_dp(M.MLP(), (torch.randn(8, 16), torch.randn(8, 4)), 2)
    assert count_ops(gm, c10d.all_reduce.default) == 2
    local = without_gradient_reduction(gm, sig.num_params, "dp-group")
    assert count_ops(local, c10d.all_reduce.default) == 1
    assert count_ops(local, c10d.wait_tensor.default) == 1
    assert count_ops(gm, c10d.all_reduce.default) == 2  # (a copy: the program's graph kept)
    (ar,) = [n for n in local.graph.nodes if n.target is c10d.all_reduce.default]
    out = next(n for n in local.graph.nodes if n.op == "output")
    assert ar in {a for a in out.args[0][0].all_input_nodes} | {
        x for a in out.args[0][0].all_input_nodes for x in a.all_input_nodes} or \
        ar.meta[ir.VAL].numel() <= 2  # the loss's (sum, count) pair
    local.graph.lint()


def test_the_program_carries_the_local_graph_only_when_compressing():
    cfg = M.GPTConfig(n_layer=1)
    batch = M.gpt_batch(cfg, 4)
    plain = fxpar.compile(M.GPT(cfg), 2, example_batch=batch, plan={"dp": 2})
    comp = fxpar.compile(M.GPT(cfg), 2, example_batch=batch,
                         plan={"dp": 2, "grad_compression": "1bit-adam"})
    assert plain.local_graph is None and comp.local_graph is not None
    assert count_ops(comp.local_graph, c10d.all_reduce.default) < \
        count_ops(comp.graph, c10d.all_reduce.default)
    assert "local gradients" in comp.stage_graphs


def test_plan_errors_name_what_1bit_adam_needs():
    ok = dict(dp=2, tp=1, pp=1, grad_compression="1bit-adam")
    fxpar.Plan(**ok).validate(2)
    for bad, match in (({"dp": 1}, "dp > 1"), ({"zero": 2}, "ZeRO"),
                       ({"microbatches": 2, "schedule": "gpipe"}, "one microbatch"),
                       ({"max_grad_norm": 1.0}, "max_grad_norm=None"),
                       ({"precision": "fp16"}, "fp16"), ({"compression_warmup": 0}, "positive"),
                       ({"grad_compression": "2bit"}, "one of")):
        plan = {**ok, **bad}
        world = plan["dp"]
        with pytest.raises(PlanError, match=match):
            fxpar.Plan(**plan).validate(world)


def test_an_optimizer_other_than_adam_is_refused_by_name():
    with pytest.raises(PlanError, match="torch.optim.Adam or AdamW, got SGD"):
        ob.OneBitAdam(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), 10, 2, 0, "g")


def test_the_compressed_mean_is_one_tensor_on_every_rank_and_tracks_the_true_mean():
    """2 ranks, the same vectors 80 times: each result is equal on both ranks and one bit a
    value (one step is far off), but the error feedback keeps the carried errors bounded,
    so the running average of the results converges to the true mean as 1/steps."""
    import workers
    res = fxpar.launch(workers.onebit_mean_rank, 2, 80)
    (x0, outs0), (x1, outs1) = res[0], res[1]
    for a, b in zip(outs0, outs1):
        assert torch.equal(a, b)
    true = (x0 + x1) / 2

    def off(t):  # the average of the first t results, relative to the true mean
        return float((torch.stack(outs0[:t]).mean(0) - true).norm() / true.norm())
    assert off(1) > 0.5 and off(20) < 0.2 and off(80) < 0.06 and off(80) < 0.4 * off(20), \
        [off(t) for t in (1, 20, 80)]


def _reference(name, warmup, steps):
    """One process: the user's optimizer for `warmup` steps, then Adam's update with the
    momentum fed the whole batch's gradient and the second moment frozen, except at steps
    warmup * 2^j, which update it too."""
    import workers
    torch.manual_seed(0)
    model = M.MLP()
    opt = workers.ONEBIT_OPTIMIZERS[name](model.parameters())
    losses, v_steps = [], warmup
    for s in range(steps):
        n = s + 1
        loss = model(workers.onebit_batch(s))
        loss.backward()
        losses.append(loss.item())
        if n <= warmup:
            opt.step()
        else:
            refresh = n % warmup == 0 and (n // warmup) & (n // warmup - 1) == 0
            v_steps += refresh
            with torch.no_grad():
                for g in opt.param_groups:
                    b1, b2 = g["betas"]
                    for p in g["params"]:
                        st = opt.state[p]
                        grad = p.grad + g["weight_decay"] * p if type(opt) is torch.optim.Adam \
                            else p.grad
                        st["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
                        if refresh:
                            st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                            if g["amsgrad"]:
                                st["max_exp_avg_sq"] = torch.maximum(st["max_exp_avg_sq"],
                                                                     st["exp_avg_sq"])
                        st["step"] += 1
                        if type(opt) is torch.optim.AdamW:
                            p.mul_(1 - g["lr"] * g["weight_decay"])
                        v = st["max_exp_avg_sq"] if g["amsgrad"] else st["exp_avg_sq"]
                        denom = v.sqrt() / math.sqrt(1 - b2 ** v_steps) + g["eps"]
                        p.sub_(g["lr"] / (1 - b1 ** float(st["step"])) * st["exp_avg"] / denom)
        opt.zero_grad()
    return losses, model.state_dict()


@pytest.mark.parametrize("name", [pytest.param("adam_l2", marks=pytest.mark.slow), "adamw",
                                  pytest.param("adam_amsgrad", marks=pytest.mark.slow)])
def test_the_update_after_the_warmup_is_adam_with_its_second_moment_frozen(name):
    """The compressed mean swapped for the exact mean: 2 ranks equal the single-process
    reference (warm-up: the user's optimizer; after: Adam with v frozen, its bias
    correction frozen with it, but for the refresh at step 6) - L2 weight decay, decoupled
    weight decay, amsgrad."""
    import workers
    losses, state = fxpar.launch(workers.onebit_exact_mean_rank, 2, name, 3, 8)[0]
    ref_losses, ref_state = _reference(name, 3, 8)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_a_checkpoint_resumes_the_compressed_phase_with_fresh_errors(tmp_path):
    """Saved mid-compression, loaded into a fresh model: Adam's state and the step count
    come back (the compressed phase goes on), the carried errors restart at zero, and
    training goes on near where it was; a plan without compression is refused."""
    import workers
    plan = {"dp": 2, "grad_compression": "1bit-adam", "compression_warmup": 3}
    path = str(tmp_path / "ck")
    before, after, reset, step = fxpar.launch(workers.onebit_resume_rank, 2, path, plan, 6,
                                              2)[0]
    assert reset and step == 8
    assert abs(after[0] - before[-1]) < 0.1 * before[-1], (before, after)
    with pytest.raises(Exception, match="grad_compression: checkpoint '1bit-adam"):
        fxpar.launch(workers.onebit_resume_rank, 2, str(tmp_path / "ck2"), plan, 4, 0,
                     {"dp": 2})


@pytest.mark.slow
def test_1bit_adam_trains_as_uncompressed_adam_on_a_fraction_of_the_bytes():
    """2 ranks, the example GPT learning a Markov chain's language from fresh batches for 200
    AdamW steps (lr 1e-2: near its plateau by then), 1-bit Adam after 20 warm-up steps: the
    warm-up is the uncompressed plan exactly, the end within 2% of its loss (the mean of
    the last 10 steps; a fall of over half from the start), and the momentum's two
    collectives carry <= 1/4 of the gradient all-reduce's bytes (~0.08x at this size, where
    the GPT's 32-element biases are padded to a block of 256)."""
    import workers
    plans = [{"dp": 2}, {"dp": 2, "grad_compression": "1bit-adam", "compression_warmup": 20}]
    res = fxpar.launch(workers.quantized_rank, 2, plans, 200, "markov", 1e-2)[0]
    (lp, bp), (lq, bq) = res[repr(plans[0])], res[repr(plans[1])]
    assert lq[:21] == lp[:21]  # (step 21's loss is the last warm-up update's)
    end_p, end_q = sum(lp[-10:]) / 10, sum(lq[-10:]) / 10
    print(f"loss {lp[0]:.4f} -> {end_p:.4f}, 1-bit {end_q:.4f}", bq, bp)
    assert end_p < 0.5 * lp[0], lp
    assert abs(end_q - end_p) <= 0.02 * end_p, (end_q, end_p)
    assert bq["all_to_all"] + bq["all_gather"] <= 0.25 * bp["all_reduce"], (bq, bp)


def test_the_second_moment_is_refreshed_at_doubling_intervals():
    o = ob.OneBitAdam(torch.optim.Adam([torch.zeros(1, requires_grad=True)]), 20, 2, 0, "g")
    assert [n for n in range(1, 700) if o.refreshing(n)] == [40, 80, 160, 320, 640]
    assert [o.compressing(n) for n in (20, 21, 39, 40, 41)] == [False, True, True, False, True]
    assert [o.variance_steps(n) for n in (10, 20, 39, 40, 79, 80, 160)] == \
        [10, 20, 20, 21, 21, 22, 23]


@pytest.mark.slow
def test_1bit_adam_composes_with_tensor_parallelism():
    """4 ranks, dp=2 x tp=2: each tp rank averages its slices over its own dp group; with the
    compressed mean swapped for the exact one it equals the single-process reference, as
    dp alone does."""
    import workers
    losses, state = fxpar.launch(workers.onebit_exact_mean_rank, 4, "adamw", 3, 8,
                                 {"dp": 2, "tp": 2})[0]
    ref_losses, ref_state = _reference("adamw", 3, 8)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)

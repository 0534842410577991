"""core/cost.py: FLOPs equal FlopCounterMode's, bytes per node, and the liveness simulator
against the measured tracker (runtime/memtrack.py)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxpar.compiler import capture as cap
from fxpar.core import cost, ir
from fxpar.compiler.pass_manager import PassContext
from fxpar.examples import models as M
from fxpar.passes import remat
from fxpar.runtime.memtrack import MemoryTracker, measure

aten = torch.ops.aten


def _case(name):
    torch.manual_seed(0)
    if name == "mlp":
        return M.MLP(), (torch.randn(8, 16), torch.randn(8, 4))
    if name == "deep_mlp":
        return M.DeepMLP(6), (torch.randn(8, 16), torch.randn(8, 4))
    if name == "gpt":
        cfg = M.GPTConfig(dropout=0.1)
        return M.GPT(cfg), M.gpt_batch(cfg, 8, seed=0)
    if name == "convbn":
        return M.ConvBN(), (torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,)))
    if name == "hf_llama":
        return M.hf_llama(), M.hf_lm_batch(128, 8, 16, seed=0)


def _args(model, sig, batch):
    params = dict(model.named_parameters(remove_duplicate=False))
    bufs = dict(model.named_buffers(remove_duplicate=False))
    return ([params[n] for n in sig.param_names] + [bufs[n] for n in sig.buffer_names]
            + list(cap.flatten_batch(batch, sig)))


@pytest.mark.parametrize("name", ["mlp", "gpt", "convbn"])
def test_flops_equal_flop_counter_mode(name):
    """Same totals as FlopCounterMode (given our formula for CPU attention, which it lacks),
    but that a causal attention kernel counts the (L+1)/2L of the query-key pairs it
    computes where FlopCounterMode counts all."""
    model, batch = _case(name)
    gm, sig = cap.capture(model, batch)
    with FlopCounterMode(display=False, custom_mapping=cost.EXTRA_FLOP_FORMULAS) as fc, \
            torch.no_grad():
        gm(*_args(model, sig, batch))
    causal = [n for n in gm.graph.nodes if cost.node_flops(n) and cost.causal_share(n) < 1]
    every_pair = sum(cost.node_flops(n) / (cost.causal_share(n) if n in causal else 1)
                     for n in gm.graph.nodes)
    assert every_pair == pytest.approx(fc.get_total_flops(), rel=1e-6) and every_pair > 0


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm"), reason="no grouped_mm")
def test_grouped_mm_flops_are_its_groups_matmuls():
    """aten._grouped_mm (HF MoE experts) has no FlopCounterMode formula; ours counts what its
    groups' matmuls do, in each of its forms (the forward's 2-D x 3-D, the weight gradient's
    2-D x 2-D with groups along the contraction, the batched 3-D x 3-D)."""
    offs = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    a, w, g = torch.randn(16, 8), torch.randn(4, 8, 8), torch.randn(16, 8)
    cases = [((a, w, offs), sum(2 * 4 * 8 * 8 for _ in range(4))),
             ((a.t().contiguous(), g, offs), sum(2 * 8 * 4 * 8 for _ in range(4))),
             ((torch.randn(4, 16, 8), w), 4 * 2 * 16 * 8 * 8)]
    for args, groups in cases:
        with FlopCounterMode(display=False, custom_mapping=cost.EXTRA_FLOP_FORMULAS) as fc:
            torch._grouped_mm(*args)
        assert fc.get_total_flops() == groups


def test_bytes_of_a_matmul_and_a_view():
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    mm = g.call_function(aten.mm.default, (a, b))
    v = g.call_function(aten.view.default, (mm, [6, 5]))
    g.output(v)
    a.meta[ir.VAL], b.meta[ir.VAL] = torch.empty(3, 4), torch.empty(4, 10)
    mm.meta[ir.VAL], v.meta[ir.VAL] = torch.empty(3, 10), torch.empty(6, 5)
    assert cost.node_bytes(mm) == ((12 + 40) * 4, 30 * 4)
    assert cost.node_flops(mm) == 2 * 3 * 4 * 10
    assert cost.is_view(v) and cost.node_bytes(v) == (0, 0)


@pytest.mark.parametrize("name", ["mlp", "gpt", "convbn", "hf_llama"])
@pytest.mark.parametrize("mode", ["none", "sqrt"])
@pytest.mark.slow  # (make test's 6 minutes)
def test_simulator_matches_tracker(name, mode):
    """Peak within 5% (in practice: equal) and the same live bytes after every node."""
    model, batch = _case(name)
    gm, sig = cap.capture(model, batch)
    if mode != "none":
        gm = remat.run(gm, remat.Options(remat=mode, dp=1), PassContext(signature=sig))
        gm.recompile()
    args = _args(model, sig, batch)
    with torch.no_grad():
        _, measured = measure(lambda: gm(*args))
    tl = cost.simulate_liveness(gm, count_inputs=False)
    simulated = tl.peak_total - tl.peak["params"]
    assert abs(simulated - measured) <= 0.05 * measured, (simulated, measured)

    # node by node: run with an interpreter that frees at last use, as FX's code does
    interp = torch.fx.Interpreter(gm, garbage_collect_values=True)
    interp.args_iter, interp.env = iter(args), {}
    live = []
    with torch.no_grad(), MemoryTracker() as mt:
        for n in gm.graph.nodes:
            if n.op == "output":
                break
            interp.env[n] = interp.run_node(n)
            for dead in interp.user_to_last_uses.get(n, []):
                del interp.env[dead]
            live.append(sum(b for b, _ in mt.events))
    sim_live = [tl.live["activations"][i] + tl.live["grads"][i] for i in range(len(live))]
    assert live == sim_live


def test_simulator_categories():
    model, batch = _case("mlp")
    gm, sig = cap.capture(model, batch)
    p_bytes = sum(p.numel() * 4 for p in model.parameters())
    tl = cost.simulate_liveness(gm, optimizer_state_bytes=2 * p_bytes)
    assert tl.peak["params"] == p_bytes
    assert tl.peak["grads"] == p_bytes           # every gradient is alive at the end
    assert tl.peak["optimizer"] == 2 * p_bytes
    assert tl.live["grads"][0] == 0              # none before the backward
    assert tl.peak["activations"] > 0
    assert tl.peak_total <= sum(tl.peak.values())


def test_ring_attention_time_against_gathering():
    """cost.ring_attention_time: where a block's kernels outlast its transfer the ring's
    steps cost the rank's kernels (its transfers hidden) and a latency each, under the
    gather's all-gather + kernels; where the kernels are tiny the ring's steps pay their
    transfers' latency and their own, and the gather wins; a backward's float32 gradient
    accumulators add to the ring's steps and a last hop, and the gather side's backward
    reduce-scatters (and with regather all-gathers again)."""
    prof = cost.DeviceProfile("x", flops=1e12, bandwidth=1e12, alpha=1e-5,
                              link_bandwidth=1e9)
    kv, n = 8e6, 4
    ring, gather = cost.ring_attention_time(kv, 1.0, n, prof)
    assert ring == pytest.approx(1.0 / n + 3 * 1e-5)
    assert gather == pytest.approx(1.0 / n + 3 * 1e-5 + 0.75 * kv / 1e9)
    ring, gather = cost.ring_attention_time(1e3, 1e-6, 8, prof)
    assert ring > gather
    fwd = cost.ring_attention_time(kv, 1e-3, n, prof)[0]
    bwd, gather_b = cost.ring_attention_time(kv, 1e-3, n, prof, acc_bytes=2 * kv)
    assert bwd > fwd
    scatter = 3 * 1e-5 + 0.75 * kv / 1e9  # (the backward reads the forward's gathered copy)
    assert gather_b == pytest.approx(1e-3 / n + scatter)
    again = cost.ring_attention_time(kv, 1e-3, n, prof, acc_bytes=2 * kv, regather=True)[1]
    assert again == pytest.approx(gather_b + scatter)  # (an all-gather costs what it scatters)

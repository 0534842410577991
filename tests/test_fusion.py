"""Fusion pass: the hand-written kernels it swaps in (under the Triton interpreter on CPU),
memory traffic from the cost model, pricing of launches, the pass on whole models, and the
cross-entropy rewrites for Inductor."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxpar
from fxpar.compiler import capture
from fxpar.core import cost, ir
from fxpar.core.plan import pass_options
from fxpar.compiler.pass_manager import PassContext
from fxpar.examples.models import GPT, GPTConfig, gpt_batch, hf_llama, hf_lm_batch
from fxpar.kernels.jit import interpreter, stored_as
from fxpar.kernels import launch_cost
from fxpar.passes import fusion

aten = torch.ops.aten


def _graph(fn, *args, region=ir.FORWARD):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[ir.REGION] = region
            n.meta[ir.MODULE] = ""
    return gm


def _softmax(x):  # what a decomposed softmax looks like in a graph
    m = aten.amax(x, [-1], True)
    e = aten.exp(aten.sub(x, m))
    return aten.div(e, aten.sum(e, [-1], True))


# --- memory traffic (cost model) --------------------------------------------------------------

def test_softmax_traffic_counted_op_by_op_and_for_the_kernel():
    M, N = 64, 100
    gm = _graph(_softmax, torch.randn(M, N))  # decomposed: each op reads and writes memory
    reads = sum(cost.node_bytes(n)[0] for n in gm.graph.nodes)
    writes = sum(cost.node_bytes(n)[1] for n in gm.graph.nodes)
    assert (reads, writes) == (4 * (5 * M * N + 2 * M), 4 * (3 * M * N + 2 * M))
    gm = _graph(lambda x: torch.softmax(x, -1), torch.randn(M, N))
    with interpreter():
        fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu"))
    fused = [n for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta]
    assert len(fused) == 1 and fused[0].meta[ir.FUSED_GROUP]["kind"] == "softmax"
    assert cost.node_bytes(fused[0]) == (4 * M * N, 4 * M * N)


# --- the pass on whole models -----------------------------------------------------------------

def _fused_model(model, batch, **plan):
    gm, sig = capture.capture(model, batch)
    params = [p.detach() for p in model.parameters()]
    leaves = capture.flatten_batch(batch, sig)
    want = gm(*params, *model.buffers(), *leaves)
    before = sum(sum(cost.node_bytes(n)) for n in gm.graph.nodes)
    with interpreter():
        gm = fusion.run(gm, pass_options(fusion.Options, fxpar.Plan(**plan)),
                        PassContext(signature=sig, device="cpu"))
        gm.graph.lint()
        gm.recompile()
        got = gm(*params, *model.buffers(), *leaves)
    after = sum(sum(cost.node_bytes(n)) for n in gm.graph.nodes)
    return gm, got, want, before, after


def test_gpt_step_fused_equals_unfused_and_moves_fewer_bytes():
    torch.manual_seed(0)
    cfg = GPTConfig()
    gm, got, want, before, after = _fused_model(GPT(cfg), gpt_batch(cfg, 4))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    kinds = [n.meta[ir.FUSED_GROUP]["kind"] for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta]
    # every block: 2 layer norms + their backwards; the head's cross-entropy; softmax
    assert kinds.count("layer_norm") == 2 * cfg.n_layer + 1
    assert kinds.count("layer_norm_backward") == 2 * cfg.n_layer + 1
    assert kinds.count("cross_entropy") == 1 and kinds.count("cross_entropy_backward") == 1
    assert not any(n.target in (aten._log_softmax.default, aten.native_layer_norm.default)
                   for n in gm.graph.nodes)
    assert after < before
    d = gm.meta["fusion"]
    assert d.bytes_fused < d.bytes_unfused


def test_llama_step_fused_equals_unfused():
    torch.manual_seed(0)
    gm, got, want, before, after = _fused_model(hf_llama(), hf_lm_batch(128, 2, 16))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    kinds = [n.meta[ir.FUSED_GROUP]["kind"] for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta]
    assert kinds.count("rms_norm") == 5          # 2 per layer + the final norm
    assert kinds.count("flash_attention") == 2 and kinds.count("flash_attention_backward") == 2
    assert after < before


def test_without_triton_device_the_pass_changes_nothing_and_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gm = _graph(lambda x: torch.softmax(x, -1), torch.randn(6, 10))  # (the kernel's op)
    n_before = len(gm.graph.nodes)
    gm = fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu"))
    assert len(gm.graph.nodes) == n_before
    assert "TRITON_INTERPRET=1" in gm.meta["fusion"].skipped


def test_fused_nodes_drawn_as_one_box_with_ops_and_bytes():
    from fxpar.viz.graph import _label
    gm = _graph(lambda x: torch.softmax(x, -1), torch.randn(6, 10))
    with interpreter():
        fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu"))
    node = next(n for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta)
    label = _label(node)
    assert "softmax" in label and "bytes" in label


@pytest.mark.slow  # (make test's 6 minutes)
def test_parallelize_with_fusion_records_groups(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    ref = GPT(cfg)
    ref.load_state_dict(model.state_dict())
    batch = gpt_batch(cfg, 4)
    pm = fxpar.parallelize(model, 1, example_batch=batch,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                           plan=fxpar.Plan(fuse=True))
    assert "fusion" in pm.stage_graphs
    opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    for _ in range(2):
        loss = pm.step(batch)
        opt.zero_grad()
        want = ref(batch)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)


def test_a_kernel_that_cannot_be_built_runs_its_ops_unfused_and_says_so(monkeypatch, caplog):
    from fxpar.kernels import library
    gm = _graph(lambda x: torch.softmax(x, -1), torch.randn(6, 10))
    with interpreter():
        fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu"))
    call = next(n.target for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta)
    assert isinstance(call, library.KernelCall)

    def broken(*a, **k):
        raise RuntimeError("ptxas: out of registers")
    monkeypatch.setattr(call, "kernel", broken)
    monkeypatch.setattr(call, "launched", set())
    x = torch.randn(6, 10)
    with interpreter(), caplog.at_level("WARNING"):
        out = call(x, -1, False)
    torch.testing.assert_close(out, torch.softmax(x, -1))
    assert "out of registers" in call.fallback
    assert "could not be built, running ATen instead" in caplog.text


class _RMSNormNet(torch.nn.Module):
    def __init__(self, d=40):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.w = torch.nn.Parameter(torch.randn(d))

    def forward(self, batch):
        x, t = batch
        h = self.lin(x)
        y = self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return (y * t).sum()


def test_rmsnorm_forward_is_the_hand_written_kernel():
    torch.manual_seed(0)
    model, batch = _RMSNormNet(), (torch.randn(3, 7, 40), torch.randn(3, 7, 40))
    gm, got, want, before, after = _fused_model(model, batch)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    kinds = [n.meta[ir.FUSED_GROUP]["kind"] for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta]
    assert kinds == ["rms_norm"] and after < before


# --- attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["flash", "efficient"])
def test_cuda_attention_ops_use_the_flash_kernels(op):
    """A trace on a GPU records CUDA's flash / memory-efficient attention ops: the pass swaps
    forward and backward for the Triton flash kernels with the ops' signatures and output
    layouts (efficient attention's padded logsumexp included). Traced here on fake tensors,
    run on CPU tensors in the interpreter against eager attention's autograd."""
    def step(q, k, v, g):
        if op == "flash":
            o = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=0.3)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                g, q, k, v, o[0], o[1], o[2], o[3], o[4], o[5], 0.0, True, o[6], o[7], scale=0.3)
        else:
            o = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                             scale=0.3)
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                g, q, k, v, None, o[0], o[1], o[2], o[3], 0.0, [True, True, True, False], True,
                scale=0.3)
        return o[0], dq, dk, dv
    args = [torch.randn(2, 3, 33, 16) for _ in range(4)]
    gm = _graph(step, *args)
    with interpreter():
        gm = fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu"))
        gm.graph.lint()
        gm.recompile()
        out, dq, dk, dv = gm(*args)
    kinds = {n.meta[ir.FUSED_GROUP]["kind"] for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta}
    assert {"flash_attention", "flash_attention_backward"} <= kinds
    q, k, v = (a.clone().requires_grad_() for a in args[:3])
    g = args[3]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    want.backward(g)
    for got, ref in ((out, want), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("op", [aten._scaled_dot_product_flash_attention.default,
                                aten._scaled_dot_product_efficient_attention.default])
def test_cuda_attention_stays_aten_on_cuda_tensors(op):
    """On CUDA tensors (a trace on a GPU) the pass keeps ATen's attention: its flash /
    memory-efficient kernels move the same bytes and ran faster than the Triton one on an
    H100 (tests/test_gpu.py, docs/benchmarks.md). Checked on fake CUDA tensors here."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fxpar.kernels import library
    with FakeTensorMode():
        q = torch.empty(2, 3, 33, 16, device="cuda")
    args = (q, q, q, 0.0, True) if "flash" in str(op) else (q, q, q, None, True, 0.0, True)
    assert library.SINGLE_OP[op]._supports(*args) == library.CUDA_ATTENTION_KEPT
    assert library.SINGLE_OP[op]._supports(*[a.to("cpu") if isinstance(a, torch.Tensor)
                                             else a for a in args]) is None


# --- pricing: an op is swapped only where its kernel's launch pays --------------------------

def test_kernel_price_weighs_launches_against_bytes():
    """Host-bound (tiny tensors, launches not replayed): one Triton launch dearer than the
    three ATen dispatches it replaces does not pay; replayed from a CUDA graph the launch
    cost is gone and the saved kernels pay; with large tensors the saved bytes pay."""
    p = cost.KernelPrice(aten_launch_s=5e-6, triton_launch_s=25e-6, bandwidth=2e12)
    assert not p.pays(3, [64, 64, 64], 96)
    assert cost.KernelPrice(5e-6, 25e-6, 2e12, replayed=True).pays(3, [64, 64, 64], 96)
    big = 3 * 2 ** 26  # 3 ops over 64 MiB each: 100 us of traffic each on the device
    assert p.pays(3, [big] * 3, big)
    assert not p.pays(1, [64], 64)                    # one op for one kernel, host-bound
    assert p.pays(1, [big], big)                      # same bytes, device-bound: a tie fuses


@pytest.mark.parametrize("replayed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fusion_leaves_ops_unfused_where_launches_do_not_pay(monkeypatch, replayed):
    """The pass on a small GPT with a GPU's price: with launches dearer than the ops (not
    replayed) a single op's kernel (the layer norms on these tiny tensors) is not swapped in
    and is listed in meta["fusion"].unpaid, while the patterns that drop a tensor (the
    cross-entropy's [N, V] log-probabilities) always are; replayed from a CUDA graph every
    kernel pays (as without a price)."""
    calls = []

    def price(device, rep):
        calls.append(rep)
        return cost.KernelPrice(aten_launch_s=5e-6, triton_launch_s=40e-6, bandwidth=2e12,
                                replayed=rep)
    torch.manual_seed(0)
    cfg = GPTConfig()
    base = _fused_model(GPT(cfg), gpt_batch(cfg, 4))
    monkeypatch.setattr(launch_cost, "kernel_price", price)
    torch.manual_seed(0)
    gm, got, want, _, _ = _fused_model(GPT(cfg), gpt_batch(cfg, 4), cuda_graphs=replayed)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert calls == [replayed]
    n_base, d = len(base[0].meta["fusion"].groups), gm.meta["fusion"]
    if replayed:
        assert len(d.groups) == n_base and not d.unpaid
    else:
        assert d.unpaid and len(d.groups) < n_base
        assert {g.kind for g in d.groups} == {"cross_entropy", "cross_entropy_backward"}
        assert all(len(u) == 1 for u in d.unpaid)


def test_launch_costs_are_measured_once_per_device(monkeypatch):
    """launch_cost.launch_seconds times an ATen op and a hand-written Triton kernel launched through
    the wrapper the pass puts in the graph (here on CPU under the interpreter, with CUDA's
    sync stubbed: on a GPU the same code runs for real), once per device; kernel_price is
    None off CUDA."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(launch_cost, "_LAUNCH_CACHE", {})
    with interpreter():
        aten_s, triton_s = launch_cost.launch_seconds("cpu")
    assert 0 < aten_s < triton_s  # the interpreter is far slower than a dispatch
    assert launch_cost.launch_seconds("cpu") == (aten_s, triton_s)  # cached
    assert launch_cost.kernel_price("cpu", replayed=False) is None


def test_bound_kernel_call_fast_path_still_runs_references_on_fake_tensors():
    """After a node's hand-written kernel ran once on a device, its later calls skip the
    layout bookkeeping (its shapes are the trace's); fake tensors (planning, shape
    propagation) still get the reference ops, never a launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fxpar.kernels import library
    x, w, b = torch.randn(8, 32), torch.randn(32), torch.randn(32)
    gm = make_fx(lambda x, w, b: aten.native_layer_norm.default(x, [32], w, b, 1e-5))(x, w, b)
    node = next(n for n in gm.graph.nodes if n.target is aten.native_layer_norm.default)
    call = library.SINGLE_OP[aten.native_layer_norm.default].for_node(node)
    want = aten.native_layer_norm.default(x, [32], w, b, 1e-5)
    with interpreter():
        for _ in range(2):
            got = call(x, [32], w, b, 1e-5)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert call._ran_on == "cpu"
    with FakeTensorMode() as mode:
        out = call(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                     for t in (x, [32], w, b, 1e-5)])
    assert out[0].shape == (8, 32)


# --- with Inductor as the fuser: cross-entropy in closed form ----------------------------------

def _cross_entropy_joint(x, t, g, reduction, count=None, ignore=-100):
    """log_softmax + nll_loss and their backward, as autograd records them; `count`: the
    backward's total weight when it is not this batch's (data parallelism makes it the
    global batch's)."""
    ls = aten._log_softmax(x, 1, False)
    loss, tw = aten.nll_loss_forward(ls, t, None, reduction, ignore)
    nb = aten.nll_loss_backward(g, ls, t, None, reduction, ignore, tw if count is None else count)
    return loss, tw, aten._log_softmax_backward_data(nb, ls, 1, x.dtype)


def _closed_form(fn, *args, codegen="inductor"):
    """fn's joint graph (backward ops tagged so) through the fusion pass (under Inductor)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    backward_ops = (aten.nll_loss_backward.default, aten._log_softmax_backward_data.default)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[ir.REGION] = ir.BACKWARD if n.target in backward_ops else ir.FORWARD
            n.meta[ir.MODULE] = ""
    want = gm(*args)
    gm = fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu",
                                                   codegen=codegen))
    gm.graph.lint()
    gm.recompile()
    return gm, want


def test_cross_entropy_kernel_reads_half_logits_and_writes_the_half_gradient():
    """Mixed precision: the precision pass casts the logits up to fp32 for log_softmax and
    the gradient back down once. The kernels read the half logits (no [N, V] fp32 copy is
    written) and store the gradient in half (no fp32 one is written); the results equal the
    kernels' on the fp32 copy, then cast, bit for bit (as the store rounds where it runs)."""
    def joint(x16, t, g):
        loss, tw, dx = _cross_entropy_joint(aten._to_copy(x16, dtype=torch.float32), t, g, 1)
        return loss, tw, aten._to_copy(dx, dtype=torch.bfloat16)
    x = (torch.randn(12, 40) * 3).to(torch.bfloat16)
    t = torch.randint(0, 40, (12,))
    g = torch.tensor(1.5)
    with interpreter():
        gm = make_fx(joint, tracing_mode="fake")(x, t, g)
        ref = make_fx(lambda x, t, g: _cross_entropy_joint(x.float(), t, g, 1),
                      tracing_mode="fake")(x, t, g)
        for graph in (gm, ref):
            for n in graph.graph.nodes:
                if n.op == "call_function":
                    n.meta[ir.MODULE] = ""
                    n.meta[ir.REGION] = ir.BACKWARD if n.target in (
                        aten.nll_loss_backward.default,
                        aten._log_softmax_backward_data.default) else ir.FORWARD
        for graph in (gm, ref):
            fusion.run(graph, fusion.Options(), PassContext(signature=None, device="cpu",
                                                         codegen="inductor"))
            graph.recompile()
        vals = [n.meta[ir.VAL] for n in gm.graph.nodes if n.op == "call_function"]
        assert not [v for v in vals if isinstance(v, torch.Tensor) and v.shape == (12, 40)
                    and v.dtype == torch.float32], gm.graph
        ops = torch.ops.fxpar
        fwd, bwd = [n for n in gm.graph.nodes if n.target in (
            ops.cross_entropy.default, ops.cross_entropy_backward.default)]
        x16 = gm.graph.find_nodes(op="placeholder")[0]
        assert fwd.args[0] is x16 and bwd.args[1] is x16
        loss, tw, dx = gm(x, t, g)
        want = ref(x, t, g)
        assert torch.equal(dx, stored_as(want[2], torch.bfloat16))
    assert loss.dtype == tw.dtype == torch.float32 and dx.dtype == torch.bfloat16
    assert torch.equal(loss, want[0]) and torch.equal(tw, want[1])
    d = gm.meta["fusion"]
    assert [grp.kind for grp in d.groups] == ["cross_entropy", "cross_entropy_backward"]
    assert d.bytes_fused < d.bytes_unfused


@pytest.mark.parametrize("reduction", [1, 2])
@pytest.mark.parametrize("dtype,ignore", [(torch.float32, -100), (torch.float32, 3),
                                          (torch.bfloat16, -100), (torch.float16, 3)])
def test_cross_entropy_becomes_its_closed_form_for_inductor(monkeypatch, reduction, dtype,
                                                            ignore):
    """Plan.codegen="inductor" without Triton kernels: the pattern becomes its closed form,
    one pass over the logits each way (Inductor fuses it); the backward keeps the logits and
    [N] row values instead of the [N, V] log-probabilities, values and dtypes are unchanged
    (ignored rows included, an ignore_index inside the vocabulary too) and the decision says
    what was rewritten."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(12, 40).to(dtype)
    t = torch.randint(0, 40, (12,))
    t[::4] = ignore
    g = torch.tensor(1.5, dtype=dtype)
    count = torch.tensor(20.0, dtype=dtype)  # the global batch's targets (dp): not these 9
    gm, want = _closed_form(lambda x, t, g, c: _cross_entropy_joint(x, t, g, reduction, c,
                                                                    ignore), x, t, g, count)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {aten._log_softmax.default, aten.nll_loss_forward.default,
                          aten.nll_loss_backward.default,
                          aten._log_softmax_backward_data.default}
    assert aten.amax.default in targets
    # what crosses from the forward to the backward: the logits (a placeholder) and row values
    crossing = {a for n in gm.graph.nodes if n.meta.get(ir.REGION) == ir.BACKWARD
                for a in n.all_input_nodes if a.meta.get(ir.REGION) == ir.FORWARD}
    assert crossing and all(a.meta[ir.VAL].shape in ((12,), (12, 1), ()) for a in crossing), \
        crossing
    (group,) = gm.meta["fusion"].groups
    assert group.kind == fusion.INDUCTOR_CE and group.bytes_fused < group.bytes_unfused
    assert "cross-entropy in closed form for Inductor" in gm.meta["fusion"].describe()
    got = gm(x, t, g, count)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


def test_cross_entropy_closed_form_with_every_target_ignored_and_forward_only(monkeypatch):
    """Every target ignored: the mean is 0/0 = nan as in eager, the gradient zero. A
    forward-only graph (evaluate's): the forward alone is rewritten."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, t, g = torch.randn(5, 7), torch.full((5,), -100), torch.tensor(1.0)
    gm, want = _closed_form(lambda x, t, g: _cross_entropy_joint(x, t, g, 1), x, t, g)
    loss, tw, dx = gm(x, t, g)
    assert loss.isnan() and want[0].isnan() and tw == 0 and not dx.any()
    t = torch.randint(0, 7, (5,))
    fwd, want = _closed_form(lambda x, t: aten.nll_loss_forward(
        aten._log_softmax(x, 1, False), t, None, 1, -100), x, t)
    assert len(fwd.meta["fusion"].groups) == 1 and aten.amax.default in {
        n.target for n in fwd.graph.nodes}
    torch.testing.assert_close(fwd(x, t), want)


def test_cross_entropy_closed_form_rounds_large_logits_as_aten_does(monkeypatch):
    """Logits around 100 (common in language models): the log-probabilities are formed as
    (x - max) - log(sum(exp(x - max))), as ATen's log_softmax does; x - logsumexp(x) would
    round the logsumexp at 100's magnitude (~8e-6) and the gradient with it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)
    x, t, g = torch.randn(64, 50) * 3 + 100, torch.randint(0, 50, (64,)), torch.tensor(1.0)
    gm, want = _closed_form(lambda x, t, g: _cross_entropy_joint(x, t, g, 2), x, t, g)
    for a, b in zip(gm(x, t, g), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _remat_ce_joint(x, labels, g, start=1):
    """The cross-entropy joint graph as remat="sqrt" / "auto" leave it on HF models: the
    backward reads a recomputed copy of the targets (`start`=1: the same ones) and a
    recomputed nll_loss_forward of the same log-probabilities."""
    t = aten.view(aten.clone(aten.slice(labels, 1, 1, 7)), [-1])
    ls = aten._log_softmax(x, 1, False)
    loss, _ = aten.nll_loss_forward(ls, t, None, 1, -100)
    t2 = aten.view(aten.clone(aten.slice(labels, 1, start, start + 6)), [-1])  # remat's
    loss2, tw2 = aten.nll_loss_forward(ls, t2, None, 1, -100)
    seed = aten.mul(aten.ones_like(loss2), g)
    nb = aten.nll_loss_backward(seed, ls, t2, None, 1, -100, tw2)
    return loss, aten._log_softmax_backward_data(nb, ls, 1, x.dtype)


def _remat_ce_inputs():
    torch.manual_seed(0)
    labels = torch.randint(0, 30, (4, 7))
    labels[0, 2:5] = -100
    return torch.randn(24, 30), labels, torch.tensor(1.0)


@pytest.mark.parametrize("codegen", ["inductor", "eager"])
def test_cross_entropy_kernel_under_remat(codegen):
    """remat's form of the pattern (recomputed targets and nll_loss_forward in the backward)
    takes fxpar's kernel too, called from Inductor's code or op by op (it fell to the closed
    form: the H200's remat="auto" row); the backward reads the forward's targets and count;
    values unchanged. Copies of other targets are not the pattern: nothing rewritten."""
    x, labels, g = _remat_ce_inputs()
    with interpreter():
        gm, want = _closed_form(lambda x, labels, g: _remat_ce_joint(x, labels, g), x, labels, g,
                                codegen=codegen)
        got = gm(x, labels, g)
        other, _ = _closed_form(lambda x, labels, g: _remat_ce_joint(x, labels, g, start=0),
                                x, labels, g, codegen=codegen)
    assert not [grp for grp in other.meta["fusion"].groups if "cross_entropy" in grp.kind]
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.fxpar.cross_entropy.default in ops
    assert torch.ops.fxpar.cross_entropy_backward.default in ops
    assert not set(ops) & {aten._log_softmax.default, aten.nll_loss_forward.default,
                           aten.nll_loss_backward.default}
    assert ops.count(aten.clone.default) == 1  # the unread copy of the targets is gone
    assert [grp.kind for grp in gm.meta["fusion"].groups
            if "cross_entropy" in grp.kind] == ["cross_entropy", "cross_entropy_backward"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cross_entropy_closed_form_under_remat(monkeypatch):
    """remat="sqrt" on HF models: the backward reads a recomputed copy of the targets and a
    recomputed nll_loss_forward of the same log-probabilities (its count divides the
    gradient, its loss shapes the seed). Both copies go with the pattern: the backward uses
    the forward's two scalars and targets; values unchanged."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    joint = _remat_ce_joint
    x, labels, g = _remat_ce_inputs()
    gm, want = _closed_form(lambda x, labels, g: joint(x, labels, g), x, labels, g)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not set(ops) & {aten._log_softmax.default, aten.nll_loss_forward.default,
                           aten.nll_loss_backward.default}
    assert ops.count(aten.clone.default) == 1  # the unread copy of the targets is gone
    (group,) = gm.meta["fusion"].groups
    assert group.kind == fusion.INDUCTOR_CE
    for a, b in zip(gm(x, labels, g), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a "copy" computing other targets (another slice) is not one: nothing is rewritten
    other, _ = _closed_form(lambda x, labels, g: joint(x, labels, g, start=0), x, labels, g)
    assert other.meta["fusion"].groups == []


def test_cross_entropy_reduction_none_stays_for_inductor(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gm = _graph(lambda x, t: aten.nll_loss_forward(aten._log_softmax(x, 1, False), t, None, 0,
                                                   -100)[0],
                torch.randn(6, 10), torch.randint(0, 10, (6,)))
    gm = fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu",
                                                   codegen="inductor"))
    assert aten.nll_loss_forward.default in {n.target for n in gm.graph.nodes}
    assert gm.meta["fusion"].groups == []

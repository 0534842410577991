"""Mixed precision (passes/precision.py), loss scaling and gradient clipping (runtime/amp.py):
the transformation itself on small graphs, the scaler's logic, single-process numerics against
torch.autocast / clip_grad_norm_, and (slow) bf16 / fp16 / clipping under dp, tp, pp and ZeRO
on real processes."""
import operator

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.core import ir
from fxpar.compiler.capture import capture, flatten_batch
from fxpar.core.errors import PlanError
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.core.graphs import verify
from fxpar.core.plan import resolve
from fxpar.examples import models as M
from fxpar.passes import precision
from fxpar.runtime import amp
from workers import (OPTIMIZERS, build, check_clipping, clip_eager_reference,
                     fp16_overflow_rank, precision_curve_rank, precision_eager_curve)

aten = torch.ops.aten
BF16 = torch.bfloat16


def _compile(model, batch, **plan):
    gm, sig = capture(model, batch)
    world = plan.get("dp", 1) * plan.get("tp", 1) * plan.get("pp", 1)
    ctx = PassContext(signature=sig, group_names={"dp": "dp-group", "tp": "tp-group"})
    gm = run_passes(gm, resolve({"dp": 1, **plan}, world), ctx, "rank", {})
    return gm, sig, ctx


def _dtype(n):
    v = n.meta[ir.VAL]
    return v.dtype if isinstance(v, torch.Tensor) else v[0].dtype


def _casts_of(gm, node):
    return [u for u in node.users if u.target is aten._to_copy.default]


def test_mlp_matmuls_in_bf16_loss_in_fp32_one_cast_per_weight_fp32_grads():
    torch.manual_seed(0)
    model = M.MLP()
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    gm, sig, _ = _compile(model, batch, precision="bf16")
    info = gm.meta["precision"]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = phs[:sig.num_params]
    mms = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert len(mms) == 3 + 5  # forward 3 linears; backward: 3 weight grads + 2 input grads
    assert all(_dtype(n) == BF16 for n in mms), [(n.name, _dtype(n)) for n in mms]
    # relu follows its (bf16) input; the MSE loss (decomposed: sub, pow, mean) runs in fp32
    assert all(_dtype(n) == BF16 for n in gm.graph.nodes if n.target is aten.relu.default)
    fp32 = [n for n in gm.graph.nodes if n.target in (aten.mean.dim, aten.mean.default,
                                                       aten.pow.Tensor_Scalar, aten.sum.dim_IntList)]
    assert fp32 and all(_dtype(n) == torch.float32 for n in fp32)
    assert all(_dtype(a) == torch.float32 for n in fp32 for a in n.all_input_nodes)
    # parameters stay fp32 placeholders; each read by a half op is cast exactly once, and
    # that one cast is reused by the backward (autocast's weight cache)
    assert all(p.meta[ir.VAL].dtype == torch.float32 for p in params)
    for p in params:
        casts = _casts_of(gm, p)
        assert len(casts) == 1 and casts[0].kwargs["dtype"] == BF16, p.name
        assert casts[0].meta[ir.REGION] == ir.FORWARD
    weights = [p for p in params if p.meta[ir.VAL].dim() == 2]
    for w in weights[1:]:  # the cast feeds the forward and the backward's input-grad matmul
        regions = {u.meta[ir.REGION] for t in _casts_of(gm, w)[0].users for u in t.users}
        assert regions == {ir.FORWARD, ir.BACKWARD}, w.name
    assert len(info.param_casts) == sig.num_params
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out[0].meta[ir.VAL].dtype == torch.float32  # the loss
    assert all(g.meta[ir.VAL].dtype == torch.float32 for g in out[1:1 + sig.num_params])
    verify(gm)  # meta["val"] true, region / module on every new node
    from fxpar.viz.report import _decision_line  # the report's one-line summary of the pass
    assert _decision_line("precision", gm).startswith("bfloat16: 8 ops in half")


def test_a_value_is_cast_down_once_for_its_forward_and_backward_matmuls():
    """As autocast: a matmul's half input (here a LayerNorm's fp32 output) is the forward's
    cast, reused by the backward's weight-gradient matmul (the backward does not re-cast it
    from a kept fp32 copy), and an fp32 gradient (from a LayerNorm's backward) is cast once
    for both of its backward matmuls, views re-made on the cast."""
    torch.manual_seed(0)
    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                           torch.nn.Linear(32, 32), torch.nn.LayerNorm(32),
                                           torch.nn.Linear(32, 4))

        def forward(self, batch):
            return F.mse_loss(self.net(batch[0]), batch[1])
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    gm, sig, _ = _compile(Normed(), batch, precision="bf16", remat="none")
    params = set([n for n in gm.graph.nodes if n.op == "placeholder"][:sig.num_params])

    def root(n):
        while n.op == "call_function" and n.target in precision._VIEWS:
            n = n.args[0]
        return n
    down = [n for n in gm.graph.nodes if n.target is aten._to_copy.default and
            n.kwargs["dtype"] == BF16 and root(n.args[0]) not in params]
    roots = [root(c.args[0]) for c in down]
    assert len(roots) == len(set(roots)) and len(roots) >= 4, [(c.name, r.name) for c, r in
                                                             zip(down, roots)]
    assert all(c.args[0] is r for c, r in zip(down, roots))  # the value itself, views after
    norms = [n for n in gm.graph.nodes if n.target is aten.native_layer_norm.default]
    for ln in norms:  # each norm's output: one forward cast, read by both of its matmuls
        (c,) = [c for c, r in zip(down, roots) if r.args and r.args[0] is ln]
        assert c.meta[ir.REGION] == ir.FORWARD
        readers = {u.meta[ir.REGION] for u in gm.graph.nodes if u.target in (
            aten.mm.default, aten.addmm.default) and any(root(a) is c for a in u.all_input_nodes)}
        assert readers == {ir.FORWARD, ir.BACKWARD}, ln.name
    readers = []  # a norm's input gradient, cast once: the middle linear's dX and dW, the
    for lnb in [n for n in gm.graph.nodes  # first's dW (its input needs no gradient)
                if n.target is aten.native_layer_norm_backward.default]:
        (c,) = [c for c, r in zip(down, roots) if r.args and r.args[0] is lnb]
        readers.append(len([u for u in gm.graph.nodes if u.target is aten.mm.default and
                            any(root(a) is c for a in u.all_input_nodes)]))
    assert sorted(readers) == [1, 2], readers
    verify(gm)


@pytest.mark.slow  # (make test's time: runs in CI's slow suite)
def test_bf16_graph_keeps_no_fp32_logits_and_about_two_thirds_of_fp32s_activations():
    """benchmarks/precision_memory.py --small --triton (the graphs as a GPU plans them): the
    cross-entropy kernel reads the half logits and stores the half gradient (no fp32 [N, V]
    tensor left), and the bf16 graph's activation peak is under 0.7 of fp32's (0.85 when the
    backward re-cast fp32 activations it kept)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "precision_memory.py"
    spec = importlib.util.spec_from_file_location("precision_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--small", "--triton"])
    for model in ("gpt2", "llama"):
        assert out[model, "fp32"][2] == 2 and out[model, "bf16"][2] == 0, out
        assert out[model, "bf16"][0] < 0.7 * out[model, "fp32"][0], out


def test_gpt_softmax_norms_loss_reductions_fp32_attention_bf16():
    torch.manual_seed(0)
    cfg = M.GPTConfig()
    gm, sig, _ = _compile(M.GPT(cfg), M.gpt_batch(cfg, 4), precision="bf16")
    by = lambda *ts: [n for n in gm.graph.nodes if n.target in ts]  # noqa: E731
    attn = by(aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert len(attn) == 2 * cfg.n_layer and all(_dtype(n) == BF16 for n in attn)
    fwd = by(aten._scaled_dot_product_flash_attention_for_cpu.default)[0]
    assert fwd.meta[ir.VAL][1].dtype == torch.float32  # the log-sum-exp stays fp32 ...
    bwd = by(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)[0]
    assert bwd.args[5].meta[ir.VAL].dtype == torch.float32  # ... and is read as such
    for n in by(aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
                aten._log_softmax.default, aten._log_softmax_backward_data.default,
                aten.nll_loss_forward.default, aten.nll_loss_backward.default,
                aten.sum.dim_IntList):
        ins = [a for a in n.all_input_nodes if a.meta[ir.VAL].dtype.is_floating_point]
        assert all(a.meta[ir.VAL].dtype == torch.float32 for a in ins), n.name
        assert _dtype(n) == torch.float32, n.name
    # the embeddings are read by lookups (fp32, as under autocast): the residual stream is fp32
    assert all(_dtype(n) == torch.float32 for n in by(aten.embedding.default))
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for p in phs[:sig.num_params]:
        assert len(_casts_of(gm, p)) <= 1, p.name
    # the tied embedding: one fp32 lookup and one bf16 cast for the LM head
    assert len(_casts_of(gm, phs[0])) == 1
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert all(g.meta[ir.VAL].dtype == torch.float32 for g in out[:1 + sig.num_params])


def _efficient_attention_step(bias=False, contiguous=False):
    """A GPU trace's attention, forward and backward, on fake CUDA tensors already in bf16
    (the precision pass's input casts made): (graph, {node: fake value}, fake mode).
    contiguous: q, k, v laid out [B, H, T, D] (as HF GPT-2's are after the cast), the
    output viewed back to [B, T, C] as models do."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    aten = torch.ops.aten
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # [B, H, T, D] views of a [B, T, H, D] projection, as a model's q/k/v are
        qkv = [torch.empty_strided((2, 4, 64, 16), (4096, 1024, 16, 1) if contiguous else
                                   (4096, 16, 64, 1), device="cuda", dtype=torch.bfloat16)
               for _ in range(4)]
        b = torch.empty(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v, g):
        o = aten._scaled_dot_product_efficient_attention(q, k, v, b if bias else None, True,
                                                         0.0, True, scale=0.25)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, b if bias else None, o[0], o[1], o[2], o[3], 0.0,
            [True, True, True, False], True, scale=0.25)
        if contiguous:
            return o[0].transpose(1, 2).view(2, 64, 64), dq, dk, dv
        return o[0], dq, dk, dv
    gm = make_fx(step, tracing_mode="fake")(*qkv)
    env = {n: n.meta[ir.VAL] for n in gm.graph.nodes if ir.VAL in n.meta}
    return gm, env, next(v for v in env.values() if isinstance(v, torch.Tensor)).fake_mode


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_half_attention_takes_the_kernel_torch_picks_for_half_inputs(monkeypatch, kernel):
    """A GPU trace is made in fp32, where torch's attention is the memory-efficient kernel;
    once its inputs are half, the pass swaps forward and backward together for the kernel
    torch picks for half inputs (here told: no GPU to ask), wired to the same values: the
    new forward's output, logsumexp and random state feed the new backward, whose gradients
    replace the old ones, with their shapes."""
    aten = torch.ops.aten
    monkeypatch.setattr(precision, "_sdp_choice", lambda *a: {"flash": 1, "cudnn": 3}[kernel])
    gm, env, mode = _efficient_attention_step()
    half_nodes = [n.name for n in gm.graph.nodes if "efficient" in str(n.target)]
    out_before = [tuple(env[a].shape) for a in next(n for n in gm.graph.nodes
                                                     if n.op == "output").args[0]]
    swapped = precision._attention_for_half(gm.graph, env, mode, half_nodes)
    gm.graph.lint()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    fwd_op = getattr(aten, f"_scaled_dot_product_{kernel}_attention").default
    bwd_op = getattr(aten, f"_scaled_dot_product_{kernel}_attention_backward").default
    assert fwd_op in targets and bwd_op in targets
    assert not {aten._scaled_dot_product_efficient_attention.default,
                aten._scaled_dot_product_efficient_attention_backward.default} & targets
    assert list(swapped.values()) == [kernel] and set(half_nodes) == {
        n.name for n in gm.graph.nodes if n.target in (fwd_op, bwd_op)}
    fwd = next(n for n in gm.graph.nodes if n.target is fwd_op)
    bwd = next(n for n in gm.graph.nodes if n.target is bwd_op)
    taken = {a.args[1] for a in bwd.args if isinstance(a, torch.fx.Node)
             and a.target is operator.getitem and a.args[0] is fwd}
    assert taken == {0, 1, 6, 7}  # output, logsumexp, the random state's two parts
    assert fwd.kwargs["scale"] == bwd.kwargs["scale"] == 0.25
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out[0].args[0] is fwd and all(o.args[0] is bwd for o in out[1:])
    assert [tuple(env[a].shape) for a in out] == out_before
    assert all(tuple(a.meta[ir.VAL].shape) == s for a, s in zip(out, out_before))


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_half_attention_gives_the_traced_layout_to_the_ops_after_it(monkeypatch, kernel):
    """The new kernels lay out their outputs as their inputs, memory-efficient attention
    [B, T, H, D] whatever the inputs: with [B, H, T, D] inputs (HF GPT-2 in bf16 on an H200)
    the model's `.transpose(1, 2).view(B, T, C)` failed on the cuDNN output. The ops after
    the swap read a copy in the traced layout; the new backward reads the kernel's own."""
    from fxpar.core import graphs
    aten = torch.ops.aten
    monkeypatch.setattr(precision, "_sdp_choice", lambda *a: {"flash": 1, "cudnn": 3}[kernel])
    gm, env, mode = _efficient_attention_step(contiguous=True)
    out_before = [(tuple(env[a].shape), env[a].stride()) for a in next(
        n for n in gm.graph.nodes if n.op == "output").args[0]]
    precision._attention_for_half(gm.graph, env, mode, [])
    gm.graph.lint()
    gm.recompile()
    graphs.fake_propagate(gm, check=True)  # raised "Cannot view a tensor ..." before
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [(tuple(a.meta[ir.VAL].shape), a.meta[ir.VAL].stride()) for a in out] == out_before
    fwd = next(n for n in gm.graph.nodes if n.target is getattr(
        aten, f"_scaled_dot_product_{kernel}_attention").default)
    # the forward's output copied through shape-free ops (tensor parallelism shards them)
    copies = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert copies and copies[0].args[0].target is aten.permute.default
    out0 = copies[0].args[0].args[0]
    assert out0.target is operator.getitem and out0.args[0] is fwd
    assert not [n for n in gm.graph.nodes if n.target in (aten.empty_strided.default,
                                                           aten.copy.default)]
    bwd = next(n for n in gm.graph.nodes if n.target is getattr(
        aten, f"_scaled_dot_product_{kernel}_attention_backward").default)
    assert out0 in bwd.args  # the backward reads the kernel's own layout


def test_dense_order_reads_a_layout_a_copy_can_restore():
    assert precision._dense_order((2, 4, 64, 16), (4096, 16, 64, 1)) == [0, 2, 1, 3]
    assert precision._dense_order((2, 4, 64, 16), (4096, 1024, 16, 1)) == [0, 1, 2, 3]
    assert precision._dense_order((2, 1, 3), (3, 99, 1)) is not None  # size 1: anywhere
    assert precision._dense_order((2, 3), (6, 2)) is None  # gaps
    assert precision._dense_order((2, 3), (0, 1)) is None  # broadcast


def test_half_attention_with_a_bias_or_without_a_gpu_keeps_memory_efficient_attention(
        monkeypatch):
    """With an attention bias (its gradient and layout differ between the kernels) the
    memory-efficient kernel stays; so it does where torch cannot tell (no GPU here)."""
    gm, env, mode = _efficient_attention_step(bias=True)
    monkeypatch.setattr(precision, "_sdp_choice", lambda *a: 3)
    assert precision._attention_for_half(gm.graph, env, mode, []) == {}
    monkeypatch.undo()
    gm, env, mode = _efficient_attention_step()
    assert precision._attention_for_half(gm.graph, env, mode, []) == {}
    assert any("efficient" in str(n.target) for n in gm.graph.nodes)


def test_fp16_adds_a_loss_scale_input_and_unscales_gradients_in_fp32():
    torch.manual_seed(0)
    model = M.MLP()
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    gm, sig, ctx = _compile(model, batch, precision="fp16")
    assert gm.meta[ir.LOSS_SCALE]
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    assert ph.name == gm.meta["precision"].loss_scale and ph.meta[ir.ROLE] == "batch"
    assert ph.meta[ir.VAL].shape == () and ph.meta[ir.VAL].dtype == torch.float32
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    for g in out[1:1 + sig.num_params]:  # grad = fp32(grad_scaled) / scale
        assert g.target is aten.div.Tensor and g.args[1] is ph
        assert g.args[0].meta[ir.VAL].dtype == torch.float32
    # run it: the gradients do not depend on the scale (up to fp16 rounding of the scaled ones)
    gm.recompile()
    params = [p.detach() for p in model.parameters()]
    lo = gm(*params, *batch, torch.tensor(1024.0))
    hi = gm(*params, *batch, torch.tensor(65536.0))
    assert lo[0] == hi[0]  # the loss is never scaled
    for a, b in zip(lo[1:], hi[1:]):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
@pytest.mark.slow  # (make test's 6 minutes)
def test_tensor_parallel_on_the_half_graph_keeps_megatrons_collectives_and_splits_the_casts(prec):
    torch.manual_seed(0)
    cfg = M.GPTConfig(n_layer=1)
    gm, sig, ctx = _compile(M.GPT(cfg), M.gpt_batch(cfg, 4), tp=2, precision=prec)
    decision = gm.meta["tensor_parallel"]
    assert decision.column and decision.row
    c10d = torch.ops._c10d_functional
    ars = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default
           and n.args[2] == "tp-group" and n.meta.get(ir.MODULE, "").startswith("h.0")]
    assert len(ars) == 4  # 2 forward + 2 backward, as in fp32
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for p in phs[:sig.num_params]:  # a split weight's cast has the local (half) shape
        for c in _casts_of(gm, p):
            assert c.meta[ir.VAL].shape == p.meta[ir.VAL].shape
            assert _dtype(c) == precision.HALF_DTYPES[prec]


def test_bf16_training_equals_torch_autocast_on_its_first_step_and_tracks_it():
    """Same op policy as torch.autocast: the first loss is bit-identical; afterwards fxpar's
    gradients differ slightly because it accumulates bias-gradient sums and norm backwards
    in fp32, where autocast runs backward ops in their inputs' (bf16) dtype."""
    for name in ("gpt",):  # (HF Llama too, in the slow curve test)
        model, batch_fn, loss_fn = build(name)
        pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                               optimizer=OPTIMIZERS["adamw"], plan={"precision": "bf16"})
        assert pm.scaler is None
        got = [pm.step(batch_fn(s)).item() for s in range(2)]
        model, batch_fn, loss_fn = build(name)
        opt = OPTIMIZERS["adamw"](model.parameters())
        ref = []
        for s in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = model(**batch_fn(s)) if name != "gpt" else model(batch_fn(s))
            loss = getattr(loss, "loss", loss)
            loss.backward()
            opt.step()
            ref.append(loss.item())
        assert got[0] == ref[0], name
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)


def test_complex_numbers_stay_fp32_under_bf16():
    """Llama 4's rotary embedding multiplies complex numbers, `view_as_complex(x.float())`:
    the `.float()` records nothing in an fp32 trace, and complex numbers have no bfloat16,
    so the pass casts view_as_complex's input up, as the model's code does under autocast.
    Training then tracks autocast's (its norms' `type_as` casts, also absent from the trace,
    leave fxpar's values fp32 where autocast rounds them to bf16)."""
    model, batch_fn, loss_fn = build("llama4")
    pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=OPTIMIZERS["adamw"], plan={"precision": "bf16"})
    report = pm.stage_graphs["precision"]["dp"].meta[ir.PRECISION_REPORT]
    graph = pm.stage_graphs["precision"]["dp"].graph
    complex_in = [n.args[0] for n in graph.nodes
                  if n.target is torch.ops.aten.view_as_complex.default]
    assert complex_in and all(x.meta[ir.VAL].dtype == torch.float32 for x in complex_in)
    assert report.half_nodes
    got = [pm.step(batch_fn(s)).item() for s in range(2)]
    model, batch_fn, loss_fn = build("llama4")
    opt = OPTIMIZERS["adamw"](model.parameters())
    ref = []
    for s in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss = model(**batch_fn(s)).loss
        loss.backward()
        opt.step()
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)


@pytest.mark.slow  # (make test's 6 minutes)
def test_remat_on_the_bf16_graph_equals_no_remat():
    """remat runs after precision and sees the half-precision graph (its casts are cheap to
    recompute): bf16 training with remat="sqrt" equals bf16 without, bit for bit."""
    runs = []
    for remat in ("none", "sqrt"):
        model, batch_fn, loss_fn = build("gpt")
        pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                               optimizer=OPTIMIZERS["adamw"],
                               plan={"precision": "bf16", "remat": remat})
        runs.append([pm.step(batch_fn(s)).item() for s in range(2)])
        if remat == "sqrt":
            assert pm.stage_graphs["remat"]["dp"].meta["remat"].recomputed
    assert runs[0] == runs[1]


def test_clipping_equals_clip_grad_norm_single_process():
    losses, state, norms = clip_eager_reference("mlp", "sgd", max_norm=0.1, steps=3)
    model, batch_fn, loss_fn = build("mlp")
    pm = fxpar.parallelize(model, 1, example_batch=batch_fn(0), loss_fn=loss_fn,
                           optimizer=OPTIMIZERS["sgd"], plan={"max_grad_norm": 0.1})
    got, got_norms = [], []
    for s in range(3):
        got.append(pm.step(batch_fn(s)).item())
        got_norms.append(pm.last_grad_norm.item())
    assert min(norms) > 0.1  # the clip is active on every step
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    full = pm.full_state_dict()
    for k, v in state.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)


def test_grad_scaler_grows_after_interval_and_halves_on_overflow():
    s = amp.GradScaler(init_scale=8.0, growth_interval=3)
    for found_inf, want in [(False, 8), (False, 8), (False, 16), (True, 8), (False, 8),
                            (False, 8), (True, 4), (False, 4), (False, 4), (False, 8)]:
        s.update(found_inf)
        assert s.scale == want
    assert s.skipped_steps == 2
    t = amp.GradScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    # the defaults and keys of torch.amp.GradScaler
    ref = torch.amp.GradScaler("cpu")
    assert (ref.get_scale(), ref.get_growth_factor(), ref.get_backoff_factor(),
            ref.get_growth_interval()) == (amp.GradScaler().scale, 2.0, 0.5, 2000)
    t.load_state_dict(ref.state_dict())
    assert t.scale == 2.0 ** 16
    with pytest.raises(KeyError, match="scale"):
        t.load_state_dict({})


def test_fp16_overflow_skips_the_step_and_halves_the_scale_single_process():
    res = fp16_overflow_rank([("mlp", {})], inject_step=1, steps=4)[repr({})]
    assert res["skipped"] == [False, True, False, False]
    assert res["scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15]
    assert res["unchanged"] == [False, True, False, False]
    assert torch.isfinite(torch.tensor(res["eval"]))  # the forward-only program: no scale input


def test_plan_rejects_bad_clipping_and_precision():
    for bad in (0, -1.0, "1", True):
        with pytest.raises(PlanError, match="max_grad_norm"):
            resolve({"max_grad_norm": bad}, 1)
    with pytest.raises(PlanError, match="precision"):
        resolve({"precision": "fp8"}, 1)
    assert resolve({"precision": "bf16", "max_grad_norm": 1.0}, 1).precision == "bf16"


# --- multi-process ---------------------------------------------------------------------------

PARITY_PLANS = [{"dp": 2}, {"tp": 2}, {"pp": 2, "microbatches": 2}]


@pytest.mark.slow
def test_bf16_tracks_fp32_over_50_steps_dp_tp_pp():
    """bf16 training of the small GPT and HF Llama at dp=2, tp=2, pp=2 (2 ranks each) tracks
    fp32 eager training over 50 steps: every step's loss within 2% (the loss falls by about
    half over the run, so this is a real curve, not a flat line); every rank agrees."""
    cases = [(m, {"precision": "bf16", **p}) for m in ("gpt", "hf_llama") for p in PARITY_PLANS]
    res = fxpar.launch(precision_curve_rank, 2, cases, 50)
    for name in ("gpt", "hf_llama"):
        ref = torch.tensor(precision_eager_curve(name, 50))
        assert ref[-1] < 0.85 * ref[0], ref  # it learns
        for p in PARITY_PLANS:
            key = (name, repr({"precision": "bf16", **p}))
            got = torch.tensor(res[0][key])
            assert res[1][key] == res[0][key]
            rel = ((got - ref).abs() / ref).max().item()
            assert rel < 0.02, (name, p, rel)


CLIP_CASES_2 = [("gpt", {"dp": 2}), ("gpt", {"tp": 2}), ("gpt", {"pp": 2, "microbatches": 2}),
                ("gpt", {"dp": 2, "zero": 2}), ("hf_llama", {"tp": 2})]
CLIP_CASES_4 = [("gpt", {"dp": 2, "tp": 2, "zero": 1}), ("gpt", {"pp": 2, "tp": 2}),
                ("hf_llama", {"dp": 4, "zero": 3})]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [(2, CLIP_CASES_2), (4, CLIP_CASES_4)])
def test_clipping_by_global_norm_across_shards_equals_clip_grad_norm(world, cases):
    """Plan.max_grad_norm under dp, tp (split and replicated weights), pp (a tied embedding on
    two stages), ZeRO 1/2/3 shards and combinations: the norm of every step (on every rank),
    the losses and the final parameters equal single-process training with
    torch.nn.utils.clip_grad_norm_ (fp32, rtol 1e-5); the clip is active on every step."""
    check_clipping(world, cases)


@pytest.mark.slow
def test_fp16_injected_overflow_skips_exactly_that_step_on_every_rank():
    """fp16 at dp=2, tp=2, pp=2 and dp=2 + ZeRO-2 / ZeRO-3: rank 1's gradients are made inf at step 2
    (an overflow on one rank only). Every rank skips that step (its parameters unchanged),
    halves the scale, and then trains on (parameters change, losses finite): the same on
    all ranks."""
    cases = [("gpt", {"precision": "fp16", **p}) for p in
             [{"dp": 2}, {"tp": 2}, {"pp": 2, "microbatches": 2}, {"dp": 2, "zero": 2},
              {"dp": 2, "zero": 3}]]
    res = fxpar.launch(fp16_overflow_rank, 2, cases, 2, 5)
    for _, plan in cases:
        r0, r1 = res[0][repr(plan)], res[1][repr(plan)]
        assert r0 == r1, plan
        assert r0["skipped"] == [False, False, True, False, False], plan
        assert r0["unchanged"] == [False, False, True, False, False], plan
        assert r0["scales"] == [2.0 ** 16] * 2 + [2.0 ** 15] * 3, plan
        assert all(torch.isfinite(torch.tensor(r0["losses"] + [r0["eval"]]))), plan


def test_fusion_runs_on_the_bf16_graph():
    """Precision x fusion: under Triton's interpreter the fusion pass fuses the bf16 GPT
    training graph (half matmul outputs feeding fp32 norms / softmax / cross-entropy) and the
    fused program equals the unfused bf16 one (bf16 values rounded per op as eager: loss and
    fp32 gradients within bf16 rounding)."""
    from fxpar.kernels.jit import interpreter
    from fxpar.passes import fusion
    torch.manual_seed(0)
    cfg = M.GPTConfig(n_layer=1)
    model, batch = M.GPT(cfg), M.gpt_batch(cfg, 2)
    gm, sig = capture(model, batch)
    ctx = PassContext(signature=sig, device="cpu")
    gm = precision.run(gm, precision.Options(precision="bf16"), ctx)
    gm.recompile()
    args = [*(p.detach() for p in model.parameters()), *model.buffers(),
            *flatten_batch(batch, sig)]
    want = gm(*args)
    with interpreter():
        gm = fusion.run(gm, fusion.Options(), ctx)
        gm.graph.lint()
        gm.recompile()
        verify(gm)
        got = gm(*args)
    kinds = [n.meta[ir.FUSED_GROUP]["kind"] for n in gm.graph.nodes if ir.FUSED_GROUP in n.meta]
    assert "layer_norm" in kinds and "cross_entropy" in kinds, kinds
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)

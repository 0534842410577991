"""On a real NVIDIA GPU: training steps with the Triton kernels launched for real (the fusion
pass's layer norm and cross-entropy; ATen's attention is kept on CUDA), bf16 / fp16
precision, activation offload to pinned host memory on a side stream, the optimizer stepped
on host copies (Plan.offload_optimizer), the planner's
memory estimate against the CUDA allocator, the step replayed as a CUDA graph,
Plan.codegen="inductor" (Inductor's Triton kernels, fxpar's cross-entropy kernel kept), and
context parallelism's chunk attention on CUDA's flash kernels.
Tests that name no codegen run "auto": Inductor on a GPU.

Skipped where no GPU is (CI has none). Where one is lent:

    FXPAR_TEST_GPU=1 python -m pytest -q tests/test_gpu.py tests/test_kernels.py

(FXPAR_TEST_GPU=1 also runs every kernel test of tests/test_kernels.py on the GPU instead of
Triton's interpreter.)
"""
import copy
import dataclasses

import pytest
import torch

import fxpar
from fxpar.compiler import planner
from fxpar.compiler.compile import planner_stats
from fxpar.examples import models as M

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs an NVIDIA GPU (CI has none)")

CFG = M.GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=8, n_embd=256)
ROWS = 8


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 matmuls in full fp32 (torch's default) on both sides of each comparison."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def _batch(cfg=CFG, rows=ROWS):
    return [t.cuda() for t in M.gpt_batch(cfg, rows)]


def _opt(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def _eager_losses(steps, data):
    torch.manual_seed(0)
    model = M.GPT(CFG).cuda()
    opt = _opt(model.parameters())
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(data)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _fxpar(plan, steps, data, cfg=CFG):
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(cfg).cuda(), ["cuda:0"], example_batch=data, optimizer=_opt,
                           plan=plan)
    return pm, [pm.step(data).item() for _ in range(steps)]


def test_fused_training_on_gpu_equals_eager():
    """fp32, codegen="eager", with the fusion pass: the hand-written layer norms and
    cross-entropy run as compiled Triton kernels (not the interpreter), ATen's CUDA
    attention is kept (faster than fxpar's Triton flash kernel there), and 4 AdamW steps give
    eager's losses."""
    data = _batch()
    pm, got = _fxpar(fxpar.Plan(fuse=True, codegen="eager"), 4, data)
    assert pm.world.device.type == "cuda"
    assert not getattr(pm, "fusion_skipped", None), pm.fusion_skipped
    groups = [g for gm in pm.stage_graphs["fusion"].values() for g in gm.meta["fusion"].groups]
    kinds = {g.kind for g in groups}
    assert {"layer_norm", "cross_entropy"} <= kinds, kinds
    assert "flash_attention" not in kinds, kinds
    want = _eager_losses(4, data)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_inductor_codegen_on_gpu_equals_eager(precision, tol):
    """Plan.codegen="inductor" on a GPU: the graph's compute compiled into Triton kernels by
    Inductor (one fuser: of fxpar's kernels only the cross-entropy stays, as a node between
    compiled runs), no run refused, and 4 AdamW steps give eager's losses (fp32: Inductor's
    fused reductions round differently from ATen's, hence 1e-4; bf16: the half-precision
    bound)."""
    data = _batch()
    pm, got = _fxpar(fxpar.Plan(codegen="inductor", precision=precision, cuda_graphs=False),
                     4, data)
    gen = pm.codegen_result
    assert gen is not None and gen.runs and not gen.failed, pm.codegen_summary
    assert sum(r.ops for r in gen.runs) > 3 * gen.eager_ops, pm.codegen_summary
    kinds = {g.kind for gm in pm.stage_graphs["fusion"].values()
             for g in gm.meta["fusion"].groups}
    assert kinds == {"cross_entropy", "cross_entropy_backward"}, kinds
    want = _eager_losses(4, data)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol, atol=tol)


def test_bf16_attention_runs_the_kernel_torch_picks_for_bf16_and_equals_autocast():
    """The trace (fp32) holds memory-efficient attention; in bf16 the precision pass swaps it
    for what torch's scaled_dot_product_attention picks for bf16 inputs (cuDNN or flash on
    an H100/H200), forward and backward; 4 AdamW steps equal eager under autocast (the same
    kernel there) within bf16 rounding, op by op and with Inductor."""
    data = _batch()
    q = torch.randn(ROWS, CFG.n_head, CFG.block_size, CFG.n_embd // CFG.n_head,
                    device="cuda", dtype=torch.bfloat16)
    want_kernel = {1: "flash", 3: "cudnn"}.get(
        int(torch._fused_sdp_choice(q, q, q, None, 0.0, True)))
    torch.manual_seed(0)
    model = M.GPT(CFG).cuda()
    opt = _opt(model.parameters())
    want = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(data)
        loss.backward()
        opt.step()
        want.append(loss.item())
    for codegen in ("eager", "inductor"):
        pm, got = _fxpar(fxpar.Plan(precision="bf16", codegen=codegen, cuda_graphs=False), 4,
                         data)
        kernels = {k for gm in pm.stage_graphs["precision"].values()
                   for k in gm.meta["precision"].attention.values()}
        assert kernels == ({want_kernel} if want_kernel else set()), (kernels, want_kernel)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)


def test_bf16_attention_swap_on_hf_gpt2_keeps_the_models_views():
    """HF GPT-2's q, k, v are [B, H, T, D]-contiguous once cast to bf16; cuDNN / flash lay
    their output out as q, memory-efficient attention (the fp32 trace's) as [B, T, H, D], and
    the model's `.transpose(1, 2).view(B, T, C)` needs the latter (on an H200 the compile
    failed there). The swapped graph compiles, its kernel is torch's choice for bf16, and
    4 AdamW steps equal eager under autocast within bf16 rounding, op by op and with
    Inductor."""
    torch.manual_seed(0)
    base = M.hf_gpt2(vocab=512, n_embd=256, n_layer=2, n_head=4, n_positions=128).cuda()
    batch = {k: v.cuda() for k, v in M.hf_lm_batch(512, 8, 128).items()}
    q = torch.randn(8, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    want_kernel = {1: "flash", 3: "cudnn"}.get(
        int(torch._fused_sdp_choice(q, q, q, None, 0.0, True)))
    model = copy.deepcopy(base)
    opt = _opt(model.parameters())
    want = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    for codegen in ("eager", "inductor"):
        pm = fxpar.parallelize(copy.deepcopy(base), ["cuda:0"], example_batch=batch,
                               optimizer=_opt, plan=fxpar.Plan(precision="bf16",
                                                               codegen=codegen,
                                                               cuda_graphs=False))
        kernels = {k for gm in pm.stage_graphs["precision"].values()
                   for k in gm.meta["precision"].attention.values()}
        assert kernels == ({want_kernel} if want_kernel else set()), (kernels, want_kernel)
        got = [pm.step(batch).item() for _ in range(4)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_training_on_gpu_tracks_fp32(precision):
    """bf16 / fp16 (fp32 master weights, fp16 with its dynamic loss scale): 8 steps within a
    half-precision rounding of the fp32 run's losses, and the loss goes down."""
    data = _batch()
    pm, got = _fxpar(fxpar.Plan(precision=precision), 8, data)
    want = _eager_losses(8, data)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)
    assert got[-1] < got[0] - 0.1, got
    if precision == "fp16":
        assert pm.scaler.skipped_steps == 0


def test_offload_on_gpu_keeps_the_losses_and_lowers_the_peak():
    """4 microbatches under GPipe with offload: the stashed activations go to pinned host memory on a side
    stream and come back before their backward; the losses are those of the same plan
    without offload and the CUDA allocator's peak is lower (activations dominate here:
    T=512, 32 rows, a small vocabulary)."""
    from fxpar.runtime.memtrack import measure
    cfg = dataclasses.replace(CFG, vocab_size=128, block_size=512)
    data = _batch(cfg, 32)
    peaks, losses = {}, {}
    for offload in (False, True):
        # GPipe: all four forwards before any backward, so three microbatches' activations
        # wait (1F1B at pp=1 runs each backward right after its forward: nothing waits)
        pm, losses[offload] = _fxpar(fxpar.Plan(microbatches=4, schedule="gpipe",
                                                offload=offload, fuse=False), 3, data, cfg)
        _, peaks[offload] = measure(lambda: pm.step(data))
        assert not offload or pm.offload_stats["copies"] > 0, pm.offload_stats
        del pm
        torch.cuda.empty_cache()
    # the same arithmetic; CUDA's embedding backward accumulates with atomics (not
    # bit-reproducible run to run), so equal to float rounding
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]),
                               rtol=1e-6, atol=1e-6)
    assert peaks[True] < 0.9 * peaks[False], peaks


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_offload_optimizer_on_gpu_keeps_the_losses_and_frees_the_state():
    """Plan.offload_optimizer: AdamW's moments in host memory, the step on the CPU,
    the parameters copied back in place (the CUDA graph replays them): the losses of the same
    plan without offload (the CPU's fused AdamW against CUDA's: rounding), and the device
    memory held after the steps lower by the moments (two fp32 copies of the parameters)."""
    data = _batch()
    held, losses = {}, {}
    for offload in (False, True):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        pm, losses[offload] = _fxpar(fxpar.Plan(offload_optimizer=offload), 4, data)
        held[offload] = torch.cuda.memory_allocated() - base
        if offload:
            state = [v for st in pm.optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0]
            assert state and all(v.device.type == "cpu" for v in state)
            moments = 2 * sum(p.numel() * 4 for p in pm.params)
        del pm
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]),
                               rtol=1e-5, atol=1e-5)
    assert held[False] - held[True] >= 0.9 * moments, (held, moments)


@pytest.mark.parametrize("remat,precision", [("none", "fp32"), ("none", "bf16"),
                                              ("sqrt", "fp32")])
def test_memory_estimate_matches_the_cuda_allocator(remat, precision):
    """The planner's estimate of what one step allocates on top of the resident weights and
    AdamW state (activations after remat, gradients) against torch.cuda.max_memory_allocated:
    within 10% without remat; with remat="sqrt" within 0.9-1.3x (the pass picks the lowest
    simulated peak of a few checkpoint spacings, the estimate prices one: 1.2x on this model
    on CPU)."""
    from fxpar.core import cost
    from fxpar.runtime.memtrack import measure
    data = _batch()
    pm, _ = _fxpar(fxpar.Plan(remat=remat, precision=precision, fuse=False, cuda_graphs=False),
                   2, data)
    _, peak = measure(lambda: pm.step(data))  # above the resident weights and AdamW state
    stats = planner_stats(M.GPT(CFG), M.gpt_batch(CFG, ROWS), precision=precision)
    hw = dataclasses.replace(cost.HARDWARE["h100"])
    c = planner.search(stats, 1, hw, batch_rows=ROWS, optimizer="adamw", precision=precision,
                       constraints={"dp": 1, "tp": 1, "pp": 1, "microbatches": 1,
                                    "remat": remat, "precision": precision}).table[0]
    est = c.memory.per_stage[0].step_allocated
    if remat == "none":
        assert abs(est - peak) <= 0.10 * peak, (est, peak, c.memory.per_stage[0])
    else:
        assert 0.9 * peak <= est <= 1.3 * peak, (est, peak)


@pytest.mark.parametrize("codegen,precision,tol", [("eager", "fp32", 2e-5),
                                                   ("eager", "bf16", 2e-2),
                                                   ("inductor", "fp32", 1e-4),
                                                   ("inductor", "bf16", 2e-2)])
def test_cuda_graph_replay_equals_eager(codegen, precision, tol):
    """Plan.cuda_graphs=True: 2 warm-up steps, then the forward+backward captured and replayed
    (with codegen="inductor": Inductor's kernels inside fxpar's capture); 6 AdamW steps give
    eager's losses (fp32 op by op: the same kernels; Inductor's: its own rounding; bf16:
    within the half-precision bound above), every replay has its device time, and the
    replayed step is not slower than the uncaptured one (10% for timing noise)."""
    import time
    data = _batch()
    pm, got = _fxpar(fxpar.Plan(precision=precision, cuda_graphs=True, codegen=codegen), 6,
                     data)
    assert pm.cuda_graphs.capture and pm._graphed.captured, pm.cuda_graphs
    assert all(s.device_s is not None and s.device_s > 0 for s in pm.step_stats[3:])
    want = _eager_losses(6, data)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol, atol=tol)
    off, _ = _fxpar(fxpar.Plan(precision=precision, cuda_graphs=False, codegen=codegen), 3,
                    data)
    times = {}
    for name, m in (("graph", pm), ("eager-executor", off)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            m.step(data)
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - t
    assert times["graph"] <= 1.10 * times["eager-executor"], times


@pytest.mark.parametrize("experts", ["batched_mm", "grouped_mm"])
def test_cuda_graph_replay_of_an_moe_step_equals_eager(experts):
    """HF Mixtral (top-2 routing by integer indices): the step is captured (cuda_graphs
    "auto") and 6 AdamW steps give eager's losses; each step's routing differs (new
    batches), so a replay that kept the captured step's routing would not. transformers'
    default grouped_mm experts in fp32 run torch's group-by-group fallback, which reads the
    offsets on the host: that step runs uncaptured, said why, with the same losses."""
    from fxpar.examples import zoo
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if experts not in ALL_EXPERTS_FUNCTIONS:
        pytest.skip(f"this transformers has no {experts} experts")
    model, spec = zoo.build("mixtral")
    model.config._experts_implementation = experts
    batches = [{k: v.cuda() for k, v in spec.batch(s).items()} for s in range(6)]
    eager = copy.deepcopy(model).cuda()
    opt = _opt(eager.parameters())
    want = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss = zoo.loss_of(eager, spec, b)
        loss.backward()
        opt.step()
        want.append(loss.item())
    pm = fxpar.parallelize(model.cuda(), ["cuda:0"], example_batch=batches[0], optimizer=_opt,
                           plan=fxpar.Plan(codegen="eager"))
    got = [pm.step(b).item() for b in batches]
    if experts == "grouped_mm":
        assert not pm.cuda_graphs.capture and "grouped matmul" in pm.cuda_graphs.reason
    else:
        assert pm.cuda_graphs.capture and pm._graphed.captured, pm.cuda_graphs
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-5, atol=2e-5)


def test_cuda_graph_replay_draws_new_dropout_masks():
    """Dropout inside the captured graph: torch registers the generator's philox offsets with
    the graph, so each replay draws a new mask (lr=0: the same weights and batch give a
    different loss every replay, as in eager)."""
    cfg = dataclasses.replace(CFG, dropout=0.1)
    data = _batch(cfg)
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(cfg).cuda(), ["cuda:0"], example_batch=data,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0),
                           plan=fxpar.Plan(cuda_graphs=True))
    losses = [pm.step(data).item() for _ in range(6)]
    assert pm._graphed.captured
    assert len(set(losses[3:])) == 3, losses


def test_cuda_graph_replay_of_pipeline_parts():
    """cuda_graphs=True with 2 microbatches: every part is captured and replayed per
    microbatch (activations copied in, outputs cloned out); the losses are those of the same
    plan uncaptured (to float rounding: CUDA's embedding backward uses atomics)."""
    data = _batch()
    losses = {}
    for graphs in (True, False):
        pm, losses[graphs] = _fxpar(fxpar.Plan(microbatches=2, schedule="1f1b",
                                               cuda_graphs=graphs), 6, data)
        if graphs:
            assert all(g.captured for g in pm.pipeline_runner.graphs.values())
        else:
            assert pm.pipeline_runner.graphs is None
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_chunk_attention_on_cuda_is_whole_sequence_attention(monkeypatch, cp):
    """Context parallelism's attention on CUDA's flash kernels (core/context_attention: each
    rank's front and back chunk of queries against the keys before them and their own,
    merged by logsumexp; the backward from the merged output): each rank's rows of causal
    SDPA over the whole sequence, and the keys' and values' gradients summed over the ranks
    equal SDPA's. bf16, so within bf16's rounding of the same sums."""
    from fxpar.core import context_attention
    fx = torch.ops.fxpar
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 256 * cp, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    go = torch.randn_like(ref)
    ref.backward(go)
    gk, gv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    tol = dict(rtol=5e-2, atol=5e-2)  # (a wrong block or layout is off by O(1))
    for r in range(cp):
        monkeypatch.setattr(context_attention, "_rank", lambda name, r=r: r)
        qc = fx.zigzag_chunk(q.detach(), 2, cp, "g")
        out, lse = fx.causal_chunk_attention(qc, k.detach(), v.detach(), 0.0, None, "g")
        torch.testing.assert_close(out, fx.zigzag_chunk(ref.detach(), 2, cp, "g"), **tol)
        dq, dk, dv = fx.causal_chunk_attention_backward(
            fx.zigzag_chunk(go, 2, cp, "g"), qc, k.detach(), v.detach(), out, lse, 0.0,
            None, "g")
        torch.testing.assert_close(dq, fx.zigzag_chunk(q.grad, 2, cp, "g"), **tol)
        gk, gv = gk + dk.float(), gv + dv.float()
    torch.testing.assert_close(gk, k.grad.float(), **tol)
    torch.testing.assert_close(gv, v.grad.float(), **tol)
    # the flash op the pass makes of CUDA's kernel: the kernel's own results
    out, lse = fx.flash_attention(q.detach(), k.detach(), v.detach(), 0.0, True, None)
    torch.testing.assert_close(out, ref.detach(), **tol)
    dq, dk, dv = fx.flash_attention_backward(go, q.detach(), k.detach(), v.detach(), out, lse,
                                             0.0, True, None)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, **tol)

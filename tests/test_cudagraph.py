"""CUDA-graph replay (runtime/cudagraph.py): which programs are captured and why not, and the
static-buffer plumbing of a replayed step, checked on CPU with a stand-in for the CUDA graph
that has a real graph's semantics (a capture records, a replay recomputes into the same
output buffers from the same input buffers). Replays on a GPU: tests/test_gpu.py."""

import types

import pytest
import torch

import fxpar
from fxpar.compiler.capture import capture
from fxpar.core.errors import PlanError
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.core.plan import resolve
from fxpar.examples import models as M
from fxpar.runtime import cudagraph

CUDA = torch.device("cuda")


def _program(model, batch, world=1, **plan):
    gm, sig = capture(model, batch)
    ctx = PassContext(signature=sig, group_names={"dp": "dp-group", "tp": "tp-group"})
    gm = run_passes(gm, resolve(plan, world), ctx, "dp", {})
    return types.SimpleNamespace(graph=gm, pipeline=None)


def _gpt(dropout=0.0):
    cfg = M.GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16,
                      dropout=dropout)
    return M.GPT(cfg), M.gpt_batch(cfg, 4)


def test_single_device_gpt_step_is_captured_on_cuda():
    prog = _program(*_gpt())
    d = cudagraph.decide(prog, "auto", CUDA, None)
    assert d.capture and "forward+backward" in d.reason
    assert cudagraph.decide(prog, True, CUDA, None).capture


def test_cpu_ranks_and_cuda_graphs_false_never_capture():
    prog = _program(*_gpt())
    assert "CUDA device" in cudagraph.decide(prog, "auto", torch.device("cpu"), "gloo").reason
    assert not cudagraph.decide(prog, False, CUDA, "nccl").capture


def test_collectives_are_captured_on_nccl_only():
    prog = _program(*_gpt(), world=2, dp=2)
    assert cudagraph.decide(prog, "auto", CUDA, "nccl").capture
    assert cudagraph.decide(prog, "auto", CUDA, "cpu:gloo,cuda:nccl").capture
    d = cudagraph.decide(prog, "auto", CUDA, "gloo")
    assert not d.capture and "gloo backend" in d.reason and "all_reduce" in d.reason


@pytest.mark.slow  # (three compiles, ~5 s: make test's time)
def test_remat_rng_replay_falls_back_with_the_reason():
    """remat recomputes a dropout by replaying the saved RNG state: that reads
    torch.cuda.get_rng_state, which a capture forbids. Without dropout remat is captured."""
    d = cudagraph.decide(_program(*_gpt(dropout=0.1), remat="sqrt"), "auto", CUDA, None)
    assert not d.capture and "RNG state" in d.reason and "remat='none'" in d.reason
    assert cudagraph.decide(_program(*_gpt(), remat="sqrt"), "auto", CUDA, None).capture
    # plain dropout (no remat) is graph-safe: torch registers the generator with the graph
    assert cudagraph.decide(_program(*_gpt(dropout=0.1)), "auto", CUDA, None).capture


def test_pipeline_parts_are_captured_only_when_asked():
    """A pipeline part runs once per microbatch: capturing it copies activations in and
    outputs out, so "auto" leaves pipelines uncaptured (until measured on a GPU) and True
    captures every part."""
    model, batch = _gpt()
    pm = fxpar.parallelize(model, 1, example_batch=batch,
                           plan=dict(microbatches=2, schedule="gpipe"))
    d = cudagraph.decide(pm.program, "auto", CUDA, None)
    assert not d.capture and "cuda_graphs=True" in d.reason
    d = cudagraph.decide(pm.program, True, CUDA, None)
    assert d.capture and "each pipeline part" in d.reason


def test_pipelines_data_dependent_shapes_and_host_copies_fall_back():
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.nonzero.default(x))
    d = cudagraph.decide(types.SimpleNamespace(graph=gm, pipeline=None), "auto", CUDA, None)
    assert not d.capture and "depends on the data" in d.reason

    from torch._subclasses.fake_tensor import FakeTensorMode
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten._to_copy.default(x, device="cpu"))
    with FakeTensorMode():
        x = torch.empty(4, device="cuda")
        out = torch.empty(4)
    for n in gm.graph.nodes:
        n.meta["val"] = x if n.op == "placeholder" else out
    d = cudagraph.decide(types.SimpleNamespace(graph=gm, pipeline=None), "auto", CUDA, None)
    assert not d.capture and "copies a device value to the host" in d.reason


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.slow  # (make test's 6 minutes)
def test_moe_routing_by_integer_indices_is_capturable(name, monkeypatch):
    """HF's MoE layers route tokens with x[idx] on integer indices (a fixed shape, no host
    sync): their programs are captured with the batched_mm experts (on CUDA in fp32
    passes/batched_experts leaves them picked per row: grouped they would read their
    offsets on the host); transformers' default grouped_mm experts in fp32 are refused
    (torch's fallback reads the offsets on the host), and a boolean-mask index stays
    refused."""
    from fxpar.examples import zoo
    from fxpar.passes import batched_experts
    model, spec = zoo.build(name)
    prog = fxpar.compile(model, 1, example_batch=spec.batch(0), loss_fn=spec.loss_fn)
    assert any("grouped matmul" in w for w in cudagraph.uncapturable(prog.graph.graph, "nccl"))
    model.config._experts_implementation = "batched_mm"
    # (compiled for CPU here: the experts as a CUDA fp32 compile leaves them)
    monkeypatch.setattr(batched_experts, "find", lambda gm: [])
    prog = fxpar.compile(model, 1, example_batch=spec.batch(0), loss_fn=spec.loss_fn)
    assert any(n.target is torch.ops.aten.index.Tensor for n in prog.graph.graph.nodes)
    assert cudagraph.uncapturable(prog.graph.graph, "nccl") == []
    g = torch.fx.Graph()
    x, m = g.placeholder("x"), g.placeholder("m")
    g.output(g.call_function(torch.ops.aten.index.Tensor, (x, [m])))
    x.meta["val"], m.meta["val"] = torch.empty(4, 3), torch.empty(4, dtype=torch.bool)
    assert "depends on the data" in cudagraph.uncapturable(g, "nccl")[0]


def test_expert_parallel_dispatch_is_not_capturable():
    """ep's all-to-all reads the routed counts on the host and a rank receives as many rows
    as the routing sends: refused by name, not left to fail inside a capture."""
    from fxpar.core import experts  # noqa: F401  (registers fxpar::ep_*)
    g = torch.fx.Graph()
    x, route = g.placeholder("x"), g.placeholder("route")
    g.output(g.call_function(torch.ops.fxpar.ep_dispatch.default, (x, route, "fxpar.ep")))
    x.meta["val"] = torch.empty(8, 4, dtype=torch.bfloat16)
    route.meta["val"] = torch.empty(2, 2, 2, dtype=torch.int64)
    why = cudagraph.uncapturable(g, "nccl")
    assert len(why) == 1 and "reads the routed counts on the host" in why[0]


def test_cuda_graphs_true_on_cpu_is_a_clear_error():
    model, batch = _gpt()
    with pytest.raises(PlanError, match="cuda_graphs=True.*CUDA device.*'auto'"):
        fxpar.parallelize(model, 1, example_batch=batch, plan=dict(cuda_graphs=True))
    with pytest.raises(PlanError, match="cuda_graphs must be"):
        fxpar.parallelize(model, 1, example_batch=batch, plan=dict(cuda_graphs="on"))


def test_graphs_false_and_pipelines_under_auto_never_build_a_graph(monkeypatch):
    monkeypatch.setattr(cudagraph, "_CudaBackend", lambda device: pytest.fail("captured"))
    model, batch = _gpt()
    pm = fxpar.parallelize(model, 1, example_batch=batch, plan=dict(cuda_graphs=False))
    for _ in range(4):
        pm.step(batch)
    assert pm._graphed is None and not pm.cuda_graphs.capture


def _eager_losses(model, batches, lr):
    ref = M.GPT(model.cfg)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    out = []
    for b in batches:
        opt.zero_grad()
        loss = ref(b)
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return ref, torch.stack(out)


class ReplayOnCPU:
    """A CUDA graph's semantics on CPU: capture records (computes nothing that the caller may
    use: new outputs are poisoned), replay recomputes into the captured output buffers from
    the captured input buffers."""

    def __init__(self):
        self.captures = self.replays = self.warm_runs = 0

    def warm(self, fn, inputs):
        self.warm_runs += 1
        return fn(*inputs)

    def capture(self, fn, inputs):
        self.captures += 1
        self.fn, self.inputs = fn, inputs
        self.outs = list(fn(*inputs))
        held = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        for o in self.outs:  # new memory holds garbage after a capture; aliases of inputs not
            if isinstance(o, torch.Tensor) and o.is_floating_point() and \
                    o.untyped_storage().data_ptr() not in held:
                o.fill_(float("nan"))
        return self.outs

    def replay(self):
        self.replays += 1
        for o, new in zip(self.outs, self.fn(*self.inputs)):
            if isinstance(o, torch.Tensor):
                o.copy_(new)

    def last_device_s(self):
        return 1e-3


def test_graphed_step_copies_batches_and_follows_moved_parameters():
    w = torch.ones(3)
    backend = ReplayOnCPU()
    step = cudagraph.GraphedStep(lambda w, x: (w * x, x.sum()), [True, False],
                                 torch.device("cpu"),
                                 warmup=2, backend=backend)
    for i in range(5):
        x = torch.full((3,), float(i))
        y, s = step([w, x])
        assert torch.equal(y, w * x) and s.item() == 3 * i
    assert (backend.warm_runs, backend.captures, backend.replays) == (2, 1, 3)
    assert y is step.static_outputs[0]        # static: the next replay overwrites it
    assert step.static_inputs[1] is not x     # the batch is copied, not read in place
    with torch.no_grad():
        w.mul_(2)                             # an optimizer step: in place, no copy needed
    assert torch.equal(step([w, x])[0], 2 * x)
    w.data = torch.full((3,), 5.0)            # load() moving the parameter: copied over
    assert torch.equal(step([w, x])[0], 5 * x)
    assert step.last_device_s() == 1e-3


def test_replayed_training_matches_eager(monkeypatch):
    """The api's captured path end to end on CPU: four warm-up/captured/replayed steps give
    eager's losses and weights (the loss is cloned out of the static output, the gradients
    reach the optimizer, the step statistics carry the replay's device time)."""
    backend = ReplayOnCPU()
    monkeypatch.setattr(cudagraph, "decide", lambda *a: cudagraph.Decision(True, "test"))
    monkeypatch.setattr(cudagraph, "_CudaBackend", lambda device: backend)
    model, batch = _gpt()
    batches = [M.gpt_batch(model.cfg, 4, seed=s) for s in range(5)]
    ref, want = _eager_losses(model, batches, 1e-2)
    pm = fxpar.parallelize(model, 1, example_batch=batch,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    losses = [pm.step(b) for b in batches]
    assert backend.captures == 1 and backend.replays == 3
    torch.testing.assert_close(torch.stack(losses), want, rtol=1e-5, atol=1e-6)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=k)
    assert pm.step_stats[-1].device_s == 1e-3
    assert pm.step_stats[1].device_s is None  # a warm-up step, not replayed
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        events = json.load(open(pm.trace(f"{d}/t.json")))
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps = [e for e in events if e.get("cat") == "step"]
    assert [e.get("args", {}).get("gpu_ms") for e in steps] == [None, None, 1.0, 1.0, 1.0]
    # the replayed graph is the unlowered one: no region markers, one segment (warm-up alike)
    # after the batch's preparation ("forward")
    compute = [e["cat"] for e in events if e.get("tid") == 0 and e.get("ph") == "X"
               and e["cat"] not in ("step", "blocked", "forward")]
    assert compute == ["forward+backward", "optimizer"] * 5


class RefusedOnCPU(ReplayOnCPU):
    """torch refusing the capture midway (an op copying to the host inside its kernel call:
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture ...")."""

    def capture(self, fn, inputs):
        self.captures += 1
        raise cudagraph.CaptureFailed("Cannot copy between CPU and CUDA tensors during CUDA "
                                      "graph capture unless the CPU tensor is pinned.")


def test_a_refused_capture_runs_uncaptured_under_auto_and_raises_under_true(monkeypatch):
    """A capture torch refuses (what the static check cannot see) is not a crash under "auto":
    the step runs uncaptured from then on, with eager's losses, and says why; cuda_graphs=True
    raises a PlanError naming torch's reason."""
    monkeypatch.setattr(cudagraph, "decide", lambda *a: cudagraph.Decision(True, "test"))
    monkeypatch.setattr(cudagraph, "_CudaBackend", lambda device: RefusedOnCPU())
    model, batch = _gpt()
    batches = [M.gpt_batch(model.cfg, 4, seed=s) for s in range(4)]
    _, want = _eager_losses(model, batches, 1e-2)
    strict = M.GPT(model.cfg)
    strict.load_state_dict(model.state_dict())
    pm = fxpar.parallelize(model, 1, example_batch=batch,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    losses = torch.stack([pm.step(b) for b in batches])
    assert not pm.cuda_graphs.capture and "pinned" in pm.cuda_graphs.reason
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    pm = fxpar.parallelize(strict, 1, example_batch=batch, plan={"cuda_graphs": True},
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    with pytest.raises(PlanError, match="cuda_graphs=True.*pinned"):
        for b in batches:
            pm.step(b)


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm"), reason="no grouped_mm")
def test_fp32_grouped_mm_is_not_captured():
    """torch runs a grouped matmul of fp32 operands group by group, reading the offsets on
    the host (HF MoE experts' default form in fp32): not captured, said why."""
    g = torch.fx.Graph()
    a, b, offs = (g.placeholder(n) for n in ("a", "b", "offs"))
    a.meta["val"], b.meta["val"] = torch.empty(16, 8), torch.empty(4, 8, 6)
    offs.meta["val"] = torch.empty(4, dtype=torch.int32)
    out = g.call_function(torch.ops.aten._grouped_mm.default, (a, b, offs))
    out.meta["val"] = torch.empty(16, 6)
    g.output(out)
    assert "grouped matmul" in cudagraph.uncapturable(g, None)[0]
    for v in (a, b):
        v.meta["val"] = v.meta["val"].to(torch.bfloat16)
    assert cudagraph.uncapturable(g, None) == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.slow  # (make test's 6 minutes)
def test_replayed_pipeline_parts_match_eager(monkeypatch, schedule):
    """cuda_graphs=True on a microbatched program: every part (forward, backward, gradient
    reduction) is captured after its warm-up calls and replayed per microbatch; outputs are
    cloned out of the static buffers, so microbatches in flight keep their own values, and
    training matches eager."""
    backends = []

    def new_backend(device):
        backends.append(ReplayOnCPU())
        return backends[-1]
    monkeypatch.setattr(cudagraph, "decide", lambda program, setting, *a: cudagraph.Decision(
        program.pipeline is not None and setting is True, "test"))
    monkeypatch.setattr(cudagraph, "_CudaBackend", new_backend)
    model, batch = _gpt()
    batches = [M.gpt_batch(model.cfg, 4, seed=s) for s in range(5)]
    _, want = _eager_losses(model, batches, 1e-2)
    plain = M.GPT(model.cfg)
    plain.load_state_dict(model.state_dict())
    runs = {}
    for graphs, m in ((True, model), (False, plain)):
        pm = fxpar.parallelize(m, 1, example_batch=batch,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                               plan=dict(microbatches=2, schedule=schedule, cuda_graphs=graphs))
        runs[graphs] = torch.stack([pm.step(b) for b in batches])
        assert (pm.pipeline_runner.graphs is not None) == graphs
        if graphs:
            assert backends and all(b.captures == 1 for b in backends)
            assert all(b.replays == (3 if b.warm_runs == 2 else 6) for b in backends)
    torch.testing.assert_close(runs[True], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(runs[True], runs[False])  # the same arithmetic, replayed
    for (k, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), k


def test_cuda_backend_calls_torchs_graph_api_by_its_signatures(monkeypatch):
    """No GPU here: the real backend runs against autospecced stand-ins of torch.cuda's graph,
    stream and event API, so calls are checked against torch's own signatures where Python
    declares them (torch.cuda.graph's keywords: a wrong one fails here, not first on a GPU;
    Event's constructor is C and takes anything); the order is torch.cuda.graphs' recipe: warm-up on a side stream that waits for the current one, sync, capture with the
    thread-local error mode, replay between two timing events."""
    from unittest import mock
    for name in ("CUDAGraph", "graph", "Stream", "Event", "current_stream", "stream",
                 "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, mock.create_autospec(getattr(torch.cuda, name)))
    b = cudagraph._CudaBackend(CUDA)
    fn = lambda x: (x + 1,)  # noqa: E731
    assert torch.equal(b.warm(fn, [torch.ones(2)])[0], torch.full((2,), 2.0))
    side = torch.cuda.Stream.return_value
    side.wait_stream.assert_called_once_with(torch.cuda.current_stream.return_value)
    torch.cuda.current_stream.return_value.wait_stream.assert_called_once_with(side)
    b.capture(fn, [torch.ones(2)])
    torch.cuda.synchronize.assert_called_once_with(CUDA)
    torch.cuda.empty_cache.assert_called_once_with()  # the warm-up's cache, before the pool
    torch.cuda.graph.assert_called_once_with(torch.cuda.CUDAGraph.return_value,
                                             capture_error_mode="thread_local")
    b.replay()
    torch.cuda.CUDAGraph.return_value.replay.assert_called_once_with()
    assert torch.cuda.Event.call_args_list == [mock.call(enable_timing=True)] * 2
    b.end.query.return_value = False
    assert b.last_device_s() is None  # not finished: never blocks
    b.end.query.return_value = True
    b.start.elapsed_time.return_value = 2.5
    assert b.last_device_s() == 2.5e-3

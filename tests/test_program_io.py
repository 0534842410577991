"""A Program saved and loaded (core/program_io.py): the same graphs node by node, metadata and
fake values included, and a loaded Program run by the runtime alone - in a process that never
imports the compiler - trains exactly as parallelize does."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fxpar
from fxpar.core import ir
from fxpar.core.errors import FxparError
from fxpar.core.graphs import verify
from fxpar.core.program_io import load_program, save_program
from fxpar.examples import models as M

CFG = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
DECLARED = {v for k, v in vars(ir).items() if k.isupper() and isinstance(v, str)}


def _same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> None:
    assert a.code == b.code
    for x, y in zip(a.graph.nodes, b.graph.nodes, strict=True):
        assert (x.op, x.name, x.target) == (y.op, y.name, y.target)
        assert {k: v for k, v in x.meta.items() if k in DECLARED - {ir.VAL}} == {
            k: v for k, v in y.meta.items() if k in DECLARED - {ir.VAL}}, x.name
        vx, vy = x.meta.get(ir.VAL), y.meta.get(ir.VAL)
        if isinstance(vx, torch.Tensor):
            assert (vx.shape, vx.stride(), vx.dtype) == (vy.shape, vy.stride(), vy.dtype), x.name


@pytest.mark.parametrize("plan, world", [
    ({"dp": 2, "zero": 3, "microbatches": 2}, 2),
    pytest.param({"pp": 2, "tp": 2, "microbatches": 2, "precision": "bf16", "remat": "sqrt"},
                 4, marks=pytest.mark.slow)],  # (make test's 6 minutes)
    ids=["zero3-microbatches", "pp-tp-bf16-remat"])
def test_a_saved_program_loads_node_for_node(tmp_path, plan, world):
    prog = fxpar.compile(M.GPT(CFG), world, example_batch=M.gpt_batch(CFG, 8), plan=plan)
    save_program(prog, tmp_path / "p.fxpar", evaluate=False)
    back = load_program(tmp_path / "p.fxpar")
    _same_graph(prog.graph, back.graph)
    verify(back.graph)  # the fake values rebuilt agree with a re-propagation
    if prog.pipeline is not None:
        assert prog.pipeline.parts.keys() == back.pipeline.parts.keys()
        for k, part in prog.pipeline.parts.items():
            _same_graph(part.graph, back.pipeline.parts[k].graph)
            assert (part.inputs, part.outputs) == (back.pipeline.parts[k].inputs,
                                                   back.pipeline.parts[k].outputs)
    if prog.loss_count is not None:
        _same_graph(prog.loss_count, back.loss_count)
    for f in dataclasses.fields(ir.Program):
        if f.name not in ("graph", "pipeline", "loss_count", "local_graph", "stage_graphs",
                          "plan_report", "build_eval", "signature"):
            assert getattr(back, f.name) == getattr(prog, f.name), f.name
    assert back.signature.param_names == prog.signature.param_names
    assert back.stage_graphs.keys() == prog.stage_graphs.keys()
    assert back.plan_report is None and back.build_eval is None  # (not saved: evaluate=False)


_RUNTIME_ONLY = textwrap.dedent("""
    import json, sys
    import torch
    from fxpar.core.program_io import load_program
    from fxpar.examples import models as M
    from fxpar.runtime import dist as rdist
    from fxpar.runtime.trainer import ParallelModel
    cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    program = load_program(sys.argv[1])
    torch.manual_seed(0)
    model = M.GPT(cfg)
    pm = ParallelModel(model, rdist.setup(1), program,
                       lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    losses = [pm.step(M.gpt_batch(cfg, 8, seed=s)).item() for s in range(3)]
    ev = pm.evaluate(M.gpt_batch(cfg, 8, seed=9)).item()
    above = sorted(m for m in sys.modules if m.startswith(("fxpar.compiler", "fxpar.passes",
                                                           "fxpar.api")))
    unbound = program.bound_groups is None and pm.program is not program
    print(json.dumps({"losses": losses, "evaluate": ev, "imported": above, "unbound": unbound}))
""")


def test_a_loaded_program_runs_without_the_compiler_exactly_as_parallelize(tmp_path):
    plan = {"dp": 1, "microbatches": 2}
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    prog = fxpar.compile(M.GPT(CFG), 1, example_batch=M.gpt_batch(CFG, 8), plan=plan)
    save_program(prog, tmp_path / "p.fxpar")  # evaluate()'s program compiled and saved too
    (tmp_path / "run.py").write_text(_RUNTIME_ONLY)
    r = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "p.fxpar")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["imported"] == [] and got["unbound"]  # (the runtime ran its bound copy)
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(CFG), 1, example_batch=M.gpt_batch(CFG, 8), optimizer=opt,
                           plan=plan)
    want = [pm.step(M.gpt_batch(CFG, 8, seed=s)).item() for s in range(3)]
    assert got["losses"] == want
    assert got["evaluate"] == pm.evaluate(M.gpt_batch(CFG, 8, seed=9)).item()
    with pytest.raises(FxparError, match="bound to its process groups"):
        save_program(pm.program, tmp_path / "bound.fxpar")


def test_a_loaded_graph_is_put_on_the_loading_ranks_device():
    """A graph compiled on rank 0 (cuda:0) loads on rank 3 with its fake values, device
    arguments and constants of that type on cuda:3; other devices stay."""
    from fxpar.core import program_io
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ones = g.call_function(torch.ops.aten.ones.default, ([4],),
                           {"device": torch.device("cuda", 0)})
    on_host = g.call_function(torch.ops.aten.ones.default, ([4],), {"device": torch.device("cpu")})
    c = g.get_attr("_tensor_constant0")
    g.output((g.call_function(torch.ops.aten.add.Tensor, (x, ones)), on_host, c))
    root = torch.nn.Module()
    root._tensor_constant0 = torch.zeros(2)
    gm = torch.fx.GraphModule(root, g)
    with mode:
        for n, dev in ((x, "cuda:0"), (ones, "cuda:0"), (on_host, "cpu")):
            n.meta[ir.VAL] = torch.empty(4, device=dev)
    back = program_io.decode_graph(program_io.encode_graph(gm), FakeTensorMode(),
                                   torch.device("cuda", 3))
    vals = {n.name: n.meta.get(ir.VAL) for n in back.graph.nodes}
    assert str(vals[x.name].device) == str(vals[ones.name].device) == "cuda:3"
    assert str(vals[on_host.name].device) == "cpu"
    ones_node = next(n for n in back.graph.nodes if n.name == ones.name)
    assert ones_node.kwargs["device"] == torch.device("cuda", 3)
    assert back._tensor_constant0.device.type == "cpu"  # (a host constant stays there)


def test_the_passes_reports_go_to_another_rank_not_to_a_file():
    """dumps(reports=True), what parallelize sends rank 0's Program with, keeps every
    snapshot's gm.meta (the passes' Decisions: their objects import on a rank that has the
    compiler); a file keeps only what loads without the compiler."""
    from fxpar.core import program_io
    prog = fxpar.compile(M.GPT(CFG), 2, example_batch=M.gpt_batch(CFG, 8),
                         plan={"dp": 2, "remat": "sqrt"})
    sent = program_io.loads(program_io.dumps(prog, evaluate=False, reports=True))
    filed = program_io.loads(program_io.dumps(prog, evaluate=False))
    assert sent.stage_graphs._read == {}  # (decoded when first read: most ranks never do)
    dropped = 0
    for name, roles in prog.stage_graphs.items():
        for role, gm in roles.items():
            assert sent.stage_graphs[name][role].meta.keys() == gm.meta.keys(), name
            dropped += len(gm.meta.keys() - filed.stage_graphs[name][role].meta.keys())
    assert sent.stage_graphs["remat"]["dp"].meta["remat"].recomputed == \
        prog.stage_graphs["remat"]["dp"].meta["remat"].recomputed != []
    assert dropped > 0


def _train_gpt_on_2(after_compile=lambda: None):
    """parallelize a GPT at dp=2, then (after_compile()) 2 steps and evaluate(): the compile
    rows, losses and evaluate()'s loss."""
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(CFG), 2, example_batch=M.gpt_batch(CFG, 8),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                           plan={"dp": 2})
    after_compile()
    losses = [pm.step(M.gpt_batch(CFG, 8, seed=s)).item() for s in range(2)]
    return ([name for name, *_ in pm.compile_times], losses,
            pm.evaluate(M.gpt_batch(CFG, 8, seed=9)).item())


def _compiled_once_rank():
    """Rank 0 compiles; rank 1 loads: their compile rows, losses and evaluate(); the same
    where rank 0's Program does not pickle, and where rank 1 cannot load it; then a model
    that cannot be traced: the same error on both ranks."""
    from fxpar.core import program_io
    rank = int(os.environ["RANK"])
    rows, losses, ev = _train_gpt_on_2()

    class Untraceable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return (y * 2 if y.sum().item() > 0 else y).pow(2).mean()
    # a Program that does not pickle (here: made so on rank 0): each rank compiles its own
    dumps, loads = program_io.dumps, program_io.loads

    def unpicklable(*args, **kwargs):
        raise pickle.PicklingError("Can't pickle <function made at compile time>")

    def unloadable(*args, **kwargs):
        raise ValueError("cannot load")
    program_io.dumps = unpicklable if rank == 0 else dumps
    try:
        own_rows, own, own_ev = _train_gpt_on_2()
    finally:
        program_io.dumps = dumps
    # rank 0's Program does not load on rank 1: rank 1 compiles its own; evaluate()'s
    # program still comes from rank 0 (both ranks ask for it at once)
    program_io.loads = unloadable if rank == 1 else loads
    try:
        unloaded_rows, unloaded, unloaded_ev = _train_gpt_on_2(
            after_compile=lambda: setattr(program_io, "loads", loads))
    finally:
        program_io.loads = loads
    try:
        fxpar.parallelize(Untraceable(), 2, example_batch=torch.randn(4, 4),
                          plan={"dp": 2}, batch="local")
        error = None
    except Exception as e:  # noqa: BLE001 - compared across the ranks below
        error = (type(e).__name__, str(e))
    return {"rank": rank, "rows": rows, "losses": losses, "eval": ev, "error": error,
            "own": (own_rows, own, own_ev), "unloaded": (unloaded_rows, unloaded, unloaded_ev)}


def test_a_job_compiles_on_rank_0_and_the_other_ranks_load_its_program():
    """fxpar.parallelize on 2 ranks: rank 0 captures and runs the passes, rank 1 loads the
    Program it sends (one "program from rank 0" row, no capture) and evaluate()'s program at
    the first evaluate; both train alike. Where rank 0's Program does not pickle, each rank
    compiles its own, with the same result. A model rank 0 cannot trace raises the same error
    on both ranks, not a wait on rank 1."""
    r0, r1 = fxpar.launch(_compiled_once_rank, 2).values()
    assert "capture" in r0["rows"] and "program to the ranks" in r0["rows"]
    assert "capture" not in r1["rows"] and "program from rank 0" in r1["rows"]
    assert r0["losses"] == r1["losses"] and r0["eval"] == r1["eval"]
    for r in (r0, r1):  # (rank 0's Program did not pickle: each rank compiled its own)
        rows, losses, ev = r["own"]
        assert "capture" in rows and (losses, ev) == (r0["losses"], r0["eval"])
        assert "program not sent" in rows or "program from rank 0" in rows
        rows, losses, ev = r["unloaded"]  # (rank 1 could not load it: compiled its own)
        assert "capture" in rows and (losses, ev) == (r0["losses"], r0["eval"])
    assert r0["error"] == r1["error"] and r0["error"][0] == "TraceError", r0["error"]
    assert ".item()" in r0["error"][1]


def _late_rank_0(delay):
    from fxpar.runtime import dist as rdist
    world = rdist.setup(2)
    if world.rank == 0:
        time.sleep(delay)
    try:
        return rdist.from_rank_0(lambda: "made")
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"


def test_ranks_wait_for_rank_0_to_begin_within_the_timeout(monkeypatch):
    """A rank 0 that never reaches the compile (failed or stuck before it) ends the other
    ranks' wait after FXPAR_TIMEOUT, naming rank 0, not after the compile's hour."""
    monkeypatch.setenv("FXPAR_TIMEOUT", "2")
    got = fxpar.launch(_late_rank_0, 2, 6)
    assert got[1].startswith("FxparError: rank 1 waited 2 s for rank 0 to begin compiling"), got
    assert fxpar.launch(_late_rank_0, 2, 0) == {0: "made", 1: "made"}


def test_remats_replayed_dropout_round_trips_with_its_op():
    """Remat's RNG replay wraps a dropout: run_and_save_rng_state's first argument is the
    op (aten.native_dropout), which pickle cannot take; it is saved by name and comes back
    as the same op, and the loaded Program trains as the compiled one."""
    from fxpar.core import program_io
    cfg = dataclasses.replace(CFG, dropout=0.1)
    plan = {"remat": "sqrt", "codegen": "eager"}
    prog = fxpar.compile(M.GPT(cfg), 1, example_batch=M.gpt_batch(cfg, 8), plan=plan)
    back = program_io.loads(program_io.dumps(prog, evaluate=False))
    wrapped = [n.args[0] for n in back.graph.graph.nodes
               if getattr(n.target, "__name__", "") == "run_and_save_rng_state"]
    assert wrapped and all(op is torch.ops.aten.native_dropout.default for op in wrapped)
    from fxpar.runtime import dist as rdist
    from fxpar.runtime.trainer import ParallelModel
    runs = []
    for p in (prog, back):
        torch.manual_seed(0)
        pm = ParallelModel(M.GPT(cfg), rdist.setup(1), p,
                           lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        torch.manual_seed(5)
        runs.append([pm.step(M.gpt_batch(cfg, 8, seed=s)).item() for s in range(2)])
    assert runs[0] == runs[1]


def test_fused_kernels_round_trip_by_their_place_in_the_library():
    """The fusion pass's kernels (bound to their nodes' layouts, under the Triton
    interpreter on CPU) are node targets with closures; they are saved as the library's
    kernel and layouts, and come back bound to the same."""
    from fxpar.compiler.pass_manager import PassContext
    from fxpar.core import program_io
    from fxpar.kernels.jit import interpreter
    from fxpar.kernels.library import KernelCall
    from fxpar.passes import fusion
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda x: torch.softmax(x, -1).sum(), tracing_mode="fake")(torch.randn(6, 10))
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[ir.REGION], n.meta[ir.MODULE] = ir.FORWARD, ""
    with interpreter():
        fusion.run(gm, fusion.Options(), PassContext(signature=None, device="cpu"))
    kernels = [n for n in gm.graph.nodes if isinstance(n.target, KernelCall)]
    assert kernels
    back = program_io.decode_graph(program_io.encode_graph(gm), program_io.FakeTensorMode())
    got = {n.name: n.target for n in back.graph.nodes}
    for n in kernels:
        k = got[n.name]
        assert isinstance(k, KernelCall) and (k.name, k.key, k.layouts) == (
            n.target.name, n.target.key, n.target.layouts)
    x = torch.randn(6, 10)
    with interpreter():
        assert torch.allclose(back(x), torch.softmax(x, -1).sum())

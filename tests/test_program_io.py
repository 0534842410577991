"""A Program saved and loaded (core/program_io.py): the same graphs node by node, metadata and
fake values included, and a loaded Program run by the runtime alone - in a process that never
imports the compiler - trains exactly as parallelize does."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

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

"""fxpar.compile is pure: no process group, no weights, no device memory; parallelize is
compile + the runtime, and the runtime binds the compiler's symbolic groups to its own."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar.core import ir
from fxpar.examples import models as M

transformers = pytest.importorskip("transformers")
c10d = torch.ops._c10d_functional


def _meta_llama():
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def _groups(gm) -> set[str]:
    return {a for n in gm.graph.nodes if n.op == "call_function"
            and str(n.target).startswith("_c10d_functional") for a in n.args
            if isinstance(a, str) and a.startswith("fxpar.")}


@pytest.mark.parametrize("plan", [
    {"dp": 2, "tp": 2},
    pytest.param({"pp": 2, "microbatches": 2, "dp": 2}, marks=pytest.mark.slow),
    pytest.param({"dp": 4, "zero": 3}, marks=pytest.mark.slow)], ids=["dp2tp2", "pp2m2", "zero3"])
@pytest.mark.slow  # (make test's 6 minutes)
def test_compile_a_meta_device_llama_without_a_process_group(plan):
    model = _meta_llama()
    ids = torch.randint(0, 256, (8, 16))
    prog = fxpar.compile(model, 4, example_batch={"input_ids": ids, "labels": ids}, plan=plan)
    assert not dist.is_initialized()
    assert all(p.is_meta for p in model.parameters())  # the model is left as it was
    assert isinstance(prog, ir.Program) and prog.plan.dp * prog.plan.tp * prog.plan.pp == 4
    every = [prog.graph] + ([p.graph for p in prog.pipeline.parts.values()]
                            if prog.pipeline is not None else [])
    used = set().union(*map(_groups, every))
    if plan.get("tp"):
        assert ir.GROUPS["tp"] in used
        assert any(lay is not None for lay in prog.tp_layouts)
        q = prog.signature.param_names.index("model.layers.0.self_attn.q_proj.weight")
        assert prog.tp_layouts[q][0] == 0  # column-parallel: output features split
    if plan.get("pp"):
        assert prog.pipeline.n_stages == 2 and prog.microbatches == 2
        assert {p.stage for p in prog.pipeline.parts.values()} == {0, 1}
    if plan.get("zero") == 3:
        assert prog.params_sharded and prog.zero == 3 and ir.GROUPS["dp"] in used
    assert used <= set(ir.GROUPS.values())
    assert [name for name, _, _ in prog.compile_times][0] == "capture"
    assert "capture" in prog.stage_graphs and "data_parallel" in prog.stage_graphs


@pytest.mark.slow  # (make test's 6 minutes)
def test_plan_auto_on_a_meta_model_plans_from_shapes():
    """plan="auto" on a meta model: the planner traces fake stand-ins (nothing whole, nothing
    timed) and every plan it ranks validates."""
    ids = torch.randint(0, 256, (8, 16))
    model = _meta_llama()
    prog = fxpar.compile(model, 4, example_batch={"input_ids": ids, "labels": ids})
    assert all(p.is_meta for p in model.parameters())
    assert prog.plan.dp * prog.plan.tp * prog.plan.pp == 4
    for c in prog.plan_report.table:
        c.plan.validate(4)


def test_compile_on_real_weights_leaves_them_untouched():
    torch.manual_seed(0)
    model = M.MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prog = fxpar.compile(model, 2, example_batch=(torch.randn(8, 16), torch.randn(8, 4)),
                         plan={"dp": 2})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert prog.batch_shard_dims == [0, 0]
    assert _groups(prog.graph) == {ir.GROUPS["dp"]}


def test_parallelize_is_compile_plus_runtime():
    """One device: the trainer runs the Program compile made; its evaluate() builds the
    forward-only program from compile's stand-ins, never from the model's own tensors."""
    torch.manual_seed(0)
    model = M.MLP()
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    ref = model(batch).detach()
    pm = fxpar.parallelize(model, 1, example_batch=batch)
    assert pm.program.plan == pm.plan and pm.stage_graphs is pm.program.stage_graphs
    torch.testing.assert_close(pm.evaluate(batch), ref)
    loss = pm.step(batch)
    torch.testing.assert_close(loss, ref)


@pytest.mark.slow
def test_the_eval_program_of_a_meta_model_is_sharded_like_training():
    """evaluate()'s forward-only program is built from compile's stand-ins (a meta model's
    too): no backward, the same tp layout as the training program."""
    ids = torch.randint(0, 256, (8, 16))
    prog = fxpar.compile(_meta_llama(), 4, example_batch={"input_ids": ids, "labels": ids},
                         plan={"dp": 2, "tp": 2})
    ev = prog.build_eval()
    assert ev.tp_layouts == prog.tp_layouts
    assert not any(n.meta.get(ir.REGION) == ir.BACKWARD for n in ev.graph.graph.nodes
                   if n.op == "call_function")


def test_compile_for_another_device_type_traces_fake_stand_ins():
    """CPU weights and a CPU batch compiled for a GPU: the graph is traced on fake tensors of
    the target device, the model untouched; without CUDA, a clear error (not an abort)."""
    torch.manual_seed(0)
    model = M.MLP()
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    if not torch.cuda.is_available():
        with pytest.raises(fxpar.PlanError, match="no CUDA GPU"):
            fxpar.compile(model, ["cuda:0", "cuda:1"], example_batch=batch, plan={"dp": 2})
        return
    prog = fxpar.compile(model, ["cuda:0", "cuda:1"], example_batch=batch, plan={"dp": 2})
    vals = [n.meta[ir.VAL] for n in prog.graph.graph.nodes if n.op == "placeholder"]
    assert {v.device.type for v in vals} == {"cuda"}
    assert all(p.device.type == "cpu" for p in model.parameters())

"""Hierarchical sharding (Plan.dp_shard: HSDP / MiCS): ZeRO within shard groups, replicas
across them. The pass's collectives on small graphs; exact training on 4 gloo ranks."""
import os

import pytest
import torch

from fxpar.api.parallelize import mesh_dims
from fxpar.compiler.capture import capture
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.graphs import count_ops
from fxpar.core.plan import Plan, resolve
from fxpar.examples import models as M
from test_parity import _check_plans
from workers import check_clipping

c10d = torch.ops._c10d_functional
GROUPS = {"dp": "dp", "dp_shard": "shard", "dp_rep": "rep"}


def _compile(dp, gpt=False, **plan):
    """The MLP's (or the example GPT's) dp graph under `plan`, with named groups."""
    if gpt:
        cfg = M.GPTConfig()
        model, batch = M.GPT(cfg), M.gpt_batch(cfg, 8)
    else:
        model, batch = M.MLP(), (torch.randn(8, 16), torch.randn(8, 4))
    gm, sig = capture(model, batch)
    ctx = PassContext(signature=sig, group_names=dict(GROUPS))
    return run_passes(gm, resolve({"dp": dp, **plan}, dp), ctx, "dp", {}), model


def _collectives(gm):
    """(target name, group, group size or None) of every collective, in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.target is c10d.all_reduce.default:
            out.append(("all_reduce", n.args[2], None))
        elif n.target is c10d.reduce_scatter_tensor.default:
            out.append(("reduce_scatter", n.args[3], n.args[2]))
        elif n.target is c10d.all_gather_into_tensor.default:
            out.append(("all_gather", n.args[2], n.args[1]))
    return out


@pytest.mark.parametrize("zero", [2, 3])
def test_shards_reduce_scatter_in_the_shard_group_then_all_reduce_across_replicas(zero):
    """dp=4 as 2 replicas x shard groups of 2: every reduce-scatter (and ZeRO-3 all-gather)
    is over the shard group in 2 parts, each followed by an all-reduce of its shard over the
    replicas; the loss is the one collective over the whole dp group; shards are 1/2."""
    gm, model = _compile(4, zero=zero, dp_shard=2)
    found = _collectives(gm)
    rs = [c for c in found if c[0] == "reduce_scatter"]
    assert rs and all(c[1:] == ("shard", 2) for c in rs)
    assert [c for c in found if c[0] == "all_reduce" and c[1] == "rep"] == \
        [("all_reduce", "rep", None)] * len(rs)
    assert [c for c in found if c[1] == "dp"] == [("all_reduce", "dp", None)]  # the loss
    # each replica all-reduce reads its reduce-scatter's result
    for n in gm.graph.nodes:
        if n.target is c10d.all_reduce.default and n.args[2] == "rep":
            assert n.args[0].args[0].target is c10d.reduce_scatter_tensor.default
    gathers = [c for c in found if c[0] == "all_gather"]
    assert all(c[1:] == ("shard", 2) for c in gathers) and bool(gathers) == (zero == 3)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    n_grads = out.meta[ir.N_GRADS]
    total = sum(p.numel() for p in model.parameters())
    held = sum(g.meta[ir.VAL].numel() for g in out.args[0][1:1 + n_grads])
    assert total / 2 <= held <= total / 2 + 2 * n_grads  # half, padding aside


def test_zero1_all_reduces_over_dp_and_keeps_the_shard_groups_slice():
    gm, _ = _compile(4, zero=1, dp_shard=2)
    found = _collectives(gm)
    assert {c[1] for c in found} == {"dp"}  # no reduce-scatter: the whole sum, then a slice
    chunks = [n for n in gm.graph.nodes if n.target is torch.ops.fxpar.local_chunk.default]
    assert chunks and all(n.args[2:] == (2, "shard") for n in chunks)


def test_dp_shard_equal_to_dp_is_plain_zero():
    a, _ = _compile(4, zero=3, dp_shard=4)
    b, _ = _compile(4, zero=3)
    assert _collectives(a) == _collectives(b)
    assert {c[1] for c in _collectives(a)} == {"dp"}


@pytest.mark.parametrize("plan,match", [
    ({"dp": 4, "dp_shard": 2}, "zero=0 shards nothing"),
    ({"dp": 4, "zero": 3, "dp_shard": 3}, "must divide dp=4"),
    ({"dp": 4, "zero": 3, "dp_shard": 1}, "at least 2 ranks"),
    ({"dp": 4, "zero": 3, "dp_shard": "rack"}, "positive integer, 'node'"),
])
def test_bad_dp_shard_is_a_clear_error(plan, match):
    with pytest.raises(PlanError, match=match):
        resolve(plan, 4)


def test_dp_shard_node_is_the_dp_ranks_of_one_node(monkeypatch):
    """dp_shard="node" takes torchrun's LOCAL_WORLD_SIZE: 2 nodes of 4 ranks at dp=8 shard
    over 4, at tp=2 (dp=4) over 2 (the node's other ranks are tp peers); one node, or no
    launcher, is plain ZeRO; a node size that does not divide dp is refused."""
    plan = {"zero": 3, "dp_shard": "node"}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve(plan, 8).dp_shard == 4
    assert resolve({**plan, "tp": 2}, 8).dp_shard == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve(plan, 8).dp_shard is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve(plan, 8).dp_shard is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(PlanError, match="does not divide"):
        resolve({**plan, "dp": 6, "tp": 1}, 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # (a node of one dp rank: nothing to shard)
    assert resolve({**plan, "tp": 2}, 8).dp_shard is None


def test_a_users_mesh_with_hsdp_dims_sets_the_shard_group():
    """A DeviceMesh passed as devices: its "dp_shard" dim sets the shard groups, "pp" ahead
    of its dp dims sets Plan.pp_outer (Megatron's order); a plan saying otherwise is
    refused by name."""
    from fxpar.api.parallelize import _plan_of_mesh

    class Mesh:  # (a DeviceMesh's names and sizes: building one needs a process group)
        def __init__(self, names=("dp_rep", "dp_shard"), sizes=(2, 4)):
            self.mesh_dim_names, self.sizes = names, sizes

        def size(self, dim=None):
            return self.sizes[dim] if dim is not None else 8
    assert _plan_of_mesh({"zero": 3}, Mesh())["dp_shard"] == 4
    assert _plan_of_mesh(Plan(zero=3), Mesh()).dp_shard == 4
    assert _plan_of_mesh({"zero": 3, "dp_shard": 4}, Mesh())["dp_shard"] == 4
    assert _plan_of_mesh("auto", Mesh()) == {"dp": "auto", "tp": "auto", "pp": "auto",
                                             "dp_shard": 4}  # (searched around it)
    with pytest.raises(PlanError, match="groups of 4 ranks"):
        _plan_of_mesh({"zero": 3, "dp_shard": 2}, Mesh())
    assert _plan_of_mesh({"zero": 3}, 8) == {"zero": 3}
    megatron = Mesh(("pp", "dp_rep", "dp_shard"), (2, 2, 2))
    assert _plan_of_mesh({"pp": 2, "zero": 3}, megatron) == {
        "pp": 2, "zero": 3, "dp_shard": 2, "pp_outer": True}
    assert _plan_of_mesh({"pp": 2}, Mesh(("pp", "dp"), (2, 4))) == {"pp": 2, "pp_outer": True}
    assert _plan_of_mesh({"pp": 2}, Mesh(("dp", "pp"), (4, 2))) == {"pp": 2}
    assert _plan_of_mesh({"zero": 1}, Mesh(("pp", "dp"), (2, 4))) == {
        "zero": 1, "pp": 2, "pp_outer": True}  # (the mesh's stages)
    assert _plan_of_mesh(Plan(pp=2), Mesh(("pp", "dp"), (2, 4))).pp_outer is True
    assert _plan_of_mesh({}, Mesh(("pp", "dp"), (1, 8))) == {}  # (one stage: no order)
    assert _plan_of_mesh("auto", Mesh(("pp", "dp"), (2, 4))) == {
        "dp": "auto", "tp": "auto", "pp": 2, "pp_outer": True}
    with pytest.raises(PlanError, match="puts 'pp' outside its dp dims"):
        _plan_of_mesh({"pp": 2, "pp_outer": False}, Mesh(("pp", "dp"), (2, 4)))


def test_hsdp_inside_tensor_parallelism_compiles_to_both_groups():
    """dp=4 x tp=2 with HSDP shard groups of 2: the tp pass's collectives on tp, ZeRO-3's
    gathers and reduce-scatters on the shard group, the shards' all-reduce on the replicas."""
    model = M.GPT(M.GPTConfig())
    gm, sig = capture(model, M.gpt_batch(M.GPTConfig(), 8))
    ctx = PassContext(signature=sig, group_names={**GROUPS, "tp": "tp"})
    gm = run_passes(gm, resolve({"dp": 4, "tp": 2, "zero": 3, "dp_shard": 2}, 8), ctx, "r", {})
    found = _collectives(gm)
    assert {c[1] for c in found} == {"dp", "tp", "shard", "rep"}
    assert all(c[2] == 2 for c in found if c[1] == "shard")
    assert count_ops(gm, c10d.reduce_scatter_tensor.default) == \
        sum(1 for c in found if c[0] == "all_reduce" and c[1] == "rep")


def test_mesh_puts_the_shard_group_on_neighbouring_ranks():
    assert mesh_dims(resolve({"dp": 4, "zero": 3, "dp_shard": 2}, 4)) == \
        [("dp_rep", 2), ("dp_shard", 2)]
    assert mesh_dims(resolve({"dp": 4, "tp": 2, "zero": 2, "dp_shard": 2}, 8)) == \
        [("dp_rep", 2), ("dp_shard", 2), ("tp", 2)]
    assert mesh_dims(resolve({"dp": 4, "zero": 3}, 4)) == [("dp", 4)]
    p = Plan(dp=8, zero=3, dp_shard=4)
    assert (p.hsdp, p.shard_ranks) == (True, 4)


@pytest.mark.slow
def test_hsdp_2x2_and_hpz_equal_single_process():
    """dp=4 as 2 replicas x shard groups of 2, ZeRO-1/2/3 (and ZeRO-3 with remat on HF
    Llama, ZeRO-2 on a BatchNorm CNN: its statistics over all 4 ranks), and ZeRO-3 with hpZ
    groups of 2 (GPT, HF Llama): losses, evaluate() and final
    parameters equal eager AdamW; under HSDP each rank holds half the optimizer state (a
    shard group's share), under hpZ a quarter."""
    cases = [("gpt", "adamw", {"dp": 4, "zero": z, "dp_shard": 2}) for z in (1, 2, 3)] + \
        [("hf_llama", "adamw", {"dp": 4, "zero": 3, "dp_shard": 2, "remat": "sqrt"}),
         ("convbn", "adamw", {"dp": 4, "zero": 2, "dp_shard": 2})] + \
        [(m, "adamw", {"dp": 4, "zero": 3, "hpz": 2}) for m in ("gpt", "hf_llama")]
    infos = _check_plans(4, cases)
    for (_, _, plan), info in zip(cases, infos):  # hpZ: state over all 4 ranks
        assert (0.5 if "dp_shard" in plan else 0.25) <= info["opt_state_fraction"] <= \
            (0.6 if "dp_shard" in plan else 0.3), (plan, info)


@pytest.mark.slow
def test_hsdp_clipping_counts_each_shard_once():
    """max_grad_norm under HSDP: the global norm counts the first replica's shards only (the
    others hold the same); under hpZ every rank's 1/dp shard: both equal clip_grad_norm_ in
    one process."""
    check_clipping(4, [("gpt", {"dp": 4, "zero": 3, "dp_shard": 2}),
                       ("gpt", {"dp": 4, "zero": 3, "hpz": 2})])


@pytest.mark.slow
def test_hsdp_checkpoint_resumes_and_reshards(tmp_path):
    """An HSDP run saves at step 5 (every replica holds the same shards: the file is one
    model's). New processes: the HSDP plan resumes bit for bit; plain ZeRO-2 over all 4
    ranks loads the same checkpoint and takes the saved run's next step."""
    import workers
    workers.check_resumed_and_resharded(4, "gpt", {"dp": 4, "zero": 3, "dp_shard": 2},
                                        {"dp": 4, "zero": 2}, str(tmp_path))


def test_planner_prices_hsdp_where_the_dp_group_spans_nodes():
    """GPT 7.5B in bf16 on 64 H100s (8 nodes), dp only with ZeRO-3, one microbatch: ZeRO over
    all 64 ranks all-gathers across InfiniBand; HSDP with a node per shard group keeps its
    collectives on NVLink, hpZ its backward's gathers. The planner prices all three, HSDP
    the least dp communication, hpZ between, with its secondary shards' memory. On one node
    there is no HSDP or hpZ candidate (nothing to gain: every link is the node's)."""
    from fxpar.compiler import planner
    from fxpar.core import cost
    from fxpar.examples import gpt_stats as G
    hw = cost.HARDWARE["h100"]
    stats = G.gpt_stats("gpt-7.5b")
    r = planner.search(stats, 64, hw, batch_rows=512, precision="bf16", executable=False,
                       constraints={"tp": 1, "pp": 1, "zero": 3, "microbatches": 1})
    by = {(c.plan.dp_shard, c.plan.hpz): c for c in r.table}
    assert set(by) == {(None, None), (8, None), (None, 8)}
    assert (r.best.plan.dp_shard, r.best.plan.hpz) != (None, None)  # (the two tie here)
    hsdp, hpz, flat = by[(8, None)], by[(None, 8)], by[(None, None)]
    comm = {k: c.parts["dp communication"] for k, c in (("hsdp", hsdp), ("hpz", hpz),
                                                          ("flat", flat))}
    # HSDP keeps every gather and the reduce-scatter in the node; hpZ the backward's gathers
    assert comm["hsdp"] < comm["hpz"] < comm["flat"] and comm["hsdp"] < 0.1 * comm["flat"]
    assert hpz.memory.buffers > flat.memory.buffers  # (its secondary shards)
    assert "hsdp=8" in hsdp.row() and "hpz=8" in hpz.row() and "hsdp" not in flat.row()
    one_node = planner.search(stats, 8, hw, batch_rows=512, precision="bf16",
                              executable=False, constraints={"tp": 1, "pp": 1, "zero": 3})
    assert {(c.plan.dp_shard, c.plan.hpz) for c in one_node.table} == {(None, None)}
    fixed = planner.search(stats, 64, hw, batch_rows=512, precision="bf16", executable=False,
                           constraints={"tp": 1, "pp": 1, "zero": 3, "dp_shard": 4, "hpz": 0})
    assert {(c.plan.dp_shard, c.plan.hpz) for c in fixed.table} == {(4, None)}
    flat = planner.search(stats, 64, hw, batch_rows=512, precision="bf16", executable=False,
                          constraints={"tp": 1, "pp": 1, "zero": 3, "dp_shard": 64, "hpz": 0})
    assert {(c.plan.dp_shard, c.plan.hpz) for c in flat.table} == {(None, None)}


# --- hpZ (Plan.hpz) ---------------------------------------------------------------------

def test_hpz_backward_gathers_secondary_shards_within_the_group():
    """ZeRO-3 over dp=4 with hpZ groups of 2: the forward all-gathers over the whole dp group
    (4 parts) and each gathered layer leaves a 1/2 secondary shard (local_chunk over the
    group); the backward's gathers read those over the group (2 parts); reduce-scatters stay
    over dp; the parameter inputs stay 1/4 shards."""
    gm, model = _compile(4, gpt=True, zero=3, hpz=2)  # (the MLP is all tail: no bwd gather)
    found = _collectives(gm)
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    fwd = [g for g in gathers if g.meta[ir.REGION] != ir.BACKWARD]
    bwd = [g for g in gathers if g.meta[ir.REGION] == ir.BACKWARD]
    assert fwd and all(g.args[1:] == (4, "dp") for g in fwd)
    assert bwd and all(g.args[1:] == (2, "shard") for g in bwd)
    assert all(c[1:] == ("dp", 4) for c in found if c[0] == "reduce_scatter")
    secs = [n for n in gm.graph.nodes if n.target is torch.ops.fxpar.local_chunk.default]
    assert secs and all(n.args[2:] == (2, "shard") and n.meta[ir.REGION] == ir.FORWARD
                        for n in secs)
    for g in bwd:  # every backward gather reads secondary shards (directly or packed)
        src = g.args[0]
        ins = src.args[0] if src.target is torch.ops.aten.cat.default else [src]
        assert all(x.target is torch.ops.fxpar.local_chunk.default for x in ins), g
    params = {n: p for n, p in model.named_parameters()}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "param"]
    assert all(ph.meta[ir.VAL].numel() == -(-params[ph.meta[ir.FQN]].numel() // 4)
               for ph in phs)


@pytest.mark.parametrize("plan,match", [
    ({"dp": 4, "zero": 2, "hpz": 2}, "needs zero=3"),
    ({"dp": 4, "zero": 3, "hpz": 4}, "fewer than dp"),
    ({"dp": 4, "zero": 3, "hpz": 2, "dp_shard": 2}, "cannot be combined"),
    ({"dp": 2, "pp": 2, "zero": 3, "hpz": 2, "microbatches": 2}, "must divide|pp=1"),
])
def test_bad_hpz_is_a_clear_error(plan, match):
    with pytest.raises(PlanError, match=match):
        resolve(plan, 4)


def test_planner_takes_dp_shard_node_from_the_launcher(monkeypatch):
    """{"dp_shard": "node"} given to the search: the node's dp ranks (LOCAL_WORLD_SIZE)."""
    from fxpar.compiler import planner
    from fxpar.core import cost
    from fxpar.examples import gpt_stats as G
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    r = planner.search(G.gpt_stats("gpt-1.7b"), 32, cost.HARDWARE["h100"], batch_rows=64,
                       precision="bf16", executable=False,
                       constraints={"tp": 1, "pp": 1, "zero": 3, "dp_shard": "node"})
    assert {c.plan.dp_shard for c in r.table} == {8}


@pytest.mark.slow
@pytest.mark.full  # (8 ranks on CI's 2 cores)
def test_hsdp_under_pipeline_parallelism_equals_single_process():
    """dp=4 (2 replicas x shard groups of 2) x pp=2, ZeRO-3, 2 microbatches on 8 ranks: each
    stage's reduce-scatters and gathers over its shard group in its R / F / B parts, equal
    to eager."""
    _check_plans(8, [("gpt", "adamw", {"dp": 4, "pp": 2, "zero": 3, "dp_shard": 2,
                                        "microbatches": 2})])


TWO_NODES_SCRIPT = """
import copy, os, torch, fxpar
from fxpar.examples import models as M
torch.manual_seed(0)
model = M.MLP()
ref = copy.deepcopy(model)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)
pm = fxpar.parallelize(model, 4, example_batch=batches[0], optimizer=opt,
                       plan={"dp": 4, "zero": 3, "dp_shard": "node", "codegen": "eager"})
losses = [pm.step(b).item() for b in batches]
state = pm.full_state_dict()
if int(os.environ["RANK"]) == 0:
    o = opt(ref.parameters())
    for b, got in zip(batches, losses):
        o.zero_grad()
        loss = ref(b)
        loss.backward()
        o.step()
        assert abs(loss.item() - got) <= 1e-5 * abs(got) + 1e-6, (loss.item(), got)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    print("mesh", dict(zip(pm.world.mesh.mesh_dim_names, pm.world.mesh.mesh.shape)),
          "dp_shard", pm.plan.dp_shard, flush=True)
"""


@pytest.mark.slow
def test_dp_shard_node_across_two_torchrun_nodes(tmp_path):
    """Two torchrun "nodes" of 2 ranks each on localhost (--nnodes 2): dp_shard="node" takes
    the node size from torchrun's LOCAL_WORLD_SIZE, so each node is one shard group (a 2 x 2
    mesh), and ZeRO-3 trains as eager AdamW."""
    import socket
    import subprocess
    import sys
    script = tmp_path / "train.py"
    script.write_text(TWO_NODES_SCRIPT)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FXPAR_DEVICE="cpu", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id", "hsdp-nodes",
         "--rdzv-endpoint", f"localhost:{port}", str(script)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert "mesh {'dp_rep': 2, 'dp_shard': 2} dp_shard 2" in outs[0], outs[0][-3000:]

"""Hierarchical sharding (Plan.dp_shard: HSDP / MiCS): ZeRO within shard groups, replicas
across them. The pass's collectives on small graphs; exact training on 4 gloo ranks."""
import pytest
import torch

import fxpar
from fxpar.api.parallelize import mesh_dims
from fxpar.compiler.capture import capture
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.graphs import count_ops
from fxpar.core.plan import Plan, resolve
from fxpar.examples import models as M
from test_parity import _check_plans
from workers import clip_eager_reference, clip_rank

c10d = torch.ops._c10d_functional
GROUPS = {"dp": "dp", "dp_shard": "shard", "dp_rep": "rep"}


def _compile(dp, **plan):
    model = M.MLP()
    gm, sig = capture(model, (torch.randn(8, 16), torch.randn(8, 4)))
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
    ({"dp": 4, "zero": 3, "dp_shard": "node"}, "positive integer"),
])
def test_bad_dp_shard_is_a_clear_error(plan, match):
    with pytest.raises(PlanError, match=match):
        resolve(plan, 4)


def test_mesh_puts_the_shard_group_on_neighbouring_ranks():
    assert mesh_dims(resolve({"dp": 4, "zero": 3, "dp_shard": 2}, 4)) == \
        [("dp_rep", 2), ("dp_shard", 2)]
    assert mesh_dims(resolve({"dp": 4, "tp": 2, "zero": 2, "dp_shard": 2}, 8)) == \
        [("dp_rep", 2), ("dp_shard", 2), ("tp", 2)]
    assert mesh_dims(resolve({"dp": 4, "zero": 3}, 4)) == [("dp", 4)]
    p = Plan(dp=8, zero=3, dp_shard=4)
    assert (p.hsdp, p.shard_ranks) == (True, 4)


@pytest.mark.slow
def test_hsdp_2x2_equals_single_process():
    """dp=4 as 2 replicas x shard groups of 2, ZeRO-1/2/3 (and ZeRO-3 with remat on HF
    Llama): losses, evaluate() and final parameters equal eager AdamW; each rank holds half
    the optimizer state (a shard group's share), not a quarter."""
    cases = [("gpt", "adamw", {"dp": 4, "zero": z, "dp_shard": 2}) for z in (1, 2, 3)] + \
        [("hf_llama", "adamw", {"dp": 4, "zero": 3, "dp_shard": 2, "remat": "sqrt"})]
    infos = _check_plans(4, cases)
    for info in infos:
        assert 0.5 <= info["opt_state_fraction"] <= 0.6, info


@pytest.mark.slow
def test_hsdp_clipping_counts_each_shard_once():
    """max_grad_norm under HSDP: the global norm counts the first replica's shards only (the
    others hold the same), so it equals clip_grad_norm_ in one process."""
    plan = {"dp": 4, "zero": 3, "dp_shard": 2}
    res = fxpar.launch(clip_rank, 4, [("gpt", plan)], 0.1, 3)
    losses, norms, state = res[0][("gpt", repr(plan))]
    ref_losses, ref_state, ref_norms = clip_eager_reference("gpt", "sgd", 0.1, steps=3)
    assert min(ref_norms) > 0.1
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_hsdp_checkpoint_resumes_and_reshards(tmp_path):
    """An HSDP run saves at step 5 (every replica holds the same shards: the file is one
    model's). New processes: the HSDP plan resumes bit for bit; plain ZeRO-2 over all 4
    ranks loads the same checkpoint and takes the saved run's next step."""
    import workers
    hsdp = {"dp": 4, "zero": 3, "dp_shard": 2}
    saved = fxpar.launch(workers.resume_save_rank, 4, [("hsdp", "gpt", hsdp)],
                         str(tmp_path))[0]
    loads = [("hsdp", ["hsdp"], "gpt", hsdp), ("zero2", ["hsdp"], "gpt", {"dp": 4, "zero": 2})]
    resumed = fxpar.launch(workers.resume_load_rank, 4, loads, str(tmp_path))[0]
    k = workers.SAVE_AT
    ref_losses, ref_next, ref_final = saved["hsdp"]
    losses, _, final, _, start = resumed[("hsdp", "hsdp")]
    assert start == k and torch.equal(losses, ref_losses[k:])
    assert all(torch.equal(final[n], ref_final[n]) for n in ref_final)
    losses, after_next, _, _, _ = resumed[("zero2", "hsdp")]
    torch.testing.assert_close(losses[0], ref_losses[k], rtol=1e-6, atol=0)
    for n, v in ref_next.items():
        torch.testing.assert_close(after_next[n], v, rtol=1e-6, atol=1e-7, msg=n)


def test_planner_prices_hsdp_where_the_dp_group_spans_nodes():
    """GPT 7.5B in bf16 on 64 H100s (8 nodes), dp only with ZeRO-3: ZeRO over all 64 ranks
    all-gathers across InfiniBand, HSDP with a node per shard group on NVLink; the planner
    prices both, HSDP the faster (less dp communication) with more memory per rank. On one
    node there is no HSDP candidate (nothing to gain: every link is the node's)."""
    from fxpar.compiler import planner
    from fxpar.core import cost
    from fxpar.examples import gpt_stats as G
    hw = cost.HARDWARE["h100"]
    stats = G.gpt_stats("gpt-7.5b")
    r = planner.search(stats, 64, hw, batch_rows=512, precision="bf16", executable=False,
                       constraints={"tp": 1, "pp": 1, "zero": 3, "microbatches": 1})
    by = {c.plan.dp_shard: c for c in r.table}
    assert set(by) == {None, 8}
    assert r.best.plan.dp_shard == 8
    hsdp, flat = by[8], by[None]
    assert hsdp.parts["dp communication"] < 0.1 * flat.parts["dp communication"]
    assert "hsdp=8" in hsdp.row() and "hsdp" not in flat.row()
    one_node = planner.search(stats, 8, hw, batch_rows=512, precision="bf16",
                              executable=False, constraints={"tp": 1, "pp": 1, "zero": 3})
    assert {c.plan.dp_shard for c in one_node.table} == {None}
    fixed = planner.search(stats, 64, hw, batch_rows=512, precision="bf16", executable=False,
                           constraints={"tp": 1, "pp": 1, "zero": 3, "dp_shard": 4})
    assert {c.plan.dp_shard for c in fixed.table} == {4}

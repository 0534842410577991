"""An MoE's token dispatch run on each dp rank's own rows (core/local_dispatch.py): which
nodes the analysis types and how, the dp=2 rewrite (no routed rows gathered, the expert
gradients reduced like any weight's), the dispatches it leaves gathered (a capacity computed
over the sorted rows, expert parallelism's windows), the planner's view, and training
against eager."""
import operator

import pytest
import torch

import fxpar
from fxpar.compiler import planner
from fxpar.compiler.capture import capture
from fxpar.core import ir, local_dispatch
from fxpar.core.local_dispatch import G, Tag
from fxpar.examples import zoo

from test_parity import _check_plans
from workers import CapacityMoE, capacity_loss as _capacity_loss

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _mixtral():
    model, spec = zoo.build("mixtral")
    return model, spec.batch(0)


def _grouped_mms(g):
    return [n for n in g.nodes if n.target is aten._grouped_mm.default]


def test_analysis_types_each_hf_mixtral_dispatch():
    """HF Mixtral, 2 MoE layers (plus remat-free backward): each layer's sort starts an
    order its rows follow through the grouped matmuls; histograms and their cumsum are
    partial counts; the weight gradients partial; the index back to token order and the
    backward's scatters into new_zeros leave in the batch's order, the factories resized
    to the local rows. Rows that do not divide over the ranks: nothing runs locally."""
    model, batch = _mixtral()
    gm, _ = capture(model, batch)
    found = local_dispatch.analyze(gm, 2)
    mms = _grouped_mms(gm.graph)
    assert len(mms) == 12 and all(m in found for m in mms)
    sorts = [n for n in gm.graph.nodes if n.target is aten.sort.default]
    assert len(sorts) == 2
    for s in sorts:
        values, indices = found[s].out
        assert values == Tag("rows", 0, s) and indices == Tag("rows", 0, s, G)
        assert found[s].inputs == {s.args[0]: 0}
    for m in mms:
        out = found[m].out
        if m.meta[ir.VAL].dim() == 3:  # a weight gradient: summed over the rows
            assert out.kind == "partial"
        else:
            assert out.kind == "rows" and out.order in sorts and out.ptr is None
    for n in gm.graph.nodes:
        if n.target in (aten.histc.default, aten.cumsum.default):
            assert found[n].out.kind == "counts"
    exits = [n for n, e in found.items() if n.target is aten.index_put.default
             and e.out == Tag("rows", 0, G)]
    assert len(exits) == 4  # backward: each layer's routing-weight and token gradients
    resized = [n for n, e in found.items() if e.resize]
    assert {n.target for n in resized} == {aten.new_zeros.default, aten.arange.start_step}
    assert local_dispatch.analyze(gm, 3) == {}  # (256 routed rows do not divide by 3)


def test_dp_runs_the_experts_on_each_ranks_rows():
    """dp=2: no all-gather in an MoE layer; each grouped matmul multiplies this rank's
    half of the routed rows; the expert weights' gradients are partial sums reduced over dp
    like every other gradient. With ep=2 the same rows go to their experts' ranks by
    all-to-all (tests/test_expert_parallel.py)."""
    model, batch = _mixtral()
    prog = fxpar.compile(model, 2, example_batch=batch, plan={"dp": 2, "fuse": False})
    g = prog.graph.graph
    gathers = [n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert not [n for n in gathers if "experts" in n.meta.get(ir.MODULE, "")]
    rows = 8 * 16 * 2  # batch x sequence x top-2
    for m in _grouped_mms(g):
        if m.meta[ir.VAL].dim() == 2:
            assert m.meta[ir.VAL].shape[0] == rows // 2
    sig = prog.signature
    out = next(n for n in g.nodes if n.op == "output")
    grads = out.args[0][1:1 + sig.num_params]
    experts = [i for i, name in enumerate(sig.param_names) if ".experts." in name]
    assert experts and all(reduced_over(grads[i]) for i in experts)
    ep = fxpar.compile(model, 2, example_batch=batch, plan={"dp": 2, "ep": 2, "fuse": False})
    assert [r["dispatch"] for r in ep.graph.meta[ir.EP_REPORT]] == ["all-to-all"] * 2
    assert not [n for n in ep.graph.graph.nodes if n.target is
                c10d.all_gather_into_tensor.default and "experts" in n.meta.get(ir.MODULE, "")]


def test_expert_biases_looked_up_by_expert_id_run_on_each_ranks_rows():
    """GPT-OSS: each routed row adds its expert's bias (`bias[expert_ids]`, the ids being
    keys, not row positions: the bias whole, the rows the ids'), its gate and up are every
    other feature (a slice's gradient along the features, sized to the local rows), and
    each bias's gradient is the rows' sum into zeros by expert id (partial, reduced over
    dp like a weight's). The dispatch then runs locally: no routed row gathered under dp,
    all-to-all under ep."""
    model, spec = zoo.build("gpt_oss")
    gm, sig = capture(model, spec.batch(0))
    found = local_dispatch.analyze(gm, 2)
    biases = {n for n in gm.graph.nodes if n.op == "placeholder"
              and n.meta.get(ir.FQN, "").endswith("_bias") and ".experts." in n.meta[ir.FQN]}
    lookups = [n for n in found if n.target is aten.index.Tensor and n.args[0] in biases]
    assert len(lookups) == 4 and all(found[n].inputs == {n.args[0]: "whole"}
                                     and found[n].out.kind == "rows" for n in lookups)
    sums = [n for n in found if n.target is aten.index_put.default
            and found[n].out.kind == "partial"]
    assert len(sums) == 4 and all(found[n].inputs == {n.args[0]: "whole"} for n in sums)
    sb = [n for n in found if n.target is aten.slice_backward.default]
    assert len(sb) == 4 and all(found[n].view_dim == 0 for n in sb)
    assert all(m in found for m in _grouped_mms(gm.graph))
    prog = fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})
    assert [r["dispatch"] for r in prog.graph.meta[ir.EP_REPORT]] == ["all-to-all"] * 2


def test_a_key_lookup_sums_only_into_zeros():
    """A parameter's gradient summed by key is partial only written into zeros: summed into
    another value (each rank would add that value once more) it is not run locally."""
    g = torch.fx.Graph()
    table = g.placeholder("table")
    table.meta[ir.VAL], table.meta[ir.ROLE] = torch.empty(4, 3), "param"
    keys = g.placeholder("keys")
    keys.meta[ir.VAL] = torch.empty(8, dtype=torch.int64)
    rows = g.placeholder("rows")
    rows.meta[ir.VAL] = torch.empty(8, 3)
    tags = {keys: Tag("rows", 0, "sort"), rows: Tag("rows", 0, "sort")}
    zeros = g.call_function(aten.zeros.default, ([4, 3],))
    ones = g.call_function(aten.ones.default, ([4, 3],))
    for dst, ok in ((zeros, True), (ones, False), (table, False)):
        put = g.call_function(aten.index_put.default, (dst, [keys], rows, True))
        put.meta[ir.VAL] = torch.empty(4, 3)
        if ok:
            assert local_dispatch._type(put, tags).out == Tag("partial")
        else:
            with pytest.raises(local_dispatch._Untyped):
                local_dispatch._type(put, tags)
    lookup = g.call_function(aten.index.Tensor, (table, [keys]))
    lookup.meta[ir.VAL] = torch.empty(8, 3)
    assert local_dispatch._type(lookup, tags).out == Tag("rows", 0, "sort")
    rows_lookup = g.call_function(aten.index.Tensor, (rows, [keys]))  # (not a parameter)
    rows_lookup.meta[ir.VAL] = torch.empty(8, 3)
    with pytest.raises(local_dispatch._Untyped):
        local_dispatch._type(rows_lookup, tags)


def reduced_over(v, group=ir.GROUPS["dp"]):
    """Whether gradient output `v` comes from an all-reduce over `group` (through waits,
    bucket views and splits)."""
    seen, todo = set(), [v]
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.target is c10d.all_reduce.default and n.args[2] == group:
            return True
        if n.target in (c10d.wait_tensor.default, operator.getitem, *ir.RESHAPES,
                        aten.split_with_sizes.default):
            todo.append(n.args[0])
    return False


def test_torchtitans_counts_made_outside_the_dispatch_are_checked_partial():
    """torchtitan's MoE counts tokens per expert as a one-hot summed over the batch, outside
    the dispatch, and scatters back with its own op: the analysis takes those counts only
    where DTensor's rules make them partial sums (a dry run), so without that check nothing
    runs locally, and with it every grouped matmul does."""
    pytest.importorskip("torchtitan")
    from fxpar.core.sharding import batch_local_dispatch
    from fxpar.examples import external_zoo
    model, spec = external_zoo.build("titan_qwen3_moe")
    gm, _ = capture(model, spec.batch(0), lambda m, b: external_zoo.loss_of(m, spec, b))
    assert local_dispatch.analyze(gm, 2) == {}
    found = batch_local_dispatch(gm, 2)
    mms = _grouped_mms(gm.graph)
    assert mms and all(m in found for m in mms)
    scatters = [n for n in found if "deterministic_scatter_add" in str(n.target)]
    assert scatters and all(found[n].out == Tag("rows", 0, G) for n in scatters)


def test_a_capacity_over_the_sorted_rows_keeps_the_rows_gathered():
    """CapacityMoE: the queue places index the counts by the sorted ids, which the analysis
    cannot type; the dispatch is left to DTensor's rules (the routed rows gathered, exact)."""
    torch.manual_seed(0)
    model = CapacityMoE()
    batch = {"ids": torch.randint(0, 32, (8, 16)), "labels": torch.randint(0, 32, (8, 16))}
    gm, _ = capture(model, batch, _capacity_loss)
    assert local_dispatch.analyze(gm, 2) == {}
    prog = fxpar.compile(model, 2, example_batch=batch, loss_fn=_capacity_loss,
                         plan={"dp": 2, "fuse": False})
    assert any(n.target is c10d.all_gather_into_tensor.default
               for n in prog.graph.graph.nodes)


def test_planner_prices_local_experts_as_dp_work():
    """The planner's statistics say the dispatch is local (moe_local), so the dp probe's
    whole work holds no expert matmuls and a dp plan's gradient reduction counts the expert
    gradients."""
    model, batch = _mixtral()
    stats = planner.graph_stats(capture(model, batch), 8, pass_extras=True)
    assert stats.moe_local
    expert_f = sum(s.expert_flops_f for s in stats.segments)
    whole_f = sum(s.flops_f_whole for s in stats.segments)
    assert expert_f > 0 and whole_f < 0.5 * expert_f
    # experts in an nn.ModuleList routed by torch.where: local too (their padded positions),
    # where_moe's (biases looked up per row) run under ep by all-to-all, not in slots
    model, spec = zoo.build("where_moe")
    stats = planner.graph_stats(capture(model, spec.batch(0)), 8, pass_extras=True)
    assert stats.moe_local and not stats.ep_slots
    assert sum(s.flops_f_whole for s in stats.segments) < 0.5 * sum(
        s.expert_flops_f for s in stats.segments)


@pytest.mark.slow  # (make test's 6 minutes; ep=2's parity, fast, runs the same dispatch)
def test_moe_dp_trains_like_eager():
    """Mixtral under dp=2 (the dispatch on each rank's rows): losses, evaluate() and every
    final weight equal eager AdamW."""
    _check_plans(2, [("mixtral", "adamw", {"dp": 2})])


@pytest.mark.slow  # (make test's 6 minutes)
def test_moe_dp_with_zero_remat_and_microbatches_trains_like_eager():
    """Mixtral under dp=2 with ZeRO-3 and remat (a recomputed dispatch of its own), and
    with two microbatches: equal to eager AdamW."""
    _check_plans(2, [("mixtral", "adamw", {"dp": 2, "zero": 3, "remat": "sqrt"}),
                     ("mixtral", "adamw", {"dp": 2, "microbatches": 2})])


@pytest.mark.slow
def test_moe_models_dp4_train_like_eager():
    """4 ranks: Qwen2-MoE (a gated shared expert), DeepSeek-V3 (group-limited routing, a
    dense first layer) at dp=4, Mixtral with its router's load-balancing loss at dp=4
    (the counts the aux loss reads are reduced, the grouped matmuls read each rank's own)
    and at dp=2 x tp=2."""
    _check_plans(4, [("qwen2_moe", "adamw", {"dp": 4}), ("deepseek_v3", "adamw", {"dp": 4}),
                     ("mixtral_aux", "adamw", {"dp": 4}),
                     ("mixtral", "adamw", {"dp": 2, "tp": 2})])


def _listed_graph(name):
    """litgpt's Mixtral / where_moe captured with their experts grouped, before any split."""
    import workers
    from fxpar.passes import grouped_experts
    model, batch_fn, loss_fn = workers.build(name)
    gm, _ = capture(model, batch_fn(0), loss_fn)
    return grouped_experts.run(gm, grouped_experts.Options(), None)


def test_padded_positions_point_into_each_ranks_own_rows():
    """litgpt's `y[idx] += w[idx, k] * expert(x[idx])` (compiler/padded_nonzero: positions
    at mask.numel() rows, -1 reading one zero row after the rows) at 2 ranks: the arange
    along the mask's token dim is a pointer into the batch's rows, made local (64 of 128);
    the k column beside it a plain key; every read and write through the positions is of
    a copy padded by one row after the rank's rows, each write cut back to them. A -1
    reading rows with no pad row after them, or an arange counting other rows than those it
    indexes, keeps that layer's routing whole."""
    gm = _listed_graph("litgpt_mixtral")
    g = gm.graph
    found = local_dispatch.analyze(gm, 2)
    grids = [n for n in g.nodes if n.target is aten.arange.default and n.args[0] == 128]
    assert len(grids) == 8 and all(found[n].resize and found[n].out == Tag(
        "rows", 0, G, G, span=128) for n in grids)  # (2 layers x 4 experts)
    where = [n for n in g.nodes if n.target is aten.where.ScalarOther and n.args[2] == -1]
    assert where and all(found[n].out.cols == (G, None) and found[n].out.neg for n in where)
    reads = [n for n in g.nodes if n.target is aten.index.Tensor]
    pads = [n.args[0] for n in reads + [n for n in g.nodes if n.target is aten.index_put.default]
            if n.args[0].target is aten.constant_pad_nd.default]
    assert pads and all(found[p].out.pad == 1 for p in pads)
    assert all(found[n].out.order == G and not found[n].out.pad for n in reads)
    cuts = [n for n in g.nodes if n.target is aten.slice.Tensor and n.args[0] in found
            and found[n.args[0]].out.pad]
    assert cuts and all(found[n].slice_end and not found[n].out.pad for n in cuts)

    first = next(n for n in reads if n.args[0] in pads)  # a -1 read of the unpadded rows
    pad = first.args[0]
    first.update_arg(0, pad.args[0])
    broken = local_dispatch.analyze(gm, 2)
    assert first not in broken and len(broken) < len(found)
    first.update_arg(0, pad)
    assert local_dispatch.analyze(gm, 2).keys() == found.keys()
    grids[0].args = (64,)  # (positions of 64 rows pointing into 128)
    grids[0].meta[ir.VAL] = grids[0].meta[ir.VAL][:64]
    assert grids[0] not in local_dispatch.analyze(gm, 2)


def test_grouped_listed_experts_run_on_each_ranks_own_positions():
    """litgpt's Mixtral (experts an nn.ModuleList, grouped by passes/grouped_experts) at
    dp=2: the grouped dispatch's stable sort of the positions by expert, the sort of that
    permutation (its inverse, putting the rows back) and the per-expert counts (a histogram
    of the positions' experts) all type, so each rank's grouped matmuls run on its own 128
    of the 256 positions and no count is all-reduced."""
    import warnings
    import workers
    model, batch_fn, loss_fn = workers.build("litgpt_mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = fxpar.compile(model, 2, example_batch=batch_fn(0), loss_fn=loss_fn,
                             plan={"dp": 2})
    g = prog.graph.graph
    rows = {n.meta[ir.VAL].shape[0] for n in g.nodes
            if n.target is torch.ops.aten._grouped_mm.default and n.meta[ir.VAL].dim() == 2}
    assert rows == {128}
    assert any(n.target is torch.ops.aten.histc.default for n in g.nodes)
    assert not [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
                and n.meta.get(ir.MODULE, "").endswith("mlp.experts")]
    # the routing around the grouped dispatch too (padded positions, where's scalar forms):
    # no row of another rank is gathered, and each pad row follows the rank's 64 rows
    assert not [n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert {n.meta[ir.VAL].shape[0] for n in g.nodes
            if n.target is aten.constant_pad_nd.default} == {65}
    # where_moe's experts (biases: each looked up by expert id from their stack, their
    # gradients summed into zeros by expert id: partial, reduced over dp as a weight's)
    prog = fxpar.compile(*zoo.build("where_moe")[:1], 2,
                         example_batch=zoo.build("where_moe")[1].batch(0), plan={"dp": 2})
    assert not [n for n in prog.graph.graph.nodes
                if n.target is c10d.all_gather_into_tensor.default]


def test_experts_looped_over_a_k_by_tokens_mask_run_on_each_ranks_own_rows():
    """Hugging Face's eager experts (and DBRX's, and stacked_loop_moe's) route by
    `one_hot(picks, E).permute(2, 1, 0)[e]`, a (k, tokens) mask: its positions are listed
    token by token (compiler/padded_nonzero), so at dp=2 each rank's grouped matmuls run on
    its own 128 of the 256 (token, pick) rows and nothing of the dispatch is gathered: the
    only collectives are the gradients' and the loss's all-reduces."""
    import warnings
    import workers
    for name in ("stacked_loop_moe", "mixtral_eager_experts"):
        model, batch_fn, loss_fn = workers.build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = fxpar.compile(model, 2, example_batch=batch_fn(0), loss_fn=loss_fn,
                                 plan={"dp": 2})
        g = prog.graph.graph
        rows = {n.meta[ir.VAL].shape[0] for n in _grouped_mms(g) if n.meta[ir.VAL].dim() == 2}
        assert rows == {128}, name
        comms = {n.target for n in g.nodes if n.target in (
            c10d.all_gather_into_tensor.default, c10d.all_reduce.default,
            c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default)}
        assert comms == {c10d.all_reduce.default}, (name, comms)

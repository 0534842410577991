"""Expert parallelism (Plan.ep, passes/expert_parallel.py): the MoE layers it finds on the
joint graph, the rewrite (which weights split, where rows move and are summed, which
collectives appear), the plans it refuses, and training on gloo ranks against eager."""
import dataclasses

import pytest
import torch

import fxpar
from fxpar.api.parallelize import mesh_dims
from fxpar.compiler.capture import capture
from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.core.plan import resolve
from fxpar.examples import zoo
from fxpar.passes import expert_parallel
from fxpar.viz.report import _decision_line

import workers
from test_local_dispatch import reduced_over
from test_parity import _check_plans
from workers import check_clipping

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _mixtral():
    model, spec = zoo.build("mixtral")
    return model, spec.batch(0)


def test_finds_each_moe_layer_its_weights_and_region():
    """HF Mixtral (grouped_mm experts), 2 layers: per layer one offs node shared by 2 forward
    and 4 backward grouped matmuls; the region between them (the gated activation and its
    backward); the rows entering it (the gathered hidden states, the down projection's
    incoming gradient) and leaving it (the layer's output rows, their input gradient)."""
    model, batch = _mixtral()
    gm, sig = capture(model, batch)
    layers = expert_parallel.find_layers(gm)
    assert [layer.module for layer in layers] == [f"model.layers.{i}.mlp.experts"
                                                  for i in range(2)]
    for i, layer in enumerate(layers):
        assert [w.meta[ir.FQN] for w in layer.weights] == [
            f"model.layers.{i}.mlp.experts.gate_up_proj",
            f"model.layers.{i}.mlp.experts.down_proj"]
        assert layer.offs.target is aten.cumsum.default and layer.rows == 8 * 16 * 2
        kinds = sorted(m.meta[ir.REGION] for m in layer.matmuls)
        assert kinds == ["backward"] * 4 + ["forward"] * 2
        ops = {n.target for n in layer.region}
        assert {aten.silu.default, aten.silu_backward.default, aten.mul.Tensor} <= ops
        assert not ops & {aten.index.Tensor, aten.sort.default, aten.sum.dim_IntList}
        assert len(layer.entering) == 2 and len(layer.leaving) == 2
        gathered = [x for x in layer.entering if x.target is aten.index.Tensor]
        assert len(gathered) == 1 and gathered[0].meta[ir.REGION] == "forward"
        assert sorted(y.meta[ir.REGION] for y in layer.leaving) == ["backward", "forward"]


def test_rewrite_splits_the_experts_and_sends_rows_by_all_to_all():
    """dp=2 x ep=2: each rank's program holds 2 of the 4 experts ([2, ...] weight inputs and
    gradients). The dispatch runs on each rank's own rows (core/local_dispatch), so each
    layer's counts go to fxpar::ep_route once, every grouped matmul takes the received
    counts, each row tensor entering a layer is sent to its experts' ranks
    (fxpar::ep_dispatch: forward hidden states, backward incoming gradient) and each one
    leaving comes back (fxpar::ep_combine); the nodes between them hold as many rows as
    arrive (their graph values the most there can be, ep x the rank's own: marked
    ir.DYNAMIC_ROWS, run op by op, never in a compiled run); nothing is gathered or
    all-reduced over ep. The expert gradients hold every rank's rows of one ep group,
    complete at dp = ep; the other weights' summed over dp."""
    model, batch = _mixtral()
    prog = fxpar.compile(model, 2, example_batch=batch, plan={"dp": 2, "ep": 2, "fuse": False})
    sig, g = prog.signature, prog.graph.graph
    names = [sig.param_names[i] for i in prog.expert_params]
    assert prog.ep == 2 and names == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                      for w in ("gate_up_proj", "down_proj")]
    params = [n for n in g.nodes if n.op == "placeholder"][:sig.num_params]
    full = dict(model.named_parameters())
    for i, p in enumerate(params):
        want = full[sig.param_names[i]].shape
        if i in prog.expert_params:
            want = (want[0] // 2, *want[1:])
        assert tuple(p.meta[ir.VAL].shape) == tuple(want), sig.param_names[i]
    fx = torch.ops.fxpar
    for m in g.nodes:
        if m.target is aten._grouped_mm.default:
            offs = m.args[2]
            assert offs.target is aten._to_copy.default
            assert offs.args[0].args[0].args[0].args[0].target is fx.ep_route.default
            if m.meta[ir.VAL].dim() == 2:  # (ep x this rank's 128 routed rows)
                assert m.meta[ir.VAL].shape[0] == 2 * 8 * 16 * 2 // 2
    count = {op: [n.meta[ir.MODULE] for n in g.nodes if n.target is op]
             for op in (fx.ep_route.default, fx.ep_dispatch.default, fx.ep_combine.default)}
    for n in g.nodes:  # (each all-to-all waited on as a functional collective is)
        if n.target in (fx.ep_dispatch.default, fx.ep_combine.default):
            assert [u.target for u in n.users] == [c10d.wait_tensor.default], n.name
    layers = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert sorted(count[fx.ep_route.default]) == layers
    assert sorted(count[fx.ep_dispatch.default]) == sorted(count[fx.ep_combine.default]) == \
        sorted(layers * 2)
    assert not [n for n in g.nodes if (n.target is c10d.all_reduce.default
                                       and n.args[-1] == ir.GROUPS["ep"])
                or (n.target is c10d.all_gather_into_tensor.default
                    and "experts" in n.meta.get(ir.MODULE, ""))]
    assert [r["dispatch"] for r in prog.graph.meta[ir.EP_REPORT]] == ["all-to-all"] * 2
    dynamic = {n for n in g.nodes if n.meta.get(ir.DYNAMIC_ROWS)}
    after, todo = set(), [n for n in g.nodes if n.target is fx.ep_dispatch.default]
    while todo:  # (every node a dispatch reaches before a combine)
        n = todo.pop()
        if n not in after and n.target is not fx.ep_combine.default:
            after.add(n)
            todo += list(n.users)
    combines = [n for n in g.nodes if n.target is fx.ep_combine.default]
    between = after & ir.ancestors([c.args[0] for c in combines])  # (dispatch .. combine)
    assert between and between <= dynamic, between - dynamic
    for n in g.nodes:  # views sized by the rows infer them
        if n in dynamic and n.target in (aten.view.default, aten._unsafe_view.default):
            assert -1 in n.args[1], n.name
    from fxpar.compiler import codegen
    assert not dynamic & {n for run in codegen.runs(g, cpu=True) for n in run}
    out = next(n for n in g.nodes if n.op == "output")
    grads = out.args[0][1:1 + sig.num_params]
    assert not any(reduced_over(grads[i]) for i in prog.expert_params)
    others = [i for i in range(sig.num_params) if i not in prog.expert_params]
    assert all(reduced_over(grads[i]) for i in others if grads[i] is not None)
    assert mesh_dims(prog.plan) == [("edp", 1), ("ep", 2)]


@pytest.mark.slow  # (make test's 6 minutes)
def test_rewrite_at_dp4_and_for_a_dispatch_that_reads_every_row():
    """dp=4 x ep=2: the expert gradients summed over "edp", the other weights' over dp. A
    dispatch that reads every row (a capacity) keeps the gathered window instead of the
    all-to-alls: fxpar::expert_window, its rows all-reduced over ep each way. Under remat
    the recomputed forward is a layer of its own on the same split weights."""
    model, batch = _mixtral()
    four = fxpar.compile(model, 4, example_batch=batch, plan={"dp": 4, "ep": 2, "fuse": False})
    sig, fx = four.signature, torch.ops.fxpar
    others = [i for i in range(sig.num_params) if i not in four.expert_params]
    out4 = next(n for n in four.graph.graph.nodes if n.op == "output")
    grads4 = out4.args[0][1:1 + sig.num_params]
    assert all(reduced_over(grads4[i], ir.GROUPS["edp"]) for i in four.expert_params)
    assert all(reduced_over(grads4[i]) for i in others if grads4[i] is not None)
    capacity, batch_fn, loss_fn = workers.build("capacity_moe")
    window = fxpar.compile(capacity, 2, example_batch=batch_fn(0), loss_fn=loss_fn,
                           plan={"dp": 2, "ep": 2, "fuse": False})
    assert [r["dispatch"] for r in window.graph.meta[ir.EP_REPORT]] == ["gathered rows"]
    wg = window.graph.graph
    assert any(n.target is fx.expert_window.default for n in wg.nodes)
    assert len([n for n in wg.nodes if n.target is c10d.all_reduce.default
                and n.args[2] == ir.GROUPS["ep"]]) == 2  # (its rows, each way)
    # remat recomputes each layer's forward in the backward, with offs of its own: a layer
    # more each, reading the same (split) weights
    remat = fxpar.compile(model, 2, example_batch=batch,
                          plan={"dp": 2, "ep": 2, "remat": "sqrt", "fuse": False})
    found = [r["module"] for r in remat.graph.meta[ir.EP_REPORT]]
    assert len(found) > 2 and set(found) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert remat.expert_params == four.expert_params
    assert mesh_dims(resolve({"dp": 4, "ep": 2}, 4)) == [("edp", 2), ("ep", 2)]


def _collectives_of(v, targets) -> set:
    """(target, group) of the collectives of gradient output `v`'s own reduction (the nodes
    the dp pass emitted for its bucket, ir.BUCKET)."""
    seen, todo, found = set(), [v], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target in targets:
            found.add((n.target, n.args[-1]))
        if n is v or n.meta.get(ir.BUCKET):
            todo.extend(n.all_input_nodes)
    return found


@pytest.mark.slow  # (several compiles: make test's 6 minutes)
def test_zero_shards_expert_weights_over_their_edp_group():
    """ep with ZeRO: an expert weight is shared by the dp / ep ranks holding the same experts
    ("edp") only, so its gradient is reduced there and ZeRO shards it there; the other weights
    over dp. ZeRO-3 at dp=4 x ep=2: expert parameters are 1/2 shards of the rank's experts
    (1/4 of every expert's), gathered and reduce-scattered over "edp"; ZeRO-2: buckets never
    mix the two; at dp = ep ("edp" of one rank) no collective touches an expert weight."""
    model, batch = _mixtral()
    full = dict(model.named_parameters())
    rs, ag = c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default
    dp_g, edp_g = ir.GROUPS["dp"], ir.GROUPS["edp"]
    for world, zero in ((4, 3), (4, 2), (2, 3)):
        prog = fxpar.compile(model, world, example_batch=batch,
                             plan={"dp": world, "ep": 2, "zero": zero, "fuse": False})
        sig, g = prog.signature, prog.graph.graph
        experts = set(prog.expert_params)
        assert len(experts) == 4
        params = [n for n in g.nodes if n.op == "placeholder"][:sig.num_params]
        out = next(n for n in g.nodes if n.op == "output")
        shards = out.args[0][1:1 + len(prog.zero_buckets)]
        edp = world // 2
        for k, idx in enumerate(prog.zero_buckets):
            assert len({i in experts for i in idx}) == 1, idx  # (never mixed)
            want = ({(rs, edp_g)} if edp > 1 else set()) if idx[0] in experts else {(rs, dp_g)}
            assert _collectives_of(shards[k], {rs, c10d.all_reduce.default}) == want, idx
        if zero < 3:
            continue
        for i, p in enumerate(params):
            n = full[sig.param_names[i]].numel()
            local, over = (n // 2, edp) if i in experts else (n, world)
            assert tuple(p.meta[ir.VAL].shape) == (-(-local // over),), sig.param_names[i]
        gathers = {n: {q for q in ir.ancestors([n]) if q in params}
                   for n in g.nodes if n.target is ag}
        for i in experts:
            groups = {n.args[-1] for n, read in gathers.items() if params[i] in read}
            assert groups == ({edp_g} if edp > 1 else set()), sig.param_names[i]
        assert all(n.args[-1] == dp_g for n, read in gathers.items()
                   if read and not read & {params[i] for i in experts})


@pytest.mark.slow  # (make test's 6 minutes)
def test_hsdp_shards_expert_weights_within_the_shard_group():
    """ep with HSDP (dp=8 in shard groups of 4, ep=2 inside each): the mesh is (replicas,
    the shard group's ranks holding the same experts, ep); ZeRO-3 gathers and
    reduce-scatters an expert weight over those 2 ranks ("edp_shard"), the others over the
    shard group of 4, and every shard is then summed across the 2 replicas; ZeRO-1
    all-reduces an expert bucket over "edp" and keeps its "edp_shard" slice."""
    model, batch = _mixtral()
    plan = {"dp": 8, "ep": 2, "zero": 3, "dp_shard": 4, "fuse": False}
    assert mesh_dims(resolve(plan, 8)) == [("dp_rep", 2), ("edp_shard", 2), ("ep", 2)]
    prog = fxpar.compile(model, 8, example_batch=batch, plan=plan)
    g, sig = prog.graph.graph, prog.signature
    params = [n for n in g.nodes if n.op == "placeholder"][:sig.num_params]
    experts = {params[i] for i in prog.expert_params}
    full = dict(model.named_parameters())
    for i, p in enumerate(params):
        n = full[sig.param_names[i]].numel()
        assert tuple(p.meta[ir.VAL].shape) == ((-(-n // 4),) if p not in experts else
                                               (-(-n // 2 // 2),)), sig.param_names[i]
    ag, rs = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default
    for n in g.nodes:
        if n.target is ag and set(ir.ancestors([n])) & set(params):
            want = "edp_shard" if set(ir.ancestors([n])) & experts else "dp_shard"
            assert n.args[-1] == ir.GROUPS[want], n.name
        if n.target is rs:  # each summed shard then all-reduced across the replicas
            assert n.args[-1] in (ir.GROUPS["dp_shard"], ir.GROUPS["edp_shard"]), n.name
            wait = next(iter(n.users))
            assert {(u.target, u.args[-1]) for u in wait.users} == {
                (c10d.all_reduce.default, ir.GROUPS["dp_rep"])}, n.name
    assert {n.args[-1] for n in g.nodes if n.target is rs} == {
        ir.GROUPS["dp_shard"], ir.GROUPS["edp_shard"]}
    # ZeRO-1: an expert bucket all-reduced over every rank holding those experts ("edp"),
    # then cut to this rank's slice of its shard group's
    one = fxpar.compile(model, 8, example_batch=batch, plan={**plan, "zero": 1})
    out = next(n for n in one.graph.graph.nodes if n.op == "output")
    for k, idx in enumerate(one.zero_buckets):
        shard = out.args[0][1 + k]
        assert shard.target is torch.ops.fxpar.local_chunk.default, idx
        reduce = shard.args[0].args[0]  # (chunk <- wait <- all-reduce)
        expert = idx[0] in one.expert_params
        assert (reduce.args[-1], shard.args[-1]) == (
            (ir.GROUPS["edp"], ir.GROUPS["edp_shard"]) if expert else
            (ir.GROUPS["dp"], ir.GROUPS["dp_shard"])), idx


def test_a_stage_boundary_inside_an_moe_layer_is_refused():
    """The rows between ep's all-to-alls are as many as the routing sends; a pipeline
    transfer is sized by the graph's values, so a stage cut inside a layer's expert rows
    is refused by name (pipeline_split cuts between blocks: a cut moved there by hand)."""
    from fxpar.compiler.pass_manager import PassContext
    model, batch = _mixtral()
    gm, sig = capture(model, batch)
    layer = expert_parallel.find_layers(gm)[0]
    for n in gm.graph.nodes:
        n.meta[ir.STAGE] = 0
    next(iter(layer.region)).meta[ir.STAGE] = 1
    ctx = PassContext(signature=sig, group_names=dict(ir.GROUPS))
    with pytest.raises(PlanError, match="stage boundary falls inside the MoE layer "
                                        "'model.layers.0.mlp.experts'"):
        expert_parallel.run(gm, expert_parallel.Options(ep=2, dp=2), ctx)


def test_plans_and_models_expert_parallelism_refuses_by_name():
    """ep must divide dp and the experts (and HSDP's shard groups); not with hpZ or ps
    yet."""
    with pytest.raises(PlanError, match="must divide dp=3"):
        resolve({"dp": 3, "ep": 2}, 3)
    with pytest.raises(PlanError, match="ep must divide dp_shard"):
        resolve({"dp": 8, "ep": 4, "zero": 3, "dp_shard": 2}, 8)
    with pytest.raises(PlanError, match="hpz=2"):
        resolve({"dp": 4, "ep": 2, "zero": 3, "hpz": 2}, 4)
    with pytest.raises(PlanError, match="ps=1"):
        resolve({"dp": 2, "ps": 1, "ep": 2}, 3)
    with pytest.raises(PlanError, match="positive integer"):
        resolve({"dp": 2, "ep": 0}, 2)
    model, batch = _mixtral()
    with pytest.raises(PlanError, match="4 experts, which do not split evenly over 3"):
        fxpar.compile(model, 3, example_batch=batch, plan={"dp": 3, "ep": 3})


@pytest.mark.slow  # (make test's 6 minutes)
def test_models_whose_experts_expert_parallelism_cannot_split_are_refused_by_name():
    """An expert weight read by anything but its layer's grouped matmuls (a regulariser)
    cannot be split; a dense model (its layers a list, but not side by side) has no MoE
    layer."""
    model, batch = _mixtral()

    def regularised(m, b):  # the experts' weight also read outside the grouped matmuls
        return m(**b).loss + 1e-3 * m.model.layers[0].mlp.experts.down_proj.pow(2).sum()
    with pytest.raises(PlanError, match="down_proj of .* is also read by .* not only as"):
        fxpar.compile(model, 2, example_batch=batch, loss_fn=regularised,
                      plan={"dp": 2, "ep": 2})
    llama, spec = zoo.build("llama")  # (its layers a list, each reading the last's output)
    with pytest.raises(PlanError, match="no MoE layer found on the graph.*'model.layers': "
                       "its members' inputs are not rows picked by an index op"):
        fxpar.compile(llama, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})


def test_ep_with_cp_sends_each_ranks_own_tokens_to_their_experts():
    """ep with cp: a cp group's ranks hold the same rows' sequence chunks, and the dispatch
    runs on each rank's own tokens (its chunks' pairs), so the all-to-alls send those, over
    the ep group, and nothing of the MoE layer is gathered over cp. dp=4 with cp=2 and ep=4
    (an expert group spanning two sequence groups) and cp=4 with ep=2: the grouped matmuls
    take ep x the rank's pairs (its rows' chunks, top-2); the mesh nests the smaller group
    in the larger (dp=2 x cp=2 x ep=2: one group for both); the expert gradients complete
    (ep = dp), the others summed over dp; the keys and values gathered over cp."""
    model, batch = _mixtral()
    fx = torch.ops.fxpar
    assert mesh_dims(resolve({"dp": 2, "cp": 2, "ep": 2}, 2)) == [("edp", 1), ("ecp", 1),
                                                                   ("cp", 2)]
    for world, cp, ep, dims in ((4, 2, 4, [("edp", 1), ("ecp", 2), ("cp", 2)]),
                                (4, 4, 2, [("cdp", 1), ("cep", 2), ("ep", 2)])):
        prog = fxpar.compile(model, world, example_batch=batch,
                             plan={"dp": world, "cp": cp, "ep": ep, "fuse": False})
        sig, g = prog.signature, prog.graph.graph
        assert (prog.ep, prog.cp) == (ep, cp) and mesh_dims(prog.plan) == dims
        assert [r["dispatch"] for r in prog.graph.meta[ir.EP_REPORT]] == ["all-to-all"] * 2
        own = 8 // (world // cp) * 16 // cp * 2  # (the rank's rows, its chunks, top-2)
        rows = {n.meta[ir.VAL].shape[0] for n in g.nodes
                if n.target is aten._grouped_mm.default and n.meta[ir.VAL].dim() == 2}
        assert rows == {ep * own}, rows
        moved = [n for n in g.nodes if n.target in (fx.ep_dispatch.default,
                                                     fx.ep_combine.default)]
        assert len(moved) == 8 and {n.args[-1] for n in moved} == {ir.GROUPS["ep"]}
        gathered = [n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default]
        assert {n.args[-1] for n in gathered} == {ir.GROUPS["cp"]}
        assert not [n for n in gathered if "experts" in n.meta.get(ir.MODULE, "")
                    or "mlp" in n.meta.get(ir.MODULE, "")]
        out = next(n for n in g.nodes if n.op == "output")
        grads = out.args[0][1:1 + sig.num_params]
        assert len(prog.expert_params) == 4
        assert not any(reduced_over(grads[i]) for i in prog.expert_params)
        assert all(reduced_over(grads[i]) for i in range(sig.num_params)
                   if i not in prog.expert_params and grads[i] is not None)
        # the report's lines say so (the labels' shift reads the whole sequence)
        assert _decision_line("expert_parallel", prog.graph) == (
            f"2 MoE layer(s) split, {4 // ep} of 4 experts on each rank; rows moved by "
            "all-to-all (2)")
        line = _decision_line("context_parallel", prog.graph)
        assert line.startswith(f"cp={cp}: the sequence of batch[0], batch[1] split; 2 "
                               "attention(s) on the rank's chunks (2 causal chunk, 0 ring), "
                               "0 whole; the sequence gathered for (outside the model's "
                               "modules) (1); "), line


def spec_shape(model, name):
    return dict(model.named_parameters())[name].shape


@pytest.mark.slow  # (several compiles: make test's 6 minutes)
def test_tp_inside_the_experts_of_each_ep_rank():
    """ep=2 x tp=2 inside dp=2 splits each expert over tp on the rank holding it. Grouped
    experts (DeepSeek-V3's): each rank's E/ep slice of each stack, stored split along its
    features by the tp pass, its rows by all-to-all. Listed
    experts (where_moe: column -> row linears, the row's bias kept by one tp rank): each slot
    holds its ep rank's expert tp-split like the others of its slot, the partial sum
    all-reduced over tp inside the slot."""
    ds, spec = zoo.build("deepseek_v3")
    prog = fxpar.compile(ds, 4, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2, "tp": 2})
    (report,) = prog.graph.meta[ir.EP_REPORT]
    assert (report["dispatch"], report["experts"], report["per_rank"]) == ("all-to-all", 4, 2)
    g, names = prog.graph.graph, prog.signature.param_names
    phs = [n for n in g.nodes if n.op == "placeholder"]
    for i in prog.expert_params:  # (this rank's 2 of 4 experts, split over tp)
        layout = prog.tp_layouts[i]
        assert layout[0] not in (None, 0) and phs[i].meta[ir.VAL].shape[0] == 2
        assert phs[i].meta[ir.VAL].shape[layout[0]] * 2 == spec_shape(ds, names[i])[layout[0]]

    prog = _where_moe_program({"dp": 2, "ep": 2, "tp": 2})
    names, layouts = prog.signature.param_names, prog.tp_layouts
    assert len(prog.expert_slots) == 8
    split = [s for s in prog.expert_slots if layouts[s[0]] is not None]
    assert {names[s[0]] for s in split} == {"experts.0.0.weight", "experts.0.0.bias",
                                            "experts.0.2.weight", "experts.1.0.weight",
                                            "experts.1.0.bias", "experts.1.2.weight"}
    assert all(layouts[s[0]] == layouts[s[1]] for s in prog.expert_slots)
    g = prog.graph.graph
    tp_sums = [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
               and n.args[2] == "fxpar.tp" and n.meta.get(ir.MODULE, "").startswith("experts.")]
    assert len(tp_sums) >= 2  # (each slot's row linear, forward)
    assert any(n.target is torch.ops.fxpar.partial_from_replicate.default for n in g.nodes)


@pytest.mark.slow  # (two ranks launched: make test's 6 minutes)
def test_mixtral_ep2_trains_like_eager():
    """dp=2 x ep=2 on 2 ranks: losses, evaluate() and every final weight (gathered from the
    ranks' halves of the experts by full_state_dict) equal eager AdamW."""
    _check_plans(2, [("mixtral", "adamw", {"dp": 2, "ep": 2})])


@pytest.mark.slow  # (make test's 6 minutes)
def test_mixtral_ep2_with_microbatches_and_zero2_trains_like_eager():
    """dp=2 x ep=2 with two microbatches and ZeRO-2: equal to eager AdamW."""
    _check_plans(2, [("mixtral", "adamw", {"dp": 2, "ep": 2, "microbatches": 2, "zero": 2})])


@pytest.mark.slow
def test_ep_with_zero_on_four_ranks_trains_like_eager(tmp_path):
    """dp=4 x ep=2 with ZeRO-2 and -3: the expert weights sharded over their "edp" pairs,
    the others over all four ranks; and ep=2 with tp=2 and ZeRO-3, with a 2-stage pipeline
    and ZeRO-1 (its optimizer state sharded over "edp"), and on 2 ranks with remat (the recomputed forward a layer of its own, on the
    same split weights) and ZeRO-3 (the other weights sharded; the experts, one rank's
    each, not): equal to eager AdamW; a ZeRO-3 run's checkpoint resumes bit for bit and
    loads into plain ZeRO-1 dp=4."""
    _check_plans(2, [("mixtral", "adamw", {"dp": 2, "ep": 2, "remat": "sqrt", "zero": 3})])
    _check_plans(4, [("mixtral", "adamw", {"dp": 4, "ep": 2, "zero": z}) for z in (2, 3)]
                 + [("mixtral", "adamw", {"dp": 2, "ep": 2, "tp": 2, "zero": 3}),
                    ("mixtral", "adamw", {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2,
                                          "zero": 1})])
    workers.check_resumed_and_resharded(4, "mixtral", {"dp": 4, "ep": 2, "zero": 3},
                                        {"dp": 4, "zero": 1}, str(tmp_path))


@pytest.mark.slow
def test_ep_with_hsdp_trains_like_eager(tmp_path):
    """ep=2 inside HSDP's shard groups: dp=4 in groups of 2 (each expert whole on its rank
    of the group, summed across the replicas) with ZeRO-2, and dp=8 in groups of 4 with
    ZeRO-3 (each expert weight sharded over the 2 ranks of its shard group holding it):
    equal to eager AdamW; a 4-rank ZeRO-3 run's checkpoint resumes bit for bit and loads
    into plain ZeRO-1 dp=4."""
    _check_plans(4, [("mixtral", "adamw", {"dp": 4, "ep": 2, "zero": 2, "dp_shard": 2})])
    _check_plans(8, [("mixtral", "adamw", {"dp": 8, "ep": 2, "zero": 3, "dp_shard": 4})])
    workers.check_resumed_and_resharded(4, "mixtral", {"dp": 4, "ep": 2, "zero": 3,
                                                       "dp_shard": 2},
                                        {"dp": 4, "zero": 1}, str(tmp_path))


@pytest.mark.slow
def test_moe_models_on_four_ranks_train_like_eager():
    """ep carved out of dp=4: groups of 2 (two groups, each holding every expert once) on
    Mixtral, Qwen2-MoE (a gated shared expert) and DeepSeek-V3 (group-limited routing, a
    shared expert, a dense first layer); ep=4 (one expert per rank); and ep=2 inside dp=2 with
    tp=2 (DeepSeek-V3's experts split over tp) or a zero-bubble pipeline of 2 stages; and Mixtral
    with its router's load-balancing loss added to the loss (router_aux_loss_coef=0.02)."""
    cases = [(m, "adamw", {"dp": 4, "ep": 2}) for m in ("mixtral", "qwen2_moe", "deepseek_v3")]
    cases.append(("deepseek_v3", "adamw", {"dp": 2, "ep": 2, "tp": 2}))  # (tp in its experts)
    _check_plans(4, cases + [("mixtral", "adamw", p) for p in (  # (Mixtral's ep x tp: with
        {"dp": 4, "ep": 4},                                       # ZeRO-3, above)
        {"dp": 2, "ep": 2, "pp": 2, "microbatches": 4, "schedule": "zero-bubble"})]
        + [("mixtral_aux", "adamw", {"dp": 4, "ep": 2})])


@pytest.mark.slow
def test_clipping_counts_each_expert_once():
    """max_grad_norm with ep=2 inside dp=4: each expert's gradient lives on one rank of each
    ep group (the same on both groups): the global norm counts the first group's; with ZeRO-2
    each rank's shard of its experts (over its "edp" pair) and of the rest; with HSDP the
    first replica's shards; all equal to clip_grad_norm_ in one process."""
    check_clipping(4, [("mixtral", {"dp": 4, "ep": 2}),
                       ("mixtral", {"dp": 4, "ep": 2, "zero": 2}),
                       ("mixtral", {"dp": 4, "ep": 2, "zero": 3, "dp_shard": 2})])


@pytest.mark.slow
def test_quantized_zero_collectives_run_over_each_weights_group():
    """ZeRO++'s compressed collectives with ep=2 inside dp=4: the experts' int8 gathers and
    int4 gradient all-to-alls run over their "edp" pairs, the rest over dp (no
    reduce-scatter left); 30 AdamW steps on 4 batches track the uncompressed plan (lossy
    by design: the mean of the last 5 losses within 10%, measured 2-5%) on <= 0.35x the
    gathered and <= 0.2x the reduced bytes."""
    model, batch = _mixtral()
    prog = fxpar.compile(model, 4, example_batch=batch, plan={
        "dp": 4, "ep": 2, "zero": 3, "fuse": False, "comm_quantization": "weights+gradients"})
    params = [n for n in prog.graph.graph.nodes if n.op == "placeholder"]
    experts = {params[i] for i in prog.expert_params}
    ag, a2a, seen = c10d.all_gather_into_tensor.default, c10d.all_to_all_single.default, set()
    for n in prog.graph.graph.nodes:
        if n.target in (ag, a2a):
            assert n.args[0].meta[ir.VAL].dtype in (torch.int8, torch.uint8), n.name
            seen.add((n.target, n.args[-1]))
        if n.target is ag:  # (a gather reads one weight's shard)
            expert = bool(set(ir.ancestors([n])) & experts)
            assert n.args[-1] == ir.GROUPS["edp" if expert else "dp"], n.name
        assert n.target is not c10d.reduce_scatter_tensor.default, n.name
    assert seen == {(op, ir.GROUPS[g]) for op in (ag, a2a) for g in ("dp", "edp")}, seen
    plans = [{"dp": 4, "ep": 2, "zero": 3},
             {"dp": 4, "ep": 2, "zero": 3, "comm_quantization": "weights+gradients"},
             {"dp": 4, "ep": 2, "zero": 2, "comm_quantization": "gradients"}]
    res = fxpar.launch(workers.quantized_rank, 4, plans, 30, "memorize", 1e-2, "mixtral")[0]
    (lp, bp), end_p = res[repr(plans[0])], sum(res[repr(plans[0])][0][-5:]) / 5
    assert end_p < 0.5 * lp[0], lp  # it learns
    for plan in plans[1:]:
        lq, bq = res[repr(plan)]
        end_q = sum(lq[-5:]) / 5
        print(plan, f"loss {lp[0]:.4f} -> {end_p:.4f}, quantized {end_q:.4f}", bq, bp)
        assert abs(end_q - end_p) <= 0.1 * end_p, (plan, end_q, end_p)
        assert "reduce_scatter" not in bq and bq["all_to_all"] <= 0.2 * bp["reduce_scatter"]
        if plan["zero"] == 3:
            assert bq["all_gather"] <= 0.35 * bp["all_gather"], (bq, bp)


@pytest.mark.slow
def test_checkpoint_resumes_and_reshards(tmp_path):
    """An ep=2 run saves at step 5 (each rank's experts gathered into one model's file): it
    resumes bit for bit, and plain dp=2 loads the same checkpoint and takes its next step."""
    workers.check_resumed_and_resharded(2, "mixtral", {"dp": 2, "ep": 2}, {"dp": 2},
                                        str(tmp_path))


def test_planner_prices_quantized_expert_gradients_as_the_pass_sends_them():
    """Plan.comm_quantization under ep: the experts' gradients go over their "edp" ranks as
    int4 all-to-alls (qgZ) and their ZeRO-3 gathers as int8 (qwZ), as the dense weights'
    over dp; the dense wire is the dense weights' alone (the experts are not sent twice)."""
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    from fxpar.core import cost
    from fxpar.core import quantized_comm as qcomm
    model, batch = _mixtral()
    stats = planner_stats(model, batch)
    sent = []

    class Recording(cost.Hardware):
        def comm(self, kind, nbytes, n, span, calls=1):
            sent.append((kind, nbytes, n))
            return super().comm(kind, nbytes, n, span, calls)
    hw = Recording(**{f.name: getattr(cost.HARDWARE["h100"], f.name)
                      for f in dataclasses.fields(cost.Hardware)})
    fixed = {"dp": 4, "tp": 1, "pp": 1, "microbatches": 1, "ep": 2}
    by = {}
    for zero, quant in ((2, "none"), (2, "gradients"), (3, "weights+gradients")):
        sent.clear()
        planner.search(stats, 4, hw, batch_rows=8, executable=False, constraints={
            **fixed, "zero": zero, "comm_quantization": quant})
        by[zero, quant] = list(sent)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    mine = experts / 2  # (this rank's half of the experts)
    plain = [(k, b) for k, b, n in by[2, "none"] if n == 2 and k == "reduce_scatter"]
    assert plain == [("reduce_scatter", pytest.approx(4 * mine))]  # (fp32, over edp)
    q = by[2, "gradients"]
    assert not [c for c in q if c[0] == "reduce_scatter"]
    assert ("all_to_all", pytest.approx(mine * (0.5 + 2 / qcomm.GRAD_BLOCK)), 2) in q
    assert ("all_to_all", pytest.approx(dense * (0.5 + 2 / qcomm.GRAD_BLOCK)), 4) in q
    w = by[3, "weights+gradients"]
    assert ("all_gather", pytest.approx(mine * (1 + 2 / qcomm.BLOCK)), 2) in w
    assert ("all_gather", pytest.approx(dense * (1 + 2 / qcomm.BLOCK)), 4) in w


def test_planner_prices_expert_parallelism():
    """The planner's statistics hold each MoE layer's experts (weights, grouped-matmul
    FLOPs, the rows ep sums); the search prices every ep dividing dp and the experts, each
    with 1/ep of the experts' state per rank (with ZeRO 1/dp, as without ep). On a Mixtral
    with 1024-wide experts over 8 H100s, plain dp (a CUDA graph) against ep's all-to-all
    dispatch (never captured); a
    dense model gets no ep candidate, and a fixed ep is the only one priced (one the graph
    refuses: its reason)."""
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    from fxpar.core import cost
    model, batch = _mixtral()
    stats = planner_stats(model, batch)
    experts = {n: p.numel() for n, p in model.named_parameters() if ".experts." in n}
    assert stats.expert_counts == (4, 4) and stats.ep_refusal is None
    assert [s.expert_params for s in stats.segments if s.n_moe] == [
        sum(v for n, v in experts.items() if f"layers.{i}." in n) for i in range(2)]
    assert all(s.expert_flops_f > 0 and s.expert_flops_b > s.expert_flops_f and s.ep_comm_f > 0
               for s in stats.segments if s.n_moe)
    hw = cost.HARDWARE["h100"]
    fixed = {"tp": 1, "pp": 1, "zero": 0, "microbatches": 1}
    r = planner.search(stats, 4, hw, batch_rows=8, executable=False, constraints=fixed)
    by_ep = {c.plan.ep: c for c in r.table}
    assert set(by_ep) == {1, 2, 4}
    share = sum(experts.values()) / stats.total_params
    for ep in (2, 4):
        assert by_ep[ep].memory.params == pytest.approx(
            by_ep[1].memory.params * (1 - share * (1 - 1 / ep)))
    # with ZeRO the experts' state shards over the dp / ep ranks holding them: 1/dp of each
    # expert per rank at every ep, as without ep
    r = planner.search(stats, 4, hw, batch_rows=8, executable=False,
                       constraints={**fixed, "zero": 3})
    z3 = {c.plan.ep: c.memory for c in r.table}
    assert set(z3) == {1, 2, 4}
    for ep in (2, 4):
        assert (z3[ep].params, z3[ep].optimizer) == pytest.approx(
            (z3[1].params, z3[1].optimizer))
    # HSDP (shard groups of 2): ep=2 inside them (ep=4 does not fit), the experts' state
    # sharded over the shard group as the rest's is
    r = planner.search(stats, 4, hw, batch_rows=8, executable=False,
                       constraints={**fixed, "zero": 3, "dp_shard": 2})
    h3 = {c.plan.ep: c for c in r.table}
    assert set(h3) == {1, 2} and all(c.plan.hsdp for c in h3.values())
    assert (h3[2].memory.params, h3[2].memory.optimizer) == pytest.approx(
        (h3[1].memory.params, h3[1].memory.optimizer))
    r = planner.search(stats, 4, hw, batch_rows=8, executable=False,
                       constraints={**fixed, "ep": 2})
    assert {c.plan.ep for c in r.table} == {2}
    dense, spec = zoo.build("llama")
    assert planner_stats(dense, spec.batch(0)).expert_counts == ()

    import transformers
    cfg = transformers.MixtralConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, router_aux_loss_coef=0.0, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        big = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 4096, (8, 1024))
    stats = planner_stats(big, {"input_ids": ids, "labels": ids}, precision="bf16")
    # the dispatch runs on each rank's own rows (core/local_dispatch), so plain dp computes
    # 1/8 of the routed rows and all-reduces every expert's gradient over 8 ranks; ep sends
    # each rank's rows to their experts' ranks and back (all-to-all: a few MB a layer) and
    # sums its experts' gradients over dp/ep ranks, but its step cannot be replayed as a
    # CUDA graph (the host reads the counts): at this size plain dp's captured step wins,
    # and ep where a copy of every expert does not fit (dp is left only remat's recompute)
    assert stats.moe_local
    r = planner.search(stats, 8, hw, batch_rows=8, precision="bf16", executable=False,
                       constraints=fixed)
    assert r.best.plan.ep == 1 and {c.plan.ep for c in r.table} == {1, 2, 4, 8}, r.format()
    small = dataclasses.replace(hw, memory=int(1.6 * 2**30))
    r = planner.search(stats, 8, small, batch_rows=8, precision="bf16", executable=False,
                       constraints=fixed)
    assert r.best.plan.ep > 1 and [c.step_s for c in r.table if c.plan.ep == 1][0] > \
        3 * r.best.step_s, r.format()
    # the rows ep receives beyond its own, of the layers remat keeps (the remat pass runs
    # before ep's and sizes its budget without them): the pass's budget is what is left
    # beside them, so a plan that fits only with recompute still fits (the received rows
    # were once added on top of a budget that filled the device: the plan was refused by
    # 0.04 GiB; a rank's one row)
    tight = dataclasses.replace(hw, memory=int(0.6 * 2**30))
    r = planner.search(stats, 8, tight, batch_rows=8, precision="bf16", executable=False,
                       constraints={**fixed, "ep": 8})
    c = r.best
    extra = (planner.EP_RECEIVED - 1) * sum(s.ep_saved for s in stats.segments) / stats.rows
    assert isinstance(c.plan.remat, int) and c.memory.total <= 0.9 * tight.memory
    assert 0 < c.recompute < 1 and c.memory.activations - c.plan.remat == pytest.approx(
        extra * (1 - c.recompute), rel=0.01)
    with pytest.raises(PlanError, match="Plan.ep=2: PlanError: .*no MoE layer"):
        planner.search(dataclasses.replace(stats, expert_counts=(), ep_refusal=(
            "PlanError: no MoE layer of grouped matmuls")), 8, hw, batch_rows=8,
            executable=False, constraints={**fixed, "ep": 2})


def _all_to_all_rank():
    from fxpar.core import experts  # noqa: F401  (registers fxpar::ep_*)
    from fxpar.runtime import dist as rdist
    fx = torch.ops.fxpar
    world = rdist.setup(2, [("edp", 1), ("ep", 2)])
    rank, group = world.rank, world.group_name("ep")
    # 4 experts over 2 ranks (2 each); rank 0 routes 1, 0, 3, 2 rows to experts 0-3, rank 1
    # 0, 2, 1, 3 (uneven, one expert empty on one side); rows sorted by expert, tagged
    counts = [[1, 0, 3, 2], [0, 2, 1, 3]][rank]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.cat([torch.full((c, 2), 100.0 * rank + e) for e, c in enumerate(counts)])
    route = fx.ep_route(offs, 2, group)
    got = fx.ep_dispatch(x, route, group)
    back = fx.ep_combine(got * 2, route, group)
    refused = False
    try:  # (every rank alike: a row more than received, refused before any exchange)
        fx.ep_combine(torch.cat([got, got[:1]]), route, group)
    except RuntimeError as e:
        refused = "rows came back from the experts, but this rank received" in str(e)
    # every row routed to rank 1's experts: rank 0 receives none (zero stand-in rows)
    counts = [[0, 0, 3, 1], [0, 0, 2, 2]][rank]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x2 = torch.cat([torch.full((c, 2), 100.0 * rank + e) for e, c in enumerate(counts)])
    route2 = fx.ep_route(offs, 2, group)
    got2 = fx.ep_dispatch(x2, route2, group)
    empty = (got2.shape[0] == experts.EMPTY_ROWS and not got2.any()) if rank == 0 else \
        got2.shape[0] == 8
    back2 = fx.ep_combine(got2 * 2, route2, group)
    # as the runtime issues them (runtime/comm.lower): asynchronously, sorted at the wait
    from fxpar.runtime import comm
    issued = []
    for r, rows in ((route, x), (route2, x2)):
        sent = comm.wait(comm.start_ep_dispatch(rows, r, group, "dispatch"))
        issued += [sent, comm.wait(comm.start_ep_combine(sent * 2, r, group, "combine"))]
    same = [torch.equal(a, b) for a, b in zip(issued, [got, back, got2, back2])]
    return route.tolist(), got[:, 0].tolist(), torch.equal(back, 2 * x) and refused and \
        empty and torch.equal(back2, 2 * x2) and all(same)


def test_all_to_all_ops_send_rows_to_their_experts_and_back():
    """fxpar::ep_route / ep_dispatch / ep_combine on 2 gloo ranks with uneven counts: each
    rank receives exactly its experts' rows (3 and 9 of the 12 routed), sorted by expert
    (rank 0's rows first within each); the combine returns every row to its own rank and
    place, and refuses rows that are not those received; a rank none of whose experts is
    routed to holds zero stand-in rows, ignored by the combine. Issued asynchronously as the
    runtime does (comm.start_ep_dispatch / start_ep_combine, then wait), the same rows."""
    out = fxpar.launch(_all_to_all_rank, 2)
    (route0, got0, ok0), (route1, got1, ok1) = out[0], out[1]
    assert route0 == [[[1, 0], [3, 2]], [[1, 0], [0, 2]]]
    assert route1 == [[[0, 2], [1, 3]], [[3, 2], [1, 3]]]
    assert got0 == [0.0, 101.0, 101.0]  # expert 0: rank 0's; 1: rank 1's
    assert got1 == [2.0, 2.0, 2.0, 102.0, 3.0, 3.0, 103.0, 103.0, 103.0]
    assert ok0 and ok1


# --- experts kept as an nn.ModuleList (the zoo's where_moe, litgpt's Mixtral) --------------

def _where_moe_program(plan):
    """where_moe with experts too narrow to run grouped (workers' where_moe_slots): under ep
    they run in slots, as traced."""
    model, batch_fn, _ = workers.build("where_moe_slots")
    return fxpar.compile(model, plan["dp"] * plan.get("tp", 1), example_batch=batch_fn(0),
                         plan=plan)


def test_listed_experts_run_in_slots_on_their_ranks():
    """dp=2 x ep=2 over 4 experts: 2 slots, each running expert j's graph on the rows of this
    rank's expert (an expert_pick among experts j and j+2, forward and backward), its results
    all-gathered over ep and read where each expert's were; experts 2 and 3 have no region
    left and no gradient; each slot parameter holds expert j on ep rank 0, j+2 on rank 1."""
    prog = _where_moe_program({"dp": 2, "ep": 2})
    g, names = prog.graph.graph, prog.signature.param_names
    (report,) = prog.graph.meta[ir.EP_REPORT]
    assert (report["dispatch"], report["experts"], report["per_rank"]) == \
        ("expert slots", 4, 2)
    assert prog.ep == 2 and prog.expert_params == []
    slots = {names[s[0]]: [names[i] for i in s] for s in prog.expert_slots}
    assert slots == {f"experts.{j}.{w}": [f"experts.{j}.{w}", f"experts.{j + 2}.{w}"]
                     for j in (0, 1) for w in ("0.weight", "0.bias", "2.weight", "2.bias")}
    picks = [n for n in g.nodes if n.target is torch.ops.fxpar.expert_pick.default]
    # per slot: its rows in (forward), the gradient of its output in (backward)
    assert len(picks) == 4 and {p.meta[ir.REGION] for p in picks} == {"forward", "backward"}
    assert all(p.args[1] == "fxpar.ep" and len(p.args[0]) == 2 for p in picks)
    gathers = [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor
               .default and n.args[2] == "fxpar.ep"]
    # per slot: its output (forward) and the gradient of its rows (backward), 2 x 256 rows
    assert len(gathers) == 4 and all(n.meta[ir.VAL].shape[0] == 512 for n in gathers)
    phs = [n for n in g.nodes if n.op == "placeholder"]
    read = {names[i] for i in range(len(names)) if phs[i].users}
    assert not {n for n in read if n.startswith(("experts.2.", "experts.3."))}
    assert {f"experts.{j}.0.weight" for j in (0, 1)} <= read
    out = next(n for n in g.nodes if n.op == "output").args[0]
    grads = dict(zip(names, out[1:1 + len(names)]))
    assert all((grads[n] is None) == n.startswith(("experts.2.", "experts.3."))
               for n in names if n.startswith("experts."))
    # the expert weights' gradients are whole (every row's): no reduction over dp or edp
    reduced = [n for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    assert all(n.meta[ir.VAL].numel() < 9000 for n in reduced)
    # the planner prices ep for it: one MoE layer of 4 experts, their weights, in slots
    from fxpar.compiler.compile import planner_stats
    model, batch_fn, _ = workers.build("where_moe_slots")
    stats = planner_stats(model, batch_fn(0))
    assert stats.ep_slots
    experts = sum(p.numel() for n, p in model.named_parameters() if n.startswith("experts."))
    assert stats.expert_counts == (4,) and stats.ep_refusal is None
    assert [s.expert_params for s in stats.segments if s.n_moe] == [experts]
    # tp splits each expert's linears: under ep x tp a rank's expert work is 1/tp of theirs
    from fxpar.compiler.planner import _expert_flops
    segs, whole = stats.segments, sum(s.expert_flops_f for s in stats.segments)
    assert sum(s.expert_flops_f_split for s in segs) == whole > 0
    assert _expert_flops(segs, "f", 2) == whole / 2 and _expert_flops(segs, "f", 1) == whole


def test_stacked_experts_a_loop_reads_split_like_grouped_experts():
    """Hugging Face's eager experts (each projection one parameter [experts, ...], a loop
    reading expert by expert: the zoo's stacked_loop_moe) at dp=2 x ep=2: grouped first
    (passes/grouped_experts), each rank keeps its half of each parameter and its rows go to
    their experts by all-to-all, as Hugging Face's grouped experts do; the planner prices
    ep for them (grouped, no stacked copy)."""
    model, spec = zoo.build("stacked_loop_moe")
    prog = fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})
    (report,) = prog.graph.meta[ir.EP_REPORT]
    assert (report["module"], report["dispatch"], report["experts"], report["per_rank"]) == \
        ("experts", "all-to-all", 4, 2)
    names = prog.signature.param_names
    assert sorted(names[i] for i in prog.expert_params) == ["experts.down_proj",
                                                            "experts.gate_up_proj"]
    phs = [n for n in prog.graph.graph.nodes if n.op == "placeholder"]
    assert all(phs[i].meta[ir.VAL].shape[0] == 2 for i in prog.expert_params)
    assert prog.expert_slots == []
    from fxpar.compiler.compile import planner_stats
    stats = planner_stats(model, spec.batch(0))
    seg = next(s for s in stats.segments if s.n_moe)
    assert stats.expert_counts == (4,) and stats.ep_refusal is None and not stats.ep_slots
    assert seg.grouped_stack_bytes == 0 and seg.grouped_saved_f > 0


def test_dbrx_experts_split_along_their_viewed_parameters():
    """DBRX: each expert weight one parameter [E * ffn, hidden], viewed as the experts' stack
    in every iteration of a loop that also visits a masking class (removed: eager cannot
    run it). Grouped, then split along dim 0 at dp=2 x ep=2: each rank holds half of every
    parameter's rows, its 2 experts'; the rows go by all-to-all."""
    pytest.importorskip("transformers")
    model, spec = zoo.build("dbrx")
    prog = fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})
    reports = prog.graph.meta[ir.EP_REPORT]
    assert [(r["dispatch"], r["experts"], r["per_rank"]) for r in reports] == \
        [("all-to-all", 4, 2)] * 2
    names = prog.signature.param_names
    phs = [n for n in prog.graph.graph.nodes if n.op == "placeholder"]
    full = dict(model.named_parameters())
    split = {names[i]: tuple(phs[i].meta[ir.VAL].shape) for i in prog.expert_params}
    assert sorted(split) == sorted(n for n in full if ".experts.mlp." in n)
    assert all(s == (full[n].shape[0] // 2, full[n].shape[1]) for n, s in split.items())


def test_stacked_experts_with_biases_run_grouped_under_ep():
    """Stacked experts with biases [experts, out] (GPT-OSS's eager form): grouped, each row's
    bias is looked up by its expert on the rank that routes it and travels with the rows,
    so ep splits the matrices and keeps the biases whole (their gradients summed into
    zeros by expert on that rank, partial over dp as any weight's); the planner prices ep.
    Parity: test_padded_nonzero's GPT-OSS eager experts at dp=2 x ep=2."""
    class Biased(zoo.StackedExperts):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(4, zoo.HIDDEN))

        def forward(self, x, indices, weights):
            y = torch.zeros_like(x)
            mask = torch.nn.functional.one_hot(indices, 4).permute(2, 1, 0)
            for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
                e = e[0]
                top, idx = torch.where(mask[e])
                gate, up = torch.nn.functional.linear(x[idx], self.gate_up_proj[e]).chunk(2, -1)
                h = torch.nn.functional.linear(gate.relu() * up, self.down_proj[e], self.bias[e])
                y.index_add_(0, idx, h * weights[idx, top, None])
            return y
    model, spec = zoo.build("stacked_loop_moe")
    model.experts = Biased()
    prog = fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})
    (layer,) = prog.graph.meta[ir.EP_REPORT]
    assert layer["dispatch"] == "all-to-all" and layer["per_rank"] == 2
    shapes = {p.meta[ir.FQN]: tuple(p.meta[ir.VAL].shape) for p in prog.graph.graph.nodes
              if p.op == "placeholder" and str(p.meta.get(ir.FQN)).startswith("experts.")}
    full = dict(model.experts.named_parameters())
    assert shapes["experts.bias"] == tuple(full["bias"].shape)
    assert shapes["experts.down_proj"][0] == 2 and shapes["experts.gate_up_proj"][0] == 2
    from fxpar.compiler.compile import planner_stats
    assert planner_stats(model, spec.batch(0)).ep_refusal is None


@pytest.mark.parametrize("d, start, step, r", [(1, 0, 2, 0), (1, 1, 2, 0), (1, 3, 1, 0),
                                                (0, 1, 2, 1), (1, 2, 4, 0)])
def test_a_slices_gradient_written_without_the_rows_count(d, start, step, r):
    """expert_parallel._unsized_slice_backward: slice_backward(g, sizes, d, start, end, step)
    as a pad (and for a step, a view) whose only size is the features': equal to it at the
    traced rows, and right at any other row count (the rows ep receives vary)."""
    import types
    from fxpar.passes import expert_parallel
    full, rows = 8, 6
    count = len(range(start, full, step)) if step > 1 else 4
    shape = [rows, count] if d == 1 else [count, rows]
    sizes = [rows, full] if d == 1 else [full, rows]
    end = full if step > 1 else start + count
    graph = torch.fx.Graph()
    g = graph.placeholder("g")
    g.meta[ir.VAL] = torch.empty(shape)
    n = graph.call_function(aten.slice_backward.default, (g, sizes, d, start, end, step))
    graph.output(n)
    layer = types.SimpleNamespace(region={n: r}, leaving=[n], module="m")
    expert_parallel._unsized_slice_backward(graph, layer, n, r)
    gm = torch.fx.GraphModule({}, graph)
    assert aten.slice_backward.default not in {x.target for x in graph.nodes}
    for k in (rows, 3, 11):
        x_shape = list(shape)
        x_shape[r] = k
        x = torch.randn(x_shape)
        want_sizes = list(sizes)
        want_sizes[r] = k
        want = aten.slice_backward.default(x, want_sizes, d, start, end, step)
        assert torch.equal(gm(x), want), k
    assert layer.leaving == [layer.leaving[0]] and n not in layer.region


@pytest.mark.slow  # (a compile of GPT-OSS at ep: make test's 6 minutes; the rewrite's own
#                    unit test above is fast)
def test_a_stepped_slices_gradient_is_sized_by_the_rows_received():
    """GPT-OSS's gate and up are every other feature of one matmul: their gradients
    (slice_backward, sized by the rows) inside an ep region are written without the rows'
    count (a pad between the features, viewed back), as the received rows vary."""
    model, batch_fn, loss_fn = workers.build("gpt_oss_eager_experts")
    prog = fxpar.compile(model, 2, example_batch=batch_fn(0), plan={"dp": 2, "ep": 2})
    g = prog.graph.graph
    dynamic = [n for n in g.nodes if n.meta.get(ir.DYNAMIC_ROWS)]
    assert not [n for n in dynamic if n.target is aten.slice_backward.default]
    pads = [n for n in dynamic if n.target is aten.constant_pad_nd.default]
    assert pads and all(n.args[0].target is aten.unsqueeze.default for n in pads)


@pytest.mark.slow  # (several compiles: make test's 6 minutes)
def test_grouped_listed_experts_split_as_slots_of_their_stacks():
    """litgpt's Mixtral at dp=2 x ep=2: its experts run grouped (passes/grouped_experts),
    each grouped matmul over a stack of this rank's 2 experts' matrices (slots: expert j on
    ep rank 0, j+2 on rank 1), the rows each rank routes (its own: core/local_dispatch)
    sent to their experts' ranks by all-to-all; no expert is run as traced, experts 2 and 3
    have no gradient and no reader. where_moe's experts (biases: each row's looked up by
    its expert before it leaves, the biases whole on every rank) run grouped too; experts
    too narrow to group run in slots as traced, the reason kept."""
    model, batch_fn, loss_fn = workers.build("litgpt_mixtral")
    prog = fxpar.compile(model, 2, example_batch=batch_fn(0), loss_fn=loss_fn,
                         plan={"dp": 2, "ep": 2})
    g, names = prog.graph.graph, prog.signature.param_names
    assert [(r["dispatch"], r["experts"], r["per_rank"]) for r in
            prog.graph.meta[ir.EP_REPORT]] == [("all-to-all, grouped slots", 4, 2)] * 2
    assert all(r["grouped"] for r in prog.graph.meta[ir.GROUPED_EXPERTS])
    stacks = [n for n in g.nodes if n.target is torch.ops.aten.stack.default
              and any(u.target is torch.ops.aten._grouped_mm.default for u in n.users)]
    assert len(stacks) == 12 and all(len(n.args[0]) == 2 for n in stacks)  # (3 fwd, 3 bwd)
    slots = {names[s[0]]: [names[i] for i in s] for s in prog.expert_slots}
    layer = "transformer.h.0.mlp.experts"
    assert {k: v for k, v in slots.items() if k.startswith(layer)} == {
        f"{layer}.{j}.{w}.weight": [f"{layer}.{j}.{w}.weight", f"{layer}.{j + 2}.{w}.weight"]
        for j in (0, 1) for w in ("fc_1", "fc_2", "proj")}
    phs = [n for n in g.nodes if n.op == "placeholder"]
    out = next(n for n in g.nodes if n.op == "output").args[0]
    for i, name in enumerate(names):
        other = ".experts.2." in name or ".experts.3." in name
        assert (not phs[i].users and out[1 + i] is None) if other else True, name
    expert_params = {phs[i] for i, n in enumerate(names) if ".experts." in n}
    assert not [n for n in g.nodes if n.target is torch.ops.aten.mm.default and any(
        a in expert_params or (a.args and a.args[0] in expert_params)
        for a in n.all_input_nodes)]  # (no expert as traced)
    assert any(n.target is torch.ops.fxpar.ep_dispatch.default for n in g.nodes)
    from fxpar.compiler.compile import planner_stats  # (ep priced with its experts grouped)
    model, batch_fn, loss_fn = workers.build("litgpt_mixtral")
    stats = planner_stats(model, batch_fn(0), loss_fn=loss_fn)
    segs = stats.segments
    assert sum(s.grouped_saved_f for s in segs) > 0
    assert stats.moe_local and not stats.ep_slots  # (dp: each rank's own positions; ep:
    #                                                 all-to-all, not slots)

    model, spec = zoo.build("where_moe")
    prog = fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})
    assert prog.graph.meta[ir.EP_REPORT][0]["dispatch"] == "all-to-all, grouped slots"
    names, phs = prog.signature.param_names, [n for n in prog.graph.graph.nodes
                                              if n.op == "placeholder"]
    biases = [i for i, n in enumerate(names) if n.startswith("experts.") and "bias" in n]
    assert len(biases) == 8 and all(phs[i].users for i in biases)  # (every expert's, whole)
    prog = _where_moe_program({"dp": 2, "ep": 2})
    (why,) = [r["why"] for r in prog.graph.meta[ir.GROUPED_EXPERTS]]
    assert "multiples of 8" in why
    assert prog.graph.meta[ir.EP_REPORT][0]["dispatch"] == "expert slots"


class _Scale(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


def test_listed_experts_that_cannot_run_in_slots_are_refused_by_name():
    """A loss reading an expert's weight outside the expert, a pipeline stage boundary among
    the experts (its one MoE layer cut in two), an expert count ep does not divide, and
    experts of one graph but each with a constant of its own are refused by name (experts
    too narrow to run grouped)."""
    model, batch_fn, _ = workers.build("where_moe_slots")
    spec = type("Spec", (), {"batch": staticmethod(batch_fn)})

    def regularised(m, b):
        return m(b) + 1e-3 * m.experts[1][0].weight.pow(2).sum()
    with pytest.raises(PlanError, match="expert 'experts.1' is read by pow.*not on the expert's"):
        fxpar.compile(model, 2, example_batch=spec.batch(0), loss_fn=regularised,
                      plan={"dp": 2, "ep": 2})
    with pytest.raises(PlanError, match="'experts' has 4 experts, which do not split evenly"):
        fxpar.compile(model, 3, example_batch=spec.batch(0), plan={"dp": 3, "ep": 3})
    with pytest.raises(PlanError, match="stage boundary falls among the experts of 'experts'"):
        fxpar.compile(model, 4, example_batch=spec.batch(0),
                      plan={"dp": 2, "ep": 2, "pp": 2, "microbatches": 2})
    for k, expert in enumerate(model.experts):  # one graph, but a constant of each its own:
        expert[1] = torch.nn.Sequential(torch.nn.GELU(), _Scale(k + 1))  # (a slot: expert j's)
    with pytest.raises(PlanError, match="experts of 'experts' do not run the same graph"):
        fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})


@pytest.mark.slow
def test_listed_experts_train_like_eager(tmp_path):
    """where_moe and litgpt's Mixtral (4 experts each, an nn.ModuleList routed by
    torch.where, grouped under ep; where_moe's biases whole on every rank), where_moe with
    experts too narrow to group (in slots as traced), and
    stacked_loop_moe (HF's eager experts, grouped: each rank its part of each stack)
    at dp=2 x ep=2, ep=4 with ZeRO-3, ep=2 on each stage of a zero-bubble pipeline of 2
    (one MoE layer a stage) and ep=2 x tp=2 (each expert tp-split on its rank; with
    ZeRO-3) (ZeRO-1 and remat with ep: test_ep_with_zero_on_four_ranks_trains_like_eager;
    slots at ep alone: the clipping runs): losses, evaluate() and every final weight
    (each expert gathered from its rank by name) equal eager AdamW; clipping counts each
    expert once (ZeRO-2 over the "edp" pairs); an ep run's checkpoint resumes bit
    for bit and loads into plain dp; its save_pretrained writes every expert under its own
    name, and a meta-device model built from those files (weights=, tp slices of each rank's
    experts under ep x tp) holds the same weights and takes the same next step."""
    _check_plans(2, [("where_moe", "adamw", {"dp": 2, "ep": 2})])
    _check_plans(4, [("where_moe", "adamw", {"dp": 4, "ep": 4, "zero": 3}),
                     ("litgpt_mixtral", "adamw", {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2,
                                                  "schedule": "zero-bubble"}),
                     ("litgpt_mixtral", "adamw", {"dp": 2, "ep": 2, "tp": 2, "zero": 3}),
                     ("where_moe", "adamw", {"dp": 2, "ep": 2, "tp": 2}),
                     ("where_moe_slots", "adamw", {"dp": 2, "ep": 2, "tp": 2}),
                     ("stacked_loop_moe", "adamw", {"dp": 2, "ep": 2, "tp": 2}),
                     ("stacked_loop_moe", "adamw", {"dp": 4, "ep": 4, "zero": 3})])
    workers.check_resumed_and_resharded(2, "where_moe", {"dp": 2, "ep": 2}, {"dp": 2},
                                        str(tmp_path))
    check_clipping(4, [("where_moe", {"dp": 4, "ep": 2, "zero": 2}),  # (each expert once;
                       ("where_moe_slots", {"dp": 4, "ep": 2, "zero": 2})])  # tp: Mixtral's)
    full, saved, reloaded, (loss, loss_again) = fxpar.launch(  # (each rank's experts, each
        workers.pretrained_round_trip_rank, 4, "where_moe",    # split over its tp pair)
        {"dp": 2, "ep": 2, "tp": 2}, str(tmp_path / "hf"))[0]
    assert set(saved) == set(full) == set(reloaded)
    assert all(torch.equal(saved[k], full[k]) and torch.equal(reloaded[k], full[k])
               for k in full)
    assert loss == loss_again


@pytest.mark.slow
def test_grouped_experts_split_by_ep_and_tp_save_resume_and_reload(tmp_path):
    """HF Mixtral at dp=2 x ep=2 x tp=2: each stack split along its experts (ep) and along
    its features (tp, gate_up interleaved). save_pretrained writes the Hub's per-expert
    tensors, a meta-device model built from them (weights=: each rank reads its ep x tp
    block) holds the same weights and takes the same next step; the run's checkpoint
    resumes bit for bit and loads into plain dp=4; clipping counts each element once."""
    full, saved, reloaded, (loss, loss_again) = fxpar.launch(
        workers.pretrained_round_trip_rank, 4, "mixtral", {"dp": 2, "ep": 2, "tp": 2},
        str(tmp_path / "hf"))[0]
    assert set(full) == set(reloaded) and all(torch.equal(reloaded[k], full[k]) for k in full)
    assert any("experts.3.w1" in k for k in saved)  # (the Hub's layout: one per expert)
    assert loss == loss_again
    workers.check_resumed_and_resharded(4, "mixtral", {"dp": 2, "ep": 2, "tp": 2}, {"dp": 4},
                                        str(tmp_path / "ck"))
    check_clipping(4, [("mixtral", {"dp": 2, "ep": 2, "tp": 2})])

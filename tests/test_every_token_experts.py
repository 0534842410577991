"""passes/expert_parallel on experts that run every token (Llama 4's: batched matmuls of the
inputs viewed [experts, tokens, ...] by parameters [experts, ...]): the layer found on the
joint graph (its matmuls, where the tokens enter and leave), the rewrite (equal all-to-alls
over the ep group, each rank holding its experts' slice), the refusals, the planner's
pricing; parity under ep with ZeRO-3, tp and pp (slow)."""
import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.compiler.capture import capture
from fxpar.core import ir
from fxpar.core.errors import PlanError
from fxpar.examples import zoo
from fxpar.passes import expert_parallel

import workers
from test_parity import _check_plans

c10d = torch.ops._c10d_functional


def _every_token():
    model, batch_fn, loss_fn = workers.build("every_token_moe")
    return model, batch_fn(0), loss_fn


def _a2a(graph, group=ir.GROUPS["ep"]):
    return [n for n in graph.nodes
            if n.target is c10d.all_to_all_single.default and n.args[3] == group]


def test_the_layer_its_tokens_and_weights_are_found():
    """One layer: two readers forward (`routed @ W_in`, `W_out @ h^T`, the tokens on dim 1
    and 2), their input gradients, the two weight gradients summing over the tokens; the
    tokens enter as the routed inputs and the output's gradient, and leave as the output
    and the routed inputs' gradient."""
    model, batch, loss_fn = _every_token()
    gm, _ = capture(model, batch, loss_fn)
    [layer] = expert_parallel.find_dense_layers(gm)
    assert (layer.experts, layer.tokens) == (4, 8 * 16)
    assert [w.meta[ir.FQN] for w in layer.weights] == ["w_in", "w_out"]
    sums = [m for m in layer.matmuls if layer.region[m] is None]
    assert len(layer.matmuls) == 6 and len(sums) == 2
    regions = {n: n.meta[ir.REGION] for n in layer.matmuls}
    assert sorted(regions.values()) == [ir.BACKWARD] * 4 + [ir.FORWARD] * 2
    assert sorted((x.meta[ir.REGION], d) for x, d in layer.entering) == [
        (ir.BACKWARD, 2), (ir.FORWARD, 1)]
    assert sorted((y.meta[ir.REGION], r) for y, r in layer.leaving) == [
        (ir.BACKWARD, 1), (ir.FORWARD, 2)]


def test_one_stacked_expert_is_not_a_layer_to_split():
    """A stack of one expert run on every token (Inkling's one shared expert beside its
    routed ones) has nothing to split: it stays a weight like any other, and the routed
    experts still split over ep."""
    model = workers.EveryTokenMoE(experts=1)
    gm, _ = capture(model, {"ids": torch.randint(0, 32, (8, 16)),
                            "labels": torch.randint(0, 32, (8, 16))}, workers.capacity_loss)
    assert expert_parallel.find_dense_layers(gm) == []


def test_llama4_every_expert_on_every_token_is_a_layer_per_block():
    llama4, spec = zoo.build("llama4")
    gm, _ = capture(llama4, spec.batch(0), None)
    layers = expert_parallel.find_dense_layers(gm)
    assert [(x.module, x.experts, len(x.matmuls), len(x.entering), len(x.leaving))
            for x in layers] == [(f"model.layers.{i}.feed_forward.experts", 4, 6, 2, 2)
                                 for i in range(2)]
    assert [w.meta[ir.FQN] for w in layers[0].weights] == [
        "model.layers.0.feed_forward.experts.gate_up_proj",
        "model.layers.0.feed_forward.experts.down_proj"]


def test_each_rank_holds_its_experts_and_the_tokens_move_by_equal_all_to_alls():
    """dp=2 x ep=2: the weights are each rank's 2 of 4 experts; each value entering the
    layer goes to the experts' ranks, each leaving one comes back: 4 all-to-alls of parts
    sized by the graph (no count exchanged, no rows marked dynamic), and the data-parallel
    pass keeps the tokens between them split (each rank's own)."""
    model, batch, loss_fn = _every_token()
    prog = fxpar.compile(model, 2, example_batch=batch, loss_fn=loss_fn,
                         plan={"dp": 2, "ep": 2})
    [rep] = prog.graph.meta[ir.EP_REPORT]
    assert (rep["per_rank"], rep["dispatch"], rep["entering"], rep["leaving"]) == (
        2, "all-to-all, every token", 2, 2)
    a2a = _a2a(prog.graph.graph)
    assert len(a2a) == 4 and all(n.args[1] == n.args[2] for n in a2a)
    assert sorted(n.meta[ir.EP_TOKENS][1] for n in a2a) == ["return"] * 2 + ["send"] * 2
    assert not any(n.meta.get(ir.DYNAMIC_ROWS) for n in prog.graph.graph.nodes)
    assert not any(n.target is torch.ops.fxpar.ep_route.default for n in prog.graph.graph.nodes)
    params = {p.meta[ir.FQN]: tuple(p.meta[ir.VAL].shape) for p in prog.graph.graph.nodes
              if p.op == "placeholder" and p.meta.get(ir.ROLE) == "param"}
    assert params["w_in"] == (2, 16, 32) and params["w_out"] == (2, 16, 32)
    tokens = 8 * 16 // 2  # (this rank's)
    for n in a2a:  # each sends this rank's tokens of the 4 experts ([E, d, T] / [ep, E/ep, ..])
        d, _ = n.meta[ir.EP_TOKENS]
        assert n.meta[ir.VAL].shape[d] == tokens and n.meta[ir.SHARD] == (
            torch.distributed.tensor.Shard(d),)


def test_a_recomputed_layer_is_split_too():
    """Under remat the backward's recomputed copy of the forward is a layer of its own,
    reading the same weights: both are rewritten, the weights split once."""
    model, batch, loss_fn = _every_token()
    prog = fxpar.compile(model, 2, example_batch=batch, loss_fn=loss_fn,
                         plan={"dp": 2, "ep": 2, "remat": "sqrt"})
    report = prog.graph.meta[ir.EP_REPORT]
    assert [r["module"] for r in report] == ["w_in, w_out"] * 2
    # (the forward's: its input in, its output out; the recomputed copy's and the
    # backward's: the input again and the output's gradient in, the input's gradient out)
    assert sorted((r["entering"], r["leaving"]) for r in report) == [(1, 1), (2, 1)]
    assert all(p.meta[ir.VAL].shape[0] == 2 for p in prog.graph.graph.nodes
               if p.op == "placeholder" and p.meta.get(ir.FQN) in ("w_in", "w_out"))


def test_a_stage_boundary_inside_the_layer_is_refused():
    """A pipeline transfer is sized by the graph's values, which ep resizes inside the
    layer: a stage cut there (moved by hand: pipeline_split cuts between blocks) is refused
    by name."""
    from fxpar.compiler.pass_manager import PassContext
    model, batch, loss_fn = _every_token()
    gm, sig = capture(model, batch, loss_fn)
    [layer] = expert_parallel.find_dense_layers(gm)
    for n in gm.graph.nodes:
        n.meta[ir.STAGE] = 0
    layer.matmuls[1].meta[ir.STAGE] = 1
    ctx = PassContext(signature=sig, group_names=dict(ir.GROUPS))
    with pytest.raises(PlanError, match="stage boundary falls inside the MoE layer "
                                        "'w_in, w_out'"):
        expert_parallel.run(gm, expert_parallel.Options(ep=2, dp=2), ctx)


def test_an_op_mixing_the_experts_or_a_weight_read_elsewhere_is_refused():
    """A value made from every expert's (a mean over them) re-entering the layer, or an
    expert weight also read by a regulariser, cannot be split over ep ranks."""
    model, batch, loss_fn = _every_token()

    def mixing(ids):  # (every expert's hidden values scaled by their mean over the experts)
        x = model.emb(ids).flatten(0, 1)
        routed = x.unsqueeze(0) * model.gate(x).softmax(-1).t().unsqueeze(-1)
        h = torch.bmm(routed, model.w_in)
        h = F.gelu(h) * torch.sigmoid(h.mean(0, keepdim=True))
        return model.head(x + torch.bmm(model.w_out, h.transpose(1, 2)).sum(0).t())
    model.forward = mixing
    with pytest.raises(PlanError, match="sigmoid.* enters the MoE layer 'w_in, w_out'.* as "
                       "\\[1, 128, 32\\], not \\[4 experts"):
        fxpar.compile(model, 2, example_batch=batch, loss_fn=loss_fn,
                      plan={"dp": 2, "ep": 2})
    model, batch, loss_fn = _every_token()

    def regularised(m, b):
        return loss_fn(m, b) + 1e-3 * m.w_in.pow(2).sum()
    with pytest.raises(PlanError, match="w_in of .* is also read by .* not only as"):
        fxpar.compile(model, 2, example_batch=batch, loss_fn=regularised,
                      plan={"dp": 2, "ep": 2})


def test_tensor_parallelism_splits_each_expert_inside_its_ep_rank():
    """Llama 4 at dp=2 x ep=2 x tp=2: the tp pass splits the batched matmuls' stacks as
    each expert's linears (gate_up by its output features, gate and up interleaved; down by
    its input features), and ep splits their experts on top."""
    llama4, spec = zoo.build("llama4")
    prog = fxpar.compile(llama4, 4, example_batch=spec.batch(0),
                         plan={"dp": 2, "ep": 2, "tp": 2})
    rep = prog.graph.meta[ir.TP_REPORT]
    experts = [f"model.layers.{i}.feed_forward.experts" for i in range(2)]
    assert [w for w in rep.column if ".experts." in w] == [f"{e}.gate_up_proj" for e in experts]
    assert [w for w in rep.row if ".experts." in w] == [f"{e}.down_proj" for e in experts]
    assert {w: k for w, k in rep.interleaved.items() if ".experts." in w} == {
        f"{e}.gate_up_proj": 2 for e in experts}
    assert [(r["module"], r["per_rank"]) for r in prog.graph.meta[ir.EP_REPORT]] == [
        (e, 2) for e in experts]
    shapes = {p.meta[ir.FQN]: tuple(p.meta[ir.VAL].shape) for p in prog.graph.graph.nodes
              if p.op == "placeholder" and p.meta.get(ir.ROLE) == "param"}
    assert shapes[f"{experts[0]}.gate_up_proj"] == (2, 32, 64)  # ([4, 32, 128] split)
    assert shapes[f"{experts[0]}.down_proj"] == (2, 32, 32)  # ([4, 64, 32])


def test_the_planner_prices_expert_parallelism_for_them():
    """The planner finds the layers (two MoE layers, 4 experts each): ep=2 is searched, its
    expert weights half a rank's, the tokens' all-to-alls priced."""
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    llama4, spec = zoo.build("llama4")
    stats = planner_stats(llama4, spec.batch(0), None, "cpu", {})
    assert stats.ep_refusal is None and stats.expert_counts == (4, 4) and stats.moe_local
    assert sum(s.ep_comm_f for s in stats.segments) > 0
    res = planner.auto_plan(stats, None, 2, "cpu", constraints={"dp": 2, "ep": 2})
    assert res.best.plan.ep == 2


@pytest.mark.slow
def test_every_token_experts_train_like_eager_under_plans():
    """Llama 4 and the hand-written soft MoE against eager (evaluate() too): ep=2 carved out
    of dp=4 with ZeRO-3, ep x tp (each expert tp-split on its rank), and ep on each stage of
    a pipeline of 2."""
    _check_plans(4, [("every_token_moe", "adamw", {"dp": 4, "ep": 2, "zero": 3}),
                     ("llama4", "adamw", {"dp": 4, "ep": 2, "zero": 3}),
                     ("llama4", "adamw", {"dp": 2, "ep": 2, "tp": 2}),
                     ("llama4", "adamw", {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2})])

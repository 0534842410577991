"""passes/grouped_experts: experts kept as an nn.ModuleList and routed by torch.where run once
over the rows sorted by expert (grouped matmuls) instead of each over every routed position.
The transformation on small graphs (which matmuls became grouped, what was left and why),
each against the padded graph as traced and eager; parity under plans in test_pipeline,
test_tensor_parallel and the zoo tables (where_moe, litgpt's Mixtral)."""
import pytest
import torch
from torch import nn

from fxpar.compiler.capture import _as_scalar_loss, capture, default_loss_fn
from fxpar.core import cost, ir
from fxpar.examples.zoo import HIDDEN, VOCAB, HitLoopMoE, StackedLoopMoE, WhereRoutedMoE, \
    tokens_batch
from fxpar.passes import grouped_experts

aten = torch.ops.aten


class ComparedMoE(WhereRoutedMoE):
    """where_moe with the masks made as litgpt makes them: one comparison of the top-k ids
    with an arange of experts, its expert dim moved first and unbound."""

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        weights, indices = self.gate(x).softmax(-1).topk(self.k, -1)
        masks = indices.unsqueeze(-1) == torch.arange(len(self.experts))
        y = torch.zeros_like(x)
        for mask, expert in zip(masks.permute(2, 0, 1), self.experts):
            idx, top = torch.where(mask)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        h = self.norm(x + y).view(*ids.shape, -1)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class OneHotMoE(WhereRoutedMoE):
    """The older Hugging Face Mixtral block: one-hot masks with the experts first, each
    expert's rows gathered by token and added back with index_add_."""

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        weights, selected = self.gate(x).softmax(-1).topk(self.k, -1)
        y = torch.zeros_like(x)
        expert_mask = nn.functional.one_hot(selected, len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            idx, top_x = torch.where(expert_mask[e])
            rows = x[None, top_x].reshape(-1, x.shape[-1])
            y.index_add_(0, top_x, expert(rows) * weights[top_x, idx, None])
        h = self.norm(x + y).view(*ids.shape, -1)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class DenseScoreMoE(WhereRoutedMoE):
    """Top-1 routing weighted by each expert's own column of the scores: the rows entering
    each expert's backward are gathered from a different tensor per expert."""

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        scores = self.gate(x).softmax(-1)
        top = scores.argmax(-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            (idx,) = torch.where(top == i)
            y[idx] += expert(x[idx]) * scores[idx, i, None]
        h = self.norm(x + y).view(*ids.shape, -1)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class ThresholdMoE(WhereRoutedMoE):
    """Each expert takes the tokens whose gate score passes a threshold: a token may go to
    several experts or none, so the masks do not partition the positions."""

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        scores = self.gate(x).softmax(-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            (idx,) = torch.where(scores[:, i] > 0.2)
            y[idx] += expert(x[idx]) * scores[idx, i, None]
        h = self.norm(x + y).view(*ids.shape, -1)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _args(model, sig, batch):
    """The captured graph's inputs: the model's parameters and buffers, the batch's tensors."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    leaves = [x for x in torch.utils._pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    return [params[n].detach() for n in sig.param_names] + \
        [buffers[n] for n in sig.buffer_names] + leaves


def _grouped(model, batch=None, loss_fn=None, pass_=grouped_experts, ctx=None):
    """(the traced graph's outputs, `pass_`'s graph, its outputs, the traced FLOPs, eager
    loss and grads)."""
    batch = batch or tokens_batch(0)
    gm, sig = capture(model, batch, loss_fn)
    args = _args(model, sig, batch)
    with torch.no_grad():
        padded = gm(*args)
    flops = sum(cost.node_flops(n) for n in gm.graph.nodes)
    gm = pass_.run(gm, pass_.Options(), ctx)
    with torch.no_grad():
        out = gm(*args)
    model.zero_grad()
    loss = _as_scalar_loss((loss_fn or default_loss_fn)(model, batch))
    loss.backward()
    grads = [p.grad for p in (dict(model.named_parameters())[n] for n in sig.param_names)]
    return padded, gm, out, flops, (loss, grads)


def _assert_close(out, ref, eager):
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0], eager[0], rtol=1e-6, atol=1e-6)
    for got, want, g in zip(out[1:], ref[1:], eager[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, torch.zeros_like(got) if g is None else g,
                                   rtol=1e-5, atol=1e-6)


def _matmuls(gm):
    return [n for n in gm.graph.nodes if n.target in (
        aten.mm.default, aten.addmm.default, aten._grouped_mm.default)]


@pytest.mark.parametrize("cls", [WhereRoutedMoE, ComparedMoE, OneHotMoE, HitLoopMoE],
                         ids=["eq", "arange", "one_hot", "hit_loop"])
def test_listed_experts_run_grouped_and_exact(cls):
    """Each expert's two linears, forward, input-gradient and weight-gradient, become one
    grouped matmul each over the sorted rows (6 for 4 experts, where 24 ran), the biases
    read per row; eager's loss and gradients, a quarter of the expert FLOPs."""
    torch.manual_seed(0)
    model = cls()
    padded, gm, out, flops, eager = _grouped(model)
    assert gm.meta[ir.GROUPED_EXPERTS] == [
        {"module": "experts", "experts": 4, "rows": 2 * tokens_batch(0)[0].numel(),
         "grouped": True, "why": None}]
    grouped = [n for n in gm.graph.nodes if n.target is aten._grouped_mm.default]
    assert len(grouped) == 6
    assert sum(n.meta[ir.REGION] == ir.FORWARD for n in grouped) == 2
    weight_grads = [n for n in grouped if n.meta[ir.VAL].dim() == 3]
    assert sorted(tuple(n.meta[ir.VAL].shape) for n in weight_grads) == [
        (4, HIDDEN, 2 * HIDDEN), (4, 2 * HIDDEN, HIDDEN)]
    # no matmul over the routed positions (tokens x k rows) is left: the rest are the
    # gate's and the head's, over the tokens
    rows, d = 2 * tokens_batch(0)[0].numel(), HIDDEN
    assert not [n for n in _matmuls(gm) if n.target is not aten._grouped_mm.default and any(
        rows in a.meta[ir.VAL].shape for a in n.args if isinstance(a, torch.fx.Node))]
    expert_flops = 2 * 3 * 2 * rows * d * 2 * d  # two linears, three matmuls each, 2 x MACs
    assert flops - sum(cost.node_flops(n) for n in gm.graph.nodes) == \
        pytest.approx(3 * expert_flops, rel=0.01)
    _assert_close(out, padded, eager)


def test_stacked_experts_run_grouped_reading_the_stack_itself():
    """Hugging Face's eager experts: each projection a parameter [experts, out, in] a loop
    reads expert by expert. Each linear's forward, input gradient and weight gradient become
    one grouped matmul (6), reading the parameter through a transpose (no stacked copy, no
    select left); each parameter's gradient is the weight gradient's grouped matmul itself
    (not a sum of one full-size tensor per expert); a quarter of the expert FLOPs."""
    torch.manual_seed(0)
    model = StackedLoopMoE()
    padded, gm, out, flops, eager = _grouped(model)
    rows = 2 * tokens_batch(0)[0].numel()
    assert gm.meta[ir.GROUPED_EXPERTS] == [
        {"module": "experts", "experts": 4, "rows": rows, "grouped": True, "why": None}]
    grouped = [n for n in gm.graph.nodes if n.target is aten._grouped_mm.default]
    assert len(grouped) == 6
    params = {n.meta[ir.FQN]: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        readers, todo = set(), [params[name]]
        while todo:  # (what reads the parameter, up to the grouped matmuls)
            for u in todo.pop().users:
                readers.add(u.target)
                if u.target is not aten._grouped_mm.default:
                    todo.append(u)
        assert readers == {aten.transpose.int, aten._grouped_mm.default}
    assert not any(n.target is aten.select_backward.default or (
        n.target is aten.stack.default and not n.args[1:]) for n in gm.graph.nodes)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for g in out_node.args[0][1:1 + len(params)]:
        while isinstance(g, torch.fx.Node) and g.target in ir.RESHAPES | {aten.transpose.int}:
            g = g.args[0]
        if isinstance(g, torch.fx.Node) and g.meta[ir.VAL].dim() == 3:
            assert g.target is aten._grouped_mm.default
    d = HIDDEN  # (gate/up: d -> 4d, down: 2d -> d; three matmuls each, 2 x MACs)
    expert_flops = 2 * 3 * rows * (4 * d * d + 2 * d * d)
    assert flops - sum(cost.node_flops(n) for n in gm.graph.nodes) == \
        pytest.approx(3 * expert_flops, rel=0.01)
    _assert_close(out, padded, eager)


class ChainedStackedExperts(StackedLoopMoE):
    """Each expert reads the sum so far (the experts before it): not side by side, so not
    a list to group: they run as traced, exact."""

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        weights, indices = self.gate(x).softmax(-1).topk(self.k, -1)
        w, y = self.experts, torch.zeros_like(x)
        mask = nn.functional.one_hot(indices, len(w.gate_up_proj)).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = e[0]
            top, idx = torch.where(mask[e])
            gate, up = nn.functional.linear((x + y)[idx], w.gate_up_proj[e]).chunk(2, dim=-1)
            h = nn.functional.linear(nn.functional.silu(gate) * up, w.down_proj[e])
            y = y.index_add(0, idx, h * weights[idx, top, None])
        h = self.norm(x + y).view(*ids.shape, -1)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def test_stacked_experts_reading_each_others_rows_are_not_grouped():
    from fxpar.core.expert_lists import find_expert_lists
    torch.manual_seed(0)
    padded, gm, out, flops, eager = _grouped(ChainedStackedExperts())
    assert not any(n.target is aten._grouped_mm.default for n in gm.graph.nodes)
    skipped = []
    assert find_expert_lists(gm, skipped) == []
    assert any("computed from another expert's rows" in s for s in skipped)
    _assert_close(out, padded, eager)


def test_rows_each_expert_gathers_differently_are_picked_per_expert():
    """DenseScoreMoE's experts gather their backward's rows from their own score column:
    one gather for all would read expert 0's; each expert's rows are picked per position
    instead (where), and the gradients are eager's."""
    torch.manual_seed(0)
    padded, gm, out, _, eager = _grouped(DenseScoreMoE())
    assert gm.meta[ir.GROUPED_EXPERTS][0]["grouped"]
    assert any(n.target is aten.where.self and n.meta[ir.REGION] == ir.BACKWARD
               for n in gm.graph.nodes)
    _assert_close(out, padded, eager)


def test_an_expert_no_token_picks_is_exact_grouped():
    """Experts 2 and 3 get no rows (empty groups): zero gradients, as eager gives none."""
    torch.manual_seed(0)
    model = WhereRoutedMoE()
    model.gate = nn.Linear(model.gate.in_features, 4)
    with torch.no_grad():
        model.gate.weight.zero_()
        model.gate.bias.copy_(torch.tensor([5.0, 4.0, 0.0, 0.0]))
    padded, gm, out, _, eager = _grouped(model)
    assert gm.meta[ir.GROUPED_EXPERTS][0]["grouped"]
    _assert_close(out, padded, eager)


def test_masks_that_do_not_partition_the_positions_are_left_padded():
    """A token may pass several experts' thresholds: grouping by one expert per position
    would drop rows, so the experts stay as traced (padded, exact), and the reason is kept."""
    torch.manual_seed(0)
    model = ThresholdMoE()
    padded, gm, out, flops, eager = _grouped(model)
    (report,) = gm.meta[ir.GROUPED_EXPERTS]
    assert not report["grouped"] and "comparison" in report["why"]
    assert not any(n.target is aten._grouped_mm.default for n in gm.graph.nodes)
    assert sum(cost.node_flops(n) for n in gm.graph.nodes) == flops
    _assert_close(out, padded, eager)


def test_feature_sizes_a_grouped_matmul_cannot_take_are_left_padded():
    """aten._grouped_mm needs 16-byte strides: 6 features are 12 bytes in bf16 (to which
    Plan.precision may cast them after the pass)."""
    torch.manual_seed(0)
    model = WhereRoutedMoE()
    model.experts = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 6), nn.GELU(),
                                                nn.Linear(6, HIDDEN)) for _ in range(4))
    padded, gm, out, _, eager = _grouped(model)
    (report,) = gm.meta[ir.GROUPED_EXPERTS]
    assert not report["grouped"] and "multiples of 8" in report["why"]
    _assert_close(out, padded, eager)


def test_on_cuda_the_experts_are_grouped_in_bf16_only():
    """torch runs a grouped matmul of fp32 operands on CUDA group by group from the host (no
    CUDA graph): there the experts stay as traced, and say why."""
    import types
    gm, _ = capture(WhereRoutedMoE(), tokens_batch(0))
    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    out = grouped_experts.run(gm, grouped_experts.Options(precision="fp32"), cuda)
    assert out is gm and "bf16 only" in gm.meta[ir.GROUPED_EXPERTS][0]["why"]
    assert not any(n.target is aten._grouped_mm.default for n in gm.graph.nodes)


def test_a_model_without_listed_experts_is_untouched():
    """A stack of layers in a ModuleList is not a list of experts: the graph is unchanged."""
    model = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), *[nn.Linear(HIDDEN, HIDDEN)
                                                          for _ in range(3)])
    batch = (torch.randint(0, VOCAB, (4, 8)),)
    gm, _ = capture(model, batch, lambda m, b: m(b[0]).pow(2).mean())
    before = [n.target for n in gm.graph.nodes]
    gm = grouped_experts.run(gm, grouped_experts.Options(), None)
    assert [n.target for n in gm.graph.nodes] == before
    assert gm.meta[ir.GROUPED_EXPERTS] == []


def test_the_planner_prices_grouped_experts_at_ep1():
    """Statistics of where_moe: the experts' traced FLOPs, of which grouping saves 3/4 (4
    experts) at ep=1, and the bytes it moves doing so (the weights stacked forward and
    backward, the rows gathered in expert order and put back); the planner's step
    prediction is that much compute shorter and those bytes' time longer, at ep=2 too (the
    experts grouped, their rows sent by all-to-all); on a GPU below bf16 neither."""
    import dataclasses
    from fxpar.compiler import planner
    from fxpar.compiler.compile import planner_stats
    from fxpar.core import cost
    torch.manual_seed(0)
    stats = planner_stats(WhereRoutedMoE(dim=256), tokens_batch(0))
    seg = next(s for s in stats.segments if s.expert_flops_f)
    assert seg.grouped_saved_f == pytest.approx(0.75 * seg.expert_flops_f)
    assert seg.grouped_saved_b == pytest.approx(0.75 * seg.expert_flops_b)
    model = WhereRoutedMoE(dim=256)
    weights = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("experts"))
    assert seg.grouped_stack_bytes == 2 * weights  # (each stack read and written)
    assert seg.grouped_bytes_f > 0 and seg.grouped_bytes_b > 0
    hw = cost.HARDWARE["h100"]

    def step(stats, ep, precision="bf16"):  # (on CUDA the experts are grouped in bf16)
        return planner.search(stats, 2, hw, batch_rows=8, executable=False,
                              precision=precision, constraints={
                                  "dp": 2, "tp": 1, "pp": 1, "microbatches": 1, "zero": 0,
                                  "ep": ep}).best.step_s
    traced = dataclasses.replace(stats, segments=[
        dataclasses.replace(s, grouped_saved_f=0.0, grouped_saved_b=0.0, grouped_bytes_f=0.0,
                            grouped_bytes_b=0.0, grouped_stack_bytes=0.0)
        for s in stats.segments])
    # (shorter by up to the saved FLOPs' time less the moved bytes': part of the backward
    # hides the gradients' all-reduce)
    saved = sum(s.grouped_saved_f + s.grouped_saved_b for s in stats.segments)
    rate = hw.flops("bf16") * hw.matmul_efficiency / hw.roofline_scale
    free = dataclasses.replace(stats, segments=[  # (grouping's moves priced at no cost)
        dataclasses.replace(s, grouped_bytes_f=0.0, grouped_bytes_b=0.0, grouped_stack_bytes=0.0)
        for s in stats.segments])
    assert 0 < step(traced, 1) - step(free, 1) <= saved / rate * 1.001
    # (at these 128 tokens the moves cost about what the FLOPs save on an H100)
    assert step(free, 1) < step(stats, 1) and step(free, 2) < step(stats, 2)
    assert step(free, 2) < step(traced, 2)
    assert step(traced, 1, "fp32") == step(stats, 1, "fp32")


@pytest.mark.slow
def test_grouped_experts_train_like_eager_under_plans():
    """where_moe, litgpt's Mixtral and stacked_loop_moe (HF's eager experts), experts
    grouped, trained against eager (evaluate()
    too): dp with ZeRO-3, remat and microbatches (each microbatch sorts its own positions),
    a pipeline, context parallelism (the sort over every position of the split sequence),
    and tp (each stack's experts split alike by the tp pass)."""
    from test_parity import _check_plans
    plans = [{"dp": 2, "zero": 3, "remat": "sqrt", "microbatches": 2},
             {"pp": 2, "microbatches": 2}, {"tp": 2}]
    _check_plans(2, [(name, "adamw", plan) for name in ("where_moe", "litgpt_mixtral",
                                                         "stacked_loop_moe")
                     for plan in plans] + [("litgpt_mixtral", "adamw", {"dp": 2, "cp": 2})])


def test_the_planner_prices_stacked_experts_split_by_tp_as_grouped():
    """stacked_loop_moe (HF's eager experts): no linear reads its stacks in the traced form
    (a select per expert), but the grouped form tp splits them (gate_up by columns, down by
    rows): the planner's tp roles are decided on that form, so every expert FLOP is priced
    split under tp, as it runs."""
    from fxpar.compiler.compile import planner_stats
    from fxpar.examples import zoo
    model, spec = zoo.build("stacked_loop_moe")
    stats = planner_stats(model, spec.batch(0))
    experts = {k: r for k, r in stats.tp_roles.items() if k.startswith("experts.")}
    assert experts and set(experts.values()) == {"column", "row"}
    segs = [s for s in stats.segments if s.expert_flops_f]
    assert segs and all(s.expert_flops_f_split == s.expert_flops_f and
                        s.expert_flops_b_split == s.expert_flops_b for s in segs)


def test_grouping_under_tp_saves_one_tp_th_where_tp_splits_the_experts():
    """planner._grouped: under tp each rank's stacks hold 1/tp of every expert where tp splits
    their linears, so grouping saves 1/tp of the traced FLOPs it saves at tp = 1 (and moves
    1/tp of the stacks); the rows it gathers are whole on every tp rank."""
    from fxpar.compiler import planner
    from fxpar.compiler.graphstats import Segment
    seg = Segment(name="h.0", grouped_saved_f=8e9, grouped_saved_b=16e9, grouped_bytes_f=1e6,
                  grouped_bytes_b=2e6, grouped_stack_bytes=4e6, expert_flops_f_split=1e9)
    whole = Segment(**{**seg.__dict__, "expert_flops_f_split": 0.0})
    rate, bw = 1e12, 1e11

    def saved(s, tp):
        tf, tb = planner._grouped([s], 1.0, 1.0, 1.0, rate, bw, 1, "grouped_saved", tp)
        return 2.0 - tf - tb
    moved = (1e6 + 2e6) / bw
    assert saved(seg, 1) == pytest.approx(24e9 / rate - moved - 2 * 4e6 / bw)
    assert saved(seg, 2) == pytest.approx(12e9 / rate - moved - 2 * 2e6 / bw)
    assert saved(whole, 2) == pytest.approx(saved(seg, 1))  # (experts whole on each rank)

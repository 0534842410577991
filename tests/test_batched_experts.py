"""passes/batched_experts: experts that pick a copy of their weights for every row
(`bmm(W[ids], x)`: Hugging Face's 'batched_mm' experts) run as grouped matmuls over the rows
sorted by expert. The transformation on small graphs (which products became grouped, the
sorts left, what was refused and why), each against the graph as traced and eager; the
planner pricing them as they run; parity under dp, ep, tp, ZeRO and pp (slow)."""
import re

import pytest
import torch
from torch import nn

import fxpar
from fxpar.compiler.capture import capture
from fxpar.core import cost, ir
from fxpar.core.errors import PlanError
from fxpar.examples import zoo
from fxpar.examples.zoo import tokens_batch
from fxpar.passes import batched_experts

import workers
from test_grouped_experts import _assert_close, _grouped as _run
from test_parity import _check_plans

aten = torch.ops.aten


class PickedMoE(nn.Module):
    """An MoE written as Hugging Face's batched_mm experts are, by other hands: each of the
    (token, k) rows multiplies its expert's matrices picked by index, the second through a
    transpose, as a row vector (`v @ W[ids]^T`)."""

    def __init__(self, dim=16, hidden=32, experts=4, k=2, vocab=zoo.VOCAB):
        super().__init__()
        self.k = k
        self.emb = nn.Embedding(vocab, dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, dim, hidden) / hidden ** 0.5)
        self.head = nn.Linear(dim, vocab)

    def forward(self, batch):
        ids, targets = batch
        x = self.emb(ids).flatten(0, 1)
        weights, picks = self.gate(x).softmax(-1).topk(self.k, -1)
        rows, e = x.repeat_interleave(self.k, 0), picks.reshape(-1)
        h = torch.bmm(self.w_in[e], rows.unsqueeze(-1)).squeeze(-1).relu()
        y = torch.bmm(h.unsqueeze(1), self.w_out[e].transpose(1, 2)).squeeze(1)
        y = (y * weights.reshape(-1, 1)).view(-1, self.k, x.shape[-1]).sum(1)
        return nn.functional.cross_entropy(self.head(x + y), targets.flatten())


def _grouped(model, batch, loss_fn=None):
    return _run(model, batch, loss_fn, pass_=batched_experts)


def _count(gm, target):
    return sum(n.target is target for n in gm.graph.nodes)


def _picked_copies(gm):
    """The nodes holding a copy of an expert matrix per row ([rows, a, b] picks by index)."""
    return [n for n in gm.graph.nodes if n.target is aten.index.Tensor and
            n.meta[ir.VAL].dim() == 3]


def test_picked_experts_run_grouped_and_exact():
    """Each product (forward, input gradient) and each weight gradient (index_put of one
    outer product a row) becomes one grouped matmul reading the parameter itself: 6 for two
    projections, no copy of an expert matrix per row left; the rows are sorted once each way
    (entering, and the gradient entering the backward) and put back once each way: 4
    index_selects; the same FLOPs; eager's loss and gradients."""
    torch.manual_seed(0)
    model = PickedMoE()
    batch = tokens_batch(0)
    traced, gm, out, flops, eager = _grouped(model, batch)
    rows = 2 * batch[0].numel()
    assert gm.meta[ir.BATCHED_EXPERTS] == [
        {"module": "", "experts": 4, "rows": rows, "grouped": True, "why": None}]
    assert not _picked_copies(gm) and _count(gm, aten.bmm.default) == 0
    assert not [n for n in gm.graph.nodes if n.target is aten.index_put.default]
    grouped = [n for n in gm.graph.nodes if n.target is aten._grouped_mm.default]
    assert len(grouped) == 6 and sum(n.meta[ir.REGION] == ir.FORWARD for n in grouped) == 2
    assert sorted(tuple(n.meta[ir.VAL].shape) for n in grouped if n.meta[ir.VAL].dim() == 3) \
        == [(4, 16, 32), (4, 32, 16)]
    assert all(n.args[1].op == "placeholder" or n.args[1].args[0].op == "placeholder"
               for n in grouped if n.meta[ir.VAL].dim() == 2)  # (W itself, or W^T)
    assert _count(gm, aten.index_select.default) == 4
    assert not [n for n in gm.graph.nodes if n.meta.get(ir.REGION) == ir.FORWARD and any(
        a.meta.get(ir.REGION) == ir.BACKWARD for a in n.all_input_nodes)]  # (sorts in the
    # region of the value they sort: the forward reads no backward node)
    assert sum(cost.node_flops(n) for n in gm.graph.nodes) == pytest.approx(flops, rel=0.02)
    _assert_close(out, traced, eager)


@pytest.mark.parametrize("name", ["mixtral", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_hugging_face_batched_mm_experts_run_grouped_and_exact(name):
    """Hugging Face's batched_mm experts (Mixtral: gate and up fused, weights [E, out, in];
    GPT-OSS: transposed weights [E, in, out], biases picked per row, gate and up
    interleaved): every layer grouped, 6 grouped matmuls each, no per-row copy of a matrix
    left (GPT-OSS's biases are still picked per row, as in the grouped form), the values of
    the batched graph and of eager."""
    torch.manual_seed(0)
    model, spec = zoo.build(name)
    model.config._experts_implementation = "batched_mm"
    batch = spec.batch(0)
    traced, gm, out, _, eager = _grouped(model, batch, spec.loss_fn)
    layers = model.config.num_hidden_layers
    assert [r["grouped"] for r in gm.meta[ir.BATCHED_EXPERTS]] == [True] * layers
    assert not _picked_copies(gm)
    assert _count(gm, aten._grouped_mm.default) == 6 * layers
    with torch.no_grad():  # (the loss: eager's is the model's own forward)
        torch.testing.assert_close(out[0], traced[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(out[1:], traced[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class ReadElsewhere(PickedMoE):
    """The picked copies also read by the loss (a regulariser of the rows' matrices)."""

    def forward(self, batch):
        ids, _ = batch
        e = self.gate(self.emb(ids).flatten(0, 1)).argmax(-1)
        return super().forward(batch) + 1e-3 * self.w_in[e].pow(2).mean()


class Narrow(PickedMoE):
    def __init__(self):
        super().__init__(hidden=6)


def test_picks_that_cannot_run_grouped_are_left_as_traced_with_the_reason():
    """A picked copy read other than by a matrix-vector product, feature sizes a grouped
    matmul cannot take (6: 24 bytes), and on CUDA a precision other than bf16 leave the
    layer as traced, each reason kept; under ep the refusal names it."""
    torch.manual_seed(0)
    batch = tokens_batch(0)
    for model, why in ((ReadElsewhere(), "reads the weights .* picks per row, not as a "
                        "batched matrix-vector product"),
                       (Narrow(), "multiples of 8")):
        gm, _ = capture(model, batch)
        gm = batched_experts.run(gm, batched_experts.Options(), None)
        (report,) = [r for r in gm.meta[ir.BATCHED_EXPERTS] if not r["grouped"]]
        assert re.search(why, report["why"]), report["why"]
        assert len(_picked_copies(gm)) == 1 + isinstance(model, Narrow)
    gm, _ = capture(PickedMoE(), batch)
    before = [n.target for n in gm.graph.nodes]
    cuda = type("Ctx", (), {"device": torch.device("cuda")})
    gm = batched_experts.run(gm, batched_experts.Options("fp32"), cuda)
    assert [n.target for n in gm.graph.nodes] == before
    assert "bf16 only" in gm.meta[ir.BATCHED_EXPERTS][0]["why"]
    with pytest.raises(PlanError, match="per row left as traced: '': .*multiples of 8"):
        fxpar.compile(Narrow(), 2, example_batch=batch, plan={"dp": 2, "ep": 2})


def test_a_failed_rewrite_leaves_the_graph_as_traced(monkeypatch, caplog):
    """fxpar's own rewrite raising (a bug) leaves the captured graph whole and runnable, the
    experts picked per row as traced, with a warning and the error as the reason."""
    gm, _ = capture(PickedMoE(), tokens_batch(0))
    before = [n.target for n in gm.graph.nodes]

    def broken(*a):
        raise RuntimeError("a bug")
    monkeypatch.setattr(batched_experts, "_fold", broken)
    out = batched_experts.run(gm, batched_experts.Options(), None)
    assert out is gm and [n.target for n in gm.graph.nodes] == before
    assert gm.meta[ir.BATCHED_EXPERTS][0]["why"] == "RuntimeError: a bug"
    assert "grouping the experts failed" in caplog.text


def test_a_model_without_picked_experts_is_untouched():
    """An embedding gathers rows of a 2-D table; a 3-D parameter indexed by a constant
    picks no rows: nothing to group."""
    class Tables(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.stack = nn.Embedding(8, 4), nn.Parameter(torch.randn(3, 4, 4))

        def forward(self, ids):
            return (self.emb(ids) @ self.stack[1]).pow(2).mean()
    gm, _ = capture(Tables(), torch.arange(8))
    assert not batched_experts.find(gm)
    gm = batched_experts.run(gm, batched_experts.Options(), None)
    assert gm.meta[ir.BATCHED_EXPERTS] == []


@pytest.mark.slow  # (two captures and plannings of Mixtral: make test's 6 minutes)
def test_the_planner_prices_picked_experts_as_they_run():
    """The planner's statistics of Mixtral's batched_mm experts are those of its grouped_mm
    experts (the same layers, expert weights, FLOPs and rows moved): the graph it prices is
    the one the first pass makes, so expert parallelism is searched for them too."""
    from fxpar.compiler.compile import planner_stats
    fields = ("n_moe", "expert_params", "expert_flops_f", "expert_flops_b", "ep_comm_f",
              "ep_comm_b")
    got = []
    for implementation in ("batched_mm", "grouped_mm"):
        model, spec = zoo.build("mixtral")
        model.config._experts_implementation = implementation
        stats = planner_stats(model, spec.batch(0), spec.loss_fn)
        assert stats.ep_refusal is None
        got.append([tuple(getattr(s, f) for f in fields) for s in stats.segments])
    assert got[0] == got[1] and any(s[0] for s in got[0])


@pytest.mark.slow  # (four compiles: make test's 6 minutes)
@pytest.mark.parametrize("name", ["gpt_oss"])  # (Mixtral's: the ep x tp parity run)
def test_tp_splits_picked_experts_as_it_splits_their_grouped_form(name):
    """Under tp=2 the batched_mm experts' weights take the roles the same model's grouped_mm
    experts take (Mixtral: gate_up by its output features, down by its input features;
    GPT-OSS, biases added on the sorted rows, alike)."""
    roles = []
    for implementation in ("batched_mm", "grouped_mm"):
        model, spec = zoo.build(name)
        model.config._experts_implementation = implementation
        prog = fxpar.compile(model, 2, example_batch=spec.batch(0), loss_fn=spec.loss_fn,
                             plan={"tp": 2})
        rep = prog.graph.meta[ir.TP_REPORT]
        roles.append(([w for w in rep.column if ".mlp." in w], [w for w in rep.row
                                                                   if ".mlp." in w]))
    assert roles[0] == roles[1] and roles[0][0] and roles[0][1]


@pytest.mark.slow
def test_picked_experts_train_like_eager_under_plans():
    """Mixtral's and GPT-OSS's batched_mm experts, grouped, trained against eager (evaluate()
    too): ep=2 (rows sent to their experts' ranks by all-to-all), ep x tp (each expert
    tp-split on its rank), and ep on each stage of a pipeline of 2 (ZeRO with their grouped
    form: test_expert_parallel)."""
    _check_plans(2, [("mixtral_batched_experts", "adamw", {"dp": 2, "ep": 2}),
                     ("gpt_oss_batched_experts", "adamw", {"dp": 2, "ep": 2})])
    _check_plans(4, [("mixtral_batched_experts", "adamw", {"dp": 2, "ep": 2, "tp": 2}),
                     ("mixtral_batched_experts", "adamw", {"dp": 2, "ep": 2, "pp": 2,
                                                           "microbatches": 2})])


def test_expert_parallelism_sends_picked_experts_rows_by_all_to_all():
    """At dp=2 x ep=2 each rank holds 2 of Mixtral's 4 experts per layer, and the rows go to
    them and back by all-to-all, as for its grouped_mm experts."""
    model, batch_fn, loss_fn = workers.build("mixtral_batched_experts")
    prog = fxpar.compile(model, 2, example_batch=batch_fn(0), loss_fn=loss_fn,
                         plan={"dp": 2, "ep": 2})
    report = prog.graph.meta[ir.EP_REPORT]
    assert [(r["per_rank"], r["dispatch"]) for r in report] == [(2, "all-to-all")] * 2
    assert _count(prog.graph, torch.ops.fxpar.ep_dispatch.default) == 4

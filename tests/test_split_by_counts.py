"""compiler/split_by_counts.py: rows split by `counts.tolist()` into per-expert linears traced
as one grouped matmul (JetMoE's parallel experts), exact against eager; every other use of
the counts or the pieces refused by name."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

from fxpar.compiler.capture import capture
from fxpar.core import ir
from fxpar.core.errors import TraceError
from test_padded_nonzero import _assert_exact, _run, _run_dict

aten = torch.ops.aten


class _SplitExperts(nn.Module):
    """ScatterMoE-style experts: rows sorted by expert, split by the counts, one linear per
    piece, joined back; `use` replaces the experts' part (the refusal tests)."""

    def __init__(self, use=None, experts=4, dim=8):
        super().__init__()
        self.gate = nn.Linear(dim, experts)
        self.w1 = nn.Parameter(torch.randn(experts, 16, dim) / 4)
        self.w2 = nn.Parameter(torch.randn(experts, dim, 16) / 4)
        self.use = use

    def forward(self, x):
        w, picked = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        counts = torch.zeros(x.shape[0], len(self.w1)).scatter(1, picked, 1).long().sum(0)
        order = picked.flatten().sort(stable=True).indices
        rows = x[order // 2]
        sizes = counts.tolist()
        if self.use is not None:
            return (self.use(self, rows, sizes).sum(),)
        h = torch.cat([F.linear(p, self.w1[i]) for i, p in enumerate(rows.split(sizes))])
        h = F.silu(h)
        out = torch.cat([F.linear(p, self.w2[i]) for i, p in enumerate(h.split(sizes))])
        y = torch.zeros_like(x).index_add(0, order // 2, out * w.flatten()[order, None])
        return (y.pow(2).sum(),)


def test_split_experts_run_as_one_grouped_matmul_each_and_exact():
    torch.manual_seed(0)
    model, x = _SplitExperts(), torch.randn(16, 8)
    gm, got, loss, grads, params = _run(model, x, lambda m, b: m(b)[0])
    grouped = [n for n in gm.graph.nodes if n.target is aten._grouped_mm.default]
    # the two experts' linears forward; in the backward both weight gradients and the
    # second one's input gradient (the batch, the first one's input, needs none)
    assert sum(n.meta[ir.REGION] == ir.FORWARD for n in grouped) == 2
    assert len(grouped) == 5
    assert not [n for n in gm.graph.nodes if n.target in (
        aten.split_with_sizes.default, aten._local_scalar_dense.default)]
    # each piece's weight is w[i] of one stack: the grouped matmul reads the stack itself
    # (transposed, a view; the form expert parallelism splits), not a copy of its rows
    assert not [n for n in gm.graph.nodes if n.target is aten.stack.default]
    _assert_exact(gm, got, loss, grads, params)


@pytest.mark.slow  # (make test's 6 minutes: the plain module above is the fast case)
def test_jetmoes_experts_and_attention_experts_are_exact():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.JetMoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, aux_loss_coef=0.0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (8, 16))
    gm, got, loss, grads, params = _run_dict(transformers.JetMoeForCausalLM(cfg),
                                             {"input_ids": ids, "labels": ids})
    # per layer: the MoE's two linears and the attention experts' two, forward (x3 with
    # the backward's two each)
    assert sum(n.target is aten._grouped_mm.default for n in gm.graph.nodes) == 2 * 4 * 3
    _assert_exact(gm, got, loss, grads, params)


@pytest.mark.parametrize("use,why", [
    (lambda m, rows, sizes: rows[:sizes[0]], "as a Python number"),
    (lambda m, rows, sizes: rows * (sum(sizes) > 0), "as a Python number"),
    (lambda m, rows, sizes: torch.cat([p.relu() for p in rows.split(sizes)]), "relu takes"),
    (lambda m, rows, sizes: torch.cat([F.linear(p, m.w1[i]) for i, p in
                                       enumerate(rows.split(sizes))][::-1]), "in order"),
    (lambda m, rows, sizes: torch.cat([F.linear(p, m.w1[i]) for i, p in
                                       enumerate(rows.split(sizes))][:2]), "in order"),
    (lambda m, rows, sizes: torch.cat([F.linear(p, m.w1[i], m.w1[i, :, 0]) for i, p in
                                       enumerate(rows.split(sizes))]), "with a bias"),
    (lambda m, rows, sizes: F.linear(rows.split(sizes)[0], m.w1[0]).sum(), "sum takes"),
], ids=["slice", "sum-of-counts", "other-op", "reordered", "some-experts", "bias",
        "one-product"])
def test_other_uses_of_the_counts_or_the_pieces_are_refused(use, why):
    with pytest.raises(TraceError, match=why) as e:
        capture(_SplitExperts(use), torch.randn(16, 8), lambda m, b: m(b)[0])
    assert "Fix:" in str(e.value) and "test_split_by_counts.py" in str(e.value)


@pytest.mark.slow  # (two ranks launched: make test's 6 minutes)
def test_jetmoe_trains_like_eager_under_ep_and_a_pipeline():
    """JetMoE's grouped matmuls split over ep=2 (each rank's rows sent to its experts' rank
    by all-to-all) and a 2-stage pipeline with microbatches: losses, evaluate() and final
    weights equal eager AdamW."""
    pytest.importorskip("transformers")
    from test_parity import _check_plans
    _check_plans(2, [("jetmoe", "adamw", {"dp": 2, "ep": 2}),
                     ("jetmoe", "adamw", {"pp": 2, "microbatches": 2})])

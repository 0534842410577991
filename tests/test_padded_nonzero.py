"""compiler/padded_nonzero.py: `torch.where(mask)` / `nonzero` traced at their largest size,
the tensors their indices address padded with a zero row, and every use of the padding rows
proved harmless on the graph or refused. Parity under every plan: the zoo's `where_moe` and
the external zoo's `litgpt_mixtral`."""
import pytest
import torch
from torch import nn

from fxpar.core import ir
from fxpar.compiler.capture import capture
from fxpar.core.errors import TraceError
from fxpar.examples.zoo import WhereRoutedMoE, tokens_batch

aten = torch.ops.aten


def _run(model, batch, loss_fn=None):
    """The captured joint graph op by op, and eager's loss and gradients."""
    gm, sig = capture(model, batch, loss_fn)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    leaves = [b for b in (batch if isinstance(batch, (tuple, list)) else [batch])]
    args = [params[n].detach() for n in sig.param_names] + \
        [buffers[n] for n in sig.buffer_names] + leaves
    with torch.no_grad():
        out = gm(*args)
    model.zero_grad()
    loss = (loss_fn or (lambda m, b: m(b)))(model, batch)
    loss.backward()
    grads = {n: g for n, g in zip(sig.param_names, out[1:1 + len(sig.param_names)])}
    return gm, out[0], loss, grads, params


def _assert_exact(gm, got_loss, loss, grads, params):
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        ref = params[name].grad
        if ref is None:
            assert g is None or not g.any(), name
        else:
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=name)


def _padded_index_ops(gm):
    return [n for n in gm.graph.nodes if n.target in (aten.index.Tensor, aten.index_put.default)
            and n.args[0].target is aten.constant_pad_nd.default]


def test_where_routed_experts_are_traced_padded_and_exact():
    torch.manual_seed(0)
    model = WhereRoutedMoE()
    gm, got, loss, grads, params = _run(model, tokens_batch(0))
    targets = {n.target for n in gm.graph.nodes}
    assert aten.nonzero.default not in targets
    assert torch.ops.fxpar.padded_nonzero.default not in targets
    # every index op here takes routed indices (the embedding is its own op): each reads
    # or writes a padded copy; per expert the forward reads x, the weights and y, writes y
    padded = _padded_index_ops(gm)
    index_ops = [n for n in gm.graph.nodes
                 if n.target in (aten.index.Tensor, aten.index_put.default)]
    assert len(padded) == len(index_ops)
    assert sum(n.meta[ir.REGION] == ir.FORWARD for n in padded) == 4 * 4
    # weights[idx, top, None] pads both dims it indexes (one zero row, one zero column) and
    # not the trailing one
    assert any(n.args[0].args[1] == [0, 0, 0, 1, 0, 1] for n in padded)
    # a write's result is cut back to the written tensor's shape
    writes = [n for n in padded if n.target is aten.index_put.default]
    assert all(next(iter(w.users)).target is aten.slice.Tensor for w in writes)
    _assert_exact(gm, got, loss, grads, params)


def test_an_expert_no_token_picks_is_exact():
    """Every index of the unpicked experts is padding: their rows compute on zeros and their
    weights get exact-zero gradients, as in eager (where they get none)."""
    torch.manual_seed(0)
    model = WhereRoutedMoE()
    model.gate = nn.Linear(model.gate.in_features, 4)  # experts 0 and 1 always win
    with torch.no_grad():
        model.gate.weight.zero_()
        model.gate.bias.copy_(torch.tensor([5.0, 4.0, 0.0, 0.0]))
    gm, got, loss, grads, params = _run(model, tokens_batch(0))
    assert params["experts.3.0.weight"].grad.abs().max() == 0
    _assert_exact(gm, got, loss, grads, params)


class _Route(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.use = use

    def forward(self, x):
        h = self.proj(x)
        return self.use(h, torch.where(h[:, 0] > 0)[0])


@pytest.mark.parametrize("use", [
    lambda h, idx: h[idx].sum() + (h[idx] * 2).sum(),           # sums of zero padding rows
    lambda h, idx: torch.zeros_like(h).index_put((idx,), h[idx].relu(), accumulate=True).sum(),
    lambda h, idx: h[torch.nonzero(h[:, 1] > 0)[:, 0]].pow(2).sum(dim=1).sum(),
    lambda h, idx: h[torch.argwhere(h[:, 1] > 0).unbind(1)[0]].tanh().sum(),
    lambda h, idx: h.index_select(0, idx).relu().sum(),
    lambda h, idx: h[(h[:, 1] > 0).nonzero().squeeze(-1)].relu().sum(),
    lambda h, idx: h[(h > 0).nonzero().T[0]].relu().sum(),
    # a fused gate/up expert: its projection chunked or sliced along the features
    lambda h, idx: (lambda g, u: (torch.nn.functional.silu(g) * u).sum())(*h[idx].chunk(2, -1)),
    lambda h, idx: (torch.nn.functional.silu(h[idx][:, :4]) * h[idx][:, 4:]).sum(),
    lambda h, idx: (h[idx][:, 0] * h[idx][:, 1]).sum(),
], ids=["sum", "index_put", "nonzero-column", "argwhere", "index_select", "nonzero-squeeze",
        "nonzero-T", "chunk", "slices", "select-columns"])
def test_uses_proved_exact(use):
    torch.manual_seed(1)
    model, x = _Route(use), torch.randn(16, 8)
    _assert_exact(*_run(model, x))


@pytest.mark.parametrize("use,why", [
    (lambda h, idx: h[idx].mean(), "reduces over the routed rows"),
    (lambda h, idx: h[idx].exp().sum(), "reduces over the routed rows"),
    (lambda h, idx: h[idx].sum() / len(idx), "padded count"),
    (lambda h, idx: h[idx].sum() * idx.numel(), "padded count"),
    (lambda h, idx: h[idx + 1].sum(), "computes with the indices"),
    (lambda h, idx: (h[idx] + 1).amax(0).sum(), "reduces over the routed rows"),
    (lambda h, idx: h[h[idx][:, 0].long().clamp(0, 15)].sum(), "values computed from the routed"),
    # found by review: each was a silent wrong answer before its rule
    (lambda h, idx: (h[idx] * h[torch.where(h[:, 1] > 0)[0]]).sum(), "different masks"),
    (lambda h, idx: (h[idx] * torch.arange(16.0)[:, None]).sum(), "as many rows"),
    (lambda h, idx: (h + torch.zeros_like(h).index_put(
        (idx,), torch.arange(16.0)[:, None].expand(16, 8))).sum(), "as many rows"),
    (lambda h, idx: (h[idx] * h[idx].pow(2).sum(-1, keepdim=True).pow(-0.5)).sum(),
     "padding rows non-zero|reduces over"),
    (lambda h, idx: torch.nn.functional.hardtanh(h[idx], 0.1, 1.0).sum(), "reduces over"),
    (lambda h, idx: torch.where(h[idx] > 0, h[idx], float("-inf")).softmax(-1).sum(),
     "reduces over"),
    (lambda h, idx: (h[idx] @ h[idx].T).softmax(-1).sum(), "outer product"),
], ids=["mean", "exp-sum", "len", "numel", "index-arithmetic", "max", "routed-values-as-index",
        "two-masks", "arange-pairing", "arange-written", "pow-negative", "hardtanh-positive",
        "where-inf", "outer-product"])
def test_uses_that_padding_would_change_are_refused(use, why):
    with pytest.raises(TraceError, match=why) as e:
        capture(_Route(use), torch.randn(16, 8))
    assert "torch.where(mask)" in str(e.value) and "Fix:" in str(e.value)


def test_the_positions_are_nonzeros_with_padding_last_in_each_row_major_slot():
    mask = torch.tensor([[True, False], [False, True], [True, True]])
    from fxpar.compiler.padded_nonzero import padded_nonzero
    pos = padded_nonzero(mask)
    assert pos.shape == (6, 2)
    assert pos[(pos >= 0).all(1)].tolist() == torch.nonzero(mask).tolist()
    assert (pos[~mask.reshape(-1)] == -1).all()

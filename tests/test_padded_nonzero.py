"""compiler/padded_nonzero.py: `torch.where(mask)` / `nonzero` traced at their largest size,
the tensors their indices address padded with a zero row, and every use of the padding rows
proved harmless on the graph or refused. Parity under every plan: the zoo's `where_moe` and
the external zoo's `litgpt_mixtral`."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fxpar.core import ir
from fxpar.compiler.capture import capture
from fxpar.core.errors import TraceError
from fxpar.examples.zoo import StackedLoopMoE, WhereRoutedMoE, tokens_batch

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
    # a clamp inside the expert: its backward masks the gradient by where(mask, grad, 0)
    lambda h, idx: (h[idx].clamp(max=0.5) * 2).sum(),
    lambda h, idx: torch.where(h[idx] > 0, h[idx], torch.zeros(())).sum(),
], ids=["sum", "index_put", "nonzero-column", "argwhere", "index_select", "nonzero-squeeze",
        "nonzero-T", "chunk", "slices", "select-columns", "clamp", "where-zero"])
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
    (lambda h, idx: h[idx].clamp(min=0.1).sum(), "reduces over"),
    (lambda h, idx: torch.where(h[idx] > 0, h[idx], float("-inf")).softmax(-1).sum(),
     "reduces over"),
    (lambda h, idx: (h[idx] @ h[idx].T).softmax(-1).sum(), "outer product"),
], ids=["mean", "exp-sum", "len", "numel", "index-arithmetic", "max", "routed-values-as-index",
        "two-masks", "arange-pairing", "arange-written", "pow-negative", "hardtanh-positive",
        "clamp-positive",
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


def test_a_permuted_token_major_mask_lists_its_positions_token_by_token():
    """`torch.where(one_hot(picked, E).permute(2, 1, 0)[e])` (a (k, tokens) view of a
    token-major tensor): its positions are listed in the mask's memory order, token by
    token, so a dp rank's tokens are one block of them (core/local_dispatch). Each true
    position is still listed once, with nonzero's coordinates; the result is eager's."""
    torch.manual_seed(0)
    model = _HitLoopMoE()
    x = torch.randn(16, 8)
    gm, got, loss, grads, params = _run(model, x, lambda m, b: m(b)[0])
    _assert_exact(gm, got, loss, grads, params)
    where = [n for n in gm.graph.nodes if n.target is aten.where.ScalarOther
             and n.args[2] == -1]
    assert len(where) == 4
    flats = [w.args[0].args[0] if w.args[0].target is aten.ne.Scalar else w.args[0]
             for w in where]
    assert all(f.args[0].target is aten.permute.default and f.args[0].args[1] == [1, 0]
               for f in flats)

    seen = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n in where or n.target is aten.permute.default and n.args[1] == [2, 1, 0]:
                seen[n] = out
            return out

    params_ = [p.detach() for p in model.parameters()]
    with torch.no_grad():
        Record(gm).run(*params_, x)
    (onehot,) = [v for n, v in seen.items() if n not in where]
    for e, w in enumerate(where):
        pos = seen[w]
        true = pos[(pos >= 0).all(1)]
        assert sorted(true.tolist()) == torch.nonzero(onehot[e]).tolist()
        assert true[:, 1].tolist() == sorted(true[:, 1].tolist())  # (token by token)
        assert pos.shape == (2 * 16, 2)


# --- a loop over the experts nonzero() found hit: HF's eager experts, DBRX, and the
# ModuleList form Hugging Face's MoE models had before (and much hand-written MoE code has) --

class _HitLoopMoE(nn.Module):
    """`for e in expert_hit: expert = self.experts[e]; idx, top = torch.where(mask[e])`:
    the experts run are those some token picked, a count set by the data. `body` adds
    something to the loop (the refusal tests)."""

    def __init__(self, body=None, experts=4, dim=8, route=lambda m: m, least=0, bump=False):
        super().__init__()
        self.route, self.least, self.bump = route, least, bump
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 16), nn.SiLU(),
                                                   nn.Linear(16, dim)) for _ in range(experts))
        self.body = body

    def forward(self, x):
        w, picked = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        y = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(picked, len(self.experts)).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), self.least).nonzero()
        aux = x.new_zeros(())
        for e in hit:
            top, rows = torch.where(self.route(mask[e].squeeze(0)))
            if self.bump:  # (a change an absent expert's iteration would make too)
                y = y + 1
            y.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, top, None])
            if self.body is not None:
                aux = aux + self.body(self, e, mask, x)
        return (y.pow(2).sum() + aux,)


def test_a_loop_over_the_experts_nonzero_found_runs_every_expert_exactly():
    """Experts 0 and 1 always win: 2 and 3 are not in the hit list, so eager runs two
    iterations. fxpar runs four, proving the other two change nothing (their masks route no
    row: every index -1): the same loss and gradients, 2 and 3 without gradient."""
    torch.manual_seed(0)
    model = _HitLoopMoE()
    with torch.no_grad():
        model.gate.weight.mul_(0.01)
        model.gate.bias.copy_(torch.tensor([5.0, 4.0, 0.0, 0.0]))
    x = torch.randn(16, 8)
    gm, got, loss, grads, params = _run(model, x, lambda m, b: m(b)[0])
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.fxpar.loop_mark.default not in targets
    assert torch.ops.fxpar.padded_nonzero.default not in targets
    # each of the four iterations writes its rows through padded indices (index_add_ is
    # traced as an index_put, whose -1 rows the padding drops)
    writes = [n for n in gm.graph.nodes if n.target is aten.index_put.default
              and n.meta[ir.REGION] == ir.FORWARD]
    assert len(writes) == 4
    assert params["experts.3.0.weight"].grad is None and not grads["experts.3.0.weight"].any()
    _assert_exact(gm, got, loss, grads, params)
    # the hit list is a one_hot's sums > 0 and each iteration routes by that one_hot's row:
    # every expert is taken present (an absent one routes nothing), the positions constant,
    # the whole batch's hit list not computed
    assert not any(n.target is aten.gt.Scalar for n in gm.graph.nodes)


def test_a_hit_list_that_skips_experts_with_tokens_is_kept():
    """`sum > 1`: an expert one token picked is skipped, as in eager; its row reads -1."""
    torch.manual_seed(0)
    model, x = _HitLoopMoE(), torch.randn(16, 8)
    picks = torch.topk(model.gate(x), 2, dim=-1).indices.flatten().bincount(minlength=4)
    model.least = int(picks.min())  # the least picked expert has tokens and is skipped
    assert model.least > 0
    gm, got, loss, grads, params = _run(model, x, lambda m, b: m(b)[0])
    assert any(n.target is aten.gt.Scalar for n in gm.graph.nodes)
    _assert_exact(gm, got, loss, grads, params)


def _hf_moe(name):
    from fxpar.examples import zoo
    model, spec = zoo.build(name)
    model.config._experts_implementation = "eager"
    return model, spec.batch(0)


def _run_dict(model, batch):
    gm, sig = capture(model, batch, lambda m, b: m(**b).loss)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    args = [params[n].detach() for n in sig.param_names] + \
        [buffers[n] for n in sig.buffer_names] + list(batch.values())
    with torch.no_grad():
        out = gm(*args)
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    grads = {n: g for n, g in zip(sig.param_names, out[1:1 + len(sig.param_names)])}
    return gm, out[0], loss, grads, params


def test_a_stack_read_through_the_hit_lists_rows_is_read_as_views():
    """Every row of the hit list is present (constant p): each iteration reads expert p's
    matrices as `select(stack, 0, p)`, a view (no padded copy of the stack per iteration),
    and the stack's gradient is the sum of those selects' own backward, each at its p
    (no index write into a full-size zeros: passes/grouped_experts reads the p)."""
    torch.manual_seed(0)
    model, batch = StackedLoopMoE(), tokens_batch(0)
    gm, sig = capture(model, batch)
    phs = {n.meta[ir.FQN]: n for n in gm.graph.nodes if n.op == "placeholder"}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        users = phs[name].users
        assert {u.target for u in users} == {aten.select.int}
        assert sorted(u.args[1:] for u in users) == [(0, p) for p in range(4)]
        todo, parts = [out.args[0][1 + sig.param_names.index(name)]], []
        while todo:
            n = todo.pop()
            if n.target is aten.add.Tensor:
                todo.extend(n.args)
            else:
                parts.append(n)
        assert {n.target for n in parts} == {aten.select_backward.default}
        assert sorted(n.args[3] for n in parts) == list(range(4))
    assert not any(n.target in (aten.constant_pad_nd.default, aten.index_put.default) and
                   n.args[0] in phs.values() for n in gm.graph.nodes)
    params = dict(model.named_parameters())
    with torch.no_grad():
        got = gm(*[params[n].detach() for n in sig.param_names], *batch)
    loss = model(batch)
    loss.backward()
    torch.testing.assert_close(got[0], loss)
    for name, g in zip(sig.param_names, got[1:]):
        want = params[name].grad
        torch.testing.assert_close(g, torch.zeros_like(g) if want is None else want)


class _MaskingClassExperts(nn.Module):
    """DBRX's experts in plain PyTorch: each weight one parameter [E * out, in] viewed as the
    experts' stack in every iteration, `W.T`, and a one_hot over E + 1 classes (a masking
    class) whose loop visits class E too, with no `continue`: eager would index the stack
    past its end there, so it runs only where no token picked class E."""

    def __init__(self, d=8, f=16, experts=4):
        super().__init__()
        self.d, self.f, self.e = d, f, experts
        self.w1 = nn.Parameter(torch.randn(experts * f, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts * f, d) / f ** 0.5)

    def forward(self, batch):
        x, indices = batch
        mask = F.one_hot(indices, self.e + 1).permute(2, 1, 0)
        y = torch.zeros_like(x)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = e[0]
            top, idx = torch.where(mask[e])
            w1 = self.w1.view(-1, self.f, self.d)[e]
            w2 = self.w2.view(-1, self.f, self.d)[e]
            y.index_add_(0, idx, F.gelu(x[idx] @ w1.T) @ w2)
        return y.pow(2).mean()


def test_an_iteration_eager_cannot_run_is_removed_and_checked():
    """The masking class's iteration reads the stack past its end: removed, forward and
    backward (the stack read only by the four experts' selects, no padded copy), exact;
    where a token does pick class E, eager raises IndexError and the graph's check
    raises too."""
    torch.manual_seed(0)
    model = _MaskingClassExperts()
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16, 2)))
    gm, sig = capture(model, batch, lambda m, b: m(b))
    phs = {n.meta[ir.FQN]: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in ("w1", "w2"):
        sels = [u for v in phs[name].users for u in v.users]
        assert {v.target for v in phs[name].users} == {aten.view.default}
        assert sorted(u.args[1:] for u in sels) == [(0, p) for p in range(4)]
    checks = [n for n in gm.graph.nodes if n.target is torch.ops.fxpar.check_unrouted.default]
    assert len(checks) == 1 and "row 4" in checks[0].args[1]
    assert checks[0].args[0].target is aten.select.int and checks[0].args[0].args[1:] == (0, 4)
    stacks = {phs["w1"], phs["w2"], *phs["w1"].users, *phs["w2"].users}
    assert not any(n.target is aten.constant_pad_nd.default and n.args[0] in stacks
                   for n in gm.graph.nodes)
    params = dict(model.named_parameters())
    args = [params[n].detach() for n in sig.param_names]
    with torch.no_grad():
        got = gm(*args, *batch)
    model(batch).backward()
    torch.testing.assert_close(got[0], model(batch))
    for name, g in zip(sig.param_names, got[1:]):
        torch.testing.assert_close(g, params[name].grad)
    masked = (batch[0], batch[1].clone().index_fill_(0, torch.tensor([3]), 4))
    with pytest.raises(IndexError):
        model(masked)
    with pytest.raises(RuntimeError, match="row 4 .* past a tensor's end"):
        gm(*args, *masked)


@pytest.mark.slow  # (two Hugging Face models traced: make test's 6 minutes)
def test_hugging_faces_eager_experts_and_dbrx_are_exact():
    """transformers' eager experts (`config._experts_implementation = "eager"`: every HF MoE
    model) and DBRX's experts loop over the experts hit, skip the masking class by
    `if expert_idx == self.num_experts: continue` and read each expert's stacked weights by
    a 0-d index tensor."""
    pytest.importorskip("transformers")
    from fxpar.examples import zoo
    _assert_exact(*_run_dict(*_hf_moe("mixtral")))
    _assert_exact(*_run_dict(*_hf_moe("gpt_oss")))  # (biases, a clamped SwiGLU)
    model, spec = zoo.build("dbrx")
    _assert_exact(*_run_dict(model, spec.batch(0)))


@pytest.mark.parametrize("body,why", [
    # found nowhere in the rows the iteration routes: eager adds it once per expert hit
    (lambda m, e, mask, x: m.experts[e][0].weight.sum(), "leaves an iteration"),
    (lambda m, e, mask, x: x.sum(), "leaves an iteration"),
    # a mask true where the expert is absent would route real rows
    (lambda m, e, mask, x: (lambda rows: torch.zeros_like(x).index_add(0, rows, x[rows]))(
        torch.where(mask[e].squeeze(0) == 0)[1]).pow(2).sum(), "leaves an iteration"),
    (lambda m, e, mask, x: (e * 2).sum().float(), "computes with a row"),
], ids=["weights-only", "outside-value", "inverted-mask", "row-arithmetic"])
def test_loop_bodies_an_absent_expert_would_change_are_refused(body, why):
    with pytest.raises(TraceError, match=why) as e:
        capture(_HitLoopMoE(body), torch.randn(16, 8), lambda m, b: m(b)[0])
    assert "Fix:" in str(e.value)


def test_an_iterations_rows_must_be_routed_by_a_mask_all_false_where_it_is_absent():
    """`mask[e] != 0` is false where row e reads the zero row: exact; `mask[e] == 0` would be
    true there and route real rows in an iteration eager does not run: refused."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    _assert_exact(*_run(_HitLoopMoE(route=lambda m: m != 0), x, lambda m, b: m(b)[0]))
    with pytest.raises(TraceError, match="leaves an iteration"):
        capture(_HitLoopMoE(route=lambda m: m == 0), x, lambda m, b: m(b)[0])


def test_an_iterations_writes_must_go_into_a_value_from_before_it():
    """`y = y + 1` then a write through the routed rows: the write drops its -1 rows, but
    the + 1 an absent expert's iteration makes stays."""
    with pytest.raises(TraceError, match="leaves an iteration"):
        capture(_HitLoopMoE(bump=True), torch.randn(16, 8), lambda m, b: m(b)[0])


def _first_of_a_loop(rows):
    for e in rows:
        return e


@pytest.mark.parametrize("pick", [lambda rows: rows[0], lambda rows: [*rows][0],
                                  _first_of_a_loop], ids=["by-position", "unpacked", "break"])
def test_a_row_of_nonzero_taken_outside_a_loop_is_refused(pick):
    """nonzero's first row in eager is the first true position, not position 0."""
    def use(h, idx):
        first = pick(torch.nonzero(h[:, 0] > 0).unbind(0))
        return torch.zeros_like(h).index_put((first,), h[first] * 2).sum()
    with pytest.raises(TraceError, match="outside a loop|before its end"):
        capture(_Route(use), torch.randn(16, 8))


@pytest.mark.slow  # (two ranks launched: make test's 6 minutes)
def test_experts_looped_over_the_hit_list_train_like_eager():
    """transformers' eager experts under dp=2, a 2-stage pipeline with microbatches (each
    microbatch runs every expert: no hit list of the whole batch is computed) and dp=2 x
    ep=2 (run grouped, each rank its half of each stack), DBRX under dp=2 x ep=2 and tp=2,
    GPT-OSS's (expert biases, gate and up interleaved) under dp=2 x ep=2 and tp=2: losses,
    evaluate() and final weights equal eager AdamW."""
    pytest.importorskip("transformers")
    from test_parity import _check_plans
    _check_plans(2, [("mixtral_eager_experts", "adamw", {"dp": 2}),
                     ("mixtral_eager_experts", "adamw", {"pp": 2, "microbatches": 2}),
                     ("mixtral_eager_experts", "adamw", {"dp": 2, "ep": 2}),
                     ("dbrx", "adamw", {"dp": 2, "ep": 2}),
                     ("dbrx", "adamw", {"tp": 2}),
                     ("gpt_oss_eager_experts", "adamw", {"dp": 2, "ep": 2}),
                     ("gpt_oss_eager_experts", "adamw", {"tp": 2})])

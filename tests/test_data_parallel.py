"""The data-parallel pass on small graphs: which collectives appear, buckets, placements."""

import operator

import pytest
import torch

import fxpar
from fxpar.core import ir
from fxpar.compiler.capture import capture
from fxpar.core.errors import BatchError
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.core.graphs import count_ops, verify
from fxpar.core.plan import resolve
from fxpar.core.sharding import Partial, Replicate, Shard
from fxpar.examples import models as M
from fxpar.passes import data_parallel

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def compile_dp(model, batch, dp, **plan):
    gm, sig = capture(model, batch)
    ctx = PassContext(signature=sig, group_names={"dp": "dp-group"})
    snaps = {}
    gm = run_passes(gm, resolve({"dp": dp, **plan}, dp), ctx, "dp", snaps)
    return gm, sig, ctx, snaps


def _mlp_batch(n=8):
    return torch.randn(n, 16), torch.randn(n, 4)


def test_mlp_dp2_collectives_and_placements():
    gm, sig, ctx, snaps = compile_dp(M.MLP(), _mlp_batch(), 2)
    assert set(snaps) == {"capture", "data_parallel", "overlap"}  # no fusion on CPU (no Triton)
    assert "TRITON_INTERPRET" in gm.meta[ir.FUSION_SKIPPED]
    # one bucket for all gradients (tiny model < 25 MiB) + one for the mean loss
    assert count_ops(gm, c10d.all_reduce.default) == 2
    assert count_ops(gm, c10d.wait_tensor.default) == 2
    assert count_ops(gm, c10d.all_gather_into_tensor.default) == 0
    batch = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "batch"]
    assert [tuple(n.meta[ir.VAL].shape) for n in batch] == [(4, 16), (4, 4)]
    assert all(n.meta[ir.SHARD] == (Shard(0),) for n in batch)
    assert gm.meta[ir.BATCH_SHARD_DIMS] == [0, 0]
    # weight gradients are Partial(sum) before the bucket all-reduce, replicated after
    grads_partial = [n for n in gm.graph.nodes if n.target is aten.mm.default
                     and n.meta[ir.REGION] == ir.BACKWARD and n.meta[ir.SHARD] == (Partial("sum"),)]
    assert len(grads_partial) == 3
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert all(v.meta[ir.SHARD] == (Replicate(),) for v in out)
    # the mean loss: all-reduce(sum) then divide by dp
    loss = out[0]
    assert loss.target is aten.div.Scalar and loss.args[1] == 2
    assert loss.args[0].target is c10d.wait_tensor.default


def test_sum_loss_is_all_reduced_without_division():
    gm, *_ = compile_dp(M.SumLossMLP(), _mlp_batch(), 2)
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert loss.target is c10d.wait_tensor.default


def test_bucket_count_follows_bucket_size():
    model = M.MLP()
    n_params = len(list(model.parameters()))
    gm, *_ = compile_dp(model, _mlp_batch(), 2, bucket_mb=1e-9)  # every grad its own bucket
    assert count_ops(gm, c10d.all_reduce.default) == n_params + 1
    # bucket all-reduces start right after their gradient is computed, not at the end
    nodes = list(gm.graph.nodes)
    first_ar = next(i for i, n in enumerate(nodes) if n.target is c10d.all_reduce.default)
    last_bwd = max(i for i, n in enumerate(nodes) if n.meta.get(ir.REGION) == ir.BACKWARD)
    assert first_ar < last_bwd


def test_assign_buckets_reverse_order_and_cap():
    g = torch.fx.Graph()
    nodes = []
    for numel in (100, 100, 100, 100):
        n = g.placeholder(f"g{len(nodes)}")
        n.meta[ir.VAL] = torch.empty(numel)
        nodes.append(n)
    # 400-byte gradients, 800-byte cap: buckets close once they reach the cap
    assert data_parallel.assign_buckets(nodes, 800) == [[3, 2], [1, 0]]
    assert data_parallel.assign_buckets(nodes, 10**9) == [[3, 2, 1, 0]]


def test_batchnorm_statistics_are_all_reduced_in_forward():
    gm, *_ = compile_dp(M.ConvBN(), (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))), 2)
    fwd_waits = [n for n in gm.graph.nodes if n.target is c10d.wait_tensor.default
                 and any(u.meta.get(ir.REGION) == ir.FORWARD for u in n.users)]
    assert fwd_waits, "BatchNorm batch statistics need a forward all-reduce"
    assert {w.meta[ir.MODULE] for w in fwd_waits} & {"bn1", "bn2"}


class _Contrastive(torch.nn.Module):
    """CLIP's loss: every image scored against every text of the batch ([B, B] logits)."""

    def __init__(self):
        super().__init__()
        self.img, self.txt = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)

    def forward(self, batch):
        x, t = batch
        logits = self.img(x) @ self.txt(t).t()
        return torch.nn.functional.cross_entropy(logits, torch.arange(x.shape[0]))


class _BatchStats(torch.nn.Module):
    """BatchNorm without running buffers: the batch's statistics, nothing mutated."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8, track_running_stats=False)

    def forward(self, batch):
        return torch.nn.functional.mse_loss(self.bn(self.lin(batch[0])), batch[1])


class _RowsByPosition(torch.nn.Module):
    """Doge's router: [rows, 2k] logits viewed [2, rows, k] and unbound, so each row's first
    k scores are the first half of the rows' values, its last k the second half's."""

    def __init__(self):
        super().__init__()
        self.router, self.lin = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)

    def forward(self, batch):
        x, y = batch
        first, second = self.router(x).view(2, x.shape[0], 4).unbind(0)
        gate = torch.cat([first, second], -1).sigmoid()
        return torch.nn.functional.mse_loss(self.lin(x) * gate, y)


@pytest.mark.parametrize("model,what", [(_Contrastive, "every row of the batch"),
                                        (_BatchStats, "a sum over the batch"),
                                        (_RowsByPosition, "rows of the batch by their position")])
def test_microbatches_refused_where_rows_of_the_batch_are_computed_together(model, what):
    """Each microbatch runs alone: where one row reads another's values before the loss,
    that is not one step on the whole batch (a zoo sweep found CLIP's contrastive loss 30%
    off, BatchNorm without running statistics 1e-3 off and Doge's router 3e-4 off under
    pp=2, microbatches=2). Such
    a plan is refused, naming the op and module, and the planner never proposes it; dp=2
    of the same model is exact (collectives) and still allowed."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randn(8, 16 if model is _Contrastive else 8))
    with pytest.raises(fxpar.PlanError, match=f"microbatches > 1: rows of the batch.*{what}"):
        fxpar.compile(model(), 2, example_batch=batch, plan={"pp": 2, "microbatches": 2})
    gm, _ = capture(model(), batch)
    assert what in data_parallel.microbatch_refusal(gm)
    fxpar.compile(model(), 2, example_batch=batch, plan={"dp": 2})


class _GroupedMoE(torch.nn.Module):
    """torchtitan's expert dispatch in miniature: tokens sorted by expert, one grouped matmul
    whose group offsets are the cumsum of tokens per expert over the batch, unsorted back.
    `aux`: a load-balancing loss that reads the counts as well; `capacity`: counts clipped."""

    def __init__(self, aux=False, capacity=0):
        super().__init__()
        self.router, self.aux, self.capacity = torch.nn.Linear(8, 4, bias=False), aux, capacity
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8) * 0.1)

    def forward(self, batch):
        x, y = batch
        logits = self.router(x)
        expert = logits.argmax(-1)
        counts = torch.histc(expert.float(), bins=4, min=0, max=3)
        if self.capacity:  # a capacity: a row's group then depends on the other rows' counts
            counts = counts.clamp(max=self.capacity)
        order = torch.argsort(expert, stable=True)
        h = torch._grouped_mm(x[order], self.w, offs=torch.cumsum(counts, 0).to(torch.int32))
        gate = logits.softmax(-1).amax(-1, keepdim=True)
        loss = torch.nn.functional.mse_loss(torch.zeros_like(h).index_copy(0, order, h) * gate, y)
        if self.aux:
            loss = loss + (counts / x.shape[0] * logits.softmax(-1).mean(0)).sum()
        return loss


def test_counts_read_only_as_grouped_matmul_offsets_allow_microbatches():
    """Tokens per expert are a count over the whole batch, but a grouped matmul reading them
    as its group offsets multiplies each row by its own expert's weights: each microbatch's
    own counts give each row the whole batch's result (torchtitan's MoE at pp=2 m=2 was
    refused). The same counts read by a loss term, or clipped to a capacity before they
    become offsets, are a coupling and stay refused. Two
    microbatches on one device equal eager's step on the whole batch."""
    torch.manual_seed(0)
    batch = (torch.randn(16, 8), torch.randn(16, 8))
    gm, _ = capture(_GroupedMoE(), batch)
    assert data_parallel.microbatch_refusal(gm) is None
    for model in (_GroupedMoE(aux=True), _GroupedMoE(capacity=5)):
        gm, _ = capture(model, batch)
        assert "a sum over the batch" in data_parallel.microbatch_refusal(gm)
    torch.manual_seed(1)
    model = _GroupedMoE()
    eager = {k: v.detach().clone() for k, v in model.named_parameters()}
    pm = fxpar.parallelize(model, 1, example_batch=batch, plan={"microbatches": 2},
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.manual_seed(1)
    ref = _GroupedMoE()
    ref_loss = ref(batch)
    ref_loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    torch.testing.assert_close(pm.step(batch), ref_loss.detach())
    for k, p in ref.named_parameters():
        assert not torch.equal(p, eager[k]) or k == "router.weight"
        torch.testing.assert_close(pm.full_state_dict()[k], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # (make test's time: runs in CI's slow suite)
def test_microbatches_allowed_where_rows_are_computed_apart():
    """An LSTM (views that cannot stay split) and MoE routing (a sort over all tokens)
    compute each row apart: no refusal (the whole zoo is checked by its slow sweep)."""
    from fxpar.examples import zoo
    for name in ("lstm", "mixtral"):
        model, spec = zoo.build(name)
        gm, _ = capture(model, spec.batch(0), spec.loss_fn)
        assert data_parallel.microbatch_refusal(gm) is None, name


def test_gpt_dp_has_no_activation_gathers():
    cfg = M.GPTConfig()
    gm, *_ = compile_dp(M.GPT(cfg), M.gpt_batch(cfg, 4), 2)
    assert count_ops(gm, c10d.all_gather_into_tensor.default) == 0
    assert count_ops(gm, torch.ops.fxpar.local_chunk.default) == 0


def test_rows_sorted_over_the_batch_are_not_re_split_on_features():
    """Rows sorted over the whole batch (an MoE's token dispatch) are gathered; DTensor's rule
    for the row lookup then asked to re-split them on features (priced as an all-to-all;
    fxpar's re-split is the same all-gather plus a chunk), which made the next matmul
    contract a split dim: partial sums, and in bf16 each rank's share rounded before the sum
    (0.5% of the weight's gradient here; 1-28% of torchtitan Qwen3-MoE's first gradients).
    The lookup now runs on the whole rows and the matmul is no partial sum."""
    from workers import SortedRowsHalfMatmul, sorted_rows_batch
    gm, *_ = compile_dp(SortedRowsHalfMatmul(), sorted_rows_batch(), 2)
    fwd = [n for n in gm.graph.nodes if n.op == "call_function"
           and n.meta[ir.REGION] == ir.FORWARD]
    mm = [n for n in fwd if n.target is aten.mm.default]
    assert mm and all(n.meta[ir.SHARD] == (Replicate(),) for n in mm)
    assert not [n for n in fwd if n.target is torch.ops.fxpar.local_chunk.default
                and n.args[1] != 0]  # (no split on features)
    assert not [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default
                and n.args[0].meta[ir.REGION] == ir.FORWARD]  # (no partial sum to reduce)


@pytest.mark.slow  # (make test's time: runs in CI's slow suite)
def test_rows_sorted_over_the_batch_then_a_bf16_matmul_step_as_eager():
    """The same model trained one SGD step under dp=2 equals eager: loss and gradient up to
    fp32 reordering (before: the loss 7e-5 off, the gradient 0.5%)."""
    from workers import SortedRowsHalfMatmul, sorted_rows_batch, sorted_rows_rank
    ref = SortedRowsHalfMatmul()
    w0 = ref.w.detach().clone()
    loss = ref(sorted_rows_batch())
    loss.backward()
    got_loss, w = fxpar.launch(sorted_rows_rank, 2)[0]
    assert abs(got_loss - loss.item()) <= 1e-6 * loss.item()
    grad = w0 - w
    assert ((grad - ref.w.grad).abs().max() / ref.w.grad.abs().max()).item() < 1e-5


def test_mean_cross_entropy_is_one_all_reduce_of_sum_and_count():
    """The loss and its target count (the backward's divisor) travel in one [2] all-reduce,
    and the loss is global sum / global count (exact with ignore_index), not a mean of means."""
    cfg = M.GPTConfig()
    gm, *_ = compile_dp(M.GPT(cfg), M.gpt_batch(cfg, 4), 2)
    small = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default
             and not n.meta.get(ir.BUCKET)]
    assert [tuple(n.args[0].meta[ir.VAL].shape) for n in small] == [(2,)]
    assert small[0].args[0].target is aten.stack.default
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert loss.target is aten.div.Tensor
    assert [a.target for a in loss.args] == [aten.select.int, aten.select.int]
    backward = next(n for n in gm.graph.nodes if n.target is aten.nll_loss_backward.default)
    assert backward.args[-1] is loss.args[1]  # the backward divides by the global count


class _TwoLosses(torch.nn.Module):
    """Two heads, each a mean cross-entropy (the second ignoring some targets)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 5), torch.nn.Linear(16, 3)

    def forward(self, batch):
        x, ya, yb = batch
        return torch.nn.functional.cross_entropy(self.a(x), ya) + \
            torch.nn.functional.cross_entropy(self.b(x), yb, ignore_index=-1)


def _two_losses_batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g),
            torch.tensor([0, -1, 2, -1, -1, 1, 0, 2]))  # (rank 0 counts 2 targets, rank 1 3)


def test_a_mean_cross_entropy_among_other_loss_terms_averages_to_the_batch_mean():
    """A loss adding two mean cross-entropies: each term's value on a rank becomes its sum
    times dp over the group's count (its count all-reduced for it), so the average over the
    ranks - what the loss's reduction takes - is the batch's mean of that term, not the mean
    of the ranks' means; the backward is untouched (it divides by the group's count)."""
    gm, *_ = compile_dp(_TwoLosses(), _two_losses_batch(), 2)
    nlls = [n for n in gm.graph.nodes if n.target is aten.nll_loss_forward.default]
    assert len(nlls) == 2
    for nll in nlls:
        readers = {w for m in nll.users if m.target is operator.getitem and m.args[1] == 0
                   for w in m.users if w.meta.get(ir.REGION) != ir.BACKWARD}
        assert readers and all(w.meta.get(ir.LOSS_REDUCTION) for w in readers)
    counts = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default
              and n.meta.get(ir.LOSS_REDUCTION)]
    assert len(counts) == 2 and all(n.args[0].args[0] in nlls for n in counts)
    verify(gm)


def _two_losses_rank():
    torch.manual_seed(0)
    model = _TwoLosses()
    want = model(_two_losses_batch()).item()
    pm = fxpar.parallelize(model, 2, example_batch=_two_losses_batch(), plan={"dp": 2})
    return pm.step(_two_losses_batch()), want


def test_a_loss_of_two_cross_entropies_reports_the_batch_mean_under_dp():
    """2 ranks, the batch above: pm.step's loss is eager's (before: 3.2441 vs 3.2625)."""
    for got, want in fxpar.launch(_two_losses_rank, 2).values():
        assert abs(float(got) - want) < 1e-6 * abs(want)


def test_forward_only_mean_loss_is_global_sum_over_global_count():
    """evaluate()'s forward-only graph has no backward to reduce the count for: the rewrite
    reduces it with the sum anyway (one [2] all-reduce), so the loss is exact there too."""
    cfg = M.GPTConfig()
    gm, sig = capture(M.GPT(cfg), M.gpt_batch(cfg, 4), joint=False)
    ctx = PassContext(signature=sig, group_names={"dp": "dp-group"})
    gm = run_passes(gm, resolve({"dp": 2}, 2), ctx, "dp", {})
    ars = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    assert [tuple(n.args[0].meta[ir.VAL].shape) for n in ars] == [(2,)]
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert loss.target is aten.div.Tensor


def test_batch_not_divisible_by_dp_is_a_clear_error():
    with pytest.raises(BatchError, match="multiple of 2"):
        compile_dp(M.MLP(), _mlp_batch(5), 2)


def test_dp1_is_identity():
    gm, sig = capture(M.MLP(), _mlp_batch())
    before = len(gm.graph.nodes)
    ctx = PassContext(signature=sig, group_names={"dp": "g"})
    gm = data_parallel.run(gm, data_parallel.Options(dp=1), ctx)
    assert len(gm.graph.nodes) == before and gm.meta[ir.BATCH_SHARD_DIMS] == [None, None]


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_gradient_outputs_are_bucket_shards(zero):
    """ZeRO-1: each flat bucket all-reduced, then this rank's slice; ZeRO-2: reduce-scattered.
    The outputs are one 1/dp shard per bucket and gm.meta[ir.ZERO_BUCKETS] records the layout."""
    model = M.MLP()
    n_params = len(list(model.parameters()))
    gm, sig, ctx, _ = compile_dp(model, _mlp_batch(), 2, zero=zero, bucket_mb=1e-3)
    buckets = gm.meta[ir.ZERO_BUCKETS]
    assert sorted(i for b in buckets for i in b) == list(range(n_params))
    rs, ar = count_ops(gm, c10d.reduce_scatter_tensor.default), count_ops(gm, c10d.all_reduce.default)
    if zero == 2:
        assert (rs, ar) == (len(buckets), 1)              # the loss is the only all-reduce
    else:
        assert (rs, ar) == (0, len(buckets) + 1)
        assert count_ops(gm, torch.ops.fxpar.local_chunk.default) == len(buckets)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.meta["n_grads"] == len(buckets)
    params = dict(model.named_parameters())
    for b, shard in zip(buckets, out.args[0][1:1 + len(buckets)]):
        numel = sum(params[sig.param_names[i]].numel() for i in b)
        assert shard.meta[ir.VAL].numel() == -(-numel // 2)  # padded, halved


def _gathers_reading(ph):
    """The all-gathers that read placeholder `ph`: directly, or through the copy of several
    shards into one input (ir.PACK)."""
    out = []
    for u in ph.users:
        if u.meta.get(ir.PACK):
            out += [g for g in u.users if g.target is c10d.all_gather_into_tensor.default]
        elif u.target is c10d.all_gather_into_tensor.default:
            out.append(u)
    return out


def test_zero3_params_are_shards_gathered_before_forward_and_backward_use():
    """Each module's weights travel in one all-gather (weight + bias: shards copied into one
    input, whole weights copied out) and their gradients in one reduce-scatter. The MLP is
    all tail: the weights its backward reads (fc2's and fc3's, for the input gradients) are
    read right after the forward, with nothing larger gathered in between, so the backward
    keeps the forward's copies instead of gathering them again."""
    model = M.MLP()
    params = dict(model.named_parameters())
    gm, sig, ctx, _ = compile_dp(model, _mlp_batch(), 2, zero=3)
    assert gm.meta[ir.PARAMS_SHARDED]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "param"]
    gathers = {}
    for ph, name in zip(phs, sig.param_names):
        assert tuple(ph.meta[ir.VAL].shape) == (-(-params[name].numel() // 2),)
        gathers[name] = _gathers_reading(ph)
        assert [g.meta[ir.REGION] for g in gathers[name]] == [ir.FORWARD], name
        # nothing reads the shard but the gathers (or their packing copy)
        assert all(u.meta.get(ir.PACK) or u.target is c10d.all_gather_into_tensor.default
                   for u in ph.users), name
    for m in ("fc1", "fc2", "fc3"):  # one gather per module
        assert gathers[f"{m}.weight"] == gathers[f"{m}.bias"], m
    assert count_ops(gm, c10d.all_gather_into_tensor.default) == 3
    assert count_ops(gm, c10d.reduce_scatter_tensor.default) == 3   # one per module
    assert gm.meta[ir.ZERO_BUCKETS] == [[i] for i in reversed(range(len(phs)))]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for b, shard in zip(gm.meta[ir.ZERO_BUCKETS], out.args[0][1:1 + len(phs)]):
        assert shard.meta[ir.VAL].shape == phs[b[0]].meta[ir.VAL].shape  # grad shard = param's


def _backward_reads_of(gather):
    """Backward nodes reading a gathered weight (through its copy-out and views)."""
    stack, seen, found = [gather], set(), set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.meta[ir.REGION] == ir.BACKWARD:
                found.add(u)
            if u not in seen and u.target in (
                    c10d.wait_tensor.default, aten.view.default, aten.slice.Tensor,
                    aten.t.default, aten.split_with_sizes.default, operator.getitem,
                    aten.clone.default):
                seen.add(u)
                stack.append(u)
    return found


def test_zero3_gathers_again_in_the_backward_except_the_tail():
    """GPT, 3 blocks: the blocks before the last are gathered again for the backward (their
    forward copies die after the forward: no backward node reads them); the last block, the
    final norm and the tied embedding / LM head keep their forward copies (read right after
    the forward, nothing half their size gathered in between)."""
    cfg = M.GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)
    gm, sig, ctx, _ = compile_dp(M.GPT(cfg), M.gpt_batch(cfg, 4), 2, zero=3)
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    layer = lambda g: ir.layer_of(g.meta[ir.MODULE])
    bwd = sorted(layer(g) for g in gathers if g.meta[ir.REGION] == ir.BACKWARD)
    assert bwd == ["h.0", "h.1"]
    for g in gathers:
        if g.meta[ir.REGION] == ir.FORWARD:
            kept = layer(g) in ("h.2", "ln_f", "wte")
            assert bool(_backward_reads_of(g)) == kept, layer(g)


def test_microbatch_loss_weighting_nodes_carry_the_values_torch_computes():
    """With microbatches the loss is rescaled by the microbatch's share of the targets (its
    count over the step's, a placeholder fed by the runtime): the pass gives those few nodes
    their values itself, dtype promotion included (a bf16 model's loss, fp32 counts), rather
    than propagating the whole graph again - and a fake run of the whole graph agrees."""
    cfg = M.GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
    for precision in ("fp32", "bf16"):
        gm, *_ = compile_dp(M.GPT(cfg), M.gpt_batch(cfg, 4), 2, microbatches=2,
                            precision=precision)
        loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        share = next(n for n in gm.graph.nodes if n.op == "placeholder"
                     and n.meta.get(ir.FQN) == "loss_count")
        assert loss.target is aten.where.ScalarOther and share in ir.ancestors([loss])
        verify(gm)  # (every value: a fake run of the whole graph)


def test_zero3_with_microbatches_keeps_no_forward_copy_for_the_backward():
    """pp=1 with microbatches: the step's forward and backward run as separate parts, one
    microbatch at a time, so no weight is kept from the forward (it would be stashed per
    microbatch): the tail is gathered again for the backward like every other layer."""
    cfg = M.GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)
    gm, sig, ctx, _ = compile_dp(M.GPT(cfg), M.gpt_batch(cfg, 4), 2, zero=3, microbatches=2)
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert sorted(ir.layer_of(g.meta[ir.MODULE]) for g in gathers
                  if g.meta[ir.REGION] == ir.BACKWARD) == ["h.0", "h.1", "h.2", "lm_head", "ln_f"]
    for g in gathers:
        if g.meta[ir.REGION] == ir.FORWARD:
            assert not _backward_reads_of(g), g.meta[ir.MODULE]


def test_zero3_collectives_are_one_per_layer():
    """GPT: one all-gather per layer in the forward (wte, wpe, each block, ln_f), one per
    layer whose weights the backward reads, one reduce-scatter per layer; a block's gather
    sits before the first node of that block."""
    cfg = M.GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)
    gm, sig, ctx, _ = compile_dp(M.GPT(cfg), M.gpt_batch(cfg, 4), 2, zero=3)
    layers = {ir.layer_of(n.rsplit(".", 1)[0]) for n in sig.param_names}
    assert layers == {"wte", "wpe", "ln_f", "h.0", "h.1", "h.2"}
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    fwd = [g for g in gathers if g.meta[ir.REGION] == ir.FORWARD]
    assert len(fwd) == len(layers)
    assert count_ops(gm, c10d.reduce_scatter_tensor.default) == len(layers)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k in range(cfg.n_layer):
        first = min(pos[n] for n in gm.graph.nodes if n.op == "call_function"
                    and n.meta.get(ir.REGION) == ir.FORWARD
                    and (n.meta.get(ir.MODULE) or "").startswith(f"h.{k}.")
                    and n.target is not c10d.all_gather_into_tensor.default
                    and not n.meta.get(ir.PACK) and n.target is not c10d.wait_tensor.default)
        mine = [g for g in fwd if g.meta[ir.MODULE].startswith(f"h.{k}.")]
        assert len(mine) == 1 and pos[mine[0]] < first


def test_zero3_under_pp_each_stage_gathers_in_its_own_parts():
    """ZeRO-3 x pp: every all-gather lands in the part (stage, F/B) of the node it feeds, a
    weight read by two stages (the GPT's tied embedding / LM head) is gathered by each of
    them, and no part reads a full weight another part gathered (no full weight is sent
    between stages or kept from a forward to its backward)."""
    from fxpar.compiler import stages
    cfg = M.GPTConfig()
    gm, sig = capture(M.GPT(cfg), M.gpt_batch(cfg, 8))
    ctx = PassContext(signature=sig, group_names={"dp": "dp-group", "pp": "pp-group"})
    gm = run_passes(gm, resolve({"dp": 2, "pp": 2, "zero": 3, "microbatches": 2}, 4), ctx,
                    "dp", {})
    prog = stages.split(gm, sig, 2)
    gathered_in = {}
    for key, part in prog.parts.items():
        names = {n.name for n in part.graph.graph.nodes}
        for n in part.graph.graph.nodes:
            if n.target is c10d.all_gather_into_tensor.default:
                gathered_in.setdefault(key, []).append(n.name)
        for kind, ref in part.inputs:  # values from other parts are activations, not weights
            if kind == "value":
                producer = next(n for n in gm.graph.nodes if n.name == ref)
                assert producer.target is not c10d.wait_tensor.default or \
                    producer.args[0].target is not c10d.all_gather_into_tensor.default, \
                    (key, ref)
        assert names  # (a part with nodes)
    assert {"F0", "F1", "B0", "B1"} <= set(gathered_in), gathered_in
    wte = sig.param_names.index("wte.weight")
    readers = {prog.parts[k].stage for k, p in prog.parts.items()
               for kind, ref in p.inputs if kind == "param" and ref == wte}
    assert readers == {0, 1}


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.slow  # (make test's 6 minutes)
def test_zero_buckets_of_redistributed_gradients_keep_graph_order(zero):
    """An LSTM's weight gradients come out Replicate (its recurrence reads the whole batch)
    and are made partial sums at the end of the graph; a bucket of two of them was placed
    after the first and read the second before it existed (compile crashed)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn = nn.Embedding(32, 8), nn.LSTM(8, 8, batch_first=True)
            self.head = nn.Linear(8, 32)

        def forward(self, batch):
            ids, targets = batch
            h, _ = self.rnn(self.emb(ids))
            return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 3))
    prog = fxpar.compile(LSTMLM(), 2, example_batch=(ids, ids), plan={"dp": 2, "zero": zero})
    prog.graph.graph.lint()  # every node defined before it is read
    gm = prog.stage_graphs["data_parallel"]["dp"]
    assert any(n.target is torch.ops.fxpar.partial_from_replicate.default
               for n in gm.graph.nodes)  # the case: gradients redistributed to partial sums
    if zero == 3:  # beside the parameters' gathers, the sharding engine's of an activation
        gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
        assert any(g.args[0].op != "placeholder" and not g.args[0].meta.get(ir.PACK)
                   for g in gathers)


@pytest.mark.slow  # (13 s: the zoo's GRU; tests/test_zoo.py runs it under every plan too)
def test_zero3_tail_check_passes_over_activation_gathers():
    """A bidirectional GRU's recurrence reads the whole batch: the sharding engine gathers an
    activation between the head's last forward use and its backward use. ZeRO-3's check of
    what was gathered in between (to keep the head's forward copy) counts parameter gathers
    only (it read the activation gather's input as a shard: KeyError, found by the zoo)."""
    from fxpar.examples import zoo
    model, spec = zoo.build("gru")
    prog = fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "zero": 3})
    gm = prog.stage_graphs["data_parallel"]["dp"]
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert any(g.args[0].op != "placeholder" and not g.args[0].meta.get(ir.PACK)
               for g in gathers)


def zero_gather_rank():
    """Rank function: ZeRO-1/2 and plain dp on the same model and batches, AdamW, 3 steps
    (op by op); the parameter all-gathers of the last step as the timeline records them."""
    from fxpar.runtime import comm
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
    out = {}
    for zero in (0, 1, 2):
        torch.manual_seed(0)
        pm = fxpar.parallelize(M.DeepMLP(n_blocks=2, width=128), 2, example_batch=batches[0],
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2,
                                                                      weight_decay=0.1),
                               plan={"dp": 2, "zero": zero, "codegen": "eager"})
        losses = [pm.step(b).item() for b in batches]
        gathers = [s.args["bytes"] for s in pm.recorder.steps[-1][3]
                   if s.track == "comm" and s.name.startswith("all_gather params")]
        out[zero] = (losses, pm.full_state_dict(), gathers)
    losses, state, _ = out[0]
    return {zero: dict(same_losses=out[zero][0] == losses,
                       same_state=all(torch.equal(out[zero][1][k], v) for k, v in state.items()),
                       gathers=len(out[zero][2]),
                       large=any(b >= comm.GLOO_INPLACE_AG_BYTES for b in out[zero][2]))
            for zero in (1, 2)}


@pytest.mark.slow  # (make test's time: runs in CI's slow suite)
def test_zero12_parameter_gathers_through_the_runtime_equal_plain_dp():
    """ZeRO-1/2's all-gather of the stepped shards goes through runtime/comm (on gloo, a
    bucket of 64 KiB or more as one broadcast per rank into the output) and is on the
    timeline; the training equals plain dp's bit for bit."""
    res = fxpar.launch(zero_gather_rank, 2)
    for r in (0, 1):
        for zero in (1, 2):
            got = res[r][zero]
            assert got["same_losses"] and got["same_state"], (r, zero, got)
            assert got["gathers"] >= 1 and got["large"], (r, zero, got)

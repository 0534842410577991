"""The sharding engine on tiny graphs: DTensor rules, inserted collectives, local shapes."""
import pytest
import torch
import torch.fx

from fxpar.core import ir
from fxpar.compiler.capture import capture
from fxpar.core.graphs import count_ops
from fxpar.core.sharding import Partial, Replicate, Shard, make_mesh, redistribute, shard_graph

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def test_redistribute_emits_the_right_collectives():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta[ir.VAL] = torch.empty(4, 6, 8)
    meta = {ir.MODULE: "", ir.REGION: ir.FORWARD}
    r1 = redistribute(g, x, (Shard(1),), (Replicate(),), ["g"], [2], meta)
    r2 = redistribute(g, x, (Partial("avg"),), (Replicate(),), ["g"], [2], meta)
    r3 = redistribute(g, x, (Replicate(),), (Shard(0),), ["g"], [2], meta)
    r4 = redistribute(g, x, (Partial("sum"),), (Shard(1),), ["g"], [2], meta)
    g.output((r1, r2, r3, r4))
    gm = torch.fx.GraphModule({}, g)
    assert count_ops(gm, c10d.all_gather_into_tensor.default) == 1
    # dim 1 is gathered by moving it to the front (all_gather concatenates dim 0) and back
    gather = next(n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default)
    assert gather.args[0].args[0].target is aten.permute.default
    assert gather.args[0].args[0].args[1] == [1, 0, 2]
    assert r1.target is aten.clone.default and r1.args[0].args[1] == [1, 0, 2]
    assert r2.target is aten.div.Scalar and r2.args[1] == 2        # avg = sum / n (gloo has no AVG)
    assert r3.target is torch.ops.fxpar.local_chunk.default        # no communication
    # a partial sum to a split value: one reduce-scatter, no all-reduce for it
    assert count_ops(gm, c10d.reduce_scatter_tensor.default) == 1
    assert count_ops(gm, c10d.all_reduce.default) == 1             # (r2's)


def test_view_shapes_become_local_and_distinct_views_stay_distinct():
    """Regression: DTensor's cached propagation conflated views that differ only in shape."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x.view(4, 4, 8)).view(4, 4, 2, 4)  # two views of same-shaped inputs
            return h.view(4, 4, 8).sum(-1).view(16).mean()

    gm, _ = capture(M(), torch.randn(4, 4, 8))
    batch = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "batch")
    shard_graph(gm, make_mesh(2), {batch.name: (Shard(0),)}, ["g"])
    shapes = {tuple(n.args[1]) for n in gm.graph.nodes if n.target is aten.view.default
              and n.meta[ir.SHARD] == (Shard(0),)}
    assert (2, 4, 2, 4) in shapes and (2, 4, 8) in shapes and (8,) in shapes


def test_squeeze_without_dims_takes_the_dims_of_the_global_shape():
    """`x.squeeze()` (no dim: ERNIE 4.5 MoE's router bias) on a split value squeezes the
    dims of size 1 in the global shape, which DTensor's rule names (an argument the op did
    not have: it crashed the pass); a local size of 1 (2 rows over 2 ranks) is not one."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.b = torch.nn.Parameter(torch.zeros(1, 4))

        def forward(self, x):  # x [2, 1, 4]
            return (self.fc(x).squeeze() + self.b.squeeze()).square().mean()

    gm, _ = capture(M(), torch.randn(2, 1, 4))
    batch = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "batch")
    shard_graph(gm, make_mesh(2), {batch.name: (Shard(0),)}, ["g"])
    squeezes = [n for n in gm.graph.nodes if n.target in (aten.squeeze.default, aten.squeeze.dims)
                and n.meta.get(ir.REGION) == ir.FORWARD]
    assert sorted(tuple(n.args[1]) for n in squeezes) == [(0,), (1,)]  # (the bias's, the rows')
    bias, rows = sorted(squeezes, key=lambda n: tuple(n.args[1]))
    assert bias.meta[ir.SHARD] == (Replicate(),) and rows.meta[ir.SHARD] == (Shard(0),)


def test_custom_ops_lay_out_their_outputs_as_their_fakes_say(monkeypatch):
    """fxpar's rank-dependent ops on transposed inputs: real outputs match the fake kernels'
    shapes and strides (torch.library.opcheck). Compiled code trusts the fake's layout -
    Inductor asserts it around a fallback op, and reads it as laid out: a chunk cloned in
    its input's layout crashed T5's tp=2 step under Inductor."""
    import torch.distributed.distributed_c10d as c10d_mod

    from fxpar.core import sharding, split_random, vocab_parallel  # noqa: F401 (registers)

    class Rank1:
        def rank(self):
            return 1

        def size(self):
            return 2
    monkeypatch.setattr(sharding, "_group_rank_size", lambda group: (1, 2))
    monkeypatch.setattr(c10d_mod, "_resolve_process_group", lambda group: Rank1())
    x = torch.randn(6, 8).t()
    fx = torch.ops.fxpar
    for op, args in [(fx.local_chunk.default, (x, 0, 2, "g")),
                     (fx.local_chunk.default, (x, 1, 2, "g")),
                     (fx.partial_from_replicate.default, (x, "g")),
                     (fx.dropout_with_mask.default, (x, (torch.rand(8, 6) > 0.5).float(), 2.0)),
                     (fx.localize.default, (torch.arange(12).view(3, 4).t(), 6, "g", -100))]:
        result = torch.library.opcheck(op, args, test_utils=("test_faketensor",))
        assert result == {"test_faketensor": "SUCCESS"}, (op, result)
    out, mask = fx.dropout_with_mask.default(x, torch.ones(8, 6), 2.0)
    torch.testing.assert_close(out, x * 2)
    assert mask.all() and out.stride() == x.stride()
    # localize: an id out of the whole vocabulary (2 x 6 rows) raises as eager's embedding
    # does - split by vocabulary it would be masked to zero on every rank, silently
    ids = torch.tensor([0, 5, 11, -100])
    assert fx.localize.default(ids, 6, "g", -100).tolist() == [-6, -1, 5, -106]
    for bad, ignore in ((torch.tensor([3, 12]), -100), (torch.tensor([-100]), -2 ** 62)):
        with pytest.raises(IndexError, match=r"out of the vocabulary's range \[0, 12\)"):
            fx.localize.default(bad, 6, "g", ignore)


def test_an_op_without_a_dtensor_rule_runs_on_whole_inputs():
    """weight_norm's backward has no DTensor rule; under dp its weight gradient arrives
    Partial(sum) (found by a zoo sweep on HF Wav2Vec2, whose positional convolution is
    weight-normed). The op runs on whole inputs: the partial gradient is all-reduced first
    (as DDP reduces it), and dp does not reduce the op's outputs again."""
    import fxpar

    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(8, 8))

        def forward(self, batch):
            return torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    gm = fxpar.compile(Normed(), 2, example_batch=batch, plan={"dp": 2}).graph
    c10d = torch.ops._c10d_functional
    (wn,) = [n for n in gm.graph.nodes
             if n.target is torch.ops.aten._weight_norm_interface_backward.default]
    src = wn.args[0]
    while src.target is not c10d.wait_tensor.default:
        src = src.args[0]
    assert src.args[0].target is c10d.all_reduce.default
    # what the op returns (the g and v gradients) is whole already: no second reduction
    reduced = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    assert not any(wn in _ancestors(n) for n in reduced)


def _ancestors(n):
    seen, todo = set(), [n]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _topk_graph():
    """x -> topk(x, 2): a row-wise op DTensor's rule lets split on its rows."""
    import operator
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta[ir.VAL] = torch.empty(8, 4)
    t = g.call_function(aten.topk.default, (x, 2))
    t.meta[ir.VAL] = torch.topk(torch.empty(8, 4), 2)
    v = g.call_function(operator.getitem, (t, 0))
    v.meta[ir.VAL] = t.meta[ir.VAL][0]
    g.output((v,))
    return torch.fx.GraphModule({}, g), x, t


def test_a_partial_sum_is_not_split_onto_rows_another_axis_splits():
    """DTensor's topk rule reduce-scatters a partial input onto its rows (litgpt's Mixtral
    under tp: the router's logits). When data parallelism splits those rows too (`rows`),
    the two splits would nest: the partial sum is all-reduced instead."""
    gm, x, t = _topk_graph()
    shard_graph(gm, make_mesh(2), {"x": (Partial(),)}, ["g"])
    assert count_ops(gm, c10d.reduce_scatter_tensor.default) == 1
    assert t.meta[ir.SHARD][0] == (Shard(0),)

    gm, x, t = _topk_graph()
    shard_graph(gm, make_mesh(2), {"x": (Partial(),)}, ["g"], rows={x: 0})
    assert count_ops(gm, c10d.reduce_scatter_tensor.default) == 0
    assert count_ops(gm, c10d.all_reduce.default) == 1
    assert t.meta[ir.SHARD][0] == (Replicate(),)

    gm, x, t = _topk_graph()  # rows on another dim than the one the rule splits: as before
    shard_graph(gm, make_mesh(2), {"x": (Partial(),)}, ["g"], rows={x: 1})
    assert count_ops(gm, c10d.reduce_scatter_tensor.default) == 1


def test_a_partial_sum_goes_through_another_axis_gather_unreduced():
    """A partial sum over this mesh (an expert's weight gradient, its rows dp-local) gathered
    over another axis (tp's chunked expert weight) stays a partial sum, reduced by whoever
    owns it (ep's experts: over their "edp" part of dp only): not all-reduced over the whole
    mesh ahead of the gather, as a partial entering a bigger value otherwise is."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta[ir.VAL] = torch.empty(4, 8)
    gathered = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "other"))
    gathered.meta[ir.VAL] = torch.empty(8, 8)
    done = g.call_function(c10d.wait_tensor.default, (gathered,))
    done.meta[ir.VAL] = torch.empty(8, 8)
    g.output((done,))
    gm = torch.fx.GraphModule({}, g)
    shard_graph(gm, make_mesh(2), {"x": (Partial(),)}, ["g"])
    assert count_ops(gm, c10d.all_reduce.default) == 0
    assert done.meta[ir.SHARD] == (Partial(),)


def test_row_dims_follow_the_batch_rows_through_the_graph():
    """row_dims: where data parallelism's split of the batch lands on each value (a
    transpose moves it; a weight has none)."""
    from fxpar.core.sharding import row_dims

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).transpose(0, 1).sum(-1).mean()

    gm, _ = capture(M(), torch.randn(4, 6, 8))
    rows = row_dims(gm)
    by = {n.target: d for n, d in rows.items() if n.op == "call_function"}
    assert by[aten.transpose.int] == 1
    weight = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert weight.meta[ir.ROLE] == "param" and weight not in rows
    batch = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[ir.ROLE] == "batch")
    assert rows[batch] == 0

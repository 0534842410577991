"""The sharding engine on tiny graphs: DTensor rules, inserted collectives, local shapes."""
import torch
import torch.fx

from fxpar.compiler import ir
from fxpar.compiler.capture import capture
from fxpar.compiler.graphs import count_ops
from fxpar.compiler.sharding import Partial, Replicate, Shard, make_mesh, redistribute, shard_graph

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

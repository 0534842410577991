"""BatchNorm: eager's numerics on one device, sums where the batch is split.

On one device (one microbatch) the captured graph keeps BatchNorm's ATen ops, so the step
runs eager's kernels: a ResNet block whose last BatchNorm scale starts at zero (timm's
zero_init_last) trains bit for bit as eager does. Behind that scale the gradients are small
differences of large sums: BatchNorm decomposed into sums (what dp needs) rounds them
otherwise (timm's ResNet-18: 1e-3 of a bias in five SGD steps; the block here: 6e-6).
Plans that split the batch keep the decomposition (statistics all-reduced across ranks, or
the microbatch refusal)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.core import ir
from fxpar.compiler.capture import capture

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BN_FORWARD = aten._native_batch_norm_legit_functional.default
BN_BACKWARD = aten.native_batch_norm_backward.default


class ResBlockNet(nn.Module):
    """conv -> BN -> relu -> conv -> BN (scale zero-initialised) + skip -> relu -> head."""

    def __init__(self, ch=8, classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(ch)
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        nn.init.zeros_(self.bn2.weight)
        self.head = nn.Linear(ch, classes)

    def forward(self, batch):
        x, y = batch
        h = F.relu(self.bn0(self.stem(x)))
        r = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h)))))
        return F.cross_entropy(self.head(F.relu(h + r).mean((2, 3))), y)


def _batch():
    g = torch.Generator().manual_seed(1)
    # images with a mean well off zero (unnormalised pixels): the statistics' sums cancel
    return (torch.randn(8, 3, 12, 12, generator=g) * 0.3 + 0.5,
            torch.randint(0, 5, (8,), generator=g))


def _ops(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_one_device_keeps_batchnorm_ops_and_trains_as_eager():
    torch.manual_seed(0)
    model, batch = ResBlockNet(), _batch()
    ref = copy.deepcopy(model)
    pm = fxpar.parallelize(model, 1, example_batch=batch, plan={"codegen": "eager"},
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    ops = _ops(pm.stage_graphs["capture"]["joint"])
    assert {BN_FORWARD, BN_BACKWARD} <= ops
    assert aten.var_mean.correction not in ops
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(4):
        loss = pm.step(batch)
        opt.zero_grad()
        want = ref(batch)
        want.backward()
        opt.step()
        assert float(loss) == want.item()
    got = pm.full_state_dict()
    assert got["bn2.weight"].abs().max() > 0  # the zero-initialised scale did train
    for name, want in ref.state_dict().items():
        # the same kernels in the same order: equal, element by element (the decomposed
        # BatchNorm missed this by 6e-6 of an element of bn1.bias, 2e-6 of stem.weight)
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0, msg=name)


def test_capture_decomposes_batchnorm_by_default():
    """capture() alone (the planner's, the passes' unit tests) decomposes BatchNorm into
    sums, which any plan can shard; compile asks for the ATen ops on one device only."""
    model, batch = ResBlockNet(), _batch()
    gm, _ = capture(model, batch)
    assert not {BN_FORWARD, BN_BACKWARD} & _ops(gm)
    gm, sig = capture(model, batch, decompose_batch_norm=False)
    assert {BN_FORWARD, BN_BACKWARD} <= _ops(gm)
    assert sig.mutated_buffers[:2] == ["bn0.running_mean", "bn0.running_var"]
    fwd = [n for n in gm.graph.nodes if n.target is BN_FORWARD]
    assert [n.meta[ir.MODULE] for n in fwd] == ["bn0", "bn1", "bn2"]
    assert all(n.meta[ir.REGION] == ir.FORWARD for n in fwd)


def test_dp_still_all_reduces_batchnorm_statistics():
    """dp=2 computes the statistics of the global batch: sums all-reduced in the forward."""
    prog = fxpar.compile(ResBlockNet(), 2, example_batch=_batch(), plan={"dp": 2})
    gm = prog.graph
    assert not {BN_FORWARD, BN_BACKWARD} & _ops(gm)
    fwd_waits = [n for n in gm.graph.nodes if n.target is c10d.wait_tensor.default
                 and any(u.meta.get(ir.REGION) == ir.FORWARD for u in n.users)]
    assert {w.meta[ir.MODULE] for w in fwd_waits} >= {"bn0", "bn1", "bn2"}


def test_one_device_microbatches_still_refuse_batch_statistics():
    """Microbatches run apart: BatchNorm's statistics of a part are not the batch's. The
    refusal reads the decomposed sums, so one device with microbatches keeps them."""
    class BatchStats(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(16, 8), nn.BatchNorm1d(8, track_running_stats=False)

        def forward(self, batch):
            return F.mse_loss(self.bn(self.lin(batch[0])), batch[1])

    batch = (torch.randn(8, 16), torch.randn(8, 8))
    with pytest.raises(fxpar.PlanError, match="microbatches > 1: rows of the batch"):
        fxpar.compile(BatchStats(), 1, example_batch=batch, plan={"microbatches": 2})


@pytest.mark.parametrize("plan", [{"remat": "sqrt"}, {"precision": "bf16"}])
def test_one_device_passes_take_batchnorm_ops(plan):
    """remat and mixed precision run over the ATen BatchNorm ops: the step still trains
    (remat exactly as eager; bf16 close to it)."""
    torch.manual_seed(0)
    model, batch = ResBlockNet(), _batch()
    ref = copy.deepcopy(model)
    pm = fxpar.parallelize(model, 1, example_batch=batch, plan={"codegen": "eager", **plan},
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        loss = pm.step(batch)
        opt.zero_grad()
        want = ref(batch)
        want.backward()
        opt.step()
    exact = "precision" not in plan
    torch.testing.assert_close(torch.as_tensor(float(loss)), want.detach(),
                               rtol=1e-6 if exact else 2e-2, atol=0 if exact else 1e-2)
    got = pm.full_state_dict()
    for name, w in ref.state_dict().items():
        if exact:
            torch.testing.assert_close(got[name], w, rtol=1e-6, atol=0, msg=name)
        elif w.is_floating_point():
            torch.testing.assert_close(got[name], w, rtol=5e-2, atol=5e-3, msg=name)
    assert pm.evaluate(batch) > 0

"""Buffers a step updates, under microbatches (Plan.batch_stats; core/graphs.
summed_buffer_updates; runtime/pipeline.py writes each microbatch's update back).

A buffer that only adds (an MoE's tokens-per-expert counter, BatchNorm's num_batches_tracked)
is summed over the microbatches: exactly one step on the whole batch. BatchNorm's running
statistics are not a sum: refused by default, and with batch_stats="microbatch" trained as
gradient accumulation in eager PyTorch (each microbatch its own batch)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.compiler import capture as cap
from fxpar.core.graphs import summed_buffer_updates

from workers import build


class CountingMoE(torch.nn.Module):
    """Top-1 routing over 4 experts with a load counter updated in the forward (as
    torchtitan's MoE updates `tokens_per_expert`, a buffer outside the state dict)."""

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.router = torch.nn.Linear(d, experts)
        self.experts = torch.nn.Parameter(torch.randn(experts, d, d) * 0.1)
        self.head = torch.nn.Linear(d, 2)
        self.register_buffer("tokens_per_expert", torch.zeros(experts), persistent=False)

    def forward(self, batch):
        x, y = batch
        scores = self.router(x).softmax(-1)
        choice = F.one_hot(scores.argmax(-1), scores.shape[-1]).to(x.dtype)
        with torch.no_grad():
            self.tokens_per_expert.add_(choice.sum(0))
        h = torch.einsum("be,edk,bd->bk", choice * scores, self.experts, x)
        return F.cross_entropy(self.head(torch.tanh(h)), y)


def _moe_batch(step, rows=8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 2, (rows,), generator=g)


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def test_which_buffer_updates_are_sums():
    model, batch_fn, _ = build("convbn")
    gm, sig = cap.capture(model, batch_fn(0), None)
    kinds = dict(zip(sig.mutated_buffers, summed_buffer_updates(gm, sig)))
    # num_batches_tracked + 1: one step adds 1, m microbatches would add m
    assert kinds == {f"bn{i}.{b}": False for i in (1, 2)
                     for b in ("running_mean", "running_var", "num_batches_tracked")}
    gm, sig = cap.capture(CountingMoE(), _moe_batch(0), None)
    assert summed_buffer_updates(gm, sig) == [True]


class Counters(torch.nn.Module):
    """Buffers that only add, of which just the row sums (`rows`, `labels`) add up over
    microbatches to one step's update."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        for name in ("rows", "labels", "mean", "calls", "seen", "scaled"):
            self.register_buffer(name, torch.zeros(8 if name in ("rows", "mean", "scaled")
                                                   else 2 if name == "labels" else ()))

    def forward(self, batch):
        x, y = batch
        h = self.lin(x) * (1 + self.seen).reciprocal()  # the loss reads a counter's old value
        with torch.no_grad():
            self.rows.add_(x.sum(0))
            self.labels.add_(F.one_hot(y, 2).sum(0).to(x.dtype))
            self.mean.add_(x.mean(0))  # a mean: m microbatches add m means
            self.calls.add_(1)  # a constant: added once per microbatch
            self.seen.add_((y >= 0).sum())  # a row sum, but the loss reads it
            self.scaled.add_(x.sum(0) * self.rows)  # reads a buffer earlier microbatches moved
        return F.cross_entropy(h, y)


def test_only_row_sums_nobody_reads_are_summed():
    gm, sig = cap.capture(Counters(), _moe_batch(0), None)
    kinds = dict(zip(sig.mutated_buffers, summed_buffer_updates(gm, sig)))
    assert kinds == {"rows": True, "labels": True, "mean": False, "calls": False,
                     "seen": False, "scaled": False}


def test_a_step_counter_under_microbatches_is_refused():
    """frozen_unused counts its forward calls (+1): 2 microbatches would count 2 per step."""
    from fxpar.examples import zoo
    model, spec = zoo.build("frozen_unused")
    with pytest.raises(fxpar.PlanError, match=r"buffers \['calls'\] once per microbatch"):
        fxpar.parallelize(model, 1, example_batch=spec.batch(0), plan={"microbatches": 2})


def _eager_whole(model, batches):
    model = copy.deepcopy(model)
    opt = sgd(model.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = model(b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def _eager_accumulated(model, batches, m):
    """Gradient accumulation in eager PyTorch: m microbatches a step, mean loss."""
    model = copy.deepcopy(model)
    opt = sgd(model.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        parts = [tuple(t.chunk(m)[i] for t in b) for i in range(m)]
        total = 0.0
        for p in parts:
            loss = model(p) / m
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, model


def _fxpar(model, batches, plan, devices=1):
    pm = fxpar.parallelize(copy.deepcopy(model), devices, example_batch=batches[0],
                           optimizer=sgd, plan=plan)
    return [pm.step(b).item() for b in batches], pm


def test_a_counter_is_summed_over_microbatches_exactly():
    torch.manual_seed(0)
    model = CountingMoE()
    batches = [_moe_batch(s) for s in range(3)]
    ref_losses, ref = _eager_whole(model, batches)
    losses, pm = _fxpar(model, batches, {"microbatches": 2})
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    state = pm.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    assert torch.equal(pm.model.tokens_per_expert, ref.tokens_per_expert)  # 24 tokens counted
    assert float(ref.tokens_per_expert.sum()) == 24


def test_batchnorm_under_microbatches_is_refused_or_accumulated_as_asked():
    model, batch_fn, _ = build("convbn")
    batches = [batch_fn(s) for s in range(3)]
    with pytest.raises(fxpar.PlanError, match="batch_stats='microbatch'"):
        _fxpar(model, batches, {"microbatches": 2})
    ref_losses, ref = _eager_accumulated(model, batches, 2)
    losses, pm = _fxpar(model, batches, {"microbatches": 2, "batch_stats": "microbatch"})
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    state = pm.full_state_dict()
    for k, v in ref.state_dict().items():  # running statistics moved once per microbatch
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert int(state["bn1.num_batches_tracked"]) == 6


def counter_pp_rank():
    torch.manual_seed(0)
    model = CountingMoE()
    batches = [_moe_batch(s) for s in range(3)]
    losses, pm = _fxpar(model, batches, {"pp": 2, "microbatches": 2}, devices=2)
    return losses, pm.full_state_dict(), pm.model.tokens_per_expert.clone(), \
        sorted(pm.pipeline_runner.p.buffer_stages.get(0, {0}))


@pytest.mark.slow
def test_a_counter_under_a_pipeline_is_exact():
    """pp=2, 2 microbatches on 2 ranks (a refusal before): the rank whose stage holds the
    counter counts every token of the step; losses and weights equal one process."""
    torch.manual_seed(0)
    model = CountingMoE()
    batches = [_moe_batch(s) for s in range(3)]
    ref_losses, ref = _eager_whole(model, batches)
    out = fxpar.launch(counter_pp_rank, 2)
    for rank, (losses, state, counter, stages) in out.items():
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
        if rank in stages:  # the counter's stage's rank
            assert torch.equal(counter, ref.tokens_per_expert)


class CrossStage(torch.nn.Module):
    """A buffer read at the start of the network and updated from its end: under pp=2 read
    by stage 0, updated by stage 1."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 2)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, batch):
        x, y = batch
        h = x + self.ema
        for layer in self.layers:
            h = torch.tanh(layer(h))
        with torch.no_grad():
            self.ema.mul_(0.5).add_(0.5 * h.mean(0))
        return F.cross_entropy(self.head(h), y)


def cross_stage_rank():
    torch.manual_seed(0)
    model = CrossStage()
    batches = [_moe_batch(s) for s in range(3)]
    losses, pm = _fxpar(model, batches, {"pp": 2}, devices=2)
    try:
        _fxpar(model, batches, {"pp": 2, "microbatches": 2, "batch_stats": "microbatch"},
               devices=2)
        refused = ""
    except fxpar.PlanError as e:
        refused = str(e)
    return losses, pm.full_state_dict(), pm.model.ema.clone(), refused


@pytest.mark.slow
def test_a_buffer_one_stage_updates_and_another_reads():
    """pp=2: the stage-0 rank's copy of a buffer stage 1 updates is sent the new value after
    each step (it stayed stale: the second step's loss and the saved buffer differed from
    eager); with microbatches, where it cannot be sent in time, a PlanError."""
    torch.manual_seed(0)
    model = CrossStage()
    ref_losses, ref = _eager_whole(model, [_moe_batch(s) for s in range(3)])
    out = fxpar.launch(cross_stage_rank, 2)
    for rank, (losses, state, ema, refused) in out.items():
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["ema"], ref.ema, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ema, ref.ema, rtol=1e-5, atol=1e-6)
        assert "updated by pipeline stage 1 and read by stages [0, 1]" in refused

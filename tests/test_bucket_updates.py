"""Optimizer updates between the last gradient all-reduces (runtime/bucket_updates.py): each
bucket stepped once reduced, while later buckets are still in flight, equal bit for bit to one
update after the graph."""
import copy
import functools

import pytest
import torch

import fxpar
from fxpar.examples import models as M
from fxpar.runtime import bucket_updates as bu
from fxpar.runtime import comm

c10d = torch.ops._c10d_functional
CFG = M.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@functools.lru_cache(maxsize=None)  # (interleave copies the graph it reads)
def _dp2(bucket_mb=0.01):
    torch.manual_seed(0)
    return fxpar.compile(M.GPT(CFG), 2, example_batch=M.gpt_batch(CFG, 8),
                         plan={"dp": 2, "bucket_mb": bucket_mb, "codegen": "eager"})


@pytest.mark.slow  # (make test's 6 minutes)
def test_an_update_after_each_bucket_wait_once_its_parameters_are_read_no_more():
    program = _dp2()
    n = len(program.signature.param_names)
    gm, buckets = bu.interleave(program.graph, n)
    assert gm is not None and len(buckets) >= 3
    with_grad = [i for i, g in enumerate(next(iter(reversed(program.graph.graph.nodes))
                                         ).args[0][1:1 + n]) if g is not None]
    assert sorted(i for b in buckets for i in b) == with_grad  # every gradient, once
    nodes = list(gm.graph.nodes)
    pos = {x: i for i, x in enumerate(nodes)}
    updates = [x for x in nodes if x.target is bu.update_ready]
    waits = [x for x in nodes if x.target is c10d.wait_tensor.default]
    params = [x for x in nodes if x.op == "placeholder"][:n]
    assert [u.args[0] for u in updates] == list(range(len(buckets)))
    out = nodes[-1]
    for u, idx in zip(updates, buckets):
        assert list(u.args[2:]) == [out.args[0][1 + i] for i in idx]  # that bucket's grads
        assert pos[u] > pos[u.args[1]]  # after the loss (checked before the first update)
        assert all(pos[r] < pos[u] for i in idx for r in params[i].users if r is not u)
        assert u.meta["region"] == "optimizer"  # its own segment on the timeline
    # the point: the first buckets are stepped before the last bucket's wait
    assert pos[updates[0]] < pos[waits[-1]]
    assert bu.interleave(_dp2(bucket_mb=1000).graph, n) == (None, [])  # one bucket
    # markers: comm.lower labels each update "optimizer", then back to "packing"
    marks = [x.args[0] for x in comm.lower(gm).graph.nodes if x.target is comm.mark]
    assert marks.count("optimizer") == len(buckets)


def test_a_loss_waited_at_the_end_is_waited_before_the_first_update():
    """A sum loss: only the output reads its all-reduce, so the overlap pass waits for it at
    the end of the graph; the first update checks the loss, so the wait moves before it."""
    torch.manual_seed(0)
    program = fxpar.compile(M.SumLossMLP(), 2, example_batch=(torch.randn(8, 16),
                                                              torch.randn(8, 4)),
                            plan={"dp": 2, "bucket_mb": 1e-6, "codegen": "eager"})
    n = len(program.signature.param_names)
    before = list(program.graph.graph.nodes)
    loss = before[-1].args[0][0]
    assert loss.target is c10d.wait_tensor.default  # waited after every bucket:
    assert before.index(loss) > max(i for i, x in enumerate(before)
                                    if x.target is c10d.wait_tensor.default and x is not loss)
    gm, buckets = bu.interleave(program.graph, n)
    assert gm is not None and len(buckets) >= 2
    nodes = list(gm.graph.nodes)
    updates = [x for x in nodes if x.target is bu.update_ready]
    loss = updates[0].args[1]
    assert loss.target is c10d.wait_tensor.default
    assert nodes.index(loss) < nodes.index(updates[0])
    waits = [x for x in nodes if x.target is c10d.wait_tensor.default]
    assert nodes.index(updates[0]) < nodes.index(waits[-1])  # still ahead of the last bucket


def test_an_update_waits_for_a_later_reader_of_a_view_of_its_parameters():
    """The optimizer updates in place: a node after the bucket's wait that reads a view of
    one of its parameters (a transpose here; a compiled run's output can be one too) keeps
    the update behind it."""
    program = _dp2()
    n = len(program.signature.param_names)
    _, buckets = bu.interleave(program.graph, n)
    gm = torch.fx.GraphModule(program.graph, copy.deepcopy(program.graph.graph))
    nodes = list(gm.graph.nodes)
    param = [x for x in nodes if x.op == "placeholder"][buckets[0][0]]
    with gm.graph.inserting_before(nodes[-1]):
        view = gm.graph.call_function(torch.ops.aten.t.default, (param,))
        reader = gm.graph.call_function(torch.ops.aten.clone.default, (view,))
    out, _ = bu.interleave(gm, n)
    nodes = list(out.graph.nodes)
    first = next(x for x in nodes if x.target is bu.update_ready and x.args[0] == 0)
    reader = next(x for x in nodes if x.name == reader.name)
    assert nodes.index(first) > nodes.index(reader)


def test_a_leftover_gradient_is_not_stepped_once_per_bucket():
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.SGD(ps, lr=1.0)
    ps[1].grad = torch.ones(3)  # e.g. from an eager backward of the user's own
    with bu.BucketUpdates(opt, ps, [[0], [1]]) as updates:
        updates(0, torch.tensor(1.0), [torch.ones(3)])
    assert torch.equal(ps[0].detach(), torch.zeros(3))
    assert torch.equal(ps[1].detach(), torch.ones(3)) and ps[1].grad is None


def test_usable_follows_the_ranks_optimizer_as_it_is_now():
    """Checked every step: a hook registered since, or an optimizer replaced by one over other
    tensors, runs the step's update after the graph instead; a replacement over the same
    parameters is the one stepped."""
    ps = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    first = torch.optim.SGD(ps, lr=0.1)
    updates = bu.BucketUpdates(first, ps, [[0], [1]])
    assert updates.usable(first) and updates.opt is first
    second = torch.optim.AdamW(ps)
    assert updates.usable(second) and updates.opt is second
    assert not updates.usable(torch.optim.AdamW(ps + [torch.nn.Parameter(torch.ones(1))]))
    second.register_step_post_hook(lambda *a: None)
    assert not updates.usable(second)


def test_splittable():
    p = [torch.nn.Parameter(torch.ones(2))]
    assert bu.splittable(torch.optim.AdamW(p)) is None
    assert bu.splittable(torch.optim.SGD(p, lr=0.1, momentum=0.9)) is None
    assert "LBFGS" in bu.splittable(torch.optim.LBFGS(p))

    class Mine(torch.optim.SGD):
        pass
    assert "Mine" in bu.splittable(Mine(p, lr=0.1))
    opt = torch.optim.Adam(p)
    opt.register_step_pre_hook(lambda *a: None)
    assert "hooks" in bu.splittable(opt)
    opt = torch.optim.Adam(p)
    torch.optim.lr_scheduler.StepLR(opt, 1)  # wraps step() to count calls: fine
    assert bu.splittable(opt, p) is None
    opt.step = lambda *a: None
    assert "replaced" in bu.splittable(opt)
    other = torch.nn.Parameter(torch.ones(2))
    assert "not this rank's parameters" in bu.splittable(torch.optim.Adam(p + [other]), p)


def bucket_updates_rank():
    """Rank function: dp=2 with small buckets, updates between the waits vs one update after
    the graph (a step hook on rank 0 forces it there: a hook on one rank only, as logging
    might register), AdamW; then a NaN loss."""
    import os

    from workers import LogNet
    batches = [M.gpt_batch(CFG, 8, seed=s) for s in range(3)]
    out = {}
    opts = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}
    for name, opt in opts.items():
        runs = []
        for one_update in (False, True):
            torch.manual_seed(0)
            pm = fxpar.parallelize(M.GPT(CFG), 2, example_batch=batches[0], optimizer=opt,
                                   plan=dict(dp=2, bucket_mb=0.01, codegen="eager"))
            if one_update and os.environ["RANK"] == "0":  # rank 1 still steps per bucket:
                # the updates issue no collective, so the ranks' collectives still pair up
                pm.optimizer.register_step_post_hook(lambda *a: None)
            losses = [pm.step(b).item() for b in batches]
            spans = pm.recorder.steps[-1][3]
            runs.append((losses, pm.full_state_dict(), pm._bucket_updates is not None,
                         [(s.cat, s.name) for s in spans if s.track == "compute"]))
        (la, sa, on_a, spans_a), (lb, sb, _, _) = runs
        # the timeline: one optimizer segment per bucket, packing (the next bucket's wait and
        # unpacking) between them
        cats = [c for c, _ in spans_a if c != "blocked"]
        tail = cats[cats.index("optimizer"):]
        out[name] = dict(active=on_a, same_losses=la == lb,
                         same_state=all(torch.equal(sa[k], sb[k]) for k in sa),
                         stepped_in_tail="packing" in tail and tail.count("optimizer") >= 2)
    # a NaN loss: no bucket updated, NonFiniteLossError on every rank after the graph
    torch.manual_seed(0)
    pm = fxpar.parallelize(LogNet(), 2, example_batch=torch.ones(8, 4),
                           plan=dict(dp=2, bucket_mb=1e-6, codegen="eager"))
    pm.step(torch.ones(8, 4))
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    bad = torch.ones(8, 4)
    bad[-1] = -100.0
    try:
        pm.step(bad)
        out["nan"] = "no error"
    except fxpar.NonFiniteLossError:
        out["nan"] = "raised"
    out["nan_active"] = pm._bucket_updates is not None
    out["nan_unchanged"] = all(torch.equal(before[k], v) for k, v in pm.full_state_dict().items())
    return out


@pytest.mark.slow  # (make test's time: runs in CI's slow suite)
def test_bucket_updates_equal_one_update_and_skip_a_nan_step():
    res = fxpar.launch(bucket_updates_rank, 2)
    for r in (0, 1):
        out = res[r]
        for name in ("adamw",):
            assert out[name] == dict(active=True, same_losses=True, same_state=True,
                                     stepped_in_tail=True), (r, name, out[name])
        assert out["nan"] == "raised" and out["nan_active"] and out["nan_unchanged"], out


def optimizers_rank():
    """Rank function: bucket updates vs one update (a step hook forces it) with Inductor and
    torch's fused AdamW, and with an SGD-with-momentum instance of two param groups under an
    lr scheduler (op by op)."""
    batches = [M.gpt_batch(CFG, 8, seed=s) for s in range(3)]
    out = {}
    for name, codegen in (("adamw", "inductor"), ("sgd groups", "eager")):
        runs = []
        for one_update in (False, True):
            torch.manual_seed(0)
            model = M.GPT(CFG)
            if name == "adamw":
                opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
            else:
                decay = [p for p in model.parameters() if p.dim() > 1]
                rest = [p for p in model.parameters() if p.dim() <= 1]
                opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.1},
                                       {"params": rest, "lr": 0.05}], lr=0.1, momentum=0.9)
            pm = fxpar.parallelize(model, 2, example_batch=batches[0], optimizer=opt,
                                   plan=dict(dp=2, bucket_mb=0.01, codegen=codegen))
            sched = torch.optim.lr_scheduler.StepLR(pm.optimizer, 1, gamma=0.5)
            if one_update:
                pm.optimizer.register_step_post_hook(lambda *a: None)
            losses = []
            for b in batches:
                losses.append(pm.step(b).item())
                sched.step()
            runs.append((losses, pm.full_state_dict(), pm._bucket_updates is not None,
                         pm.optimizer_fused))
        (la, sa, on, fused), (lb, sb, _, _) = runs
        out[name] = dict(active=on, fused=fused, same_losses=la == lb,
                         same_state=all(torch.equal(sa[k], sb[k]) for k in sa))
    return out


@pytest.mark.slow  # (Inductor compiles: ~1 min on 2 cores)
def test_bucket_updates_with_inductor_fused_adamw_and_param_groups():
    res = fxpar.launch(optimizers_rank, 2)
    for r in (0, 1):
        assert res[r]["adamw"] == dict(active=True, fused=True, same_losses=True,
                                       same_state=True), res[r]
        assert res[r]["sgd groups"] == dict(active=True, fused=False, same_losses=True,
                                            same_state=True), res[r]

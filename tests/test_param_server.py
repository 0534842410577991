"""Parameter-server data parallelism (Plan.ps, runtime/param_server.py): the shares, the plan
errors, the worker programs compile makes (synchronous: the dp graph without its gradient
all-reduce; asynchronous: one share of the batch with no collective), a server's protocol
driven message by message (when an update is applied, whom it waits for, which replies are
held back, late pushes joined or dropped); multi-process: synchronous training equals one
process, asynchronous workers end on the servers' parameters within the staleness bound,
and what is not supported is refused on every rank."""
import pytest
import torch

import fxpar
from fxpar.core.errors import NonFiniteLossError, PlanError
from fxpar.core.graphs import count_ops
from fxpar.examples import models as M
from fxpar.runtime import param_server as ps

c10d = torch.ops._c10d_functional


def test_shares_are_whole_tensors_spread_by_size():
    owner = ps.assign([100, 10, 60, 50, 5], 2)
    load = [sum(n for n, o in zip([100, 10, 60, 50, 5], owner) if o == j) for j in range(2)]
    assert owner[0] != owner[2]  # the two largest apart
    assert abs(load[0] - load[1]) <= 100
    assert sorted(load) == [110, 115]
    assert ps.assign([3, 3, 3], 1) == [0, 0, 0]


@pytest.mark.parametrize("bad, match", [
    ({"tp": 2}, "tp=2"), ({"zero": 1}, "zero=1"), ({"max_grad_norm": 1.0}, "max_grad_norm"),
    ({"precision": "fp16"}, "precision='fp16'"), ({"verify": True}, "verify=True"),
    ({"microbatches": 2, "schedule": "gpipe"}, "microbatches=2"),
    ({"grad_compression": "1bit-adam"}, "grad_compression")])
def test_plan_errors_name_what_parameter_servers_need(bad, match):
    world = 2 * bad.get("tp", 1) + 1
    with pytest.raises(PlanError, match=match):
        fxpar.core.plan.resolve({"dp": 2, "ps": 1, **bad}, world)


def test_world_size_counts_the_servers():
    resolve = fxpar.core.plan.resolve
    assert resolve({"dp": 3, "ps": 1}, 4).ps == 1
    assert resolve({"ps": 2}, 5).dp == 3
    with pytest.raises(PlanError, match=r"dp\*tp\*pp \+ ps = 2\*1\*1 \+ ps = 1 = 3"):
        resolve({"dp": 2, "ps": 1}, 4)
    with pytest.raises(PlanError, match="needs ps > 0"):
        resolve({"dp": 2, "ps_staleness": 1}, 2)
    with pytest.raises(PlanError, match="never searched"):
        fxpar.core.plan.needs_search({"ps": 1, "dp": "auto"})
    with pytest.raises(PlanError, match="integer >= 0"):
        resolve({"dp": 2, "ps": -1}, 1)


def test_worker_programs():
    """Synchronous: the dp graph without the gradient all-reduce (the loss's kept: the
    workers' step is one global batch); asynchronous: one worker's share of the batch alone,
    with no collective at all."""
    cfg = M.GPTConfig(n_layer=1)
    batch = M.gpt_batch(cfg, 8)
    plain = fxpar.compile(M.GPT(cfg), 2, example_batch=batch, plan={"dp": 2})
    sync = fxpar.compile(M.GPT(cfg), 3, example_batch=batch, plan={"dp": 2, "ps": 1})
    asyn = fxpar.compile(M.GPT(cfg), 3, example_batch=batch,
                         plan={"dp": 2, "ps": 1, "ps_staleness": 2})
    assert plain.local_graph is None
    n_plain = count_ops(plain.graph, c10d.all_reduce.default)
    assert 0 < count_ops(sync.local_graph, c10d.all_reduce.default) < n_plain
    collectives = [n for n in asyn.local_graph.graph.nodes if n.op == "call_function"
                   and getattr(n.target, "namespace", None) == "_c10d_functional"]
    assert collectives == []
    rows = [n.meta["val"].shape[0] for n in asyn.local_graph.graph.nodes
            if n.op == "placeholder"][-2:]  # (idx, targets)
    assert rows == [4, 4]
    assert "worker" in asyn.stage_graphs


class _Sent:
    def __init__(self, log, dst, buf):
        log.append((dst, int(buf[0]), buf.clone()))

    def wait(self):
        pass


def _server(monkeypatch, staleness, workers=(0, 1)):
    """A server of one parameter p (2 values, SGD lr=1) whose sends are recorded."""
    sent = []
    monkeypatch.setattr(ps.dist, "isend", lambda buf, dst, group=None: _Sent(sent, dst, buf))
    p = torch.zeros(2, requires_grad=True)
    server = ps.Server([p], lambda params: torch.optim.SGD(params, lr=1.0), 0, list(workers),
                       staleness, None)
    return server, p, sent


def _push(step, grad, loss=1.0):
    return torch.tensor([float(step), loss, *grad])


def test_a_synchronous_server_waits_for_every_worker_and_sums_in_worker_order(monkeypatch):
    server, p, sent = _server(monkeypatch, 0)
    server.handle(1, _push(0, [1.0, 2.0]))
    assert server.version == 0 and sent == []  # worker 0 not in yet: no update, no reply
    server.handle(0, _push(0, [10.0, 20.0], loss=3.0))
    assert server.version == 1
    assert p.tolist() == [-11.0, -22.0]  # the sum (the workers' Partial gradients)
    assert sorted((d, v) for d, v, _ in sent) == [(0, 1), (1, 1)]  # both read version 1
    assert sent[0][2][1:].tolist() == [-11.0, -22.0]
    assert server.losses[0] == 2.0


def test_an_asynchronous_server_leaves_its_slowest_worker_out(monkeypatch):
    """3 workers, k=1: update 0 is applied once two pushed step 0, and they read it; the
    third's step 0 arrives late, read version 0, joins update 1 (staleness 1) and is
    answered at once with the newest version."""
    server, p, sent = _server(monkeypatch, 1, workers=(0, 1, 2))
    server.handle(0, _push(0, [2.0, 2.0]))
    assert server.version == 0 and sent == []
    server.handle(1, _push(0, [4.0, 4.0]))
    assert server.version == 1 and p.tolist() == [-3.0, -3.0]  # their mean
    assert sorted((d, v) for d, v, _ in sent) == [(0, 1), (1, 1)]
    assert server.stats["partial"] == 1 and not server.step_done(0)  # worker 2 not past 0
    server.handle(2, _push(0, [6.0, 6.0]))  # late
    assert server.stats["late"] == 1 and server.version == 1 and server.step_done(0)
    assert [(d, v) for d, v, _ in sent][-1] == (2, 1)
    server.handle(0, _push(1, [0.0, 0.0]))
    server.handle(1, _push(1, [3.0, 3.0]))  # update 1: steps 1 of workers 0, 1 + the late one
    assert server.version == 2 and p.tolist() == [-6.0, -6.0]
    assert server.stats["max_staleness"] == 1 and server.stats["dropped"] == 0


def test_a_push_older_than_the_bound_is_dropped_and_its_worker_skips(monkeypatch):
    server, p, sent = _server(monkeypatch, 1, workers=(0, 1, 2))
    for step in (0, 1):
        server.handle(0, _push(step, [1.0, 1.0]))
        server.handle(1, _push(step, [1.0, 1.0]))
    assert server.version == 2 and p.tolist() == [-2.0, -2.0]
    server.handle(2, _push(0, [100.0, 100.0]))  # read version 0, would join update 2: stale 2
    assert server.stats["dropped"] == 1 and p.tolist() == [-2.0, -2.0]
    assert [(d, v) for d, v, _ in sent][-1] == (2, 2)  # it reads version 2 ...
    assert not server.step_done(1)
    server.handle(2, torch.tensor([float(ps.SKIP), 2.0, 0.0, 0.0]))  # ... and skips step 1
    assert server.step_done(1) and len(sent) == 5  # (a skip is not answered)


def test_a_non_finite_loss_stops_the_server(monkeypatch):
    server, _, _ = _server(monkeypatch, 0)
    with pytest.raises(NonFiniteLossError, match="worker rank 1"):
        server.handle(1, _push(0, [0.0, 0.0], loss=float("nan")))


# --- multi-process ---------------------------------------------------------------------------

@pytest.mark.slow  # (make test's 6 minutes)
def test_synchronous_parameter_servers_train_as_one_process(tmp_path):
    """2 workers + 1 server: the losses, the evaluation and the final parameters (on the
    workers and in the server's share) equal one process training on the whole batch;
    pm.save_pretrained is refused on every rank; pm.trace writes the workers' timelines."""
    import workers
    res = fxpar.launch(workers.param_server_rank, 3, {"ps": 1}, 4, None,
                       str(tmp_path / "trace.json"))
    ref = workers.param_server_reference(4)
    for r in (0, 1):
        losses, ev, state, stats, _ = res[r]
        torch.testing.assert_close(losses, ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ev, ref[1], rtol=1e-5, atol=1e-6)
        for k, v in ref[2].items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
        assert stats == {"pushes": 4, "skipped": 0}
    assert all("pm.save_pretrained is not supported" in res[r][4] for r in range(3))
    assert (tmp_path / "trace.json").stat().st_size > 0  # the workers' timelines
    share, server_stats = res[2][2], res[2][3]
    assert share and all(torch.equal(v, res[0][2][k]) for k, v in share.items())
    assert server_stats["updates"] == 4 and server_stats["partial"] == 0


@pytest.mark.slow
def test_two_synchronous_servers_split_the_parameters_and_stay_exact():
    import workers
    res = fxpar.launch(workers.param_server_rank, 4, {"ps": 2}, 3)
    ref = workers.param_server_reference(3)
    torch.testing.assert_close(res[0][0], ref[0], rtol=1e-5, atol=1e-6)
    shares = [set(res[r][2]) for r in (2, 3)]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] <= set(ref[2])
    for r in (2, 3):
        for k, v in res[r][2].items():
            torch.testing.assert_close(v, ref[2][k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_asynchronous_workers_end_on_the_servers_parameters():
    """2 workers + 1 server, staleness 2, one worker slowed: every step's staleness within
    the bound; after evaluate (a pull) both workers hold the server's parameters and agree
    on the loss."""
    import workers
    res = fxpar.launch(workers.param_server_rank, 3, {"ps": 1, "ps_staleness": 2}, 6, 1)
    (l0, ev0, s0, _, _), (l1, ev1, s1, _, _), (_, _, share, sst, _) = res[0], res[1], res[2]
    assert sst["updates"] == 6 and sst["max_staleness"] <= 2
    assert ev0 == ev1
    for k, v in share.items():
        assert torch.equal(v, s0[k]) and torch.equal(v, s1[k]), k
    assert all(x is None or x == x for x in l1)  # skipped steps: None


def test_an_optimizer_instance_is_refused_by_name():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(PlanError, match="optimizer=lambda ps"):
        ps.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.slow
def test_asynchronous_training_converges_near_synchronous():
    """3 workers + 1 server, 200 AdamW steps at lr 1e-3: the asynchronous plan's held-out
    loss within 2% of the synchronous plan's (which equals one process)."""
    import workers
    sync, asyn = {"ps": 1}, {"ps": 1, "ps_staleness": 2}
    res = fxpar.launch(workers.param_server_convergence_rank, 4, [sync, asyn], 200, 1e-3)[0]
    assert res[repr(asyn)] <= 1.02 * res[repr(sync)], res


@pytest.mark.slow
def test_a_checkpoint_resumes_parameter_servers_and_loads_in_one_process(tmp_path):
    """2 workers + 1 server: the steps after a load repeat the steps after the save exactly;
    the checkpoint (model from the workers, AdamW state from the server) read in one plain
    process holds what eager training holds after the same steps."""
    import workers
    path = str(tmp_path / "ck")
    after_save, after_load, extra, count = fxpar.launch(
        workers.param_server_checkpoint_rank, 3, {"ps": 1}, path)[0]
    assert after_save == after_load and extra == {"position": 2} and count == 4
    model_state, optim_state = fxpar.runtime.checkpoint.load_plain(path)
    ref = workers.param_server_reference(2)[2]
    for k, v in ref.items():
        torch.testing.assert_close(model_state[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"}
               for s in optim_state["state"].values())

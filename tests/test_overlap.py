"""The overlap pass on small graphs (order of starts and waits, the memory limit), alpha-beta
bucket sizing, and, under real processes, exposed communication measured from the timeline."""

import copy
import json
import types

import pytest
import torch

import fxpar
from fxpar.core import cost, ir
from fxpar.core.graphs import verify
from fxpar.compiler.capture import capture
from fxpar.compiler.pass_manager import PassContext, run_passes
from fxpar.core.plan import resolve
from fxpar.examples import models as M
from fxpar.passes import data_parallel, overlap
from workers import overlap_rank, zero_memory_rank

c10d = torch.ops._c10d_functional
CFG = M.GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)


def compile_plan(model, batch, dp=2, memory=None, captured=None, **plan):
    gm, sig = captured if captured is not None else capture(model, batch)
    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # (a captured graph is reused)
    ctx = PassContext(signature=sig, group_names={"dp": "g"}, overlap_memory_bytes=memory)
    snaps = {}
    gm = run_passes(gm, resolve({"dp": dp, **plan}, dp), ctx, "dp", snaps)
    return gm, snaps


def _pos(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _first_compute_user(node, pos):
    return min(node.users, key=pos.__getitem__)


def test_without_overlap_every_wait_follows_its_start():
    gm, snaps = compile_plan(M.GPT(CFG), M.gpt_batch(CFG, 4), zero=3, overlap=False)
    assert "overlap" not in snaps
    for start, wait in overlap.collective_pairs(gm.graph):
        assert start.next is wait


def test_gradient_bucket_waits_sink_to_the_end_and_starts_follow_their_last_gradient():
    gm, snaps = compile_plan(M.MLP(), (torch.randn(8, 16), torch.randn(8, 4)))
    pos = _pos(gm)
    buckets = [(s, w) for s, w in overlap.collective_pairs(gm.graph) if s.meta.get("bucket")]
    assert buckets
    last_backward = max(pos[n] for n in gm.graph.nodes
                        if n.meta.get(ir.REGION) == ir.BACKWARD and n.op == "call_function")
    for start, wait in buckets:
        # start: right after the packing of its inputs; wait: after every backward node
        assert pos[start] == max(pos[a] for a in start.all_input_nodes) + 1
        assert pos[wait] > last_backward
        assert pos[wait] == min(pos[u] for u in wait.users) - 1
    decision = gm.meta["overlap"]
    assert all(w.name in decision.sunk for _, w in buckets)


def test_overlap_only_reorders_so_the_manager_skips_its_fake_run():
    """The pass declares its values fresh (no fake run of the whole graph after it: a third
    of a tp=4 Mixtral's pass time): it moves nodes and nothing else - the same nodes, reading
    the same inputs, with the same values - and a fake run of its result agrees."""
    assert overlap.CONTRACT.values_fresh
    gm, snaps = compile_plan(M.GPT(CFG), M.gpt_batch(CFG, 4), zero=3)
    given = {n.name: n for n in snaps["data_parallel"]["dp"].graph.nodes}
    order = [n.name for n in gm.graph.nodes]
    assert sorted(order) == sorted(given) and order != list(given)  # (moved, none added)
    for n in gm.graph.nodes:
        old = given[n.name]
        assert [a.name for a in n.all_input_nodes] == [a.name for a in old.all_input_nodes]
        assert n.meta.get(ir.VAL) is old.meta.get(ir.VAL)
    verify(gm)  # (every value checked by a fake run)


@pytest.mark.slow  # (moved to keep make test under 6 minutes)
def test_zero3_gathers_are_prefetched_below_the_step_peak():
    """ZeRO-3 by default: the step's simulated peak does not grow (slack 0), yet the gathers
    are prefetched where the live set is below that peak: the forward's early (activations
    not yet saved), the backward's behind the previous layer's backward."""
    model, batch = M.GPT(CFG), M.gpt_batch(CFG, 4)
    gm_off, _ = compile_plan(model, batch, zero=3, overlap=False)
    gm, _ = compile_plan(model, batch, zero=3)
    decision = gm.meta["overlap"]
    assert decision.slack == 0
    pos = _pos(gm)
    gathers = [(s, w) for s, w in overlap.collective_pairs(gm.graph)
               if s.target is c10d.all_gather_into_tensor.default]
    assert len(gathers) == 6 + 2    # a forward gather per layer, backward's of h.0 and h.1
    prefetched = 0
    for start, wait in gathers:
        first_use = min(pos[u] for u in wait.users)
        assert pos[wait] == first_use - 1                    # waited on just before use
        assert pos[start] > max(pos[a] for a in start.all_input_nodes)  # after its input
        compute_between = [n for n in list(gm.graph.nodes)[pos[start]:pos[wait]]
                           if n.op == "call_function" and cost.node_flops(n) > 0]
        prefetched += bool(compute_between)
    assert prefetched >= len(gathers) // 2                  # most hide behind a matmul or more
    backward = [s for s, _ in gathers if s.meta[ir.REGION] == ir.BACKWARD]
    assert any(s.name in decision.hoisted for s in backward), decision.hoisted
    # starts of one kind keep their order (the backend serves them first in, first out);
    # each reduce-scatter starts after the previous one's wait (one in flight)
    for kind in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default):
        names = lambda g: [s.name for s, _ in overlap.collective_pairs(g.graph)
                           if s.target is kind]
        assert names(gm) == names(gm_off), kind
    scatters = [(s, w) for s, w in overlap.collective_pairs(gm.graph)
                if s.target is c10d.reduce_scatter_tensor.default]
    for (s, w), (s2, _) in zip(scatters, scatters[1:]):
        assert pos[s] < pos[w] < pos[s2]
    assert cost.simulate_liveness(gm).peak_total <= cost.simulate_liveness(gm_off).peak_total


def _layer_gather_bytes(gm):
    units = {}
    for s, w in overlap.collective_pairs(gm.graph):
        if s.target is c10d.all_gather_into_tensor.default:
            key = (w.meta[ir.REGION], ir.layer_of(w.meta[ir.MODULE]))
            units[key] = units.get(key, 0) + cost.tensor_bytes(s.meta[ir.VAL])
    return units


@pytest.mark.slow  # (make test's 6 minutes)
def test_overlap_memory_limit_bounds_the_peak():
    """With room to grow the peak (here a layer's gathered bytes), the simulated peak grows by
    at most that much; a reduce-scatter is waited on before the next one starts (one in
    flight: holding its input longer gains nothing on a first-in-first-out channel)."""
    model, batch = M.GPT(CFG), M.gpt_batch(CFG, 4)
    captured = capture(model, batch)
    gm_off, _ = compile_plan(model, batch, zero=3, overlap=False, captured=captured)
    unit = max(_layer_gather_bytes(gm_off).values())
    gm, _ = compile_plan(model, batch, zero=3, memory=unit, captured=captured)
    assert gm.meta["overlap"].slack == unit
    assert cost.simulate_liveness(gm).peak_total <= \
        cost.simulate_liveness(gm_off).peak_total + unit
    pos = _pos(gm)
    scatters = [(s, w) for s, w in overlap.collective_pairs(gm.graph)
                if s.target is c10d.reduce_scatter_tensor.default]
    assert len(scatters) > 3
    for (s, w), (s2, _) in zip(scatters, scatters[1:]):
        assert pos[s] < pos[w] < pos[s2]


def test_moved_collectives_are_labelled_for_the_graph_picture():
    gm, snaps = compile_plan(M.GPT(CFG), M.gpt_batch(CFG, 4), zero=3)
    labels = [n.meta["moved"] for n in snaps["overlap"]["dp"].graph.nodes if "moved" in n.meta]
    assert any(m.startswith("started") for m in labels)
    assert any(m.startswith("waited") for m in labels)


def test_zero3_packing_copies_rise_with_their_gathers():
    """A layer's shards copied into one all-gather input (ir.PACK) move with the gather: the
    copy sits right before its collective wherever the gather was started."""
    gm, _ = compile_plan(M.GPT(CFG), M.gpt_batch(CFG, 4), zero=3)
    decision = gm.meta["overlap"]
    packs = [n for n in gm.graph.nodes if n.meta.get(ir.PACK)]
    assert len(packs) >= 2 * CFG.n_layer                   # each block, forward and backward
    for pk in packs:
        (start,) = pk.users
        assert start.target is c10d.all_gather_into_tensor.default and pk.next is start
        assert all(a.op == "placeholder" for a in pk.all_input_nodes)
    assert sum(next(iter(pk.users)).name in decision.hoisted for pk in packs) >= CFG.n_layer


@pytest.mark.slow  # (make test's 6 minutes)
def test_zero3_gather_stopped_below_its_packing_copy_still_follows_it():
    """Where the memory limit stops a layer's backward all-gather right below its packing copy,
    the copy still precedes it. HF Llama (3 layers x 64, vocabulary 256) at dp=4, one sample
    per rank: a layer's weights outweigh the activations, as in a 12 x 1024 Llama, so the
    reduce-scatter of a layer's gradients, waited late, fits the room below the step's peak at
    the next layer's packing copy but not at its all-gather: the wait stops between the two,
    and the all-gather rises past it and stops at the copy (which was re-inserted one place
    too far, after its collective: graph lint's 'used before it has been defined')."""
    model, batch = M.hf_llama(vocab=256, hidden=64, layers=3), M.hf_lm_batch(256, 4, 16)
    gm, _ = compile_plan(model, batch, dp=4, zero=3)  # (run_passes lints after every pass)
    gm.graph.lint()
    decision, pos = gm.meta["overlap"], _pos(gm)
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    stopped = [n for n in gathers if n.meta[ir.REGION] == ir.BACKWARD
               and n.name in decision.hoisted and n.name in decision.limited
               and n.next.target is c10d.wait_tensor.default
               and n.next.args[0].target is c10d.reduce_scatter_tensor.default]
    assert stopped  # the case this test is for: a start stopped right above a sunk wait
    for start in gathers:
        (pk,) = start.all_input_nodes
        if start in stopped:
            assert pk.meta.get(ir.PACK)
        assert pk.op == "placeholder" or pk.next is start
        assert all(pos[start] < pos[u] for u in start.users)


def _fake_grads(nbytes):
    return [types.SimpleNamespace(meta={ir.VAL: torch.empty(b // 4)}) for b in nbytes]


def test_alpha_beta_buckets_follow_latency_and_backward_time():
    profile = cost.DeviceProfile("t", 1e12, 1e12, alpha=1e-3, link_bandwidth=1e9)
    target = c10d.all_reduce.default
    grads = _fake_grads([4_000] * 8)
    # latency-bound, gradients all ready at once: one bucket
    assert data_parallel.assign_buckets_by_cost(grads, [0.0] * 8, profile, 2, target) == \
        [list(reversed(range(8)))]  # ties: reverse parameter order, as DDP
    # gradients 10 ms apart, cheap messages: each goes as soon as it exists
    profile = cost.DeviceProfile("t", 1e12, 1e12, alpha=1e-6, link_bandwidth=1e9)
    ready = [0.01 * (8 - j) for j in range(8)]  # the last parameter's gradient comes first
    b = data_parallel.assign_buckets_by_cost(grads, ready, profile, 2, target)
    assert b == [[j] for j in reversed(range(8))]
    # the optimum is what the alpha-beta model says is fastest (brute force on 6 gradients)
    grads = _fake_grads([400_000, 4_000, 4_000, 800_000, 4_000, 40_000])
    ready = [0.0012, 0.0010, 0.0008, 0.0006, 0.0003, 0.0001]
    best = data_parallel.assign_buckets_by_cost(grads, ready, profile, 2, target)
    assert _finish(best, grads, ready, profile) == pytest.approx(
        min(_finish(c, grads, ready, profile) for c in _contiguous_splits([5, 4, 3, 2, 1, 0])))


def test_alpha_beta_buckets_never_latency_dominated():
    """No bucket but the last holds fewer than 4 alpha x bandwidth bytes."""
    profile = cost.DeviceProfile("t", 1e12, 1e12, alpha=1e-5, link_bandwidth=1e9)  # 40 kB
    grads = _fake_grads([4_000] * 40)
    ready = [0.01 * (40 - j) for j in range(40)]
    b = data_parallel.assign_buckets_by_cost(grads, ready, profile, 2, c10d.all_reduce.default)
    sizes = [4_000 * len(x) for x in b]
    assert all(s >= 40_000 for s in sizes[:-1]) and 1 < len(b) <= 4


def _finish(buckets, grads, ready, profile):
    t = 0.0
    for b in buckets:
        nbytes = sum(cost.tensor_bytes(grads[j].meta[ir.VAL]) for j in b)
        t = max(t, max(ready[j] for j in b)) + cost.comm_time(c10d.all_reduce.default, nbytes,
                                                             2, profile)
    return t


def _contiguous_splits(seq):
    if not seq:
        yield []
        return
    for k in range(1, len(seq) + 1):
        for rest in _contiguous_splits(seq[k:]):
            yield [seq[:k], *rest]


def test_alpha_beta_comm_time_factors():
    p = cost.DeviceProfile("t", 1, 1, alpha=0.0, link_bandwidth=1.0)
    assert cost.comm_time(c10d.all_reduce.default, 1000, 4, p) == pytest.approx(1500)
    assert cost.comm_time(c10d.all_gather_into_tensor.default, 1000, 4, p) == pytest.approx(750)
    assert cost.comm_time(c10d.all_reduce.default, 1000, 1, p) == 0


@pytest.mark.slow  # (moved to keep make test under 6 minutes)
def test_fixed_bucket_size_still_honoured():
    gm, _ = compile_plan(M.GPT(CFG), M.gpt_batch(CFG, 4), bucket_mb=0.01)
    n_fixed = sum(1 for s, _ in overlap.collective_pairs(gm.graph) if s.meta.get("bucket"))
    gm, _ = compile_plan(M.GPT(CFG), M.gpt_batch(CFG, 4), bucket_mb=100)
    assert n_fixed > sum(1 for s, _ in overlap.collective_pairs(gm.graph) if s.meta.get("bucket"))


@pytest.mark.slow
def test_overlap_halves_exposed_communication_and_trace_has_both_tracks(tmp_path):
    """dp=2 on gloo, a GPT with 3.3 M parameters (13 MB of gradients per step): the fraction
    of step time the compute thread is blocked on communication, overlap on vs off."""
    path = str(tmp_path / "trace.json")
    # a timing measurement on a shared 2-core VM: best of up to three runs (a descheduled
    # gloo thread can spoil one). On/off ratio measured 0.44-0.49 alone on a quiet machine
    # (2026-11-23, 4 runs); one slow-suite run read 0.69 three times in a row, not reproduced
    for _ in range(3):
        res = fxpar.launch(overlap_rank, 2, path)
        for r in res.values():
            assert r[True]["losses"] == r[False]["losses"]  # reordering changes no number
        if all(r[True]["exposed"] < 0.6 * r[False]["exposed"] for r in res.values()):
            break
    for r in res.values():
        assert r[True]["exposed"] < 0.6 * r[False]["exposed"], r
    events = json.load(open(path))["traceEvents"]
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert tracks == {(0, "compute"), (0, "comm"), (1, "compute"), (1, "comm")}
    comm = [e for e in events if e.get("cat") == "comm"]
    assert comm and all(e["dur"] > 0 and e["args"]["bytes"] > 0 for e in comm)
    assert {e["pid"] for e in comm} == {0, 1}


@pytest.mark.slow
def test_zero3_dp4_model_state_measured_with_tracker():
    """params + gradients + optimizer state per rank (tracker) at zero=3 <= 30% of zero=0."""
    full = fxpar.launch(zero_memory_rank, 4, 0)
    sharded = fxpar.launch(zero_memory_rank, 4, 3)
    for r in range(4):
        total = sum(full[r].values())
        assert sum(sharded[r].values()) <= 0.30 * total, (sharded[r], full[r])
        for k in ("params", "grads", "optimizer"):
            assert sharded[r][k] <= 0.30 * full[r][k], (k, sharded[r], full[r])


def test_overlap_says_why_nothing_moved():
    """One gradient bucket (a tiny model: alpha-beta sizing keeps it whole) leaves the pass
    nothing to move; its decision says so and what would change it. Split buckets move."""
    cfg = M.GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    gm, _ = compile_plan(M.GPT(cfg), M.gpt_batch(cfg, 4), bucket_mb=None)
    d = gm.meta["overlap"]
    assert not d.hoisted and not d.sunk
    assert "one bucket" in d.why and "Plan.bucket_mb" in d.why
    gm, _ = compile_plan(M.GPT(cfg), M.gpt_batch(cfg, 4), bucket_mb=0.001)
    d = gm.meta["overlap"]
    assert d.sunk and d.why == ""


def test_expert_all_to_alls_travel_beside_the_layers_other_compute():
    """Expert parallelism's dispatch and combine are each waited on as a functional
    collective is, so the pass moves them: DeepSeek-V3's shared experts read none of the
    dispatched rows, and run between the forward dispatch's start and its wait (moved above
    the grouped matmul that reads the rows); every node still follows its inputs. A random
    op never moves (the random stream's order), nor a collective."""
    from fxpar.examples import zoo
    model, spec = zoo.build("deepseek_v3")
    prog = fxpar.compile(model, 2, example_batch=spec.batch(0), plan={"dp": 2, "ep": 2})
    d, g = prog.graph.meta[ir.OVERLAP_REPORT], prog.graph.graph
    pos = _pos(prog.graph)
    start = next(n for n in g.nodes if n.target is torch.ops.fxpar.ep_dispatch.default)
    (wait,) = start.users
    assert wait.target is c10d.wait_tensor.default and d.pulled.get(wait.name, 0) > 0
    between = [n for n in g.nodes if pos[start] < pos[n] < pos[wait]]
    assert any("shared_experts" in n.meta.get(ir.MODULE, "") for n in between)
    reader = _first_compute_user(wait, pos)
    assert reader.target is torch.ops.aten._grouped_mm.default and pos[reader] > pos[wait]
    assert all(pos[a] < pos[n] for n in g.nodes for a in n.all_input_nodes)
    assert "expert all-to-alls" in d.describe()

    t = torch.fx.Graph()
    x = t.placeholder("x")
    assert not overlap._movable(t.call_function(torch.ops.aten.native_dropout.default,
                                                (x, 0.1, True)))
    assert not overlap._movable(t.call_function(c10d.all_reduce.default, (x, "sum", "g")))
    assert overlap._movable(t.call_function(torch.ops.aten.relu.default, (x,)))

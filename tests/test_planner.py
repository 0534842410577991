"""The planner: graph statistics, the memory estimator against closed forms (Megatron's
activation formula, EleutherAI's Transformer Math), the search (fits, errors, constraints,
175B on 1024 fake devices) and the `fxpar plan` command."""
import dataclasses
import math
import time
import warnings

import pytest
import torch

import fxpar

from fxpar.compiler import graphstats, planner
from fxpar.core import cost, ir
from fxpar.api.autoplan import calibration_inputs
from fxpar.compiler.compile import planner_stats
from fxpar.core.errors import PlanError
from fxpar.compiler.memory_model import stage_memory
from fxpar.examples import gpt_stats as G
from fxpar.examples import models as M
from fxpar.runtime import comm, machine
from fxpar.core import schedules

GiB = 2 ** 30


def _fake_gpt(cfg, rows, dtype=torch.float32):
    return G.fake_gpt_stats(cfg, rows, dtype)


@pytest.mark.parametrize("b,s,h,a", [(2, 128, 256, 4), (1, 64, 384, 6)])
@pytest.mark.slow  # (make test's 6 minutes)
def test_saved_activations_match_megatron_formula(b, s, h, a):
    """Korthikanti et al. 2022: a GPT layer saves s*b*h*(34 + 5*a*s/h) bytes with 16-bit
    activations, 1-byte dropout masks and unfused attention. Counted here on the joint graph
    (forward values the backward reads) of a bf16 Megatron-style block."""
    cfg = M.GPTConfig(vocab_size=512, block_size=s, n_layer=3, n_head=a, n_embd=h,
                      dropout=0.1, attention="manual")
    stats = _fake_gpt(cfg, b, torch.bfloat16)
    assert [x.name for x in stats.layers] == ["h.0", "h.1", "h.2"]
    formula = s * b * h * (34 + 5 * a * s / h)
    got = stats.layers[1].saved
    assert abs(got - formula) <= 0.02 * formula, (got, formula)


def test_tensor_parallel_split_found_on_the_graph():
    """Megatron: every matmul FLOP of a block splits over tp, and the block all-reduces b*s*h
    twice forward (row outputs) and twice backward (column inputs)."""
    cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    stats = _fake_gpt(cfg, 4)
    blk = stats.layers[0]
    bsh = 4 * 32 * 64 * 4  # fp32
    assert blk.flops_f_split == blk.flops_f > 0
    assert blk.n_row == 2 and len(blk.column_out) == 2
    assert blk.tp_comm_f == 2 * bsh and blk.tp_comm_b == 2 * bsh
    assert sorted(blk.column_out) == [3 * 64, 4 * 64]
    assert stats.heads == 4
    # all weights but LayerNorms and the row linears' biases split
    ln_and_row_bias = 4 * 64 + 2 * 64
    assert blk.params - blk.params_split == ln_and_row_bias


def test_a_recomputed_forward_repeats_its_tp_all_reduces():
    """remat runs before the tp pass, which splits the recomputed copies as it splits the
    forward: a recomputed row linear all-reduces again. With every layer recomputed (a
    budget of 1 byte: Megatron's full recompute) the backward pays the forward's tp
    all-reduces once more; they had been priced once (the forward's FLOPs only)."""
    stats = G.gpt_stats("gpt-1.7b")

    def recompute_cost(call_s):  # what full recompute adds to the backward, per microbatch
        hw = dataclasses.replace(cost.HARDWARE["a100"],
                                 collectives={("all_reduce", 8): (call_s, 0.0)})
        plans = [planner.search(stats, 8, hw, batch_rows=16, precision="bf16",
                                executable=False, constraints={
                                    "tp": 8, "pp": 1, "microbatches": 1, "zero": 0,
                                    "remat": remat}).best for remat in ("none", 1)]
        assert plans[1].recompute > 0.99
        return plans[1].ctx[1][0] - plans[0].ctx[1][0]

    at8 = stats.at_tp(8)
    forward_calls = sum(s.n_row + int(s.tp_calls_extra) for s in at8.segments)
    assert forward_calls >= 2 * len(at8.layers)        # Megatron's 2 a block, at least
    assert recompute_cost(1e-3) - recompute_cost(0.0) == pytest.approx(forward_calls * 1e-3)


def test_microbatched_data_parallelism_hides_its_reduction_behind_the_last_backward():
    """One joint graph reduces gradients during its backward (the overlap pass hides what
    the backward's length allows); with microbatches and no pipeline the reduction runs
    once a step on the summed gradients inside the last microbatch's backward
    (runtime/pipeline.with_reductions): hidden behind that one microbatch's backward, so
    less than without overlap and no more than behind the whole batch's."""
    stats = G.gpt_stats("gpt-1.7b")
    hw = cost.HARDWARE["a100"]

    def dp_comm(m, overlap=True):
        return planner.search(stats, 8, hw, batch_rows=16, precision="bf16", executable=False,
                              constraints={"dp": 8, "tp": 1, "pp": 1, "zero": 0,
                                           "remat": "none", "microbatches": m,
                                           "overlap": overlap}).best.parts["dp communication"]
    loss = hw.comm("all_reduce", 4, 8, 8, calls=stats.dp_loss_calls)  # one more per microbatch
    assert dp_comm(1) < 0.5 * dp_comm(1, overlap=False)
    assert dp_comm(2, overlap=False) == pytest.approx(dp_comm(1, overlap=False) + loss)
    assert (dp_comm(1) + loss) * (1 - 1e-6) <= dp_comm(2) < dp_comm(2, overlap=False)


def test_activations_dp_gathers_are_priced_per_microbatch():
    """The dp probe counts the activations the dp pass all-gathers (an op with no split
    sharding rule reading the batch's rows: litgpt's experts loop's combine, 11 a layer);
    each data-parallel plan pays its stages' per microbatch as blocking calls, the whole
    microbatch's bytes each, in the activations' precision (traced in fp32)."""
    stats = G.gpt_stats("gpt-1.7b")
    hw = cost.HARDWARE["a100"]

    def dp_comm(st, m):
        return planner.search(st, 8, hw, batch_rows=16, precision="bf16", executable=False,
                              constraints={"dp": 8, "tp": 1, "pp": 1, "zero": 0,
                                           "remat": "none", "microbatches": m}
                              ).best.parts["dp communication"]
    gathered = dataclasses.replace(stats, segments=[
        dataclasses.replace(s, dp_gathers=10, dp_gather_bytes=2e6) if i == 1 else s
        for i, s in enumerate(stats.segments)])
    for m in (1, 2):  # (each microbatch's: 16 / m rows of the traced ones, bf16)
        extra = m * hw.comm("all_gather", 2e6 * (16 / (8 * m)) * 8 / stats.rows / 2, 8, 8,
                            calls=10)
        assert dp_comm(gathered, m) == pytest.approx(dp_comm(stats, m) + extra)


@pytest.mark.slow  # (a capture and the pass probes)
def test_dp_probe_counts_the_gathers_of_an_experts_loop():
    """A Switch-style MoE with an expert capacity under dp (each pair's place in its
    expert's queue depends on the whole batch: its routed rows gathered) and litgpt's
    Mixtral (its experts' loop local end to end: the grouped dispatch and the padded
    positions around it): the probe counts the first's gathers, none of the second's."""
    import workers
    from fxpar.compiler.capture import capture_as_is
    torch.manual_seed(0)
    capacity = {"ids": torch.randint(0, 32, (8, 16)), "labels": torch.randint(0, 32, (8, 16))}
    lit, lit_batch, lit_loss = workers.build("litgpt_mixtral")
    for name, model, batch, loss_fn, gathers in (
            ("capacity", workers.CapacityMoE(), capacity, workers.capacity_loss, True),
            ("litgpt_mixtral", lit, lit_batch(0), lit_loss, False)):
        rows = next(iter(batch.values())).shape[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            st = planner.graph_stats(capture_as_is(model, batch, loss_fn=loss_fn), rows,
                                     pass_extras=True)
        assert (sum(s.dp_gathers for s in st.segments) > 0 and sum(
            s.dp_gather_bytes for s in st.segments) > 0) == gathers, name


def test_a_head_tp_does_not_divide_stays_whole_and_tp_stays_legal():
    """GPT-2's 50257-wide LM head: the tp pass keeps a column linear whose out features tp
    does not divide whole on every rank (the rest splits). The planner prices the roles the
    pass decides (tensor_parallel.roles): the head's segment whole, the layers split, and tp
    stays legal (it had refused every tp plan of such a model, then priced the head split)."""
    cfg = M.GPTConfig(vocab_size=129, block_size=32, n_layer=2, n_head=4, n_embd=64)
    stats = _fake_gpt(cfg, 4)
    post, blk = stats.segments[-1], stats.layers[0]
    assert 129 not in post.column_out and post.flops_f_split == post.flops_b_split == 0
    assert blk.flops_f_split == blk.flops_f > 0 and blk.column_out
    assert stats.segments[0].params_split == 0  # the tied embedding: whole with its head
    assert "replicated" not in {stats.tp_roles.get(k) for k in stats.tp_roles
                                if "h." in k} and stats.tp_refusal is None
    hw = _cpu(4 * GiB)
    r = planner.search(stats, 2, hw, batch_rows=4)
    assert any(c.plan.tp == 2 for c in r.table)
    even = _fake_gpt(M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4,
                                 n_embd=64), 4)
    assert 128 in even.segments[-1].column_out  # (a head tp divides: split, as the pass does)


def test_a_graph_the_tp_pass_cannot_split_gets_no_tp_plan(monkeypatch):
    """Where the tensor_parallel pass cannot decide the roles on a graph, the planner prices
    no tp plan (it had found column/row pairs by a walk of its own, and "auto" could choose a
    plan the pass then refused): the search names the pass's reason."""
    from fxpar.passes import tensor_parallel

    def cannot(gm, sig, *a, **k):
        raise PlanError("an op it has no sharding rule for")
    monkeypatch.setattr(tensor_parallel, "roles", cannot)
    cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    stats = _fake_gpt(cfg, 4)
    assert "no sharding rule" in stats.tp_refusal
    assert stats.tp_roles == {} and all(s.flops_f_split == 0 for s in stats.segments)
    with pytest.raises(PlanError, match="cannot split this graph"):
        planner.search(stats, 2, _cpu(4 * GiB), batch_rows=4, constraints={"tp": 2})
    assert all(c.plan.tp == 1 for c in planner.search(stats, 2, _cpu(4 * GiB),
                                                      batch_rows=4).table)


def test_transformer_math_closed_forms():
    """EleutherAI 'Transformer Math 101': P = 12Lh^2 + 13Lh + (V + s)h (+ 2h final norm);
    mixed-precision AdamW holds 2 + 2 + 12 = 16 bytes per parameter; ZeRO-1/2/3 divide the
    optimizer / + gradients / + parameters by N."""
    L, h, a, V, s = 24, 2304, 24, 51200, 2048
    stats = G.gpt_stats("gpt-1.7b", seq=s, vocab=V)
    P = 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h
    assert abs(stats.total_params - P) <= 0.02 * P
    N = 8

    def model_states(zero, dp):
        m, _ = stage_memory(stats.segments, stats, tp=1, dp=dp, zero=zero, rows=1, in_flight=1,
                            precision="bf16", optimizer="adamw")
        return m.params + m.grads + m.optimizer
    expect = {(0, 1): 16 * P, (1, N): 4 * P + 12 * P / N, (2, N): 2 * P + 14 * P / N,
              (3, N): 16 * P / N}
    for (zero, dp), want in expect.items():
        got = model_states(zero, dp)
        assert abs(got - want) <= 0.02 * want, (zero, got, want)
    # fp32 Adam: 4 + 4 + 8
    m, _ = stage_memory(stats.segments, stats, tp=1, dp=1, zero=0, rows=1, in_flight=1,
                        precision="fp32", optimizer="adam")
    assert abs(m.params + m.grads + m.optimizer - 16 * P) <= 0.02 * 16 * P


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved"])
def test_in_flight_equals_the_schedule_simulator(schedule):
    for pp in (1, 2, 3, 4, 8):
        for m in (1, 2, 4, 8, 16):
            v = 2 if schedule == "interleaved" else 1
            if schedule == "interleaved" and (pp < 2 or m % pp):
                continue
            tl = schedules.simulate_schedule(schedules.build(schedule, pp, m, v), {"F": 1.0, "B": 2.0})
            assert planner.in_flight(schedule, pp, m, v) == \
                [math.ceil(x / v) for x in tl.peak_in_flight], (pp, m)


def test_partition_balances_contiguous_parts():
    assert planner.partition([1, 1, 1, 1, 1, 1], 3) == [0, 2, 4]
    assert planner.partition([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert len(planner.partition([1] * 10, 10)) == 10


@pytest.mark.slow
@pytest.mark.timing
def test_1t_on_3072_fake_devices_under_a_minute():
    """The largest configuration of Narayanan et al. 2021: 6959 legal plans (3072 = 2^10 x 3
    devices, pp up to 128); the search takes ~32 s on a 2-core VM."""
    t0 = time.perf_counter()
    r = planner.search(G.gpt_stats("gpt-1t"), 3072, cost.HARDWARE["a100"],
                       batch_rows=3072, precision="bf16", executable=False)
    assert time.perf_counter() - t0 < 60 and r.n_legal > 5000
    b = r.best.plan
    assert b.dp * b.tp * b.pp == 3072 and b.tp <= 8 and b.pp > 1
    assert r.best.memory.total <= 0.9 * cost.HARDWARE["a100"].memory


def test_a_pipelines_twin_ranks_are_priced_once_and_alike():
    """A pipeline's middle ranks of identical layers are one twin (`planner._twins`), priced
    once: the plan's step and every stage's memory equal pricing each rank apart, and each
    stage's estimate is its own (told its stage)."""
    stats, hw, pp = G.gpt_stats("gpt-1t"), cost.HARDWARE["a100"], 8
    for sched in ("1f1b", "interleaved", "zero-bubble"):
        v = 2 if sched == "interleaved" else 1
        ranks = planner._rank_aggregates(planner.stages_of(stats, pp, v, "cuda"), pp, v)
        twins = planner._twins(ranks)
        assert twins == [0, 1, 1, 1, 1, 1, 1, 7]  # the embedding's rank, 6 alike, the head's
        args = (48, 8, pp, v, 16, 4, sched, 1, "bf16", "adamw", {}, 0.9 * hw.memory)
        once = planner._price(stats, hw, ranks, twins, *args)
        apart = planner._price(stats, hw, ranks, list(range(pp)), *args)
        assert once.step_s == apart.step_s, sched
        assert [m.total for m in once.memory.per_stage] == \
            [m.total for m in apart.memory.per_stage], sched
        assert [m.stage for m in once.memory.per_stage] == list(range(pp))


@pytest.mark.slow  # (moved to keep make test under 6 minutes)
@pytest.mark.timing
def test_175b_on_1024_fake_devices_under_a_minute():
    t0 = time.perf_counter()
    stats = G.gpt_stats("gpt-175b")
    hw = cost.HARDWARE["a100"]
    r = planner.search(stats, 1024, hw, batch_rows=1536, precision="bf16", executable=False)
    assert time.perf_counter() - t0 < 60
    assert "96 repeated blocks" in r.note
    b = r.best.plan
    assert b.dp * b.tp * b.pp == 1024 and 96 % b.tp == 0 and b.pp <= 96
    assert b.tp <= 8                              # tensor parallelism stays on NVLink
    assert b.pp > 1                               # 175B does not fit without pipelining
    assert r.best.memory.total <= 0.9 * hw.memory
    assert all(c.memory.total <= 0.9 * hw.memory for c in r.table)
    assert 0.3 < r.best.mfu < 0.7
    assert "chosen:" in r.explain() and "runner-up" in r.explain()


@pytest.fixture(scope="module")
def small_stats():
    return G.gpt_stats("small", precision="fp32")


def _cpu(memory):
    hw = dataclasses.replace(cost.HARDWARE["a100"], name="test-cpu", memory=memory)
    return hw


def test_never_returns_a_plan_that_does_not_fit(small_stats):
    full = None
    for mem in (4 * GiB, 8 * 2 ** 20, 2 * 2 ** 20, 1 * 2 ** 20):
        try:
            r = planner.search(small_stats, 4, _cpu(mem), batch_rows=8)
        except PlanError as e:
            assert "smallest need" in str(e) and "nearest plan" in str(e)
            continue
        assert all(c.memory.total <= 0.9 * mem for c in r.table)
        full = full or r
    assert full is not None


def test_no_legal_factorization_is_a_clear_error(small_stats):
    with pytest.raises(PlanError, match="no legal factorization of 7 devices") as e:
        planner.search(small_stats, 7, _cpu(GiB), batch_rows=8)
    msg = str(e.value)
    assert "does not divide the 4 attention heads" in msg and "2 repeated blocks" in msg


def test_model_that_fits_nowhere_names_its_need():
    stats = G.gpt_stats("gpt-175b")
    with pytest.raises(PlanError, match="smallest need is") as e:
        planner.search(stats, 8, cost.HARDWARE["a100"], batch_rows=8, precision="bf16",
                       executable=False)
    assert "nearest plan dp=" in str(e.value)


def test_constraints_fix_fields(small_stats):
    r = planner.search(small_stats, 4, _cpu(GiB), batch_rows=8, constraints={"pp": 2})
    assert all(c.plan.pp == 2 for c in r.table)
    r = planner.search(small_stats, 4, _cpu(GiB), batch_rows=8,
                       constraints={"tp": 2, "zero": 1})
    assert all(c.plan.tp == 2 and c.plan.zero == 1 for c in r.table)
    # every plan the search returns validates (ZeRO-3 composes with tp / pp / microbatches)
    r = planner.search(small_stats, 4, _cpu(GiB), batch_rows=8)
    for c in r.table:
        c.plan.validate(4)
    assert any(c.plan.zero == 3 and (c.plan.tp > 1 or c.plan.pp > 1) for c in r.table)
    # fields the search does not choose are kept as the user fixed them (they were dropped
    # for codegen, max_grad_norm and offload: a silent change of the user's plan)
    fixed = {"codegen": "eager", "max_grad_norm": 1.0, "overlap": False, "fuse": False}
    r = planner.search(small_stats, 4, _cpu(GiB), batch_rows=8, constraints=fixed)
    assert all(all(getattr(c.plan, k) == v for k, v in fixed.items()) for c in r.table)


def test_fxpar_plan_command(capsys):
    from fxpar.__main__ import main
    main(["plan", "--model", "small", "--devices", "4", "--device-type", "h100",
          "--batch", "8", "--explain", "--top", "3"])
    out = capsys.readouterr().out
    assert "legal plans for 4 x H100" in out and "chosen:" in out
    assert out.count("MFU") >= 4
    # a value --fix gives that a Plan cannot take is named, not priced
    with pytest.raises(SystemExit, match="Plan.zero must be 0, 1, 2 or 3"):
        main(["plan", "--model", "small", "--devices", "4", "--device-type", "h100",
              "--batch", "8", "--fix", '{"zero": 7}'])


def test_one_device_needs_no_search():
    cfg = M.GPTConfig()
    pm = __import__("fxpar").parallelize(M.GPT(cfg), 1, example_batch=M.gpt_batch(cfg, 4))
    assert pm.plan_report is None and (pm.plan.dp, pm.plan.tp, pm.plan.pp) == (1, 1, 1)


@pytest.mark.slow  # (make test's 6 minutes)
def test_the_memory_model_prices_the_buckets_the_dp_pass_makes():
    """Data parallelism holds one gradient bucket beside the gradients, while it is packed
    (the reduction runs in place and the gradients become views of it): the largest one the
    dp pass makes on this model (the planner's dp probe counts it), never more than the
    gradients. Priced at a 25 MiB bucket where the pass made 4-6 MiB ones, plain dp came out
    1.28x what it allocates; priced as a bucket and a reduced copy, 1.14-1.22x."""
    from fxpar.compiler.memory_model import stage_memory
    cfg = M.GPTConfig(vocab_size=4096, block_size=32, n_layer=4, n_head=4, n_embd=256)
    batch = M.gpt_batch(cfg, 8)
    torch.manual_seed(0)
    stats = planner_stats(M.GPT(cfg), batch)
    planner.count_pass_extras(stats)
    prog = fxpar.compile(M.GPT(cfg), 2, example_batch=batch, plan={"dp": 2})
    made = [cost.tensor_bytes(n.args[0].meta[ir.VAL]) for n in prog.graph.graph.nodes
            if n.target is torch.ops._c10d_functional.all_reduce.default
            and n.meta.get(ir.BUCKET)]
    assert len(made) > 1 and stats.dp_bucket_bytes == max(made)
    grads = sum(made)

    def buffers(bucket):
        return stage_memory(stats.segments, stats, tp=1, dp=2, zero=0, rows=8, in_flight=1,
                            precision="fp32", optimizer="sgd",
                            bucket_bytes=bucket)[0].buffers
    assert buffers(stats.dp_bucket_bytes) == pytest.approx(max(made))
    assert buffers(25 * 2 ** 20) == pytest.approx(grads, rel=1e-3)  # (capped: all of them)


@pytest.mark.slow
def test_memory_estimate_vs_tracker_on_cpu_ranks():
    """The estimator's per-rank memory of a step (gradients + activations + buffers of this
    rank's stage) at most 10% under what the tracker measures on real gloo ranks (under is
    what runs a chosen plan out of memory) and at most 15% over, for dp, pp, tp and ZeRO
    plans of a GPT whose activations dominate (its head tied to the embedding), and gradient
    accumulation without a pipeline (summed in place; priced with a second whole sum it was
    1.45x; without the buckets the dp pass packs after the last microbatch, 0.81-0.88x),
    and context parallelism, keys and values gathered or passed around a ring (what the
    cp pass keeps beyond a rank's share, from its probe: priced as the gathered keys and
    values alone, 0.85x).
    Over: a last pipeline stage's backward (+5% at m=2: its working memory priced on top
    of all of the microbatch's activations, which the boxed backward frees as it goes)."""
    import fxpar
    from planner_workers import memory_rank
    plans = [dict(dp=2, tp=1, pp=1), dict(dp=2, tp=1, pp=1, cp=2, cp_attention="gather"),
             dict(dp=2, tp=1, pp=1, cp=2, cp_attention="ring"),
             dict(dp=1, tp=1, pp=2, microbatches=2, schedule="1f1b"),
             dict(dp=1, tp=1, pp=2, microbatches=4, schedule="1f1b"),
             dict(dp=1, tp=2, pp=1), dict(dp=2, tp=1, pp=1, zero=2),
             dict(dp=2, tp=1, pp=1, microbatches=2), dict(dp=2, tp=1, pp=1, microbatches=2, zero=2),
             dict(dp=2, tp=1, pp=1, microbatches=4, zero=1)]
    res = fxpar.launch(memory_rank, 2, plans)
    for rank, rows in sorted(res.items()):
        for p, (measured, est) in zip(plans, rows):
            print(f"rank {rank} {p}: measured {measured / 2**20:.2f} MiB, estimated "
                  f"{est / 2**20:.2f} MiB ({(est / measured - 1) * 100:+.1f}%)")
    bad = [(rank, p, measured, est) for rank, rows in res.items()
           for p, (measured, est) in zip(plans, rows)
           if not 0.90 * measured <= est <= 1.15 * measured]
    assert not bad, bad


@pytest.mark.slow  # (10 s: make test stays under 6 minutes with codegen's test)
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.full), "bf16"])
def test_memory_estimate_vs_tracker_in_each_precision(precision):
    """One process, AdamW: the estimate of what a step allocates within 10% of the tracker's
    peak in fp32 and in bf16. bf16 is priced from the graph after the precision pass (its
    residual stream, norms and loss stay fp32): halving the fp32 graph's activations put it
    at 0.69x here and 0.6x of the CUDA allocator's peak on an H100."""
    import fxpar
    from fxpar.runtime.memtrack import measure
    cfg = M.GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=8, n_embd=256)
    batch = M.gpt_batch(cfg, 8)
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(cfg), 1, example_batch=batch,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                           plan=fxpar.Plan(precision=precision, fuse=False))
    for _ in range(2):
        pm.step(batch)
    _, peak = measure(lambda: pm.step(batch))
    stats = planner_stats(M.GPT(cfg), batch, precision=precision)
    assert stats.activations_precision == ("" if precision == "fp32" else precision)
    c = planner.search(stats, 1, cost.cpu_hardware(), batch_rows=8,
                       optimizer="adamw", precision=precision, constraints={
                           "dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "remat": "none",
                           "precision": precision}).table[0]
    est = c.memory.per_stage[0].step_allocated
    assert abs(est - peak) <= 0.10 * peak, (precision, est / 2**20, peak / 2**20)


@pytest.mark.slow  # (21 s: kept out of make test's 6 minutes)
@pytest.mark.parametrize("layers,seq", [(8, 128), pytest.param(12, 64, marks=pytest.mark.full)])
def test_sqrt_remat_memory_vs_tracker(layers, seq):
    """remat="sqrt": the pass checkpoints at cut vertices, 2 per transformer block (after each
    residual add), so the estimate spaces checkpoints over 2n half-layers (priced per layer
    it was 1.5x the measured). 12 layers of T=64: the gradients outweigh the activations and
    the step's peak is at the end of the backward, gradients plus the last segment's working
    memory (without that term: 0.85x). Both within 10% of the tracker."""
    import fxpar
    from fxpar.runtime.memtrack import measure
    cfg = M.GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=8, n_embd=256)
    batch = M.gpt_batch(cfg, 8)
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(cfg), 1, example_batch=batch,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                           plan=fxpar.Plan(remat="sqrt", fuse=False))
    for _ in range(2):
        pm.step(batch)
    _, peak = measure(lambda: pm.step(batch))
    stats = planner_stats(M.GPT(cfg), batch)
    assert stats.checkpoints_per_layer == 2
    c = planner.search(stats, 1, cost.cpu_hardware(), batch_rows=8,
                       optimizer="adamw", constraints={"dp": 1, "tp": 1, "pp": 1,
                                                       "microbatches": 1, "remat": "sqrt"})
    est = c.table[0].memory.per_stage[0].step_allocated
    assert abs(est - peak) <= 0.10 * peak, (est / 2**20, peak / 2**20)


def test_layers_of_a_hugging_face_model():
    """HF Llama: blocks found on the graph (named by their full paths, as the parameters);
    every block's parameters and backward belong to it."""
    stats = planner_stats(M.hf_llama(), M.hf_lm_batch(128, 8, 16))
    assert [s.name for s in stats.layers] == ["model.layers.0", "model.layers.1"]
    a, b = stats.layers
    assert a.params == b.params > 0 and a.flops_b == b.flops_b > 0
    assert stats.heads == 4 and a.n_row == 2


def test_only_auto_searches_and_auto_degrees_are_the_searched_ones():
    """A plan never depends on the machine compiling it unless it asks for a search: "auto",
    or "auto" as a degree (the other fields given constrain the search)."""
    from fxpar.core.plan import needs_search as _needs_search
    from fxpar.core.plan import resolve
    assert _needs_search("auto") and _needs_search(None)
    assert _needs_search({"pp": 2, "dp": "auto", "tp": "auto"})
    assert _needs_search(fxpar.Plan(pp=2, dp="auto"))
    assert not _needs_search({"pp": 2}) and not _needs_search({"zero": 1})
    assert not _needs_search(fxpar.Plan(dp=2))
    p = resolve({"pp": 2, "dp": "auto", "tp": "auto"}, 4)   # without a search: dp = the rest
    assert (p.dp, p.tp, p.pp) == (2, 1, 2)


@pytest.mark.slow
@pytest.mark.full  # (7-8 min of 8 ranks on 2 cores: make test-full, not CI)
def test_choice_on_8_cpu_ranks_is_within_10_percent_of_the_best_measured():
    """Issue 8: on 8 CPU ranks the planner's choice runs within 10% of the fastest plan
    measured. Measured here: the choice and the two best-predicted plans of every dp x tp x
    pp factorization (12 plans, one step each per round, interleaved); benchmarks/
    planner_accuracy.py --nprocs 8 --check-best measures every legal plan.

    The comparison is paired: the VM's speed drifts by tens of percent over seconds (two
    identical plans, GPipe and 1F1B at m=1, timed as separate medians came out 13% apart),
    so each plan is compared with the choice step by step, round by round, and the median
    of those ratios must be >= 1/1.1."""
    import statistics
    from planner_workers import choice_rank
    choice, rows = fxpar.launch(choice_rank, 8)[0]
    ratio = {r: statistics.median(c / t for c, t in zip(rows[choice][1], ts))
             for r, (_, ts) in rows.items()}  # choice / plan, paired by round
    table = "\n".join(f"{r}  predicted {p * 1e3:7.1f} ms  measured "
                      f"{statistics.median(ts) * 1e3:7.1f} ms  choice/this {ratio[r]:.2f}"
                      for r, (p, ts) in rows.items())
    assert len({r.split("m=")[0] for r in rows}) >= 6, table  # every factorization measured
    print(table)
    assert max(ratio.values()) <= 1.10, f"choice {choice}\n{table}"


def test_collectives_priced_per_call_from_the_measured_table():
    hw = dataclasses.replace(cost.HARDWARE["a100"])
    ring = hw.comm("all_reduce", 2 ** 20, 8, 8, calls=3)
    link = hw.intra  # no table: the ring model, one latency term per call
    assert ring == pytest.approx(cost.collective_time("all_reduce", 2 ** 20, 8, link)
                                 + 2 * 14 * link.alpha)
    hw.collectives = {("all_reduce", 8): (1e-3, 1e-9), ("p2p", 2): (5e-4, 0.0)}
    assert hw.comm("all_reduce", 2 ** 20, 8, 8, calls=3) == pytest.approx(3e-3 + 2 ** 20 * 1e-9)
    assert hw.comm("p2p", 123, 2, 16) == pytest.approx(5e-4)
    assert hw.comm("all_gather", 2 ** 20, 8, 8) == pytest.approx(
        cost.collective_time("all_gather", 2 ** 20, 8, link))  # not measured: ring model
    assert hw.comm("all_reduce", 2 ** 20, 1, 1) == 0.0
    # an all-to-all (ep's dispatch, qgZ's parts): one latency, (n-1)/n of each rank's bytes
    a2a = cost.collective_time("all_to_all", 2 ** 20, 8, link)
    assert a2a == pytest.approx(link.alpha + 7 / 8 * 2 ** 20 / link.bandwidth)
    assert a2a < cost.collective_time("reduce_scatter", 2 ** 20, 8, link)
    assert hw.comm("all_to_all", 2 ** 20, 8, 8, calls=3) == pytest.approx(a2a + 2 * link.alpha)


def test_sends_paid_per_microbatch_where_the_device_cannot_overlap_them(small_stats):
    """pp=2 on a device that overlaps nothing (gloo on CPU): each of the m forwards and m
    backwards on each of the 2 ranks pays its send or receive, so the step grows by
    2 * m * p2p per rank's critical path over the overlapping device's prediction (which
    pays the transfers only filling and draining the pipeline)."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB,
                             collectives={("p2p", 2): (1e-3, 0.0)})

    def step(overlap, m):
        h = dataclasses.replace(hw, overlap=overlap)
        c = planner.search(small_stats, 2, h, batch_rows=8, constraints={
            "dp": 1, "tp": 1, "pp": 2, "microbatches": m, "schedule": "gpipe"}).table[0]
        return c.step_s
    for m in (1, 4):
        # GPipe: (m - 1) * slowest + sum over ranks; overlap 1 pays 2 fill/drain transfers
        assert step(0.0, m) - step(1.0, m) == pytest.approx((2 * (m - 1) + 4 - 2) * 1e-3)


def test_zero_bubble_gains_what_its_deferred_weight_gradients_fill(small_stats):
    """Zero-bubble runs each stage's weight-gradient part (W) later, in what would be a
    bubble. Where CPU ranks share the cores a bubble is not idle (the others take its core),
    so the gain is what W fills while a core would otherwise idle: with no W part it prices
    as 1F1B and loses the tie, with half the backward deferred it is cheaper; with idle
    bubbles (a GPU) it is cheaper than 1F1B."""
    sim = planner._makespan_on_shared_cores
    fwd, bwd = [1.0] * 4, [2.0] * 4
    one = sim("1f1b", 4, 2, 1, fwd, bwd, 0.0, 0.0, 4, 0.5)
    assert sim("zero-bubble", 4, 2, 1, fwd, bwd, 0.0, 0.0, 4, 0.5, None, [0.0] * 4) == \
        pytest.approx(one)
    assert sim("zero-bubble", 4, 2, 1, fwd, bwd, 0.0, 0.0, 4, 0.5, None, [1.0] * 4) < 0.9 * one
    assert planner._makespan("zero-bubble", 4, 2, 1, fwd, bwd, 0.0, [0.0] * 4) == \
        pytest.approx(planner._makespan("1f1b", 4, 2, 1, fwd, bwd, 0.0))
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB)

    def price(h, schedule):
        return planner.search(small_stats, 2, h, batch_rows=8, constraints={
            "dp": 1, "tp": 1, "pp": 2, "microbatches": 4, "schedule": schedule}).table[0].step_s
    assert price(hw, "zero-bubble") < price(hw, "1f1b")
    cpu = dataclasses.replace(hw, async_launch=False)  # CPU ranks with a core each
    assert price(cpu, "zero-bubble") < price(cpu, "1f1b")


def test_the_deferred_weight_gradients_are_the_pipeline_pass_s_own_split():
    """The W share the planner prices is the part of each stage's backward pipeline_split
    labels W: about half of a stack of linears (x^T dy beside dy W^T), and almost none of a
    conv net, whose weight gradients come out of the op that makes the input gradient. The
    first stage sends no gradient on: all of its backward is W."""
    hw = cost.cpu_hardware()
    mlp = planner_stats(M.DeepMLP(n_blocks=4, width=64), (torch.randn(16, 16),
                                                          torch.randn(16, 4)))
    conv = planner_stats(M.ConvBN(), (torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))))
    shares = {}
    for name, stats in (("mlp", mlp), ("conv", conv)):
        assert planner.pass_stages(stats, 2, "cpu")
        shares[name] = [planner._wgrad_share(stats, (2, "cpu"), r, stats.rows, hw, "fp32")
                        for r in range(2)]
    assert shares["mlp"][0] == shares["conv"][0] == 1.0
    assert 0.3 < shares["mlp"][1] < 0.7, shares
    assert shares["conv"][1] < 0.2, shares  # (the linear head's weight gradient)


@pytest.mark.slow  # (moved to keep make test under 6 minutes)
def test_pass_extras_count_what_the_passes_emit():
    """graph_stats(pass_extras=True) runs the tp and dp passes once: the planner's tp call
    count (one per row/column linear + the extras) equals the collectives the tp pass emits,
    ZeRO-3's gathers per parameter and the per-microbatch loss all-reduces those the dp pass
    emits."""
    import copy
    from fxpar.compiler.pass_manager import PassContext
    from fxpar.core.plan import resolve
    from fxpar.passes import data_parallel, tensor_parallel
    c10d = torch.ops._c10d_functional
    cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    stats = planner_stats(M.GPT(cfg), M.gpt_batch(cfg, 8), pass_extras=True)
    gm, sig = stats.graph

    def compiled(pass_, plan):
        g = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        return pass_.run(g, resolve(plan, 2), PassContext(signature=sig, group_names={
            "tp": "tp", "dp": "dp"}))
    tp_g = compiled(tensor_parallel, {"tp": 2, "dp": 1})
    kinds = {c10d.all_reduce.default, c10d.all_gather_into_tensor.default,
             c10d.reduce_scatter_tensor.default}
    tp_calls = sum(1 for n in tp_g.graph.nodes if n.target in kinds)
    modeled = sum(s.n_row + len(s.column_out) + s.tp_calls_extra for s in stats.segments)
    assert modeled == tp_calls and stats.segments[-1].tp_calls_extra > 0  # vocab-parallel loss
    base = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    assert stats.tp_nodes_extra == sum(1 for n in tp_g.graph.nodes
                                       if n.op == "call_function") - base
    z3 = compiled(data_parallel, {"dp": 2, "zero": 3})
    gathers = sum(1 for n in z3.graph.nodes if n.target is c10d.all_gather_into_tensor.default)
    n_params = sum(s.n_param_tensors for s in stats.segments)
    assert stats.zero3_gathers_per_param * n_params == pytest.approx(gathers)
    scatters = sum(1 for n in z3.graph.nodes if n.target is c10d.reduce_scatter_tensor.default)
    assert stats.zero3_reduce_scatters_per_param * n_params == pytest.approx(scatters)
    # one collective per layer (wte, wpe, each block, ln_f) and direction: forward gathers,
    # backward gathers of the layers the backward reads weights of, reduce-scatters
    n_layers = len({ir.layer_of(n.rsplit(".", 1)[0]) for n in sig.param_names})
    assert scatters == n_layers and n_layers < gathers < 2 * n_layers
    assert stats.dp_nodes_per_param[3] > stats.dp_nodes_per_param[0] > 0
    # the GPT's loss is a mean over targets that are not ignored: dp all-reduces the loss's
    # sum and the count of its targets (one call) each microbatch, besides the gradient buckets
    dp_g = compiled(data_parallel, {"dp": 2, "zero": 0})
    loss_calls = [n for n in dp_g.graph.nodes if n.target is c10d.all_reduce.default
                  and not n.meta.get(ir.BUCKET)]
    assert stats.dp_loss_calls == len(loss_calls) == 1
    assert not any(s.dp_gathers for s in stats.segments)  # (every activation splits)


def test_cpu_ranks_share_the_cores(monkeypatch):
    from fxpar.runtime import dist as rdist
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    try:
        rdist._share_cores()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice is kept
        torch.set_num_threads(2)
        rdist._share_cores()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_measured_collective_table_on_gloo_ranks():
    from planner_workers import collectives_rank
    res = fxpar.launch(collectives_rank, 2)
    (table, timed), (table1, _) = res[0], res[1]
    assert table == table1  # averaged over the ranks: every rank plans alike
    assert set(table) == {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2),
                          ("all_to_all", 2), ("p2p", 2)}
    assert all(lat > 0 and per_byte >= 0 for lat, per_byte in table.values())
    # timed as the runtime issues them (runtime/comm: on gloo, large all-gathers and
    # reduce-scatters take other paths than the functional collectives'), at a size that
    # takes those paths
    assert set(timed) == {"start_all_reduce", "start_all_gather", "start_reduce_scatter",
                          "start_all_to_all"}
    assert all(max(sizes) >= comm.GLOO_INPLACE_RS_BYTES for sizes in timed.values()), timed


def test_link_from_table_reproduces_the_measured_all_reduce():
    table = {("all_reduce", 4): (6e-3, 2e-9)}
    link = cost.link_from_table(table, 4)
    assert cost.collective_time("all_reduce", 2 ** 20, 4, link) == pytest.approx(
        6e-3 + 2 ** 20 * 2e-9)
    assert cost.link_from_table(table, 2) is None



def test_recalibrate_scales_compute_to_the_measured_step(small_stats):
    """planner.recalibrate: the one compute factor that makes the plan that ran cost what it
    measured; communication keeps its price; every plan re-priced (a fresh search with the
    scaled hardware), the start-up result kept."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB)
    r = planner.search(small_stats, 4, hw, batch_rows=8)
    ran = next(c for c in r.table if c.plan.dp == 4)       # pp=1 tp=1: all compute but dp
    for factor in (2.5, 0.6):
        new = planner.recalibrate(r, ran.plan, factor * ran.step_s)
        now = next(c for c in new.table if c.plan == ran.plan)
        assert now.step_s == pytest.approx(factor * ran.step_s, rel=0.01)
        k = now.parts["compute"] / ran.parts["compute"]
        assert (k > factor) if factor > 1 else (k < factor)  # the dp all-reduce kept its price
        assert new.hardware.intra == hw.intra and new.hardware.peak_flops == hw.peak_flops
        assert new.start_up is r and "compute x" in new.refit and "priced" in new.explain()
        fresh = planner.search(small_stats, 4, new.hardware, batch_rows=8)
        assert [c.plan for c in fresh.table] == [c.plan for c in new.table]
    assert new.n_legal == r.n_legal and new.inputs == r.inputs


def test_recalibrate_on_cpu_ranks_scales_the_gloo_collectives_alike(small_stats):
    """CPU ranks (async_launch False): gloo's collectives are host work on the same cores,
    measured at start-up in the same second as the compute, so the re-fit scales the measured
    table and the links by the same factor: a plan all communication (dp=4) is then priced
    exactly factor x its start-up price."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB, async_launch=False,
                             collectives={("all_reduce", 4): (2e-3, 1e-9),
                                          ("all_reduce", 2): (1e-3, 1e-9), ("p2p", 2): (1e-3, 0.0)},
                             overlap=0.0)
    r = planner.search(small_stats, 4, hw, batch_rows=8)
    ran = next(c for c in r.table if c.plan.dp == 4 and c.plan.zero == 0)
    new = planner.recalibrate(r, ran.plan, 2.5 * ran.step_s)
    assert new.hardware.collectives[("all_reduce", 4)][0] == pytest.approx(
        2e-3 * new.hardware.node_overhead / hw.node_overhead)
    assert new.hardware.intra.alpha > hw.intra.alpha and "gloo collectives" in new.refit
    now = next(c for c in new.table if c.plan == ran.plan)
    assert now.parts["dp communication"] == pytest.approx(
        2.5 * ran.parts["dp communication"], rel=0.02)


def test_parallel_model_refits_the_planner_after_its_first_steps(tmp_path):
    """plan="auto" jobs re-fit the planner to their own measured steps (after REFIT_AFTER);
    a plan the re-fit prices clearly worse than the best warns with the plan to use, and the
    report shows both predictions. One process here: the planner's result is given by hand."""
    import warnings
    from fxpar.viz.report import write_report
    cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    batch = M.gpt_batch(cfg, 8)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    r = planner.auto_plan(planner_stats(M.GPT(cfg), batch), opt, 1, "cpu")
    slow = max(r.table, key=lambda c: c.step_s)               # most microbatches
    assert slow.plan.microbatches > 1
    torch.manual_seed(0)
    pm = fxpar.parallelize(M.GPT(cfg), 1, example_batch=batch, optimizer=opt, plan=slow.plan)
    pm.plan_report, pm.REFIT_AFTER = r, 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            pm.step(batch)
    new = pm.plan_report
    assert new is not r and new.start_up is r and "compute x" in new.refit, new.refit
    measured = sorted(s.time_s for s in pm.step_stats[2:])[1]
    now = next(c for c in new.table if c.plan == slow.plan)
    k = float(new.refit.rsplit("compute x", 1)[1].split()[0])
    if k not in (round(1 / 64, 2), 64.0):  # inside the fit's range: the price is the step
        assert now.step_s == pytest.approx(measured, rel=0.01), (new.refit, measured)
    else:  # a machine loaded far past the start-up timing: the factor stops at its bound
        assert (now.step_s < measured) == (k == 64.0), (new.refit, measured)
    said = [str(w.message) for w in caught if "re-fitted" in str(w.message)]
    assert len(said) == 1 and str(planner.plan_dict(new.best.plan)) in said[0], (
        [str(w.message) for w in caught], new.format(4), now.row())
    page = open(write_report(pm, str(tmp_path), svgs=[], images=[])).read()
    assert "start-up calibration" in page and "re-fit to steps 3-4 (median" in page


def test_what_the_planner_measured_is_remembered_per_key(tmp_path, monkeypatch):
    """machine.remembered: measured once per key and kept on disk (FXPAR_CACHE_DIR/planner);
    another key, an unreadable entry or FXPAR_PLAN_CACHE=0 measures again, and the last
    remembers nothing."""
    monkeypatch.setenv("FXPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FXPAR_PLAN_CACHE", "1")
    calls = []

    def measure():
        calls.append(1)
        return {"figure": len(calls)}
    assert machine.remembered("model", ["a"], measure) == ({"figure": 1}, False)
    assert machine.remembered("model", ["a"], measure) == ({"figure": 1}, True)
    assert machine.remembered("model", ["b"], measure) == ({"figure": 2}, False)
    for p in (tmp_path / "planner").iterdir():
        p.write_bytes(b"not a pickle")
    assert machine.remembered("model", ["a"], measure) == ({"figure": 3}, False)
    monkeypatch.setenv("FXPAR_PLAN_CACHE", "0")
    assert machine.remembered("model", ["c"], measure) == ({"figure": 4}, False)
    assert machine.remembered("model", ["c"], measure) == ({"figure": 5}, False)
    assert len(list((tmp_path / "planner").iterdir())) == 2  # ("a" and "b" only)


@pytest.mark.slow
def test_a_job_launched_again_plans_from_what_it_measured_and_chooses_alike(tmp_path):
    """plan="auto" twice on the same 2 ranks, model and batch: the second time the machine's
    figures, the model's timing and the passes' probes come from the disk (planning in a
    fraction of the time: no measuring), the prices and the choice are the same, and the
    calibration says it was remembered."""
    from planner_workers import plan_twice
    first, second = fxpar.launch(plan_twice, 2, str(tmp_path))[0]
    assert first["plan"] == second["plan"] and first["prices"] == second["prices"]
    assert "remembered" not in first["calibrated"] and "remembered" in second["calibrated"]
    assert second["times"]["planner: calibrate"] < 0.2 * first["times"]["planner: calibrate"]
    assert second["times"]["planner: measure machine"] < 0.2 * first["times"][
        "planner: measure machine"]


@pytest.mark.slow
def test_plan_auto_refits_alike_on_every_rank():
    """Two gloo ranks, plan="auto", 8 steps: every rank re-fits at the same step to the same
    (slowest rank's) measurement and re-prices the same table, so every rank would choose
    alike; training goes on."""
    from planner_workers import refit_rank
    res = fxpar.launch(refit_rank, 2)
    (refit, kept, table, running, learned), other = res[0], res[1]
    assert "compute x" in refit and kept and learned and len(running) == 1, res
    assert other == res[0], res


@pytest.mark.slow
def test_demo_plans_and_reports_the_refit(tmp_path):
    """The README's demo: the planner picks dp x tp, re-fits after 8 steps, and the report
    shows both predictions next to the measured step."""
    from fxpar.examples.demo import main
    losses = main(out_dir=str(tmp_path), steps=9)
    assert losses[-1] < losses[0]
    page = (tmp_path / "report.html").read_text()  # the ranks' prints go to their own stdout
    assert "legal plans for 2 x cpu" in page and "chosen:" in page
    assert "start-up calibration" in page and "re-fit to steps 3-8" in page


def test_recalibrate_a_derived_remat_budget_and_an_unsimulated_pipeline(small_stats):
    """Plans whose remat budget the search derived to fit (pinning it would price another
    plan, or none) and pipelined plans outside the simulated best: each re-fits exactly."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=int(1.75 * 2 ** 20))
    r = planner.search(small_stats, 4, hw, batch_rows=8)
    tight = [c for c in r.table if not isinstance(c.plan.remat, str)]
    piped = [c for c in r.table if c.plan.pp > 1 and not c.simulated]
    assert tight and piped
    for c in (tight[0], tight[-1], piped[0], piped[-1]):
        new = planner.recalibrate(r, c.plan, 2 * c.step_s)
        now = next(x for x in new.table if planner.plan_dict(x.plan) == planner.plan_dict(c.plan))
        assert now.step_s == pytest.approx(2 * c.step_s, rel=0.005), c.row()


def test_gpu_profile_follows_torchs_fp32_matmul_precision(monkeypatch):
    """On a GPU fp32 matmuls run on the tensor cores (TF32) only where torch allows it; by
    default ("highest") they run at the data sheet's FP32 rate (an H100's fp32 GPT-2 small
    step was priced 10x too fast at the TF32 rate). The shared profile is not changed."""
    import types
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: types.SimpleNamespace(total_memory=80 * GiB))
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        hw = cost.gpu_hardware("cuda:0")
        assert hw.name == "H100-SXM" and hw.async_launch and hw.memory == 80 * GiB
        assert hw.peak_flops["fp32"] == cost.FP32_WITHOUT_TF32["h100"] == 67e12
        assert "without TF32" in hw.calibrated
        torch.set_float32_matmul_precision("high")
        assert cost.gpu_hardware("cuda:0").peak_flops["fp32"] == 495e12
    finally:
        torch.set_float32_matmul_precision(old)
    assert cost.HARDWARE["h100"].peak_flops["fp32"] == 495e12
    assert not cost.cpu_hardware().async_launch


def test_host_dispatch_overlaps_device_work_on_gpus(small_stats):
    """A GPU's host enqueues kernels while the device runs: a segment costs the larger of its
    device time and its dispatch time (CPU: their sum, one thread does both)."""
    s = small_stats.layers[0]
    slow_host = dataclasses.replace(cost.HARDWARE["a100"], node_overhead=1e-3)
    device_only = planner._seg_time(s, small_stats, small_stats.rows, 1,
                                    dataclasses.replace(slow_host, node_overhead=0.0), "fp32",
                                    "f")
    host = s.nodes_f * 1e-3
    assert host > device_only
    assert planner._seg_time(s, small_stats, small_stats.rows, 1, slow_host, "fp32",
                             "f") == pytest.approx(host)
    cpu_like = dataclasses.replace(slow_host, async_launch=False)
    assert planner._seg_time(s, small_stats, small_stats.rows, 1, cpu_like, "fp32",
                             "f") == pytest.approx(host + device_only)


def test_cuda_graph_replay_prices_no_host_dispatch(small_stats):
    """On a GPU a pp=1 plan with one microbatch is replayed as a CUDA graph (Plan.cuda_graphs):
    its graph nodes cost no host dispatch, so a host-bound model is priced at its device time;
    cuda_graphs=False and microbatched plans keep the dispatch cost; CPUs never capture."""
    hw = dataclasses.replace(cost.HARDWARE["h100"], node_overhead=1e-3)  # host-bound
    fixed = {"dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "remat": "none"}

    def step(hw, rows=small_stats.rows, **extra):
        return planner.search(small_stats, 1, hw, batch_rows=rows,
                              constraints={**fixed, **extra}).table[0]
    graphed, eager = step(hw), step(hw, cuda_graphs=False)
    nodes = sum(s.nodes_f + s.nodes_b for s in small_stats.segments)
    assert eager.step_s >= nodes * 1e-3 > 10 * graphed.step_s
    assert graphed.plan.cuda_graphs == "auto" and eager.plan.cuda_graphs is False
    assert step(hw, 2 * small_stats.rows, microbatches=2,
                schedule="gpipe").step_s >= 2 * nodes * 1e-3
    cpu_like = dataclasses.replace(hw, async_launch=False)
    assert step(cpu_like).step_s == pytest.approx(step(cpu_like, cuda_graphs=False).step_s)


def test_compiled_steps_pay_host_dispatch_per_call_not_per_node(monkeypatch):
    """Under Inductor (codegen "auto" on a GPU) an uncaptured step's host launches its
    compiled runs and the library kernels they call, not one op per graph node: a
    microbatched plan pays that per microbatch (priced per node, a GPT-2's m=2 step was 3.7x
    its m=1 step on an H200's data sheet); codegen="eager" pays per node."""
    from fxpar.compiler import codegen
    from fxpar.examples import models as M
    monkeypatch.delenv("FXPAR_CODEGEN", raising=False)  # (the suite runs op by op)
    cfg = M.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    stats = planner_stats(M.GPT(cfg), M.gpt_batch(cfg, 4))
    gm, _ = stats.graph
    nodes = sum(s.nodes_f + s.nodes_b for s in stats.segments)
    mms = sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                           torch.ops.aten.bmm.default) for n in gm.graph.nodes)
    assert stats.host_calls_compiled == codegen.host_calls(gm.graph)
    assert mms < stats.host_calls_compiled < nodes / 3
    hw = dataclasses.replace(cost.HARDWARE["h200"], node_overhead=1e-3)  # host-bound
    fixed = {"dp": 1, "tp": 1, "pp": 1, "microbatches": 2, "schedule": "gpipe",
             "remat": "none"}

    def step(**extra):
        return planner.search(stats, 1, hw, batch_rows=8,
                              constraints={**fixed, **extra}).table[0].step_s
    compiled, eager = step(), step(codegen="eager")
    assert 2 * stats.host_calls_compiled * 1e-3 <= compiled < 2 * nodes * 1e-3 <= eager


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_figures_come_from_the_formula_the_explanation_prints(zero, small_stats):
    """The memory model keeps params + grads + optimizer symbolic (sympy): the figures are
    that formula evaluated, and `explain()` prints it with the sizes substituted in."""
    import sympy
    from fxpar.compiler import memory_model as memory
    stats = small_stats
    est, _ = memory.stage_memory(stats.segments, stats, tp=1, dp=4, zero=zero, rows=8,
                                 in_flight=1, precision="bf16", optimizer="adamw")
    subs = {memory.N: est.sizes["N"], memory.DP: 4, memory.B: 2, memory.S: 12}
    for expr, got in zip(est.state, (est.params, est.grads, est.optimizer)):
        assert float(expr.subs(subs)) == pytest.approx(got)
    assert sympy.simplify(sum(est.state).subs(subs) - (est.params + est.grads + est.optimizer)) \
        == pytest.approx(0)
    assert ("/dp" in str(est.state[2])) == (zero >= 1)
    assert ("/dp" in str(est.state[0])) == (zero >= 3)
    r = planner.search(stats, 4, cost.HARDWARE["a100"], batch_rows=8, precision="bf16",
                       constraints={"zero": zero, "dp": 4}, executable=False)
    assert "params + grads + optimizer = N*" in r.explain()


def test_zero12_parameter_gather_is_priced_exposed(small_stats):
    """ZeRO-1/2 all-gather the stepped shards after the optimizer, where no backward is left
    to hide them: even on a device that overlaps communication with the backward, the gather
    (and copying it back into the parameters) is added whole to the step, so ZeRO-1 costs
    plain dp's step plus the gather, less the optimizer's saving."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB)

    def price(zero):
        return planner.search(small_stats, 2, hw, batch_rows=4096, constraints={
            "dp": 2, "tp": 1, "pp": 1, "zero": zero, "remat": "none"}).table[0]
    plain, z1 = price(0), price(1)
    # (the parameters' bytes, gathered in one bucket at least; the backward would hide it)
    gather = hw.comm("all_gather", z1.memory.params, 2, 2, calls=1)
    assert gather < 0.5 * plain.parts["compute"]
    assert z1.parts["dp communication"] - plain.parts["dp communication"] >= gather
    assert z1.step_s - plain.step_s == pytest.approx(
        z1.parts["dp communication"] - plain.parts["dp communication"]
        + z1.parts["optimizer"] - plain.parts["optimizer"], rel=1e-6)


def test_cpu_calibration_times_the_optimizer_the_runtime_will_run(monkeypatch):
    """Under Inductor's codegen the runtime swaps the user's AdamW for torch's fused kernel
    (runtime/optim.prefer_fused); the planner's calibration times that same optimizer (the
    loop over tensors it had timed is ~3x slower on CPU, and over-pricing the whole model's
    update against a ZeRO shard's made the demo pick ZeRO-2 for speed)."""
    from fxpar.examples import models as M
    cfg = M.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model, batch = M.GPT(cfg), M.gpt_batch(cfg, 2)
    stats = planner_stats(model, batch)
    args, params = calibration_inputs(stats.graph, model, batch)
    timed = []
    real = machine.optim.prefer_fused
    monkeypatch.setattr(machine.optim, "prefer_fused",
                        lambda opt: timed.append(opt) or real(opt))
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    t_graph, spread, step_s, alone, small = machine.time_model(stats.graph[0], args, params,
                                                               adamw)
    assert not timed and step_s > 0 and t_graph > 0  # eager codegen: the optimizer as built
    assert alone is None and small is None  # (one process: no rank to time alone)
    hw = planner.fit_to_timing(cost.cpu_hardware(), stats, t_graph, spread, step_s, alone)
    assert hw.optimizer_s == step_s and 0.03 <= hw.noise <= 0.05 and hw.alone_speedup == 1
    _, _, step_s, _, _ = machine.time_model(stats.graph[0], args, params, adamw, fused=True)
    assert len(timed) == 1 and all(g["fused"] for g in timed[0].param_groups)
    assert step_s > 0


def test_cpu_calibration_splits_the_graph_time_into_per_row_and_per_call(small_stats):
    """planner.fit_to_timing with the graph timed at the batch and at the fewest rows a plan
    calls it on (one row here): the priced graph reproduces both timings and interpolates
    between them, the per-row part as the ops' roofline scaled (so it follows the rows and
    the tp split) and the rest per node (each call pays it). With one timing everything is
    per node."""
    hw = dataclasses.replace(cost.cpu_hardware(), node_overhead=2e-6)
    stats = dataclasses.replace(small_stats, rows=8)  # (as traced on a batch of 8 rows)

    def graph_s(h, rows):
        return sum(planner._seg_time(s, stats, rows, 1, h, "fp32", part)
                   for s in stats.segments for part in ("f", "b"))
    nodes = sum(s.nodes_f + s.nodes_b for s in stats.segments)
    roofline = graph_s(dataclasses.replace(hw, node_overhead=0.0), stats.rows)

    def timed(rows):  # 5x the roofline per row, 10 us a node per call
        return 5 * roofline * rows / stats.rows + nodes * 10e-6
    assert planner.smallest_call_rows(stats, 2) == 1
    fit = planner.fit_to_timing(hw, stats, timed(stats.rows), 0.01, None, None, timed(1),
                                small_rows=1)
    assert fit.roofline_scale == pytest.approx(5.0, rel=1e-6)
    assert fit.node_overhead == pytest.approx(10e-6, rel=1e-6)
    for rows in (1, 2, stats.rows // 2, stats.rows):
        assert graph_s(fit, rows) == pytest.approx(timed(rows), rel=1e-6)
    assert f"at {stats.rows} rows" in fit.calibrated and "at 1 ->" in fit.calibrated
    # a timing at half the rows (small_rows not given) is the same line
    half = planner.fit_to_timing(hw, stats, timed(stats.rows), 0.01, None, None,
                                 timed(stats.rows / 2))
    assert half.node_overhead == pytest.approx(10e-6, rel=1e-6)
    one = planner.fit_to_timing(hw, stats, timed(stats.rows), 0.01, None)  # one timing
    assert one.roofline_scale == 1.0
    assert one.node_overhead == pytest.approx((timed(stats.rows) - roofline) / nodes,
                                              rel=1e-6)
    # a small timing above the whole's (noise): no per-row part beyond the roofline
    flat = planner.fit_to_timing(hw, stats, timed(stats.rows), 0.01, None, None,
                                 1.1 * timed(stats.rows), small_rows=1)
    assert flat.roofline_scale == 1.0
    assert graph_s(flat, stats.rows) == pytest.approx(timed(stats.rows))


def test_cpu_calibration_of_one_sequence_splits_per_token_and_per_call(small_stats):
    """One row (no plan calls fewer): the second timing is at the fewest tokens a cp rank
    takes; attention shrinks with the square of the tokens, the rest linearly. The fitted
    prices reproduce both timings, and a cp=2 or tp rank's call (half the work) is not
    charged the whole call's time per node."""
    hw = dataclasses.replace(cost.cpu_hardware(), node_overhead=2e-6)
    segs = [dataclasses.replace(s, attn_flops_f=s.flops_f / 4, attn_flops_b=s.flops_b / 4)
            for s in small_stats.segments]
    stats = dataclasses.replace(small_stats, rows=1, seq=64, cp_refusal=None, segments=segs)

    def graph_s(h, rows=1):
        return sum(planner._seg_time(s, stats, rows, 1, h, "fp32", part)
                   for s in stats.segments for part in ("f", "b"))
    nodes = sum(s.nodes_f + s.nodes_b for s in stats.segments)
    base = dataclasses.replace(hw, node_overhead=0.0)
    roofline = graph_s(base)
    attention = sum(s.attn_flops_f + s.attn_flops_b for s in segs) / (
        base.flops("fp32") * base.matmul_efficiency)

    def timed(tokens):  # 5x the roofline at these tokens, 10 us a node per call
        g = tokens / stats.seq
        return 5 * (g * (roofline - attention) + g * g * attention) + nodes * 10e-6
    assert planner.smallest_call_rows(stats, 4) is None
    assert planner.smallest_call_tokens(stats, 2) == 32
    assert planner.smallest_call_tokens(stats, 4) == 16
    assert planner.smallest_call_tokens(stats, 6) == 32  # (cp divides the world: 2 of 6)
    assert planner.smallest_call_tokens(stats, 1) is None
    assert planner.smallest_call_tokens(dataclasses.replace(stats, seq=None), 4) is None
    fit = planner.fit_to_timing(hw, stats, timed(64), 0.01, None, None, timed(16),
                                small_tokens=16)
    assert fit.roofline_scale == pytest.approx(5.0, rel=1e-6)
    assert fit.node_overhead == pytest.approx(10e-6, rel=1e-6)
    assert graph_s(fit) == pytest.approx(timed(64), rel=1e-6)
    assert "at 64 tokens" in fit.calibrated and "at 16 ->" in fit.calibrated
    # half the work (a cp=2 rank's tokens): the fitted line's price; one timing puts
    # everything beyond the roofline per node, which half the work pays whole
    half = nodes * 10e-6 + 5 * roofline / 2
    assert graph_s(fit, 0.5) == pytest.approx(half, rel=1e-6)
    one = planner.fit_to_timing(hw, stats, timed(64), 0.01, None)
    assert graph_s(one, 0.5) == pytest.approx(timed(64) - roofline / 2, rel=1e-6)
    assert graph_s(one, 0.5) - half == pytest.approx(2 * roofline, rel=1e-6)


def test_the_smallest_call_is_one_row_unless_microbatches_would_change_the_step():
    """The calibration's second timing is at the fewest rows a plan runs the graph on: one
    row where microbatches are allowed; with BatchNorm (its statistics per microbatch would
    differ from one step's) the batch over the dp ranks, at most the world."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8))
    stats = planner_stats(model, torch.randn(8, 16), lambda m, b: m(b).square().mean())
    assert stats.mutated_buffers and stats.rows == 8
    assert planner.smallest_call_rows(stats, 4) == 2
    assert planner.smallest_call_rows(stats, 1) is None  # (one rank: the whole batch only)
    assert planner.smallest_call_rows(stats, 3) is None  # (8 rows do not split over 3)
    assert planner.smallest_call_rows(stats, 4, {"batch_stats": "microbatch"}) == 1


@pytest.mark.slow  # (two models captured and probed: kept out of make test's 6 minutes)
def test_the_work_data_parallelism_leaves_whole_is_priced_whole():
    """An MoE whose dispatch cannot run on each rank's rows (test_local_dispatch's
    CapacityMoE: a capacity over the sorted rows) runs its routed expert matmul on the
    gathered batch under the dp pass: count_pass_extras finds that work in the pass's own
    graph, and a dp rank is priced for it at the whole batch's rows. A dense model's matmuls
    all halve, and so do HF Mixtral's experts (their dispatch runs on each rank's rows)."""
    from fxpar.examples import zoo
    from test_local_dispatch import CapacityMoE, _capacity_loss
    hw = dataclasses.replace(cost.HARDWARE["a100"], node_overhead=0.0)  # (no host bound)
    torch.manual_seed(0)
    capacity = (CapacityMoE(d=64), {"ids": torch.randint(0, 32, (8, 64)),
                                    "labels": torch.randint(0, 32, (8, 64))}, _capacity_loss)
    for name, moe in (("capacity", True), ("llama", False), ("mixtral", False)):
        if name == "capacity":
            model, batch, loss_fn = capacity
        else:
            model, spec = zoo.build(name)
            batch, loss_fn = spec.batch(0), spec.loss_fn
        stats = planner_stats(model, batch, loss_fn)
        planner.count_pass_extras(stats)
        whole = sum(s.flops_f_whole + s.flops_b_whole for s in stats.segments)
        total = sum(s.flops_f + s.flops_b for s in stats.segments)
        if not moe:  # (Mixtral: its router's weight gradient, no bigger than the router)
            assert whole == 0 if name == "llama" else whole < 0.01 * total, name
            continue
        assert 0.1 * total < whole < total
        s = max(stats.segments, key=lambda s: s.flops_f_whole)
        rows = stats.rows / 2  # a dp=2 rank's
        extra = (planner._seg_time(s, stats, rows, 1, hw, "fp32", "f", dp=2)
                 - planner._seg_time(s, stats, rows, 1, hw, "fp32", "f", dp=1))
        assert extra == pytest.approx(
            0.5 * s.flops_f_whole / (hw.flops("fp32") * hw.matmul_efficiency)
            + 0.5 * s.bytes_f_whole / hw.mem_bandwidth, rel=1e-6)


def _cand(step_s, **fields):
    plan = fxpar.Plan(**{"dp": 1, "tp": 1, "pp": 1, **fields})
    return planner.Candidate(plan, step_s, None, None, 0.0, {"compute": step_s})


def test_a_tie_within_the_noise_goes_to_the_simpler_plan_and_a_clear_win_does_not():
    """planner.rank: plans predicted within the prediction's resolution are a tie, broken by
    simplicity (less tp, fewer stages and microbatches, fewer axes, less ZeRO), so a
    timing that varies a few percent between runs does not flip the choice; outside it the
    fastest plan wins."""
    pp = _cand(0.100, pp=2, microbatches=2, schedule="zero-bubble")
    dp = _cand(0.104, dp=2)
    tp = _cand(0.102, tp=2)
    z3 = _cand(0.1035, dp=2, zero=3)
    ranked = planner.rank([pp, dp, tp, z3], noise=0.05)
    assert ranked[0] is dp                       # within 5%: the simplest
    assert ranked[1:] == [pp, tp, z3]            # the rest fastest first
    assert planner.rank([pp, dp, tp, z3], noise=0.01)[0] is pp  # 4% apart: a clear win
    assert planner.rank([z3, _cand(0.103, dp=2, zero=1)], noise=0.05)[0].plan.zero == 1
    # a deep pipeline with many microbatches is not "simpler" for having one axis
    deep, hybrid = _cand(0.100, pp=4, microbatches=8), _cand(0.104, dp=2, pp=2)
    assert planner.rank([deep, hybrid], noise=0.05)[0] is hybrid


def test_the_report_says_where_plain_data_parallelism_ranks_and_why(small_stats):
    """Plain dp is the baseline every user knows: the summary and explain() name its rank and
    what the choice saves over it, or why it is not in the table."""
    hw = cost.HARDWARE["a100"]
    r = planner.search(small_stats, 8, hw, batch_rows=8, executable=False)
    line = r.plain_dp()
    if r.best.plan.dp == 8 and r.best.plan.zero == 0 and r.best.plan.microbatches == 1:
        assert line == "plain data parallelism (dp=8) is the choice"
    else:
        k = next(i for i, c in enumerate(r.table) if c.plan.dp == 8 and c.plan.zero == 0
                 and c.plan.microbatches == 1)
        assert f"ranks #{k + 1}, " in line, line
    assert line in r.summary() and line in r.explain()
    fixed = planner.search(small_stats, 8, hw, batch_rows=8, executable=False,
                           constraints={"tp": 2})
    assert fixed.plain_dp() == ("plain data parallelism (dp=8) is not in the table: the fields "
                                "fixed for this job ({'tp': 2}) rule it out")
    odd = planner.search(small_stats, 8, hw, batch_rows=4, executable=False)
    assert "the batch of 4 rows does not split over dp=8" in odd.plain_dp()


@pytest.mark.parametrize("pp,m,schedule,layers", [
    (2, 1, "1f1b", 3), pytest.param(3, 1, "gpipe", 6, marks=pytest.mark.slow),
    pytest.param(2, 2, "interleaved", 6, marks=pytest.mark.slow)])
@pytest.mark.slow  # (make test's 6 minutes)
def test_the_planner_prices_the_stages_the_pipeline_pass_cuts(pp, m, schedule, layers):
    """The planner's stages are pipeline_split's own cut (its partition run on the planner's
    copy of the graph), not a second partitioner's: for the same plan, every layer's forward
    runs in the stage the planner priced it in."""
    model = M.hf_llama(vocab=512, hidden=64 if layers > 3 else 32, layers=layers, heads=4,
                       kv_heads=2)
    batch = M.hf_lm_batch(512, 8, 32 if layers > 3 else 16)
    stats = planner_stats(model, batch)
    v = 2 if schedule == "interleaved" else 1
    priced = {s.name: k for k, stage in enumerate(planner.stages_of(stats, pp, v))
              for s in stage if s.name not in ("pre", "post")}
    prog = fxpar.compile(model, pp, example_batch=batch,
                         plan={"pp": pp, "microbatches": m, "schedule": schedule})
    ran: dict[str, set] = {}
    names = graphstats.forward_segments(prog.graph)
    for n in prog.graph.graph.nodes:
        if n.name in names and n.meta.get(ir.STAGE) is not None:
            ran.setdefault(names[n.name], set()).add(n.meta[ir.STAGE])
    assert set(priced) == {k for k in ran if k not in ("pre", "post")}
    for layer, stage in priced.items():
        assert stage in ran[layer], (layer, stage, ran[layer])
    assert stats.stage_shares[(pp * v, "cpu")]  # the pass's cut, not the fallback


@pytest.mark.slow  # (make test's 6 minutes)
def test_a_stage_the_pass_gives_the_head_alone_is_priced_as_cut():
    """BERT-MLM with a 16k-token head: the pass's pp=2 cut gives stage 1 the MLM head alone
    (its LayerNorm, tied decoder and loss cost what the four layers do). The planner
    prices those stages - not a layer balance of its own, which had put two layers on each
    and priced stage 0 at half its gradients - and each stage's saved activations as the cut
    saves them."""
    import transformers as T
    model = T.BertForMaskedLM(T.BertConfig(
        vocab_size=16384, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        intermediate_size=1024, max_position_embeddings=128))
    stats = planner_stats(model, M.hf_lm_batch(16384, 8, 64))
    first, last = planner.stages_of(stats, 2, 1, "cpu")
    assert [s.name for s in last] == ["post"]
    assert [s.name for s in first] == [s.name for s in stats.segments]
    # of the head, stage 0 runs at most its first dense and the tied weight's gradient sum
    head_here, head = first[-1], stats.segments[-1]
    assert head_here.flops_f + head_here.flops_b < 0.02 * (head.flops_f + head.flops_b)
    assert first[0] == stats.segments[0] and first[1:-1] == stats.layers
    cut = stats.stage_saved[(2, "cpu")]
    assert cut[0] == pytest.approx(sum(s.saved for s in first), rel=0.02)
    assert cut[1] == pytest.approx(sum(s.saved for s in last), rel=0.02)


@pytest.mark.slow  # (make test's 6 minutes)
def test_each_stage_is_priced_with_the_work_the_pass_gives_it():
    """A conv net whose pp=4 cut puts the stem's convolution alone on a stage and cuts
    inside the first block (no mapping of whole layers onto stages says what each stage
    runs): the planner's stage segments carry, stage by stage, the FLOPs, op count and
    parameters of the nodes the compiled job gives that stage, and together the model's."""
    import transformers as T
    model = T.ResNetForImageClassification(T.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_labels=10))
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(8, 3, 32, 32, generator=g),
             "labels": torch.randint(0, 10, (8,), generator=g)}
    stats = planner_stats(model, batch)
    stages = planner.stages_of(stats, 4, 1, "cpu")
    prog = fxpar.compile(model, 4, example_batch=batch, plan={"pp": 4})
    flops, nodes = [0.0] * 4, [0] * 4
    for n in prog.graph.graph.nodes:
        k = n.meta.get(ir.STAGE)
        if n.op == "call_function" and k is not None and n.name in stats.node_segment:
            flops[k] += cost.node_flops(n)
            nodes[k] += 1
    for k in range(4):
        assert sum(s.flops_f + s.flops_b for s in stages[k]) == pytest.approx(flops[k],
                                                                              rel=1e-6)
        assert sum(s.nodes_f + s.nodes_b for s in stages[k]) == pytest.approx(nodes[k])
    for f in ("flops_f", "flops_b", "bytes_b", "saved", "params"):
        assert sum(getattr(s, f) for st in stages for s in st) == pytest.approx(
            sum(getattr(s, f) for s in stats.segments), rel=1e-6), f


@pytest.mark.parametrize("name", ["mixtral", pytest.param("gpt2", marks=pytest.mark.slow),
                                  pytest.param("bert_mlm", marks=pytest.mark.slow)])
def test_the_planner_prices_the_tensor_parallel_split_the_pass_makes(name):
    """Every linear weight is priced in the role the tensor_parallel pass gives it in the
    tp=2 job: GPT-2's fused QKV, BERT-MLM's head tied to the word embedding (vocabulary-
    split) behind a dense layer whose output is gathered for its LayerNorm, and an MoE whose
    router stays whole (a walk over the graph of its own paired the router with the
    attention and priced every projection of the next layers in the wrong role)."""
    import warnings
    from fxpar.examples import zoo
    z = zoo.models()[name]
    torch.manual_seed(0)
    model, batch = z.factory(), z.batch(0)
    stats = planner_stats(model, batch, z.loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (weights left whole are reported by the pass)
        prog = fxpar.compile(model, 2, example_batch=batch, loss_fn=z.loss_fn,
                             plan={"tp": 2})
    d = prog.graph.meta["tensor_parallel"]
    ran = {**{w: "column" for w in d.column}, **{w: "row" for w in d.row},
           **{w: "column+gather" for w in d.gathered}}
    assert stats.tp_roles == ran
    assert ran and (name != "mixtral" or d.replicated)  # (the router: whole)


def test_a_stages_transfers_cost_a_latency_each_but_small_ones_ride_along():
    """What one stage sends another for one action is one group: each value over a socket
    buffer's size costs a latency (on both ranks), values under it (a BatchNorm's
    statistics beside its activation) only their bytes."""
    model = M.hf_gpt2(vocab=512, n_embd=32, n_layer=4, n_head=4)
    stats = planner_stats(model, M.hf_lm_batch(512, 8, 16))
    hw = dataclasses.replace(cost.cpu_hardware(), overlap=0.0)  # (gloo's: not hidden)
    planner.pass_stages(stats, 2, "cpu")
    big = planner.SMALL_TRANSFER * 4

    def step(sizes):
        sent = [planner.Transfer(0, 1, b, False, False, False, False) for b in sizes]
        st = dataclasses.replace(stats, transfers={(2, "cpu"): sent}, shared_weights={})
        return planner.search(st, 2, hw, batch_rows=8, constraints={
            "pp": 2, "microbatches": 1, "schedule": "1f1b"}).best.step_s
    one = step([big])
    with_small = step([big] + [32] * 6)
    assert with_small - one == pytest.approx(
        2 * (hw.comm("p2p", big + 6 * 32, 2, 2) - hw.comm("p2p", big, 2, 2)), rel=0.5,
        abs=1e-9)
    latency = hw.comm("p2p", 0, 2, 2)
    assert step([big, big]) - one >= 2 * latency * 0.99  # a second large value: a latency


def test_a_tied_weight_under_a_pipeline_is_priced_as_the_pass_sends_it():
    """GPT-2's embedding is also its head: at pp=2 the pass sums the two stages' parts of its
    gradient once a step (an R part), so the head's part crosses back to the first stage
    once, not every microbatch, and the runtime exchanges the summed gradient once. The
    planner reads both off the pass's own cut of the graph."""
    model = M.hf_gpt2(vocab=512, n_embd=32, n_layer=4, n_head=4)
    stats = planner_stats(model, M.hf_lm_batch(512, 8, 16))
    hw = cost.cpu_hardware()
    r = planner.search(stats, 2, hw, batch_rows=8, constraints={"pp": 2})
    weight = 512 * 32 * 4
    assert stats.shared_weights[(2, "cpu")] == [(weight, [0, 1], 0)]  # (summed on stage 0)
    sent = stats.transfers[(2, "cpu")]
    (part,) = [t for t in sent if t.once]
    assert (part.src, part.dst, part.nbytes, part.per_row) == (1, 0, weight, False)
    assert any(t.src == 0 and t.dst == 1 and t.per_row and not t.backward
               for t in sent)  # the residual stream forward
    for c in r.table:  # the part and the summed gradient, each once a step
        assert c.parts["tied weights' gradients"] == pytest.approx(
            2 * hw.comm("p2p", weight, 2, 2))
    # and in memory: the head's stage holds its running sum of the part over the step, the
    # embedding's stage the buffer it receives it in after the last microbatch, whatever
    # the microbatches
    untied = dataclasses.replace(stats, transfers={k: [t for t in v if not t.once]
                                                   for k, v in stats.transfers.items()})
    bare = {planner.plan_str(c.plan): c for c in planner.search(
        untied, 2, hw, batch_rows=8, constraints={"pp": 2}).table}
    for c in r.table:
        if c.plan.schedule == "interleaved":  # (two chunks a rank: the pass's 4-stage cut)
            continue
        first, last = c.memory.per_stage
        b_first, b_last = bare[planner.plan_str(c.plan)].memory.per_stage
        assert last.buffers - b_last.buffers == pytest.approx(weight)
        assert first.buffers == b_first.buffers and first.at_end >= weight


def _limit_ruling_out_plain_dp(stats) -> float:
    """A device memory (bytes; the search keeps 90% of it) halfway between the smallest plan
    of 2 ranks and plain dp without remat, as priced: plain dp fits only with a remat budget."""
    from planner_workers import MEM_ROWS
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=64 * GiB)
    r = planner.search(stats, 2, hw, batch_rows=MEM_ROWS, optimizer="adamw")
    plain = next(c for c in r.table if (c.plan.dp, c.plan.zero, c.plan.microbatches) ==
                 (2, 0, 1) and c.plan.remat == "none")
    least = min(c.memory.total for c in r.table)
    assert least < 0.8 * plain.memory.total, (least, plain.memory.total)
    return (least + plain.memory.total) / 2 / 0.9


@pytest.mark.slow  # (make test's 6 minutes)
def test_a_remat_budget_the_search_derives_is_one_the_pass_reaches():
    """Under a memory limit that plain dp exceeds, the search gives plans a remat budget to
    fit: the activation peak it priced (working memory included, as the pass simulates it),
    which the remat pass then reaches on the captured graph. Budgeting what was left after
    the static state handed the pass less than it can reach (a PlanError at compile)."""
    import copy
    from planner_workers import MEM_CFG, MEM_ROWS
    from fxpar.compiler.pass_manager import PassContext
    from fxpar.passes import remat
    stats = planner_stats(M.GPT(MEM_CFG), M.gpt_batch(MEM_CFG, MEM_ROWS))
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=_limit_ruling_out_plain_dp(stats))
    r = planner.search(stats, 2, hw, batch_rows=MEM_ROWS, optimizer="adamw")
    derived = [c for c in r.table if isinstance(c.plan.remat, int)
               and (c.plan.tp, c.plan.pp, c.plan.microbatches) == (1, 1, 1)]
    assert any(c.plan.zero == 0 for c in derived), [str(c.plan) for c in r.table]
    gm, sig = stats.graph
    for c in sorted(derived, key=lambda c: c.plan.remat)[:2]:  # the tightest budgets
        assert c.plan.remat == int(c.memory.activations)
        new = remat.run(torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)),
                        remat.Options(remat=c.plan.remat, dp=c.plan.dp),
                        PassContext(signature=sig))
        assert new.meta["remat"].peak_after <= c.plan.remat, (c.plan, new.meta["remat"])


@pytest.mark.slow
def test_a_memory_limit_that_rules_out_plain_dp_is_kept_by_the_choice(monkeypatch):
    """FXPAR_MEMORY_PER_DEVICE set below what plain dp needs (as priced): plan="auto" picks
    a plan predicted to fit, the report says why plain dp is out, and each rank's measured
    step stays within its estimate (plain dp is only in the table with a remat budget)."""
    from planner_workers import MEM_CFG, MEM_ROWS, limited_rank
    stats = planner_stats(M.GPT(MEM_CFG), M.gpt_batch(MEM_CFG, MEM_ROWS))
    limit = _limit_ruling_out_plain_dp(stats)
    monkeypatch.setenv("FXPAR_MEMORY_PER_DEVICE", str(limit / GiB))
    res = fxpar.launch(limited_rank, 2)
    for rank, (plan, peak, step_est, total, plain_line) in res.items():
        assert (plan["dp"], plan["zero"], plan["microbatches"], plan["remat"]) != \
            (2, 0, 1, "none"), plan
        assert total <= 0.9 * limit, (total, limit)
        assert peak <= 1.10 * step_est, (rank, plan, peak, step_est)
        # out of the table, or in it only with a remat budget
        assert "usable" in plain_line or "remat=" in plain_line, plain_line


@pytest.mark.slow
def test_the_regret_benchmark_on_one_model(monkeypatch):
    """benchmarks/planner_regret.py's fast subset: plan="auto" on 2 CPU ranks against the
    best of three measured plans (plain dp among them), interleaved. The target is 1.10
    (docs/benchmarks.md); 1.25 here, for a CI machine's noise. Past it, one more job (its
    own start-up timing and measurements) decides: on a shared 2-core CI machine one job
    measured plans 0.2% apart in price 1.31x apart, where this VM's runs measure them within
    1.06x; a planner that is wrong fails both."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1] / "benchmarks"))
    import planner_regret as R
    reports = []
    for attempt in range(2):
        res = fxpar.launch(R.worker, 2, "llama_gqa", 3, 6, False)[0]
        rows = res["rows"]
        assert sum(r["chosen"] for r in rows) == 1 and len(rows) + len(res["failed"]) == 3
        assert not res["failed"], res["failed"]
        assert any(r["plan"].split()[:3] == ["dp=2", "tp=1", "pp=1"] for r in rows)
        s = R.summarize(res)
        reports.append(R.report([res]))
        print(reports[-1])
        if s["regret"] <= 1.25:
            return
    pytest.fail("regret past 1.25 in two jobs:\n" + "\n".join(reports))


def test_pipelines_on_oversubscribed_cores_are_priced_by_the_work_not_the_bubbles(small_stats):
    """More CPU ranks than cores (Hardware.core_share < 1): a rank waiting in a bubble hands
    its core to the others, so a pipeline costs between its critical path at a whole core's
    speed and the mean busy time (`_makespan_on_shared_cores` below); plans without a
    pipeline are priced as before."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB, async_launch=False)

    def price(share, **fixed):
        r = planner.search(small_stats, 4, dataclasses.replace(hw, core_share=share),
                           batch_rows=8, constraints=fixed)
        return r.table[0]
    whole, shared = price(1.0, dp=2, pp=2, microbatches=1), price(0.5, dp=2, pp=2,
                                                                   microbatches=1)
    fwd, bwd = whole.ctx[0], whole.ctx[1]
    busy = sum(f + b for f, b in zip(fwd, bwd)) / 2
    assert shared.step_s < whole.step_s
    pipe_whole = whole.step_s - sum(v for k, v in whole.parts.items()
                                    if k not in ("compute", "pipeline bubble"))
    pipe_shared = shared.step_s - sum(v for k, v in shared.parts.items()
                                      if k not in ("compute", "pipeline bubble"))
    assert max(busy, 0.5 * pipe_whole) * (1 - 1e-9) <= pipe_shared < pipe_whole
    assert price(0.5, dp=4).step_s == pytest.approx(price(1.0, dp=4).step_s)


def test_a_pipeline_on_shared_cores_is_simulated_with_the_cores_shared_at_each_instant():
    """The ranks computing at an instant share the cores; waiting on communication is not
    faster for it. With whole cores the simulation is the schedule's own makespan."""
    sim = planner._makespan_on_shared_cores
    for sched, pp, m, v in (("1f1b", 2, 4, 1), ("gpipe", 4, 4, 1), ("interleaved", 2, 4, 2),
                            ("zero-bubble", 2, 4, 1)):
        fwd, bwd = [1.0 + r for r in range(pp)], [2.0 + r for r in range(pp)]
        assert sim(sched, pp, m, v, fwd, bwd, 0.1, 0.0, pp, 1.0) == pytest.approx(
            planner._makespan(sched, pp, m, v, fwd, bwd, 0.1))
    # 2 ranks on 1 core, one microbatch: the stages take turns, each with the whole core
    # (twice its speed with both busy, when its time was measured)
    assert sim("1f1b", 2, 1, 1, [1.0, 1.0], [2.0, 2.0], 0.0, 0.0, 2, 0.5) == pytest.approx(3.0)
    # half of each action waiting on a peer: that half takes its time
    assert sim("1f1b", 2, 1, 1, [1.0, 1.0], [2.0, 2.0], 0.0, 0.5, 2, 0.5) == pytest.approx(4.5)
    # many microbatches: both ranks compute most of the time, at the measured speed
    steady = sim("1f1b", 2, 32, 1, [1.0, 1.0], [2.0, 2.0], 0.0, 0.0, 2, 0.5)
    assert 32 * 3.0 * 0.98 < steady < 32 * 3.0 * 1.06


def test_a_transfer_is_on_the_critical_path_once_and_shares_the_cores_as_compute():
    """A transfer costs its sender and its receiver (both stage times include it), but the
    data travels during the sender's SEND: the receiver's share follows it on the critical
    path, not the sender's first. Copying it is work on the shared cores, faster while the
    other ranks wait (ResNet's pp=4 m=1 on 4 ranks over 2 cores was priced 1.15-1.66x its
    step with each transfer paid twice, as waiting)."""
    sim = planner._makespan_on_shared_cores
    c, cb, t = 1.0, 2.0, 0.5
    fwd, bwd = [c + t, c + t], [cb + t, cb + t]
    sends = ([t, 0.0], [0.0, t])  # stage 0 sends forward, stage 1 backward
    # whole cores: F0, then the SEND beside F1 (its receive t + c), B1, the SEND beside B0
    assert sim("1f1b", 2, 1, 1, fwd, bwd, 0.0, 0.0, 2, 1.0, sends) == pytest.approx(
        2 * c + 2 * cb + 2 * t)
    assert sim("1f1b", 2, 1, 1, fwd, bwd, 0.0, 0.0, 2, 1.0) == pytest.approx(
        2 * c + 2 * cb + 4 * t)  # (without: each transfer paid twice in turn)
    # 2 ranks on 1 core: nothing overlaps, and each share of a transfer is work at the
    # whole core's speed (twice what it was measured at, with both ranks busy), not a wait
    assert sim("1f1b", 2, 1, 1, fwd, bwd, 0.0, 0.0, 2, 0.5, sends) == pytest.approx(
        (2 * c + 2 * cb + 4 * t) / 2)
    # many microbatches: every transfer's work is paid, at the busy speed
    steady = sim("1f1b", 2, 32, 1, fwd, bwd, 0.0, 0.0, 2, 0.5, sends)
    assert 32 * (c + cb + 2 * t) * 0.98 < steady < 32 * (c + cb + 2 * t) * 1.06


def test_the_search_lists_one_program_once(small_stats):
    """At one microbatch GPipe and 1F1B run the same actions: one plan (1F1B), not two
    whose measured difference would be the timing's noise; with microbatches both."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB, async_launch=False)
    table = planner.search(small_stats, 2, hw, batch_rows=8, constraints={"pp": 2}).table
    one = {c.plan.schedule for c in table if c.plan.microbatches == 1}
    assert "1f1b" in one and "gpipe" not in one
    assert {"1f1b", "gpipe"} <= {c.plan.schedule for c in table if c.plan.microbatches == 2}
    fixed = planner.search(small_stats, 2, hw, batch_rows=8, constraints={
        "pp": 2, "microbatches": 1, "schedule": "gpipe"}).table  # (what the user asks for)
    assert {c.plan.schedule for c in fixed} == {"gpipe"}


def test_a_pipelines_transfers_are_priced_as_sends_of_their_own(small_stats):
    """Each transfer the pass inserts is priced on its sender as a SEND (Candidate.ctx) and
    its receiver's stage time; the SENDs follow the schedule's direction."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB, async_launch=False,
                             overlap=0.0)
    c = planner.search(small_stats, 2, hw, batch_rows=8, constraints={"pp": 2,
                                                                      "microbatches": 1}).table[0]
    fwd, bwd, *_, (send_f, send_b), _ = c.ctx
    assert send_f[0] > 0 and send_f[1] == 0 and send_b[0] == 0 and send_b[1] > 0
    assert send_f[0] < fwd[0] and send_b[1] < bwd[1]


def test_pipeline_stages_that_run_alone_are_priced_at_the_alone_speed(small_stats):
    """CPU ranks on their own cores compute faster while the others wait
    (Hardware.alone_speedup, timed at start-up): with one microbatch the stages take turns,
    so the whole makespan runs at the alone speed; with many microbatches the ranks are
    mostly busy together and the price stays near the busy one; no pipeline, no change."""
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4 * GiB, async_launch=False)

    def pipe(speedup, **fixed):
        c = planner.search(small_stats, 2, dataclasses.replace(hw, alone_speedup=speedup),
                           batch_rows=8, constraints=fixed).table[0]
        return c.step_s - sum(v for k, v in c.parts.items()
                              if k not in ("compute", "pipeline bubble"))
    one = dict(pp=2, microbatches=1, schedule="1f1b")
    assert pipe(1.25, **one) == pytest.approx(pipe(1.0, **one) / 1.25, rel=1e-6)
    many = dict(pp=2, microbatches=8, schedule="1f1b")
    assert pipe(1.0, **many) / 1.25 < pipe(1.25, **many) < pipe(1.0, **many)
    assert pipe(1.25, **many) > 0.9 * pipe(1.0, **many)
    assert pipe(1.25, dp=2) == pytest.approx(pipe(1.0, dp=2))


def test_the_loss_backward_is_priced_where_the_loss_is():
    """A backward op outside the layers goes with the forward op autograd made it for: a
    cross-entropy computed in the root module is "post" (by module alone it went to "pre",
    with the root's first forward op, the positions: the first stage's time and beside no
    saved value). On a GPU with the fusion pass the graph is priced with fxpar's
    cross-entropy kernel, which saves the half logits, not fp32 log-probabilities."""
    cfg = M.GPTConfig(vocab_size=1024, block_size=32, n_layer=2, n_head=4, n_embd=64)
    batch = M.gpt_batch(cfg, 4)
    stats = planner_stats(M.GPT(cfg), batch, precision="bf16")
    aten = torch.ops.aten
    gm, _ = stats.graph
    for target in (aten.nll_loss_backward.default, aten._log_softmax_backward_data.default):
        (n,) = gm.graph.find_nodes(op="call_function", target=target)
        assert stats.node_segment[n.name] == "post", n.name
    kernel = planner_stats(M.GPT(cfg), batch, precision="bf16", kernel_cross_entropy=True)
    logits = 4 * 32 * cfg.vocab_size
    assert stats.segments[-1].saved - kernel.segments[-1].saved == pytest.approx(
        logits * (4 - 2), rel=0.05)  # fp32 log-probs -> bf16 logits (+ a row value)
    assert kernel.segments[-1].transient < stats.segments[-1].transient
    assert planner.kernel_cross_entropy("cpu", None) is False
    assert planner.kernel_cross_entropy("cuda", {"fuse": False}) is False


def test_tp_activations_are_priced_from_the_tp_pass_graph():
    """What a tp=2 rank saves and works in, per segment, is the tp pass's own graph's: a row
    linear's partial sum, read only by its forward all-reduce, is not a saved value (counted
    as one, ViT's tp=2 was priced 1.23x what it allocates), and the working memory tp splits
    (a vocab-parallel loss's logits: the structural guess kept it whole, 1.21x) is what the
    probe found split."""
    from fxpar.passes import tensor_parallel
    cfg = M.GPTConfig(vocab_size=1024, block_size=32, n_layer=2, n_head=4, n_embd=64)
    stats = planner_stats(M.GPT(cfg), M.gpt_batch(cfg, 4))
    gm, sig = stats.graph
    g = planner._on_copy(tensor_parallel, gm, sig, {"tp": 2, "dp": 1}, 2,
                         group_names={"tp": "tp", "dp": "dp"})
    c10d = torch.ops._c10d_functional
    fwd = graphstats.forward_nodes(g)
    reduced = [n for n in fwd if n.target is c10d.all_reduce.default]
    assert reduced  # (the row linears' all-reduces sit on the forward side)
    saved = graphstats.saved_values(fwd)
    assert not any(k[0] in {r.args[0] for r in reduced} for k in saved)
    at2 = {s.name: s for s in graphstats.analyze(g, stats.rows).segments}
    planner.count_pass_extras(stats)
    for seg in stats.segments:
        x = at2[seg.name]
        assert seg.saved - seg.saved_split / 2 == pytest.approx(x.saved)
        assert seg.working(2) == pytest.approx(x.transient)
    assert stats.segments[-1].transient_split > 0  # (the loss's logits, split by vocab)


def test_a_saved_piece_of_a_split_keeps_the_whole_projection():
    """A fused q/k/v projection split into pieces (views of its output): where the backward
    reads one piece, the whole output stays alive, and the statistics count it whole (as
    the liveness simulation does). Counted as a piece, a cp rank's gathered attention
    (which reads its own q, and k and v gathered) was priced 15% under what it holds."""
    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).split(16, dim=-1)
            return (q.sin() + k + v).sum()  # (sin's backward reads q; k and v none)
    from fxpar.compiler.capture import capture_as_is
    gm, _ = capture_as_is(Fused(), (torch.randn(8, 16),), loss_fn=lambda m, b: m(*b))
    saved = graphstats.saved_values(graphstats.forward_nodes(gm))
    projection = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default)
    assert [k for k in saved if k[0] is projection] == [(projection, None)]
    assert graphstats.saved_bytes((projection, None)) == 8 * 48 * 4


def test_the_optimizer_goes_to_the_host_where_a_plan_does_not_fit_or_recomputes_to_fit():
    """Plan.offload_optimizer is a variant the search prices per plan where the plan does
    not fit with the state on the device, or fits only by recomputing (offloading may cost
    less): a 7.5B GPT in bf16 on one 80 GB H100 fits no plan with AdamW's state on the
    device (16 bytes a parameter: 120 GB) and fits with it on the host (the fp32 masters
    stay: they are the graph's parameters), priced with the copies over PCIe and the step on
    the host's CPU; on a 1.7B GPT only plans that recompute without it get the variant, and
    the plain one that needs no recompute wins."""
    hw = cost.HARDWARE["h100"]
    stats = G.gpt_stats("gpt-7.5b")
    with pytest.raises(PlanError, match="fits no legal plan"):
        planner.search(stats, 1, hw, batch_rows=8, precision="bf16", executable=False,
                       constraints={"offload_optimizer": False})
    r = planner.search(stats, 1, hw, batch_rows=8, precision="bf16", executable=False)
    b = r.best
    assert all(c.plan.offload_optimizer for c in r.table)
    assert b.memory.total <= 0.9 * hw.memory
    n = sum(s.params for s in stats.segments)
    assert b.memory.optimizer == pytest.approx(4 * n, rel=1e-6)  # the fp32 masters only
    assert b.memory.optimizer_step == 0
    # the copies: fp32 gradients out and values back over PCIe, not overlapped
    assert b.parts["optimizer offload"] == pytest.approx(2 * 4 * n / hw.host_link, rel=1e-6)
    assert "no plan fits with the optimizer's state on the device" in r.explain()
    assert "optimizer on host" in b.row() and "optimizer on host" in r.summary()
    fits = planner.search(G.gpt_stats("gpt-1.7b"), 1, hw, batch_rows=8, precision="bf16",
                          executable=False)
    on_device = {planner.plan_str(c.plan): c for c in fits.table
                 if not c.plan.offload_optimizer}
    for c in fits.table:
        if c.plan.offload_optimizer:  # its twin on the device recomputes to fit
            twin = dataclasses.replace(c.plan, offload_optimizer=False)
            same = [d for d in on_device.values() if (d.plan.microbatches, d.plan.zero) ==
                    (twin.microbatches, twin.zero)]
            assert same and all(d.recompute > 0 for d in same), planner.plan_str(c.plan)
    assert not fits.best.plan.offload_optimizer and not fits.best.recompute
    # fixed by the user: every plan of the table has it, and the plan keeps it
    given = planner.search(G.gpt_stats("gpt-1.7b"), 1, hw, batch_rows=8, precision="bf16",
                           executable=False, constraints={"offload_optimizer": True})
    assert all(c.plan.offload_optimizer for c in given.table)
    assert "(offload_optimizer: as given)" in given.explain()


def test_an_optimizer_instance_keeps_the_search_to_plans_it_can_step():
    """An optimizer built over the whole parameters cannot step ZeRO's shards or host
    copies (parallelize refuses those plans and asks for a factory): plan="auto" searches
    without them; a factory leaves them to the search."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert planner.constraints_of("auto", opt) == {"zero": 0, "offload_optimizer": False}
    assert planner.constraints_of({"dp": "auto", "zero": 1}, opt)["zero"] == 1  # as given
    assert planner.constraints_of("auto", lambda ps: torch.optim.AdamW(ps)) == {}


def test_quantized_collectives_are_priced_as_given_and_never_chosen():
    """Plan.comm_quantization is lossy, so the search never picks it; given, ZeRO-3's
    gathers are priced at int8's bytes and its reduce-scatters at int4's (+ a scale per
    256 values), plus the (de)quantizing passes: on 16 A100s over two nodes, a 1.7B GPT's
    exposed dp communication (fp32 gathers and gradients, as fxpar's ZeRO-3 sends them)
    falls below 0.4x."""
    stats = G.gpt_stats("gpt-1.7b", precision="fp32")
    hw = cost.HARDWARE["a100"]
    fixed = {"dp": 16, "zero": 3, "microbatches": 1, "dp_shard": 16}  # (ZeRO over all 16)
    plain = planner.search(stats, 16, hw, batch_rows=16, executable=False,
                           constraints=fixed)
    quant = planner.search(stats, 16, hw, batch_rows=16, executable=False,
                           constraints={**fixed, "comm_quantization": "weights+gradients"})
    assert all(c.plan.comm_quantization == "weights+gradients" for c in quant.table)
    dp_s = [r.best.parts["dp communication"] for r in (plain, quant)]
    assert dp_s[1] < 0.4 * dp_s[0], dp_s
    auto = planner.search(stats, 16, hw, batch_rows=16, executable=False)
    assert all(c.plan.comm_quantization == "none" for c in auto.table)


def test_1bit_adam_is_priced_as_given_on_plain_dp_only_and_never_chosen():
    """Plan.grad_compression is lossy, so the search never picks it; given, only plain dp
    plans (zero=0, pp=1, one microbatch) are priced, their gradient all-reduce replaced by
    the momentum's two 1-bit collectives after the backward: on 16 A100s over two nodes a
    1.7B GPT's dp communication falls below 0.2x; its carried errors and flat momentum cost
    memory (2 + 1/dp fp32 values per parameter)."""
    stats = G.gpt_stats("gpt-1.7b", precision="fp32")
    hw = cost.HARDWARE["a100"]
    fixed = {"dp": 16, "zero": 0, "microbatches": 1}
    plain = planner.search(stats, 16, hw, batch_rows=16, executable=False,
                           constraints=fixed, optimizer="adamw")
    onebit = planner.search(stats, 16, hw, batch_rows=16, executable=False, optimizer="adamw",
                            constraints={**fixed, "grad_compression": "1bit-adam"})
    assert all(c.plan.grad_compression == "1bit-adam" for c in onebit.table)
    dp_s = [r.best.parts["dp communication"] for r in (plain, onebit)]
    assert dp_s[1] < 0.2 * dp_s[0], dp_s
    extra = onebit.best.memory.optimizer - plain.best.memory.optimizer
    assert extra == pytest.approx(4 * (2 + 1 / 16) * plain.best.memory.params / 4, rel=1e-6)
    free = planner.search(stats, 16, hw, batch_rows=16, executable=False, optimizer="adamw",
                          constraints={"grad_compression": "1bit-adam"})
    assert all(c.plan.zero == 0 and c.plan.pp == 1 and c.plan.microbatches == 1 and
               c.plan.dp > 1 for c in free.table)
    auto = planner.search(stats, 16, hw, batch_rows=16, executable=False)
    assert all(c.plan.grad_compression == "none" for c in auto.table)


def test_on_a_cpu_device_the_optimizer_stays_and_offload_costs_memory(monkeypatch):
    """A CPU device is the host: the search never moves the optimizer there to fit (it would
    keep its state and add host copies), and given it prices the copies on top; remat="auto"
    budgets the same way, while on a GPU the moments leave the device."""
    from fxpar.compiler.compile import activation_budget
    from fxpar.core.plan import Plan
    stats = G.gpt_stats("gpt-1.7b", precision="fp32")
    hw = dataclasses.replace(cost.cpu_hardware(), memory=24 * GiB)
    with pytest.raises(PlanError, match="fits no legal plan"):  # (offloading would not fit)
        planner.search(stats, 1, hw, batch_rows=8, executable=False)
    r = planner.search(stats, 1, dataclasses.replace(hw, memory=64 * GiB), batch_rows=8,
                       executable=False)
    assert r.table and not any(c.plan.offload_optimizer for c in r.table)
    given = planner.search(stats, 1, dataclasses.replace(hw, memory=256 * GiB), batch_rows=8,
                           executable=False, constraints={"offload_optimizer": True})
    plain = planner.search(stats, 1, dataclasses.replace(hw, memory=256 * GiB), batch_rows=8,
                           executable=False, constraints={"offload_optimizer": False})
    n = sum(s.params for s in stats.segments)
    assert given.best.memory.optimizer == pytest.approx(plain.best.memory.optimizer + 8 * n,
                                                        rel=1e-6)
    model = M.GPT(M.GPTConfig(n_embd=64))
    p_bytes = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setenv("FXPAR_MEMORY_PER_DEVICE", "1")
    for dev, more in (("cuda", 2 * p_bytes), ("cpu", -2 * p_bytes)):
        budgets = [activation_budget(model, Plan(dp=1, tp=1, pp=1, remat="auto",
                                                 offload_optimizer=o), torch.device(dev))
                   for o in (False, True)]
        assert budgets[1] - budgets[0] == pytest.approx(more, abs=2), dev


def test_a_tied_weight_s_two_gradient_parts_are_priced_at_the_end_of_the_last_backward():
    """With microbatches under dp the reduction runs inside the last backward: the last
    gradient (the embedding's) is made beside the other buckets packed, and a tied
    embedding's gets two parts, its own and the LM head's, live at once before their sum.
    An untied model's last gradient is one part, priced as before."""
    cfg = M.GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=64)
    batch = M.gpt_batch(cfg, 8)
    tied = planner_stats(M.GPT(cfg), batch)
    assert tied.last_grad == (512 * 64, 2)
    untied = dataclasses.replace(tied, last_grad=(512 * 64, 1))
    hw = dataclasses.replace(cost.cpu_hardware(), memory=4 * GiB)
    fixed = {"dp": 2, "tp": 1, "pp": 1, "microbatches": 2, "zero": 0}
    one, two = (planner.search(s, 2, hw, batch_rows=8, constraints=fixed).table[0].memory
                for s in (untied, tied))
    assert two.at_end - one.at_end == pytest.approx(512 * 64 * 4)
    mlp = planner_stats(M.MLP(), (torch.randn(8, 16), torch.randn(8, 4)))
    assert mlp.last_grad[1] == 1


def test_with_depth_stretches_the_repeated_blocks_after_the_ones_that_differ(small_stats):
    """A model traced a few blocks deep is priced at its depth: the middle block stands for
    each; `keep_first` keeps the model's first blocks as traced (DeepSeek-V3's dense layers
    before its MoE ones) and stretches the run after them. Blocks that differ inside the
    run are refused (scaling them would price another model)."""
    layers = small_stats.layers
    assert len(layers) >= 2
    first = dataclasses.replace(layers[0], flops_f=layers[0].flops_f * 3)
    traced = dataclasses.replace(small_stats, segments=[
        small_stats.segments[0], first, *layers[1:], small_stats.segments[-1]])
    deep = traced.with_depth(10, keep_first=1)
    assert [s.name for s in deep.segments][:2] == ["pre", first.name] and deep.n_layers == 10
    assert len(deep.layers) == 10 and deep.layers[0].flops_f == first.flops_f
    mid = layers[1:][len(layers[1:]) // 2]
    assert all(s.key() == mid.key() for s in deep.layers[1:])
    assert "after the first 1" in deep.note
    plain = traced.with_depth(10)  # (the first block is not kept: the middle one stands in)
    assert all(s.flops_f == layers[len(layers) // 2].flops_f for s in plain.layers)
    odd = dataclasses.replace(small_stats, segments=[
        small_stats.segments[0], *layers, dataclasses.replace(layers[-1], flops_f=1.0),
        layers[-1], small_stats.segments[-1]])
    with pytest.raises(ValueError, match="the traced blocks differ"):
        odd.with_depth(10)
    with pytest.raises(ValueError, match="no repeated blocks"):
        traced.with_depth(1, keep_first=1)


def test_each_stage_pays_for_its_own_parameters_communication():
    """Each pipeline stage gathers, reduces and steps its own parameters, so the step waits
    on the stage with the most, whichever rank binds memory (DeepSeek-V3's first stage, its
    embedding and dense layers, once stood for stages of 20x the parameters in experts:
    ZeRO-3 priced 4.8x too cheap). One layer made 20x heavier on the last stage: its ZeRO-3
    communication is the last stage's, though the first (more microbatches in flight)
    binds memory."""
    stats = G.gpt_stats("gpt-1.7b")
    layers = stats.layers

    def heavy(i):
        segs = list(stats.segments)
        j = stats.segments.index(layers[i])
        segs[j] = dataclasses.replace(layers[i], params=layers[i].params * 20)
        return dataclasses.replace(stats, segments=segs, transfers={}, stage_saved={},
                                   stage_shares={}, stage_wgrad={}, shared_weights={})
    hw = dataclasses.replace(cost.HARDWARE["a100"], memory=4096 * 2**30)
    fixed = {"pp": 2, "tp": 1, "dp": 4, "zero": 3, "microbatches": 4, "schedule": "1f1b",
             "remat": "none"}
    comm, most = {}, {}
    for i in (0, -1):
        c = planner.search(heavy(i), 8, hw, batch_rows=64, executable=False,
                           constraints=fixed).best
        stages = c.memory.per_stage
        assert max(stages, key=lambda m: m.total) is stages[0]  # (memory binds on stage 0)
        comm[i], most[i] = c.parts["dp communication"], max(m.params for m in stages)
    assert most[-1] > 1.5 * min(m.params for m in stages)  # (the heavy stage: the last)
    assert comm[-1] / comm[0] == pytest.approx(most[-1] / most[0], rel=0.05), (comm, most)

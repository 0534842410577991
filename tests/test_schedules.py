"""core/schedules.py: every schedule is complete and deadlock-free under the buffered-send
contract, and the simulator reproduces the textbook bubbles and activation counts."""
from collections import Counter

import pytest

from fxpar.core.schedules import Action, ScheduleError, build, simulate_schedule

FB = {"F": 1.0, "B": 2.0}
FIW = {"F": 1.0, "I": 1.0, "W": 1.0}
CASES = [(s, pp, m, 2 if s == "interleaved" else 1)
         for s in ("gpipe", "1f1b", "interleaved", "zero-bubble")
         for pp in (1, 2, 4) for m in range(1, 9)
         if s != "interleaved" or m % pp == 0]


def _sim(schedule, pp, m, v=1, time=FB, **kw):
    return simulate_schedule(build(schedule, pp, m, v), time, **kw)


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_complete_and_deadlock_free(schedule, pp, m, v):
    acts = build(schedule, pp, m, v)
    assert len(acts) == pp
    compute = Counter((a.kind, a.stage, a.microbatch) for r in acts for a in r if a.is_compute)
    split = schedule == "zero-bubble"
    for s in range(pp * v):
        for mb in range(m):
            kinds = ("F", "I", "W") if split else ("F", "B")
            assert all(compute[(k, s, mb)] == 1 for k in kinds), (s, mb)
    assert sum(compute.values()) == pp * v * m * (3 if split else 2)
    for r, rank_acts in enumerate(acts):
        assert all(a.stage % pp == r for a in rank_acts)
    sends = Counter(a.kind for r in acts for a in r)
    assert sends["SEND_F"] == sends["RECV_F"] == (0 if pp == 1 else (pp * v - 1) * m)
    assert sends["SEND_B"] == sends["RECV_B"] == sends["SEND_F"]
    for lat in (0.0, 0.5):                                     # raises on deadlock / violation
        tl = simulate_schedule(acts, FIW if split else FB, p2p_latency=lat)
        assert len(tl.events) == pp and 0 <= tl.bubble_fraction < 1
        # the planner's unchecked timing of lists once checked: the same timeline
        fast = simulate_schedule(acts, FIW if split else FB, p2p_latency=lat, validate=False)
        assert (fast.events, fast.makespan, fast.busy, fast.peak_in_flight) == \
            (tl.events, tl.makespan, tl.busy, tl.peak_in_flight)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("time", [FB, {"F": 1.0, "I": 1.0, "W": 1.0}])
def test_bubble_matches_formula(schedule, pp, m, time):
    tl = _sim(schedule, pp, m, time=time)
    assert tl.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=0.01)
    assert tl.busy == [pytest.approx(3.0 * m)] * pp


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("m", range(1, 9))
def test_peak_in_flight(pp, m):
    assert _sim("1f1b", pp, m).peak_in_flight == [min(pp - r, m) for r in range(pp)]
    assert _sim("gpipe", pp, m).peak_in_flight == [m] * pp
    assert max(_sim("zero-bubble", pp, m, time=FIW).peak_in_flight) <= min(pp, m)


def test_zero_bubble_beats_1f1b():
    zb, base = _sim("zero-bubble", 4, 8, time=FIW), _sim("1f1b", 4, 8, time=FIW)
    assert zb.bubble_fraction < base.bubble_fraction
    # ZB-H1 keeps 1F1B's peak (pp on the worst rank); later ranks hold W's a little longer.
    assert max(zb.peak_in_flight) <= max(base.peak_in_flight)
    # Qi et al.: ZB-H1's bubble is (p-1)(T_F + T_I - T_W) = 3 units vs 1F1B's (p-1)(T_F + T_B) = 9.
    assert zb.makespan == pytest.approx(8 * 3 + 3) and base.makespan == pytest.approx(8 * 3 + 9)


def test_interleaved_beats_1f1b():
    v = 2
    chunk = {k: t / v for k, t in FB.items()}       # each chunk is 1/v of the rank's layers
    il, base = _sim("interleaved", 4, 8, v, time=chunk), _sim("1f1b", 4, 8)
    assert il.bubble_fraction < base.bubble_fraction
    # Megatron: bubble time (p-1)(t_f + t_b) / v, i.e. fraction (p-1)/v / (m + (p-1)/v).
    assert il.bubble_fraction == pytest.approx(1.5 / 9.5, abs=0.01)
    assert sum(il.busy) == pytest.approx(sum(base.busy))


def test_latency_and_callable_time():
    tl = _sim("gpipe", 2, 1, p2p_latency=0.5)       # F 0-1 | wait | F 1.5-2.5, B -4.5 | B 5-7
    assert tl.makespan == pytest.approx(7.0)
    recv = [e for e in tl.events[1] if e[0].kind == "RECV_F"]
    assert [(t0, t1) for _, t0, t1 in recv] == [(0.0, 1.5)]
    slow_last = simulate_schedule(build("1f1b", 2, 2), lambda a: 2.0 if a.stage == 1 else 1.0)
    assert slow_last.makespan > _sim("1f1b", 2, 2).makespan


def test_action_str():
    assert str(Action("F", 1, 3)) == "F3s1"
    assert str(Action("SEND_F", 1, 3, peer=2)) == "SEND_F3s1->2"
    assert str(Action("RECV_B", 1, 3, peer=2)) == "RECV_B3s1<-2"
    with pytest.raises(ValueError, match="peer"):
        Action("SEND_F", 0, 0)
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("X", 0, 0)


@pytest.mark.parametrize("args,match", [
    (("pipedream", 2, 4), "unknown pipeline schedule 'pipedream': use one of gpipe"),
    (("1f1b", 0, 4), "pp must be an integer >= 1"),
    (("1f1b", 2, 0), "microbatches must be an integer >= 1"),
    (("1f1b", 2, 4, 2), "virtual=2 is only for schedule 'interleaved'.*set virtual=1"),
    (("zero-bubble", 2, 4, 2), "virtual=2 is only for schedule 'interleaved'"),
    (("interleaved", 2, 4, 1), "needs virtual >= 2.*use schedule '1f1b'"),
    (("interleaved", 4, 6, 2), "multiple of pp.*microbatches=6, pp=4; use 4 or 8"),
    (("interleaved", 4, 2, 2), "microbatches=2, pp=4; use 4$"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        build(*args)


def _two_stage(rank0, rank1):
    """Hand-written 2-rank, 2-stage, 1-microbatch lists: "F, SEND_F, ..." per rank."""
    def acts(text, stage):
        kinds = [k.strip() for k in text.split(",")]
        return [Action(k, stage, 0, None if k in ("F", "B") else 1 - stage) for k in kinds]
    return [acts(rank0, 0), acts(rank1, 1)]


def test_reference_two_stage_runs():
    simulate_schedule(_two_stage("F, SEND_F, RECV_B, B", "RECV_F, F, B, SEND_B"), FB)


def test_detects_deadlock():
    acts = _two_stage("RECV_B, F, SEND_F, B", "RECV_F, F, B, SEND_B")
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at #0 RECV_B0s0<-1; "
                                            r"rank 1 waits at #0 RECV_F0s1<-0"):
        simulate_schedule(acts, FB)
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at #0 RECV_B0s0<-1; "):
        simulate_schedule(acts, FB, validate=False)


def test_detects_dependency_violation():
    with pytest.raises(ScheduleError, match=r"rank 1.*F0s1: dependency violated: forward output "
                                            r"of stage 0 microbatch 0"):
        simulate_schedule(_two_stage("F, SEND_F, RECV_B, B", "F, RECV_F, B, SEND_B"), FB)
    with pytest.raises(ScheduleError, match=r"W0s0: dependency violated: I \(input-grad\)"):
        simulate_schedule([[Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0)]], FIW)


def test_detects_missing_or_extra_work():
    ok0, ok1 = _two_stage("F, SEND_F, RECV_B, B", "RECV_F, F, B, SEND_B")
    with pytest.raises(ScheduleError, match=r"SEND without a matching RECV: \[\('B', 1, 0\)\]"):
        simulate_schedule([ok0[:2], ok1], FB)
    with pytest.raises(ScheduleError, match="sent twice"):
        simulate_schedule([ok0 + [Action("SEND_F", 0, 0, peer=1)], ok1], FB)
    with pytest.raises(ScheduleError, match="second RECV for one SEND"):
        simulate_schedule([ok0, ok1 + [Action("RECV_F", 1, 0, peer=0)]], FB)
    with pytest.raises(ScheduleError, match="peer must be the rank of stage 1"):
        simulate_schedule([ok0[:1] + [Action("SEND_F", 0, 0, peer=0)] + ok0[2:], ok1], FB)
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate_schedule([[Action("F", 0, 0), Action("F", 0, 0)]], FB)
    with pytest.raises(ScheduleError, match=r"stage 0 microbatch 0 ran \['F'\]"):
        simulate_schedule([[Action("F", 0, 0)]], FB)
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        simulate_schedule([[Action("F", 1, 0)], []], FB)

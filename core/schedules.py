"""Pipeline-parallel schedules as explicit per-rank action lists, and a simulator to check them.

A schedule is `build(...)[rank]`: the exact order in which one rank runs its forwards,
backwards and point-to-point transfers. The planner simulates it to price a plan (bubble,
activation memory); the executor runs it action by action. Both own this small IR, so it is
ours rather than an import of `torch.distributed.pipelining.schedules`: that module's `_Action`
and schedule classes are private, tied to its PipelineStage runtime, and change between
releases. Names follow it where sensible (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B; a RECV
names the stage that consumes the data), so its schedules are easy to compare against.

Placement: `n_stages = pp * virtual` and stage s lives on rank `s % pp` (Megatron's interleaved
placement; virtual = 1 except for "interleaved"), so rank r holds stages r, r + pp, r + 2pp, ...

Communication contract (what `simulate_schedule` checks and the executor must honour): each rank runs
its list in order; a SEND never blocks (it is buffered or non-blocking), a RECV blocks until
the peer has issued the matching SEND. Pairwise blocking send/recv would be stricter and is
not what these lists promise.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
COMPUTE = ("F", "B", "I", "W")   # B = full backward; I = input grad only; W = weight grad only
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute (F/B/I/W) of `stage` on `microbatch`, or a transfer.

    SEND_F/SEND_B name the stage that produced the data, RECV_F/RECV_B the stage that
    consumes it (the one on this rank); `peer` is the other rank.
    """
    kind: str
    stage: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self):
        if self.kind not in COMPUTE + COMM:
            raise ValueError(f"unknown action kind {self.kind!r}: use one of {COMPUTE + COMM}")
        if (self.peer is None) != (self.kind in COMPUTE):
            want = "no peer" if self.kind in COMPUTE else "peer=<rank>"
            raise ValueError(f"{self.kind} needs {want} (got peer={self.peer!r})")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def __str__(self):
        s = f"{self.kind}{self.microbatch}s{self.stage}"
        if self.kind.startswith("SEND"):
            s += f"->{self.peer}"
        elif self.kind.startswith("RECV"):
            s += f"<-{self.peer}"
        return s

    __repr__ = __str__


def stage_to_rank(stage: int, pp: int) -> int:
    return stage % pp


class ScheduleError(RuntimeError):
    """A schedule that would hang or compute on data it does not have."""


# ---------------------------------------------------------------------------------------------
# Building schedules


def build(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per-rank action lists (compute plus SEND/RECV) for `schedule` on `pp` ranks."""
    _check_args(schedule, pp, microbatches, virtual)
    n_stages = pp * virtual
    make = {"gpipe": _gpipe, "1f1b": _1f1b, "interleaved": _interleaved, "zero-bubble": _zb_h1}
    return [_with_comms(make[schedule](r, pp, microbatches, virtual), r, pp, n_stages)
            for r in range(pp)]


def _check_args(schedule, pp, m, v):
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: "
                         f"use one of {', '.join(SCHEDULES)}")
    for name, val in (("pp", pp), ("microbatches", m), ("virtual", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
    if schedule == "interleaved":
        if v < 2:
            raise ValueError(f"schedule 'interleaved' needs virtual >= 2 model chunks per rank "
                             f"(got virtual={v}); for one chunk per rank use schedule '1f1b'")
        if m % pp:
            fits = " or ".join(str(k) for k in (m // pp * pp, (m // pp + 1) * pp) if k)
            raise ValueError(f"schedule 'interleaved' needs microbatches to be a multiple of pp "
                             f"(as in Megatron): got microbatches={m}, pp={pp}; use {fits}")
    elif v != 1:
        raise ValueError(f"virtual={v} is only for schedule 'interleaved' (got {schedule!r}); "
                         f"set virtual=1 or use schedule='interleaved'")


def _one_f_one_b(fwd, bwd, warmup):
    """`warmup` forwards, then alternate one forward / one backward, then the rest backwards."""
    steady = [a for pair in zip(fwd[warmup:], bwd) for a in pair]
    return fwd[:warmup] + steady + bwd[len(fwd) - warmup:]


def _gpipe(r, pp, m, v):
    """GPipe (Huang et al. 2019): every forward, then every backward. Holds all m activations."""
    return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]


def _1f1b(r, pp, m, v):
    """PipeDream-flush / Megatron 1F1B: rank r runs pp - r - 1 forwards ahead, then one
    forward per backward, so it never holds more than pp - r activations."""
    fwd = [("F", r, i) for i in range(m)]
    bwd = [("B", r, i) for i in range(m)]
    return _one_f_one_b(fwd, bwd, min(pp - r - 1, m))


def _interleaved(r, pp, m, v):
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank, microbatches
    go through the chunks in groups of pp; the warmup/cooldown bubble shrinks by about v.
    Megatron's special case m == pp (all forwards first) exists for its paired blocking P2P;
    under our buffered-send contract the general warmup count is deadlock-free (tested)."""
    def stage_mb(k, forward):       # k-th (chunk, microbatch) this rank runs, forward or backward
        group, j = divmod(k, pp * v)
        chunk = j // pp if forward else v - 1 - j // pp
        return chunk * pp + r, group * pp + j % pp

    total = m * v
    fwd = [("F", *stage_mb(k, True)) for k in range(total)]
    bwd = [("B", *stage_mb(k, False)) for k in range(total)]
    return _one_f_one_b(fwd, bwd, min(2 * (pp - r - 1) + (v - 1) * pp, total))


def _zb_h1(r, pp, m, v):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split
    into I (input grad, on the critical path to the previous stage) and W (weight grad, needed
    only by the optimizer). Rank r defers its W's by r steps, so gradients reach rank 0 sooner
    and the W's fill what would be the cooldown bubble. Peak in-flight microbatches stays pp,
    the same as 1F1B's rank 0 (later ranks hold more than under 1F1B, up to pp)."""
    w = min(pp - r - 1, m)
    ops = [("F", r, i) for i in range(w)]
    for j in range(m):
        if w + j < m:
            ops.append(("F", r, w + j))
        ops.append(("I", r, j))
        if j >= r:
            ops.append(("W", r, j - r))
    return ops + [("W", r, i) for i in range(max(m - r, 0), m)]


def _with_comms(ops, r, pp, n_stages):
    """Compute ops -> Actions, with RECV just before the op that needs remote data and SEND
    just after the op that produces it. Under the buffered-send contract that is enough."""
    out = []
    for kind, s, mb in ops:
        prev_remote = s > 0 and stage_to_rank(s - 1, pp) != r
        next_remote = s < n_stages - 1 and stage_to_rank(s + 1, pp) != r
        if kind == "F" and prev_remote:
            out.append(Action("RECV_F", s, mb, stage_to_rank(s - 1, pp)))
        if kind in ("B", "I") and next_remote:
            out.append(Action("RECV_B", s, mb, stage_to_rank(s + 1, pp)))
        out.append(Action(kind, s, mb))
        if kind == "F" and next_remote:
            out.append(Action("SEND_F", s, mb, stage_to_rank(s + 1, pp)))
        if kind in ("B", "I") and prev_remote:
            out.append(Action("SEND_B", s, mb, stage_to_rank(s - 1, pp)))
    return out


# ---------------------------------------------------------------------------------------------
# Simulation


@dataclass
class Timeline:
    """What `simulate_schedule` found. `events[rank]` = [(action, start, end)] in execution order; a RECV
    starts when the rank reaches it and ends when the data is there, so its length is the wait.
    peak_in_flight counts (stage, microbatch) pairs: with v chunks per rank each holds 1/v of
    the rank's layers, so divide by v to compare with a non-interleaved schedule."""
    events: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]              # compute seconds per rank
    bubble_fraction: float         # 1 - sum(busy) / (pp * makespan)
    peak_in_flight: list[int]      # per rank: most (stage, microbatch) pairs between F and B/W

    def chart(self, unit: float = 1.0) -> str:
        """Text Gantt chart, one row per rank, one column per `unit` seconds ('.' = idle)."""
        cols = round(self.makespan / unit)
        rows = []
        for r, evs in enumerate(self.events):
            row = ["."] * cols
            for a, t0, t1 in evs:
                for c in range(round(t0 / unit), round(t1 / unit) if a.is_compute else 0):
                    row[c] = a.kind
            rows.append(f"rank {r}: {''.join(row)}")
        return "\n".join(rows)


def _duration_fn(time) -> Callable[[Action], float]:
    """time: callable(action) -> seconds, or {kind: seconds} per stage. In a dict, B defaults
    to I + W and I, W to B / 2, so one dict prices both 1F1B and zero-bubble schedules."""
    if callable(time):
        return time
    t = dict(time)
    if "B" not in t and "I" in t and "W" in t:
        t["B"] = t["I"] + t["W"]
    if "B" in t:
        t.setdefault("I", t["B"] / 2)
        t.setdefault("W", t["B"] / 2)

    def duration(a: Action) -> float:
        if a.kind not in t:
            raise ValueError(f"time has no entry for {a.kind!r} (needed by {a}); give {a.kind!r} "
                             f"or, for a backward, 'B' or both 'I' and 'W'")
        return t[a.kind]
    return duration


def simulate_schedule(actions: list[list[Action]], time, p2p_latency: float = 0.0,
                      validate: bool = True) -> Timeline:
    """Run every rank's list in order under the buffered-send contract (module docstring).

    Compute takes duration(action); a SEND takes no time on its sender; a RECV ends at
    max(own clock, matching SEND's issue time + p2p_latency). Raises ScheduleError when the
    lists deadlock, compute on data the rank does not have yet, or leave work undone/doubled.
    `validate=False` only times lists a validating run has already checked (the planner
    prices one shape for many stage times): it raises on a deadlock alone.
    """
    duration = _duration_fn(time)
    if not validate:
        return _timeline(_run_unchecked(actions, duration, p2p_latency))
    pp = len(actions)
    n_stages = 1 + max((a.stage for acts in actions for a in acts), default=-1)
    last = n_stages - 1
    done: set[tuple[str, int, int]] = set()                 # compute (kind, stage, mb) finished
    have = [set() for _ in range(pp)]                        # per rank: ("act"|"grad", stage, mb)
    sent: dict[tuple, float] = {}                            # (dir, from_stage, mb) -> issue time
    received: set[tuple] = set()
    clock = [0.0] * pp
    pos = [0] * pp
    events = [[] for _ in range(pp)]

    def fail(r, a, why):
        raise ScheduleError(f"rank {r}, action #{pos[r]} {a}: {why}")

    def check(r, a):
        """Static checks: right rank, right peer, inputs present on this rank."""
        s, mb = a.stage, a.microbatch
        if stage_to_rank(s, pp) != r:
            fail(r, a, f"stage {s} lives on rank {stage_to_rank(s, pp)} (stage % pp), not here")
        if a.kind in ("SEND_F", "RECV_B") and (s == last or a.peer != stage_to_rank(s + 1, pp)):
            fail(r, a, f"peer must be the rank of stage {s + 1}")
        if a.kind in ("SEND_B", "RECV_F") and (s == 0 or a.peer != stage_to_rank(s - 1, pp)):
            fail(r, a, f"peer must be the rank of stage {s - 1}")
        if a.is_compute and (a.kind, s, mb) in done:
            fail(r, a, "runs twice")
        if a.kind in ("B", "I") and {("B", s, mb), ("I", s, mb)} & done:
            fail(r, a, "backward already ran for this stage and microbatch (B and I exclude "
                       "each other)")
        needs = {
            "F": [("act", s - 1, mb)] if s > 0 else [],
            "B": [("act", s, mb)] + ([("grad", s + 1, mb)] if s < last else []),
            "I": [("act", s, mb)] + ([("grad", s + 1, mb)] if s < last else []),
            "W": [("I", s, mb)],
            "SEND_F": [("act", s, mb)],
            "SEND_B": [("grad", s, mb)],
        }.get(a.kind, [])
        for need in needs:
            if need not in have[r]:
                what = {"act": "forward output", "grad": "input gradient",
                        "I": "I (input-grad) output"}
                fail(r, a, f"dependency violated: {what[need[0]]} of stage {need[1]} microbatch "
                           f"{need[2]} is not on rank {r} yet (missing or later RECV/compute)")

    def step(r) -> bool:
        """Run rank r's next action if it can; False if it is blocked on a RECV."""
        a = actions[r][pos[r]]
        s, mb = a.stage, a.microbatch
        check(r, a)
        start = clock[r]
        if a.kind in ("RECV_F", "RECV_B"):
            key = ("F", s - 1, mb) if a.kind == "RECV_F" else ("B", s + 1, mb)
            if key in received:
                fail(r, a, "second RECV for one SEND")
            if key not in sent:
                return False
            received.add(key)
            end = max(start, sent[key] + p2p_latency)
            have[r].add(("act", s - 1, mb) if a.kind == "RECV_F" else ("grad", s + 1, mb))
        elif a.kind in ("SEND_F", "SEND_B"):
            key = ("F" if a.kind == "SEND_F" else "B", s, mb)
            if key in sent:
                fail(r, a, "sent twice")
            sent[key] = end = start
        else:
            end = start + duration(a)
            done.add((a.kind, s, mb))
            if a.kind != "W":
                have[r].add(("act" if a.kind == "F" else "grad", s, mb))
            if a.kind == "I":
                have[r].add(("I", s, mb))
        clock[r] = end
        events[r].append((a, start, end))
        pos[r] += 1
        return True

    while True:
        progress = False
        for r in range(pp):
            while pos[r] < len(actions[r]) and step(r):
                progress = True
        stuck = [r for r in range(pp) if pos[r] < len(actions[r])]
        if not stuck:
            break
        if not progress:
            waits = "; ".join(f"rank {r} waits at #{pos[r]} {actions[r][pos[r]]}" for r in stuck)
            raise ScheduleError(f"deadlock: {waits} (no rank can issue the SEND they need)")

    unreceived = [k for k in sent if k not in received]
    if unreceived:
        raise ScheduleError(f"SEND without a matching RECV: {unreceived[:5]}")
    n_mb = 1 + max((a.microbatch for acts in actions for a in acts), default=-1)
    for s in range(n_stages):
        for mb in range(n_mb):
            kinds = {k for k in COMPUTE if (k, s, mb) in done}
            if kinds not in ({"F", "B"}, {"F", "I", "W"}):
                raise ScheduleError(f"stage {s} microbatch {mb} ran {sorted(kinds)}; "
                                    f"need F and B, or F, I and W")

    return _timeline(events)


def _timeline(events) -> Timeline:
    pp = len(events)
    makespan = max((evs[-1][2] for evs in events if evs), default=0.0)
    busy = [sum(t1 - t0 for a, t0, t1 in evs if a.is_compute) for evs in events]
    bubble = 1 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    return Timeline(events, makespan, busy, bubble, [_peak_in_flight(evs) for evs in events])


def _run_unchecked(actions, duration, p2p_latency) -> list[list[tuple]]:
    """`simulate_schedule`'s clocks without its checks: per rank, [(action, start, end)].
    (A loop of its own: the planner times 1T-parameter pipelines of ~10^5 actions, where the
    checked run's per-action bookkeeping was most of the search.)"""
    pp = len(actions)
    sent: dict[tuple, float] = {}
    clock, pos = [0.0] * pp, [0] * pp
    events: list[list[tuple]] = [[] for _ in range(pp)]
    while True:
        progress = False
        for r in range(pp):
            acts, i, t, evs = actions[r], pos[r], clock[r], events[r]
            while i < len(acts):
                a = acts[i]
                k = a.kind
                if k == "RECV_F" or k == "RECV_B":
                    issued = sent.get(("F", a.stage - 1, a.microbatch) if k == "RECV_F"
                                      else ("B", a.stage + 1, a.microbatch))
                    if issued is None:
                        break
                    end = max(t, issued + p2p_latency)
                elif k == "SEND_F" or k == "SEND_B":
                    sent[("F" if k == "SEND_F" else "B", a.stage, a.microbatch)] = end = t
                else:
                    end = t + duration(a)
                evs.append((a, t, end))
                t = end
                i += 1
            progress = progress or i > pos[r]
            pos[r], clock[r] = i, t
        stuck = [r for r in range(pp) if pos[r] < len(actions[r])]
        if not stuck:
            return events
        if not progress:
            waits = "; ".join(f"rank {r} waits at #{pos[r]} {actions[r][pos[r]]}" for r in stuck)
            raise ScheduleError(f"deadlock: {waits} (no rank can issue the SEND they need)")


def _peak_in_flight(evs) -> int:
    """Activation-memory proxy: a (stage, microbatch) is live from its F until its B, or its W
    when the backward is split (W still reads the saved activations)."""
    live = peak = 0
    for a, _, _ in evs:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind in ("B", "W"):
            live -= 1
    return peak

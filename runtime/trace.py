"""Per-rank timeline of a training step: compute and communication as separate tracks.

The executor and runtime/comm.py record spans (name, track, start, end) with
`time.perf_counter` while a step runs; `Recorder.events` turns them into Chrome-trace events
(`pm.trace` gathers every rank's into one JSON: open it in https://ui.perfetto.dev), one
process per rank, one thread per track ("compute", "comm"). A compute event's `cat` says
what the compute thread was doing (CATEGORY): forward, backward, packing, optimizer, from the
nodes' meta["region"] (runtime/comm.lower puts a marker call where the region changes); in a
pipeline the action keeps its name ("F3 s1"), its cat comes from its phase and its args are
{stage, microbatch, phase}; a CUDA-graph replay is one "forward+backward" segment (host
calls are not replayed, so it has no markers). "blocked" is time spent issuing or waiting on
communication; comm-track events have cat "comm" and their bytes. `StepStats` is what one
step cost: its time, the time a collective was in flight, and the *exposed* part - the time
the compute thread sat blocked issuing or waiting for a collective, i.e. communication
nothing overlapped.

Recording costs two clock reads per collective and per compute segment (region changes: a
handful a step, ~1.5 us each), so it is always on; only the last `keep_steps` steps are kept.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import time

from fxpar.core.trace_events import (BLOCKED, CATEGORY, COMM, COMPUTE, PEER_WAIT,  # noqa: F401
                                      RUNTIME, TRACKS)


@dataclasses.dataclass
class Span:
    name: str
    track: str
    start: float  # perf_counter seconds
    end: float
    args: dict | None = None
    cat: str | None = None  # compute: its category (CATEGORY, "blocked"); None: the track


@dataclasses.dataclass
class StepStats:
    step: int
    time_s: float
    comm_s: float          # union of the intervals during which some collective was in flight
    exposed_comm_s: float  # compute thread blocked on communication (issue + wait)
    device_s: float | None = None  # GPU time of the step's CUDA-graph replay (CUDA events)

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_s / self.time_s if self.time_s else 0.0


class Recorder:
    """Spans of the last `keep_steps` steps of one rank."""

    def __init__(self, rank: int = 0, keep_steps: int = 20):
        self.rank = rank
        self.steps: collections.deque = collections.deque(maxlen=keep_steps)
        self.stats: collections.deque = collections.deque(maxlen=keep_steps)
        self._spans: list[Span] | None = None
        self._seg_start = 0.0
        self._seg = ("", "", None)  # the open compute segment's (name, cat, args)
        self._exposed = 0.0
        self._step_no = 0
        self._t0 = 0.0
        # wall-clock anchor: ranks' spans line up through time.time() (the same clock on one
        # host, NTP-synced across hosts), while spans are measured with perf_counter
        self._wall0, self._perf0 = time.time(), time.perf_counter()

    # --- step boundaries -----------------------------------------------------------------
    def begin_step(self, name: str = "forward") -> None:
        self._spans = []
        self._exposed = 0.0
        self._t0 = self._seg_start = time.perf_counter()
        self._seg = (name, CATEGORY.get(name, name), None)

    def end_step(self) -> StepStats:
        t = time.perf_counter()
        self._close_segment(t)
        spans, self._spans = self._spans or [], None
        comm = _union([(s.start, s.end) for s in spans if s.track == COMM])
        st = StepStats(self._step_no, t - self._t0, comm, self._exposed)
        self.steps.append((self._step_no, self._t0, t, spans))
        self.stats.append(st)
        self._step_no += 1
        return st

    @property
    def recording(self) -> bool:
        return self._spans is not None

    # --- compute segments: closed whenever the compute thread turns to something else -------
    def _close_segment(self, t: float) -> None:
        if self._spans is not None and t > self._seg_start:
            name, cat, args = self._seg
            self._spans.append(Span(name, COMPUTE, self._seg_start, t, args, cat))

    def segment(self, name: str, cat: str | None = None, args: dict | None = None) -> None:
        """The compute thread starts on something else: a region ("backward", from a graph
        marker: cat from CATEGORY), a pipeline action ("F3 s1", its cat and args)."""
        cat = cat or CATEGORY.get(name, name)
        if self._spans is None or (name, cat) == self._seg[:2]:
            return
        t = time.perf_counter()
        self._close_segment(t)
        self._seg_start, self._seg = t, (name, cat, args)

    def blocked(self, t0: float, t1: float, name: str, next_segment: str | None = None,
                cat: str = BLOCKED) -> None:
        """The compute thread spent [t0, t1] on communication `name` (issuing or waiting;
        cat PEER_WAIT: on a pipeline peer); then it resumes the segment it was in, or starts
        `next_segment`."""
        if self._spans is None:
            return
        self._close_segment(t0)
        self._exposed += t1 - t0
        if t1 - t0 > 2e-6:
            self._spans.append(Span(name, COMPUTE, t0, t1, {"blocked_on": "comm"}, cat))
        self._seg_start = t1
        if next_segment is not None:
            self._seg = (next_segment, CATEGORY.get(next_segment, next_segment), None)

    def comm(self, name: str, t0: float, t1: float, nbytes: int) -> None:
        """A collective in flight from issue (t0) to completion (t1), on the comm track."""
        if self._spans is not None:
            self._spans.append(Span(name, COMM, t0, t1, {"bytes": nbytes}))

    def events(self) -> list[dict]:
        """This rank's spans as Chrome-trace events (wall-clock microseconds)."""
        offset = self._wall0 - self._perf0
        pid = self.rank
        ev = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}}]
        for tid, track in enumerate(TRACKS):
            ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": track}})
        device_s = {st.step: st.device_s for st in self.stats if st.device_s is not None}
        for step, t0, t1, spans in self.steps:
            ev.append({"name": f"step {step}", "ph": "X", "pid": pid, "tid": TRACKS.index(COMPUTE),
                       "ts": (t0 + offset) * 1e6, "dur": (t1 - t0) * 1e6, "cat": "step"})
            if step in device_s:  # a CUDA-graph replay: its GPU time, from CUDA events
                ev[-1]["args"] = {"gpu_ms": device_s[step] * 1e3}
            for s in spans:
                e = {"name": s.name, "ph": "X", "pid": pid, "tid": TRACKS.index(s.track),
                     "ts": (s.start + offset) * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                     "cat": s.cat or s.track}
                if s.args:
                    e["args"] = s.args
                ev.append(e)
        return ev


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def on_track(e: dict, track: str) -> bool:
    """Whether Chrome-trace event `e` is a span on `track` (COMPUTE or COMM) of its rank."""
    return e.get("ph") == "X" and e.get("cat") != "step" and e.get("tid") == TRACKS.index(track)


def write_chrome_trace(path: str, events: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def last_step_actions(events: list[dict]) -> dict[tuple, float]:
    """(kind, stage, microbatch) -> seconds, of every stage computation in the last step."""
    import re
    starts = {}
    for e in events:
        if e.get("cat") == "step":
            starts[e["pid"]] = max(starts.get(e["pid"], e["ts"]), e["ts"])
    out = {}
    for e in events:
        m = re.match(r"([FBIW])(\d+) s(\d+)$", e["name"]) if on_track(e, COMPUTE) else None
        if m and e["ts"] >= starts[e["pid"]]:
            out[(m[1], int(m[3]), int(m[2]))] = e["dur"] / 1e6
    return out


def transfer_latency(events: list[dict]) -> float:
    """Median seconds from a stage's send to the arrival at a receiver that was already
    waiting (the last step; k-th send of a value paired with its k-th receive)."""
    import statistics
    starts = {}
    for e in events:
        if e.get("cat") == "step":
            starts[e["pid"]] = max(starts.get(e["pid"], e["ts"]), e["ts"])
    t0 = min(starts.values())
    sends, recvs = {}, {}
    for e in events:
        if e.get("ph") != "X" or e["ts"] < t0:
            continue
        if e["name"].startswith("send ") and on_track(e, COMPUTE):
            sends.setdefault(e["name"][5:], []).append(e)
        elif e["name"].startswith("recv ") and on_track(e, COMM):
            recvs.setdefault(e["name"][5:], []).append(e)
    lat = []
    for name, rs in recvs.items():
        for s, r in zip(sorted(sends.get(name, []), key=lambda e: e["ts"]),
                        sorted(rs, key=lambda e: e["ts"])):
            if r["ts"] <= s["ts"]:
                lat.append((r["ts"] + r["dur"] - s["ts"]) / 1e6)
    return statistics.median(lat) if lat else 0.0


def pipeline_bubble(events: list[dict], step: int = -1) -> float:
    """Idle fraction of one step's pipeline (default the last recorded step; -2 the one
    before...), from a Chrome trace's events (all ranks): 1 - (time computing, summed over
    ranks) / (ranks x span), the span running from the first stage computation's (F/B/I/W)
    start to the last one's end, and "computing" everything on the compute track but blocked
    time: the stage computations and the runner's own work between them (the quantity
    (p-1)/(m+p-1) predicts for GPipe and 1F1B with equal stages counts waiting only)."""
    import re
    starts: dict[int, list[float]] = {}
    for e in events:
        if e.get("cat") == "step":
            starts.setdefault(e["pid"], []).append(e["ts"])
    window = {}
    for pid, ts in starts.items():
        ts.sort()
        k = step % len(ts)
        window[pid] = (ts[k], ts[k + 1] if k + 1 < len(ts) else float("inf"))
    mine = [e for e in events if on_track(e, COMPUTE) and e.get("pid") in window
            and window[e["pid"]][0] <= e["ts"] < window[e["pid"]][1]]
    work = [e for e in mine if re.match(r"[FBIW]\d+ s\d+$", e["name"])]
    start = min(e["ts"] for e in work)
    end = max(e["ts"] + e["dur"] for e in work)
    busy = sum(max(0.0, min(e["ts"] + e["dur"], end) - max(e["ts"], start))
               for e in mine if e.get("cat") not in (BLOCKED, PEER_WAIT))
    return 1 - busy / (len(window) * (end - start))

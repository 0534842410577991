"""Timeline pictures: a Chrome trace written by `pm.trace` drawn as a PNG Gantt chart, one
row per (rank, track). Compute spans are coloured by their category (the event's cat: the
region or pipeline phase it ran, runtime/trace.CATEGORY), time blocked on a collective red,
time waiting for a pipeline peer (the bubble) pink, collectives on the comm row; pipeline
actions carry one label style throughout ("F3 s1" where every bar fits it, else "F3"), the
title each rank's blocked and waiting time per step, dashed
lines mark where each step starts, and the legend (right of the axes, off the bars) lists
only the categories drawn."""
from __future__ import annotations

import json

from fxpar.core.trace_events import BLOCKED, COMM, COMPUTE, PEER_WAIT, TRACKS

# legend order: the step's own order, then what is not compute
COLORS = {"forward": "#7fb3e6", "backward": "#f5a35c", "weight grad": "#f7d08a",
          "forward+backward": "#b39ddb", "packing": "#c7c7c7", "optimizer": "#9bd39b",
          "runtime": "#e8e8e8", "blocked": "#d62728", "waiting for a peer": "#f4b6c2",
          "comm": "#8c564b"}
OTHER = "#999999"  # a category this module does not know (e.g. an older trace's "compute")


def category(e: dict) -> str:
    """What a span's colour stands for: "comm" on the comm track, else the event's cat."""
    return COMM if e.get("tid") == TRACKS.index(COMM) else e.get("cat", "other")


def last_spans(events: list[dict], last_steps: int = 2) -> tuple[list[dict], list[dict], float]:
    """The spans and step events of every rank's last `last_steps` steps, and when the
    first of those steps started (trace microseconds)."""
    steps = sorted((e for e in events if e.get("cat") == "step"), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("the trace has no steps: train before calling pm.trace")
    ranks = {e["pid"] for e in steps}
    t0 = steps[max(0, len(steps) - last_steps * len(ranks))]["ts"]
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") != "step"
             and e["ts"] >= t0]
    return spans, [e for e in steps if e["ts"] >= t0], t0


def legend_handles(spans: list[dict]) -> list:
    """One legend entry per category present in `spans`, in COLORS' order."""
    from matplotlib.patches import Patch
    order = list(COLORS)
    cats = sorted({category(e) for e in spans}, key=lambda c: (order.index(c) if c in order
                                                                else len(order), c))
    return [Patch(color=COLORS.get(c, OTHER), label=c) for c in cats]


def _fits(text: str, width_px: float) -> bool:
    return width_px >= 6.5 * len(text) + 4


def _label(e: dict, width_px: float, full: bool = True) -> str | None:
    """A pipeline action's text: "F3 s1" (full) or "F3", if it fits in the bar, else none."""
    if "microbatch" not in e.get("args", {}):
        return None
    text = e["name"] if full else e["name"].split()[0]
    return text if _fits(text, width_px) else None


def idle_per_step(spans: list[dict], steps: list[dict]) -> dict[int, tuple[float, float]]:
    """rank -> (ms a step blocked on collectives, ms a step waiting for a pipeline peer)."""
    out = {}
    for pid in sorted({s["pid"] for s in steps}):
        n = max(sum(s["pid"] == pid for s in steps), 1)
        mine = [e for e in spans if e["pid"] == pid and e.get("tid") == TRACKS.index(COMPUTE)]
        out[pid] = tuple(sum(e["dur"] for e in mine if e.get("cat") == c) / 1e3 / n
                         for c in (BLOCKED, PEER_WAIT))
    return out


def plot_timeline(trace_path: str, path: str, last_steps: int = 2) -> str:
    """Draw the last `last_steps` steps of a Chrome-trace JSON as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.load(open(trace_path))["traceEvents"]
    names = {(e["pid"], e["tid"]): f"rank {e['pid']} {e['args']['name']}"
             for e in events if e["name"] == "thread_name"}
    try:
        spans, steps, t0 = last_spans(events, last_steps)
    except ValueError as e:
        raise ValueError(f"{trace_path}: {e}") from None
    rows = sorted(names)
    width_in, dpi = 12, 110
    fig, ax = plt.subplots(figsize=(width_in, 0.6 * len(rows) + 1.5))
    end = max(e["ts"] + e["dur"] for e in spans + steps)
    px_per_us = 0.8 * width_in * dpi / max(end - t0, 1.0)  # the axes: ~80% of the figure
    actions = [e for e in spans if "microbatch" in e.get("args", {})]
    full = all(_fits(e["name"], e["dur"] * px_per_us) for e in actions)  # one style for all
    for e in spans:
        y = rows.index((e["pid"], e["tid"]))
        x, w = (e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-3)
        ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=COLORS.get(category(e), OTHER),
                       edgecolors="white" if e.get("tid") == TRACKS.index(COMPUTE) else "none",
                       linewidth=0.3)
        text = _label(e, e["dur"] * px_per_us, full)
        if text:
            ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True)
    for s in steps:  # step boundaries, over that rank's rows
        ys = [i for i, r in enumerate(rows) if r[0] == s["pid"]]
        for t in (s["ts"], s["ts"] + s["dur"]):
            ax.vlines((t - t0) / 1e3, min(ys) - 0.5, max(ys) + 0.5, colors="black",
                      linestyles="dashed", linewidth=0.7)
        ax.text((s["ts"] - t0) / 1e3, min(ys) - 0.42, " " + s["name"], fontsize=6,
                va="bottom")
    ax.set_yticks(range(len(rows)), [names[r] for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top, room above it for the step names
    ax.set_xlabel("ms")
    idle = "; ".join(f"rank {r}: blocked {b:.1f} ms" + (f", waiting for a peer {w:.1f} ms"
                                                      if w else "")
                     for r, (b, w) in idle_per_step(spans, steps).items())
    ax.set_title(f"last {len(steps) // len({s['pid'] for s in steps})} steps per rank: "
                 f"compute and communication\n(a step: {idle})", pad=14)
    ax.legend(handles=legend_handles(spans), loc="upper left", bbox_to_anchor=(1.005, 1),
              fontsize=8, frameon=False)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path

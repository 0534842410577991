"""Timeline pictures: a Chrome trace written by `pm.trace` drawn as a PNG Gantt chart, one
row per (rank, track): compute segments coloured by region, blocked time red, collectives on
the comm row."""
from __future__ import annotations

import json

COLORS = {"forward": "#7fb3e6", "backward": "#f5a35c", "weight grad": "#f7d08a",
          "optimizer": "#9bd39b", "blocked": "#d62728", "comm": "#8c564b"}
# pipeline actions are named "F3 s1" (forward of microbatch 3 on stage 1), "B..", "I..", "W.."
_ACTION = {"F": "forward", "B": "backward", "I": "backward", "W": "weight grad"}


def _color(e) -> str:
    if e.get("cat") == "comm":
        return COLORS["comm"]
    if e.get("args", {}).get("blocked_on"):
        return COLORS["blocked"]
    name = e["name"]
    if name[:1] in _ACTION and " s" in name:
        return COLORS[_ACTION[name[0]]]
    return COLORS.get(name, "#cccccc")


def plot_timeline(trace_path: str, path: str, last_steps: int = 2) -> str:
    """Draw the last `last_steps` steps of a Chrome-trace JSON as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = json.load(open(trace_path))["traceEvents"]
    names = {(e["pid"], e["tid"]): f"rank {e['pid']} {e['args']['name']}"
             for e in events if e["name"] == "thread_name"}
    steps = sorted((e for e in events if e.get("cat") == "step"), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{trace_path} has no steps: train before calling pm.trace")
    ranks = {e["pid"] for e in steps}
    t0 = sorted(e["ts"] for e in steps)[-last_steps * len(ranks)]
    rows = sorted(names)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    for e in events:
        if e.get("ph") != "X" or e.get("cat") == "step" or e["ts"] < t0:
            continue
        y = rows.index((e["pid"], e["tid"]))
        ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-3))], (y - 0.4, 0.8),
                       facecolors=_color(e), edgecolors="none")
    ax.set_yticks(range(len(rows)), [names[r] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"last {last_steps} steps per rank: compute and communication")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right",
              fontsize=8, ncol=len(COLORS))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Memory-timeline plots: live bytes after every node, e.g. before and after remat (PNG).

Two graphs of one step have different node counts (remat adds recomputed nodes to the
backward), so their curves are drawn against the step's phases, not node indices: each
graph's forward nodes spread over [0, 1) and its backward over [1, 2], the boundary marked.
"""
from __future__ import annotations

import os

import torch.fx

from fxpar.core import ir
from fxpar.core.cost import MemoryTimeline, simulate_liveness


def backward_start(gm: torch.fx.GraphModule) -> int:
    """Index (in execution order, as MemoryTimeline's) of the graph's first backward node;
    the node count if it has no backward."""
    nodes = list(gm.graph.nodes)
    return next((i for i, n in enumerate(nodes) if n.op == "call_function"
                 and n.meta.get(ir.REGION) not in (None, ir.FORWARD)), len(nodes))


def phase_positions(n_nodes: int, start: int) -> list[float]:
    """x of each node: forward nodes evenly over [0, 1), backward nodes over [1, 2]."""
    fwd, bwd = max(start, 1), max(n_nodes - start - 1, 1)
    return [i / fwd if i < start else 1 + (i - start) / bwd for i in range(n_nodes)]


def plot_memory(timelines: dict[str, MemoryTimeline], path: str,
                categories=("activations", "grads"), title: str = "live memory per node",
                backward_starts: dict[str, int] | None = None) -> str:
    """One line per timeline (sum of `categories`), y = MiB; marks each peak. With
    `backward_starts` ({label: index of its first backward node}) the curves are aligned on
    the forward/backward boundary (phase_positions); without, x = node index."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, tl in timelines.items():
        ys = [sum(tl.live[c][i] for c in categories) / 2**20 for i in range(len(tl.nodes))]
        xs = (phase_positions(len(ys), backward_starts[label]) if backward_starts
              else list(range(len(ys))))
        line, = ax.plot(xs, ys, label=f"{label} ({len(ys)} nodes, peak "
                                      f"{max(ys, default=0):.2f} MiB)")
        if ys:
            i = max(range(len(ys)), key=ys.__getitem__)
            ax.plot([xs[i]], [ys[i]], "o", color=line.get_color())
    if backward_starts:
        ax.axvline(1.0, color="0.4", linestyle="--", linewidth=1)
        ax.set_xticks([0, 0.5, 1, 1.5, 2])
        ax.set_xticklabels(["forward", "", "backward", "", "end"])
        ax.set_xlabel("step phase (each graph's forward and backward nodes spread evenly)")
    else:
        ax.set_xlabel("node index (execution order)")
    ax.set_ylabel(f"live {' + '.join(categories)} (MiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_remat(stage_graphs: dict, path: str) -> str:
    """Simulated live memory of the joint graph before ("capture") and after the remat pass,
    aligned on the forward/backward boundary."""
    before, after = stage_graphs["capture"]["joint"], stage_graphs["remat"]["dp"]
    label = f"remat={after.meta['remat'].mode}"
    return plot_memory({"no remat": simulate_liveness(before), label: simulate_liveness(after)},
                       path, title="joint graph, global batch: live activations + gradients",
                       backward_starts={"no remat": backward_start(before),
                                        label: backward_start(after)})

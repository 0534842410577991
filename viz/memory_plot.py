"""Memory-timeline plots: live bytes after every node, e.g. before and after remat (PNG)."""
from __future__ import annotations

import os

from fxpar.compiler.cost import MemoryTimeline, simulate_liveness


def plot_memory(timelines: dict[str, MemoryTimeline], path: str,
                categories=("activations", "grads"), title: str = "live memory per node") -> str:
    """One line per timeline (sum of `categories`), x = node index, y = MiB; marks each peak."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, tl in timelines.items():
        ys = [sum(tl.live[c][i] for c in categories) / 2**20 for i in range(len(tl.nodes))]
        line, = ax.plot(range(len(ys)), ys, label=f"{label} (peak {max(ys, default=0):.2f} MiB)")
        if ys:
            i = max(range(len(ys)), key=ys.__getitem__)
            ax.plot([i], [ys[i]], "o", color=line.get_color())
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
    """Simulated live memory of the joint graph before ("capture") and after the remat pass."""
    after = stage_graphs["remat"]["dp"]
    return plot_memory({"no remat": simulate_liveness(stage_graphs["capture"]["joint"]),
                        f"remat={after.meta['remat'].mode}": simulate_liveness(after)}, path,
                       title="joint graph, global batch: live activations + gradients")

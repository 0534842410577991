"""Graph pictures: any snapshot -> DOT/SVG (graphviz). Nodes are coloured by region,
collectives are highlighted, and module paths become nested clusters."""
from __future__ import annotations

import html
import os
import torch
import torch.fx

from fxpar.compiler import ir

REGION_COLORS = {ir.FORWARD: "#cfe8ff", ir.BACKWARD: "#ffe3c4", ir.OPTIMIZER: "#e0f5d0",
                 ir.COMM: "#ffd0d0"}  # comm: bucket packing etc.; collectives are bold red
COLLECTIVE_COLOR = "#d62728"
RECOMPUTE_COLOR = "#e4d4ff"   # nodes remat copied into the backward
SAVED_BORDER = "#1f4fd6"      # forward values kept for the backward (thick blue border)
FUSED_BORDER = "#2ca02c"      # one Triton kernel (fusion pass): green 3-D box
COLLECTIVE_PREFIXES = ("_c10d_functional.", "c10d_functional.", "fxpar.")


# one colour per pipeline stage (forward and backward of a stage share it)
STAGE_COLORS = ["#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#8dd3c7",
                "#bebada"]


def is_collective(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and str(n.target).startswith(COLLECTIVE_PREFIXES)


def _label(n: torch.fx.Node) -> str:
    if n.op == "placeholder":
        title = n.meta.get("fqn", n.name)
    elif n.op == "output":
        title = "output"
    else:
        title = getattr(n.target, "__name__", None) if not isinstance(
            n.target, torch._ops.OpOverload) else None
        title = title or str(n.target).replace("aten.", "").replace(".default", "")
    val = n.meta.get(ir.VAL)
    shape = "x".join(map(str, val.shape)) if isinstance(val, torch.Tensor) else ""
    shard = n.meta.get(ir.SHARD)
    place = ""
    if isinstance(shard, tuple) and shard and not isinstance(shard[0], tuple):
        place = ",".join(_short(p) for p in shard)
    if n.meta.get(ir.RECOMPUTE):
        title += " (recompute)"
    elif n.meta.get("saved"):
        title += " [saved]"
    if ir.TRANSFER in n.meta:  # a pipeline stage boundary
        src, dst = n.meta[ir.TRANSFER]
        title = f"send s{src} -> recv s{dst}"
    elif ir.STAGE in n.meta and ir.PHASE in n.meta:
        title += f" [{n.meta[ir.PHASE]}{n.meta[ir.STAGE]}]"
    if n.meta.get("moved"):  # set by the overlap pass
        title += f" ({n.meta['moved']})"
    group = n.meta.get(ir.FUSED_GROUP)
    if group:  # one box per fused kernel: its ops and the bytes it saves
        stage_tag = title[title.find(" ["):] if " [" in title else ""  # pipeline "[F0]" etc.
        title = ("fused kernel" if group["kind"] == "generated" else group["kind"]) + stage_tag
    parts = [f"<b>{html.escape(title)}</b>"]
    if group:
        ops = group["ops"]
        for i in range(0, len(ops), 4):
            parts.append(html.escape(", ".join(ops[i:i + 4])))
        parts.append(html.escape(f"bytes {_mb(group['bytes_unfused'])} -> "
                                 f"{_mb(group['bytes_fused'])}"))
    elif shape or place:
        parts.append(html.escape(" ".join(x for x in (shape, place) if x)))
    return "<" + "<br/>".join(parts) + ">"


def _mb(b: int) -> str:
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB"


def _short(p) -> str:
    s = repr(p)
    return (s.replace("Shard(dim=", "S(").replace("Replicate()", "R")
            .replace("Partial(sum)", "P(sum)").replace("Partial(avg)", "P(avg)"))


def to_dot(gm: torch.fx.GraphModule, title: str = ""):
    """A graphviz.Digraph of the graph (import graphviz lazily: optional at runtime)."""
    import graphviz
    dot = graphviz.Digraph(name=title or "graph", graph_attr={"rankdir": "TB", "label": title,
                                                              "labelloc": "t", "fontsize": "20",
                                                              "compound": "true"},
                           node_attr={"shape": "box", "style": "rounded,filled",
                                      "fontname": "Helvetica", "fontsize": "10"})
    clusters: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        clusters.setdefault(n.meta.get(ir.MODULE, "") if n.op == "call_function" else "", []).append(n)

    def node_attrs(n):
        region = n.meta.get(ir.REGION, ir.FORWARD)
        attrs = {"fillcolor": REGION_COLORS.get(region, "#eeeeee")}
        if is_collective(n):
            attrs.update(fillcolor=COLLECTIVE_COLOR, penwidth="3", color="#7a0000",
                         fontcolor="white")
        if n.meta.get(ir.RECOMPUTE):
            attrs.update(fillcolor=RECOMPUTE_COLOR, style="rounded,filled,dashed")
        if n.meta.get("saved"):
            attrs.update(penwidth="3", color=SAVED_BORDER)
        if ir.STAGE in n.meta and not is_collective(n):  # pipeline: colour by stage
            attrs["fillcolor"] = STAGE_COLORS[n.meta[ir.STAGE] % len(STAGE_COLORS)]
            if n.meta.get(ir.REGION) == ir.BACKWARD:
                attrs["style"] = "rounded,filled,bold"
        if ir.TRANSFER in n.meta:
            attrs.update(shape="cds", penwidth="3", color="#000000")
        if ir.FUSED_GROUP in n.meta:
            attrs.update(shape="box3d", penwidth="2", color=FUSED_BORDER, style="filled")
        if n.op == "placeholder":
            attrs["shape"] = "ellipse"
        return attrs

    # nested clusters by module path prefix
    tree: dict = {}
    for path in clusters:
        cur = tree
        for part in (path.split(".") if path else []):
            cur = cur.setdefault(part, {})

    def emit(graph, prefix, sub):
        for n in clusters.get(prefix, []):
            graph.node(n.name, _label(n), **node_attrs(n))
        for name, child in sub.items():
            path = f"{prefix}.{name}" if prefix else name
            with graph.subgraph(name=f"cluster_{path}") as c:
                c.attr(label=path, style="rounded,dashed", color="#888888", fontsize="11")
                emit(c, path, child)

    emit(dot, "", tree)
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            dot.edge(a.name, n.name, color="#b00000" if is_collective(a) or is_collective(n)
                     else "#666666")
    return dot


def write_svg(gm: torch.fx.GraphModule, path: str, title: str = "") -> str:
    """Write `path` (.svg) and the DOT source beside it (.dot); returns the SVG path."""
    dot = to_dot(gm, title)
    base = path[:-4] if path.endswith(".svg") else path
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    with open(base + ".dot", "w") as f:
        f.write(dot.source)
    dot.render(outfile=base + ".svg", format="svg", cleanup=True)
    return base + ".svg"


def write_snapshots(stage_graphs: dict, out_dir: str) -> list[str]:
    """One SVG per (pass, rank-role) snapshot, named `<index>_<pass>_<role>.svg`."""
    paths = []
    for i, (pass_name, roles) in enumerate(stage_graphs.items()):
        for role, gm in roles.items():
            paths.append(write_svg(gm, os.path.join(out_dir, f"{i:02d}_{pass_name}_{role}.svg"),
                                   title=f"after {pass_name} ({role})"))
    return paths


def summary(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Counts of nodes per region and of collectives (for logs and the CLI)."""
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            key = "collective" if is_collective(n) else n.meta.get(ir.REGION, "?")
            out[key] = out.get(key, 0) + 1
    return out

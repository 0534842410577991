"""Graph pictures: any snapshot -> DOT/SVG (graphviz). Nodes are coloured by region,
collectives are highlighted, and module paths become nested clusters."""
from __future__ import annotations

import html
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.fx

from fxpar.core import ir
from fxpar.viz import layer_graph
from fxpar.viz.layer_graph import layer_view
from fxpar.viz.style import (COLLECTIVE_COLOR, COLLECTIVE_PREFIXES, FUSED_BORDER,  # noqa: F401
                             RECOMPUTE_COLOR, REGION_COLORS, RUN_BORDERS, SAVED_BORDER,
                             STAGE_COLORS, is_collective)


def _label(n: torch.fx.Node) -> str:
    if n.op == "placeholder":
        title = n.meta.get(ir.FQN, n.name)
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
    if n.meta.get(ir.MOVED):  # set by the overlap pass
        title += f" ({n.meta['moved']})"
    if n.meta.get(ir.CODEGEN_RUN):  # pm.stage_graphs["codegen"]: the Inductor run it is in
        title += f" [{n.meta[ir.CODEGEN_RUN].rpartition('/')[2]}]"
    group = n.meta.get(ir.FUSED_GROUP)
    if group:  # one box per fused kernel: its ops and the bytes it saves
        stage_tag = title[title.find(" ["):] if " [" in title else ""  # pipeline "[F0]" etc.
        title = group["kind"] + stage_tag
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


def to_dot(gm: torch.fx.GraphModule, title: str = "", nodes=None):
    """A graphviz.Digraph of the graph (import graphviz lazily: optional at runtime).
    nodes: draw only these (one layer box's ops) and, as small ellipses, what they read."""
    import graphviz
    dot = graphviz.Digraph(name=title or "graph", graph_attr={"rankdir": "TB", "label": title,
                                                              "labelloc": "t", "fontsize": "20",
                                                              "compound": "true"},
                           node_attr={"shape": "box", "style": "rounded,filled",
                                      "fontname": "Helvetica", "fontsize": "10"})
    keep = set(nodes) if nodes is not None else set(gm.graph.nodes)
    inputs = {a for n in keep for a in n.all_input_nodes} - keep
    for a in sorted(inputs, key=lambda a: a.name):
        dot.node(a.name, f"{a.meta.get('fqn', a.name)}\n({a.meta.get(ir.MODULE) or 'top'})",
                 shape="ellipse", style="dashed", fontsize="8", height="0.2", color="#999999")
    clusters: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n not in keep:
            continue
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
        run = n.meta.get(ir.CODEGEN_RUN)
        if run:  # one border colour per Inductor run (neighbouring runs differ)
            index = int(run.rpartition("_")[2]) if run.rpartition("_")[2].isdigit() else 0
            attrs.update(penwidth="3", color=RUN_BORDERS[index % len(RUN_BORDERS)])
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
        for a in (n.all_input_nodes if n in keep else ()):
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


def write_snapshots(stage_graphs: dict, out_dir: str, *, details: bool = True,
                    full: bool = False) -> list[str]:
    """Per (pass, rank-role) snapshot: the layer view `<index>_<pass>_<role>.svg` (+ .dot),
    returned in order; with details, each layer box links to the node-level drawing of its
    ops in `<index>_<pass>_<role>/<module>.svg`. A box whose drawing is the same as in an
    earlier pass links to that file instead of rendering it again (most passes change few
    layers), and the drawings render in parallel: the `dot` runs are the cost. full: also
    the whole node-level graph, `<index>_<pass>_<role>/_graph.svg` (small graphs only: it
    is thousands of points wide for a 2-layer GPT)."""
    import graphviz
    paths, jobs, drawn = [], {}, {}  # jobs: file -> dot source; drawn: source -> file
    for i, (pass_name, roles) in enumerate(stage_graphs.items()):
        for role, gm in roles.items():
            stem = f"{i:02d}_{pass_name}_{role}"
            view = layer_view(gm)
            href = {}
            for b in view.boxes.values() if details else ():
                name = (b.path or "_top") + (f".s{b.stage}" if b.stage is not None else "")
                src = to_dot(gm, f"{b.path or layer_graph.TOP} after {{pass}}",
                             nodes=b.nodes).source
                if src not in drawn:
                    drawn[src] = f"{stem}/{name}.svg"
                    jobs[drawn[src]] = src.replace("{pass}", f"{pass_name} ({role})")
                href[b.key] = drawn[src]
            if full:
                jobs[f"{stem}/_graph.svg"] = to_dot(gm, f"after {pass_name} ({role})").source
            dot = layer_graph.layer_dot(view, f"after {pass_name} ({role})"
                                        + _what_moved(gm.meta.get(ir.OVERLAP_REPORT))
                                        + _what_compiled(gm.meta.get("codegen")),
                                        href=lambda b: href.get(b.key))
            jobs[f"{stem}.svg"] = dot.source
            paths.append(os.path.join(out_dir, f"{stem}.svg"))
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"{stem}.dot"), "w") as f:
                f.write(dot.source)

    def render(item):
        rel, src = item
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(graphviz.pipe("dot", "svg", src.encode()))
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        list(pool.map(render, jobs.items()))
    return paths


def _what_compiled(g) -> str:
    """The codegen picture's title: Inductor's runs and what stayed op by op."""
    if g is None or not hasattr(g, "summary"):
        return ""
    return ": " + g.summary()


def _what_moved(d) -> str:
    """The overlap pass's picture says in its title what moved, or why nothing did (its
    graph alone looks like the data-parallel one: the change is the collectives' places)."""
    if d is None:
        return ""
    if not (d.hoisted or d.sunk or d.pulled):
        return f": nothing moved ({d.why})" if d.why else ": nothing moved"
    parts = [f"{len(d.hoisted)} collectives started earlier (by up to "
             f"{max(d.hoisted.values())} nodes)" if d.hoisted else "",
             f"{len(d.sunk)} waits moved later (by up to {max(d.sunk.values())} nodes)"
             if d.sunk else "",
             f"{sum(d.pulled.values())} compute nodes moved beside expert all-to-alls"
             if d.pulled else ""]
    return ": " + ", ".join(p for p in parts if p) + "; green on the links below"


def summary(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Counts of nodes per region and of collectives (for logs and the CLI)."""
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            key = "collective" if is_collective(n) else n.meta.get(ir.REGION, "?")
            out[key] = out.get(key, 0) + 1
    return out

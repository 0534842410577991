"""Layer-level graph pictures: one box per module at layer granularity, so a 12-layer model
fits a page (the node-level drawing of viz/graph.py is thousands of points wide).

Boxes: the ops (call_function nodes) grouped by meta["module"] cut at a readable depth: inside
a repeated-layer container (a module whose children are named 0, 1, 2, ...: `h`,
`transformer.h`, `model.layers`, `bert.encoder.layer`, found from the paths, no model names)
a box is one child of a layer (`h.3.attn`, `h.3.mlp`; `h.3` itself holds the layer's own ops
such as residual adds); outside it, the first level below what the path shares with the
container (`wte`, `transformer.ln_f`, `bert.embeddings`, `lm_head`). A box holds forward and
backward of its module and says what the passes did there (recomputed, saved, tensor-parallel
layout, fused kernels). Boxes are grouped per repeated layer (one row each) and per pipeline
stage. Collectives and pipeline transfers are small red/black nodes between the boxes they
connect, labelled with kind, count and bytes. Box-to-box edges follow the forward dataflow
(a backward-only flow is drawn dashed, against its arrow), which keeps the layout acyclic.
"""
from __future__ import annotations

import collections
import dataclasses
import html

import torch
import torch.fx

from fxpar.core import ir
from fxpar.viz.style import (COLLECTIVE_COLOR, FUSED_COLOR, INDUCTOR_COLOR, MOVED_COLOR,
                             MOVED_FILL,
                             RECOMPUTE_COLOR, REGION_COLORS, STAGE_COLORS, TP_COLOR, fmt_bytes,
                             is_collective, nbytes)

TOP = "(top level)"  # the box of ops whose module is the model itself (e.g. the loss)


def repeated_containers(paths) -> list[str]:
    """Module paths whose children are numbered (0, 1, ...: a ModuleList/Sequential of
    layers), outermost only: `h.0.mlp.0` does not make `h.0.mlp` a container when `h` is."""
    kids = collections.defaultdict(set)
    for p in paths:
        parts = p.split(".") if p else []
        for i, s in enumerate(parts):
            if s.isdigit():
                kids[".".join(parts[:i])].add(s)
    found = sorted((p for p, k in kids.items() if len(k) > 1), key=lambda p: p.count("."))
    out: list[str] = []
    for p in found:
        if not any(p == c or p.startswith(c + ".") or c == "" for c in out):
            out.append(p)
    return out


def box_of(path: str, containers: list[str]) -> tuple[str, str | None]:
    """(box path, repeated layer or None) for a module path."""
    parts = path.split(".") if path else []
    for c in containers:
        n = len(c.split(".")) if c else 0
        if parts[:n] == (c.split(".") if c else []) and len(parts) > n and parts[n].isdigit():
            return ".".join(parts[:n + 2]), ".".join(parts[:n + 1])
    if not parts:
        return "", None
    shared = max((_common(parts, c.split(".") if c else []) for c in containers), default=0)
    return ".".join(parts[:shared + 1]), None


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclasses.dataclass
class Box:
    path: str                   # module path at layer granularity ("" = top level)
    layer: str | None           # the repeated layer it belongs to ("h.3"), else None
    stage: int | None           # pipeline stage (meta["stage"]), None without a pipeline
    nodes: list = dataclasses.field(default_factory=list)
    regions: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    recomputed: int = 0
    saved: int = 0
    fused: int = 0
    compiled: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tp: set = dataclasses.field(default_factory=set)  # {"column c_attn", "row c_proj"}

    @property
    def key(self):
        return (self.stage, self.path)

    @property
    def name(self) -> str:
        """The dot node id (unique per stage)."""
        base = self.path or TOP
        return base if self.stage is None else f"{base} #s{self.stage}"

    @property
    def short(self) -> str:
        """The label: the path relative to its layer (`attn` in the layer row `h.3`)."""
        if self.layer and self.path.startswith(self.layer + "."):
            return self.path[len(self.layer) + 1:]
        return "own ops" if self.layer else (self.path or TOP)


@dataclasses.dataclass
class Link:
    """Collectives of one kind (or pipeline transfers) between the same boxes."""
    kind: str                   # "all_reduce", "send s0 -> recv s1", ...
    srcs: tuple                 # box keys the data comes from
    dsts: tuple                 # box keys that read the result
    backward: bool              # flows against the forward order (gradients)
    stage: int | None
    count: int = 0
    nbytes: int = 0
    transfer: bool = False
    earlier: int = 0            # the overlap pass started this many earlier ...
    later: int = 0              # ... and waited for this many later (meta "moved")


@dataclasses.dataclass
class LayerView:
    boxes: dict                 # key -> Box, in graph order
    edges: dict                 # (tail key, head key) -> True (forward flow) / False (backward)
    links: list
    staged: bool


def _comm_kind(n: torch.fx.Node) -> str | None:
    """The kind of a communicating node (a collective start, not its wait; fxpar's own ops
    in the collective namespace compute locally), else None."""
    if ir.TRANSFER in n.meta and n.op == "call_function":
        s, d = n.meta[ir.TRANSFER]
        return f"send s{s} -> recv s{d}"
    if not is_collective(n) or str(n.target).startswith("fxpar."):
        return None
    name = str(n.target).split(".")[1]
    return None if name.startswith("wait") else name


def _plumbing(n: torch.fx.Node) -> bool:
    """Nodes drawn as no box: collective waits and bucket (un)packing (region comm)."""
    return n.op == "call_function" and (is_collective(n) and not str(n.target).startswith(
        "fxpar.") or n.meta.get(ir.REGION) == ir.COMM)


def layer_view(gm: torch.fx.GraphModule) -> LayerView:
    """Group the graph's ops into layer boxes and collect the links between them."""
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function"]
    containers = repeated_containers({n.meta.get(ir.MODULE, "") for n in nodes})
    staged = any(n.meta.get(ir.STAGE) is not None for n in calls)
    stage_of = _stages_of(calls) if staged else {}
    boxes: dict = {}
    where: dict = {}  # node -> box key
    for n in calls:
        if _comm_kind(n) or _plumbing(n):
            continue
        path, layer = box_of(n.meta.get(ir.MODULE, ""), containers)
        stage = stage_of.get(n)
        b = boxes.get((stage, path)) or boxes.setdefault(
            (stage, path), Box(path, layer, stage))
        where[n] = b.key
        b.nodes.append(n)
        b.regions[n.meta.get(ir.REGION, ir.FORWARD)] += 1
        b.recomputed += bool(n.meta.get(ir.RECOMPUTE))
        b.saved += bool(n.meta.get("saved"))
        b.fused += ir.FUSED_GROUP in n.meta
        if n.meta.get(ir.CODEGEN_RUN):
            b.compiled[n.meta[ir.CODEGEN_RUN]] += 1
    _tensor_parallel(gm, boxes, where)
    # boxes in dataflow order: by the first op that reads an activation (a weight's
    # transpose or an arange may be hoisted to the top of the graph)
    index = {n: i for i, n in enumerate(nodes)}
    first = {k: min((index[n] for n in b.nodes if any(a.op != "placeholder"
                                                      for a in n.all_input_nodes)),
                    default=index[b.nodes[0]]) for k, b in boxes.items()}
    boxes = {k: boxes[k] for k in sorted(boxes, key=first.get)}

    edges: dict = {}
    for n in calls:
        for a in n.all_input_nodes:
            if n in where and a in where and where[a] != where[n]:
                fwd = n.meta.get(ir.REGION) == ir.FORWARD and a.meta.get(ir.REGION) == ir.FORWARD
                bwd = n.meta.get(ir.REGION) == ir.BACKWARD == a.meta.get(ir.REGION)
                if fwd:
                    edges[(where[a], where[n])] = True
                elif bwd and (where[n], where[a]) not in edges:
                    edges[(where[n], where[a])] = False  # drawn in forward order
    links: dict = {}
    for n in calls:
        kind = _comm_kind(n)
        if kind is None:
            continue
        srcs = _reach(n, where, up=True)
        dsts = _reach(n, where, up=False) - srcs if ir.TRANSFER not in n.meta else \
            _reach(n, where, up=False)
        region = ({a.meta.get(ir.REGION) for a in n.all_input_nodes} - {ir.COMM}) or \
            {n.meta.get(ir.REGION)}
        backward = ir.BACKWARD in region or (n.meta.get(ir.REGION) == ir.COMM and not srcs)
        # (a collective a later pass inserted has no stage of its own: its neighbours')
        stage = stage_of.get(n) if staged and ir.TRANSFER not in n.meta else None
        key = (kind, tuple(sorted(srcs, key=str)), tuple(sorted(dsts, key=str)), stage)
        if ir.BUCKET in n.meta:
            kind += " (grads)"
        link = links.setdefault(key, Link(kind, key[1], key[2], backward, stage,
                                          transfer=ir.TRANSFER in n.meta))
        link.count += 1
        link.nbytes += max([nbytes(n)] + [nbytes(a) for a in n.all_input_nodes])
        link.earlier += bool(n.meta.get(ir.MOVED))
        link.later += any(u.meta.get(ir.MOVED) for u in n.users)
    return LayerView(boxes, edges, list(links.values()), staged)


def _stages_of(calls: list) -> dict:
    """Each op's pipeline stage: its meta's, else (ops a later pass inserted, e.g. tensor
    parallelism's id masking and its gathers) the stage of the nearest input that has one,
    else of a user: such an op runs with its neighbours, so its box stays in their stage's
    cluster instead of floating outside every stage."""
    stage = {n: n.meta[ir.STAGE] for n in calls if n.meta.get(ir.STAGE) is not None}
    for order in (calls, calls[::-1]):
        for n in order:
            if n not in stage:
                near = n.all_input_nodes if order is calls else list(n.users)
                s = next((stage[a] for a in near if a in stage), None)
                if s is not None:
                    stage[n] = s
    return stage


def _reach(n: torch.fx.Node, where: dict, up: bool) -> set:
    """The boxes a link reads from (up) or feeds (down), through waits and (un)packing."""
    out, seen = set(), set()
    todo = list(n.all_input_nodes if up else n.users)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if m in where:
            out.add(where[m])
        elif m.op == "call_function" and _plumbing(m):
            todo.extend(m.all_input_nodes if up else m.users)
    return out


def _tensor_parallel(gm, boxes, where):
    """Badges from gm.meta[TP_LAYOUTS] (per parameter: None or (shard dim, ...)): a sharded
    weight read by an embedding is vocab-parallel, else dim 0 = column, dim 1 = row."""
    layouts = gm.meta.get(ir.TP_LAYOUTS) or []
    params = [n for n in gm.graph.nodes if n.op == "placeholder"
              and n.meta.get(ir.ROLE) == "param"]
    for p, layout in zip(params, layouts):
        if layout is None or layout[0] is None:
            continue
        owner = p.meta.get(ir.MODULE, "")
        for u in p.users:
            if u not in where:
                continue
            b = boxes[where[u]]
            kind = ("vocab" if u.target is torch.ops.aten.embedding.default
                    else "column" if layout[0] == 0 else "row")
            name = owner[len(b.path) + 1:] if owner.startswith(b.path + ".") and b.path else (
                "" if owner == b.path else owner)
            b.tp.add(f"{kind} {name}".strip())


# --- drawing ------------------------------------------------------------------------------

def _cell(text, color="#ffffff", bold=False, span=1, align="center") -> str:
    t = html.escape(text)
    return (f'<tr><td colspan="{span}" bgcolor="{color}" align="{align}">'
            f'{f"<b>{t}</b>" if bold else t}</td></tr>')


def _box_label(b: Box) -> str:
    """An HTML table: the module's name (filled by stage, else by its majority region), its
    op counts per region, then one badge per thing a pass did to it."""
    r = b.regions
    top = max(r, key=r.get) if r else ir.FORWARD
    title = STAGE_COLORS[b.stage % len(STAGE_COLORS)] if b.stage is not None else \
        REGION_COLORS.get(top, "#eeeeee")
    counts = [f'<td bgcolor="{REGION_COLORS[k]}">{k[0].upper()} {r[k]}</td>'
              for k in (ir.FORWARD, ir.BACKWARD, ir.OPTIMIZER) if r.get(k)]
    span = max(len(counts), 1)
    rows = [_cell(b.short, title, bold=True, span=span), f"<tr>{''.join(counts)}</tr>"]
    if b.recomputed:
        rows.append(_cell(f"{b.recomputed} recomputed", RECOMPUTE_COLOR, span=span))
    if b.saved:
        rows.append(_cell(f"{b.saved} saved", "#dfe8ff", span=span))
    if b.tp:
        rows.append(_cell("tp: " + ", ".join(sorted(b.tp)), TP_COLOR, span=span))
    if b.fused:
        rows.append(_cell(f"{b.fused} fused kernel{'s' * (b.fused > 1)}", FUSED_COLOR,
                          span=span))
    if b.compiled:
        ops = sum(b.compiled.values())
        runs = sorted((r.rpartition("_")[2] for r in b.compiled),
                      key=lambda k: (len(k), k))  # (numbers in order: 6 before 10)
        rows.append(_cell(f"Inductor run{'s' * (len(runs) > 1)} {', '.join(runs)}: {ops} "
                          f"op{'s' * (ops > 1)}", INDUCTOR_COLOR, span=span))
    return ('<table border="0" cellborder="1" cellspacing="0" cellpadding="3">'
            + "".join(rows) + "</table>")


def _legend(view: LayerView) -> str:
    def row(text, color="#ffffff", bold=False):
        return _cell(text, color, bold, span=3, align="left")
    rows = [row("legend", "#f4f4f4", bold=True),
            row("box = one module, forward + backward; click: its ops"),
            f'<tr><td bgcolor="{REGION_COLORS[ir.FORWARD]}">F n</td>'
            f'<td bgcolor="{REGION_COLORS[ir.BACKWARD]}">B n</td>'
            '<td align="left">ops per region</td></tr>',
            row("n recomputed: remat replays them in the backward", RECOMPUTE_COLOR),
            row("n saved: forward values kept for the backward", "#dfe8ff"),
            row("tp: column / row / vocab-sharded weights", TP_COLOR),
            *([row("n fused kernels: fxpar's Triton kernels (fusion pass)", FUSED_COLOR)]
              if any(b.fused for b in view.boxes.values()) else []),
            *([row("Inductor runs i, j: its ops compiled into those runs (a run spans boxes)",
                   INDUCTOR_COLOR)] if any(b.compiled for b in view.boxes.values()) else []),
            row("red: collective (kind x count, bytes)", "#ffd0d0"),
            row("arrow: forward dataflow; dashed: backward only")]
    if any(link.earlier or link.later for link in view.links):
        rows.append(row("green border: the overlap pass moved it (started earlier / waited "
                        "later)", MOVED_FILL))
    if view.staged:
        rows.append(row("black: pipeline send/recv (bytes)", "#e8e8e8"))
        rows += [row(f"stage {s}", STAGE_COLORS[s % len(STAGE_COLORS)])
                 for s in _stages(view) if s is not None]
    return ('<table border="0" cellborder="1" cellspacing="0" cellpadding="3">'
            + "".join(rows) + "</table>")


def _stages(view: LayerView) -> list:
    """The stages boxes belong to, in order; None (a box of no stage) last."""
    return sorted({b.stage for b in view.boxes.values()}, key=lambda s: (s is None, s))


def layer_dot(view: LayerView | torch.fx.GraphModule, title: str = "", href=None):
    """A graphviz.Digraph of the layer view: one HTML-table node per repeated layer (its
    boxes left to right in forward order, so a layer is one row and 12 layers stack down
    the page), a node per other box, a cluster per pipeline stage. href(box) -> relative URL
    of the box's node-level drawing, or None."""
    import graphviz
    if isinstance(view, torch.fx.GraphModule):
        view = layer_view(view)
    dot = graphviz.Digraph(name=title or "layers", graph_attr={
        "rankdir": "TB", "label": title, "labelloc": "t", "fontsize": "18", "nodesep": "0.2",
        "ranksep": "0.35", "fontname": "Helvetica"},
        node_attr={"shape": "plain", "fontname": "Helvetica", "fontsize": "10"},
        edge_attr={"color": "#777777", "arrowsize": "0.6"})
    dot.node("legend", "<" + _legend(view) + ">")
    order = {k: i for i, k in enumerate(view.boxes)}
    end = {}  # box key -> dot endpoint ("node" or "row:port")
    rows: dict = {}  # (stage, layer) -> boxes
    for b in view.boxes.values():
        if b.layer:
            rows.setdefault((b.stage, b.layer), []).append(b)

    def attrs(b):
        url = href(b) if href else None
        return (f' href="{html.escape(url)}" target="_top"' if url else "") + \
            f' title="{html.escape(b.path or TOP)}"'

    for s in _stages(view):
        ctx = dot.subgraph(name=f"cluster_stage{s}") if s is not None else None
        g = ctx.__enter__() if ctx else dot
        if ctx:
            g.attr(label=f"stage {s}", style="rounded,filled", fontsize="14",
                   fillcolor="#f7f7f7", color=STAGE_COLORS[s % len(STAGE_COLORS)], penwidth="3")
        for b in view.boxes.values():
            if b.stage == s and not b.layer:
                url = href(b) if href else None
                g.node(b.name, "<" + _box_label(b) + ">", tooltip=b.path or TOP,
                       **({"URL": url, "target": "_top"} if url else {}))
                end[b.key] = b.name
        for (stage, layer), members in rows.items():
            if stage != s:
                continue
            node = layer if s is None else f"{layer} #s{s}"
            cells = "".join(f'<td port="p{i}"{attrs(b)}>{_box_label(b)}</td>'
                            for i, b in enumerate(members))
            end.update({b.key: f"{node}:p{i}" for i, b in enumerate(members)})
            g.node(node, f'<<table border="1" style="rounded" color="#888888" cellspacing="6" '
                   f'cellborder="0" cellpadding="0"><tr><td valign="top"><b>'
                   f'{html.escape(layer)}</b></td>{cells}</tr></table>>')
        for i, link in enumerate(view.links):  # a stage's collectives inside its cluster
            if link.stage == s and s is not None:
                _link_node(g, link, f"link{i}", view)
        if ctx:
            ctx.__exit__(None, None, None)

    for (a, b), fwd in view.edges.items():
        if end[a].split(":")[0] == end[b].split(":")[0]:
            continue  # inside one layer row: the row's order shows it
        # an edge against the boxes' order (the top-level box holds the embedding sum and
        # the loss) is drawn but does not rank: no cycles, layers stay top to bottom
        dot.edge(end[a], end[b], **({} if fwd else {"style": "dashed", "dir": "back"}),
                 **({"constraint": "false"} if order[a] > order[b] else {}),
                 **({"weight": "0"} if ":" in end[a] and ":" in end[b] else {}))
    # consecutive layers stacked straight down (their port edges above pull no weight)
    chain = [(k, f"{k[1]}" if k[0] is None else f"{k[1]} #s{k[0]}") for k in rows]
    for (k1, a), (k2, b) in zip(chain, chain[1:]):
        if k1[0] == k2[0]:
            dot.edge(a, b, style="invis", weight="20")
    for i, link in enumerate(view.links):
        if link.stage is None:  # (pipeline transfers: between the clusters)
            _link_node(dot, link, f"link{i}", view)
        _link_edges(dot, link, f"link{i}", end, order)
    return dot


def _link_sources(link: Link, order: dict) -> list:
    srcs = list(link.srcs)
    return [max(srcs, key=order.get)] if len(srcs) > 3 else srcs


def _link_node(g, link: Link, name: str, view: LayerView):
    """The badge of a link (collectives red, pipeline transfers black), declared in `g`
    (its stage's cluster, or the top graph)."""
    times = f" x{link.count}" if link.count > 1 else ""
    label = f"{link.kind}{times}\n{fmt_bytes(link.nbytes)}"
    srcs = list(link.srcs)
    if len(srcs) > 3:  # a gradient bucket: name what it covers, one edge from its last box
        layers = sorted({view.boxes[k].layer for k in srcs} - {None},
                        key=lambda l: [int(p) if p.isdigit() else p for p in l.split(".")])
        others = sum(view.boxes[k].layer is None for k in srcs)
        span = (f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else layers[0]) if layers else ""
        label += f"\nfrom {' + '.join(x for x in (span, others and f'{others} more') if x)}"
    attrs = ({"shape": "box", "style": "filled,bold", "fillcolor": "#e8e8e8",
              "color": "#000000"} if link.transfer else
             {"shape": "box", "style": "rounded,filled", "fillcolor": "#ffd0d0",
              "color": COLLECTIVE_COLOR, "fontcolor": "#7a0000"})
    if link.earlier or link.later:  # what the overlap pass did to these collectives
        label += "\nmoved: " + ", ".join(x for x in (
            link.earlier and f"{link.earlier} started earlier",
            link.later and f"{link.later} waited later") if x)
        attrs.update(color=MOVED_COLOR, penwidth="3")
    g.node(name, label, fontsize="9", margin="0.04,0.02", height="0.2", **attrs)


def _link_edges(dot, link: Link, name: str, end: dict, order: dict):
    color = "#000000" if link.transfer else COLLECTIVE_COLOR
    # drawn in forward order like the box edges: a gradient link hangs above its sources
    ends = ([(end[s], name) for s in _link_sources(link, order)]
            + [(name, end[d]) for d in link.dsts])
    for tail, head in ends:
        if link.backward:
            dot.edge(head, tail, color=color, dir="back", style="dashed")
        else:
            dot.edge(tail, head, color=color, penwidth="1.5")

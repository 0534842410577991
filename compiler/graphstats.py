"""Per-layer statistics of a joint graph, for the planner: captured once, priced per plan.

The planner never runs the pass pipeline per candidate. It reads, from the one joint graph
(traced on fake tensors, so a 175B-parameter model costs no memory), what every plan's price
depends on, per *segment*: the layers of the model's repeated blocks (a module path with an
integer component, e.g. `h.3` or `model.layers.3`), plus `pre` (what runs before the first
block: embeddings) and `post` (after the last: final norm, head, loss).

Per segment: forward / backward FLOPs (torch's FlopCounterMode formulas), bytes moved, graph
nodes (each pays the dispatch overhead), parameter elements, the bytes of forward values the
backward reads (the saved activations: storages, so a view counts as its base), the bytes
that cross to the next segment (a pipeline cut there sends them), and what tensor
parallelism splits: every statistic has a `_split` part that Megatron-style column->row
pairs divide by tp, and the bytes of the all-reduces those pairs need.

Tensor-parallel split: each linear in the role the tensor_parallel pass gives it
(`tensor_parallel.roles`, its decisions on a copy): a *column* linear's output is split and
values computed from split values stay split; a *row* linear reads a split value and its
output is a partial sum, all-reduced (forward), whole afterwards; a column+gather linear does
1/tp of the work and its output is gathered. The backward mirrors it: the gradient of a
column linear's input is all-reduced. Backward nodes are split when they produce a value
shaped like a split forward value (and not like a whole one), or are matmuls reading a split
value.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.fx

from fxpar.core import cost, ir
from fxpar.core.graphs import grad_sum_trees, param_grads

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            *([aten._grouped_mm.default] if hasattr(aten, "_grouped_mm") else [])}


def layer_key(module: str) -> str | None:
    """`transformer.h.3.mlp.c_fc` -> `transformer.h.3` (the repeated block it belongs to)."""
    layer = ir.layer_of(module or "")
    return layer if layer and layer.split(".")[-1].isdigit() else None


FIELDS = ("flops_f", "flops_b", "bytes_f", "bytes_b", "nodes_f", "nodes_b", "saved",
          "boundary", "params", "flops_f_split", "flops_b_split", "bytes_f_split",
          "bytes_b_split", "saved_split", "params_split", "tp_comm_f", "tp_comm_b",
          "transient", "transient_split", "tp_calls_extra", "flops_f_whole", "flops_b_whole",
          "bytes_f_whole", "bytes_b_whole", "saved_whole", "expert_params", "expert_flops_f",
          "expert_flops_b", "ep_comm_f", "ep_comm_b", "ep_bytes_f", "ep_bytes_b", "ep_saved",
          "grouped_saved_f", "grouped_saved_b", "grouped_bytes_f", "grouped_bytes_b",
          "grouped_stack_bytes",
          "expert_flops_f_split", "expert_flops_b_split",
          "attn_flops_f", "attn_flops_b", "sdpa_flops_f", "sdpa_flops_b", "kv_bytes", "qo_bytes",
          "n_attn")


@dataclasses.dataclass
class Segment:
    """Statistics of one segment for the traced batch (rows = the batch rows traced)."""
    name: str
    flops_f: float = 0.0         # FLOPs of the matmul-family ops
    flops_b: float = 0.0
    bytes_f: float = 0.0         # bytes read + written by the ops without FLOPs
    bytes_b: float = 0.0
    nodes_f: int = 0
    nodes_b: int = 0
    saved: float = 0.0           # bytes of forward values the backward reads
    boundary: float = 0.0        # bytes crossing to the next segment (forward; grads back)
    params: int = 0              # parameter elements
    flops_f_split: float = 0.0
    flops_b_split: float = 0.0
    bytes_f_split: float = 0.0
    bytes_b_split: float = 0.0
    saved_split: float = 0.0
    params_split: int = 0
    tp_comm_f: float = 0.0       # bytes all-reduced over tp in the forward (row outputs)
    tp_comm_b: float = 0.0       # ... in the backward (column inputs' gradients)
    transient: float = 0.0       # working bytes beyond the saved values while it runs
    transient_split: float = 0.0  # of transient: what tensor parallelism splits (the tp
    #                               pass's own graph at tp=2, planner.count_pass_extras)
    tp_calls_extra: float = 0.0  # tp collectives beyond one per row/column linear (a
    #                              vocab-parallel loss's): counted by running the tp pass
    # the work data parallelism does not split: ops the dp pass runs on the gathered batch
    # (e.g. an MoE's expert matmuls over the routed rows of every rank), counted by running
    # the dp pass (planner.count_pass_extras)
    flops_f_whole: float = 0.0
    flops_b_whole: float = 0.0
    bytes_f_whole: float = 0.0
    bytes_b_whole: float = 0.0
    saved_whole: float = 0.0     # of `saved`: what a dp rank holds of the gathered batch
    # expert parallelism (planner.expert_stats, from passes/expert_parallel.find_layers): the
    # MoE layers' expert weights (elements), their grouped matmuls' FLOPs (part of the
    # `_whole` work: every rank's rows), and the bytes of the rows Plan.ep sums over its
    # group where they leave a layer, forward and backward; n_moe: the MoE layers
    expert_params: int = 0
    expert_flops_f: float = 0.0
    expert_flops_b: float = 0.0
    ep_comm_f: float = 0.0
    ep_comm_b: float = 0.0
    ep_bytes_f: float = 0.0      # ... and the bytes its row moves and masks read and write
    ep_bytes_b: float = 0.0
    ep_saved: float = 0.0        # the MoE layers' row values the backward reads (an ep
    #                              rank holds the rows it receives of them: up to
    #                              planner.EP_RECEIVED x its own)
    n_moe: int = 0
    # of expert_flops_*: what running a list of E experts grouped saves at ep=1 (each expert
    # traced over every routed position, grouped over its own rows: 1 - 1/E of them;
    # passes/grouped_experts)
    grouped_saved_f: float = 0.0
    grouped_saved_b: float = 0.0
    # ... and the bytes it moves doing so: the rows entering gathered in expert order and
    # each leaving value put back in position order, one masked copy per expert (of the
    # traced rows); the experts' weights stacked, forward and backward (each read and
    # written: per forward or backward, whatever its rows)
    grouped_bytes_f: float = 0.0
    grouped_bytes_b: float = 0.0
    grouped_stack_bytes: float = 0.0
    # the activations the dp pass all-gathers here (an op with no split sharding rule reading
    # the batch's rows: an experts loop's combine), per microbatch: how many, and their
    # bytes gathered at the traced rows (fp32)
    dp_gathers: int = 0
    dp_gather_bytes: float = 0.0
    # of expert_flops_*: the experts' whose weights tp splits (listed experts' linears), 1/tp
    # of them a rank's under tp
    expert_flops_f_split: float = 0.0
    expert_flops_b_split: float = 0.0
    # context parallelism (planner.context_stats): each attention's FLOPs (forward, backward),
    # the bytes of its keys and values (gathered over the cp group forward, their gradients
    # reduce-scattered backward) and of its queries and output; n_attn: the attention ops
    attn_flops_f: float = 0.0
    attn_flops_b: float = 0.0
    sdpa_flops_f: float = 0.0    # of attn_flops: the CUDA kernels cp leaves whole
    sdpa_flops_b: float = 0.0
    kv_bytes: float = 0.0
    qo_bytes: float = 0.0
    n_attn: int = 0
    n_row: int = 0               # row linears (one tp all-reduce each, forward)
    n_param_tensors: int = 0
    largest_param: int = 0       # elements of its largest parameter (an optimizer's temporaries)
    column_out: list = dataclasses.field(default_factory=list)  # column linears' out features

    def key(self):
        return tuple(round(float(getattr(self, f)), 3) for f in FIELDS
                     if f not in ("transient", "transient_split"))

    def working(self, tp: int = 1) -> float:
        """Its working memory (transient) on a rank of a tp group of `tp`."""
        return self.transient - self.transient_split * (1 - 1 / tp)


@dataclasses.dataclass(frozen=True)
class CpProbe:
    """What the cp pass makes of a graph, from its runs at cp=2 on copies (planner.cp_probe).
    moe_cp_whole: the experts run on the cp group's whole tokens, not each rank's own (cp
    splits none of their work, and ep with cp is refused). gather / ring: what a cp rank
    keeps for the backward beyond its share of the layers' traced saved values (and, with
    the keys and values gathered, beyond their whole copies), per byte of that share: the
    projection a rank's own keys and values are views of (a fused q/k/v's output, alive
    for q), the copies the attention kernels take."""
    moe_cp_whole: bool = False
    gather: float = 0.0
    ring: float = 0.0


@dataclasses.dataclass
class GraphStats:
    """What the planner knows about a model. Per-row fields scale with the batch rows of a
    microbatch (`rows` were traced); params and nodes do not."""
    segments: list[Segment]
    rows: int                    # batch rows of the traced graph
    param_bytes_per_elem: float  # dtype size of the parameters as traced
    transient: float             # activation peak beyond the saved values (working memory)
    n_layers: int
    traced_layers: int
    note: str = ""
    heads: int | None = None     # attention heads, if found (tp must divide them)
    mutated_buffers: bool = False  # e.g. BatchNorm statistics: one microbatch per step only
    microbatch_refusal: str | None = None  # why the loss cannot be split into microbatches
    # the precision whose graph (after the precision pass) the activation statistics were
    # measured on; "" = the traced graph's, scaled by dtype size for another precision
    activations_precision: str = ""
    # remat="sqrt"'s checkpoint candidates per layer (planner.checkpoints_per_layer)
    checkpoints_per_layer: int = 1
    graph: object = None         # (GraphModule, GraphSignature) when captured from a model
    # nodes the passes add (counted by planner.graph_stats running them once): tensor
    # parallelism's per microbatch, data parallelism's per parameter tensor by ZeRO stage
    # (0 stands for 0-2, 3 for 3)
    tp_nodes_extra: float = 0.0
    dp_nodes_per_param: dict = dataclasses.field(default_factory=dict)
    # ZeRO-3's collectives per parameter tensor (one per layer: a few per 10 tensors): the
    # all-gathers (before the forward use and the backward use), the reduce-scatters
    zero3_gathers_per_param: float = 2.0
    zero3_reduce_scatters_per_param: float = 1.0
    # the host calls of a compiled step (codegen.host_calls: Inductor's runs and the library
    # kernels they call, ops left outside), which a GPU's host prices instead of the nodes
    host_calls_compiled: int | None = None
    dp_loss_calls: int = 1  # data parallelism's all-reduces per microbatch besides gradients
    #                         (a mean over the targets not ignored: the loss and their count)
    # bytes of the largest gradient bucket the dp pass makes (its probe at dp=2), or None
    dp_bucket_bytes: float | None = None
    # per column linear's weight: (its out features, the segment holding the parameter, its
    # elements) - a tied weight is held where first used, not where the column is (at_tp)
    column_weights: list = dataclasses.field(default_factory=list)
    # each linear weight's tensor-parallel role as priced: {parameter name: "column" | "row"}
    tp_roles: dict = dataclasses.field(default_factory=dict)
    # why the tensor_parallel pass cannot split this graph (no tp plan is priced), or None
    tp_refusal: str | None = None
    # each op node's segment, by node name (a pass's copy of the graph keeps the names)
    node_segment: dict = dataclasses.field(default_factory=dict)
    # where pipeline_split cuts the graph (planner.pass_stages), by (stages, device type):
    # its transfers and the weights several stages read
    transfers: dict = dataclasses.field(default_factory=dict)
    shared_weights: dict = dataclasses.field(default_factory=dict)
    # (same keys): per stage of the pass's cut, the bytes of activations it saves
    stage_saved: dict = dataclasses.field(default_factory=dict)
    # (same keys): each segment's share of its work on each stage of the cut (None: the
    # pass cannot cut the graph so)
    stage_shares: dict = dataclasses.field(default_factory=dict)
    # (same keys): per stage, its backward's (FLOPs, bytes, nodes) in all and in the weight-
    # gradient part zero-bubble defers ("W": what no gradient sent to an earlier stage needs)
    stage_wgrad: dict = dataclasses.field(default_factory=dict)
    # each MoE layer's expert count (expert parallelism's degree must divide them all), and
    # why Plan.ep cannot split this graph's experts (None: it can, or there are none)
    expert_counts: tuple = ()
    ep_refusal: str | None = None
    # the dp pass runs every MoE layer's dispatch on each rank's own rows
    # (core/local_dispatch): its expert work splits over dp and its expert gradients are
    # partial sums; else the routed rows are gathered to every dp rank
    moe_local: bool = False
    # some experts kept as an nn.ModuleList run under Plan.ep in slots as traced (each rank's
    # experts over every row picked for them, results all-gathered), not by all-to-all
    ep_slots: bool = False
    # what the cp pass makes of this graph (planner.cp_probe): run where the search first
    # prices cp (it costs cp passes on copies of the graph), remembering its answer
    cp_probe: Callable[[], CpProbe] = dataclasses.field(default=CpProbe, repr=False,
                                                        compare=False)
    # the sequence length Plan.cp splits (None: no sequence input) and why it cannot (None:
    # it can)
    seq: int | None = None
    cp_refusal: str | None = None
    # why some attention cannot run as ring attention (Plan.cp_attention="ring"; None: all can)
    ring_refusal: str | None = None
    # the gradient the backward makes last (elements) and how many parts are summed into it
    # (2 for an embedding tied to the LM head: the head's part waits for the embedding's)
    last_grad: tuple = (0, 1)

    @property
    def moe_cp_whole(self) -> bool:
        return self.cp_probe().moe_cp_whole

    @property
    def layers(self) -> list[Segment]:
        return [s for s in self.segments if s.name not in ("pre", "post")]

    @property
    def total_params(self) -> int:
        return sum(s.params for s in self.segments)

    def at_tp(self, tp: int) -> "GraphStats":
        """The statistics as the tensor-parallel pass splits the model at `tp`, per segment:
        the pass replicates a column linear whose out features tp does not divide (GPT-2's
        50257-wide LM head; it warns), and with it what that leaves without a partner, and
        its weight wherever it is held (a tied embedding). Approximated so: such a segment
        is priced whole (nothing split or tp-reduced; exact for a head alone in its
        segment), and the weight whole in the segment holding it. Found only where the
        statistics see the column (a head behind a dense + LayerNorm, BERT's, is not)."""
        if tp == 1 or not any(c % tp for s in self.segments for c in s.column_out):
            return self
        whole = dict(flops_f_split=0.0, flops_b_split=0.0, bytes_f_split=0.0,
                     bytes_b_split=0.0, saved_split=0.0, params_split=0, tp_comm_f=0.0,
                     transient_split=0.0,
                     tp_comm_b=0.0, tp_calls_extra=0.0, n_row=0, column_out=[])
        segs = [dataclasses.replace(s, **whole) if any(c % tp for c in s.column_out) else s
                for s in self.segments]
        by_name = {s.name: i for i, s in enumerate(segs)}
        for out, seg, n in self.column_weights:  # a tied weight held in another segment
            i = by_name.get(seg)
            if out % tp and i is not None and segs[i].params_split:
                segs[i] = dataclasses.replace(segs[i],
                                              params_split=max(segs[i].params_split - n, 0))
        return dataclasses.replace(self, segments=segs)

    def with_depth(self, n_layers: int, keep_first: int = 0) -> "GraphStats":
        """The statistics of the same model with `n_layers` blocks: the middle traced block
        stands for every block (they must be identical: checked). `keep_first`: the model's
        first blocks that differ from the rest (DeepSeek-V3's dense layers before its MoE
        ones), traced and kept as they are, the repeated ones after them."""
        layers = self.layers
        kept, run = layers[:keep_first], layers[keep_first:]
        if not run or n_layers <= keep_first:
            raise ValueError(f"no repeated blocks found in the graph to scale (traced "
                             f"{len(layers)}, {keep_first} of them kept)")
        mid = run[len(run) // 2]
        inner = run[1:-1]  # the first and last blocks may differ (what feeds them)
        if any(s.key() != inner[0].key() for s in inner):
            raise ValueError("the traced blocks differ; trace the full depth instead")
        new = [self.segments[0], *kept] + [
            dataclasses.replace(mid, name=f"{mid.name}#{i}")
            for i in range(n_layers - keep_first)] + [self.segments[-1]]
        return dataclasses.replace(
            self, segments=new, n_layers=n_layers, graph=None, transfers={},
            cp_probe=self.cp_probe,  # (the traced graph's, run where cp is first priced)
            shared_weights={}, stage_saved={}, stage_shares={}, stage_wgrad={},
            note=f"traced {len(layers)} of {n_layers} repeated blocks; block '{mid.name}' "
                 f"stands for each of the {n_layers - keep_first}"
                 + (f" after the first {keep_first}" if keep_first else ""))


def storage_base(n):
    """The node whose value n is a view of (n itself if it is no view)."""
    while cost.is_view(n) and n.all_input_nodes and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n


def _storage(n):
    """(allocating node, element index or None) of the memory value n lives in; None for
    inputs (parameters, batch). An element of a multi-output op is its own storage, unless
    the op returns views (split, unbind: a fused q/k/v projection's pieces all keep its
    output alive, as the liveness simulation counts them)."""
    idx = None
    while n.op == "call_function" and cost.is_view(n) and isinstance(n.args[0], torch.fx.Node):
        src = n.args[0]
        if n.target is operator.getitem and isinstance(src.meta.get(ir.VAL), (tuple, list)) \
                and not cost.is_view(src):
            idx = n.args[1]
            n = src
            break
        n = src
    return (n, idx) if n.op == "call_function" else None


def saved_values(fwd) -> dict:
    """{(allocating node, element index or None): a forward node read by the backward} over
    the forward nodes `fwd`: the saved activations, one entry per storage (an element of a
    multi-output op is its own storage: dropout's mask, not its output)."""
    saved: dict = {}
    for n in fwd:
        if any(not _on_forward(u) for u in n.users):
            key = _storage(n)
            if key is not None:
                saved[key] = n
    return saved


def saved_bytes(key) -> int:
    """Bytes of a `saved_values` storage."""
    base, idx = key
    v = base.meta.get(ir.VAL)
    return cost.tensor_bytes(v[idx] if idx is not None else v)


def _is_param(n) -> bool:
    return n.op == "placeholder" and n.meta.get(ir.ROLE) in ("param", "buffer")


def _on_forward(n: torch.fx.Node) -> bool:
    """A forward op, or a collective a pass put in the forward (see forward_nodes)."""
    region = n.meta.get(ir.REGION)
    if region == ir.COMM:
        ins = [a for a in n.all_input_nodes if a.op == "call_function"]
        return bool(ins) and all(_on_forward(a) for a in ins)
    return region == ir.FORWARD and n.op == "call_function"


def forward_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's forward ops in order, with the collectives a pass put in the forward
    (REGION "comm", fed by forward values only: a row linear's all-reduce), so that what
    they read is not taken for a value the backward saves."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and _on_forward(n)]


def forward_segments(gm: torch.fx.GraphModule) -> dict[str, str]:
    """{forward node name: its segment}: the repeated block (layer_key) its module lies in,
    "pre" before the first block, "post" after."""
    out, seen_layer = {}, False
    for n in forward_nodes(gm):
        k = layer_key(n.meta.get(ir.MODULE, ""))
        seen_layer = seen_layer or k is not None
        out[n.name] = k or ("post" if seen_layer else "pre")
    return out


def analyze(gm: torch.fx.GraphModule, rows: int, roles: dict | None = None) -> GraphStats:
    """Segment statistics of a captured joint graph whose batch has `rows` rows. `roles`:
    the tensor_parallel pass's role of each linear weight (tensor_parallel.roles), which
    decide the split (a weight it does not name stays whole; None: every one, a graph
    nothing splits)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    fwd = forward_nodes(gm)
    on_fwd = set(fwd)
    bwd = [n for n in nodes if n not in on_fwd]

    # segments of forward nodes in execution order: pre, layers..., post
    names = forward_segments(gm)
    order: list[str] = ["pre"]
    seg_of: dict[torch.fx.Node, str] = {}
    module_seg: dict[str, str] = {}
    for n in fwd:
        seg = names[n.name]
        if seg not in order:
            order.append(seg)
        seg_of[n] = seg
        module_seg.setdefault(n.meta.get(ir.MODULE, ""), seg)
    if "post" in order:
        order.remove("post")
    order.append("post")
    segs = {s: Segment(s) for s in order}
    def match(k):
        """The segment of layer key k, if it is one (capture names forward and backward nodes
        and parameters by the same full paths from the user's model)."""
        return k if k in segs else None

    # a backward op outside the layers goes with the forward op autograd made it for (the
    # same seq_nr), or with its module; one a pass made in the root module (no seq_nr: a
    # vocab-parallel loss's) with the latest segment it reads from. By module alone a loss
    # computed in the root module went to "pre" with the root's first forward op
    # (positions, say): a cross-entropy's backward priced on the first stage and beside no
    # saved value.
    seq_seg = {}
    for n in fwd:
        seq_seg.setdefault(n.meta.get(ir.SEQ_NR), seg_of[n])
    seq_seg.pop(None, None)
    rank = {name: i for i, name in enumerate(order)}
    for b in bwd:
        m = b.meta.get(ir.MODULE, "")
        read = [seg_of[a] for a in b.all_input_nodes if a in seg_of]
        seg_of[b] = match(layer_key(m)) or seq_seg.get(b.meta.get(ir.SEQ_NR)) or \
            (module_seg.get(m) if m else None) or \
            (max(read, key=rank.__getitem__) if read else None) or module_seg.get(m) or "post"

    # weight-derived values (a weight's transpose/view) and the tp split
    roots: dict = {}  # weight-derived node (a weight's transpose/view) -> its parameters
    for n in nodes:
        ins = n.all_input_nodes
        if ins and all(_is_param(a) or a in roots for a in ins):
            roots[n] = [r for a in ins for r in ([a] if _is_param(a) else roots[a])]
    weightish = roots

    def _param_roots(ins):
        return [r for a in ins for r in ([a] if _is_param(a) else roots.get(a, []))]
    split: set = set()
    split_params: set = set()
    column_w: list = []  # (out features, the weight's parameter nodes) per column linear
    roles_found: dict = {}  # weight parameter node -> its role (GraphStats.tp_roles)
    split_work = set()  # split work whose result is whole (a partial sum, all-reduced)
    heads = None
    for n in fwd:
        ins = n.all_input_nodes
        w = [a for a in ins if _is_param(a) or a in weightish]
        data = [a for a in ins if a not in w]
        if n in weightish:
            continue
        if n.target in _MATMULS and w:
            base_w = [a for a in _param_roots(w)]
            role = next((roles[p.meta.get(ir.FQN)] for p in base_w
                         if p.meta.get(ir.FQN) in (roles or {})), "replicated")
            if role in ("replicated", "column+gather"):
                if role == "column+gather":  # 1/tp of the work, the output gathered whole
                    split_work.add(n)
                    split_params.update(base_w)
                    roles_found.update((p, role) for p in base_w if _val_dim(p) >= 2)
                    segs[seg_of[n]].tp_comm_f += cost.tensor_bytes(n.meta.get(ir.VAL))
                    segs[seg_of[n]].n_row += 1
                continue                               # (whole: its input gathered first)
            if role == "row":                          # row linear
                split_params.update(p for p in base_w if _val_dim(p) >= 2)
                roles_found.update((p, "row") for p in base_w if _val_dim(p) >= 2)
                segs[seg_of[n]].tp_comm_f += cost.tensor_bytes(n.meta.get(ir.VAL))
                segs[seg_of[n]].n_row += 1
            else:                                      # column linear: output split
                split.add(n)
                split_params.update(base_w)
                roles_found.update((p, "column") for p in base_w if _val_dim(p) >= 2)
                segs[seg_of[n]].tp_comm_b += sum(cost.tensor_bytes(a.meta.get(ir.VAL))
                                                 for a in data if a.op != "placeholder"
                                                 or a.meta.get(ir.ROLE) == "batch")
                segs[seg_of[n]].column_out.append(int(n.meta[ir.VAL].shape[-1]))
                column_w.append((int(n.meta[ir.VAL].shape[-1]), base_w))
        elif any(a in split for a in data) and n.meta.get(ir.VAL) is not None:
            split.add(n)
            v = n.meta[ir.VAL]
            if heads is None and n.target in (aten.view.default, aten._unsafe_view.default) \
                    and isinstance(v, torch.Tensor) and v.dim() == 4:
                heads = int(v.shape[2])                # (b, s, heads, head_dim)
    split_shapes = {tuple(n.meta[ir.VAL].shape) for n in split
                    if isinstance(n.meta.get(ir.VAL), torch.Tensor)}
    whole_shapes = {tuple(n.meta[ir.VAL].shape) for n in fwd if n not in split
                    and isinstance(n.meta.get(ir.VAL), torch.Tensor)}
    split_only = split_shapes - whole_shapes
    for b in bwd:
        v = b.meta.get(ir.VAL)
        reads_split = any(a in split for a in b.all_input_nodes)
        if isinstance(v, torch.Tensor) and tuple(v.shape) in split_only:
            split.add(b)
        elif reads_split and (isinstance(v, (tuple, list)) or b.target is operator.getitem
                              or (cost.is_view(b) and b.args[0] in split)):
            split.add(b)  # a multi-output op (attention backward) on split values, its parts
        elif reads_split and b.target in _MATMULS:
            split_work.add(b)

    for n in nodes:
        s = segs[seg_of[n]]
        f, (r, w) = cost.node_flops(n), cost.node_bytes(n)
        if f or n.meta.get(ir.REGION) == ir.COMM:  # priced by FLOPs (compute-bound); bytes
            r = w = 0  # price the FLOP-less (memory-bound) ops; collectives are priced apart
        is_f = n in on_fwd
        sp = n in split or n in split_work or (n.target in _MATMULS and any(
            p in split_params for p in _param_roots(n.all_input_nodes)))
        if is_f:
            s.flops_f += f
            s.bytes_f += r + w
            s.nodes_f += 1
            if sp:
                s.flops_f_split += f
                s.bytes_f_split += r + w
        else:
            s.flops_b += f
            s.bytes_b += r + w
            s.nodes_b += 1
            if sp:
                s.flops_b_split += f
                s.bytes_b_split += r + w

    saved = saved_values(fwd)
    for (base, idx), n in saved.items():
        b = saved_bytes((base, idx))
        segs[seg_of[base]].saved += b
        if base in split or n in split:
            segs[seg_of[base]].saved_split += b
    # values crossing from a segment to a later one (forward)
    pos = {s: i for i, s in enumerate(order)}
    for n in fwd:
        base = storage_base(n)
        if base is not n or base.op != "call_function":
            continue
        users = [u for u in n.users if u in on_fwd]
        later = [pos[seg_of[u]] for u in users if pos[seg_of[u]] > pos[seg_of[n]]]
        if later:
            for i in range(pos[seg_of[n]], max(later)):
                segs[order[i]].boundary += cost.tensor_bytes(n.meta.get(ir.VAL))
    # parameters: the segment of their first forward use
    elem = 4.0
    param_seg = {}
    for p in gm.graph.nodes:
        if p.op == "placeholder" and p.meta.get(ir.ROLE) == "param":
            users = [u for u in p.users if u in on_fwd]
            seg = match(layer_key(p.meta.get(ir.FQN, ""))) or (seg_of[users[0]] if users
                                                               else "pre")
            seg = seg if seg in segs else "pre"
            v = p.meta[ir.VAL]
            segs[seg].params += v.numel()
            segs[seg].largest_param = max(segs[seg].largest_param, v.numel())
            segs[seg].n_param_tensors += 1
            param_seg[p] = seg
            elem = v.element_size()
            if p in split_params:
                segs[seg].params_split += v.numel()

    # working memory per segment: the simulated live activations while its nodes run, less
    # the other segments' saved values alive then and all of its own (the memory model
    # prices it beside every saved value: measured against the values alive at that
    # moment, a loss's working memory after its own saved logits died was counted twice)
    tl = cost.simulate_liveness(gm, count_inputs=False)
    transient = max(0.0, tl.peak["activations"] - sum(s.saved for s in segs.values()))
    idx = {n: i for i, n in enumerate(gm.graph.nodes)}
    size = {k: cost.tensor_bytes(k[0].meta.get(ir.VAL)[k[1]] if k[1] is not None
                                 else k[0].meta.get(ir.VAL)) for k in saved}
    last = {k: idx[k[0]] for k in saved}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            k = _storage(a) if a.op == "call_function" else None
            if k in last:
                last[k] = max(last[k], idx[n])
    events: dict[int, list] = {}  # node index -> [(segment, bytes saved from / freed)]
    for k, b in size.items():
        events.setdefault(idx[k[0]], []).append((seg_of[k[0]], b))
        events.setdefault(last[k] + 1, []).append((seg_of[k[0]], -b))
    alive, own = 0.0, dict.fromkeys(order, 0.0)
    for n, i in idx.items():
        for s, b in events.get(i, ()):
            alive += b
            own[s] += b
        if n in seg_of:
            s = seg_of[n]
            segs[s].transient = max(segs[s].transient, tl.activations_during[i]
                                    - (alive - own[s]) - segs[s].saved)
    layers = [s for s in order if s not in ("pre", "post")]
    column_weights = [(out, param_seg[p], p.meta[ir.VAL].numel()) for out, ws in column_w
                      for p in dict.fromkeys(ws) if p in param_seg and _val_dim(p) >= 2]
    return GraphStats([segs[s] for s in order], rows, elem, transient, len(layers),
                      len(layers), heads=heads, column_weights=column_weights,
                      tp_roles={p.meta.get(ir.FQN, p.name): r for p, r in roles_found.items()},
                      node_segment={n.name: sg for n, sg in seg_of.items()},
                      last_grad=_last_grad(gm))


def _last_grad(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """(elements, parts) of the parameter gradient made last in the backward: a weight read
    twice, as a tied embedding and LM head, gets its gradient as a sum of one part per read
    (`graphs.grad_sum_trees`)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    made = [(p, g) for p, g in param_grads(gm) if g is not None]
    if not made:
        return (0, 1)
    p, g = max(made, key=lambda pg: order[pg[1]])
    parts = next((len(leaves) for root, _, leaves in grad_sum_trees(gm.graph) if root is g), 1)
    return p.meta[ir.VAL].numel(), parts


def _val_dim(n) -> int:
    v = n.meta.get(ir.VAL)
    return v.dim() if isinstance(v, torch.Tensor) else 0

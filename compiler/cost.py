"""Static cost analysis of a graph: FLOPs and bytes per node, and a liveness memory simulator.

FLOPs come from torch's own FlopCounterMode formulas (`torch.utils.flop_counter.flop_registry`),
applied to the fake values recorded in meta["val"], so a graph is costed without running it
and the numbers equal what FlopCounterMode reports for a real run (matmul-family ops count,
pointwise ops count 0 FLOPs there; they cost bytes, which we count separately). CPU flash
attention, which FlopCounterMode leaves at 0, gets torch's flash formulas (EXTRA_FLOP_FORMULAS).

The simulator replays the graph in its execution order the way the executor runs it: an op's
outputs are allocated while its inputs are still alive, and every value is freed right after
its last use (FX's generated code drops each variable at its last use). It works on storages,
not values: a view shares its base's storage and keeps it alive, so live bytes match what a
real run allocates (checked against `fxpar.runtime.memtrack` in the tests).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Iterable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from fxpar.compiler import ir

aten = torch.ops.aten


def _shape_wrapped(formula):
    """torch's registered formulas already take tensors; tell FlopCounterMode not to wrap."""
    def f(*args, **kwargs):
        return formula(*args, **kwargs)
    f._get_raw = True
    return f


# FlopCounterMode has no formula for CPU flash attention (it counts 0); we use torch's own
# flash-attention formulas for it. Pass as FlopCounterMode(custom_mapping=...) to compare.
EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _shape_wrapped(sdpa_flop),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _shape_wrapped(sdpa_backward_flop),
}
# ops whose schema says "new tensor" but whose result shares the input's storage
# (wait_tensor returns the very tensor its collective produced)
_ALIASING_NON_VIEWS = {aten._unsafe_view.default, torch.ops._c10d_functional.wait_tensor.default}
c10d = torch.ops._c10d_functional
# collectives that read their input asynchronously: it stays alive until their wait_tensor
# (an all-reduce runs in place on a buffer it owns, or copies at start)
ASYNC_INPUT_COLLECTIVES = {c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default}
COLLECTIVES = {c10d.all_reduce.default, *ASYNC_INPUT_COLLECTIVES}


def tensor_bytes(v) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(v)
               if isinstance(t, torch.Tensor))


def is_view(node: torch.fx.Node) -> bool:
    """True if the node's (every) tensor result aliases an input's storage."""
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        return True  # aliases an element of its tuple input
    if t in _ALIASING_NON_VIEWS:
        return True
    if isinstance(t, torch._ops.OpOverload):
        rets = t._schema.returns
        return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write
                                  for r in rets)
    return False


def _val(a):
    return a.meta.get(ir.VAL) if isinstance(a, torch.fx.Node) else a


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one node by FlopCounterMode's formula for its op (0 if it has none)."""
    if ir.FUSED_GROUP in node.meta:
        return node.meta[ir.FUSED_GROUP].get("flops", 0)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    packet = node.target.overloadpacket
    fn = flop_registry.get(packet) or EXTRA_FLOP_FORMULAS.get(packet)
    if fn is None:
        return 0
    args, kwargs = pytree.tree_map_only(torch.fx.Node, _val, (node.args, node.kwargs))
    return int(fn(*args, **kwargs, out_val=node.meta.get(ir.VAL)))


def node_bytes(node: torch.fx.Node) -> tuple[int, int]:
    """(bytes read, bytes written): tensor inputs once each, new outputs (views write 0)."""
    if node.op != "call_function":
        return 0, 0
    ins = {a for a in node.all_input_nodes}
    read = sum(tensor_bytes(a.meta.get(ir.VAL)) for a in ins if not is_view(node))
    written = 0 if is_view(node) else tensor_bytes(node.meta.get(ir.VAL))
    return read, written


@dataclasses.dataclass
class DeviceProfile:
    """Peak compute and memory bandwidth, for time estimates (a roofline per node), and the
    alpha-beta model of the link between ranks (alpha = latency per message step, seconds;
    link_bandwidth = bytes/s per direction).

    Rough defaults until the planner calibrates them (issue 8); only ratios matter to remat
    and to bucket sizing. CPU: gloo over loopback TCP (a small all-reduce measured nearer
    0.5 ms on a 2-core VM: to calibrate, issue 8); CUDA: NVLink within a node."""
    name: str
    flops: float       # FLOP/s (fp32)
    bandwidth: float   # bytes/s
    alpha: float = 50e-6
    link_bandwidth: float = 2e9

    @classmethod
    def for_device(cls, device) -> "DeviceProfile":
        device = torch.device(device)
        if device.type == "cuda":
            return cls("cuda", 400e12, 3.0e12, alpha=10e-6, link_bandwidth=150e9)
        return cls("cpu", 100e9, 20e9, alpha=50e-6, link_bandwidth=2e9)


def comm_time(target, nbytes: int, group_size: int, profile: DeviceProfile) -> float:
    """Alpha-beta time of one ring collective on `nbytes` (the full, unsharded buffer):
    all-reduce moves 2(n-1)/n of it in 2(n-1) steps, all-gather and reduce-scatter (n-1)/n
    in n-1 steps."""
    n = group_size
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if target is c10d.all_reduce.default else n - 1
    return steps * profile.alpha + steps / n * nbytes / profile.link_bandwidth


def node_time(node: torch.fx.Node, profile: DeviceProfile) -> float:
    """Roofline estimate: the slower of compute and memory traffic."""
    r, w = node_bytes(node)
    return max(node_flops(node) / profile.flops, (r + w) / profile.bandwidth)


def annotate(gm: torch.fx.GraphModule) -> None:
    """Set meta["cost"] = {"flops", "bytes_read", "bytes_written"} on every call node."""
    for n in gm.graph.nodes:
        if n.op == "call_function":
            r, w = node_bytes(n)
            n.meta[ir.COST] = {"flops": node_flops(n), "bytes_read": r, "bytes_written": w}


def total_flops(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(node_flops(n) for n in nodes)


# --- memory simulation ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Storage:
    path: tuple  # (producing node, index, index, ...) of one allocated tensor


CATEGORIES = ("params", "grads", "optimizer", "activations")


@dataclasses.dataclass
class MemoryTimeline:
    """Live bytes per category after every node (index = position in execution order).

    `peak[c]` is the peak of category c while a node runs (its inputs and outputs both live);
    `peak_total` the peak of the sum. params/optimizer are constant over the step; grads grow
    as the backward produces them; activations are everything else the step allocates
    (batch inputs included)."""
    nodes: list[str]
    live: dict[str, list[int]]
    peak: dict[str, int]
    peak_total: int
    peak_node: str

    @property
    def activation_peak(self) -> int:
        return self.peak["activations"]


def simulate(gm: torch.fx.GraphModule, *, optimizer_state_bytes: int = 0,
             count_inputs: bool = True) -> MemoryTimeline:
    """Live memory of one run of `gm` in graph order, freeing storages after their last use.

    optimizer_state_bytes: what the optimizer keeps per step (e.g. 2x params for Adam); it is
    not in the graph, so the caller says. count_inputs=False leaves batch placeholders out of
    activations (what a tracker that only sees allocations made by the run measures).
    """
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out_node = nodes[-1]
    n_grads = out_node.meta.get("n_grads", 0)
    out_args = list(pytree.tree_leaves(out_node.args[0]))
    grad_outs = {a for a in out_args[1:1 + n_grads] if isinstance(a, torch.fx.Node)}

    # storages each value keeps alive, as a tree mirroring its value: a view -> its base's; a
    # multi-output op allocates one storage per tensor leaf, keyed (node, i, j, ...), and a
    # getitem of it refers to that element's subtree
    size: dict[object, int] = {}
    owner: dict[object, torch.fx.Node] = {}

    def build(n, val, path):
        if isinstance(val, (tuple, list)):
            return tuple(build(n, v, (*path, i)) for i, v in enumerate(val))
        if isinstance(val, torch.Tensor) and tensor_bytes(val):
            key = _Storage(path)
            size[key], owner[key] = tensor_bytes(val), n
            return key
        return None

    tree: dict[torch.fx.Node, object] = {}
    for n in nodes:
        val = n.meta.get(ir.VAL)
        if n.op == "call_function" and n.target is operator.getitem:
            src = tree.get(n.args[0])
            tree[n] = src[n.args[1]] if isinstance(src, tuple) else src
        elif is_view(n) and n.all_input_nodes:
            base = n.args[0] if isinstance(n.args[0], torch.fx.Node) else n.all_input_nodes[0]
            tree[n] = tree.get(base)
        elif n.op != "output":
            tree[n] = build(n, val, (n,))
    keys = {n: [k for k in pytree.tree_leaves(t) if isinstance(k, _Storage)]
            for n, t in tree.items()}

    last = {k: index[owner[k]] for k in size}
    for n in nodes:
        reads = list(n.all_input_nodes)
        if n.target is c10d.wait_tensor.default and n.args[0].target in ASYNC_INPUT_COLLECTIVES:
            reads += n.args[0].all_input_nodes  # the collective reads its input until done
        for a in reads:
            for k in keys.get(a, []):
                last[k] = max(last[k], index[n])
    grad_storages = {k for a in grad_outs for k in keys.get(a, [])}

    def category(k):
        o = owner[k]
        if o.op == "placeholder":
            role = o.meta.get(ir.ROLE)
            if role in ("param", "buffer"):
                return "params"
            return "activations" if count_inputs else None
        if k in grad_storages:
            return "grads"
        return "activations"

    frees: dict[int, list] = {}
    for k, i in last.items():
        frees.setdefault(i, []).append(k)
    allocs: dict[int, list] = {}
    for k, o in owner.items():
        allocs.setdefault(index[o], []).append(k)
    cur = {c: 0 for c in CATEGORIES}
    cur["optimizer"] = optimizer_state_bytes
    live = {c: [] for c in CATEGORIES}
    peak = dict(cur)
    peak_total, peak_node = sum(cur.values()), ""
    for i, n in enumerate(nodes):
        for k in allocs.get(i, []):
            c = category(k)
            if c:
                cur[c] += size[k]
        tot = sum(cur.values())
        for c in CATEGORIES:
            peak[c] = max(peak[c], cur[c])
        if tot > peak_total:
            peak_total, peak_node = tot, n.name
        for k in frees.get(i, []):
            c = category(k)
            if c and owner[k].op != "placeholder" and i < len(nodes) - 1:
                cur[c] -= size[k]
        for c in CATEGORIES:
            live[c].append(cur[c])
    return MemoryTimeline([n.name for n in nodes], live, peak, peak_total, peak_node)

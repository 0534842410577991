"""Static cost analysis of a graph: FLOPs and bytes per node, and a liveness memory simulator.

FLOPs come from torch's own FlopCounterMode formulas (`torch.utils.flop_counter.flop_registry`),
applied to the fake values recorded in meta["val"], so a graph is costed without running it
and the numbers equal what FlopCounterMode reports for a real run (matmul-family ops count,
pointwise ops count 0 FLOPs there; they cost bytes, which we count separately). CPU flash
attention, which FlopCounterMode leaves at 0, gets torch's flash formulas (EXTRA_FLOP_FORMULAS).
A fused attention kernel under a causal mask counts the pairs it computes, (L+1)/2L of them
(`causal_share`; FlopCounterMode counts every query against every key).

The simulator replays the graph in its execution order the way the executor runs it: an op's
outputs are allocated while its inputs are still alive, and every value is freed right after
its last use (FX's generated code drops each variable at its last use). It works on storages,
not values: a view shares its base's storage and keeps it alive, so live bytes match what a
real run allocates (checked against `fxpar.runtime.memtrack` in the tests).
"""
from __future__ import annotations

import dataclasses
import operator
import os

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.operator_schemas import normalize_function
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from fxpar.core import context_attention  # noqa: F401  (registers fxpar::flash_attention)
from fxpar.core import experts, ir

aten = torch.ops.aten


def _shape_wrapped(formula):
    """torch's registered formulas already take tensors; tell FlopCounterMode not to wrap."""
    def f(*args, **kwargs):
        return formula(*args, **kwargs)
    f._get_raw = True
    return f


def _grouped_mm_flop(mat_a, mat_b, offs=None, *args, out_val=None, **kwargs) -> int:
    """aten._grouped_mm (the expert matmuls of Hugging Face MoE models): every output element
    is a dot product over its group's share of the contraction. 2-D x 3-D (offs groups a's
    rows) and 3-D x 2-D (b's columns): 2 M K N; 2-D x 2-D (offs groups the contraction,
    the weights' gradient): 2 M K N over the whole K; 3-D x 3-D: batched, 2 G M K N."""
    a, b = mat_a.shape, mat_b.shape
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    m = a[-2] if len(a) == 3 else a[0]
    return 2 * m * a[-1] * b[-1]


# FlopCounterMode has no formula for CPU flash attention (it counts 0) nor for grouped_mm;
# we use torch's own flash-attention formulas and the one above. Pass as
# FlopCounterMode(custom_mapping=...) to compare.
EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _shape_wrapped(sdpa_flop),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _shape_wrapped(sdpa_backward_flop),
}
if hasattr(aten, "_grouped_mm"):
    EXTRA_FLOP_FORMULAS[aten._grouped_mm] = _shape_wrapped(_grouped_mm_flop)
# CUDA's flash attention as the context-parallel pass carries it (its arguments and results:
# the CPU kernel's; core/context_attention.py)
EXTRA_FLOP_FORMULAS[torch.ops.fxpar.flash_attention] = _shape_wrapped(sdpa_flop)
EXTRA_FLOP_FORMULAS[torch.ops.fxpar.flash_attention_backward] = _shape_wrapped(sdpa_backward_flop)
# the fused attention kernels, forward and backward (their causal mask skips work)
_FUSED_ATTENTION = {getattr(aten, k + suffix) for k in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    for suffix in ("", "_backward") if hasattr(aten, k + suffix)} | {
    torch.ops.fxpar.flash_attention, torch.ops.fxpar.flash_attention_backward}
# ops whose schema says "new tensor" but whose result shares the input's storage
# (wait_tensor returns the very tensor its collective produced)
_ALIASING_NON_VIEWS = {aten._unsafe_view.default, torch.ops._c10d_functional.wait_tensor.default,
                       aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default,
                       aten.unsafe_chunk.default}
c10d = torch.ops._c10d_functional
# collectives that read their input asynchronously: it stays alive until their wait_tensor
# (an all-reduce runs in place on a buffer it owns, or copies at start)
# (expert parallelism's dispatch and combine too: all-to-alls whose splits are data)
ASYNC_INPUT_COLLECTIVES = {c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                           c10d.all_to_all_single.default, *experts.ASYNC}
COLLECTIVES = {c10d.all_reduce.default, *ASYNC_INPUT_COLLECTIVES}


def tensor_bytes(v) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(v)
               if isinstance(t, torch.Tensor))


def owned(x) -> bool:
    """Nothing but its one reader reads x's memory: x (or the chain of views it is of, each
    read once) was computed by the graph, not a graph input, so a collective may reduce it
    in place."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function" and len(x.users) == 1:
        if not is_view(x):
            return True
        x = x.args[0]
    return False


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
    flops = int(fn(*args, **kwargs, out_val=node.meta.get(ir.VAL)))
    if packet in _FUSED_ATTENTION:
        flops = int(flops * causal_share(node))
    return flops


def causal_share(node: torch.fx.Node) -> float:
    """The share of every query-key pair a fused attention kernel computes: (L+1) / 2L under
    its causal mask (the flash and memory-efficient kernels skip the blocks above the
    diagonal; FlopCounterMode's formula counts every pair), else 1."""
    a = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                           normalize_to_only_use_kwargs=True)
    if a is None or not a.kwargs.get("is_causal"):
        return 1.0
    q, k = _val(a.kwargs["query"]), _val(a.kwargs["key"])
    L = q.shape[-2]
    return (L + 1) / (2 * L) if L == k.shape[-2] and L > 0 else 1.0


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
    and to bucket sizing. CPU: gloo over loopback TCP; CUDA: NVLink within a node.
    `collective_alpha`: the fixed cost of one collective where it differs from a message's
    latency - on CPU a small gloo all-reduce measured ~0.5 ms on a 2-core VM (its threads
    share the cores with the compute), which gradient bucket sizing must see (at 50 us it
    cut 14 buckets and made fxpar dp=2 1.03-1.09x DDP; one 25 MiB bucket: 0.98x), while the
    pipeline cut keeps the 50 us point-to-point latency (0.5 ms there broke stage balance)."""
    name: str
    flops: float       # FLOP/s (fp32)
    bandwidth: float   # bytes/s
    alpha: float = 50e-6
    link_bandwidth: float = 2e9
    collective_alpha: float | None = None  # None: alpha

    def for_collectives(self) -> "DeviceProfile":
        """This profile with alpha = the per-collective cost (bucket sizing)."""
        if self.collective_alpha is None:
            return self
        return dataclasses.replace(self, alpha=self.collective_alpha, collective_alpha=None)

    @classmethod
    def for_device(cls, device) -> "DeviceProfile":
        device = torch.device(device)
        if device.type == "cuda":
            return cls("cuda", 400e12, 3.0e12, alpha=10e-6, link_bandwidth=150e9)
        return cls("cpu", 100e9, 20e9, alpha=50e-6, link_bandwidth=2e9,
                   collective_alpha=500e-6)


def min_bucket_bytes(profile: DeviceProfile) -> float:
    """Gradient buckets smaller than this are latency-bound: 4 alpha of bytes (a bucket's
    transfer then takes >= 80% of the time at link bandwidth)."""
    return 4 * profile.for_collectives().alpha * profile.link_bandwidth


def comm_time(target, nbytes: int, group_size: int, profile: DeviceProfile) -> float:
    """Alpha-beta time of one ring collective on `nbytes` (the full, unsharded buffer):
    all-reduce moves 2(n-1)/n of it in 2(n-1) steps, all-gather and reduce-scatter (n-1)/n
    in n-1 steps."""
    n = group_size
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if target is c10d.all_reduce.default else n - 1
    return steps * profile.alpha + steps / n * nbytes / profile.link_bandwidth


def ring_attention_time(kv_bytes: float, kernel_s: float, n: int, profile: DeviceProfile,
                        acc_bytes: float = 0.0, regather: bool = False) -> tuple[float, float]:
    """(ring, gather) seconds of one attention (or its backward) on a rank of a cp group of
    n: `kv_bytes` the whole sequence's keys and values, `kernel_s` the whole attention's
    kernel time (each rank runs 1/n of it). Gather: the keys and values all-gathered, then
    the rank's kernels; a backward (`acc_bytes` > 0) reduce-scatters their gradients after
    (and with `regather` all-gathers them again first). Ring: n steps, each one block's
    kernels beside the next block's transfer (kv/n point to point), the slower of the two,
    and an alpha more for the step's own launches and merge; a backward also passes each
    block's gradients on (`acc_bytes`: the whole sequence's, in their float32
    accumulators), the last hop after the last kernels."""
    own = kernel_s / n  # (the rank's queries against every key; a ring step: one block's)
    p2p = profile.alpha + kv_bytes / n / profile.link_bandwidth
    hop = profile.alpha + acc_bytes / n / profile.link_bandwidth if acc_bytes else 0.0
    ring = own / n + (n - 1) * (max(own / n, p2p + hop) + profile.alpha) + hop
    gather = own + comm_time(c10d.all_gather_into_tensor.default, kv_bytes, n, profile) * (
        regather if acc_bytes else 1)  # (a backward reads the forward's copy, or regathers)
    if acc_bytes:
        gather += comm_time(c10d.reduce_scatter_tensor.default, kv_bytes, n, profile)
    return ring, gather


def node_time(node: torch.fx.Node, profile: DeviceProfile) -> float:
    """Roofline estimate: the slower of compute and memory traffic."""
    r, w = node_bytes(node)
    return max(node_flops(node) / profile.flops, (r + w) / profile.bandwidth)


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
    during: list[int] = dataclasses.field(default_factory=list)  # total while each node runs
    # activations while each node runs (its inputs and outputs both live)
    activations_during: list[int] = dataclasses.field(default_factory=list)

    @property
    def activation_peak(self) -> int:
        return self.peak["activations"]


def simulate_liveness(gm: torch.fx.GraphModule, *, optimizer_state_bytes: int = 0,
             count_inputs: bool = True) -> MemoryTimeline:
    """Live memory of one run of `gm` in graph order, freeing storages after their last use.

    optimizer_state_bytes: what the optimizer keeps per step (e.g. 2x params for Adam); it is
    not in the graph, so the caller says. count_inputs=False leaves batch placeholders out of
    activations (what a tracker that only sees allocations made by the run measures).
    """
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out_node = nodes[-1]
    n_grads = out_node.meta.get(ir.N_GRADS, 0)
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
    during, acts_during = [], []
    for i, n in enumerate(nodes):
        for k in allocs.get(i, []):
            c = category(k)
            if c:
                cur[c] += size[k]
        tot = sum(cur.values())
        during.append(tot)
        acts_during.append(cur["activations"])
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
    return MemoryTimeline([n.name for n in nodes], live, peak, peak_total, peak_node, during,
                          acts_during)


# --- calibrated hardware model (the planner's; the passes above keep DeviceProfile) ---------

@dataclasses.dataclass(frozen=True)
class Link:
    """alpha-beta model of one link class: alpha = seconds per message step, bandwidth =
    bytes/s per direction per device, as collectives reach it."""
    alpha: float
    bandwidth: float


@dataclasses.dataclass
class Hardware:
    """What the planner prices a plan against: one device's compute and memory, and the links
    between devices (intra-node, inter-node).

    peak_flops: dense FLOP/s per compute dtype from the data sheet (CPU: measured matmul rate);
    matmul_efficiency: the fraction of peak large GEMMs reach in practice (cuBLAS reaches about
    80% of the A100/H100 dense peak on the large matmuls of a GPT layer; the CPU number is
    measured, so 1.0); node_overhead: seconds per executed graph node (the Python/dispatcher
    cost of launching one op: dominant for the small CPU models; about 20 us per node of
    fxpar's executor on the H100 machine's host, where a GPT-2-small bf16 step was bound by
    it); step_overhead: seconds per step outside the graphs (the runtime's own bookkeeping);
    async_launch: the host enqueues kernels while the device runs earlier ones (CUDA
    streams), so a stretch of graph costs the larger of its device time and its host dispatch
    time, not their sum (on CPU the same thread does both)."""
    name: str
    peak_flops: dict
    mem_bandwidth: float
    memory: int
    intra: Link
    inter: Link
    devices_per_node: int = 8
    matmul_efficiency: float = 0.8
    node_overhead: float = 2e-5
    step_overhead: float = 0.0
    calibrated: str = "data sheet"
    optimizer_s: float | None = None  # measured optimizer step over all parameters (CPU)
    # measured per collective: {(kind, group size): (seconds per call, seconds per byte of
    # the full buffer)} (runtime/comm.measure_collectives); kinds the table lacks use the ring model
    collectives: dict | None = None
    # fraction of the gradient communication that hides behind the backward: NCCL runs on
    # its own stream (1.0); gloo ranks sharing a few CPU cores measured none (0.0)
    overlap: float = 1.0
    # cores per rank where CPU ranks oversubscribe them (< 1): a waiting rank's core goes to
    # the others (planner._on_shared_cores)
    core_share: float = 1.0
    # how much faster one rank computes while the others wait than with every rank busy
    # (CPU ranks share memory bandwidth and clocks; measured at start-up): the stage times
    # are priced busy, and a pipeline's bubbles leave ranks alone (planner._alone_share)
    alone_speedup: float = 1.0
    # how many times its roofline (the matmul rate and copy bandwidth above) the model's own
    # ops took, measured on its graph at start-up less the dispatch per node (CPU: 1.2-3x;
    # small or odd-shaped matmuls, gathers, scatters and sorts run below those rates): the
    # graph's segments are priced at this multiple, so the work scales with the rows and
    # the tp split of the ops it belongs to (planner.fit_to_timing)
    roofline_scale: float = 1.0
    async_launch: bool = True
    # Plan.offload_optimizer: bytes/s of a pinned copy between device and host memory (0:
    # the device is the host: a copy at mem_bandwidth), and the node's host memory bandwidth
    # (its ranks' CPU optimizer steps share it)
    host_link: float = 0.0
    host_bandwidth: float = 0.0
    # the relative resolution of a predicted step time: plans predicted this close are a tie,
    # which the planner breaks by simplicity (data sheet: 2%; CPU: the spread of the
    # start-up timing's repetitions, 3-5%)
    noise: float = 0.02

    def flops(self, precision: str) -> float:
        return self.peak_flops.get(precision, self.peak_flops["fp32"])

    def comm(self, kind: str, nbytes: float, n: int, span: int, calls: int = 1) -> float:
        """Seconds of `calls` collectives of `kind` ("all_reduce", "all_gather",
        "reduce_scatter", "all_to_all", "p2p") moving `nbytes` in all over a group of n ranks
        that spans `span` consecutive ranks: the measured table where it has the entry, else
        the ring alpha-beta model of the link the group crosses."""
        if calls <= 0 or (n <= 1 and kind != "p2p"):
            return 0.0
        known = (self.collectives or {}).get((kind, 2 if kind == "p2p" else n))
        if known:
            return calls * known[0] + nbytes * known[1]
        link = self.link(span)
        one = collective_time(kind, nbytes, n, link)
        steps = 1 if kind in ("p2p", "all_to_all") else (
            2 * (n - 1) if kind == "all_reduce" else n - 1)
        return one + (calls - 1) * steps * link.alpha

    def link(self, span: int) -> Link:
        """The bottleneck link of a group whose members lie `span` consecutive ranks apart at
        most (ranks fill a node before the next)."""
        return self.intra if span <= self.devices_per_node else self.inter


GiB = 2 ** 30
# Data sheets (SXM parts, dense tensor-core rates; fp32 = the TF32 tensor-core rate, which
# torch uses for fp32 matmuls when allowed), with bandwidths as they are reached rather than
# as printed: HBM (A100-80GB 2.039 TB/s, H100 3.35, H200 4.8) at 85%, what streaming kernels
# reach (STREAM-style copies measure 85-90%); NVLink (A100 600 GB/s, H100/H200 900 GB/s total
# = half each way) at 80%, the bus bandwidth NCCL's all-reduce reaches inside an 8-GPU
# NVSwitch node; one HDR (200 Gb/s, A100 / Selene) or NDR (400 Gb/s, H100/H200) InfiniBand
# NIC per GPU at 90%. Latencies: NCCL's ~10 us per ring step in a node, ~20 us across.
# Host side (Plan.offload_optimizer): PCIe Gen4 x16 (A100, 32 GB/s each way) or Gen5 x16
# (H100/H200, 64 GB/s) at 80%, what pinned copies reach; host memory: a DGX's two sockets
# (A100: 2 x 205 GB/s DDR4, H100: 2 x 307 GB/s DDR5) at 70%.
HBM_REACHED, NVLINK_REACHED, IB_REACHED = 0.85, 0.8, 0.9
PCIE_REACHED, HOST_MEM_REACHED = 0.8, 0.7
HARDWARE = {
    "a100": Hardware("A100-80GB-SXM", {"fp32": 156e12, "bf16": 312e12, "fp16": 312e12},
                     2.039e12 * HBM_REACHED, 80 * GiB, Link(10e-6, 300e9 * NVLINK_REACHED),
                     Link(20e-6, 25e9 * IB_REACHED), host_link=32e9 * PCIE_REACHED,
                     host_bandwidth=2 * 205e9 * HOST_MEM_REACHED),
    "h100": Hardware("H100-SXM", {"fp32": 495e12, "bf16": 989e12, "fp16": 989e12},
                     3.35e12 * HBM_REACHED, 80 * GiB, Link(8e-6, 450e9 * NVLINK_REACHED),
                     Link(15e-6, 50e9 * IB_REACHED), host_link=64e9 * PCIE_REACHED,
                     host_bandwidth=2 * 307e9 * HOST_MEM_REACHED),
    "h200": Hardware("H200-SXM", {"fp32": 495e12, "bf16": 989e12, "fp16": 989e12},
                     4.8e12 * HBM_REACHED, 141 * GiB, Link(8e-6, 450e9 * NVLINK_REACHED),
                     Link(15e-6, 50e9 * IB_REACHED), host_link=64e9 * PCIE_REACHED,
                     host_bandwidth=2 * 307e9 * HOST_MEM_REACHED),
}
# fp32 matmuls without TF32 (torch's default, float32_matmul_precision "highest") run on
# the CUDA cores: the data sheets' FP32 rate. On an H100 eager fp32 GPT-2-small steps ran at
# ~44 TFLOP/s, two thirds of this, where the TF32 figure would predict them 4x too fast.
FP32_WITHOUT_TF32 = {"a100": 19.5e12, "h100": 67e12, "h200": 67e12}


def gpu_hardware(device) -> Hardware:
    """The data-sheet profile of this CUDA device (matched by name; an unknown GPU is priced
    as an H100), its fp32 rate as torch will run fp32 matmuls (TF32 only where
    torch.get_float32_matmul_precision() allows it) and its memory as the driver reports it."""
    name = torch.cuda.get_device_name(device).lower()
    key = next((k for k in HARDWARE if k in name), "h100")
    hw = dataclasses.replace(HARDWARE[key], peak_flops=dict(HARDWARE[key].peak_flops))
    if torch.get_float32_matmul_precision() == "highest":
        hw.peak_flops["fp32"] = FP32_WITHOUT_TF32[key]
        hw.calibrated += "; fp32 matmuls without TF32"
    hw.memory = torch.cuda.get_device_properties(device).total_memory
    return hw


@dataclasses.dataclass(frozen=True)
class KernelPrice:
    """What one fused kernel costs against the ops it replaces, on one device (the fusion
    pass asks before swapping in a single op's kernel). Host: seconds to dispatch one ATen
    op from the executor and to launch one hand-written Triton kernel (its wrapper binds
    arguments in Python: on an H100's host a launch of fxpar's since-removed generated
    kernels cost more than the ATen ops they replaced, and that fused bf16 GPT-2 step was
    1.3x the unfused one). Device: bytes / bandwidth, at least the shortest kernel. Host and device overlap (async launches), so a stretch costs the larger;
    `replayed` (a CUDA graph replays the launches): the host cost is gone."""
    aten_launch_s: float
    triton_launch_s: float
    bandwidth: float
    kernel_min_s: float = 3e-6
    replayed: bool = False

    def pays(self, n_nodes: int, op_bytes: list[int], fused_bytes: int) -> bool:
        """Does one kernel moving `fused_bytes` beat `n_nodes` dispatched nodes whose
        non-view ops move `op_bytes`? Ties fuse (the kernels are measured no slower per
        byte: docs/benchmarks.md)."""
        dev_unfused = sum(max(b / self.bandwidth, self.kernel_min_s) for b in op_bytes)
        dev_fused = max(fused_bytes / self.bandwidth, self.kernel_min_s)
        if self.replayed:
            return dev_fused <= dev_unfused
        return max(self.triton_launch_s, dev_fused) <= max(n_nodes * self.aten_launch_s,
                                                           dev_unfused)


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Ring algorithms' alpha-beta time on `nbytes` (the full, unsharded buffer):
    all_reduce 2(n-1) steps moving 2(n-1)/n of it; all_gather / reduce_scatter n-1 steps,
    (n-1)/n; all_to_all (`nbytes` each rank's: its parts to every peer at once, as NCCL's
    grouped sends go) one step's latency and (n-1)/n of them; p2p one message of nbytes."""
    if kind == "p2p":
        return link.alpha + nbytes / link.bandwidth
    if n <= 1:
        return 0.0
    if kind == "all_to_all":
        return link.alpha + (n - 1) / n * nbytes / link.bandwidth
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}[kind]
    return steps * link.alpha + steps / n * nbytes / link.bandwidth


_CPU_CACHE: dict = {}


def cpu_hardware(link: Link | None = None) -> Hardware:
    """This CPU, measured once per process in well under a second: fp32 matmul FLOP/s (a
    512x512 matmul), memory bandwidth (copying 32 MiB) and the cost of dispatching one small
    op (what every graph node pays in the executor). `link`: gloo's alpha-beta
    (`link_from_table` of runtime/comm.measure_collectives) when a process group exists;
    else loopback defaults measured on a 2-core VM (0.25 ms per step, 1 GB/s)."""
    import time
    if "hw" not in _CPU_CACHE:
        torch.manual_seed(0)
        a, b = torch.randn(512, 512), torch.randn(512, 512)

        def rate(fn, work, budget=0.15):
            fn()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < budget:
                fn()
                n += 1
            return work * n / (time.perf_counter() - t0)
        mm = rate(lambda: torch.mm(a, b), 2 * 512 ** 3)
        src = torch.empty(8 * 2 ** 20)
        dst = torch.empty_like(src)
        bw = rate(lambda: dst.copy_(src), 2 * src.numel() * 4)
        x = torch.ones(4)
        per_op = 1 / rate(lambda: [x.add(1) for _ in range(100)], 100, 0.1)
        threads = torch.get_num_threads()
        _CPU_CACHE["hw"] = (mm, bw, per_op, threads)
    mm, bw, per_op, threads = _CPU_CACHE["hw"]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware("cpu", {"fp32": mm, "bf16": mm / 4, "fp16": mm / 8}, bw, ram,
                    link or Link(250e-6, 1e9), link or Link(250e-6, 1e9),
                    devices_per_node=1 << 30, matmul_efficiency=1.0, node_overhead=per_op,
                    calibrated=f"measured ({threads} threads)",
                    async_launch=False, noise=0.05)


def link_from_table(table: dict, n: int) -> Link | None:
    """The ring alpha-beta link that reproduces the table's measured n-rank all-reduce (what
    prices the collectives the table lacks); None if it was not measured."""
    known = table.get(("all_reduce", n))
    if not known:
        return None
    steps = 2 * (n - 1)
    latency, per_byte = known
    return Link(latency / steps, steps / (n * per_byte) if per_byte > 0 else float("inf"))


def device_memory(device: torch.device) -> int:
    """Bytes one rank may use: FXPAR_MEMORY_PER_DEVICE (GiB) where set -- a GPU shared with
    other work, a budget to plan for -- else the GPU's memory, or this host's RAM shared by
    its local ranks."""
    limit = os.environ.get("FXPAR_MEMORY_PER_DEVICE", "").strip()
    if limit:
        try:
            gib = float(limit)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ValueError(f"FXPAR_MEMORY_PER_DEVICE={limit!r}: give the memory one device "
                             "may use in GiB, a positive number (e.g. 40 or 0.5)")
        return int(gib * 2 ** 30)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return ram // max(local, 1)

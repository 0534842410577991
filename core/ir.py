"""Names shared by capture, passes and runtime: node.meta keys and the Program.

Passes talk to each other only through the graph and these meta keys; the runtime only
through `Program`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.fx

from fxpar.core.errors import BatchError

# ops that only reshape or alias a tensor (same elements, same storage): passes look through them
RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                      torch.ops.aten.reshape.default, torch.ops.aten.alias.default})

# the op namespaces of collectives, their waits and DTensor's redistributions: an op from one
# communicates (fxpar's own namespace holds both communicating ops and local kernels)
COMMUNICATION_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})

def fused_pieces(pieces) -> bool:
    """A tp layout's pieces (Program.tp_layouts) name fused pieces stored interleaved: k > 1
    equal ones, or their sizes."""
    return isinstance(pieces, (tuple, list)) or pieces > 1


# node.meta keys (docs/design.md section 3)
VAL = "val"              # fake tensor: shape, dtype, device
REGION = "region"        # "forward" | "backward" | "optimizer" | "comm"
MODULE = "module"        # source module path, e.g. "transformer.h.3.mlp.c_fc"
RECOMPUTE = "recompute"  # set by remat
STAGE = "stage"          # set by pipeline_split
SHARD = "shard"          # placements of the value, tuple of Placement (one per mesh dim)
LOSS_REDUCTION = "loss_reduction"  # core/mean_loss: the node sums a mean loss over ranks
FUSED_GROUP = "fused_group"
PHASE = "pipe_phase"    # set by pipeline_split: "F" | "B" | "I" | "W" (part of a stage), "R"
#                         (run once a step, after the last microbatch: a shared weight's
#                         gradient sum; the dp pass's reduction joins it)
PHASES = ("F", "B", "I", "W", "R")  # a stage's parts, in the order they run
TRANSFER = "transfer"    # set by pipeline_split on stage-boundary nodes: (src stage, dst stage)
VOCAB_SHARD = "vocab_shard"  # set by tensor_parallel on a vocab-split table's lookup backward
BUCKET = "bucket"        # set by data_parallel on gradient-reduction nodes (packing, collective)
PACK = "pack"            # set by data_parallel on what makes an all-gather's input from the
#                          shards (their copy into one input, their quantization)
CODEGEN_RUN = "codegen_run"  # set on pm.stage_graphs["codegen"]: the Inductor run a node went into
OWNED = "owned"          # set by codegen on an all-reduce / reduce-scatter: nothing else reads its input
ROLE = "role"            # placeholder/output role: "param" | "buffer" | "batch" | "loss" | "grad" | "buffer_update"
FQN = "fqn"              # set by capture on placeholders: the parameter's or buffer's name, or
#                          "batch[i]" for the i-th batch leaf
N_GRADS = "n_grads"      # set by capture on the output node: how many gradients follow the loss
#                          (data_parallel rewrites it when it regroups them)
SEQ_NR = "seq_nr"        # torch's (from tracing): the autograd sequence number tying a backward
#                          op to the forward op it differentiates
MOVED = "moved"          # set by overlap on a start or wait it moved: how far (for pictures)
COUNTER_DTYPE = "dtype"  # set by data_parallel on the microbatch loss counter (LOSS_COUNT): the
#                          dtype of the loss's share
DYNAMIC_ROWS = "dynamic_rows"  # set by expert_parallel on the nodes between an all-to-all
#                          dispatch and its combine: their rows are as many as the rank
#                          receives (meta["val"]: the most it can), run op by op
EP_TOKENS = "ep_tokens"  # set by expert_parallel on the all-to-alls of experts that run every
#                          token: (the dim of their input holding each dp rank's own tokens,
#                          "send" | "return"); data_parallel's sharding keeps that dim split

FORWARD, BACKWARD, OPTIMIZER, COMM = "forward", "backward", "optimizer", "comm"


def ancestors(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """`nodes` and every node they read, transitively."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def first_phase(users) -> str | None:
    """The pipeline part (PHASE) of the first of `users` to run: where a value made for them
    belongs (None outside a pipeline)."""
    return min((u.meta[PHASE] for u in users if PHASE in u.meta), key=PHASES.index,
               default=None)


def layer_of(module_path: str) -> str:
    """The layer a module belongs to: its path up to the first numeric index
    (`transformer.h.3.mlp.c_fc` -> `transformer.h.3`); a module outside the repeated blocks
    is its own layer."""
    parts = module_path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return module_path

# What a pass decides that the Program carries: graph-module meta keys (gm.meta), written
# by the pass named, read by compiler/compile.py into the Program. The context a pass
# receives (compiler/pass_manager.PassContext) is read-only input.
BATCH_SHARD_DIMS = "batch_shard_dims"  # data_parallel: per batch leaf, the dim split over dp
ZERO_BUCKETS = "zero_buckets"          # data_parallel (ZeRO): parameter indices per bucket
PARAMS_SHARDED = "params_sharded"      # data_parallel (ZeRO-3): parameter inputs are shards
TP_LAYOUTS = "tp_layouts"              # tensor_parallel: per parameter, None or a layout
EXPERT_PARAMS = "expert_params"        # expert_parallel: indices of the parameters split over
#                                        the ep group along dim 0 (each rank its experts)
EXPERT_SLOTS = "expert_slots"          # expert_parallel: nn.ModuleList experts, per slot
#                                        parameter [its index on ep rank 0, 1, ...]: the
#                                        user's parameter it holds there (the graph reads
#                                        the first; the others are held as slots elsewhere)
SEQUENCE_SPLIT = "sequence_split"      # context_parallel: per batch leaf, the dim split over
#                                        the cp group in the graph (None: whole on every rank)
LOSS_SCALE = "loss_scale"              # precision (fp16): the last batch input is the scale
LOSS_COUNT = "loss_count"              # data_parallel (microbatches): the target counter
# written by the pass manager (compiler/pass_manager.run_passes):
PASS_TIMES = "pass_times"              # [(pass name, seconds, call nodes after it)], first
#                                        ("verify capture", ...): the captured graph checked
FUSION_SKIPPED = "fusion_skipped"      # Plan.fuse but the device cannot run Triton: why
# each pass's report of what it decided (gm.meta), for pictures, tests and the plan report
PRECISION_REPORT = "precision"         # precision: what was cast, kept, scaled
REMAT_REPORT = "remat"                 # remat: what is saved and what recomputed
PIPELINE = "pipeline"                  # pipeline_split: the stages and their parts
TP_REPORT = "tensor_parallel"          # tensor_parallel: each weight's role, the collectives
CP_REPORT = "context_parallel"         # context_parallel: the split leaves, attention, comms
EP_REPORT = "expert_parallel"          # expert_parallel: each MoE layer, its experts and rows
GROUPED_EXPERTS = "grouped_experts"    # grouped_experts: each list of experts, grouped or why not
BATCHED_EXPERTS = "batched_experts"    # batched_experts: each layer of per-row picks, grouped or why
OVERLAP_REPORT = "overlap"             # overlap: what moved and what limited it
FUSION_REPORT = "fusion"               # fusion: the fused groups and the unpaid ones

# what capture leaves on the graph: the keys every pass may require
CAPTURED = frozenset({VAL, REGION, MODULE, ROLE, FQN, N_GRADS, SEQ_NR})


@dataclasses.dataclass(frozen=True)
class PassContract:
    """A pass's declaration, next to its `run(gm, options, ctx) -> gm` (as torch.fx's
    PassBase requires/ensures): the keys of this module it requires on the graph (from
    capture or an earlier pass), reads where present (so it runs after their provider when
    both run) and provides, the passes it must precede or follow for a reason no key names,
    whether a plan runs it at all, and its
    options - a frozen dataclass of the Plan fields it reads (core/plan.pass_options). The
    pass manager orders the passes and checks the keys from these alone (and asks `finds`,
    where given, whether the graph has anything for the pass)."""
    name: str
    options: type
    requires: frozenset = frozenset()
    reads: frozenset = frozenset()
    provides: frozenset = frozenset()
    before: frozenset = frozenset()
    after: frozenset = frozenset()
    applies: Callable[[Any], bool] = lambda options: True  # whether the plan runs it at all
    # a cheap look at the graph: whether the pass has anything to do on it (None: always);
    # a pass with nothing to do is skipped (no run, no snapshot)
    finds: Callable[[Any], bool] | None = None
    # every meta["val"] is what the graph computes when its run ends (it re-propagated them
    # itself, or it only reorders nodes): the pass manager's check after it would compare
    # them with themselves (a fake run of the whole graph), so it is skipped
    values_fresh: bool = False


# Symbolic process-group names the compiler writes into collectives (a Program is compiled
# without a process group); the runtime binds them to its groups (runtime/comm.bind_groups).
# Plan.dp_shard (HSDP) splits the dp ranks into shard groups ("dp_shard": ZeRO's
# reduce-scatters and gathers) and the groups across them ("dp_rep": a shard's all-reduce);
# "dp" stays the whole dp group (the batch's split: the loss, batch statistics).
# Plan.ep splits the dp ranks into expert groups of ep neighbouring ranks ("ep": an MoE
# layer's experts split over it) and the groups across them ("edp"); with HSDP too, each
# shard group's ranks holding the same experts form "edp_shard" (ZeRO's group for expert
# weights; "dp_rep" then sums their shards across the replicas).
# Plan.cp likewise: groups of cp neighbouring dp ranks split the sequence ("cp"), the groups
# across them split the batch's rows ("cdp"); "dp" stays the gradients' group.
GROUPS = {"dp": "fxpar.dp", "tp": "fxpar.tp", "pp": "fxpar.pp",
          "dp_shard": "fxpar.dp_shard", "dp_rep": "fxpar.dp_rep",
          "ep": "fxpar.ep", "edp": "fxpar.edp", "edp_shard": "fxpar.edp_shard",
          "cp": "fxpar.cp", "cdp": "fxpar.cdp"}


@dataclasses.dataclass
class GraphSignature:
    """Which placeholders/outputs of the joint graph are what.

    Placeholders: params (in `param_names` order), buffers, then batch leaves.
    Outputs: (loss, *grads in param order, *updated buffers in `mutated_buffers` order).
    """
    param_names: list[str]
    buffer_names: list[str]
    batch_spec: Any                 # pytree spec of the batch
    batch_leaf_meta: list[Any]      # per leaf: (shape, dtype) for tensors, the value otherwise
    mutated_buffers: list[str]

    @property
    def num_params(self) -> int:
        return len(self.param_names)


# the pipeline section of a Program: its graph cut into parts per (phase, stage)
# (compiler/stages.split makes it)
@dataclasses.dataclass
class Part:
    key: str                          # "F0", "B1", "I1", "W1", "R1"
    stage: int
    phase: str
    graph: torch.fx.GraphModule
    inputs: list[tuple[str, object]]  # ("param", i) | ("buffer", i) | ("batch", i) | ("value", name)
    outputs: list[str]                # value names, in the graph's output order


@dataclasses.dataclass
class PipelineProgram:
    n_stages: int
    parts: dict[str, Part]
    producer: dict[str, str]                # value name -> part key
    consumers: dict[str, list[str]]         # value name -> part keys reading it
    loss: str                               # value name of the (microbatch) loss
    grads: list[str | None]                 # per parameter: value name of its gradient
    buffer_updates: list[str]               # per mutated buffer
    param_stages: dict[int, set[int]]       # parameter index -> stages that read it
    buffer_stages: dict[int, set[int]]

    def keys_of_stage(self, stage: int) -> list[str]:
        return [k for k, p in self.parts.items() if p.stage == stage]


@dataclasses.dataclass(frozen=True)
class Program:
    """What the runtime executes on one rank: a value, complete when compile returns it (a
    runtime binds its own copy to its process groups: runtime/comm.bind_groups).

    `graph` takes (params, buffers, local batch leaves) and returns
    (loss, grads, updated buffers) with every collective as an explicit node.
    `batch_shard_dims[i]` is the dim along which batch leaf i is split over the dp group
    (None = replicated), `rows` ways (dp, or dp/cp: context parallelism's cp ranks take the same
    rows and split their sequences in the graph); the fields below say how parameters, gradients
    and the batch are sharded (ZeRO, tp) and how the step is cut (pipeline).
    """
    graph: torch.fx.GraphModule
    signature: GraphSignature
    dp: int
    batch_shard_dims: list[int | None]
    cp: int = 1
    # ZeRO (stage 1/2, dp > 1): the gradient outputs are one flat shard per bucket instead of
    # one tensor per parameter; bucket k holds the parameters zero_buckets[k] (indices into
    # signature.param_names) flattened in that order, padded to a multiple of dp, and this
    # rank owns the k-th 1/dp slice. Parameters with no gradient are in no bucket.
    zero: int = 0
    zero_buckets: list[list[int]] = dataclasses.field(default_factory=list)
    # ZeRO-3: every parameter input is this rank's slice of the flat, padded parameter
    params_sharded: bool = False
    # Pipeline (pp > 1 or microbatches > 1): the graph cut into parts per (phase, stage)
    # (PipelineProgram), run per microbatch in the order of `schedule`
    # (core/schedules.py) over the pp group; `graph` is then the whole joint graph, for
    # pictures only. Batch leaves are split into `microbatches` along dim 0 first.
    pipeline: Any = None
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    offload: bool = False  # Plan.offload: waiting microbatches' saved values to host memory
    # Tensor parallelism (tp > 1): per parameter None (whole) or a layout (shard_dim,
    # interleave_dim, pieces) saying which slice of the user's weight this tp rank's program
    # reads (runtime/tp_slices.py; pieces: 1, k equal fused pieces, or the fused pieces'
    # sizes); gradient outputs are placed the same way.
    tp: int = 1
    tp_layouts: list = dataclasses.field(default_factory=list)
    # Expert parallelism (ep > 1): the parameters expert_params (indices) are split along
    # dim 0 (the experts) over the ep group, this rank's contiguous E/ep of them; their
    # gradient outputs likewise.
    ep: int = 1
    expert_params: list = dataclasses.field(default_factory=list)
    # nn.ModuleList experts under ep: per slot parameter, [the index of the user's parameter
    # it holds on ep rank 0, 1, ...] (the first is the slot's own index: the graph reads it;
    # the others are not read, held by their ranks as slots; their gradients are None).
    expert_slots: list = dataclasses.field(default_factory=list)
    # Mixed precision (passes/precision.py): fp16's graph takes one more batch input after
    # the batch leaves, the 0-dim fp32 loss scale (runtime/amp.GradScaler feeds it).
    loss_scale: bool = False
    # Microbatches with a mean cross-entropy (passes/data_parallel.py): a program counting a
    # microbatch's targets; the graph takes the step's count / microbatches as its last
    # batch input (after the loss scale), so the m microbatch means average to the batch mean.
    loss_count: Any = None
    # What compile knew and did: the resolved plan, the planner's report (plan="auto"), the
    # graph after each pass ({pass: {role: GraphModule}}, for pictures), the compile times
    # [(phase, seconds, call nodes or None)], adding up to compile's (in a ParallelModel:
    # parallelize's) wall time with a last row "other", why Plan.fuse fused nothing (if so), and evaluate()'s
    # forward-only program, built on first use by the compiler that made this one.
    plan: Any = None
    plan_report: Any = None
    stage_graphs: Mapping = dataclasses.field(default_factory=dict)  # (loaded: read-only)
    compile_times: list = dataclasses.field(default_factory=list)
    fusion_skipped: str | None = None
    # Plan.codegen resolved: "inductor" (the runtime compiles each graph it runs with
    # compiler/codegen.generate) or "eager", and why not Inductor (None when it is)
    codegen: str = "eager"
    codegen_why: str | None = None
    build_eval: Any = None
    # Plan.grad_compression and a synchronous Plan.ps worker: `graph` without the gradient
    # buckets' all-reduces (each rank's gradient outputs its own Partial sums; run once the
    # compression starts); an asynchronous Plan.ps worker: the graph of one dp share of the
    # batch alone, without any collective (its gradients the means over that share)
    local_graph: torch.fx.GraphModule | None = None
    # {symbolic group: process group name} on a runtime's bound copy (runtime/comm.bind_groups)
    bound_groups: dict | None = None

    @property
    def rows(self) -> int:
        """How many ways the batch's rows split: dp, or dp/cp under context parallelism."""
        return self.dp // self.cp


# --- the batch, as the compiled graph takes it (compile and runtime alike) ---------------

def flatten_batch(batch: Any, signature: GraphSignature,
                  local: tuple[list, int] | None = None) -> list[torch.Tensor]:
    """Batch -> its tensor leaves, checking it has the example batch's structure and shapes.
    local=(batch_shard_dims, dp): the batch is one dp rank's share (dims split over dp are
    1/dp of the example's)."""
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    if spec != signature.batch_spec:
        raise BatchError(f"batch structure {spec} differs from the example_batch's "
                         f"{signature.batch_spec}; give step() batches shaped like example_batch "
                         "(or call parallelize again with a matching example_batch).")
    out = []
    for i, (v, m) in enumerate(zip(leaves, signature.batch_leaf_meta)):
        if isinstance(m, tuple) and len(m) == 2 and isinstance(m[1], torch.dtype):
            want = m[0]
            dim = local[0][len(out)] if local is not None else None
            if dim is not None:
                want = tuple(n // local[1] if d == dim else n for d, n in enumerate(want))
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != want or v.dtype != m[1]:
                got = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
                if local is not None:
                    raise BatchError(
                        f"batch leaf {i} is {got}, but with batch='local' each rank gives its "
                        f"1/{local[1]} share of the global batch: {(want, m[1])} (example_batch "
                        f"is the global batch, {m}). Give every rank global_batch/dp_size rows "
                        "(e.g. a DistributedSampler with num_replicas=pm.dp_size, "
                        "rank=pm.dp_rank).")
                raise BatchError(f"batch leaf {i} is {got}, but example_batch had {m}; the graph "
                                 "was compiled for the example batch's shapes and dtypes. Pad or "
                                 "re-parallelize with a matching example_batch.")
            out.append(v)
        elif v != m:
            raise BatchError(f"non-tensor batch leaf {i} is {v!r} but example_batch had {m!r}; "
                             "non-tensor values are baked into the graph at trace time.")
    return out


def check_microbatches(n_rows, m, dp, where):
    if n_rows % (m * dp):
        raise BatchError(
            f"the global batch does not split into {m} microbatches over dp={dp}: {where} has "
            f"{n_rows} rows on dim 0, not a multiple of microbatches*dp = {m * dp}. Use a "
            f"global batch that is a multiple of {m * dp}, or fewer microbatches.")


def microbatches(batch, m, dp):
    """The global batch as m microbatches along dim 0 of every tensor leaf (0-dim leaves
    repeat)."""
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            check_microbatches(x.shape[0], m, dp, f"a batch tensor of shape {tuple(x.shape)}")
    return [torch.utils._pytree.tree_unflatten(
        [x.chunk(m, 0)[j] if isinstance(x, torch.Tensor) and x.dim() > 0 else x
         for x in leaves], spec) for j in range(m)]


# what code generation (compiler/codegen.generate) did to a graph: gm.meta["codegen"]
@dataclasses.dataclass
class Run:
    """One compiled run: its name, how many ATen ops it holds, compile seconds, whether it
    was loaded from fxpar's cache."""
    name: str
    ops: int
    seconds: float
    cached: bool = False
    reused: bool = False  # the same code as an earlier run of this graph (a repeated block)
    origin: tuple = ()    # the names of the graph's nodes it compiled


@dataclasses.dataclass
class Generated:
    """What `generate` did to one graph (gm.meta["codegen"] of its result)."""
    runs: list[Run]
    eager_ops: int    # ATen ops left outside compiled runs (short runs, failed runs,
    #                   CPU_EAGER_OPS on CPU)
    seconds: float
    failed: list[str] = dataclasses.field(default_factory=list)  # runs Inductor refused, why

    @staticmethod
    def combined(done: list["Generated"]) -> "Generated":
        """Several graphs' (a rank's pipeline parts, evaluate's graph) as one."""
        return Generated([r for d in done for r in d.runs], sum(d.eager_ops for d in done),
                         sum(d.seconds for d in done), [f for d in done for f in d.failed])

    def summary(self) -> str:
        ops = sum(r.ops for r in self.runs)
        hits = sum(r.cached for r in self.runs)
        reused = sum(r.reused for r in self.runs)
        return (f"{len(self.runs)} compiled runs holding {ops} ops"
                + (f" ({hits} from the cache)" if hits else "")
                + (f" ({reused} the code of a repeated block's earlier copy)" if reused else "")
                + f", {self.eager_ops} ops left eager"
                + (f" ({len(self.failed)} runs Inductor could not compile: see the log)"
                   if self.failed else ""))

"""CUDA-graph replay of a rank's step program (Plan.cuda_graphs).

Why: the executor dispatches every ATen op of the joint graph from Python (~20 us a node on
an H100's host) where eager's autograd dispatches from C++, so a GPU step was host-bound
(GPT-2 small bf16: 54 ms of host time over 31 ms of GPU work, docs/benchmarks.md). A CUDA
graph records the step's kernels once and replays them with one launch, as
torch.compile(mode="reduce-overhead") and Megatron's --enable-cuda-graph do.

What is captured: the forward+backward graph of a program that runs as one graph per step
(pp = 1, microbatches = 1), or with cuda_graphs=True each part of a pipeline program (run
once per microbatch: its activations are copied into the part's static inputs and its
outputs cloned out, as the same part runs again before they are consumed; the transfers
between stages stay outside), with their functional collectives (NCCL collectives are capturable;
the uncaptured path's comm.lower'ed work handles are not, so the captured graph runs the
graph's own `_c10d_functional` ops). The optimizer stays outside: torch's optimizers read
the learning rate as a Python float, which a capture would freeze (an lr scheduler would
silently stop working); on CUDA they already run as a few multi-tensor kernels.

How (torch.cuda.graphs' recipe): `WARMUP_STEPS` real steps run uncaptured on a side stream
(Triton autotuning, cuBLAS workspaces, NCCL communicators initialise there), then the next
step is captured and replayed. Parameters and buffers are static inputs by address (the
optimizer updates them in place); batch leaves are copied into static input buffers each
step; outputs are static buffers overwritten by the next replay (the caller clones what it
keeps, e.g. the loss). Dropout stays random: torch registers the default CUDA generator's
philox offsets with the graph, so each replay draws new masks.

`decide` says whether a program can be captured, and why not: a pipeline program under
"auto" (core/plan.replays_step), a collective on a backend other than NCCL, an op
whose output shape or value depends on the data (a host sync; x[idx] with integer indices
is not one: `_integer_index`), a value copied to the host, remat's RNG-state replay (it reads
torch.cuda.get_rng_state, which capture forbids). Plan.cuda_graphs="auto" falls back to the
uncaptured executor with the reason logged; True raises a PlanError naming it.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fxpar.core import context_attention, experts
from fxpar.core.plan import replays_step

WARMUP_STEPS = 2  # uncaptured steps before the capture (torch.compile uses 1, Megatron 3)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether a rank's training program is replayed as a CUDA graph, and why (not)."""
    capture: bool
    reason: str


def _rng_replay_ops():
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    return {run_and_save_rng_state, run_with_rng_state}


def _tensors(args) -> list[torch.Tensor]:
    """The fake tensors of the nodes in `args`."""
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, nodes.append)
    return [v for v in (a.meta.get("val") for a in nodes) if isinstance(v, torch.Tensor)]


def uncapturable(graph: torch.fx.Graph, backend: str | None) -> list[str]:
    """Why each node that a CUDA graph cannot hold cannot (empty: the graph is capturable)."""
    rng_ops = _rng_replay_ops()
    why = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if t in experts.COMMUNICATING:
            why.append(f"{n.name} ({t}): expert parallelism's all-to-all reads the routed "
                       "counts on the host and receives as many rows as the routing sends "
                       "(a host sync each step; a graph replays fixed shapes)")
        elif t in context_attention.RING:
            why.append(f"{n.name} ({t}): ring attention passes the keys and values by "
                       "torch.distributed's send/recv inside the op, which this runtime does "
                       "not capture; use cp_attention='gather' to capture")
        elif t in rng_ops:
            why.append(f"{n.name}: remat replays a random op's RNG state, which reads "
                       "torch.cuda.get_rng_state (forbidden while capturing); use remat='none' "
                       "or a model without dropout to capture")
        elif getattr(t, "namespace", "") == "_c10d_functional" and \
                "nccl" not in (backend or ""):  # "nccl", "cuda:nccl,cpu:gloo"
            why.append(f"{n.name}: a collective on the {backend} backend (only NCCL "
                       "collectives can be captured)")
        elif isinstance(t, torch._ops.OpOverload) and (
                torch.Tag.dynamic_output_shape in t.tags or
                torch.Tag.data_dependent_output in t.tags) and not _integer_index(n):
            why.append(f"{n.name} ({t}): its output's shape or value depends on the data (a "
                       "host sync each step; a graph replays fixed shapes)")
        elif getattr(t, "overloadpacket", 0) is experts.GROUPED_MM and any(
                v.dtype != torch.bfloat16 for v in _tensors(n.args[:2])):
            why.append(f"{n.name} ({t}): torch runs a grouped matmul of other than bf16 "
                       "operands group by group, reading the group offsets on the host each "
                       "step")
        elif isinstance(t, torch._ops.OpOverload) and torch.Tag.cudagraph_unsafe in t.tags:
            why.append(f"{n.name} ({t}): torch marks the op unsafe in CUDA graphs")
        else:
            val = n.meta.get("val")
            ins = _tensors((n.args, n.kwargs))
            if isinstance(val, torch.Tensor) and val.device.type == "cpu" and \
                    any(v.device.type == "cuda" for v in ins):
                why.append(f"{n.name} ({t}): copies a device value to the host")
    return why


def _integer_index(n: torch.fx.Node) -> bool:
    """x[idx] with integer index tensors only: torch tags aten.index.Tensor as having a
    data-dependent shape for the boolean-mask form (a nonzero, a host sync), but with
    integer indices its shape is theirs, fixed, and the gather runs on the device - the
    routing of Hugging Face's MoE layers (tokens gathered by expert order), which a CUDA
    graph replays as it is."""
    if n.target is not torch.ops.aten.index.Tensor:
        return False
    idx, x = _tensors(n.args[1]), _tensors(n.args[0])
    # (uint8 indexes as a mask; an index on another device is copied over: a host sync)
    return len(idx) == sum(a is not None for a in n.args[1]) and len(x) == 1 and all(
        v.dtype in (torch.int64, torch.int32) and v.device == x[0].device for v in idx)


def _first_reasons(why: list[str]) -> str:
    return "; ".join(why[:2]) + (f" (and {len(why) - 2} more)" if len(why) > 2 else "")


def decide(program, setting, device: torch.device, backend: str | None,
           debug_nan: bool = False) -> Decision:
    """Whether `program` (a compiled ir.Program) is captured under Plan.cuda_graphs=`setting`."""
    if setting is False:
        return Decision(False, "Plan.cuda_graphs=False")
    if device.type != "cuda":
        return Decision(False, f"the rank runs on {device.type}: CUDA graphs need a CUDA device")
    if debug_nan:
        return Decision(False, "FXPAR_DEBUG_NAN runs the graph node by node")
    if program.pipeline is not None:
        if not replays_step(setting, program.pp, program.microbatches):
            return Decision(False, "a pipeline part runs once per microbatch, so a captured "
                                   "part copies each microbatch's inputs into its graph's "
                                   "buffers and its outputs out: not done by default until "
                                   "measured on a GPU; cuda_graphs=True captures every part")
        why = [w for part in program.pipeline.parts.values()
               for w in uncapturable(part.graph.graph, backend)]
        if why:
            return Decision(False, _first_reasons(why))
        return Decision(True, f"each pipeline part captured after {WARMUP_STEPS} warm-up "
                              "steps (its inputs copied in, its outputs cloned out); the "
                              "transfers between stages and the optimizer run outside")
    why = uncapturable(program.graph.graph, backend)
    if why:
        return Decision(False, _first_reasons(why))
    return Decision(True, f"forward+backward captured after {WARMUP_STEPS} warm-up steps; the "
                          "optimizer runs outside the graph")


class CaptureFailed(RuntimeError):
    """torch raised while recording the step (nothing ran: a capture records only)."""


class _CudaBackend:
    """torch.cuda.CUDAGraph with a private memory pool; warm-up on a side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graph = None
        self.start = self.end = None

    def warm(self, fn, inputs):
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            outs = fn(*inputs)
        cur.wait_stream(side)
        return outs

    def capture(self, fn, inputs):
        torch.cuda.synchronize(self.device)
        # the graph allocates from its own pool: hand the warm-up steps' cached blocks back
        # first, or a model near the memory limit would hold the step's activations twice
        torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog's and gloo's threads may call CUDA meanwhile
        try:
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                outs = fn(*inputs)
        except RuntimeError as e:
            self.graph = None
            raise CaptureFailed(str(e).splitlines()[0]) from e
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        return outs

    def replay(self):
        self.start.record()
        self.graph.replay()
        self.end.record()

    def last_device_s(self) -> float | None:
        """The last replay's GPU time, if it has finished (never blocks)."""
        if self.end is None or not self.end.query():
            return None
        return self.start.elapsed_time(self.end) / 1e3


class GraphedStep:
    """Runs fn(*inputs) uncaptured `warmup` times, then captures it and replays it.

    inputs: those marked in `persistent` live across steps (parameters, buffers): the graph
    reads them where they are; the rest (batch leaves, a pipeline part's activations) are
    copied into static buffers made at capture. A persistent input found at another address
    later (a parameter replaced by `load`) is copied into the captured one. Returns the graph's
    static outputs: valid until the next call."""

    def __init__(self, fn, persistent, device: torch.device, warmup: int = WARMUP_STEPS,
                 backend=None):
        self.fn, self.persistent, self.warmup = fn, persistent, warmup
        self.backend = backend if backend is not None else _CudaBackend(device)
        self.calls = 0
        self.static_inputs: list | None = None
        self.static_outputs = None

    @property
    def captured(self) -> bool:
        return self.static_outputs is not None

    def __call__(self, inputs: list):
        self.calls += 1
        if self.calls <= self.warmup:
            return self.backend.warm(self.fn, inputs)
        if self.static_inputs is None:
            # persistent inputs by a detached alias: `p.data = new` later (load) moves the
            # parameter, not the storage the graph reads, and the address check below sees it
            self.static_inputs = [x if not isinstance(x, torch.Tensor) else x.detach()
                                  if keep else x.clone()
                                  for x, keep in zip(inputs, self.persistent)]
            try:
                self.static_outputs = self.backend.capture(self.fn, self.static_inputs)
            except CaptureFailed:
                self.static_inputs = None
                raise
        else:
            for static, x in zip(self.static_inputs, inputs):
                if isinstance(x, torch.Tensor) and x.data_ptr() != static.data_ptr():
                    static.copy_(x, non_blocking=True)
        self.backend.replay()  # a capture records without running: the step runs here
        return self.static_outputs

    def last_device_s(self) -> float | None:
        return self.backend.last_device_s() if self.captured else None

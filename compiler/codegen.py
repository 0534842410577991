"""Code generation: the compute between a graph's collectives compiled by Inductor.

The last step before a graph runs (Plan.codegen). fxpar's graphs are functional ATen with
functional collectives, which is what Inductor - PyTorch's compiler - takes: it fuses
pointwise and reduction chains into C++/OpenMP kernels on CPU and Triton kernels on GPUs,
and calls ATen/BLAS for matmuls. fxpar keeps what it decided:

- **Collective placement.** The graph is cut into maximal runs of compute *in program
  order*; every collective, wait and non-ATen call (fxpar's hand-written kernels, runtime
  helpers) stays a node of the outer graph between compiled runs, so the overlap pass's
  start/wait order is exactly the order that runs, and runtime/comm.lower still turns the
  collectives into work handles (timed on the timeline). Why not CapabilityBasedPartitioner
  or fuser_utils: they merge compute across a collective when dependencies allow and then
  re-sort the graph, which moves compute from behind a wait to before its start (and
  undoes the overlap pass).
- **Regions.** A run never spans two regions (forward / backward / packing): the timeline's
  segment markers still fall between compiled runs.
- **Exactness.** Random ops call torch's own generator (Inductor's fallback_random), so
  dropout draws the numbers eager draws and remat's RNG replay holds; whether a collective
  may reduce its input in place (`ir.OWNED`) is judged on the graph before it is cut (inside
  a compiled run the view chains are no longer visible).

Each run is compiled with fake inputs of its recorded shapes and strides through
`torch._inductor.standalone_compile`, and its CompiledArtifact is kept on disk under a key of
the run's code and input layouts (`cache_dir()`): another rank of the same role, or a later
job, loads it instead of compiling. Compiling is pure (no process group); the runtime
decides which rank compiles first.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import operator
import os
import shutil
import time
from typing import Callable

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpar.core import context_attention, cost, experts, ir
from fxpar.core.ir import Generated, Run  # noqa: F401 (what generate returns)
from fxpar.core.errors import CodegenError, PlanError  # noqa: F401 (CodegenError: raised here)
from fxpar.core.logs import announce
from fxpar.core.source_version import source_version

log = logging.getLogger(__name__)
# a run with fewer ATen compute ops than this stays eager: a compile costs seconds and a
# handful of ops gains nothing from fusion (views, getitems and the like do not count)
MIN_OPS = 3


def decide(codegen: str, device) -> tuple[str, str | None]:
    """Plan.codegen on `device` -> ("inductor" | "eager", why not Inductor or None).
    "auto": Inductor where it can generate code - a GPU with Triton, or a CPU with a C++
    compiler - else eager. FXPAR_CODEGEN=eager|inductor overrides "auto" (e.g. to iterate
    on a model without compile time). `codegen` is a validated Plan's."""
    env = os.environ.get("FXPAR_CODEGEN", "").strip().lower()
    if codegen == "auto" and env:
        if env not in ("eager", "inductor"):
            raise PlanError(f"FXPAR_CODEGEN={env!r}: use 'eager' or 'inductor' (or unset it).")
        if env == "eager":
            return "eager", "FXPAR_CODEGEN=eager"
        codegen = "inductor"
    if codegen == "eager":
        return "eager", "Plan.codegen='eager'"
    dev = torch.device(device) if device is not None else torch.device("cpu")
    why = None
    if dev.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            why = "Inductor's GPU kernels need Triton, which is not installed (pip install triton)"
    elif dev.type == "cpu":
        cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++")
                                            if shutil.which(c)), None)
        if cxx is None or not shutil.which(cxx):
            why = ("Inductor's CPU kernels need a C++ compiler and none was found (install "
                   "g++, e.g. Debian's `g++` package, or set CXX)")
    else:
        why = f"Inductor does not generate code for {dev.type!r} devices here"
    if why is None:
        return "inductor", None
    if codegen == "inductor":
        raise PlanError(f"Plan.codegen='inductor': {why}. Use codegen='eager' (or 'auto').")
    return "eager", why


def _is_compute(n: torch.fx.Node, cpu: bool = False) -> bool:
    """An ATen op (or getitem of one) that Inductor compiles; everything else - collectives,
    waits, fxpar's kernels, runtime calls, higher-order ops - runs in the outer graph, and
    on CPU the ops Inductor miscompiles there (CPU_EAGER_OPS)."""
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem:  # goes with what it takes apart
        return isinstance(n.args[0], torch.fx.Node) and _is_compute(n.args[0], cpu)
    # (remat's RNG save / replay, run_and_save_rng_state / run_with_rng_state, are
    # HigherOrderOperators AOTAutograd cannot re-trace: they run in the outer graph, eagerly,
    # which also keeps their generator state exactly eager's)
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if (cpu and _adds_through_an_index(n)) or t in experts.COMMUNICATING or \
            t in context_attention.RING or \
            n.meta.get(ir.DYNAMIC_ROWS):  # (a shape the graph's values only bound)
        return False
    return t.namespace not in ir.COMMUNICATION_NAMESPACES


# Ops Inductor lowers to an indexed store with atomic adds. On CPU (torch 2.13) that store
# is miscompiled when the added values are read transposed (their innermost dim is not the
# output's): Inductor's 2-D tile kernel offsets each row of the tile twice, so values land
# in the wrong rows and past the buffer's end - wrong gradients (HF Falcon's fused-QKV
# weight, the backward of `x[..., idx]` on a transposed view) and heap corruption. Whether
# a value is read transposed is Inductor's choice (it inlines the views and copies that
# make it), not visible in the graph's metadata, so on CPU these ops always run op by op
# (ATen's kernel; they end a compiled run). tests/test_codegen.py reproduces the bug (at 2
# threads; the 1-thread kernel of that repro came out right, but its loops are Inductor's
# choice too, so the rule does not depend on the thread count). Checked and not affected
# on the same repro: scatter_add (ATen's kernel at >1 thread), col2im, unfold_backward.
CPU_EAGER_OPS = {
    torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default,
    torch.ops.aten.index_add.default, torch.ops.aten.embedding_dense_backward.default,
    torch.ops.aten._unsafe_masked_index_put_accumulate.default,
    # Inductor's CPU code for an MoE's grouped matmuls (torch 2.13) put torchtitan
    # DeepSeek-V3's expert gradients 1% off ATen's under dp where each rank's rows leave
    # some experts empty (core/local_dispatch), and Kimi-K2's router gradient 10% of its
    # update off, past Plan.verify's rounding bound; ATen's kernel, op by op, is exact
    # there (examples/zoo_ep)
    torch.ops.aten._grouped_mm.default,
}


_INDEX_PUTS = (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default)


def cpu_indexed_adds(gm: torch.fx.GraphModule) -> int:
    """On CPU, each `index_put(x, [idx], v, accumulate=True)` on x's first dim (autograd's
    backward of a row gather `x[idx]`: an MoE's dispatch, a padded routing's rows) becomes
    `index_add(x, 0, idx, v)`: the same sums in the same index order, but ATen's CPU
    index_put with accumulate runs serially (28x index_add's time for 1024 rows of 256 on a
    2-core VM, torch 2.13). Negative indices are wrapped as index_put reads
    them; an index out of range still raises. Returns how many were rewritten."""
    aten = torch.ops.aten
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _INDEX_PUTS:
            continue
        x, indices, v = n.args[:3]
        accumulate = n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False)
        if not accumulate or len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
            continue
        xv, iv, vv = (a.meta.get(ir.VAL) for a in (x, indices[0], v))
        if not all(isinstance(t, torch.Tensor) for t in (xv, iv, vv)) or iv.dim() != 1 or \
                iv.dtype not in (torch.int64, torch.int32) or \
                tuple(vv.shape) != (iv.shape[0], *xv.shape[1:]) or vv.dtype != xv.dtype:
            continue
        meta = {k: n.meta[k] for k in (ir.REGION, ir.MODULE, ir.STAGE, ir.PHASE) if k in n.meta}
        with gm.graph.inserting_before(n):
            idx = indices[0]
            neg = gm.graph.call_function(aten.lt.Scalar, (idx, 0))
            up = gm.graph.call_function(aten.add.Tensor, (idx, xv.shape[0]))
            wrapped = gm.graph.call_function(aten.where.self, (neg, up, idx))
            add = gm.graph.call_function(aten.index_add.default, (x, 0, wrapped, v))
        for made, val in ((neg, iv.new_empty(iv.shape, dtype=torch.bool)), (up, iv),
                          (wrapped, iv), (add, n.meta[ir.VAL])):
            made.meta.update(meta)
            made.meta[ir.VAL] = val
        if ir.SHARD in n.meta:
            add.meta[ir.SHARD] = n.meta[ir.SHARD]
        n.replace_all_uses_with(add)
        gm.graph.erase_node(n)
        done += 1
    if done:
        gm.recompile()
    return done


def _adds_through_an_index(n: torch.fx.Node) -> bool:
    """One of CPU_EAGER_OPS that adds: index_put only with accumulate=True (read through the
    op's schema, default included); the others always add."""
    if n.target not in CPU_EAGER_OPS:
        return False
    call = n.normalized_arguments(None, normalize_to_only_use_kwargs=True)
    return bool(call.kwargs.get("accumulate", True))


def _counts(n: torch.fx.Node) -> bool:
    return n.target is not operator.getitem and not cost.is_view(n)


def repeated_blocks(graph: torch.fx.Graph) -> dict[torch.fx.Node, str | None]:
    """Node -> the copy of a repeated block it belongs to ("transformer.h.3"), read from its
    module path: the path up to its first numeric component, where the copy numbered next to
    it in its container computes the same forward ops (transformer layers, ResNet blocks);
    None outside any."""
    copy: dict[torch.fx.Node, tuple[str, int] | None] = {}  # (container, index)
    ops: dict[tuple[str, int], list] = collections.defaultdict(list)  # its forward ops
    for n in graph.nodes:
        parts = (n.meta.get(ir.MODULE) or "").split(".")
        i = next((k for k, p in enumerate(parts) if p.isdigit()), None)
        copy[n] = None if i is None else (".".join(parts[:i]), int(parts[i]))
        if copy[n] and n.op == "call_function" and n.meta.get(ir.REGION) == ir.FORWARD:
            ops[copy[n]].append(n.target)
    # a copy counts where the copy numbered next to it computes the same forward ops (a
    # Sequential's Linear, ReLU, Linear are numbered too: cut apart, they would lose fusion)
    repeated = {(c, i) for (c, i), t in ops.items()
                if t in (ops.get((c, i - 1)), ops.get((c, i + 1)))}
    return {n: (f"{v[0]}.{v[1]}" if v[0] else str(v[1])) if v in repeated else None
            for n, v in copy.items()}


def runs(graph: torch.fx.Graph, cpu: bool = False,
         per_block: bool = True) -> list[list[torch.fx.Node]]:
    """Maximal runs of compute nodes, consecutive in program order, in one region and one
    copy of a repeated block (`repeated_blocks`: a layer's run has the same code as its
    copies', compiled once for all of them), with at least MIN_OPS real (non-view) ops
    (`cpu`: the graph runs on a CPU)."""
    out, cur, region, block = [], [], None, None
    blocks = repeated_blocks(graph) if per_block else dict.fromkeys(graph.nodes)
    for n in graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and _is_compute(n, cpu):
            continue  # goes with what it takes apart (below)
        r, b = n.meta.get(ir.REGION), blocks[n]
        if not _is_compute(n, cpu) or (cur and (r != region or b != block)):
            if sum(map(_counts, cur)) >= MIN_OPS:
                out.append(cur)
            cur = []
        if _is_compute(n, cpu):
            cur.append(n)
            region, block = r, b
    if sum(map(_counts, cur)) >= MIN_OPS:
        out.append(cur)
    # a multi-output op's getitems join its run wherever they sit in the graph (a run
    # returns tensors only); they only take apart a value already made
    owner = {n: run for run in out for n in run}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in owner:
            owner[n.args[0]].append(n)
            owner[n] = owner[n.args[0]]
    order = {n: i for i, n in enumerate(graph.nodes)}
    return [part for run in out for part in _split_at_late_inputs(
        sorted(run, key=order.__getitem__), order) if sum(map(_counts, part)) >= MIN_OPS]


# ops Inductor calls out to a library kernel (cuBLAS, cuDNN, its attention) from inside a
# compiled run: each is a launch of its own
_EXTERN = {getattr(torch.ops.aten, name, None) for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward")} - {None}


def host_calls(graph: torch.fx.Graph, cpu: bool = False) -> int:
    """The calls a step of `graph` makes from the host once compiled (codegen "inductor"):
    one per compiled run and per library kernel inside it, and one per op left outside the
    runs (views and getitems excepted). The planner prices a step's host time by these on a
    GPU, where they are the launches; per graph node it priced a GPT-2's step 3.7x high at
    two microbatches (docs/benchmarks.md)."""
    rs = runs(graph, cpu)
    inside = {n for r in rs for n in r}
    calls = sum(1 + sum(getattr(n.target, "overloadpacket", None) in _EXTERN for n in r)
                for r in rs)
    return calls + sum(1 for n in graph.nodes if n.op == "call_function" and n not in inside
                       and n.target is not operator.getitem and not cost.is_view(n))


def _split_at_late_inputs(run, order) -> list[list[torch.fx.Node]]:
    """A run is called where its first node was: cut it before any node that reads a value
    made outside the run after that point (a getitem left outside)."""
    parts, cur, inside = [], [], set(run)
    for n in run:
        if cur and any(a not in inside and order[a] > order[cur[0]] for a in n.all_input_nodes):
            parts.append(cur)
            cur = []
        cur.append(n)
    return parts + [cur]


def _halves(graph: torch.fx.Graph, run: list[torch.fx.Node]
            ) -> tuple[list[list[torch.fx.Node]], int]:
    """A run Inductor refused, cut into two runs of about half its ops each (program order;
    a multi-output op's getitems go with it), to compile apart: bisecting leaves only the
    ops Inductor cannot compile op by op (seen on an H200, torch 2.11: a Triton kernel of HF
    GPT-2's bf16 forward failed to build, and took the whole forward's run with it).
    Returns (the parts with at least MIN_OPS ops, the ops of the smaller leftovers, which
    stay op by op); ([], 0) when the run is too small to cut."""
    if sum(map(_counts, run)) < 2 * MIN_OPS:
        return [], 0
    order = {n: k for k, n in enumerate(graph.nodes)}
    run = sorted(run, key=order.__getitem__)
    total, seen, cut = sum(map(_counts, run)), 0, len(run)
    for k, n in enumerate(run):
        seen += _counts(n)
        if 2 * seen >= total:
            cut = k + 1
            break
    first = set(run[:cut])
    first |= {n for n in run[cut:] if n.target is operator.getitem and n.args[0] in first}
    parts, left = [], 0
    for half in ([n for n in run if n in first], [n for n in run if n not in first]):
        for part in _split_at_late_inputs(half, order):
            if sum(map(_counts, part)) >= MIN_OPS:
                parts.append(part)
            else:
                left += sum(map(_counts, part))
    return parts, left


class CompiledRun(torch.nn.Module):
    """A compiled run as a submodule of the outer graph; `source` is the graph it compiled.
    Inductor's code is specialised to its inputs' strides (and asserts them). An input made
    inside the graph (`produced`: positions) can arrive laid out otherwise than traced - an
    earlier compiled run returns what Inductor's own passes made of it (its shape padding
    returns a padded matmul output: GPT-2's [8192, 50257] logits with rows of 50264 on an
    H200) - and does so every step: the first such call compiles a variant for that layout
    (`compile_fn`, so cached on disk like any run) rather than copying it each step (0.96
    ms per step there). Any other input laid out otherwise (a user's non-contiguous batch
    where the example batch was contiguous, which may change from step to step) is copied
    into the layout compiled for.

    Its first call also runs `source` op by op on the same inputs (the same random numbers)
    and compares (unless `generate` checked it before the first step, `_checked_when`):
    where Inductor's result differs by more than rounding (CHECK_RTOL of the
    output's largest finite magnitude plus CHECK_ATOL; a wider bound for an fp32 output of a
    run that computes in fp16/bf16 anywhere), the run stays op by op from then on
    and a warning names it - a compiler bug never becomes a silently wrong step (seen: HF
    Falcon's fused-QKV gradients 1% off, since root-caused: CPU_EAGER_OPS). The graph's
    outputs are compared one at a time as it makes them (`_StreamingCheck`), beside
    Inductor's; where even that would take more than half the device's free memory the
    check is skipped with a warning.
    FXPAR_CODEGEN_CHECK=0 skips the check (the first step's extra time and memory)."""

    def __init__(self, fn: Callable, source: torch.fx.GraphModule, strides: list[tuple],
                 name: str = "run", compile_fn: Callable | None = None,
                 produced: tuple[int, ...] = (), origin: tuple[str, ...] = ()):
        super().__init__()
        self.fn, self.source, self.strides, self.name = fn, source, strides, name
        self.origin = origin  # the outer graph's nodes it was cut from (source's v0, v1, ...)
        self.compile_fn, self.produced = compile_fn, frozenset(produced)
        self.variants: dict[tuple, CompiledRun | None] = {}  # by input strides (None: copy)
        self.checked = os.environ.get("FXPAR_CODEGEN_CHECK", "1") == "0"
        self.mismatch: str | None = None
        # the runs of the same code (a repeated block's copies, this one among them): the
        # first of them called checks for all - one code, one verdict, and the first step
        # pays one check per distinct run, not one per layer
        self.copies: list[CompiledRun] = [self]
        self.unset = _uninitialized_outputs(source)  # (never compared)
        # an fp32 output computed from half-precision values (an upcast norm, a bf16 matmul's
        # fp32 gradient) carries their rounding: Inductor keeps fused intermediates in fp32
        # where the graph rounds each to bf16 (seen on an H200: Llama bf16's outputs 2e-3
        # apart, all its runs rejected under the fp32 bound): CHECK_RTOL["mixed"], or a few
        # roundings of the coarsest half dtype the run computes in, if wider (HF GPT-2 bf16 on
        # an H100: its fp32 GELU tanh, from bf16 values, 1.1e-2 of the max apart)
        halves = {v.dtype for n in source.graph.nodes
                  if isinstance(v := n.meta.get(ir.VAL), torch.Tensor)
                  and v.dtype in (torch.float16, torch.bfloat16)}
        self.half = bool(halves)
        self.mixed_rtol = max([CHECK_RTOL["mixed"]] + [
            MIXED_ROUNDINGS * torch.finfo(dt).eps for dt in halves])

    def forward(self, *args):
        if any(a.stride() != s for a, s in zip(args, self.strides)):
            # the user's inputs into the traced layout; then those made inside the graph
            # get a variant of their own where one can be compiled, else copied too
            args = [a if a.stride() == s or i in self.produced else _laid_out(a, s)
                    for i, (a, s) in enumerate(zip(args, self.strides))]
            if any(a.stride() != s for a, s in zip(args, self.strides)):
                variant = self._variant(args) if self.fn is not self.source else None
                if variant is not None:
                    return variant(*args)
                args = [a if a.stride() == s else _laid_out(a, s)
                        for a, s in zip(args, self.strides)]
        if not self.checked:
            return self._first_call(args)
        return self.fn(*args)

    def _variant(self, args) -> "CompiledRun | None":
        """The run compiled for the layouts of `args` (only inputs made inside the graph
        differ), compiled by each rank at the first call that brings them: at most
        MAX_VARIANTS layouts are tried (a failed compile counts), never while a CUDA graph
        is being captured (Inductor and the first-call check cannot run inside one); else
        None (the inputs are copied)."""
        strides = tuple(a.stride() for a in args)
        if strides in self.variants:
            return self.variants[strides]
        if self.compile_fn is None or len(self.variants) >= MAX_VARIANTS or \
                torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None
        off = [i for i, (a, s) in enumerate(zip(args, self.strides)) if a.stride() != s]
        variant = None
        fakes = _fakes_like(args)
        t0 = time.perf_counter()
        devices = sorted({a.device for a in args if a.device.type == "cuda"}, key=str)
        try:
            # in the middle of a step: whatever Inductor draws while it compiles (its
            # shape padding benchmarks on random inputs) must not move the step's numbers
            with torch.random.fork_rng(devices=devices):
                fn, hit = self.compile_fn(self.source, fakes)
        except Exception as e:  # noqa: BLE001 - copying the inputs is still correct
            log.warning("codegen: %s could not be compiled for its inputs' layout (%s: %s): "
                        "they are copied into the traced one each call", self.name,
                        type(e).__name__, (str(e).splitlines() or [''])[0][:200])
        else:
            variant = CompiledRun(fn, self.source, list(strides),
                                  f"{self.name}/restrided{len(self.variants)}")
            log.info("codegen: %s compiled for inputs %s as they arrive (%s) in %.1f s%s",
                     self.name, off, ", ".join(str(args[i].stride()) for i in off),
                     time.perf_counter() - t0, " (cached)" if hit else "")
        self.variants[strides] = variant
        return variant

    def _first_call(self, args):
        self.checked = True
        # Inductor's outputs are held while the graph runs op by op beside them, each of its
        # outputs compared as soon as it is made and dropped after its last use there (not
        # a second copy of all of them: a forward run returns every saved activation). A
        # model sized to its device must not fail its first step over a check: the estimate
        # is the largest output twice (the graph's, and what it keeps alive while it is
        # compared) and `_difference`'s fp32 temporaries (~5 copies of a chunk)
        outs = _output_vals(self.source)
        big = max(outs, key=lambda v: v.numel() * v.element_size(), default=None)
        extra = 0 if big is None else \
            2 * big.numel() * big.element_size() + 5 * 4 * min(big.numel(), CHECK_CHUNK)
        where = next((a.device for a in args if a.device.type != "cpu"),
                     args[0].device if args else torch.device("cpu"))
        free = free_bytes(where)
        if free is not None and extra > CHECK_MEMORY_FRACTION * free:
            log.warning("codegen: %s is not checked against the graph: the check needs "
                        "%.2f GiB more and %.2f GiB is free on %s", self.name, extra / 2**30,
                        free / 2**30, where)
            return self.fn(*args)
        devices = [a.device for a in args if a.device.type == "cuda"][:1]
        before = _rng_states(devices)
        out = self.fn(*args)
        with torch.random.fork_rng(devices=devices):  # the same random numbers as Inductor's
            _set_rng_states(devices, before)
            self.mismatch = _StreamingCheck(self.source, out, self._compare).run(*args)
        for other in self.copies:
            other.checked, other.mismatch = True, self.mismatch
        if self.mismatch is None:
            return out
        log.warning("codegen: Inductor's %s differs from the graph (%s): it runs op by op "
                    "from now on%s.", self.name, self.mismatch,
                    f", as do its {len(self.copies) - 1} copies" if len(self.copies) > 1 else "")
        for other in self.copies:
            other.fn = other.source
        del out
        _set_rng_states(devices, before)  # this step's result is the graph's, numbers alike
        return self.source(*args)

    def _compare(self, i: int, r, o) -> str | None:
        """Output i of the graph (r) against Inductor's (o): None, or what differs."""
        if not isinstance(r, torch.Tensor) or not r.is_floating_point() or not r.numel() \
                or i in self.unset:
            return None
        diff, scale = _difference(r, o)
        kind = "half" if r.dtype in (torch.float16, torch.bfloat16) else \
            "mixed" if self.half else "fp32"
        rtol = self.mixed_rtol if kind == "mixed" else CHECK_RTOL[kind]
        if diff <= rtol * scale + CHECK_ATOL[kind]:
            return None
        return f"output {i}: max |difference| {diff:.3g} against a largest magnitude {scale:.3g}"


# factories whose values are whatever memory the allocator hands out (the graph overwrites
# them before any read, e.g. HF DeepSeek-V3's attention pads its value heads into one)
UNINITIALIZED = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                 torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
                 torch.ops.aten.empty_strided.default}


def _uninitialized_outputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """The positions of `gm`'s outputs that are uninitialised memory (an `UNINITIALIZED`
    factory's, or a view of one): the graph's and Inductor's differ as their allocators do,
    so comparing them would reject a correct run (it did: HF DeepSeek-V3 ran op by op)."""
    def unset(n: torch.fx.Node) -> bool:
        while cost.is_view(n) and n.all_input_nodes and isinstance(n.args[0], torch.fx.Node):
            n = n.args[0]
        return n.op == "call_function" and n.target in UNINITIALIZED
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return frozenset(i for i, a in enumerate(out.args[0])
                     if isinstance(a, torch.fx.Node) and unset(a))


class _StreamingCheck(torch.fx.Interpreter):
    """Runs a graph op by op, comparing each of its outputs with `out` (Inductor's) as soon as
    it is made, and freeing it after its last use inside the graph rather than holding every
    output to the end. `run` returns the first difference (None: equal up to rounding)."""

    def __init__(self, gm: torch.fx.GraphModule, out, compare):
        super().__init__(gm, garbage_collect_values=True)
        out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.positions: dict[torch.fx.Node, list[int]] = {}
        for i, a in enumerate(out_node.args[0]):
            if isinstance(a, torch.fx.Node):
                self.positions.setdefault(a, []).append(i)
        last: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in gm.graph.nodes:
            if n.op != "output":
                for a in n.all_input_nodes:
                    last[a] = n
        self.user_to_last_uses = {}
        for a, n in last.items():
            self.user_to_last_uses.setdefault(n, []).append(a)
        for a in self.positions:  # read by nothing else: dropped once compared
            if a not in last:
                self.user_to_last_uses.setdefault(a, []).append(a)
        self.out, self.compare, self.found = out, compare, None

    def run_node(self, n):
        if n.op == "output":  # (its values are compared and gone)
            return self.found
        v = super().run_node(n)
        for i in self.positions.get(n, ()):
            if self.found is None:
                self.found = self.compare(i, v, self.out[i])
        return v


def _rng_states(devices) -> list:
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_states(devices, states) -> None:
    torch.set_rng_state(states[0])
    for d, st in zip(devices, states[1:]):
        torch.cuda.set_rng_state(st, d)


def _laid_out(a: torch.Tensor, stride) -> torch.Tensor:
    return torch.empty_strided(a.shape, stride, dtype=a.dtype, device=a.device).copy_(a)


MAX_VARIANTS = 2  # layouts a run is compiled for besides the traced one (then: copies)
CHECK_MEMORY_FRACTION = 0.5  # of the free memory: the rest for the two runs' temporaries
# a run is checked on the first step's own values where that adds at most this share of the
# graph's peak (its op-by-op twin's working memory beside Inductor's outputs); larger runs -
# the LM head's logits and their loss - are checked before the first step, on random inputs
FIRST_STEP_CHECK_SHARE = 0.1


def _output_vals(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return [v for n in out.all_input_nodes
            if isinstance(v := n.meta.get(ir.VAL), torch.Tensor)]


def _run_extra(run: "CompiledRun") -> int:
    """The most memory a run's op-by-op twin holds beyond its inputs (cost.simulate_liveness:
    views share their base's storage, each output of a multi-output op is freed on its own)."""
    return cost.simulate_liveness(run.source, count_inputs=False).activation_peak


def _random_like(f: torch.Tensor, gen: torch.Generator, device) -> torch.Tensor:
    """A tensor of f's shape, strides (overlapping ones too: an expanded input) and dtype on
    `device`: normal floats, random booleans, zeros for integers (in range as any index,
    so never a device-side assert)."""
    size = 1 + sum((n - 1) * st for n, st in zip(f.shape, f.stride())) if f.numel() else 0
    if f.dtype.is_floating_point or f.dtype.is_complex:
        flat = torch.randn(size, generator=gen, device=device).to(f.dtype)
    elif f.dtype == torch.bool:
        flat = torch.rand(size, generator=gen, device=device) < 0.5
    else:
        flat = torch.zeros(size, dtype=f.dtype, device=device)
    return flat.as_strided(f.shape, f.stride())


def check_ahead(run: "CompiledRun", fakes, device) -> str | None:
    """The compiled code against its graph op by op, on random inputs of the traced layouts,
    before the first step (so outside its memory peak): None if equal up to rounding, else
    what differs (or that a reference output is not finite: random values met a log or a
    square root, and inf == inf tells nothing). Values the random inputs do not reach - an
    ignore_index label, a padding mask - go unchecked: that is the price of not checking
    this run on the step's own values. The graph runs first and only its outputs are kept
    while Inductor's code runs: the most memory held is the larger of the graph's working
    set and the two sets of outputs, not their sum. The random numbers (inputs, and any
    random op's draws) leave the process's generators as they were: the step's dropout
    masks stay eager's."""
    where = torch.device(device)
    devices = [where] if where.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        gen = torch.Generator(device=where).manual_seed(0)
        args = [_random_like(f, gen, where) for f in fakes]
        before = _rng_states(devices)
        ref = run.source(*args)
        _set_rng_states(devices, before)
        out = run.fn(*args)
        del args
        for i, (r, o) in enumerate(zip(ref, out)):
            if isinstance(r, torch.Tensor) and r.is_floating_point() and \
                    i not in run.unset and not bool(r.isfinite().all()):
                return (f"output {i} is not finite on random inputs: the check cannot tell "
                        "(e.g. a log of a negative value)")
            if (d := run._compare(i, r, o)) is not None:
                return d
        return None


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can still get on `device`: on CUDA the driver's free memory
    plus what torch's caching allocator holds unused; on CPU Linux's MemAvailable (else the
    free physical pages); None where unknown."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
                device)
        if device.type == "cpu":  # MemAvailable counts the page cache the kernel can drop
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None
    return None


# fp32 / half: rounding is ~1e-6 / ~1e-2 of the max; "mixed": an fp32 output of a run that
# computes in half precision somewhere (Llama bf16 on an H200: 1.7e-3 and 2.5e-3 of the max)
CHECK_RTOL = {"fp32": 1e-3, "mixed": 1e-2, "half": 5e-2}
MIXED_ROUNDINGS = 4  # x the half dtype's eps: bf16 3.1e-2, fp16 stays at 1e-2
# and an absolute floor: an output that is zero up to the rounding of sums that cancel (fp32
# gradients of ~1e-7 everywhere: ConvNeXt, nn.Transformer) differs by ~its own size. Kept low:
# the bound is against the output's largest element, so a floor lets every output whose
# largest element is below floor/rtol be that much more wrong
CHECK_ATOL = {"fp32": 1e-6, "mixed": 1e-4, "half": 1e-4}


CHECK_CHUNK = 1 << 20  # elements compared at once: the fp32 temporaries stay ~4 MiB each


def _difference(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(largest |ref - out|, largest finite |ref|). Equal elements count 0, and so do two
    non-finite ones (an attention mask's -inf; an fp16 overflow that one side makes inf and
    the other NaN - the loss scaler only asks whether values are finite); inf or NaN against
    a number is an infinite / NaN difference, which fails every bound. Compared CHECK_CHUNK
    elements at a time, in slices of the leading dimension: whole, the fp32 temporaries for
    GPT-2's bf16 [8192, 50257] logits come to ~8 GB (an H200's warm-up peak was 19.4 GB,
    eager's 11.4). Outputs of other shapes differ infinitely."""
    if ref.shape != out.shape:
        return float("inf"), 0.0
    if ref.dim() == 0 or ref.numel() <= CHECK_CHUNK:
        return _difference_of(ref, out)
    if ref.shape[0] == 1:
        return _difference(ref[0], out[0])
    rows = max(1, CHECK_CHUNK // (ref.numel() // ref.shape[0]))
    diff = scale = 0.0
    for start in range(0, ref.shape[0], rows):
        d, m = _difference(ref[start:start + rows], out[start:start + rows])
        if d != d:  # NaN against a number: it fails every bound
            return d, m
        diff, scale = max(diff, d), max(scale, m)
    return diff, scale


def _difference_of(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    r, o = ref.float(), out.float()
    same = (r == o) | (~r.isfinite() & ~o.isfinite())
    diff = torch.where(same, torch.zeros_like(r), (r - o).abs()).max().item()
    finite = r[r.isfinite()]
    return diff, finite.abs().max().item() if finite.numel() else 0.0


def _torch_meta(n: torch.fx.Node) -> dict:
    """What Inductor reads of a node's meta. fxpar's own keys stay behind: some share a name
    with torch's (fxpar's "recompute" flag vs AOTAutograd's checkpoint policy)."""
    return {k: n.meta[k] for k in ("val", "tensor_meta", "stack_trace") if k in n.meta}


def _extract(graph: torch.fx.Graph, nodes: list[torch.fx.Node]):
    """The run as its own graph: inputs (values made outside and read inside, in first-use
    order) and outputs (values made inside and read after it). Its nodes are named by
    position (v0, v1, ...), so the copies of a repeated block give the same code, and so
    the same cache key."""
    inside = set(nodes)
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[torch.fx.Node] = []

    def arg(a):
        if a not in env:
            inputs.append(a)
            env[a] = sub.placeholder(f"in_{len(inputs) - 1}")
            env[a].meta = _torch_meta(a)
        return env[a]
    for k, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
        env[n] = sub.create_node(n.op, n.target, torch.fx.map_arg(n.args, env.__getitem__),
                                 torch.fx.map_arg(n.kwargs, env.__getitem__), name=f"v{k}")
        env[n].meta = _torch_meta(n)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub.output(tuple(env[n] for n in outputs))
    return sub, inputs, outputs


def _structure(sub: torch.fx.Graph) -> tuple:
    """What `sub`'s code says, as a value: each node's op, target and arguments (nodes by
    position, floats by repr: -0.0 is not 0.0). Equal for a repeated block's copies, and
    ~10x cheaper than generating their Python code to compare."""
    index = {n: i for i, n in enumerate(sub.nodes)}

    def leaf(a):
        return ("node", index[a]) if isinstance(a, torch.fx.Node) else \
            ("float", repr(a)) if isinstance(a, float) else a
    return tuple((n.op, n.target, repr(torch.fx.node.map_aggregate(n.args, leaf)),
                  repr(torch.fx.node.map_aggregate(n.kwargs, leaf))) for n in sub.nodes)


def _fake_inputs(inputs, device):
    """Fakes of the run's inputs as traced (None if one is not a tensor)."""
    vals = [a.meta.get(ir.VAL) for a in inputs]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    return _fakes_like(vals, device)


def _fakes_like(tensors, device=None) -> list:
    """Fake tensors of these shapes, strides and dtypes (on `device`, else each one's own):
    what Inductor specialises a compiled run to."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                    device=device if device is not None else t.device)
                for t in tensors]


def cache_dir() -> str:
    """Where compiled runs are kept: FXPAR_CACHE_DIR, else fxpar/ in Inductor's cache
    directory (TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>)."""
    if os.environ.get("FXPAR_CACHE_DIR"):
        return os.environ["FXPAR_CACHE_DIR"]
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_dir
    return os.path.join(inductor_dir(), "fxpar")


# where fxpar's ops (their fake functions, shape rules and kernels) are defined
OP_SOURCES = ("core", "kernels", "compiler/padded_nonzero.py", "compiler/shape_rules.py")


def _key(sub: torch.fx.GraphModule, fakes) -> str:
    """The run's code, its inputs' shapes/strides/dtypes/devices, torch's version, the
    Inductor options fxpar sets, the thread count (Inductor's CPU kernels fix their OpenMP
    threads at compile time: a 2-thread kernel in a 1-thread rank oversubscribes) and the
    source of fxpar's ops and kernels (`OP_SOURCES`: the code calls them by name, compiled
    with their fake functions and lowerings): what the compiled code depends on; and
    Inductor's settings as its own cache keys them
    (`save_config_portable`: a user's max_autotune or shape padding is not served a run
    compiled without it; per-process values such as compile_threads left out)."""
    from torch._inductor import config
    portable = getattr(config, "save_config_portable", dict)()
    h = hashlib.sha256()
    for part in (torch.__version__, source_version(*OP_SOURCES), repr(INDUCTOR_OPTIONS),
                 f"threads={torch.get_num_threads()}",
                 repr(sorted(portable.items())), sub.code,
                 *(f"{tuple(f.shape)}{f.stride()}{f.dtype}{f.device}" for f in fakes)):
        h.update(part.encode())
    return h.hexdigest()[:32]


# fallback_random: dropout and other random ops call torch's generator, as eager does
# (exact parity, and remat's run_with_rng_state replays the same numbers).
# Not cpp.use_decompose_tanh: where Inductor's CPU tanh (Sleef's) ran 5-8x slower than
# eager's the exp form was 2.4x faster, but its error (~1.7e-7 absolute, eager 5.6e-8) put
# Gemma 2's tp=2 step (tanh soft-capping) past the zoo's exactness bound. (Which tanh is
# faster depends on the CPU: on an AVX-512 EPYC Sleef's was 1.5x faster than eager's.)
INDUCTOR_OPTIONS = {"fallback_random": True}


def inductor(sub: torch.fx.GraphModule, fakes) -> tuple[Callable, bool]:
    """Compile one run with Inductor (torch._inductor.standalone_compile), or load it from
    fxpar's cache: a hit skips Inductor's re-trace and lowering (on a first compile those
    are most of the time; Inductor's own FX graph cache only saves the C++/Triton build).
    A refusal is remembered there too (`<key>.refused`), so that other ranks and later
    jobs do not compile the same run only to fail again.
    Returns (callable, whether it came from the cache)."""
    import torch._inductor as inductor_api
    from torch._inductor import config
    path = os.path.join(cache_dir(), _key(sub, fakes) + ".bin")
    if os.path.exists(path):
        try:
            return inductor_api.CompiledArtifact.load(path=path, format="binary"), True
        except Exception as e:  # noqa: BLE001 - a stale or partial entry: compile again
            log.debug("codegen cache entry %s unreadable (%s): compiling", path, e)
    refused = path[:-len(".bin")] + ".refused"
    if os.path.exists(refused):  # another rank or an earlier job: do not pay for it again
        with open(refused) as f:
            raise CodegenError(f"refused before ({f.read().strip()}; delete {refused} to "
                               "try again)")
    try:
        with config.patch(INDUCTOR_OPTIONS), torch.no_grad():
            art = inductor_api.standalone_compile(sub, fakes,
                                                  dynamic_shapes="from_example_inputs")
    except Exception as e:
        if not _transient(e):  # a one-off (memory, a worker, the disk) is not remembered
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{refused}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                os.replace(tmp, refused)  # (a rank reading it never sees half a file)
            except OSError:
                pass
        raise
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        art.save(path=tmp, format="binary")
        os.replace(tmp, path)  # atomic: a rank loading it never sees half a file
    except OSError as e:  # a read-only cache: the run still compiled
        log.warning("codegen: could not cache a compiled run in %s: %s", cache_dir(), e)
    return art, False


def _transient(e: BaseException) -> bool:
    """A compile failure that another try may not repeat: out of memory (while autotuning),
    a dead compile-worker pool, a timeout, the disk, or this process's environment (an
    import that failed, a module shadowed by a folder of the same name in the working
    directory: "module 'z3' has no attribute 'ExprRef'") - anywhere in its chain of causes."""
    from concurrent.futures.process import BrokenProcessPool
    while e is not None:
        if isinstance(e, (torch.OutOfMemoryError, MemoryError, BrokenProcessPool,
                          OSError, ImportError)):  # (TimeoutError is an OSError)
            return True
        if isinstance(e, AttributeError) and str(e).startswith("module '"):
            return True
        e = e.__cause__ or e.__context__
    return False


FIRST_STEP = "first step"  # a verdict: checked at the run's first call, on its values
# ... each copy of a repeated block on its own values: random values judged it wrong or
# could not run it, so values decide (one layer's routing may be where Inductor errs)
FIRST_STEP_EACH = "first step, each copy"


def _checked_when(run: CompiledRun, fakes, where: torch.device, peak: int) -> str | None:
    """Where `run` is checked against its graph: FIRST_STEP when its op-by-op twin adds at
    most FIRST_STEP_CHECK_SHARE of the graph's peak `peak`, else now, on random inputs
    (`check_ahead`, on `where`): None when they agree, FIRST_STEP_EACH when they do not - a
    compiler bug or values the model never makes, which the first call's check on the
    step's own values tells apart, each copy of a repeated block on its own - and
    FIRST_STEP when the check does not fit in memory now."""
    extra = _run_extra(run)
    if extra <= FIRST_STEP_CHECK_SHARE * peak:
        return FIRST_STEP
    need = extra + sum(cost.tensor_bytes(f) for f in fakes) + cost.tensor_bytes(
        _output_vals(run.source))
    free = free_bytes(where)
    if free is not None and need > CHECK_MEMORY_FRACTION * free:
        return FIRST_STEP  # (which is skipped with a warning if it does not fit either)
    try:
        differs = check_ahead(run, fakes, where)
    except Exception as e:  # noqa: BLE001 - e.g. an op that refuses random values: the
        log.info("codegen: %s could not be checked on random inputs (%s: %s); it is checked "
                 "on the first step's values", run.name, type(e).__name__,
                 (str(e).splitlines() or [''])[0][:200])
        return FIRST_STEP_EACH
    if differs:  # random values can be ones the model never makes (all tokens routed to
        # one expert: index_put's duplicate writes land in any order): the step's own
        # values judge, at its first call
        log.info("codegen: %s differs from the graph on random inputs (%s); it is checked "
                 "on the first step's values", run.name, differs)
        return FIRST_STEP_EACH
    return None


def generate(gm: torch.fx.GraphModule, device=None, name: str = "graph",
             compile_fn: Callable | None = None, strict: bool = True,
             per_block: bool = True) -> torch.fx.GraphModule:
    """A copy of `gm` whose compute runs are compiled (`compile_fn(sub_gm, fake_inputs)` ->
    (callable, from cache), `inductor` by default) and called as submodules; collectives,
    waits and other calls stay in place, in the same order. `device`: the device the graph
    will run on (fakes are made there: Inductor specialises to it). A run Inductor cannot
    compile is cut in halves that are compiled apart (`_halves`), down to the smallest runs
    it refuses; such a run raises CodegenError naming its ops when `strict`
    (Plan.codegen="inductor"), else (codegen "auto") stays op by op with a warning naming
    them. `per_block=False`: runs may span a repeated block's copies (`runs`), each compiled
    on its own (benchmarks/compile_time.py --per-block measures both). Result's
    meta["codegen"]: a Generated."""
    t0 = time.perf_counter()
    compile_fn = compile_fn or inductor
    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    for n in g.nodes:  # judged on the uncut graph (view chains visible)
        if n.op == "call_function" and n.target in OWNED_INPUT_OPS:
            n.meta[ir.OWNED] = cost.owned(n.args[0])
    out = torch.fx.GraphModule(gm, g)
    done, failed = [], []
    compiled: dict[tuple, Callable] = {}  # by code and input layouts: a block's copies share
    where = torch.device(device) if device is not None else next(
        (n.meta[ir.VAL].device for n in g.nodes
         if n.op == "placeholder" and isinstance(n.meta.get(ir.VAL), torch.Tensor)),
        torch.device("cpu"))
    cpu = where.type == "cpu"
    cut = runs(g, cpu, per_block)
    # what a run's first-call check is priced against: the graph's own peak, op by op
    peak = cost.simulate_liveness(gm).peak_total
    verdicts: dict[tuple, str | None] = {}  # by code and layouts, as `compiled`
    copies: dict[tuple, list[CompiledRun]] = {}  # (as CompiledRun.copies)
    in_runs = {n for r in cut for n in r}
    eager_ops = sum(1 for n in g.nodes if _is_compute(n) and _counts(n) and n not in in_runs)
    todo = [(i, nodes) for i, nodes in enumerate(cut)]
    progress = announce(log, f"codegen: compiling {name}'s {len(cut)} runs "
                        f"({sum(len(r) for r in cut)} nodes) with Inductor (a run compiled "
                        "before loads from its cache)")
    with progress:
        while todo:
            i, nodes = todo.pop(0)
            sub_graph, inputs, outputs = _extract(g, nodes)
            sub = _LazyGraphModule(out, sub_graph)  # (its code made if compiled or run)
            fakes = _fake_inputs(inputs, device)
            if fakes is None:  # a non-tensor input: leave this run eager
                eager_ops += sum(map(_counts, nodes))
                continue
            key = f"compiled_{len(done)}"
            t1 = time.perf_counter()
            same = (_structure(sub_graph), tuple(
                f"{tuple(f.shape)}{f.stride()}{f.dtype}{f.device}" for f in fakes))
            reused = same in compiled
            try:
                # (Inductor's shape padding times matmuls on random inputs: the step's
                # generators must not move)
                with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []):
                    fn, hit = (compiled[same], False) if reused else compile_fn(sub, fakes)
                compiled[same] = fn
            except Exception as e:  # noqa: BLE001 - narrowed down, then named with the way out
                parts, left = _halves(g, nodes)
                if parts:  # compile the halves apart: one refused op costs only itself
                    # (a small run's ops are named: where its halves then compile, it is the
                    # ops' fusion that Inductor refused - the lead for a report upstream)
                    small = len(nodes) <= 40
                    log.info("codegen: Inductor refused %s's run %d (%d nodes%s: %s: %s); "
                             "compiling its halves apart", name, i, len(nodes),
                             ", ops " + ", ".join(str(n.target) for n in nodes if _counts(n))
                             if small else "", type(e).__name__,
                             (str(e).splitlines() or [''])[0][:200])
                    eager_ops += left
                    todo[:0] = [(i, part) for part in parts]
                    continue
                ops = sorted({str(n.target) for n in nodes if _counts(n)})
                what = (f"Inductor could not compile {name}'s run {i} ({len(nodes)} nodes, from "
                        f"{nodes[0].name} to {nodes[-1].name}, ops {', '.join(ops)}; module "
                        f"{nodes[0].meta.get(ir.MODULE)!r}): {type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:300]}")
                if strict:
                    raise CodegenError(f"{what}. Use Plan(codegen='auto') to run only these ops "
                                       "op by op, or codegen='eager' to run the whole graph so."
                                       ) from e
                log.warning("%s; these ops run op by op (Plan.codegen='auto').", what)
                failed.append(what)
                eager_ops += sum(map(_counts, nodes))
                continue
            done.append(Run(f"{name}/{key}", sum(map(_counts, nodes)), time.perf_counter() - t1,
                            hit, reused, tuple(n.name for n in nodes)))
            produced = tuple(j for j, a in enumerate(inputs) if a.op != "placeholder")
            run = CompiledRun(fn, sub, [tuple(f.stride()) for f in fakes], f"{name}/{key}",
                              compile_fn, produced, tuple(n.name for n in nodes))
            out.add_module(key, run)
            if not run.checked:
                if same not in verdicts:  # (a copy takes its first copy's verdict)
                    verdicts[same] = _checked_when(run, fakes, where, peak)
                    copies[same] = run.copies
                elif verdicts[same] == FIRST_STEP:  # (checked once, by the first called)
                    run.copies = copies[same]
                    run.copies.append(run)
                run.checked = verdicts[same] not in (FIRST_STEP, FIRST_STEP_EACH)
            with g.inserting_before(nodes[0]):
                call = g.call_module(key, tuple(inputs))
                call.meta[ir.REGION] = nodes[0].meta.get(ir.REGION)
                call.meta[ir.MODULE] = nodes[0].meta.get(ir.MODULE)
                inside = set(nodes)
                for j, o in enumerate(outputs):
                    item = g.call_function(operator.getitem, (call, j))
                    item.meta = dict(o.meta)
                    o.replace_all_uses_with(item, lambda u: u not in inside)
            for n in reversed(nodes):  # (users first)
                g.erase_node(n)
    g.lint()
    out.recompile()
    out.meta = dict(gm.meta)
    ahead = sum(v is None for v in verdicts.values())
    if ahead:
        log.info("codegen: %s: %d distinct compiled runs checked against the graph on random "
                 "inputs before the first step (their first-step check would add over %d%% "
                 "to the step's memory peak); the others are checked on their first call",
                 name, ahead, 100 * FIRST_STEP_CHECK_SHARE)
    shared = sum(len(c) - 1 for c in copies.values())
    if shared:
        log.info("codegen: %s: %d runs share the code of a repeated block's earlier copy: "
                 "the first of them called is checked for all", name, shared)
    out.meta["codegen"] = Generated(done, eager_ops, time.perf_counter() - t0, failed)
    log.debug("codegen %s: %s", name, out.meta["codegen"].summary())
    return out


c10d = torch.ops._c10d_functional
OWNED_INPUT_OPS = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default)

"""Triton source generated from a fused subgraph of pointwise ops and trailing-dim reductions.

A group of ATen nodes becomes one kernel that loads each input once, computes every node in
registers and stores only the values used outside the group. Two templates, as in Inductor:

- pointwise: every node has the same number of elements N; a 1-D grid over N.
- persistent row reduction: the reductions (sum, mean, amax, amin) all reduce the trailing
  dims of an [R..., C...] value; one program holds BM whole rows of C (BN = next_pow2(C)
  columns) so softmax, layer/RMS norm and their backwards (several reductions, values
  broadcast back over the row) are one pass over memory. Nodes are "full" (R*C elements) or
  "row" (R elements, [BM, 1] in registers).

Reshapes (view, unsqueeze, squeeze) of a group value keep its row-major element order, so
they are free inside a group. Inputs of any strides and broadcasts are loaded through index
arithmetic on the consumer's shape (adjacent dims merged where the strides allow).
Arithmetic is fp32; a node whose dtype is bf16/fp16 is rounded to it, as eager rounds each
op's result, so a fused bf16 chain tracks eager op by op (in the interpreter it differs only
where an op's own fp32 arithmetic does; Triton's GPU exp/div are approximate). NaN
propagates as in eager (relu, maximum/minimum, amax/amin).

The kernel is specialised to the runtime inputs' shapes, strides and dtypes and compiled once
per distinct source (cache shared by all groups); `FusedKernel` runs the original subgraph
instead on fake/meta tensors (shape propagation) and never launches on them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import logging
import math
import os
import re
import tempfile
from typing import Callable

import torch
import torch.fx

from fxpar.kernels.jit import interpreting, kernel, next_pow2

log = logging.getLogger(__name__)
aten = torch.ops.aten

MAX_ROW = 16384      # a persistent row (C elements) must fit one block
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_TL = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
       torch.bool: "tl.int1"}


class Unsupported(Exception):
    """This group cannot be one generated kernel (the pass leaves its ops unfused)."""


def _lit(x) -> str:
    x = float(x)
    if math.isinf(x):
        return 'float("inf")' if x > 0 else '-float("inf")'
    if math.isnan(x):
        return 'float("nan")'
    return repr(x)


def _sigmoid(x):
    return f"(1.0 / (1.0 + tl.exp(-{x})))"


def _gelu(x, approximate="none"):
    if approximate == "tanh":
        inner = f"(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))"
        return f"(0.5 * {x} * (1.0 + (2.0 * {_sigmoid('2.0 * ' + inner)} - 1.0)))"
    return f"(0.5 * {x} * (1.0 + tl.math.erf({x} * 0.7071067811865476)))"


def _gelu_backward(g, x, approximate="none"):
    if approximate == "tanh":
        k = f"(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))"
        t = f"(2.0 * {_sigmoid('2.0 * ' + k)} - 1.0)"
        dk = f"(0.7978845608028654 * (1.0 + 3.0 * 0.044715 * {x} * {x}))"
        return f"({g} * (0.5 * (1.0 + {t}) + 0.5 * {x} * (1.0 - {t} * {t}) * {dk}))"
    cdf = f"(0.5 * (1.0 + tl.math.erf({x} * 0.7071067811865476)))"
    pdf = f"(tl.exp(-0.5 * {x} * {x}) * 0.3989422804014327)"
    return f"({g} * ({cdf} + {x} * {pdf}))"


def _pow(x, e):
    e = float(e)
    if e == 2.0:
        return f"({x} * {x})"
    if e == 3.0:
        return f"({x} * {x} * {x})"
    if e == 1.0:
        return x
    if e == 0.5:
        return f"tl.sqrt({x})"
    if e == -1.0:
        return f"(1.0 / {x})"
    if e == -0.5:
        return f"tl.rsqrt({x})"
    raise Unsupported(f"pow with exponent {e}")


def _alpha(b, alpha):
    return b if alpha in (None, 1) else f"({b} * {_lit(alpha)})"


# aten op -> (tensor/scalar arg expressions, kwargs) -> Triton expression (fp32 arithmetic)
POINTWISE: dict = {
    aten.add.Tensor: lambda a, b, alpha=1: f"({a} + {_alpha(b, alpha)})",
    aten.add.Scalar: lambda a, b, alpha=1: f"({a} + {_alpha(b, alpha)})",
    aten.sub.Tensor: lambda a, b, alpha=1: f"({a} - {_alpha(b, alpha)})",
    aten.sub.Scalar: lambda a, b, alpha=1: f"({a} - {_alpha(b, alpha)})",
    aten.rsub.Scalar: lambda a, b, alpha=1: f"({b} - {_alpha(a, alpha)})",
    aten.mul.Tensor: lambda a, b: f"({a} * {b})",
    aten.mul.Scalar: lambda a, b: f"({a} * {b})",
    aten.div.Tensor: lambda a, b: f"({a} / {b})",
    aten.div.Scalar: lambda a, b: f"({a} / {b})",
    aten.neg.default: lambda a: f"(-{a})",
    aten.exp.default: lambda a: f"tl.exp({a})",
    aten.log.default: lambda a: f"tl.log({a})",
    aten.sqrt.default: lambda a: f"tl.sqrt({a})",
    aten.rsqrt.default: lambda a: f"tl.rsqrt({a})",
    aten.reciprocal.default: lambda a: f"(1.0 / {a})",
    aten.abs.default: lambda a: f"tl.abs({a})",
    aten.sin.default: lambda a: f"tl.sin({a})",
    aten.cos.default: lambda a: f"tl.cos({a})",
    aten.erf.default: lambda a: f"tl.math.erf({a})",
    aten.sigmoid.default: lambda a: _sigmoid(a),
    aten.relu.default: lambda a: f"tl.where({a} < 0.0, 0.0, {a})",  # keeps NaN, as eager
    aten.silu.default: lambda a: f"({a} / (1.0 + tl.exp(-{a})))",
    aten.gelu.default: _gelu,
    aten.gelu_backward.default: _gelu_backward,
    aten.sigmoid_backward.default: lambda g, y: f"({g} * {y} * (1.0 - {y}))",
    aten.tanh_backward.default: lambda g, y: f"({g} * (1.0 - {y} * {y}))",
    aten.threshold_backward.default: lambda g, x, t: f"tl.where({x} <= {t}, 0.0, {g})",
    aten.native_dropout_backward.default: lambda g, mask, scale: f"({g} * {mask} * {scale})",
    aten.pow.Tensor_Scalar: _pow,
    aten.maximum.default: lambda a, b: f"tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    aten.minimum.default: lambda a, b: f"tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    aten.where.self: lambda c, a, b: f"tl.where({c}, {a}, {b})",
    aten.clone.default: lambda a, memory_format=None: a,
    aten._to_copy.default: lambda a, **kw: a,          # the rounding is applied per dtype
    aten.eq.Scalar: lambda a, b: f"({a} == {b})",
    aten.ne.Scalar: lambda a, b: f"({a} != {b})",
    aten.gt.Scalar: lambda a, b: f"({a} > {b})",
    aten.ge.Scalar: lambda a, b: f"({a} >= {b})",
    aten.lt.Scalar: lambda a, b: f"({a} < {b})",
    aten.le.Scalar: lambda a, b: f"({a} <= {b})",
    aten.eq.Tensor: lambda a, b: f"({a} == {b})",
    aten.gt.Tensor: lambda a, b: f"({a} > {b})",
    aten.lt.Tensor: lambda a, b: f"({a} < {b})",
}
_BOOL_RESULT = {aten.eq.Scalar, aten.ne.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.lt.Scalar,
                aten.le.Scalar, aten.eq.Tensor, aten.gt.Tensor, aten.lt.Tensor}
_BOOL_ARG0 = {aten.where.self}  # first argument stays boolean

REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max",
              aten.amin.default: "min"}
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}
EXPAND = aten.expand.default   # a row value broadcast over its row (e.g. mean's backward)
VIEWS = RESHAPES | {EXPAND}    # free outside a kernel: never a group's only reason to exist


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def fusible_op(node: torch.fx.Node) -> bool:
    """An op the generator can emit (the pass also checks dtypes and graph position)."""
    t = node.target
    if t not in POINTWISE and t not in REDUCTIONS and t not in VIEWS:
        return False
    v = _val(node)
    if not isinstance(v, torch.Tensor) or v.numel() == 0:
        return False
    if t is aten._to_copy.default and (set(node.kwargs) - {"dtype"} or node.args[1:]):
        return False  # only dtype casts (no device/layout/memory-format changes)
    if t is aten.clone.default and node.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    if t in REDUCTIONS and (v.dtype not in _FLOAT or t is aten.sum.dim_IntList and node.kwargs.get("dtype")):
        return False
    for a in node.all_input_nodes:
        av = _val(a)
        if not isinstance(av, torch.Tensor) or av.dtype not in _FLOAT + (torch.bool,) \
                or av.device != v.device:
            return False
    return v.dtype in _FLOAT + (torch.bool,)


def _reduced_dims(node) -> list[int]:
    shape = _val(node.args[0]).shape
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or dims == []:
        dims = list(range(len(shape)))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % max(len(shape), 1) for d in dims)


@dataclasses.dataclass
class GroupShape:
    """The iteration space of a group: R rows of C elements (pointwise: R = 1, C = N)."""
    rows: int
    cols: int
    reduction: bool
    kinds: dict  # node -> "full" | "row"


def analyze(nodes: list[torch.fx.Node]) -> GroupShape:
    """Check a group can be one kernel and find its iteration space; raise Unsupported."""
    members = set(nodes)
    for n in nodes:
        if n.target in VIEWS and n.args[0] not in members:
            raise Unsupported(f"{n.name} views a group input (left outside: a free view)")
    reds = [n for n in nodes if n.target in REDUCTIONS]
    if not reds:
        ns = {_val(n).numel() for n in nodes}
        if len(ns) != 1:
            raise Unsupported(f"pointwise nodes of different sizes {sorted(ns)}")
        n_el = ns.pop()
        return GroupShape(1, n_el, False, {n: "full" for n in nodes})
    cols = None
    for r in reds:
        shape = list(_val(r.args[0]).shape)
        dims = _reduced_dims(r)
        if dims != list(range(len(shape) - len(dims), len(shape))):
            raise Unsupported(f"{r.name} reduces dims {dims} of {shape}, not the trailing ones")
        c = math.prod(shape[d] for d in dims)
        if cols is not None and c != cols:
            raise Unsupported(f"reductions over rows of different lengths ({cols}, {c})")
        cols = c
    total = _val(reds[0].args[0]).numel()
    rows = total // cols
    if cols <= 1:
        raise Unsupported("reduction over a single element")
    if cols > MAX_ROW:
        raise Unsupported(f"row of {cols} elements exceeds one block ({MAX_ROW})")
    kinds = {}
    for n in nodes:
        numel = _val(n).numel()
        if n.target in REDUCTIONS:
            a = n.args[0]
            if a in members and kinds[a] != "full":
                raise Unsupported(f"{n.name} reduces a row value")
            kinds[n] = "row"
            continue
        kind = "full" if numel == rows * cols else "row" if numel == rows else None
        if kind is None:
            raise Unsupported(f"{n.name} has {numel} elements, neither a row ({rows}) nor the "
                              f"whole ({rows * cols})")
        for a in n.all_input_nodes:
            if a in members and kinds[a] == "full" and kind == "row":
                raise Unsupported(f"{n.name} shrinks a full value without reducing it")
            if n.target is EXPAND and kinds[a] == "full" and kind == "full":
                continue  # expanding nothing (same number of elements): an alias
            if a in members and kinds[a] == "row" and kind == "full":
                if n.target in RESHAPES:
                    raise Unsupported(f"{n.name} reshapes a row value into a full one")
                _row_broadcast_split(_val(a).shape, _val(n).shape, rows, cols, n)
        kinds[n] = kind
    return GroupShape(rows, cols, True, kinds)


def _row_broadcast_split(a_shape, out_shape, rows, cols, n) -> int:
    """A row value broadcast into a full op must look like [R..., 1...] against [R..., C...]."""
    a_shape = [1] * (len(out_shape) - len(a_shape)) + list(a_shape)
    for j in range(len(out_shape) + 1):
        if (math.prod(out_shape[:j]) == rows and math.prod(out_shape[j:]) == cols
                and list(a_shape[:j]) == list(out_shape[:j]) and all(s == 1 for s in a_shape[j:])):
            return j
    raise Unsupported(f"{n.name}: a row value of shape {tuple(a_shape)} broadcast into "
                      f"{tuple(out_shape)} does not follow the rows")


# --- source generation ------------------------------------------------------------------------

def _merge_dims(sizes, strides):
    """Merge adjacent dims whose strides make them one (dim i, i+1 contiguous or both 0)."""
    out = []
    for s, st in zip(sizes, strides):
        if s == 1:
            continue
        if out and out[-1][1] == st * s:
            out[-1] = (out[-1][0] * s, st)
        else:
            out.append((s, st))
    return out


def _offset(var: str, sizes, strides) -> str:
    """Offset of element `var` (row-major index over `sizes`) in memory with `strides`."""
    dims = _merge_dims(sizes, strides)
    terms = []
    for i, (s, st) in enumerate(dims):
        if st == 0:
            continue
        div = math.prod(d[0] for d in dims[i + 1:])
        e = var if div == 1 else f"({var} // {div})"
        if i > 0:
            e = f"({e} % {s})"
        terms.append(e if st == 1 else f"{e} * {st}")
    return " + ".join(terms) if terms else "0"


def _aligned(shape, stride, out_shape):
    """Input strides against the consumer's shape: broadcast dims get stride 0."""
    pad = len(out_shape) - len(shape)
    sizes = list(out_shape)
    strides = [0] * pad + [0 if shape[i] == 1 and out_shape[pad + i] != 1 else stride[i]
                           for i in range(len(shape))]
    return sizes, strides


class _Emitter:
    def __init__(self, nodes, inputs, outputs, in_meta, gs: GroupShape):
        self.nodes, self.inputs, self.outputs, self.gs = nodes, inputs, outputs, gs
        self.in_meta = in_meta  # per input: (shape, stride, dtype)
        self.lines: list[str] = []
        self.names: dict = {}
        self.loads: dict = {}
        self.bools: set[str] = set()
        extents = [sum((d - 1) * abs(st) for d, st in zip(s, t)) + 1 for s, t, _ in in_meta]
        self.big = max([gs.rows * gs.cols] + extents) >= 2 ** 31

    def _address(self, kind, sizes, strides) -> tuple[str, str]:
        """(offset expression, mask) of a value of this kind with these (aligned) strides."""
        gs = self.gs
        if not gs.reduction:
            return _offset("lin", sizes, strides), "mask"
        if kind == "row":
            return _offset("r", sizes, strides), "rmask"
        off = _offset(f"(r * {gs.cols} + c)", sizes, strides)
        for j in range(len(sizes) + 1):  # split at the row boundary: r and c separately
            if math.prod(sizes[:j]) == gs.rows and math.prod(sizes[j:]) == gs.cols:
                a, b = _offset("r", sizes[:j], strides[:j]), _offset("c", sizes[j:], strides[j:])
                off = b if a == "0" else a if b == "0" else f"{a} + {b}"
                break
        if off == "0":
            return off, "fmask"
        # Triton broadcasts a mask to the pointer's shape, not the reverse: a [BM, BN] mask
        # needs a [BM, BN] pointer (a weight's "c" alone is [1, BN])
        names = set(re.findall(r"\b[rc]\b", off))
        return off + "".join(f" + 0 * {v}" for v in "rc" if v not in names), "fmask"

    def load(self, i, kind, out_shape):
        key = (i, kind, tuple(out_shape))
        if key not in self.loads:
            shape, stride, dtype = self.in_meta[i]
            off, mask = self._address(kind, *_aligned(shape, stride, out_shape))
            name = f"x{len(self.loads)}"
            if off == "0":   # a 0-dim (or all-broadcast) input: one scalar load
                self.lines.append(f"{name} = tl.load(in{i})")
            else:
                self.lines.append(f"{name} = tl.load(in{i} + ({off}), mask={mask}, other=0)")
            if dtype == torch.bool:
                self.bools.add(name)
            else:
                self.lines[-1] += ".to(tl.float32)"
            self.loads[key] = name
        return self.loads[key]

    def arg(self, a, consumer):
        if isinstance(a, torch.fx.Node):
            if a in self.names:
                return self.names[a]
            return self.load(self.inputs.index(a), self.gs.kinds[consumer], _val(consumer).shape)
        if isinstance(a, bool):
            return "1" if a else "0"
        if isinstance(a, (int, float)):
            return _lit(a)
        if isinstance(a, str):  # an op's mode argument, e.g. gelu's approximate="tanh"
            return a
        raise Unsupported(f"argument {a!r} of {consumer.name}")

    def _rounded_scalar(self, a, n):
        """A Python scalar compared with a half-precision tensor is rounded to its dtype first
        (eager compares in that dtype)."""
        if n.target in _BOOL_RESULT and isinstance(a, float):
            dts = [_val(b).dtype for b in n.all_input_nodes]
            if dts and dts[0] in (torch.bfloat16, torch.float16):
                a = torch.tensor(a, dtype=dts[0]).item()
        return self.arg(a, n)

    def _float(self, e):
        return f"{e}.to(tl.float32)" if e in self.bools else e

    def _bool(self, e):
        return e if e in self.bools else f"({e} != 0)"

    def emit(self) -> str:
        gs = self.gs
        for k, n in enumerate(self.nodes):
            name, t = f"v{k}", n.target
            if t in RESHAPES or t is EXPAND and gs.kinds[n] == gs.kinds[n.args[0]]:
                self.names[n] = self.names[n.args[0]]
                continue
            if t is EXPAND:  # a [BM, 1] row value broadcast to [BM, BN]
                self.lines.append(f"{name} = {self.names[n.args[0]]} + tl.zeros((BM, BN), "
                                  "tl.float32)")
                self.names[n] = name
                continue
            if t in REDUCTIONS:
                src = n.args[0]
                x = self.names.get(src) or self.load(self.inputs.index(src), "full",
                                                     _val(src).shape)
                op = REDUCTIONS[t]
                neutral = {"max": '-float("inf")', "min": 'float("inf")'}.get(op, "0.0")
                fn = {"max": "tl.max", "min": "tl.min"}.get(op, "tl.sum")
                x = self._float(x)
                e = f"{fn}(tl.where(fmask, {x}, {neutral}), 1)[:, None]"
                if op == "mean":
                    e = f"({e} / {float(gs.cols)!r})"
                if op in ("max", "min"):  # NaN wins, as in eager
                    e = (f"tl.where(tl.max(tl.where(fmask & ({x} != {x}), 1, 0), 1)[:, None] > 0, "
                         f'float("nan"), {e})')
            else:
                args = [self._rounded_scalar(a, n) for a in n.args]
                args = [(self._bool(e) if t in _BOOL_ARG0 and i == 0 else self._float(e))
                        if isinstance(a, torch.fx.Node) else e
                        for i, (e, a) in enumerate(zip(args, n.args))]
                kwargs = {k2: (self._float(self.arg(v, n)) if isinstance(v, torch.fx.Node) else v)
                          for k2, v in n.kwargs.items() if k2 not in ("dtype", "memory_format")}
                e = POINTWISE[t](*args, **kwargs)
                if _val(n).dtype == torch.bool and t not in _BOOL_RESULT:
                    e = f"({e} != 0)"  # e.g. a cast to bool, bool + bool (logical or)
            self.lines.append(f"{name} = {e}")
            dt = _val(n).dtype
            if dt == torch.bool:
                self.bools.add(name)
            elif dt in (torch.bfloat16, torch.float16):  # round as eager does per op
                self.lines.append(f"{name} = {name}.to({_TL[dt]}).to(tl.float32)")
            self.names[n] = name
        for j, o in enumerate(self.outputs):
            v = _val(o)
            off, mask = self._address(gs.kinds[o], list(v.shape), list(v.stride()))
            if off == "0":  # a one-element output: a block of lanes (one unmasked) at offset 0
                off = "0 * r" if gs.reduction else "0 * lin"
            self.lines.append(f"tl.store(out{j} + ({off}), {self.names[o]}.to({_TL[v.dtype]}), "
                              f"mask={mask})")
        return self._source()

    def _source(self):
        gs = self.gs
        params = [f"in{i}" for i in range(len(self.inputs))] + \
                 [f"out{j}" for j in range(len(self.outputs))]
        head = [f"def fused_kernel({', '.join(params)}, BM: tl.constexpr, BN: tl.constexpr):",
                "    pid = tl.program_id(0)"]
        i64 = ".to(tl.int64)" if self.big else ""
        if gs.reduction:
            head += [f"    r = (pid * BM + tl.arange(0, BM)[:, None]){i64}",
                     f"    c = tl.arange(0, BN)[None, :]{i64}",
                     f"    rmask = r < {gs.rows}",
                     f"    fmask = rmask & (c < {gs.cols})"]
        else:
            head += [f"    lin = (pid * BN + tl.arange(0, BN)){i64}",
                     f"    mask = lin < {gs.cols}"]
        body = ["    " + ln for ln in self.lines]
        return "\n".join(["import triton", "import triton.language as tl", "", ""] + head + body) + "\n"


def generate(nodes, inputs, outputs, in_meta) -> tuple[str, GroupShape]:
    """Triton source for the group (nodes in order; inputs external nodes; outputs members
    used outside), specialised to the inputs' (shape, stride, dtype)."""
    gs = analyze(nodes)
    for o in outputs:
        if not isinstance(_val(o), torch.Tensor):
            raise Unsupported(f"output {o.name} is not a tensor")
    return _Emitter(nodes, inputs, outputs, in_meta, gs).emit(), gs


# --- compile cache ------------------------------------------------------------------------------

_CACHE: dict[str, kernel] = {}
_CACHE_DIR = os.environ.get("FXPAR_KERNEL_CACHE") or os.path.join(
    tempfile.gettempdir(), f"fxpar-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}")


def compile_source(src: str) -> kernel:
    """Load generated source as a module (Triton reads kernels' source from their file) once
    per distinct source text."""
    k = _CACHE.get(src)
    if k is not None:
        return k
    digest = hashlib.sha256(src.encode()).hexdigest()[:24]
    os.makedirs(_CACHE_DIR, exist_ok=True)
    path = os.path.join(_CACHE_DIR, f"fused_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(src)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"fxpar_fused_{digest}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k = _CACHE[src] = kernel(mod.fused_kernel)
    return k


def cache_size() -> int:
    return len(_CACHE)


def _blocks(gs: GroupShape) -> tuple[int, int, int]:
    """(BM, BN, grid) for the group: bigger blocks under the interpreter (fewer programs)."""
    budget = 1 << 16 if interpreting() else 4096
    if not gs.reduction:
        bn = min(next_pow2(gs.cols), budget if interpreting() else 1024)
        return 1, bn, -(-gs.cols // bn)
    bn = next_pow2(gs.cols)
    bm = max(1, min(next_pow2(gs.rows), budget // bn))
    return bm, bn, -(-gs.rows // bm)


def is_fake(t) -> bool:
    """A fake or meta tensor (tracing, planning): run the reference ops, never a kernel."""
    global _FakeTensor
    if _FakeTensor is None:  # imported on first use (an import per call cost ~1 us)
        from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
    return isinstance(t, _FakeTensor) or (isinstance(t, torch.Tensor) and t.is_meta)


_FakeTensor = None


_ids = itertools.count()


class FusedKernel:
    """The callable a fused graph node calls: the group's subgraph as one Triton kernel.

    `reference` is the original ops as a GraphModule (run on fake tensors for shapes, and the
    ground truth in tests)."""

    def __init__(self, nodes: list[torch.fx.Node], inputs: list[torch.fx.Node],
                 outputs: list[torch.fx.Node], name: str | None = None):
        self.__name__ = name or f"fused_{next(_ids)}"
        self.__module__ = "fxpar.kernels.codegen"
        self.ops = [str(n.target).replace("aten.", "").replace(".default", "") for n in nodes
                    if n.target not in VIEWS]
        self.reference = _subgraph(nodes, inputs, outputs)
        # what the generator needs, detached from the big graph (kept in the reference copy)
        self._nodes, self._inputs, self._outputs = _members(self.reference)
        self._launch: dict = {}
        self.fallback: str | None = None

    def source(self, *args) -> str:
        meta = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args]
        return generate(self._nodes, self._inputs, self._outputs, meta)[0]

    def __call__(self, *args):
        # every launch of a training step comes here: the hit path reads only what can
        # change between calls of one traced node (the inputs' strides; shapes and dtypes
        # are the trace's) and the device, ~3x less host time than keying on everything
        a0 = args[0]
        if self.fallback or is_fake(a0):  # FakeTensorMode (planning, shape propagation)
            return tuple(self.reference(*args))
        key = (a0.device.type, *[a.stride() for a in args])
        launch = self._launch.get(key)
        if launch is not None:
            return launch(args)
        if any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            return tuple(self.reference(*args))
        shapes = [tuple(_val(p).shape) for p in self._inputs]
        if [tuple(a.shape) for a in args] != shapes:
            raise RuntimeError(f"{self.__name__} was traced for inputs {shapes}, called with "
                               f"{[tuple(a.shape) for a in args]} (a bug in fxpar: please "
                               "report it)")
        try:  # generating, loading and (on a GPU) compiling happen here, once per layout
            launch = self._build(args)
            out = launch(args)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot be built must not
            # end the training run: its ops run unfused, and we say so (once per group)
            self.fallback = f"{type(e).__name__}: {e}"
            log.warning("fused kernel %s (%s) could not be built, running its ops "
                        "unfused: %s", self.__name__, ", ".join(self.ops), self.fallback)
            return tuple(self.reference(*args))
        self._launch[key] = launch
        return out

    def _build(self, args) -> Callable:
        meta = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args]
        src, gs = generate(self._nodes, self._inputs, self._outputs, meta)
        k = compile_source(src)
        outs = [_val(o) for o in self._outputs]
        bm, bn, grid = _blocks(gs)
        warps = min(16, max(4, bm * bn // 1024))
        layouts = [(tuple(v.shape), tuple(v.stride()), v.dtype) for v in outs]  # not per call
        run = k[(grid,)]  # bound once: the launcher for this grid

        def launch(args):
            dev = args[0].device
            res = [torch.empty_strided(shape, stride, dtype=dtype, device=dev)
                   for shape, stride, dtype in layouts]
            run(*args, *res, BM=bm, BN=bn, num_warps=warps)
            return tuple(res)
        return launch


def _subgraph(nodes, inputs, outputs) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    env = {}
    for i, a in enumerate(inputs):
        p = g.placeholder(f"in{i}")
        p.meta = {"val": _val(a)}
        env[a] = p
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
        env[n].meta = {"val": _val(n)}
    g.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _members(gm: torch.fx.GraphModule):
    ins = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return nodes, ins, list(out)


def group_io(nodes: list[torch.fx.Node]) -> tuple[list, list]:
    """(inputs, outputs) of a group: outside nodes it reads (first-use order) and members
    something outside reads (program order): the fused call's arguments and results."""
    members = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    return inputs, outputs


def fuse_nodes(nodes: list[torch.fx.Node], inputs=None, outputs=None) -> FusedKernel:
    """A FusedKernel for members `nodes` of a graph (inputs/outputs: `group_io`)."""
    if inputs is None or outputs is None:
        inputs, outputs = group_io(nodes)
    return FusedKernel(nodes, inputs, outputs)


__all__ = ["FusedKernel", "Unsupported", "analyze", "generate", "fusible_op", "fuse_nodes", "group_io",
           "compile_source"]

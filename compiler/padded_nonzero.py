"""`nonzero` at a fixed size: hand-written MoE routing (`torch.where(mask)`) traced exactly.

Mixture-of-experts layers written by hand pick each expert's tokens with
`token_idx, k = torch.where(mask)` and then `y[token_idx] += w[token_idx, k, None] *
expert(x[token_idx])` (litgpt's, Mistral's and DeepSeek's reference code). `nonzero` returns
as many rows as the mask has true elements: a shape that depends on values, which one static
graph cannot have. While tracing (`PaddedNonzero`), fxpar computes it at its largest size
instead - dropless: `mask.numel()` rows, every position (in the mask's memory order, see
`_enumeration_order`), a false one as index -1 - and `rewrite` then gives every tensor
indexed by such an index one zero row
at the end of each dim the index addresses: a -1 reads that zero row and a write to -1 lands
in it, cut away after the write. The true rows compute exactly what they compute in eager; the
padding rows compute on zeros and are written nowhere.

That is exact only while padding rows reach no result except through such a write. `rewrite`
proves it on the graph, op by op: for each value it tracks which dim holds padding rows and
whether those are exactly zero (every row read through a padded index is, and so is every
backward gradient of a padded write), finite, or anything, and refuses with a TraceError
naming the op and its module what it cannot prove: a reduction over the routed rows
other than a sum of exact zeros (a mean, a max, a matmul contracting two non-zero sides),
arithmetic on the indices, rows routed by two masks or paired with another tensor of as
many rows by position, a padding row in an output, an op it does not know. The count of
routed rows read as a number is refused where it is read (`len(idx)`, `idx.numel()`) and,
as a scalar equal to the padded count, in the graph; read through `.shape` / `.size()` and
used as a value (`x.new_ones(idx.shape[0]).sum()`) it is not seen.

A loop over nonzero's rows - the experts some token picked, `for e in
mask.sum((1, 2)).gt(0).nonzero()` (Hugging Face's eager experts, DBRX, the ModuleList form of
transformers 4) - runs a number of iterations set by the data. fxpar runs one per position:
Python sees row p as present (`if e == E: continue` and `experts[e]` decided as for p), its
tensors hold -1 where p is absent (a read through it is the zero row). `rewrite` proves such an
iteration changes nothing: each is marked in the graph, and all it computes that is used after
it must be an index write through rows routed by `torch.where` of a value read through its
row with zero kept zero (so all -1 where the row is absent). Where the hit list is a
one_hot's sums > 0 and every iteration routes by that one_hot's row, an absent row routes
nothing either way: the positions become constant (no hit list computed from the whole
batch, no padding of what the rows read).

Cost: each expert computes over `mask.numel()` rows where eager computes over its own tokens
(top-k of E experts with a (tokens, k) mask per expert: E times eager's expert FLOPs), which
passes/grouped_experts.py takes back to eager's where the masks partition the positions.
"""
from __future__ import annotations

import itertools
import math
import operator
import traceback
import weakref

import torch
import torch.fx
from torch.overrides import TorchFunctionMode

from fxpar.core import experts as _experts  # noqa: F401  (fxpar::check_unrouted)
from fxpar.core import ir
from fxpar.core.errors import TraceError, user_line
from fxpar.core.graphs import fake_propagate

aten = torch.ops.aten


@torch.library.custom_op("fxpar::padded_nonzero", mutates_args=())
def padded_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """nonzero(mask) at mask.numel() rows: every position in row-major order, false ones -1.
    Only a tracing marker: `rewrite` replaces it by the same computation in ATen ops."""
    return _positions(mask)


@padded_nonzero.register_fake
def _(mask):
    return mask.new_empty((mask.numel(), mask.dim()), dtype=torch.int64)


@torch.library.custom_op("fxpar::loop_mark", mutates_args=())
def loop_mark(x: torch.Tensor, step: int) -> None:
    """Only a tracing marker: iteration `step` of a loop over a padded nonzero's rows starts
    here (x: that row), or the loop ends (step -1, x: the rows). `rewrite` erases it."""


@loop_mark.register_fake
def _(x, step):
    return None


# kept by dead-code elimination until `rewrite` reads and erases it
torch.fx.node._side_effectful_functions.add(torch.ops.fxpar.loop_mark.default)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    grids = torch.meshgrid(*[torch.arange(s, device=mask.device) for s in mask.shape],
                           indexing="ij")
    pos = torch.stack([g.reshape(-1) for g in grids], 1)
    return torch.where(mask.reshape(-1, 1) != 0, pos, -1)


class PaddedNonzero(TorchFunctionMode):
    """While tracing: `torch.where(c)`, `nonzero` and `argwhere` at their largest size. The
    count of their rows read as a number (`len(idx)`, `idx.numel()`) would be the padded
    count, not the true one, wherever it goes (a load-balancing loss, a mean): refused here,
    where it is read (`.shape` / `.size()` stay: they mostly size views)."""

    def __init__(self):
        super().__init__()
        # the padded index tensors handed to the model, by identity (a tensor's == is not),
        # with the shape of their mask
        self.made: dict[int, tuple[weakref.ref, tuple]] = {}
        # a row of a padded (M, k) nonzero the model iterates, or one of its entries: the
        # position it holds where the mask is true (-1 where it is not)
        self.rows: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}
        # a comparison of such a row with a number: its answer where the row is present
        self.decided: dict[int, tuple[weakref.ref, bool]] = {}

    def _out(self, t, mask_shape=()):
        for x in (t if isinstance(t, tuple) else (t,)):
            self.made[id(x)] = (weakref.ref(x), tuple(mask_shape))
        return t

    def _handed(self, x) -> bool:
        r = self.made.get(id(x))
        return r is not None and r[0]() is x

    @staticmethod
    def _known(table, x):
        r = table.get(id(x)) if isinstance(x, torch.Tensor) else None
        return r[1] if r is not None and r[0]() is x else None

    def _iterate(self, idx: torch.Tensor):
        """`for e in nonzero(mask)`: every one of the mask's positions in turn, row p holding
        position p where the mask is true and -1 where not (a loop over the experts some
        token picked: HF's eager experts, DBRX). Control flow sees row p as present (its
        position: `if e == E: continue`, `experts[e]`); its tensors read through -1 where it
        is absent, and `rewrite` proves such an iteration changes nothing (`_loops`). Each
        iteration is marked in the graph (`loop_mark`) for that proof."""
        shape = self.made[id(idx)][1]
        rows = idx.unbind(0)
        for p, row in enumerate(rows):
            coords, rest = [], p
            for size in reversed(shape):
                coords.insert(0, rest % size)
                rest //= size
            self.rows[id(row)] = (weakref.ref(row), tuple(coords))

        def steps():
            for p, row in enumerate(rows):
                torch.ops.fxpar.loop_mark(row, p)
                yield row
            torch.ops.fxpar.loop_mark(idx, -1)
        return _Rows(rows, steps())

    def _row_use(self, func, args, kwargs):
        """An iterated row (or its entry) used by Python control flow or as an index: as if
        present (module lists, `if e == E`), and as a one-entry index in tensor indexing."""
        x = args[0]
        pos = self._known(self.rows, x)
        if func is torch.Tensor.__getitem__ and pos is not None and isinstance(args[1], int):
            out = func(*args, **kwargs)  # (an entry of the row: one coordinate)
            self.rows[id(out)] = (weakref.ref(out), (pos[args[1]],))
            return out
        if func in (torch.Tensor.__eq__, torch.Tensor.__ne__, torch.Tensor.eq,
                    torch.Tensor.ne) and pos is not None and len(pos) == 1 and \
                isinstance(args[1], int) and not isinstance(args[1], bool):
            out = func(*args, **kwargs)
            same = pos[0] == args[1]
            self.decided[id(out)] = (weakref.ref(out), same if func in (
                torch.Tensor.__eq__, torch.Tensor.eq) else not same)
            return out
        if func in (torch.Tensor.__bool__, torch.Tensor.item) and \
                self._known(self.decided, x) is not None:  # (a FunctionalTensor's bool: item)
            return self._known(self.decided, x)
        if func in (torch.Tensor.__index__, torch.Tensor.__int__, torch.Tensor.item) and \
                pos is not None and len(pos) == 1:
            return pos[0]
        if func is torch.Tensor.__getitem__:
            entries = args[1] if isinstance(args[1], tuple) else (args[1],)
            at = [i for i, a in enumerate(entries) if a is not None and
                  self._known(self.rows, a) is not None and a.dim() == 0]
            if len(at) == 1 and all(isinstance(a, slice) and a == slice(None)
                                    for a in entries[:at[0]]):
                # x[e] with e 0-d: ATen would read e as a Python number; read it as a
                # one-entry index instead (-1 then reads `rewrite`'s zero row)
                k = at[0]
                one = entries[k].reshape(1)
                out = func(x, (*entries[:k], one, *entries[k + 1:]), **kwargs)
                return out.squeeze(k)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__len__, torch.Tensor.numel) and args and \
                self._handed(args[0]):
            at = user_line(traceback.extract_stack())
            at = f" at {at}" if at else ""
            raise TraceError(
                f"the model reads how many rows `torch.where(mask)` / `nonzero` returned "
                f"({'len()' if func is torch.Tensor.__len__ else 'numel()'}){at}. fxpar traces "
                "nonzero at a fixed size (mask.numel() rows, the missing ones padding), so "
                "that number would be the padded count, not the true one. Fix: count from "
                "the mask (`mask.sum()`, a tensor), or drop the check (an empty expert "
                "computes nothing that reaches the result).")
        if func in (torch.Tensor.unbind, torch.unbind) and args and self._handed(args[0]) \
                and args[0].dim() == 2 and (args[1:] or (kwargs.get("dim", 0),)) == (0,):
            return self._iterate(args[0])
        if args and isinstance(args[0], torch.Tensor) and (self.rows or self.decided):
            out = self._row_use(func, args, kwargs)
            if out is not None:
                return out
        if not (args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1):
            return func(*args, **kwargs)  # (a 0-d mask: nonzero's own error)
        shape = tuple(args[0].shape)
        if func is torch.where and len(args) == 1 and not kwargs:
            return self._out(tuple(padded_nonzero(args[0]).unbind(1)), shape)
        if func in (torch.nonzero, torch.Tensor.nonzero) and len(args) == 1 \
                and set(kwargs) <= {"as_tuple"}:
            out = padded_nonzero(args[0])
            return self._out(tuple(out.unbind(1)) if kwargs.get("as_tuple") else out, shape)
        if func in (torch.argwhere, torch.Tensor.argwhere) and len(args) == 1 and not kwargs:
            return self._out(padded_nonzero(args[0]), shape)
        return func(*args, **kwargs)


class _Rows(tuple):
    """unbind(0) of a padded nonzero (what `for e in nonzero(mask)` iterates): its rows; a
    loop over them marks each iteration in the graph as it starts (PaddedNonzero._iterate).
    Rows taken by position are not marked: `rewrite` refuses their Python-level uses."""

    def __new__(cls, rows, steps):
        self = super().__new__(cls, rows)
        self._steps = steps
        return self

    def __iter__(self):
        return self._steps


# padding rows' states, ordered: a row read through a padded index is exactly zero; ops that
# keep finite values finite give FINITE; anything else (a log of zero, a division) ANY
ZERO, FINITE, ANY = 0, 1, 2
_ZERO_AT_ZERO = {aten.neg.default, aten.relu.default, aten.silu.default, aten.gelu.default,
                 aten.tanh.default, aten.sin.default, aten.abs.default, aten.clone.default,
                 aten._to_copy.default, aten.leaky_relu.default, aten.hardtanh.default,
                 aten.alias.default, aten.sign.default, aten.erf.default}
_FINITE_SAFE = _ZERO_AT_ZERO | {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.sigmoid.default, aten.cos.default, aten.where.self,
    aten.pow.Tensor_Scalar,
    aten.clamp.default, aten.maximum.default, aten.minimum.default, aten.rsub.Scalar}
_GRAD_FIRST = {aten.silu_backward.default, aten.gelu_backward.default,
               aten.threshold_backward.default, aten.sigmoid_backward.default,
               aten.tanh_backward.default, aten.leaky_relu_backward.default,
               aten.hardtanh_backward.default}
_VIEWS = ir.RESHAPES | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                        aten.squeeze.default, aten.expand.default}
_INDEX_VIEWS = _VIEWS | {aten.clone.default, aten._to_copy.default, aten.alias.default,
                         aten.slice.Tensor}  # (with the shape unchanged: no-ops)
_READS = {aten.index.Tensor, aten._unsafe_index.Tensor}
_WRITES = {aten.index_put.default, aten._unsafe_index_put.default}


def rewrite(gm: torch.fx.GraphModule) -> int:
    """Replace every `padded_nonzero` marker by ATen ops and pad what its indices address;
    refuse (TraceError) a graph where padding rows could reach a result. Returns the count."""
    graph = gm.graph
    markers = [n for n in graph.nodes if n.target is torch.ops.fxpar.padded_nonzero.default]
    if not markers:
        return 0
    fake_propagate(gm, check=False)  # (capture's clean-up left some nodes without values)
    pads, present, rows_at, past_end = _check(graph, markers)
    if _drop_iterations(graph, past_end):
        alive = set(graph.nodes)
        pads = {n: dims for n, dims in pads.items() if n in alive}
        rows_at = {n: p for n, p in rows_at.items() if n in alive}
    shapes = {n: _shape(n.args[0]) for n in pads}  # (before earlier writes' cuts feed them)
    for n, dims in pads.items():
        _pad(graph, n, dims, shapes[n])
    for m in markers:
        _emit_positions(graph, m, every=m in present)
    for n, p in rows_at.items():
        _select_row(graph, n, p)
    for n in [n for n in graph.nodes if n.target is torch.ops.fxpar.loop_mark.default]:
        graph.erase_node(n)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    fake_propagate(gm, check=False)
    return len(markers)


def _shape(n) -> tuple | None:
    v = n.meta.get(ir.VAL) if isinstance(n, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _refuse(n: torch.fx.Node, why: str) -> TraceError:
    """Named by the op and its module (AOTAutograd's joint graph keeps no user lines)."""
    module = n.meta.get(ir.MODULE) or "<root>"
    return TraceError(
        f"cannot trace module '{module}': its `torch.where(mask)` / `nonzero` result is used "
        f"in a way fxpar cannot keep exact at a fixed size: {n.target} {why}. fxpar traces "
        "nonzero at its largest size (mask.numel() rows, the extra ones index -1 into a zero "
        "row) and accepts the uses it can prove exact: indexing and index writes with the "
        "indices, row-wise ops on the rows they read, sums of their gradients. Fix: use the "
        "routed rows only that way (no mean, max or count over them, no arithmetic on the "
        "indices), or route with a static-shape form (e.g. gather by a sorted order, or a "
        "dense mask multiply).")


def _aligned(d: int, ndim: int, out_ndim: int) -> int:
    return d + out_ndim - ndim


def _view_dim(in_shape, out_shape, d) -> int | None:
    """Where dim d of in_shape lands in out_shape (a view that keeps it whole), else None."""
    before = math.prod(in_shape[:d])
    for od, size in enumerate(out_shape):
        if math.prod(out_shape[:od]) == before and size == in_shape[d]:
            return od
    return None


def _check(graph: torch.fx.Graph, markers) -> dict:
    """Walk the graph; return {read/write node: padded dims}. Raises on an unprovable use."""
    index: dict[torch.fx.Node, int] = {m: _shape(m)[0] for m in markers}  # padded index -> M
    tuples: dict[torch.fx.Node, int] = {}        # unbind of a padded index -> M
    flipped: dict[torch.fx.Node, int] = {}       # a marker transposed, (ndim, M) -> M
    parts: dict[torch.fx.Node, tuple] = {}       # routed rows split along another dim
    rows: dict[torch.fx.Node, tuple[int, int]] = {}  # value -> (padded dim, state)
    # the mask each padded value comes from: row j of one mask's padding pairs with row j of
    # another's only by position, where eager pairs them by rank among true elements
    origin: dict[torch.fx.Node, torch.fx.Node] = {m: m.args[0] for m in markers}
    pads: dict[torch.fx.Node, list[int]] = {}
    counts = {m for m in index.values()}
    downstream: set[torch.fx.Node] = set(markers)
    # a loop over a padded index's rows (PaddedNonzero._iterate): its rows and their entries
    # (elements, by the row they come from), the values read through one (all zero where the
    # row is absent), and the masks of nonzeros taken of such values (all false there)
    row_tuples: set[torch.fx.Node] = set()
    elems: dict[torch.fx.Node, torch.fx.Node] = {}
    absent: dict[torch.fx.Node, tuple] = {}  # -> (row, all zero if absent, what it read)
    for n in graph.nodes:
        if n.op == "output":
            leaked = [a for a in n.all_input_nodes if a in rows or a in index]
            if leaked:
                raise _refuse(leaked[0], "reaches the graph's outputs with its padding rows")
            continue
        if n.op != "call_function" or n.target is torch.ops.fxpar.loop_mark.default:
            continue
        if n in index:
            continue
        ins = n.all_input_nodes
        if any(a in downstream for a in ins):
            downstream.add(n)
            if n.meta.get(ir.REGION) != ir.BACKWARD and not _checked_only(n):
                _scalars_not_count(n, counts)  # (a backward's mean over real rows, an
                # index's range check: not counts)
        if n.target is operator.getitem and n.args[0] in tuples:
            index[n], origin[n] = tuples[n.args[0]], origin[n.args[0]]
            continue
        if n.target is operator.getitem and n.args[0] in row_tuples:
            elems[n], origin[n] = n, origin[n.args[0]]
            if _shape(n) == (1,):
                index[n] = 1
            continue
        if any(a in elems for a in ins):
            if _element_op(n, elems, index, origin):
                continue
        if any(a in absent for a in ins) and not any(
                a in index or a in rows or a in tuples or a in flipped for a in ins):
            _absent_op(n, absent)
            continue
        if n.target is operator.getitem and n.args[0] in parts:
            rows[n], origin[n] = parts[n.args[0]], origin[n.args[0]]
            continue
        idx_in = [a for a in ins if a in index or a in tuples or a in flipped]
        row_in = [a for a in ins if a in rows]
        if not idx_in and not row_in:
            continue
        srcs = {origin[a] for a in idx_in + row_in}
        if len(srcs) > 1:
            raise _refuse(n, "combines values routed by different masks (their rows pair up "
                             "by position here, by rank among the true elements in eager)")
        if n.target in _READS or n.target in _WRITES or n.target is aten.index_select.default:
            _index_op(n, index, rows, pads)
            if n in rows and any(i in elems for i in _indices(n)):
                del rows[n]  # a read through a row of a loop: the row's own value, all of
                absent[n] = (next(elems[i] for i in _indices(n) if i in elems), True,
                             n.args[0] if _indices(n)[0] in elems else None)  # (all zero)
        elif idx_in:
            src = n.args[0]
            if row_in or len(idx_in) > 1 or src not in (*index, *flipped):
                raise _refuse(n, "combines the indices with other values")
            dim = n.args[1] if len(n.args) > 1 else 0
            shape, out = _shape(src), _shape(n)
            if n.target is aten.unbind.int and dim == 0 and src in markers:
                row_tuples.add(n)  # (the rows a loop over nonzero(mask) iterates)
            elif src in flipped:  # columns are dim 0 of a transposed marker
                if n.target is aten.unbind.int and dim == 0:
                    tuples[n] = flipped[src]
                elif n.target is aten.select.int and dim == 0:
                    index[n] = flipped[src]
                else:
                    raise _refuse(n, "computes with the indices (only indexing is exact)")
            elif n.target is aten.unbind.int and dim == 1 and len(shape) == 2:
                tuples[n] = index[src]
            elif n.target is aten.select.int and dim == 1 and len(shape) == 2:
                index[n] = index[src]
            elif n.target in (aten.t.default, aten.permute.default, aten.transpose.int) \
                    and len(shape) == 2 and out == shape[::-1]:
                flipped[n] = index[src]
            elif n.target in _INDEX_VIEWS and (out == shape or (
                    out == (index[src],) and math.prod(shape) == index[src])):
                index[n] = index[src]  # (the same values; (M, 1) -> (M,) too)
            else:
                raise _refuse(n, "computes with the indices (only indexing with them is exact)")
        elif n.target in (aten.split.Tensor, aten.split_with_sizes.default,
                          aten.unbind.int) and n.args[0] in rows:
            # pieces along another dim (a fused gate/up projection's chunks): each keeps
            # the rows
            d, st = rows[n.args[0]]
            ndim = len(_shape(n.args[0]))
            dim = (n.args[2] if len(n.args) > 2 else 0) if n.target is not aten.unbind.int \
                else (n.args[1] if len(n.args) > 1 else 0)
            if dim % ndim == d:
                raise _refuse(n, "splits the routed rows")
            parts[n] = (d - (n.target is aten.unbind.int and dim % ndim < d), st)
        else:
            out = _row_op(n, rows)
            if out is not None:
                rows[n] = out
        if n in rows or n in index or n in tuples or n in flipped or n in parts or \
                n in row_tuples:
            origin[n] = srcs.pop()
    present = _loops(graph, elems, absent, origin, pads)
    rows_at = {}  # reads through constant rows of one-dim hit lists -> the row
    for n in [n for n, dims in pads.items() if all(
            elems.get(_indices(n)[d]) is not None and _marker_of(elems[_indices(n)[d]]) in
            present and _shape(n.args[0])[d] > elems[_indices(n)[d]].args[1]
            for d in dims)]:
        del pads[n]  # (through a row that is its position p, never -1, to a row that
        # exists: a read of row p past the tensor's end, e.g. a hit list's masking class,
        # still reads the zero row its pad adds)
        i = _indices(n)
        if len(i) == 1 and _shape(_marker_of(elems[i[0]]))[1] == 1 and (
                n.target in _READS or _is_zero(n.args[0])):
            rows_at[n] = elems[i[0]].args[1]
    past_end = {(_marker_of(e), e.args[1]) for n, dims in pads.items() if n.target in _READS
                for d in dims if (e := elems.get(_indices(n)[d])) is not None and
                _marker_of(e) in present and _shape(n.args[0])[d] <= e.args[1]}
    return pads, present, rows_at, past_end


def _drop_iterations(graph: torch.fx.Graph, past_end: set) -> bool:
    """An iteration over a hit list whose row p reads a tensor past its end (DBRX's loop
    also visits the one_hot's masking class E, and its stacked weights hold E experts)
    raises IndexError in eager wherever row p is present: eager runs it only where row p
    is absent, and then it changes nothing (`_loops`). Such an iteration is removed, its
    forward and backward (each value it adds to a sum or writes into a tensor left out),
    and a run-time check raises where row p is present, as eager does. Returns whether any
    was removed (one whose effects are not such sums or writes is kept as traced)."""
    bodies: dict = {}
    current = None
    for n in graph.nodes:
        if n.target is torch.ops.fxpar.loop_mark.default:
            key = (_marker_of(n.args[0]), n.args[1]) if n.args[1] != -1 else None
            current = bodies.setdefault(key, []) if key in past_end else None
        elif current is not None and n.op == "call_function":
            current.append(n)
    dropped = False
    for (marker, p), body in bodies.items():
        found = _removal(body)
        if found is None:
            continue
        reach, plan = found
        for n, (kind, write) in plan:  # (each value read as the graph is now: sums chain)
            if kind == "base":
                base = write
                while base in reach:
                    base = base.args[0]
                n.replace_input_with(write, base)
            else:
                n.replace_all_uses_with(n.args[0] if kind == "write" else
                                        next(a for a in n.args if a not in reach))
        for n in reversed(body):  # (its own checks go too: eager's IndexError is checked below)
            if n.target in _CHECKS and not n.users:
                graph.erase_node(n)
        picks = marker.args[0].args[0].args[0]  # (the one_hot its hit list sums: _hit_list_of)
        meta = {ir.REGION: ir.FORWARD, ir.MODULE: marker.meta.get(ir.MODULE, "")}
        with graph.inserting_before(marker.next):
            row = graph.call_function(aten.select.int, (picks, 0, p))
            check = graph.call_function(torch.ops.fxpar.check_unrouted.default, (row, (
                f"fxpar: row {p} of a loop over nonzero's rows in module "
                f"'{meta[ir.MODULE]}' is present, and eager indexes past a tensor's end in "
                "that iteration (IndexError)")))
        for x in (row, check):
            x.meta.update(meta)
        dropped = True
    return dropped


def _removal(body: list) -> tuple | None:
    """How iteration `body` leaves the graph: (reach, [(node, kind)]) - what its values
    reach (the body and backward ops), and each place they stop: a user of one of
    its writes ("base": reads the value from before the iteration), a sum one of whose
    terms they compute ("add": the other term), an index write of a value they compute
    ("write": the tensor written into). None where anything else reads them."""
    inside = set(body)
    writes = {n for n in body if n.target in _WRITES}  # (into values from before: _loops)
    reach, plan = set(inside), []
    for n in body:
        plan += [(u, ("base", n)) for u in n.users if u not in inside and n in writes]
    based = {u for u, _ in plan}
    # (from the body on - nothing before it reads it - in order: inputs decided first)
    for n in itertools.dropwhile(lambda x: x is not body[0], body[0].graph.nodes):
        if n in based and any(a in reach and a not in writes for a in n.all_input_nodes):
            return None  # (a reader of a write that reads the iteration's values too)
        if n in reach or n in based or not any(a in reach for a in n.all_input_nodes):
            continue
        if n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs and \
                sum(a in reach for a in n.args) == 1:
            plan.append((n, ("add", None)))
        elif n.target in _WRITES and n.args[0] not in reach:
            plan.append((n, ("write", None)))
        elif n.meta.get(ir.REGION) == ir.BACKWARD and n.op == "call_function":
            reach.add(n)
        else:
            return None
    return reach, plan


def _select_row(graph: torch.fx.Graph, n: torch.fx.Node, p: int) -> None:
    """x[e] for a loop's row e that is constant p (a one-dim hit list taken as present):
    select(x, 0, p) - a view of one expert's weights rather than a copy, and a mask
    passes/grouped_experts.py reads as the expert's comparison (a one_hot's row p). Its
    backward, an index write of the gradient into zeros, becomes select's own backward
    (`select_backward(g, shape, 0, p)`), where p is known to the passes: a stack of experts'
    weights read one by one has its gradient as a sum of them (passes/grouped_experts)."""
    meta = {k: n.meta[k] for k in (ir.REGION, ir.MODULE) if k in n.meta}
    if n.target in _WRITES:
        shape, v = list(_shape(n.args[0])), n.args[2]
        if len(_shape(v)) == len(shape) and _shape(v)[0] == 1:
            v = v.args[0] if v.target is aten.unsqueeze.default and v.args[1] == 0 else None
        if v is None or list(_shape(v)) != shape[1:]:
            return  # (a broadcast or squeezed value: the index write stays, exact)
        with graph.inserting_before(n):
            grad = graph.call_function(aten.select_backward.default, (v, shape, 0, p))
            grad.meta.update(meta)
        n.replace_all_uses_with(grad)
        return
    with graph.inserting_before(n):
        row = graph.call_function(aten.select.int, (n.args[0], 0, p))
        row.meta.update(meta)
    for u in list(n.users):
        if u.target is aten.squeeze.dim and u.args[1] in (0, -len(_shape(n))):
            u.replace_all_uses_with(row)
    if n.users:
        with graph.inserting_before(n):
            one = graph.call_function(aten.unsqueeze.default, (row, 0))
            one.meta.update(meta)
        n.replace_all_uses_with(one)


def _indices(n: torch.fx.Node) -> list:
    return list(n.args[1]) if n.target in _READS or n.target in _WRITES else [n.args[2]]


def _element_op(n, elems, index, origin) -> bool:
    """An op on a row of a loop over nonzero's rows: an entry of it, a view of it (both
    still the row's), or a comparison Python control flow read (`if e == E`: PaddedNonzero
    decided it, so the graph's copy is unused). False: an index op, handled as one."""
    src = n.args[0]
    if n.target in _READS or n.target in _WRITES or n.target is aten.index_select.default:
        return False
    if not n.users:
        return True
    out = _shape(n)
    if src in elems and (n.target is aten.select.int or n.target in _INDEX_VIEWS) and \
            out in ((), (1,)) and len(n.all_input_nodes) == 1:
        elems[n], origin[n] = elems[src], origin[src]
        if out == (1,):
            index[n] = 1
        return True
    raise _refuse(n, "computes with a row of the loop over nonzero's rows (only indexing "
                     "with it, and comparing it in Python control flow, are exact)")


_ZERO_KEEPING = _VIEWS | _ZERO_AT_ZERO | {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.slice.Tensor,
    aten.select.int, aten.squeeze.dim, aten.ne.Scalar, aten.gt.Scalar, aten.mul.Scalar}


def _absent_op(n, absent) -> None:
    """An op on values read through a row of a loop over nonzero's rows (no padded rows in
    it): (the row, whether it is all zero where the row is absent - kept so by ops that map
    zero to zero, so that a nonzero of it finds nothing there)."""
    found = [absent[a] for a in n.all_input_nodes if a in absent]
    roots = {root for root, _, _ in found}
    if len(roots) != 1:
        raise _refuse(n, "combines values read through the rows of two loops over nonzero's "
                         "rows")
    zero = n.target in _ZERO_KEEPING and len(n.all_input_nodes) == 1 and found[0][1] and (
        n.target not in (aten.ne.Scalar, aten.gt.Scalar) or n.args[1] == 0) and (
        n.target is not aten.mul.Scalar or math.isfinite(n.args[1]))
    absent[n] = (roots.pop(), zero, found[0][2] if zero else None)


def _loops(graph, elems, absent, origin, pads) -> set:
    """A loop over nonzero(mask)'s rows runs every position of the mask (PaddedNonzero.
    _iterate) where eager runs the true ones. Where row p is absent, its tensors read a zero
    row, so every mask taken of them is all false and every index routed by such a mask is
    -1: exact if the iteration changes nothing else - if everything it computes that is used
    after it is an index write through those indices (dropped at -1) into a value from
    before it. Raises otherwise; returns the markers whose rows may all be taken present
    (`_hit_list_of`)."""
    if not elems:
        return set()
    masks = {m: root for m, (root, zero, _) in absent.items() if zero}  # all false if absent
    windows, current, looping = [], None, None
    for n in graph.nodes:
        if n.target is torch.ops.fxpar.loop_mark.default:
            marker = n.args[0] if n.args[1] == -1 else _marker_of(n.args[0])
            if looping is not None and marker is not looping:
                raise _refuse(n, "starts a loop over nonzero's rows inside another one")
            current = None if n.args[1] == -1 else (n.args[0], [])
            looping = None if current is None else marker
            if current is not None:
                windows.append(current)
        elif current is not None and n.op == "call_function":
            current[1].append(n)
        elif current is not None and n.op == "output":
            raise _refuse(current[0], "is a row of a loop over nonzero's rows left before its "
                                      "end (a `break`: eager's first rows are the true ones)")
    bodies = {root: set(body) for root, body in windows}
    routes = {_marker_of(root): set() for root in bodies}  # what each loop's writes route by
    for e, root in elems.items():  # (a row taken by position or unpacked is not eager's row)
        if any(u not in bodies.get(root, ()) and u.target is not
               torch.ops.fxpar.loop_mark.default and u.meta.get(ir.REGION) != ir.BACKWARD
               for u in e.users):
            raise _refuse(e, "is a row of nonzero's result used outside a loop over them "
                             "(its rows in eager are the true positions only)")
    for root, body in windows:
        inside, writes = set(body), set()
        for n in body:
            if n in pads and n.target in _WRITES and any(
                    elems.get(i) is root or masks.get(origin.get(i)) is root
                    for i in _indices(n) if i is not None) and (
                    n.args[0] not in inside or n.args[0] in writes):
                writes.add(n)  # (into a value from before the iteration, or such a write)
        for n in body:
            leaves = [u for u in n.users if u not in inside and (
                u.op == "output" or u.meta.get(ir.REGION) != ir.BACKWARD)]
            if not leaves:
                continue
            if n not in writes:
                raise _refuse(n, "leaves an iteration of the loop over nonzero's rows other "
                                 "than as an index write through the rows that iteration "
                                 "routes by `torch.where` of a value read through its row "
                                 "(where the row is absent, eager runs no iteration: fxpar "
                                 "runs it on padding, which must change nothing)")
            routes[_marker_of(root)].update(
                absent[origin[i]][2] if origin.get(i) in masks else None
                for i in _indices(n) if i is not None and i not in elems)
            routes[_marker_of(root)].update(
                None for i in _indices(n) if i is not None and i in elems)
    return {m for m, srcs in routes.items() if len(srcs) == 1 and _hit_list_of(m, *srcs)}


def _marker_of(row: torch.fx.Node) -> torch.fx.Node:
    return row.args[0].args[0]  # (getitem of the marker's unbind)


def _hit_list_of(marker: torch.fx.Node, x) -> bool:
    """The marker iterated is nonzero(sum(x over all dims but the first) > 0), x counts of
    picks (a one_hot), and each iteration routes by where(x[row]): where the row is absent
    x[row] is all zero, so it runs on padding reading the true row as it does reading the
    zero one - every row may be taken present, the positions constant (no -1 to pad for,
    nothing computed from the whole batch's routing to iterate)."""
    hit = marker.args[0]
    if x is None or hit.target not in (aten.gt.Scalar, aten.ne.Scalar) or hit.args[1] != 0:
        return False
    total = hit.args[0]
    if total.target is not aten.sum.dim_IntList or total.args[0] is not x:
        return False
    ndim = len(_shape(x))
    if sorted(d % ndim for d in total.args[1]) != list(range(1, ndim)):
        return False
    src = x  # (non-negative: a one_hot, or a bool mask however stored)
    while src.meta[ir.VAL].dtype is not torch.bool and (
            src.target in _INDEX_VIEWS or src.target in (
                aten.permute.default, aten.t.default, aten.transpose.int)):
        src = src.args[0]
    return src.target is aten.one_hot.default or src.meta[ir.VAL].dtype is torch.bool


_CHECKS = {aten._assert_async.msg, aten._assert_async.default, aten.all.default,
           aten.any.default}


def _checked_only(n: torch.fx.Node) -> bool:
    """n is read only by a runtime check (an index's range assert), through all / any."""
    return bool(n.users) and all(u.target in _CHECKS and (
        not u.users or _checked_only(u)) for u in n.users)


def _scalars_not_count(n: torch.fx.Node, counts: set) -> None:
    """A count read as a number shows up as a scalar operand of arithmetic (`/ len(idx)`);
    shape arguments (a view, an embedding's row count) may equal it by chance."""
    if not isinstance(n.target, torch._ops.OpOverload) or torch.Tag.pointwise not in \
            n.target.tags:
        return
    for a in (*n.args, *n.kwargs.values()):
        if isinstance(a, (int, float)) and not isinstance(a, bool) and a in counts:
            raise _refuse(n, f"uses the number {a}, the padded row count (is the count of "
                             "routed rows, e.g. len(token_idx), read as a Python number?)")


def _index_op(n, index, rows, pads) -> None:
    is_write = n.target in _WRITES
    src = n.args[0]
    if n.target is aten.index_select.default:  # index_select(src, dim, idx): a read at dim
        dim = n.args[1] % len(_shape(src))
        indices = [None] * dim + [n.args[2]]
    else:
        indices = list(n.args[1])
    if src in rows or src in index:
        raise _refuse(n, "indexes a tensor that holds padding rows")
    if any(i in rows for i in indices):  # (padding rows' values would pick real positions)
        raise _refuse(n, "indexes with values computed from the routed rows")
    padded = [d for d, i in enumerate(indices) if i in index]
    if not padded:  # the padded value is a written value through an ordinary index
        raise _refuse(n, "writes padding rows through an index that does not drop them")
    m = index[indices[padded[0]]]
    given = [d for d, i in enumerate(indices) if i is not None]
    if any(_shape(indices[d]) != (m,) for d in given) or given != list(
            range(given[0], given[-1] + 1)):
        raise _refuse(n, "indexes with indices of another shape or in non-adjacent dims")
    if any(not _constant_along(indices[d], 0) for d in given if d not in padded):
        raise _refuse(n, "pairs the indices with another index of as many rows")
    pads[n] = padded
    if not is_write:
        rows[n] = (given[0], ZERO)
        return
    values = n.args[2]
    if values in index:
        raise _refuse(n, "writes the indices themselves")
    out_ndim = len(_shape(src)) - len(given) + 1
    if values in rows:
        vd, _ = rows[values]
        if _aligned(vd, len(_shape(values)), out_ndim) != given[0]:
            raise _refuse(n, "writes values whose padding rows are not the indexed rows")
    else:
        d = given[0] - (out_ndim - len(_shape(values)))
        if 0 <= d and _shape(values)[d] != 1 and not _constant_along(values, d):
            raise _refuse(n, "writes values of as many rows not read through the indices")


def _constant_along(n: torch.fx.Node, d: int, depth: int = 0) -> bool:
    """n's value is the same at every position of dim d - a fill, a broadcast of size 1
    there, views and pointwise ops of such values (the backward of a sum over routed rows
    expands its gradient to them) - so pairing it with routed rows by position is what
    eager's pairing by rank gives."""
    t, shape = n.target, _shape(n)
    if shape is None or not 0 <= d < len(shape) or depth > 32:
        return False
    if shape[d] == 1 or t in (
            aten.full.default, aten.zeros.default, aten.ones.default, aten.new_zeros.default,
            aten.new_ones.default, aten.new_full.default, aten.full_like.default,
            aten.zeros_like.default, aten.ones_like.default, aten.scalar_tensor.default):
        return True
    if t is aten.expand.default:
        src = _shape(n.args[0])
        k = d - (len(shape) - len(src))
        return k < 0 or src[k] == 1 or _constant_along(n.args[0], k, depth + 1)
    if t in _VIEWS:
        k = _view_dim(shape, _shape(n.args[0]), d)
        return k is not None and _constant_along(n.args[0], k, depth + 1)
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        for a in n.all_input_nodes:
            sa = _shape(a)
            k = d - (len(shape) - len(sa)) if sa is not None else -1
            if sa is not None and 0 <= k and sa[k] != 1 and not _constant_along(a, k,
                                                                                 depth + 1):
                return False
        return True
    return False


def _row_op(n: torch.fx.Node, rows) -> tuple[int, int] | None:
    """(padded dim, state) of n's output, n having an input with padding rows; None where
    the output holds none (the padding rows summed away as exact zeros)."""
    t = n.target
    out = _shape(n)
    x = n.args[0]
    if out is None:
        raise _refuse(n, "returns several values from rows holding padding")
    if t in _VIEWS or t in (aten.t.default, aten.transpose.int, aten.permute.default,
                            aten.slice.Tensor, aten.select.int):
        if x not in rows:
            raise _refuse(n, "gives a view shaped by padded rows")
        d, st = rows[x]
        ins = _shape(x)
        if t is aten.t.default:
            return (1 - d if len(ins) == 2 else d), st
        if t is aten.transpose.int:
            a, b = (k % len(ins) for k in n.args[1:3])
            return (b if d == a else a if d == b else d), st
        if t is aten.permute.default:
            return [k % len(ins) for k in n.args[1]].index(d), st
        if t in (aten.slice.Tensor, aten.select.int):
            dim = n.args[1] % len(ins)
            if dim == d:
                raise _refuse(n, "slices the routed rows (the padding would move in)")
            return (d - (t is aten.select.int and dim < d)), st
        if t is aten.expand.default:
            od = _aligned(d, len(ins), len(out))
            if out[od] != ins[d]:
                raise _refuse(n, "expands the routed rows")
            return od, st
        od = _view_dim(ins, out, d)
        if od is None:
            raise _refuse(n, "reshapes the routed rows together with another dim")
        return od, st
    if t in (aten.mm.default, aten.bmm.default, aten.addmm.default):
        return _matmul(n, rows)
    if t is aten.cat.default:  # pieces joined along another dim (a split's backward)
        ins = n.args[0]
        dim = (n.args[1] if len(n.args) > 1 else 0) % len(out)
        ds = {rows[a][0] for a in ins if a in rows}
        if len(ds) != 1 or dim in ds or any(
                a not in rows and not _constant_along(a, next(iter(ds))) for a in ins):
            raise _refuse(n, "joins routed rows with other rows")
        states = [rows[a][1] if a in rows else FINITE for a in ins]
        return next(iter(ds)), max(states)
    if t in (aten.slice_backward.default, aten.select_backward.default):
        d, st = rows[x]  # a slice's gradient: zeros around the rows' own gradient
        dim = n.args[2] % len(out)
        od = d + (t is aten.select_backward.default and dim <= d)
        if dim == od:
            raise _refuse(n, "slices the routed rows")
        return od, st
    if t in (aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
             aten.amax.default,
             aten.amin.default, aten._softmax.default, aten._log_softmax.default):
        d, st = rows[x]
        ndim = len(_shape(x))
        if t in (aten.sum.default, aten.mean.default):
            dims = list(range(ndim))
        elif t in (aten._softmax.default, aten._log_softmax.default):
            dims = [n.args[1]]
        else:
            dims = n.args[1] if len(n.args) > 1 and n.args[1] else list(range(ndim))
        dims = [k % ndim for k in ([dims] if isinstance(dims, int) else dims)]
        if d in dims:
            if t not in (aten.sum.dim_IntList, aten.sum.default) or st != ZERO:
                raise _refuse(n, "reduces over the routed rows, padding included")
            return None
        keep = t in (aten._softmax.default, aten._log_softmax.default) or (
            len(n.args) > 2 and n.args[2]) or n.kwargs.get("keepdim")
        od = d if keep else d - sum(k < d for k in dims)
        return od, (st if t in (aten.sum.dim_IntList, aten.sum.default) else max(st, FINITE))
    if t is aten._softmax_backward_data.default:
        d, st = rows[n.args[0]]
        if n.args[2] % len(out) == d:
            raise _refuse(n, "reduces over the routed rows, padding included")
        return d, (ZERO if st == ZERO and n.args[1] in rows and rows[n.args[1]][1] < ANY
                   else max(st, FINITE))
    if t in (aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default,
             aten.new_full.default):
        return None  # a fresh tensor of the size given: nothing of the rows in it
    if t in (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
             aten.empty_like.default):
        return rows[x][0], (ZERO if t is aten.zeros_like.default else ANY)
    if t in _FINITE_SAFE or t in _GRAD_FIRST or (
            isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        return _pointwise(n, rows)
    raise _refuse(n, "is not an op fxpar can prove exact on padding rows")


def _pointwise(n, rows) -> tuple[int, int]:
    out = _shape(n)
    tensors = [a for a in n.all_input_nodes if _shape(a) is not None]
    od = None
    for a in tensors:
        if a in rows:
            d = _aligned(rows[a][0], len(_shape(a)), len(out))
            if od is not None and d != od:
                raise _refuse(n, "combines padding rows of different dims")
            od = d
    states = [rows[a][1] for a in tensors if a in rows]
    others = [a for a in tensors if a not in rows]
    for a in others:
        d = od - (len(out) - len(_shape(a)))
        if 0 <= d and _shape(a)[d] != 1:
            # a tensor of as many rows not read through the indices: only one constant along
            # them pairs with routed rows as in eager (the backward of a sum over routed rows
            # expands its gradient to them); its padding rows hold that value, finite
            if not _constant_along(a, d):
                raise _refuse(n, "combines routed rows with a tensor of as many rows that "
                                 "was not read through the indices")
            states.append(FINITE)
    t = n.target
    if t is aten.where.self:
        # padding rows take either branch: the value is theirs, whatever the condition (a
        # gradient masked by a clamp's backward: where(mask, grad, 0)); another tensor's
        # value may be anything (-inf) unless it is a zero
        return od, max(rows[a][1] if a in rows else ZERO if _is_zero(a) else ANY
                       for a in n.args[1:3])
    first = n.args[0] if n.args else None
    first_st = rows[first][1] if first in rows else None
    if t is aten.pow.Tensor_Scalar:  # 0 ** -k is inf; a negative base ** 0.5 is nan
        k = n.args[1]
        whole = float(k).is_integer()
        st = ((ZERO if states == [ZERO] else FINITE) if k > 0 and (whole or states == [ZERO])
              else ANY)
    elif t is aten.hardtanh.default and not (
            (n.args[1] if len(n.args) > 1 else -1.0) <= 0 <= (n.args[2] if len(n.args) > 2
                                                              else 1.0)):
        st = max(max(states), FINITE)  # (hardtanh(0) is min_val where min_val > 0)
    elif t in _ZERO_AT_ZERO and states == [ZERO]:
        st = ZERO
    elif t is aten.clamp.default and states == [ZERO] and _holds_zero(n):
        st = ZERO  # (a clamp whose range holds 0 keeps zero rows zero)
    elif t in (aten.mul.Tensor, aten.mul.Scalar) and ZERO in states and max(states) < ANY:
        st = ZERO
    elif t in (aten.div.Tensor, aten.div.Scalar) and first_st == ZERO and len(states) == 1:
        st = ZERO  # zero rows over a divisor without padding rows
    elif t in (aten.add.Tensor, aten.sub.Tensor) and not others and max(states) == ZERO \
            and all(isinstance(a, torch.fx.Node) for a in n.args[:2]):
        st = ZERO
    elif t in _GRAD_FIRST and first_st == ZERO and max(states) < ANY:
        st = ZERO
    elif (t in _FINITE_SAFE or t in _GRAD_FIRST) and max(states) < ANY:
        st = max(FINITE, max(states))
    else:
        st = ANY
    return od, st


def _holds_zero(n: torch.fx.Node) -> bool:
    """clamp(x, min, max) maps 0 to 0."""
    lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
    hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
    return (lo is None or lo <= 0) and (hi is None or hi >= 0)


def _is_zero(a) -> bool:
    """A value that is exactly zero everywhere: a zero fill, or a view or cast of one."""
    if not isinstance(a, torch.fx.Node):
        return a == 0
    while a.target in _INDEX_VIEWS:
        a = a.args[0]
    fill = {aten.scalar_tensor.default: 0, aten.full.default: 1, aten.full_like.default: 1,
            aten.new_full.default: 2}
    if a.target in fill:
        return a.args[fill[a.target]] == 0
    return a.target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


def _matmul(n, rows):
    t = n.target
    a, b = n.args[1:3] if t is aten.addmm.default else n.args[:2]
    if t is aten.addmm.default and n.args[0] in rows:
        raise _refuse(n, "adds padding rows as a bias")
    off = 1 if t is aten.bmm.default else 0
    da = rows[a][0] - off if a in rows else None
    db = rows[b][0] - off if b in rows else None
    sa = rows[a][1] if a in rows else None
    sb = rows[b][1] if b in rows else None
    if off and (da == -1 or db == -1):  # the batch dim of bmm: batches are independent
        if not (da == db == -1):
            raise _refuse(n, "multiplies routed rows with a batch of as many matrices")
        st = ZERO if ZERO in (sa, sb) and max(sa, sb) < ANY else max(sa, sb, FINITE)
        return 0, st
    if da == 1 or db == 0:  # the contracted dim
        if da != 1 or db != 0:
            raise _refuse(n, "contracts routed rows with a tensor of as many rows")
        if not (ZERO in (sa, sb) and max(sa, sb) < ANY):
            raise _refuse(n, "sums products over the routed rows, padding rows non-zero")
        if t is aten.addmm.default:
            raise _refuse(n, "sums products over the routed rows into a bias")
        return None
    if da is not None and db is not None:  # rows against rows: padding meets real rows
        raise _refuse(n, "multiplies routed rows with routed rows (an outer product)")
    st = sa if da is not None else sb
    if t is aten.addmm.default:
        st = max(st, FINITE)
    return ((da if da is not None else 1) + off), st


def _pad(graph: torch.fx.Graph, n: torch.fx.Node, dims: list[int], shape: tuple) -> None:
    """n indexes (or writes) its first argument through padded indices in `dims`: index a
    copy with one zero row more in each (a -1 addresses it); a write's result cut back."""
    src = n.args[0]
    low = min(dims)
    spec = []
    for j in reversed(range(low, len(shape))):
        spec += [0, 1 if j in dims else 0]
    meta = {k: n.meta[k] for k in (ir.REGION, ir.MODULE) if k in n.meta}
    with graph.inserting_before(n):
        padded = graph.call_function(aten.constant_pad_nd.default, (src, spec, 0))
        padded.meta.update(meta)
    n.update_arg(0, padded)
    if n.target is aten.index_select.default:  # (which takes no -1): the same read as index
        n.target = aten.index.Tensor
        n.args = (padded, [None] * dims[0] + [n.args[2]])
    if n.target not in _WRITES:
        return
    users = list(n.users)
    with graph.inserting_before(n.next):
        cut = n
        for d in dims:
            cut = graph.call_function(aten.slice.Tensor, (cut, d, 0, shape[d]))
            cut.meta.update(meta)
    for u in users:
        u.replace_input_with(n, cut)


def _enumeration_order(m: torch.fx.Node) -> list[int]:
    """The mask's dims in the order its positions are listed: by stride, largest first (the
    memory order), where no loop iterates the rows (a loop's row p is position p in
    row-major order, as `PaddedNonzero._iterate` decided while tracing).

    A routing mask that is a permuted view of a token-major tensor (Hugging Face's
    `one_hot(picks, E).permute(2, 1, 0)[e]`: (k, tokens)) so lists its positions token by
    token, and a data-parallel rank's tokens are one block of them: core/local_dispatch
    then runs the dispatch on each rank's own rows instead of gathering them. Only the
    order of the routed rows changes: the trace reads them pairwise and writes them by
    their positions (`_check`), so each result is eager's up to the order of the sums over
    rows (a weight's gradient), as any grouped matmul's."""
    v = m.args[0].meta[ir.VAL]
    dims = list(range(v.dim()))
    if any(u.target is aten.unbind.int and (u.args[1] if len(u.args) > 1 else 0) == 0
           for u in m.users):
        return dims
    moved = iter(sorted((d for d in dims if v.shape[d] > 1), key=lambda d: -v.stride(d)))
    return [d if v.shape[d] == 1 else next(moved) for d in dims]  # (size-1 dims stay)


def _emit_positions(graph: torch.fx.Graph, m: torch.fx.Node, every: bool = False) -> None:
    """The marker's value in ATen ops: each dim's arange broadcast over the mask's shape
    (listed in `_enumeration_order`), flattened and stacked in the mask's dim order, -1
    where the mask is false (every: all positions, a loop's rows `_hit_list_of` proved may
    all be present)."""
    mask = m.args[0]
    shape = _shape(mask)
    dev = mask.meta[ir.VAL].device
    meta = {k: m.meta[k] for k in (ir.REGION, ir.MODULE) if k in m.meta}

    def call(op, *args, **kwargs):
        node = graph.call_function(op, args, kwargs)
        node.meta.update(meta)
        return node

    order = _enumeration_order(m)
    grid = [shape[d] for d in order]
    with graph.inserting_before(m):
        cols = [None] * len(shape)
        for j, d in enumerate(order):
            r = call(aten.arange.default, shape[d], dtype=torch.int64, device=dev)
            r = call(aten.view.default, r, [grid[j] if k == j else 1 for k in range(len(grid))])
            r = call(aten.expand.default, r, grid)
            cols[d] = call(aten.reshape.default, r, [-1])
        pos = call(aten.stack.default, cols, 1)
        if every:
            m.replace_all_uses_with(pos)
            graph.erase_node(m)
            return
        flat = mask if order == sorted(order) else call(aten.permute.default, mask, order)
        flat = call(aten.reshape.default, flat, [-1, 1])
        if mask.meta[ir.VAL].dtype != torch.bool:
            flat = call(aten.ne.Scalar, flat, 0)
        out = call(aten.where.ScalarOther, flat, pos, -1)
    m.replace_all_uses_with(out)
    graph.erase_node(m)


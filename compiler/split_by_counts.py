"""Rows split by counts read as Python numbers, each piece through its own expert: traced as
one grouped matmul (JetMoE's parallel experts, ScatterMoE-style code).

    sizes = counts.tolist()                        # rows per expert: values, not shapes
    pieces = x.split(sizes)                        # x: the rows sorted by expert
    y = torch.cat([F.linear(p, w[i]) for i, p in enumerate(pieces)])

has as many pieces as experts, but their sizes are values: one static graph cannot hold
them. What it computes is a grouped matmul: row r of x times the weight of the piece it falls
in, the pieces ending at cumsum(counts). While tracing (`SplitByCounts`), `tolist()` of a 1-D
integer tensor gives counts that only `split` may take; the pieces only `F.linear` (no
bias); and the `cat` of all the products, in order, becomes
`aten._grouped_mm(x, w_0..w_E-1 transposed and stacked, offs=cumsum(counts))` - exactly the
rows eager multiplies by each expert (passes/expert_parallel.py then finds it as it finds
Hugging Face's grouped experts). Any other use is refused by a TraceError naming it: a count
read as a number (`if size == 0`, `sum(sizes)`), a piece or a product used another way.
"""
from __future__ import annotations

import traceback
import weakref

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.overrides import TorchFunctionMode

from fxpar.core.errors import TraceError, user_line


def _refuse(what: str) -> TraceError:
    at = user_line(traceback.extract_stack())
    return TraceError(
        f"{what}{f' at {at}' if at else ''}. fxpar traces one static graph: counts read as "
        "Python numbers (`counts.tolist()`) are taken only as the sizes of `x.split(sizes)` whose pieces "
        "each go through one `F.linear` (no bias) and are joined by `torch.cat` in order - "
        "one grouped matmul. Fix: use the counts that way, or route with tensors (sort the "
        "rows by expert and pass `torch.cumsum(counts, 0)` as `torch._grouped_mm`'s offs, or "
        "mask with `torch.where`).")


class _Count:
    """One expert's row count from `tolist()`: a value no static graph knows."""

    def __init__(self, counts: torch.Tensor, i: int):
        self.counts, self.i = counts, i

    def _number(self, *_):
        raise _refuse("the model reads a count of rows per expert as a Python number")

    __index__ = __int__ = __float__ = __bool__ = _number
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _number
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _number
    __floordiv__ = __truediv__ = __mod__ = _number
    __hash__ = object.__hash__

    def __repr__(self):
        return f"<count of expert {self.i} (a value, not known while tracing)>"


class _Counts(list):
    """`tolist()` of a tensor of counts: only `split` takes it whole."""


class SplitByCounts(TorchFunctionMode):
    """While tracing: rows split by `counts.tolist()` into per-expert linears, as one grouped
    matmul (see the module docstring)."""

    def __init__(self):
        super().__init__()
        # a piece of x.split(counts) -> (x, counts, i); a product F.linear(piece, w) ->
        # (x, counts, i, w): by identity, the tensors handed to the model
        self.pieces: dict[int, tuple] = {}
        self.products: dict[int, tuple] = {}
        # w[i] of a stack of expert weights read while pieces exist -> (w, i)
        self.picked: dict[int, tuple] = {}

    def __enter__(self):
        # AOTAutograd hands the model FunctionalTensors, whose tolist() is a Python method
        # that reads each element (no torch function): seen here instead while tracing
        from torch._subclasses.functional_tensor import FunctionalTensor
        self._tolist = FunctionalTensor.tolist

        def tolist(t):
            return self._read(lambda: self._tolist(t), t)
        FunctionalTensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        from torch._subclasses.functional_tensor import FunctionalTensor
        FunctionalTensor.tolist = self._tolist
        return super().__exit__(*exc)

    @staticmethod
    def _is_counts(t) -> bool:
        return t.dim() == 1 and not t.is_floating_point() and not t.is_complex() and \
            t.dtype is not torch.bool

    def _read(self, tolist, t):
        """tolist() where tracing knows the values (a constant); else, of a 1-D integer
        tensor, counts only `split` takes."""
        try:
            return tolist()
        except DataDependentOutputException:
            if not self._is_counts(t):
                raise
            return _Counts(_Count(t, i) for i in range(t.shape[0]))

    def _known(self, table, t):
        r = table.get(id(t)) if isinstance(t, torch.Tensor) else None
        return r[1:] if r is not None and r[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:
            return self._read(lambda: func(*args, **kwargs), args[0])
        if not (self.pieces or self.products) and not any(
                isinstance(a, _Counts) for a in (*args, *kwargs.values())):
            return func(*args, **kwargs)
        if func in (torch.Tensor.split, torch.split) and len(args) > 1 and \
                isinstance(args[1], _Counts):
            return self._split(args[0], args[1], args[2] if len(args) > 2 else
                               kwargs.get("dim", 0))
        piece = self._known(self.pieces, args[0]) if args else None
        if func is F.linear and piece is not None:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is not None:
                raise _refuse("a piece of rows split by counts goes through a linear with a "
                              "bias")
            x, counts, i = piece
            w = args[1]
            out = x.new_empty((0, w.shape[0]))  # (a stand-in: only `cat` reads it)
            self.products[id(out)] = (weakref.ref(out), x, counts, i, w)
            return out
        if func is torch.Tensor.__getitem__ and self.pieces and isinstance(args[1], int) and \
                not isinstance(args[1], bool) and args[0].dim() == 3:
            out = func(*args, **kwargs)
            self.picked[id(out)] = (weakref.ref(out), args[0], args[1] % args[0].shape[0])
            return out
        if func is torch.cat:
            tensors = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            found = [self._known(self.products, t) for t in tensors]
            if any(f is not None for f in found):
                return self._grouped(found, dim)
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if self._known(self.pieces, a) is not None or \
                    self._known(self.products, a) is not None:
                raise _refuse(f"{getattr(func, '__name__', func)} takes rows split by "
                              "counts (or an expert's product of them)")
            if isinstance(a, (_Count, _Counts)):
                raise _refuse(f"{getattr(func, '__name__', func)} takes counts of rows per "
                              "expert read as Python numbers")
        return func(*args, **kwargs)

    def _split(self, x: torch.Tensor, sizes: _Counts, dim: int):
        counts = {id(c.counts) for c in sizes}
        if len(counts) != 1 or [c.i for c in sizes] != list(range(len(sizes))) or \
                dim % x.dim() != 0:
            raise _refuse("rows are split by counts other than one `tolist()` whole, or "
                          "along a dim other than the first")
        pieces = []
        for c in sizes:
            p = x.view(x.shape)  # (one object per piece: x whole, its rows told by offs)
            self.pieces[id(p)] = (weakref.ref(p), x, c.counts, c.i)
            pieces.append(p)
        return tuple(pieces)

    def _grouped(self, found: list, dim: int) -> torch.Tensor:
        if any(f is None for f in found):
            raise _refuse("`cat` joins an expert's product of rows split by counts with "
                          "other tensors")
        xs = {id(x) for x, *_ in found}
        counts = found[0][1]
        if len(xs) != 1 or any(c is not counts for _, c, _, _ in found) or \
                [i for _, _, i, _ in found] != list(range(counts.shape[0])) or dim % 2 != 0:
            raise _refuse("`cat` joins products of rows split by counts other than every "
                          "expert's, in order, along the rows")
        x = found[0][0]
        picked = [self._known(self.picked, w) for *_, w in found]
        if all(p is not None and p[0] is picked[0][0] and p[1] == i
               for i, p in enumerate(picked)) and picked[0][0].shape[0] == len(found):
            weights = picked[0][0].transpose(1, 2)  # (the stack itself: (experts, in, out))
        else:
            weights = torch.stack([w.t() for *_, w in found])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, weights, offs=offs)

"""Index values from the batch that are out of range, named in the user's terms.

An embedding id >= the table's rows, or a cross-entropy target outside [0, classes), makes
ATen raise a bare `IndexError: index out of range in self`, or Inductor's kernel raise
`index out of bounds: 0 <= tmp2 < 4096L` - or, inside an OpenMP region of a CPU kernel,
abort the process - from deep inside the runtime. `bad_index` finds the op instead: it
evaluates only the part of a rank's graph computed from the batch alone (views, a label
shift, an ignore_index mask: no parameter, collective or random op), up to each index op's
indices, and checks them against the range that op accepts. That part is small, needs no
other rank, and fxpar's own rewrites pass: tensor parallelism's vocabulary-parallel lookups
shift and mask the ids into this rank's rows before they index.

The trainer calls it before a program's first step (a crash there could not be caught) and
after a step raised an index-type error (`is_index_error`); never on a steady-state step.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from fxpar.core import ir
from fxpar.core.ir import ancestors

aten = torch.ops.aten
_WORDS = ("index out of range", "index out of bounds", "out of bounds", "indices out of")
# ops taking (self, dim, index, ...): indices into self's dim, 0 <= i < size
_DIM_INDEXED = (aten.gather.default, aten.index_select.default, aten.scatter.src,
                aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
                aten.index_add.default, aten.index_copy.default, aten.index_fill.int_Scalar)
# ops taking (self, [index per dim], ...): -size <= i < size
_LIST_INDEXED = (aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default,
                 aten._unsafe_index_put.default)
_NLL = {aten.nll_loss_forward.default: (0, 1, 4), aten.nll_loss2d_forward.default: (0, 1, 4),
        aten.nll_loss_backward.default: (1, 2, 5), aten.nll_loss2d_backward.default: (1, 2, 5)}


def is_index_error(e: BaseException) -> bool:
    """ATen's IndexError or an Inductor kernel's bounds check (a RuntimeError)."""
    text = str(e).lower()
    return isinstance(e, (IndexError, RuntimeError)) and any(w in text for w in _WORDS)


def bad_index(gm: torch.fx.GraphModule, inputs: dict[torch.fx.Node, tuple[torch.Tensor, str]]
              ) -> str | None:
    """The first index op of `gm` (graph order) whose indices, computed from the batch
    leaves `inputs` ({placeholder: (value, name in the batch)}) alone, fall outside the range
    the op accepts: a message naming the op, its module, the range and the likely cause.
    None when every such op's indices are in range (or none is computed from the batch)."""
    values: dict[torch.fx.Node, object] = {ph: v for ph, (v, _) in inputs.items()}
    sources = {ph: name for ph, (_, name) in inputs.items()}
    from_batch = _from_batch(gm.graph, set(inputs))
    for n in gm.graph.nodes:
        for index, size, negative_ok, ignore, kind in _indexed(n):
            if not isinstance(index, torch.fx.Node) or index not in from_batch:
                continue
            got = _evaluate(gm, index, values)
            if not isinstance(got, torch.Tensor) or got.dtype == torch.bool or not got.numel():
                continue
            ok = (got >= (-size if negative_ok else 0)) & (got < size)
            if ignore is not None:
                ok |= got == ignore
            if bool(ok.all()):
                continue
            leaves = sorted({sources[a] for a in ancestors([index]) if a in sources})
            return _message(n, kind, got[~ok], got.numel(), size, ignore, negative_ok, leaves)
    return None


def _from_batch(graph: torch.fx.Graph, leaves: set) -> set:
    """Nodes computed from the batch leaves by pure ops alone (plus constants)."""
    out = set(leaves)
    for n in graph.nodes:
        ins = n.all_input_nodes
        if n.op == "call_function" and _pure(n.target) and any(a in out for a in ins) and \
                all(a in out or _constant(a) for a in ins):
            out.add(n)
    return out


def _pure(target) -> bool:
    """A deterministic op with no side effect: safe to run again on one rank alone."""
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if target.namespace == "fxpar":  # tp's ids - rank * rows (core/vocab_parallel.py)
        return target._opname == "localize"
    return target.namespace in ("aten", "prims") and \
        torch.Tag.nondeterministic_seeded not in target.tags


def _constant(n: torch.fx.Node) -> bool:
    return n.op == "get_attr" or (n.op == "call_function" and not n.all_input_nodes
                                  and _pure(n.target))


def _evaluate(gm: torch.fx.GraphModule, node: torch.fx.Node, values: dict):
    """`node`'s value, computing its (batch-only) ancestors in graph order into `values`."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted(ancestors([node]) - values.keys(), key=order.__getitem__):
        if n.op == "get_attr":
            values[n] = torch.fx.Interpreter(gm).fetch_attr(n.target)
        else:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
            values[n] = n.target(*args, **kwargs)
    return values[node]


def _indexed(n: torch.fx.Node) -> list[tuple]:
    """(index node, size, negatives allowed, ignored value, kind) for each index argument
    of an op that reads by index; [] for any other node."""
    if n.op != "call_function":
        return []
    t, a = n.target, n.args

    def shape(x):
        v = x.meta.get(ir.VAL) if isinstance(x, torch.fx.Node) else None
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    if t is aten.embedding.default and shape(a[0]):
        return [(a[1], shape(a[0])[0], False, None, "embedding")]
    if t is aten.embedding_dense_backward.default:
        return [(a[1], a[2], False, None, "embedding")]
    if t in _NLL and shape(a[_NLL[t][0]]) is not None:
        s = shape(a[_NLL[t][0]])
        return [(a[_NLL[t][1]], s[0] if len(s) == 1 else s[1], False, a[_NLL[t][2]], "target")]
    if str(t) == "fxpar.cross_entropy.default" and shape(a[0]):  # (kernels/library.py)
        return [(a[1], shape(a[0])[-1], False, a[3], "target")]
    if t in _DIM_INDEXED and shape(a[0]) is not None:
        s = shape(a[0])
        # Plan.codegen's cross-entropy (passes/fusion.py) picks each row's target logit
        # with a gather of where(target != ignore_index, target, 0)
        ignore = next((x.args[1] for x in ancestors([a[2]]) if x.target is aten.ne.Scalar),
                      None) if t is aten.gather.default else None
        return [(a[2], s[a[1]] if s else 1, False, ignore,
                 "target" if ignore is not None else f"dim {a[1]}")]
    if t in _LIST_INDEXED and shape(a[0]) is not None:
        if any(isinstance(i, torch.fx.Node) and i.meta.get(ir.VAL) is not None and
               i.meta[ir.VAL].dtype == torch.bool for i in a[1]):
            return []  # a mask spans several dims: no per-dim range to check
        return [(i, shape(a[0])[d], True, None, f"dim {d}") for d, i in enumerate(a[1])
                if i is not None]
    return []


def _message(n, kind, bad, total, size, ignore, negative_ok, leaves) -> str:
    op = str(n.target.overloadpacket)
    module = n.meta.get(ir.MODULE) or ""
    where = f"module {module!r}" if module else "the model's top-level forward (or the loss)"
    seen = sorted({int(v) for v in bad.flatten()[:1000].tolist()})
    values = ", ".join(map(str, seen[:5])) + (", ..." if len(seen) > 5 else "")
    src = " and ".join(f"batch{p}" for p in leaves) or "the batch"
    held = f"{src} holds {values} ({bad.numel()} of {total} values out of range)"
    if kind == "embedding":
        return (f"{op} in {where}: embedding ids must be in [0, {size}) (the table's {size} "
                f"rows), but {held}. Usual causes: token ids from a tokenizer whose "
                "vocabulary is larger than the model's table (check the model's vocabulary "
                "size, num_embeddings / config.vocab_size, against the tokenizer's, or resize "
                "the embeddings), or positions past the model's maximum length. Eager "
                "PyTorch raises on this batch too.")
    if kind == "target":
        return (f"{op} in {where}: cross-entropy targets must be class indices in [0, {size}) "
                f"(the logits have {size} classes) or ignore_index={ignore}, but {held}. "
                "Check the labels: their range against the number of classes (or the "
                f"vocabulary size), and that padding is marked with ignore_index ({ignore}). "
                "Eager PyTorch raises on this batch too.")
    lo = -size if negative_ok else 0
    return (f"{op} in {where}: indices into {kind} of its input must be in [{lo}, {size}), "
            f"but {held}. Eager PyTorch raises on this batch too.")

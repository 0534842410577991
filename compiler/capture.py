"""Model + loss_fn + example batch -> one joint forward+backward functional ATen graph.

We use AOTAutograd's joint export (what `aot_export_module(trace_joint=True)` does, in one
trace: `_export_joint`): it functionalizes (BatchNorm's in-place running-stat updates become
explicit outputs), traces with fake tensors (no real memory is touched), and hands back the
graph signature we reorder into the fxpar contract: placeholders (params, buffers, batch
leaves), outputs (loss, grads, updated buffers).

A few ops are decomposed while tracing so that every later pass sees only ops whose
sharding is well defined: BatchNorm (its batch statistics must become reductions the
data-parallel pass can all-reduce), var_mean (rewritten as sums, which are linear), and nothing
else that has a sharding rule (decomposing a fused forward whose backward stays fused would
hand the backward values it does not expect).

BatchNorm is decomposed only where a plan needs its statistics as sums: `capture(...,
decompose_batch_norm=False)` (what compile does for one device, one microbatch) keeps ATen's
own ops, `_native_batch_norm_legit_functional` forward and `native_batch_norm_backward`. Why:
eager runs those kernels, and what they feed is ill-conditioned: behind a zero-initialised
BatchNorm scale (timm's zero_init_last, the last BN of each ResNet block) the gradients of the
block's parameters are small differences of large sums, so another summation order (the
decomposition's statistics, and mostly its backward's sum(grad * (x - mean))) moved timm's
ResNet-18 by 1e-3 of a BatchNorm bias's largest element in five SGD steps (run op by op), more
on its smaller ones. The decomposition is no less accurate (eager and it are as far from an
fp64 run); it is just not eager's rounding, and one device can run eager's kernels: op by op
the step is then eager's bit for bit (Inductor still lowers the ops its own way: within 1e-5
there). Where the batch is split (dp; tp and pp plans; microbatches, whose row-coupling check
reads the sums) the statistics are sums over ranks or parts, no order can be eager's, and
those plans keep the decomposition.

Fused backward kernels stay whole. A few backward ops (silu_backward, mish_backward) have both
a backend kernel, which eager's backward calls, and a composite form for double backward;
AOTAutograd's export mode decomposes every composite op it meets, which turned silu_backward
into a chain of pointwise ops, each rounded to the tensor's dtype. In bf16 (torchtitan's MoE experts run SiLU
in bf16 inside an fp32 model) that moved w1's gradient by 0.3-0.5%, where eager's kernel
computes in fp32 and rounds once. While tracing, such an op is recorded as itself when it has
a sharding rule (`_fused_backward_kept`), else decomposed by the table, whose pointwise
backward decompositions (torch._decomp's, `pw_cast_for_opmath`) compute in fp32 and round
once, as eager's kernels do.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import os
import sys
import traceback
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.compiler import padded_nonzero, repeated_blocks, split_by_counts
from fxpar.compiler.target_attention import CudaAttention
from fxpar.core import ir
from fxpar.core.ir import flatten_batch  # noqa: F401  (capture's contract, runtime's check)
from fxpar.compiler import shape_rules  # noqa: F401  (fp32 grouped_mm shapes: MoE models)
from fxpar.core.errors import TraceError, user_line
from fxpar.core.graphs import fake_like
from fxpar.core.sharding import has_sharding_rule

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _var_mean_as_sums(x, dim=None, *, correction=None, keepdim=False):
    """var_mean via sums: linear reductions shard exactly (Partial -> all-reduce)."""
    correction = 1 if correction is None else correction
    dims = list(range(x.dim())) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    n = 1
    for d in dims:
        n *= x.shape[d]
    mean = aten.sum.dim_IntList(x, dims, True) / n
    dev = x - mean
    var = aten.sum.dim_IntList(dev * dev, dims, keepdim) / max(n - correction, 0)
    if not keepdim:
        mean = aten.squeeze.dims(mean, dims)
    return var, mean


# BatchNorm's ATen ops (training, no-stats and inference forwards, and the backward)
BATCH_NORM_OPS = (
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training,
    aten.native_batch_norm,
    aten.native_batch_norm_backward,
)


def decomposition_table(batch_norm: bool = True) -> dict:
    """Decompose ops with no sharding rule (e.g. mse_loss) into ops that have one, plus the
    few we always want decomposed (see module docstring). `batch_norm=False` leaves
    BatchNorm's ATen ops whole (eager's kernels; one device only)."""
    from torch._decomp import core_aten_decompositions
    table = {op: fn for op, fn in core_aten_decompositions().items()
             if isinstance(op, torch._ops.OpOverload) and not has_sharding_rule(op)}
    bn = {getattr(op, name) for op in BATCH_NORM_OPS for name in op.overloads()}
    if batch_norm:
        table.update(get_decompositions(list(BATCH_NORM_OPS)))
    else:  # (none is in the core part today - each has a sharding rule - but make sure)
        table = {op: fn for op, fn in table.items() if op not in bn}
    table[aten.var_mean.correction] = _var_mean_as_sums
    return table


@functools.lru_cache(maxsize=None)
def _fused_backward_candidates() -> tuple:
    """ATen backward ops with a C++ composite kernel (CompositeImplicitAutograd, used for
    double backward) beside a backend kernel (what eager's backward runs): silu_backward and
    mish_backward in torch 2.13. Functional schemas only (a mutating op must be decomposed to
    be functionalized), and none torch already gives a Python composite of its own."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    out = []
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::") or not full.endswith(("_backward", "_backward.default")):
            continue
        base, _, overload = full[len("aten::"):].partition(".")
        op = getattr(getattr(aten, base, None), overload or "default", None)
        if not isinstance(op, torch._ops.OpOverload) or key in op.py_kernels or \
                op._schema.is_mutable or any(a.alias_info for a in op._schema.arguments):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key) and any(
                torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k)
                for k in (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)):
            out.append(op)
    return tuple(out)


def _backend_key(device_type: str):
    key = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}.get(device_type, device_type.upper())
    return getattr(torch._C.DispatchKey, key, None)


def _keep_as_op(*args, **kwargs):
    """A Python composite kernel that declines: OpOverload.decompose() returns NotImplemented,
    and the tracing modes (functionalization, make_fx) then record the op itself."""
    return NotImplemented


@contextlib.contextmanager
def _fused_backward_kept(device_types, table: dict):
    """While tracing, the fused backward ops (`_fused_backward_candidates`) are recorded as
    themselves instead of their composite's ops (see the module docstring); the table then
    decomposes those it holds (no sharding rule) its own way. Only where every traced device
    type has a backend kernel for the op: elsewhere the composite is also what the dispatcher
    runs at the autograd key, where a declining kernel would break the call."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    backends = [_backend_key(d) for d in device_types]
    ops = [] if None in backends else [
        op for op in _fused_backward_candidates()
        if (has_sharding_rule(op) or op in table) and key not in op.py_kernels
        and all(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), b) for b in backends)]
    for op in ops:
        op.py_kernels[key] = _keep_as_op
        op._dispatch_cache.clear()
    try:
        yield ops
    finally:
        for op in ops:
            if op.py_kernels.get(key) is _keep_as_op:
                del op.py_kernels[key]
            op._dispatch_cache.clear()


def default_loss_fn(model: torch.nn.Module, batch: Any):
    """DESIGN section 1: model(**batch) for a dict, model(batch) otherwise."""
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _batch_as_one_argument(model: torch.nn.Module, batch: Any, loss_fn: Callable,
                           error: BaseException) -> TraceError | None:
    """The default loss calls model(batch): a tuple batch given to a forward that takes its
    items as separate arguments fails inside the trace (a missing argument, a tuple reaching
    a layer) with an error naming neither. Said in the user's terms, with the fix, when the
    forward's positional parameters fit the batch's items and either two or more of them
    are required or the trace failed on a wrong argument (a TypeError or AttributeError)."""
    if loss_fn is not default_loss_fn or not isinstance(batch, (tuple, list)) or len(batch) < 2:
        return None
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # (a builtin or C-level forward: no signature)
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in params)
    most = len(batch) if variadic else len(positional)
    if (len(positional) < 2 and not variadic) or not len(required) <= len(batch) <= most:
        return None
    chain, seen = [], error
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if len(required) < 2 and not any(isinstance(x, (TypeError, AttributeError)) for x in chain):
        return None
    names = ", ".join(p.name for p in positional[:len(batch)]) + (", *args" if variadic else "")
    first = (str(error).splitlines() or [""])[0][:200]
    return TraceError(
        f"the default loss calls model(batch) with the whole batch as one argument, but "
        f"{type(model).__name__}.forward takes the batch's items as separate arguments "
        f"({names}) and example_batch is a {type(batch).__name__} of {len(batch)} (the trace "
        f"then failed: {type(error).__name__}: {first}). Fix: pass "
        "`loss_fn=lambda m, b: m(*b)` to fxpar.parallelize / fxpar.compile (it must return "
        "a scalar loss, or an object with a `.loss`), or give the model a forward(self, "
        "batch) that unpacks the batch itself.")


def _as_scalar_loss(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
        out = out.loss
    if not isinstance(out, torch.Tensor):
        raise TraceError(
            f"loss_fn returned {type(out).__name__}, not a tensor. Return a scalar loss tensor "
            "(or an object with a `.loss` tensor, as Hugging Face models do when given labels).")
    if out.numel() != 1:
        raise TraceError(
            f"loss_fn returned a tensor of shape {tuple(out.shape)}; fxpar needs a scalar loss. "
            "Reduce it, e.g. `loss.mean()` (or `.sum()`), inside loss_fn.")
    return out.reshape(())


class _LossModule(torch.nn.Module):
    """Wraps model + loss_fn so AOTAutograd sees one module returning one scalar.

    The model's parameters and buffers are registered here once per tensor (p0, p1, ...,
    b0, ...), and the forward puts them back under every name the model reads them by. A
    tied weight is then one graph input whose gradient autograd sums over its uses, whatever
    the tying: AOTAutograd swaps each *name* separately, so a tensor reached by two paths of
    one module object (T5's shared / encoder.embed_tokens / decoder.embed_tokens) would
    leave all but one name without a gradient."""

    def __init__(self, model, loss_fn, batch_spec, const_leaves, stand_ins):
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: its names are ours
        object.__setattr__(self, "loss_fn", loss_fn)  # (an nn.Module loss: not trained)
        self.batch_spec = batch_spec
        self.const_leaves = const_leaves  # {leaf index: python value} for non-tensor leaves
        self.param_names = list(dict(model.named_parameters()))  # first name per tensor
        self.buffer_names = list(dict(model.named_buffers()))
        self.aliases: dict[str, str] = {}  # every model name -> our p<i> / b<i>
        for prefix, unique, every in (
                ("p", dict(model.named_parameters()),
                 model.named_parameters(remove_duplicate=False)),
                ("b", dict(model.named_buffers()), model.named_buffers(remove_duplicate=False))):
            ours = {}
            for i, (name, t) in enumerate(unique.items()):
                ours[id(t)] = f"{prefix}{i}"
                if prefix == "p":
                    self.register_parameter(ours[id(t)], stand_ins.get(id(t), t))
                else:
                    self.register_buffer(ours[id(t)], stand_ins.get(id(t), t))
            slots = set()  # (module, attribute): swapped once, or restoring would leak a fake
            for name, t in every:
                owner, _, attr = name.rpartition(".")
                slot = (id(model.get_submodule(owner)), attr)
                if slot not in slots:
                    slots.add(slot)
                    self.aliases[name] = ours[id(t)]

    def model_name(self, ours: str) -> str:
        i = int(ours[1:])
        return (self.param_names if ours[0] == "p" else self.buffer_names)[i]

    def forward(self, *tensor_leaves):
        leaves, it = [], iter(tensor_leaves)
        for i in range(self.batch_spec.num_leaves):
            leaves.append(self.const_leaves[i] if i in self.const_leaves else next(it))
        batch = pytree.tree_unflatten(leaves, self.batch_spec)
        state = {name: getattr(self, ours) for name, ours in self.aliases.items()}
        with torch.nn.utils.stateless._reparametrize_module(self.model, state):
            return (_as_scalar_loss(self.loss_fn(self.model, batch)),)


class _ModuleTagger:
    """Tags every forward node with the innermost module that created it.

    Forward hooks mark module entry/exit; nodes appended to the graph being traced between two
    events belong to the module on top of the stack. (AOTAutograd's export does not record
    nn_module_stack, so we observe the tracer's graph directly.)
    """

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = [""]
        self.handles = []
        self.last = None
        self.tags: dict[str, str] = {}  # node name -> module path
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
            self.handles.append(mod.register_forward_hook(self._exit()))

    def _graph(self):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
        mode = get_proxy_mode()
        return None if mode is None else mode.tracer.graph

    def _flush(self):
        g = self._graph()
        if g is None:
            return
        new = []  # the nodes since the last event, newest first (a walk, not a copy of the graph)
        for n in reversed(g.nodes):
            if n is self.last:
                break
            new.append(n)
        for n in new:
            self.tags.setdefault(n.name, self.stack[-1])
        if new:
            self.last = new[0]

    def _enter(self, name):
        def hook(mod, args):
            self._flush()
            self.stack.append(name)
        return hook

    def _exit(self):
        def hook(mod, args, out):
            self._flush()
            self.stack.pop()
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _user_line(exc: BaseException) -> str:
    """The innermost frame of user code (outside torch and fxpar) in exc's traceback."""
    return user_line(traceback.extract_tb(exc.__traceback__)) or "?"


def _trace_error(exc: BaseException, module_path: str) -> TraceError:
    op = getattr(exc, "func", None)
    opname = str(op) if op is not None else type(exc).__name__
    where = _user_line(exc)  # (where the branch is)
    return TraceError(
        f"cannot trace module '{module_path or '<root>'}': operation {opname} needs the value of a "
        f"tensor (data-dependent Python control flow such as `if tensor:`, `.item()`, "
        f"`.tolist()` or a data-dependent shape) at {where}. fxpar compiles one static graph for "
        "every step. Fix: express the branch with tensor ops (`torch.where`, masking, "
        "`torch.cond`) or compute it outside the model and pass it in the batch.")


def _dynamic_shape_error(exc: BaseException, module_path: str) -> TraceError:
    """An op whose output shape depends on tensor values (DynamicOutputShapeException: e.g.
    ctc_loss, nonzero without a size), named with the user code that called it."""
    op = getattr(exc, "func", None)
    return TraceError(
        f"cannot trace module '{module_path or '<root>'}': {op or 'an operation'} makes a "
        f"tensor whose shape depends on tensor values, at {_user_line(exc)}. fxpar compiles "
        "one static graph for every step, traced on fake tensors of the example batch's "
        "shapes, and torch "
        "has no fixed-shape kernel for that op to trace. Fix: use an op with a fixed output "
        "shape there (e.g. `nonzero_static`, masking instead of boolean indexing), or "
        "compute that part outside the model.")


def capture(model: torch.nn.Module, example_batch: Any,
            loss_fn: Callable | None = None, *, joint: bool = True,
            stand_ins: dict[int, torch.Tensor] | None = None,
            decompose_batch_norm: bool = True, stamp: bool | None = None
            ) -> tuple[torch.fx.GraphModule, ir.GraphSignature]:
    """Trace loss_fn(model, batch) and d loss / d params into one joint ATen graph.

    joint=False traces the forward only (for evaluate): outputs (loss, updated buffers).
    `stand_ins` ({id(parameter or buffer): fake tensor}, from `fake_weights`) replace model
    tensors in the trace: a meta-device model's, or weights the runtime has sharded since.
    `decompose_batch_norm=False` keeps BatchNorm's ATen ops (eager's numerics), for graphs
    that run the whole batch on one device (see the module docstring).
    `stamp` (default: on unless FXPAR_STAMP=0): a list of identical blocks is traced at 2 and
    3 blocks and stamped to its depth (compiler/repeated_blocks.py); the same graph, made in
    a time that does not grow with depth.
    """
    loss_fn = loss_fn or default_loss_fn
    if stamp is None:
        stamp = os.environ.get("FXPAR_STAMP", "1") != "0"
    found = repeated_blocks.find(model) if stamp else None
    if found is not None:
        def trace():
            return capture(model, example_batch, loss_fn, joint=joint, stand_ins=stand_ins,
                           decompose_batch_norm=decompose_batch_norm, stamp=False)

        def forward(ctx):
            _forward_on_fakes(model, example_batch, loss_fn, stand_ins, ctx)
        try:
            with _transformers_sees_tracing():
                return repeated_blocks.capture(model, trace, found, tag_backward, forward)
        except Exception as e:  # noqa: BLE001 - the whole model is traced instead
            log.debug("tracing %r whole: its blocks were not stamped (%s: %s)", found[0],
                      type(e).__name__, e, exc_info=os.environ.get("FXPAR_STAMP_DEBUG") == "1")
    leaves, spec = pytree.tree_flatten(example_batch)
    const_leaves = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
    tensor_leaves = [v for v in leaves if isinstance(v, torch.Tensor)]
    if not tensor_leaves:
        raise TraceError("example_batch holds no tensors; pass one global batch: a tensor, "
                         "a tuple or a dict of tensors.")
    wrapper = _LossModule(model, loss_fn, spec, const_leaves, stand_ins or {})
    tagger = _ModuleTagger(model)
    unused: list[torch.nn.Parameter] = []
    try:
        with _transformers_sees_tracing(), padded_nonzero.PaddedNonzero(), \
                split_by_counts.SplitByCounts():
            try:
                gm, sig = _export(wrapper, tensor_leaves, joint, decompose_batch_norm)
            except AssertionError as e:  # AOTAutograd's check (its message, torch 2.5-2.13)
                if "did not receive a gradient" not in str(e):
                    raise
                # eager semantics: a parameter the loss does not reach gets no gradient (its
                # .grad stays None, the optimizer skips it): traced as if frozen
                unused = _params_without_grad(wrapper, tensor_leaves)
                if not unused:
                    raise
                for p in unused:
                    p.requires_grad_(False)
                tagger.close()
                tagger = _ModuleTagger(model)
                gm, sig = _export(wrapper, tensor_leaves, joint, decompose_batch_norm)
    except Exception as e:  # noqa: BLE001 - re-raised with the cause named
        hint = _batch_as_one_argument(model, example_batch, loss_fn, e)
        if hint is not None:
            raise hint from e
        if isinstance(e, TraceError):
            raise
        oom = e
        while oom is not None and not isinstance(oom, torch.OutOfMemoryError):
            oom = oom.__cause__ or oom.__context__
        if oom is not None:  # not the model's code: memory that real tensors hold
            oom.add_note(
                "fxpar: the device ran out of memory while tracing the model. Tracing runs on "
                "fake tensors and allocates nothing itself: the memory is held by real "
                "tensors - the model's weights moved onto the device, or other work of this "
                "process (earlier models, optimizers, caches: free them, e.g. `del model; "
                "gc.collect(); torch.cuda.empty_cache()`). Build the model on the meta device "
                "and pass weights=PATH so each rank loads only its shards.")
            raise oom
        data_dep = ("DataDependent" in type(e).__name__ or "data-dependent" in str(e).lower()
                    or "data dependent" in str(e).lower() or "GuardOnDataDependent" in str(e))
        cause = e
        while cause.__cause__ is not None and not data_dep:
            cause = cause.__cause__
            data_dep = "DataDependent" in type(cause).__name__
        if data_dep:
            raise _trace_error(e, tagger.stack[-1]) from e
        dynamic = e
        while dynamic is not None and type(dynamic).__name__ != "DynamicOutputShapeException":
            dynamic = dynamic.__cause__
        if dynamic is not None:
            raise _dynamic_shape_error(dynamic, tagger.stack[-1]) from e
        if "Please convert all Tensors to FakeTensors" in str(e):
            raise TraceError(
                f"cannot trace module '{tagger.stack[-1] or '<root>'}': one of its operations "
                "takes a real tensor beside the traced ones (fxpar traces with fake tensors "
                "standing in for the batch and for every parameter and buffer, under the "
                "names the forward reads them by). Either the model keeps a tensor as a "
                "plain attribute (register it as a buffer), or it reads a module's weights "
                "outside that module's forward - e.g. a custom autograd.Function whose "
                "backward runs the layers again with their own weights, as reversible "
                "layers (Reformer) do - which fxpar cannot trace (report the model to "
                "fxpar). " + next((line[:200] for line in str(e).splitlines()
                                   if "Found in" in line), "")) from e
        if joint and "requires gradients, and received a mutation" in str(e):
            raise _mutated_parameter_error(wrapper, tensor_leaves) from e
        raise TraceError(
            f"cannot trace module '{tagger.stack[-1] or '<root>'}': {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}. fxpar traces loss_fn(model, batch) with "
            "fake tensors into one ATen graph; the model must run on any tensor values of the "
            "example batch's shapes (no data-dependent control flow, no tensor-to-Python "
            "conversions, no mutation of Python state)." + _kv_cache_hint(model)) from e
    finally:
        tagger.close()
        for p in unused:
            p.requires_grad_(True)
    gm, signature = _to_contract(gm, sig, tensor_leaves, leaves, spec, tagger.tags, joint,
                                 wrapper)
    padded_nonzero.rewrite(gm)
    return gm, signature


def _forward_on_fakes(model, example_batch, loss_fn, stand_ins, ctx) -> None:
    """loss_fn(model, batch) once, forward only, on fake tensors, in grad mode as the trace
    runs it, with `ctx` (a dispatch mode) entered inside the fake mode: for a look at how
    the model runs its blocks (compiler/repeated_blocks.py)."""
    leaves, spec = pytree.tree_flatten(example_batch)
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode((*tensors, *(stand_ins or {}).values())) or \
        FakeTensorMode(allow_non_fake_inputs=True)
    from torch._subclasses.fake_tensor import is_fake
    # every weight a fake: an op on a real weight bypasses the fake mode's cache and is
    # converted and decomposed anew each time (~3 ms an op: 3/4 of this forward at 48 layers)
    stand_ins = {**{id(t): mode.from_tensor(t, static_shapes=True) for t in
                    (*model.parameters(), *model.buffers()) if not is_fake(t)},
                 **(stand_ins or {})}
    wrapper = _LossModule(model, loss_fn or default_loss_fn, spec,
                          {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)},
                          stand_ins)
    # (grad mode as the trace: the model's switches show)
    with mode, ctx, padded_nonzero.PaddedNonzero(), split_by_counts.SplitByCounts():
        wrapper(*[t if is_fake(t) else mode.from_tensor(t) for t in tensors])


def _export(wrapper, tensor_leaves, joint, decompose_batch_norm=True):
    from torch._functorch.aot_autograd import aot_export_module
    table = decomposition_table(decompose_batch_norm)
    devices = {t.device.type for t in (*tensor_leaves, *wrapper.parameters(), *wrapper.buffers())}
    try:
        with _fused_backward_kept(devices, table):
            if joint:
                return _export_joint(wrapper, tuple(tensor_leaves), table)
            with torch.no_grad():
                return aot_export_module(wrapper, tuple(tensor_leaves), trace_joint=False,
                                         decompositions=table)
    finally:
        # make_fx leaves its last trace's nodes in a module global (torch.export's fake
        # tensor leak check reads it within its own call): it would keep the captured graph
        # (and whatever its nodes hold) alive after a failed parallelize, until the next trace
        from torch.fx.experimental import proxy_tensor
        getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()


def _export_joint(wrapper, args, decompositions):
    """`aot_export_module(wrapper, args, trace_joint=True, output_loss_index=0)` in one trace.

    torch's version traces the joint graph, then traces that graph again (`make_fx` of a
    wrapper) only to drop its tangent input and the None gradients of inputs that need none.
    The second trace ran at ~2.7x the first's cost (70% of capture), and with real weights
    and batch it ran the whole forward and backward on them: real compute and device memory
    at tracing time. Here the same two edits are made on the graph itself; the graph and
    signature are those torch's function returns (same ops, order and names).
    """
    from torch._functorch.aot_autograd import _aot_export_function
    from torch._functorch._aot_autograd.graph_capture_wrappers import create_functional_call
    from torch._functorch._aot_autograd.input_output_analysis import create_graph_signature

    named_params = dict(wrapper.named_parameters(remove_duplicate=False))
    named_buffers = dict(wrapper.named_buffers(remove_duplicate=False))
    state, state_spec = pytree.tree_flatten({**named_params, **named_buffers})
    call = create_functional_call(wrapper, state_spec, len(state), store_orig_mod=True)

    def loss(*a):  # (_LossModule returns (loss,))
        out = call(*a)
        if not out[0].requires_grad:
            raise RuntimeError("The output at index 0 was marked as the loss, but it does "
                               "not require gradients")
        return out

    full_args = (*state, *args)
    fx_g, meta, in_spec, out_spec = _aot_export_function(
        loss, full_args, decompositions=decompositions,
        num_params_buffers=len(state), no_tangents=True, trace_joint=True)
    graph = fx_g.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for tangent in placeholders[len(full_args):]:  # the loss's: backprop starts from ones
        if tangent.users:
            raise AssertionError(f"AOTAutograd's joint graph reads its tangent {tangent}")
        graph.erase_node(tangent)
    for i, ph in enumerate(placeholders[:len(full_args)]):
        ph._rename(f"arg{i}_1")  # the names torch's second trace gives
        ph.target = ph.name
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None)
    n_fw = meta.num_outputs + meta.num_mutated_inp_runtime_indices
    fw_outs, grads = outs[:n_fw], outs[n_fw:]
    if len(grads) != len(full_args):
        raise AssertionError(f"{len(grads)} gradients for {len(full_args)} inputs")
    kept = []
    for a, g in zip(full_args, grads):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            if g is None:  # (the message capture() recognises, as torch's own)
                raise AssertionError("Found a parameter that did not receive a gradient.")
            kept.append(g)
        elif g is not None:
            raise AssertionError("a gradient for an input that needs none")
    out_node.args = ((*fw_outs, *kept),)
    graph._codegen = torch.fx.graph.CodeGen()
    fx_g.recompile()
    sig = create_graph_signature(
        fx_g, meta, in_spec, out_spec, user_args_flat=list(args),
        params_and_buffers_flat=list(state), param_names=list(named_params),
        buffer_names=list(named_buffers), trace_joint=True, num_user_fw_outs=1,
        loss_index=0)
    return fx_g, sig


def _kv_cache_hint(model: torch.nn.Module) -> str:
    """A Hugging Face model built with use_cache=True (its config's default) builds a KV
    cache in the forward it is trained by, which a trace may not copy (Inkling-2-Loop
    deep-copies its cache's layers): the fix, where that is so."""
    if any(getattr(getattr(m, "config", None), "use_cache", None) is True
           for m in model.modules()):
        return (" This model's config has use_cache=True: a training step needs no KV "
                "cache, and building one may be what failed. Set model.config.use_cache = "
                "False (as Hugging Face's Trainer does for training) and try again.")
    return ""


@contextlib.contextmanager
def _transformers_sees_tracing():
    """Hugging Face models skip value checks while tracing (`if is_tracing(mask): ...`), but
    transformers recognises a FakeTensor only as itself, not wrapped in the functional
    tensor AOTAutograd traces with: it would read a value (a data-dependent error on BART's
    masks, DeBERTa's padding check). While fxpar traces, a wrapped fake counts as fake."""
    iu = sys.modules.get("transformers.utils.import_utils")
    original = getattr(iu, "is_fake_tensor", None)
    if original is None:
        yield
        return
    from torch._subclasses.fake_tensor import is_fake
    iu.is_fake_tensor = lambda x: isinstance(x, torch.Tensor) and is_fake(x)
    try:
        yield
    finally:
        iu.is_fake_tensor = original


@contextlib.contextmanager
def _on_fakes(wrapper: torch.nn.Module, tensor_leaves):
    """Inside a fake mode: (the wrapper's parameters and buffers as fakes by name, trainable
    as theirs are; the batch's tensor leaves as fakes), for running the loss again."""
    named = dict(wrapper.named_parameters())
    state = {**named, **dict(wrapper.named_buffers())}
    mode = detect_fake_mode(tuple(state.values())) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = {k: mode.from_tensor(v, static_shapes=True) for k, v in state.items()}
        for k in named:
            fake[k].requires_grad_(named[k].requires_grad)
        yield fake, tuple(mode.from_tensor(t, static_shapes=True) for t in tensor_leaves)


def _params_without_grad(wrapper: torch.nn.Module, tensor_leaves) -> list[torch.nn.Parameter]:
    """The trainable parameters that d loss / d params does not reach (unused heads, poolers,
    a branch the batch never takes), found by running the loss on fake tensors."""
    named = dict(wrapper.named_parameters())
    with _on_fakes(wrapper, tensor_leaves) as (fake, leaves):
        (loss,) = torch.func.functional_call(wrapper, fake, leaves)
        trainable = [k for k, p in named.items() if p.requires_grad]
        grads = torch.autograd.grad(loss, [fake[k] for k in trainable], allow_unused=True)
    return [named[k] for k, g in zip(trainable, grads) if g is None]


class _Mutations(TorchDispatchMode):
    """Records the first in-place op writing into each storage of `storages` (storage ->
    name)."""

    def __init__(self, storages: dict):
        super().__init__()
        self.storages, self.hit = storages, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for i, a in enumerate(func._schema.arguments):
                x = args[i] if i < len(args) else kwargs.get(a.name)
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                for t in pytree.tree_leaves(x):  # (a list argument: _foreach_*_)
                    name = self.storages.get(StorageWeakRef(t.untyped_storage())) \
                        if isinstance(t, torch.Tensor) else None
                    if name is not None:
                        self.hit.setdefault(name, func)
        return func(*args, **kwargs)


def _mutated_parameter_error(wrapper: torch.nn.Module, tensor_leaves) -> TraceError:
    """AOTAutograd's "a graph input that requires gradients received a mutation", with the
    parameters the forward changes in place named (found by running the loss on fake
    tensors, watching in-place ops write into their storages)."""
    named = dict(wrapper.named_parameters())
    watch = _Mutations({})
    try:
        with _on_fakes(wrapper, tensor_leaves) as (fake, leaves):
            watch.storages = {StorageWeakRef(fake[k].untyped_storage()): k for k in named
                              if named[k].requires_grad}
            with watch:
                torch.func.functional_call(wrapper, fake, leaves)
    except Exception as e:  # noqa: BLE001 - the error below, with the names found so far
        log.debug("capture: looking for the parameters mutated in place failed: %s", e)
    found = watch.hit
    which = ", ".join(f"'{wrapper.model_name(k)}' ({op})" for k, op in found.items()) \
        if found else "a trainable parameter (not found again on fake tensors)"
    return TraceError(
        f"the model's forward changes {which} in place, and the training step differentiates "
        "it: one graph cannot do both (eager PyTorch lets it because a change "
        "through `.data` or under torch.no_grad() is hidden from autograd; e.g. Gemma 3n's "
        "AltUp clamps its coefficients with `weight.data.clamp_()` in forward). Fix: make the "
        "change outside the forward (the same clamp applied to the weights after each step), "
        "or freeze that parameter (requires_grad_(False)) if it should not train.")


def fake_weights(model: torch.nn.Module, device, everything: bool = False,
                 mode: FakeTensorMode | None = None) -> dict[int, torch.Tensor]:
    """Stand-ins for `capture`: a fake tensor on `device` (same shape, strides, dtype) for
    each parameter and buffer of `model` not on `device`'s type (on the meta device, or CPU
    weights compiled for a GPU), or for all of them (`everything`), keyed by id (a tied
    weight gets one). Tracing needs shapes, never values."""
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    dev_type = torch.device(device).type
    out: dict[int, torch.Tensor] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in out or (not everything and t.device.type == dev_type):
            continue
        f = fake_like(t, mode, device)
        out[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else f
    return out


def meta_tensors(model) -> list[str]:
    """Names of the model's parameters and buffers on the meta device."""
    return [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]


def capture_as_is(model: torch.nn.Module, example_batch: Any, loss_fn: Callable | None = None,
                  target: str | None = None) -> tuple[torch.fx.GraphModule, ir.GraphSignature]:
    """The joint graph of the model where its weights are (the planner's input, and the
    compile's where the plan runs the whole example batch per call); a model on the meta
    device is traced on fake stand-ins on the batch's device (shapes only: nothing in it can
    be timed). `target`: the device type the plan is for; "cuda" from tensors off a GPU
    traces attention as the GPU's kernels (compiler/target_attention.py)."""
    tensors = [t for t in pytree.tree_leaves(example_batch) if isinstance(t, torch.Tensor)]
    if target == "cuda" and not any(t.device.type == "cuda" for t in (
            *tensors, *model.parameters(), *model.buffers())):
        with CudaAttention():
            return capture_as_is(model, example_batch, loss_fn)
    stand_ins = None
    if meta_tensors(model):  # (the batch's own fake mode where it is fake already: a model
        # factory run under one, as `fxpar plan --model pkg.module:factory` runs it)
        mode = detect_fake_mode(tuple(tensors)) or FakeTensorMode(allow_non_fake_inputs=True)
        leaf = tensors[0] if tensors else None
        device = leaf.device if leaf is not None else torch.device("cpu")
        stand_ins = fake_weights(model, device, mode=mode)
        example_batch = fake_batch(example_batch, device, mode)
    return capture(model, example_batch, loss_fn, stand_ins=stand_ins)


def batch_rows(example_batch: Any) -> int:
    """The batch's rows: the first dimension of its first tensor leaf that has one."""
    leaves = [t for t in pytree.tree_leaves(example_batch)
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    return int(leaves[0].shape[0]) if leaves else 1


def fake_batch(batch: Any, device, mode: FakeTensorMode) -> Any:
    """The batch with every tensor leaf not on `device`'s type replaced by a fake one there
    (in `mode`, the stand-ins' mode): compiling for a GPU from a CPU batch."""
    dev_type = torch.device(device).type

    return pytree.tree_map_only(
        torch.Tensor, lambda t: t if t.device.type == dev_type else fake_like(t, mode, device),
        batch)


def _to_contract(gm, sig, tensor_leaves, leaves, spec, tags, joint, wrapper):
    """Reorder outputs to (loss, grads, updated buffers); tag role/region/module on every node."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])

    param_names = [wrapper.model_name(p) for p in sig.parameters]
    buffer_names = [wrapper.model_name(b) for b in sig.buffers]
    n_mut = len(sig.buffers_to_mutate)
    mutated = [wrapper.model_name(sig.buffers_to_mutate[o.name]) for o in outs[:n_mut]]
    loss = outs[n_mut]
    grads = []
    if joint:
        name_to_grad = {v: k for k, v in sig.backward_signature.gradients_to_parameters.items()}
        node_by_name = {n.name: n for n in graph.nodes}
        grads = [node_by_name.get(name_to_grad.get(p)) if name_to_grad.get(p) else None
                 for p in sig.parameters]
    out_node.args = ((loss, *grads, *outs[:n_mut]),)
    out_node.meta[ir.N_GRADS] = len(grads)
    graph._codegen = torch.fx.graph.CodeGen()  # plain positional inputs and outputs

    n_p, n_b = len(param_names), len(buffer_names)
    for i, ph in enumerate(placeholders):
        if i < n_p:
            ph.meta[ir.ROLE], ph.meta[ir.FQN] = "param", param_names[i]
            ph.meta[ir.MODULE] = param_names[i].rpartition(".")[0]
        elif i < n_p + n_b:
            ph.meta[ir.ROLE], ph.meta[ir.FQN] = "buffer", buffer_names[i - n_p]
            ph.meta[ir.MODULE] = buffer_names[i - n_p].rpartition(".")[0]
        else:
            ph.meta[ir.ROLE], ph.meta[ir.FQN] = "batch", f"batch[{i - n_p - n_b}]"
            ph.meta[ir.MODULE] = ""
        ph.meta[ir.REGION] = ir.FORWARD

    # forward = everything the loss or a buffer update depends on
    fwd: set[torch.fx.Node] = set()
    todo = [loss, *outs[:n_mut]]
    while todo:
        n = todo.pop()
        if n in fwd or n.op == "placeholder":
            continue
        fwd.add(n)
        todo.extend(n.all_input_nodes)
    before_loss = True
    for n in graph.nodes:
        before_loss = before_loss and n is not loss
        if n.op == "call_function":
            # an element of a forward op's result (e.g. LayerNorm's saved mean) is forward too,
            # even when only the backward reads it; so are the forward's checks (an index's
            # range assert), which nothing reads: every op of a forward-only graph, every op
            # before the loss in a joint one (the backward starts from the loss)
            is_fwd = n in fwd or (n.target is operator.getitem and n.args[0] in fwd) or \
                not joint or before_loss
            n.meta[ir.REGION] = ir.FORWARD if is_fwd else ir.BACKWARD
            if is_fwd:
                # the tagger hooks the user's model itself, so its paths are already those of
                # model.named_modules() and match the parameter names: kept whole (stripping a
                # leading "model." here once split HF Llama's `model.layers.N` in two)
                n.meta[ir.MODULE] = tags.get(n.name, "")
    tag_backward(graph)
    out_node.meta[ir.REGION], out_node.meta[ir.MODULE] = ir.BACKWARD, ""

    # drop no-op nodes: autograd's detach (an alias) and trace-time metadata asserts
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target in (aten.detach.default, aten.alias.default):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
        elif n.op == "call_function" and n.target is aten._assert_tensor_metadata.default:
            graph.erase_node(n)
        elif n.op == "call_function" and n.target is aten.cat.default:
            _drop_empty_cat_inputs(graph, n)
        elif n.op == "call_function" and n.target in (aten.as_strided.default,
                                                      aten.as_strided_scatter.default):
            _as_strided_as_view(graph, n)
        elif n.op == "call_function" and n.target is aten.copy.default:
            _copy_as_clone(graph, n)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()

    leaf_meta = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in leaves]
    signature = ir.GraphSignature(param_names=param_names, buffer_names=buffer_names,
                                  batch_spec=spec, batch_leaf_meta=leaf_meta,
                                  mutated_buffers=mutated)
    log.debug("captured %d nodes (%d params, %d buffers, %d batch leaves)",
              len(graph.nodes), n_p, n_b, len(tensor_leaves))
    return gm, signature


def tag_backward(graph: torch.fx.Graph) -> None:
    """Backward nodes' module: that of the most recently computed forward value (or
    parameter) they consume, else that of the gradient flowing into them."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if n.op != "call_function" or n.meta[ir.REGION] != ir.BACKWARD:
            continue
        fwd_in = [a for a in n.all_input_nodes if a.meta.get(ir.REGION) == ir.FORWARD
                  and a.meta.get(ir.ROLE) != "batch"]
        bwd_in = [a for a in n.all_input_nodes if a.meta.get(ir.REGION) == ir.BACKWARD]
        named = ([a for a in fwd_in if a.meta.get(ir.MODULE)]
                 or [a for a in bwd_in if a.meta.get(ir.MODULE)])
        src = max(named or fwd_in or bwd_in, key=order.__getitem__, default=None)
        n.meta[ir.MODULE] = src.meta.get(ir.MODULE, "") if src is not None else ""


def _drop_empty_cat_inputs(graph, n) -> None:
    """cat([torch.tensor([]), x], dim) is x: torch's cat skips 1-D empty inputs (a legacy rule
    that Hugging Face's KV cache relies on: it starts as an empty tensor). No sharding rule
    can place such an input, so the cat goes without it."""
    tensors, *rest = n.args
    keep = [t for t in tensors if not (isinstance(t, torch.fx.Node) and _is_legacy_empty(t))]
    dtype = n.meta["val"].dtype
    if len(keep) == len(tensors) or not keep or any(  # (the empty one may promote the dtype)
            t.meta["val"].dtype != dtype for t in keep):
        return
    if len(keep) == 1:
        with graph.inserting_before(n):
            copy = graph.call_function(aten.clone.default, (keep[0],),
                                       {"memory_format": torch.contiguous_format})  # as cat
        copy.meta.update(n.meta)
        n.replace_all_uses_with(copy)
        graph.erase_node(n)
    else:
        n.args = (keep, *rest)


def _as_strided_as_view(graph, n) -> None:
    """as_strided / as_strided_scatter that only re-view a whole dense tensor (offset 0, the
    dense strides of the new shape) become view ops. Functionalization emits them for
    in-place view ops (squeeze_, a pooling layer's re-strided output); no sharding rule
    exists for as_strided, while a view's is exact."""
    if n.target is aten.as_strided.default:
        x, size, stride, *offset = n.args
        src = x
    else:
        x, src, size, stride, *offset = n.args
    if (offset and offset[0]) or n.kwargs:
        return
    xv, sv = x.meta.get("val"), src.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(sv, torch.Tensor)) or \
            not _dense(size, stride) or xv.numel() != _numel(size) or \
            not xv.is_contiguous() or xv.storage_offset() != 0 or sv.numel() != xv.numel():
        return
    with graph.inserting_before(n):
        if n.target is aten.as_strided.default:
            new = graph.call_function(aten.view.default, (x, list(size)))
        else:  # the whole base overwritten by src, laid out densely in `size`
            dense = graph.call_function(aten.clone.default, (src,),
                                        {"memory_format": torch.contiguous_format})
            dense.meta.update(n.meta)
            dense.meta["val"] = sv.clone(memory_format=torch.contiguous_format)
            new = graph.call_function(aten.view.default, (dense, list(xv.shape)))
    new.meta.update(n.meta)
    n.replace_all_uses_with(new)
    graph.erase_node(n)


def _copy_as_clone(graph, n) -> None:
    """A functional copy(dst, src) is src broadcast to dst's shape and cast to its dtype; dst
    gives only the layout, which no later op depends on in a functional graph. DTensor has
    no rule for copy; expand / clone / _to_copy shard like their input."""
    dst, src = n.args[:2]
    dv, sv = dst.meta.get("val"), src.meta.get("val")
    if n.kwargs or not (isinstance(dv, torch.Tensor) and isinstance(sv, torch.Tensor)) or \
            dv.device != sv.device:
        return
    try:
        if torch.broadcast_shapes(dv.shape, sv.shape) != dv.shape:
            return
    except RuntimeError:
        return
    with graph.inserting_before(n):
        x = src
        if sv.shape != dv.shape:
            x = graph.call_function(aten.expand.default, (src, list(dv.shape)))
            x.meta.update(n.meta)
            x.meta["val"] = sv.expand(dv.shape)
        if sv.dtype != dv.dtype:
            new = graph.call_function(aten._to_copy.default, (x,), {
                "dtype": dv.dtype, "memory_format": torch.contiguous_format})
        else:
            new = graph.call_function(aten.clone.default, (x,),
                                      {"memory_format": torch.contiguous_format})
    new.meta.update(n.meta)
    n.replace_all_uses_with(new)
    graph.erase_node(n)


def _numel(size) -> int:
    out = 1
    for d in size:
        out *= d
    return out


def _dense(size, stride) -> bool:
    """Whether `stride` lays out `size` densely in row-major order (size-1 dims: any)."""
    expect = 1
    for d, st in zip(reversed(list(size)), reversed(list(stride))):
        if d != 1 and st != expect:
            return False
        expect *= d
    return True


def _is_legacy_empty(node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 0

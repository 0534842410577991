"""The hand-written kernels as graph-node targets, with the ATen ops they replace.

A `KernelCall` has the calling convention of the op (or pattern) it stands for, runs the
reference ATen code on fake/meta tensors (shape propagation never launches a kernel) and the
Triton kernel on real ones. `supports` takes graph nodes or tensors and says why a kernel does
not apply (None when it does), so the fusion pass can leave such ops alone.
"""
from __future__ import annotations

import logging

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxpar.kernels import attention, cross_entropy as ce, layernorm, rmsnorm, softmax
from fxpar.kernels.jit import is_fake

aten = torch.ops.aten
log = logging.getLogger(__name__)


def _vals(args, kwargs):
    return pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), (args, kwargs))


class KernelCall:
    def __init__(self, name, kernel_fn, reference_fn, supports_fn):
        self.name = self.__name__ = name
        self.__module__ = "fxpar.kernels.library"
        self.kernel, self.reference, self._supports = kernel_fn, reference_fn, supports_fn
        self.launched: set = set()       # (shapes, dtypes, device) that ran fine once
        self.fallback: str | None = None  # why this kernel runs as its ATen ops instead
        self.layouts: list | None = None  # set by for_node: the node's output layouts
        self._ran_on: str | None = None  # bound to a node (fixed shapes): it ran on this device
        self.key: tuple | None = None  # where this module keeps it (`_kernel`), set below

    def supports(self, *args, **kwargs) -> str | None:
        args, kwargs = _vals(args, kwargs)
        return self._supports(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        a0 = args[0] if args else None
        if self._ran_on is not None and isinstance(a0, torch.Tensor) and \
                a0.device.type == self._ran_on and not is_fake(a0):
            return self.kernel(*args, **kwargs)  # a node's call after its first launch
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_fake(t) for t in tensors) or self.fallback:
            return self.reference(*args, **kwargs)
        key = tuple((tuple(t.shape), t.dtype, t.device.type) for t in tensors)
        if key in self.launched:
            out = self.kernel(*args, **kwargs)
        else:
            try:  # the first launch per layout compiles (on a GPU): a failure must not end
                out = self.kernel(*args, **kwargs)  # training
            except Exception as e:  # noqa: BLE001
                self.fallback = f"{type(e).__name__}: {e}"
                log.warning("kernel %s could not be built, running ATen instead: %s",
                            self.name, self.fallback)
                return self.reference(*args, **kwargs)
            self.launched.add(key)
        if self.layouts is not None and isinstance(a0, torch.Tensor):
            self._ran_on = a0.device.type  # bound by for_node: the trace fixes its shapes
        return out

    def __repr__(self):
        return f"<kernel {self.name}>"

    def __reduce__(self):
        # (by where this module keeps it, and the layouts it is bound to: its functions
        # include closures; the process loading it, a rank of the same job, has the same)
        if self.key is None:
            raise TypeError(f"{self!r} is not one of fxpar.kernels.library's kernels")
        return _kernel, (self.key, self.layouts)

    def __copy__(self):  # (one kernel, its caches shared: not a re-bound copy)
        return self

    def __deepcopy__(self, memo):
        return self

    def for_node(self, node: torch.fx.Node) -> "KernelCall":
        """A copy bound to one graph node: its tensor results are given the shapes and
        strides the node's meta["val"] promises (later views and transfers rely on them)."""
        return self._bound([
            (tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else None
            for v in (node.meta["val"] if isinstance(node.meta["val"], (tuple, list))
                      else [node.meta["val"]])])

    def _bound(self, layouts: list) -> "KernelCall":
        bound = KernelCall(self.name, self.kernel, self.reference, self._supports)
        bound.launched, bound.layouts, bound.key = self.launched, layouts, self.key
        inner = bound.kernel

        def conformed(*args, **kwargs):
            out = inner(*args, **kwargs)
            many = isinstance(out, (tuple, list))
            fixed = [_conform(t, lay) for t, lay in zip(out if many else [out], bound.layouts)]
            return tuple(fixed) if many else fixed[0]
        bound.kernel = conformed
        return bound


def _conform(t, layout):
    """t with the promised (shape, stride): copied if its strides differ, zero-padded if the
    op promises a longer buffer (efficient attention pads its logsumexp to 32 queries)."""
    if not isinstance(t, torch.Tensor) or layout is None:
        return t
    shape, stride = layout
    if tuple(t.shape) == shape and tuple(t.stride()) == stride:
        return t
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    if tuple(t.shape) != shape:
        out.zero_()
    out[tuple(slice(0, n) for n in t.shape)].copy_(t)
    return out


# --- single ops: same signature as the ATen op ------------------------------------------------

def _sdpa(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return attention.flash_attention_forward(q, k, v, is_causal, scale)


def _sdpa_supports(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if dropout_p:
        return "attention dropout (masks come from torch's generator)"
    if attn_mask is not None:
        return "explicit attention mask"
    return attention.supports(q, k, v, is_causal)


def _sdpa_bw(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None,
             scale=None):
    return attention.flash_attention_backward(grad_out, q, k, v, out, lse, is_causal, scale)


def _sdpa_bw_supports(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *,
                      attn_mask=None, scale=None):
    return _sdpa_supports(q, k, v, dropout_p, is_causal, attn_mask=attn_mask)


def _safe_softmax(x, dim, dtype=None):
    return softmax.softmax_forward(x, dim, safe=True)


def _safe_softmax_supports(x, dim, dtype=None):
    return "dtype conversion" if dtype is not None else softmax.supports(x, dim)


# CUDA's attention ops (what a trace on a GPU records): the same kernels, the op's signature.
# Forward and backward are swapped together (the same supports() conditions), so the
# logsumexp only ever travels between our own two kernels. On CUDA tensors they are not
# swapped: ATen's flash / memory-efficient / cuDNN kernels are fused already (the same bytes)
# and were faster on an H100 (docs/benchmarks.md, "GPU"): the swap is kept for traces whose
# tensors live elsewhere (CPU tensors in Triton's interpreter, where the tests check it).
CUDA_ATTENTION_KEPT = ("ATen's CUDA attention kernel is already fused (same bytes) and ran "
                       "faster than fxpar's Triton flash kernel on an H100 (0.6x in bf16, "
                       "~30x slower in fp32)")


def _cuda_attention_kept(q):
    return CUDA_ATTENTION_KEPT if q.device.type == "cuda" else None

def _flash_cuda(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                scale=None):
    out, lse = attention.flash_attention_forward(q, k, v, is_causal, scale)
    u64 = dict(dtype=torch.uint64, device=q.device)
    return (out, lse, None, None, q.shape[2], k.shape[2], torch.empty(2, **u64),
            torch.empty((), **u64), torch.empty(0, dtype=q.dtype, device=q.device))


def _flash_cuda_supports(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                         scale=None):
    return "debug mask" if return_debug_mask else (
        _cuda_attention_kept(q) or _sdpa_supports(q, k, v, dropout_p, is_causal))


def _flash_cuda_bw(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p,
                   is_causal, seed, offset, *, scale=None):
    return attention.flash_attention_backward(grad_out, q, k, v, out, lse, is_causal, scale)


def _flash_cuda_bw_supports(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p,
                            is_causal, seed, offset, *, scale=None):
    return _cuda_attention_kept(q) or _sdpa_supports(q, k, v, dropout_p, is_causal)


def _efficient_cuda(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                    scale=None):
    out, lse = attention.flash_attention_forward(q, k, v, is_causal, scale)
    i64 = dict(dtype=torch.int64, device=q.device)
    return out, lse, torch.zeros((), **i64), torch.zeros((), **i64)


def _efficient_cuda_supports(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                             is_causal=False, *, scale=None):
    return _cuda_attention_kept(q) or _sdpa_supports(q, k, v, dropout_p, is_causal,
                                                     attn_mask=attn_bias)


def _efficient_cuda_bw(grad_out, q, k, v, attn_bias, out, lse, seed, offset, dropout_p,
                       grad_input_mask, is_causal=False, *, scale=None):
    lse = lse[..., :q.shape[2]]  # the op's buffer is padded to a multiple of 32 queries
    return (*attention.flash_attention_backward(grad_out, q, k, v, out, lse, is_causal, scale),
            None)


def _efficient_cuda_bw_supports(grad_out, q, k, v, attn_bias, out, lse, seed, offset,
                                dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    return _cuda_attention_kept(q) or _sdpa_supports(q, k, v, dropout_p, is_causal,
                                                     attn_mask=attn_bias)


SINGLE_OP = {
    aten._softmax.default: KernelCall(
        "softmax", softmax.softmax_forward, aten._softmax.default,
        lambda x, dim, half_to_float: softmax.supports(x, dim)),
    aten._safe_softmax.default: KernelCall(
        "softmax", _safe_softmax, aten._safe_softmax.default, _safe_softmax_supports),
    aten._softmax_backward_data.default: KernelCall(
        "softmax_backward", softmax.softmax_backward, aten._softmax_backward_data.default,
        lambda g, out, dim, input_dtype: softmax.supports(out, dim)),
    aten.native_layer_norm.default: KernelCall(
        "layer_norm", layernorm.layer_norm_forward, aten.native_layer_norm.default,
        lambda x, shape, w, b, eps: layernorm.supports(x, shape)),
    aten.native_layer_norm_backward.default: KernelCall(
        "layer_norm_backward", layernorm.layer_norm_backward,
        aten.native_layer_norm_backward.default,
        lambda g, x, shape, mean, rstd, w, b, mask: layernorm.supports(x, shape)),
    aten._scaled_dot_product_flash_attention_for_cpu.default: KernelCall(
        "flash_attention", _sdpa, aten._scaled_dot_product_flash_attention_for_cpu.default,
        _sdpa_supports),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: KernelCall(
        "flash_attention_backward", _sdpa_bw,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default, _sdpa_bw_supports),
    aten._scaled_dot_product_flash_attention.default: KernelCall(
        "flash_attention", _flash_cuda, aten._scaled_dot_product_flash_attention.default,
        _flash_cuda_supports),
    aten._scaled_dot_product_flash_attention_backward.default: KernelCall(
        "flash_attention_backward", _flash_cuda_bw,
        aten._scaled_dot_product_flash_attention_backward.default, _flash_cuda_bw_supports),
    aten._scaled_dot_product_efficient_attention.default: KernelCall(
        "flash_attention", _efficient_cuda, aten._scaled_dot_product_efficient_attention.default,
        _efficient_cuda_supports),
    aten._scaled_dot_product_efficient_attention_backward.default: KernelCall(
        "flash_attention_backward", _efficient_cuda_bw,
        aten._scaled_dot_product_efficient_attention_backward.default,
        _efficient_cuda_bw_supports),
}


# --- patterns the fusion pass rewrites --------------------------------------------------------

def _ce_reference(logits, target, reduction, ignore_index, upcast=False):
    logits = logits.float() if upcast else logits
    ls = aten._log_softmax.default(logits, 1, False)
    loss, total_weight = aten.nll_loss_forward.default(ls, target, None, reduction, ignore_index)
    return loss, total_weight, aten.logsumexp.default(logits.float(), [1])


def _ce_bw_reference(grad_loss, logits, lse, target, reduction, ignore_index, total_weight,
                     upcast=False, grad_dtype=None):
    logits = logits.float() if upcast else logits
    ls = (logits.float() - lse[:, None]).to(logits.dtype)
    g = aten.nll_loss_backward.default(grad_loss, ls, target, None, reduction, ignore_index,
                                       total_weight)
    dx = aten._log_softmax_backward_data.default(g, ls, 1, logits.dtype)
    return dx if grad_dtype is None else dx.to(grad_dtype)


# (upcast, grad_dtype: the kernels read half-precision logits where the graph held their
# fp32 copy, and write the gradient in half where the graph cast it down: fusion.py)
cross_entropy_forward = KernelCall(
    "cross_entropy", ce.cross_entropy_forward, _ce_reference,
    lambda logits, target, *_: ce.supports(logits, target))
cross_entropy_backward = KernelCall(
    "cross_entropy_backward", ce.cross_entropy_backward, _ce_bw_reference,
    lambda *a: ce.supports(a[1], a[3]))


# Inductor may hand the logits in any layout (a matmul output with padded rows): the kernels
# read rows at any stride, so no layout is imposed (the default would pin the traced strides)
_ANY_LAYOUT = (torch.Tag.flexible_layout,)


@torch.library.custom_op("fxpar::cross_entropy", mutates_args=(), tags=_ANY_LAYOUT)
def cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, reduction: int,
                     ignore_index: int, upcast: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cross-entropy kernel as an op: Inductor calls it from inside a compiled run (a
    fallback kernel), where a Python callable would end the run (one fuser: Inductor's,
    with fxpar's kernels as ops it calls). A kernel that cannot be built runs the ATen
    reference (KernelCall)."""
    loss, total_weight, lse = cross_entropy_forward(logits, target, reduction, ignore_index,
                                                    upcast)
    return loss, total_weight, lse


@cross_entropy_op.register_fake
def _(logits, target, reduction, ignore_index, upcast):
    return _ce_reference(logits, target, reduction, ignore_index, upcast)


@torch.library.custom_op("fxpar::cross_entropy_backward", mutates_args=(), tags=_ANY_LAYOUT)
def cross_entropy_backward_op(grad_loss: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                              target: torch.Tensor, reduction: int, ignore_index: int,
                              total_weight: torch.Tensor, upcast: bool,
                              grad_dtype: torch.dtype | None) -> torch.Tensor:
    """The cross-entropy backward kernel as an op (see cross_entropy_op)."""
    return cross_entropy_backward(grad_loss, logits, lse, target, reduction, ignore_index,
                                  total_weight, upcast, grad_dtype)


@cross_entropy_backward_op.register_fake
def _(grad_loss, logits, lse, target, reduction, ignore_index, total_weight, upcast,
      grad_dtype):
    dtype = grad_dtype or (torch.float32 if upcast else logits.dtype)
    return logits.new_empty(logits.shape, dtype=dtype)


def _rms_reference(x, w, eps):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * (x * r), r


rms_norm_forward = KernelCall(
    "rms_norm", rmsnorm.rms_norm_forward, _rms_reference,
    lambda x, w, eps: rmsnorm.supports(x, w))

for _op, _k in SINGLE_OP.items():
    _k.key = ("op", str(_op))
for _name in ("cross_entropy_forward", "cross_entropy_backward", "rms_norm_forward"):
    globals()[_name].key = ("attr", _name)


def _kernel(key: tuple, layouts: list | None) -> KernelCall:
    """The kernel `key` names (KernelCall.__reduce__), bound to `layouts` if it was."""
    kind, name = key
    base = next(k for op, k in SINGLE_OP.items() if str(op) == name) if kind == "op" \
        else globals()[name]
    return base if layouts is None else base._bound(layouts)

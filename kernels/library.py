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
from fxpar.kernels.codegen import is_fake

aten = torch.ops.aten
log = logging.getLogger("fxpar.kernels")


def _vals(args, kwargs):
    return pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), (args, kwargs))


class KernelCall:
    def __init__(self, name, kernel_fn, reference_fn, supports_fn):
        self.name = self.__name__ = name
        self.__module__ = "fxpar.kernels.library"
        self.kernel, self.reference, self._supports = kernel_fn, reference_fn, supports_fn
        self.launched: set = set()       # (shapes, dtypes, device) that ran fine once
        self.fallback: str | None = None  # why this kernel runs as its ATen ops instead

    def supports(self, *args, **kwargs) -> str | None:
        args, kwargs = _vals(args, kwargs)
        return self._supports(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_fake(t) for t in tensors) or self.fallback:
            return self.reference(*args, **kwargs)
        key = tuple((tuple(t.shape), t.dtype, t.device.type) for t in tensors)
        if key in self.launched:
            return self.kernel(*args, **kwargs)
        try:  # the first launch per layout compiles (on a GPU): a failure must not end training
            out = self.kernel(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self.fallback = f"{type(e).__name__}: {e}"
            log.warning("kernel %s could not be built, running ATen instead: %s", self.name,
                        self.fallback)
            return self.reference(*args, **kwargs)
        self.launched.add(key)
        return out

    def __repr__(self):
        return f"<kernel {self.name}>"


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
}


# --- patterns the fusion pass rewrites --------------------------------------------------------

def _ce_reference(logits, target, reduction, ignore_index):
    ls = aten._log_softmax.default(logits, 1, False)
    loss, total_weight = aten.nll_loss_forward.default(ls, target, None, reduction, ignore_index)
    return loss, total_weight, aten.logsumexp.default(logits.float(), [1])


def _ce_bw_reference(grad_loss, logits, lse, target, reduction, ignore_index, total_weight):
    ls = (logits.float() - lse[:, None]).to(logits.dtype)
    g = aten.nll_loss_backward.default(grad_loss, ls, target, None, reduction, ignore_index,
                                       total_weight)
    return aten._log_softmax_backward_data.default(g, ls, 1, logits.dtype)


cross_entropy_forward = KernelCall(
    "cross_entropy", ce.cross_entropy_forward, _ce_reference,
    lambda logits, target, reduction, ignore_index: ce.supports(logits, target))
cross_entropy_backward = KernelCall(
    "cross_entropy_backward", ce.cross_entropy_backward, _ce_bw_reference,
    lambda *a: ce.supports(a[1], a[3]))


def _rms_reference(x, w, eps):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * (x * r), r


rms_norm_forward = KernelCall(
    "rms_norm", rmsnorm.rms_norm_forward, _rms_reference,
    lambda x, w, eps: rmsnorm.supports(x, w))

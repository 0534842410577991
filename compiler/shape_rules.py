"""Shape rules (meta kernels) fxpar corrects where torch's is stricter than its kernels.

`aten._grouped_mm` (the expert matmul of Hugging Face MoE models, transformers' default
experts implementation) runs in fp32 and fp16 on CPU, but its meta kernel accepts only
bf16 ("Expected inputs of BF16 type"), so an fp32 MoE model could not even be traced. The
shape does not depend on the dtype: for the dtypes the CPU kernel takes, the output is made
by torch's own helper; every other case goes to torch's rule unchanged.
"""
from __future__ import annotations

import torch
import torch._meta_registrations as _meta
from torch._decomp import meta_table

aten = torch.ops.aten


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    if mat_a.dtype == mat_b.dtype and mat_a.dtype in (torch.float32, torch.float16) \
            and bias is None:
        return _meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs,
                                                      out_dtype or mat_a.dtype)
    return _torch_grouped_mm(mat_a, mat_b, offs, bias, out_dtype)


# torch registers its rule twice: as the dispatcher's Meta kernel (fake tensors outside the
# Python dispatcher) and as a Python kernel for the Meta key (taken while tracing). Both.
# Only shapes torch's rule rejects change (it raises for them), so other code is unaffected.
# A torch without grouped_mm (or without the helper) keeps its own rule.
_torch_grouped_mm = meta_table.get(getattr(getattr(aten, "_grouped_mm", None), "default", None))
if _torch_grouped_mm is not None and hasattr(_meta, "_create_grouped_mm_output_tensor"):
    _LIB = torch.library.Library("aten", "IMPL")  # kept alive: the registration lasts with it
    # torch < 2.13 refuses a second Python kernel for a key it has one for (its own rule
    # here) unless the key is forgotten first; 2.13 allows the override by default.
    getattr(torch.library, "_impls", set()).discard("aten/_grouped_mm/Meta")
    _LIB.impl("_grouped_mm", _grouped_mm, "Meta")
    _OP = aten._grouped_mm.default
    _OP.py_kernels.pop(torch._C.DispatchKey.Meta, None)
    _OP.py_impl(torch._C.DispatchKey.Meta)(_grouped_mm)
    _OP._dispatch_cache.clear()
